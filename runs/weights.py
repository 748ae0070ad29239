"""A model's weight files: where they are, what they hold, and reading one process's rows of them.

A hub id's files, once downloaded, are a folder like any other: its snapshot in the Hugging Face cache
(`cached_folder`). A folder's tensors are listed from the files' headers (`tensors`): its safetensors files, else
its `.bin` files, which torch maps from disk (`BinFile`), so that a slice of either reads its own bytes and no
others. `fill_rows` fills this process's FSDP2 shard (its rows along dim 0) of each parameter that
torch.distributed.checkpoint's Hugging Face reader cannot: every tensor of `.bin` files (the reader reads
safetensors only), a MoE block's fused expert tensor stored a matrix per expert (Qwen2/3-MoE), and gpt-oss's
experts stored in MXFP4 (blocks and scales, dequantized with transformers' own function).

Imports nothing of the project (model_loading.py uses it).
"""

import json
import os

import torch

import sharding

BIN_WEIGHTS, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
SAFE_WEIGHTS, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"


# ----------------------------------------------------------------------------- where the files are

def cached_folder(repo_id, revision=None, cache_dir=None):
    """The snapshot folder of hub id `repo_id` in the Hugging Face cache (HF_HUB_CACHE, HF_HOME or `cache_dir`) at
    `revision` (the cache's refs/main when None), if it holds the config and every weight file; else None. Offline:
    the cache is read as it is, never updated."""
    from huggingface_hub import snapshot_download
    try:
        folder = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True)
    except (OSError, ValueError):  # not in the cache (LocalEntryNotFoundError is an OSError), or a bad name
        return None
    return folder if complete(folder) else None


def complete(folder):
    """Whether `folder` holds config.json and the weights from_pretrained reads (one file, or an index and every file
    it names): a download cut short, or a --plan that fetched the config alone, leaves less, and a folder without
    weights would load as a randomly initialised model."""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        return False
    for single, index in ((SAFE_WEIGHTS, SAFE_INDEX), (BIN_WEIGHTS, BIN_INDEX)):
        if os.path.isfile(os.path.join(folder, single)):
            return True
        if os.path.isfile(os.path.join(folder, index)):
            return all(os.path.isfile(os.path.join(folder, f)) for f in _indexed(folder, index))
    return False


def _indexed(folder, index):
    with open(os.path.join(folder, index)) as f:
        return sorted(set(json.load(f)["weight_map"].values()))


def weight_file_names(folder):
    """The files a folder's weights are read from: every safetensors file, else the `.bin` files from_pretrained
    reads (pytorch_model.bin, or those its index names; never a Trainer's training_args.bin); [] for none."""
    if not os.path.isdir(folder):
        return []
    names = sorted(os.listdir(folder))
    safe = [f for f in names if f.endswith(".safetensors")]
    if safe:
        return safe
    if BIN_INDEX in names:
        return _indexed(folder, BIN_INDEX)
    return [BIN_WEIGHTS] if BIN_WEIGHTS in names else []


# ----------------------------------------------------------------------------- what they hold

class BinFile:
    """A `.bin` weights file (torch.save's zip format) behind safetensors' reading interface (`keys`, `get_slice`,
    `get_tensor`). torch maps it from disk (`mmap=True`) and unpickles tensors only (`weights_only=True`): a
    tensor's rows are read from the file when they are copied, and no other bytes are."""

    def __init__(self, file):
        try:
            self.tensors = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            folder = os.path.dirname(file)
            raise ValueError(
                f"{file} is in torch.save's old format, which cannot be read a slice at a time (convert the folder "
                f"to safetensors: python -c \"from transformers import AutoModelForCausalLM as M; "
                f"M.from_pretrained('{folder}').save_pretrained('{folder}-safetensors')\")") from e

    def keys(self):
        return list(self.tensors)

    def get_slice(self, name):  # a tensor: indexing it is a view of the mapped file, copying the view reads it
        return self.tensors[name]

    def get_tensor(self, name):
        return self.tensors[name]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.tensors = None


def open_file(path):
    """A handle on one weights file with safetensors' reading interface."""
    if path.endswith(".safetensors"):
        from safetensors import safe_open
        return safe_open(path, "pt")
    return BinFile(path)


def tensors(folder):
    """{name: (shape, dtype, file)} of every tensor in a folder's weight files (`weight_file_names`), from the
    safetensors headers or the `.bin` files' pickles: no tensor's data is read. {} for a folder without weights."""
    from safetensors.torch import _getdtype

    found = {}
    for f in weight_file_names(folder):
        with open_file(os.path.join(folder, f)) as h:
            for k in h.keys():
                t = h.get_slice(k)
                if hasattr(t, "get_shape"):  # safetensors' slice: the header's shape and dtype
                    found[k] = (tuple(t.get_shape()), _getdtype(t.get_dtype()), f)
                else:  # a mapped tensor of a .bin file
                    found[k] = (tuple(t.shape), t.dtype, f)
    return found


# A MoE block's experts as transformers 5 holds them, one 3-D parameter for all of them, and as Qwen2/3-MoE
# checkpoints store them, a matrix per expert: fused parameter -> the per-expert weights stacked into it (each
# expert's row of the parameter is their concatenation along its first dimension)
FUSED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def per_expert(name, shape, files):
    """For a fused expert parameter `name` ("...experts.gate_up_proj", shape (E, out, in)) the files hold as a
    matrix per expert: ("experts", [[each of expert e's file names] for e in range(E)]); else None."""
    prefix, _, kind = name.rpartition(".")
    if not prefix.endswith(".experts") or kind not in FUSED_EXPERTS:
        return None
    parts = [[f"{prefix}.{e}.{part}.weight" for part in FUSED_EXPERTS[kind]] for e in range(shape[0])]
    if not all(n in files for names in parts for n in names):
        return None
    for names in parts:
        stacked = [files[n][0] for n in names]
        if any(len(s) != 2 or s[1] != shape[2] for s in stacked) or sum(s[0] for s in stacked) != shape[1]:
            return None
    return "experts", parts


def mxfp4(name, shape, files):
    """For a fused expert parameter `name` (shape (E, in, out), gpt-oss's) the files hold in MXFP4, as gpt-oss is
    published: ("mxfp4", blocks' name, scales' name); else None. The OCP MX format: `name_blocks` (E, out, in / 32,
    16) bytes, two 4-bit floats each, and `name_scales` (E, out, in / 32), one power of two (a biased exponent) per
    block of 32 values."""
    blocks, scales = name + "_blocks", name + "_scales"
    if blocks not in files or scales not in files or len(shape) != 3 or shape[1] % 32:
        return None
    experts, n_in, n_out = shape
    if files[blocks][0] != (experts, n_out, n_in // 32, 16) or files[scales][0] != (experts, n_out, n_in // 32):
        return None
    return "mxfp4", blocks, scales


# ----------------------------------------------------------------------------- reading one process's rows

def shard_rows(p):
    """(this process's shard of parameter `p`, the row of `p` it starts at): FSDP2 cuts dim 0 into chunks of
    ceil(n / W) rows, the last ones short or empty; a parameter that is not sharded is its own shard."""
    mine = p.to_local() if hasattr(p, "to_local") else p
    mesh = sharding.dim0_mesh(p)  # under HSDP, the ranks of this process's replica
    if mesh is None or mine.dim() == 0:
        return mine, 0
    return mine, mesh.get_local_rank() * -(-p.shape[0] // mesh.size())


def fill_rows(sources, files, folder):
    """Fill this process's rows of each parameter of `sources` ({name: (parameter, source)}) from the folder's
    files, reading those rows and no others: a source is ("tensor", stored name), ("experts", per_expert's
    names) or ("mxfp4", blocks, scales). The files' dtype is cast to the parameter's."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    handles = {}

    def handle(n):  # the open file that holds tensor n
        f = files[n][2]
        if f not in handles:
            handles[f] = open_file(os.path.join(folder, f))
        return handles[f]

    try:
        for name, (p, source) in sources.items():
            mine, first = shard_rows(p)
            kind, rows, total = source[0], mine.shape[0] if mine.dim() else 0, p.shape[0] if p.dim() else 0
            if rows and first + rows > total:
                raise ValueError(f"{name}: a shard of {rows} rows from row {first} of {total}")
            if kind == "tensor" and mine.dim() == 0:
                mine.copy_(handle(source[1]).get_tensor(source[1]))
            elif kind == "tensor":
                mine.copy_(handle(source[1]).get_slice(source[1])[first:first + rows])
            elif kind == "experts":  # an expert at a time: its matrices concatenated are its row
                for row, names in enumerate(source[1][first:first + rows]):
                    mine[row].copy_(torch.cat([handle(n).get_tensor(n) for n in names]))
            else:  # mxfp4: an expert at a time, dequantized by transformers in the parameter's dtype as its own
                # loading does (Mxfp4Dequantize); a 4-bit value times a power of two is exact in bf16 and fp32 alike
                _, blocks, scales = source
                for e in range(first, first + rows):
                    mine[e - first].copy_(convert_moe_packed_tensors(
                        handle(blocks).get_slice(blocks)[e:e + 1], handle(scales).get_slice(scales)[e:e + 1],
                        dtype=mine.dtype)[0])
    finally:
        handles.clear()
