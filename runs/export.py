"""The trained policy written out as a Hugging Face folder (config, tokenizer, safetensors) that `from_pretrained`
loads, without any process holding the whole model.

Each tensor is gathered in turn from its shards on every rank (a collective, the same tensors in the same order on
every rank) and rank 0 writes it at its place in a safetensors file whose header it wrote first; then it is freed.
So a process holds its shards plus one whole tensor (and a LoRA merge's float32 rows, 64 MiB at a time), whatever
the model's size. The files, their names, the index of a model over 50 GB, the tensors' names and config.json are
what save_pretrained writes.

Chosen over two other ways, measured by `python -m bench --only export` (docs/memory.md, "Export"):
- each rank writing its own rows of every tensor into the files: no gather at all, but a family whose checkpoints
  keep another layout (a matrix per expert where the model holds one tensor for all) cuts its tensors by expert,
  not by rank's rows, and every rank must see the same filesystem;
- torch.distributed.checkpoint's Hugging Face writer: each rank writes its shards to files of its own, then one
  process copies them into whole tensors, so the model is written twice and takes twice its size on disk for a
  while, and the layouts and LoRA merges are still to do on top.
The cost of the one taken: rank 0 writes every byte (a disk is about as fast written by one process as by several).
"""

import json
import os
import shutil
import struct

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from torch.distributed.tensor import DTensor
from transformers.core_model_loading import revert_weight_conversion
from transformers.dynamic_module_utils import custom_object_save

import sharding
from layers import lora
from runs import disk

# save_pretrained's default: a model under 50 GB is one model.safetensors, a larger one several files and an index
MAX_SHARD_BYTES = 50 * 10**9
_MERGE_CHUNK_BYTES = 64 << 20  # a LoRA merge's float32 rows at a time: its transient beside the weight
_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
                       torch.float8_e5m2: "F8_E5M2"}


def _merge_rows(adapter, w, a, b):
    """W + scaling B A as layers/lora.py's merge computes it (in float32, back to W's dtype), a few rows of W at a
    time so that the float32 copies stay small beside W. `w` and `b` are the same rows of the weight and of B (an
    expert weight: the same experts of W, A and B); `a` is all of a LoRALinear's A."""
    out = torch.empty_like(w)
    rows = max(1, _MERGE_CHUNK_BYTES // max(1, 4 * w[0].numel())) if w.shape[0] else 1
    for i in range(0, w.shape[0], rows):
        a_rows = a[i:i + rows] if a.dim() == 3 else a
        out[i:i + rows] = (w[i:i + rows].float() + adapter.delta(a_rows.float(), b[i:i + rows].float())).to(w.dtype)
    return out


def _full_merged(adapter, w, a, b):
    """The merged weight, whole, in host memory (a collective when sharded). Sharded along dim 0 as FSDP2 shards,
    each rank merges its own rows (a LoRALinear's A, r x in, gathered whole; an expert weight's A and B shard by
    expert as W does) and the merged weight is gathered like any other: no process holds W twice."""
    if not hasattr(w, "device_mesh"):
        return _merge_rows(adapter, w, a, b).cpu()
    if sharding.dim0_mesh(w) is None:
        raise ValueError(f"export: a LoRA-adapted weight sharded as {w.placements}; the merge expects FSDP2's dim 0")
    a = a.full_tensor() if a.dim() == 2 else a.to_local()
    mine = _merge_rows(adapter, w.to_local(), a, b.to_local())
    merged = DTensor.from_local(mine, w.device_mesh, w.placements, run_check=False, shape=w.shape, stride=w.stride())
    return sharding.full_host_tensor(merged)


CHECK_ELEMENTS = 1 << 20  # the NaN check's elements at a time


def check_bytes(dtype):
    """The NaN check's temporaries for CHECK_ELEMENTS elements of `dtype`: isfinite computes x == x and |x| != inf,
    a copy of the absolute values and byte masks. Measured, 9 bytes an element for float32 and for bfloat16 alike
    (36 MiB at the 4M elements the check took at a time before, where its masks alone would be 8 MiB); a wider dtype
    is counted at its own width."""
    return CHECK_ELEMENTS * (max(4, dtype.itemsize) + 5)


def _non_finite(t):
    """How many NaN or inf a tensor holds, CHECK_ELEMENTS at a time (`check_bytes`: about 9 MiB beside it)."""
    if not t.is_floating_point():
        return 0
    flat, step = t.reshape(-1), CHECK_ELEMENTS
    return sum(int((~torch.isfinite(flat[i:i + step])).sum()) for i in range(0, flat.numel(), step))


def _export_plan(model, state_dict):
    """What the export writes, without reading a weight: [(key, lora, plain name, {name in the files: (shape,
    dtype)})] in the state dict's order. `key` is a tensor of `state_dict` (the model's names); `lora` is None or
    (adapter, key of A, key of B), folded into the weight it adapts; the right side is what the tensor becomes in
    the files, as save_pretrained names them. A tensor tied to an earlier one (the output embedding) is written
    once, as save_pretrained writes it and from_pretrained ties it again. A family whose checkpoints keep another
    layout (a matrix per expert where the model holds one tensor for all) is written in the checkpoint's:
    transformers' own reverse conversion, applied to each tensor alone."""
    adapters, skip = {}, set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    for name, adapter in lora.lora_modules(model).items():
        key, plain = lora._weight_keys(name, adapter)
        adapters[key] = ((adapter, f"{name}.lora_A", f"{name}.lora_B"), plain)
        skip |= {f"{name}.lora_A", f"{name}.lora_B"}
    owners = {}
    for name, p in model.named_parameters(remove_duplicate=False):  # tied weights: one parameter, several names
        if owners.setdefault(id(p), name) != name:
            skip.add(name)
    plan = []
    for key, t in state_dict.items():
        if key not in skip:
            merge, plain = adapters.get(key, (None, key))
            meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
            files = revert_weight_conversion(model, {plain: meta})
            plan.append((key, merge, plain, {n: (tuple(v.shape), v.dtype) for n, v in files.items()}))
    return plan


def _pwrite(fd, tensor, pos):
    """A tensor's bytes at `pos` of the file (os.pwrite writes at most about 2 GiB a call)."""
    view = memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy())
    while len(view):
        n = os.pwrite(fd, view, pos)
        view, pos = view[n:], pos + n


def _open_safetensors(path, tensors, where, fds):
    """Create a safetensors file with its header, every tensor's place fixed before any is written; `tensors` are
    meta tensors by name. The format: an 8-byte little-endian header length, the JSON header (dtype, shape, byte
    range of each tensor, spaces to 8 bytes), then the tensors' bytes, row-major, without holes. safetensors' own
    writer takes every tensor of a file at once, which is what the export avoids."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in tensors.items():
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"export: {name} is {t.dtype}, which safetensors does not store")
        n = t.dtype.itemsize * t.numel()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    fds.append(fd)
    os.write(fd, struct.pack("<Q", len(text)) + text)
    for name in tensors:
        where[name] = (fd, 8 + len(text) + header[name]["data_offsets"][0])


def _write_weights(model, folder, state_dict, max_shard_bytes):
    """The weights as save_pretrained writes them into `folder`, one tensor at a time; with `folder` None only the
    gathers, in step with the rank that writes. A failure on the writing rank is raised once every gather is done:
    the other ranks are waiting in them."""
    plan = _export_plan(model, state_dict)
    where, fds, problem, master = {}, [], None, folder is not None
    try:
        if master:
            try:
                _start_files(model, folder, plan, max_shard_bytes, where, fds)
            except Exception as e:
                problem = e
        for key, merge, plain, _ in plan:
            t = state_dict[key]  # on every rank, in the same order: a collective when sharded
            if merge is None:
                full = sharding.full_host_tensor(t)
            else:
                adapter, a, b = merge
                full = _full_merged(adapter, t, state_dict[a], state_dict[b])
            if not master or problem is not None:
                continue  # the other ranks, or after a failure: keep gathering in step with them, write nothing
            try:
                problem = _write_tensor(model, plain, full, where)
            except Exception as e:  # a full disk (...)
                problem = e
            del full
    finally:
        for fd in fds:
            os.close(fd)
    if problem is not None:
        raise problem


def _write_tensor(model, plain, full, where):
    """Write a whole tensor at its places in the files, in the checkpoint's layout (a family that keeps another one
    copies it there: a MoE layer's fused gate and up projections become two tensors); returns the problem that
    stops the export (a weight holding NaN or inf), else None. Its copies are freed on return, before the next
    tensor is gathered."""
    bad = _non_finite(full)
    if bad:
        return ValueError(f"weight '{plain}' holds {bad} NaN/inf values; not writing a broken model "
                          f"(resume from an earlier checkpoint, or lower the learning rate)")
    for n, piece in revert_weight_conversion(model, {plain: full}).items():
        _pwrite(where[n][0], piece, where[n][1])
    return None


def _start_files(model, folder, plan, max_shard_bytes, where, fds):
    """The files save_pretrained would write for these tensors, each created with its header, and the index when
    there are several; fills `where` ({name in the files: (fd, offset)}) and `fds`."""
    shapes = {n: torch.empty(s, dtype=dt, device="meta") for *_, out in plan for n, (s, dt) in out.items()}
    split = split_torch_state_dict_into_shards(shapes, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_bytes)
    for file, names in split.filename_to_tensors.items():
        _open_safetensors(os.path.join(folder, file), {n: shapes[n] for n in names}, where, fds)
    if split.is_sharded:
        index = {"metadata": {"total_parameters": model.num_parameters(), **split.metadata},
                 "weight_map": split.tensor_to_filename}
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _write_config(model, folder):
    """config.json and generation_config.json as save_pretrained writes them beside the weights."""
    model.config.dtype = str(model.dtype).removeprefix("torch.")
    model.config.architectures = [type(model).__name__.removeprefix("FSDP")]  # fully_shard renames the class
    if model.is_remote_code():
        custom_object_save(model, folder, config=model.config)
    model.config.save_pretrained(folder)
    if model.can_generate():
        model.generation_config.save_pretrained(folder)


def export_model(model, tokenizer, path, state_dict=None, image_processor=None, master=True,
                 max_shard_bytes=MAX_SHARD_BYTES):
    """Save a Hugging Face folder (config, tokenizer, safetensors) that `from_pretrained` loads; returns `path`.

    Every rank of a sharded model calls it (each tensor is gathered in turn); only `master` writes. `state_dict`
    lets a caller pass whole tensors under the model's names instead of the model's own. LoRA adapters are merged
    into the weights they adapt. Weights holding NaN or inf are refused. The folder is written beside `path` and
    renamed into place, so a run killed mid-export leaves the previous export (or none), never half of one; a
    write the storage refuses (a full disk, ...) removes the partial folder and raises disk.WriteError.
    """
    if state_dict is None:
        state_dict = model.state_dict()
    if not master:
        _write_weights(model, None, state_dict, max_shard_bytes)
        return path
    path = os.path.normpath(path)
    parent, base = os.path.split(os.path.abspath(path))
    # fixed names from the process id (not mkdtemp, whose 0700 folder would become the export's permissions)
    tmp = os.path.join(parent, f".{base}.partial-{os.getpid()}")
    aside = os.path.join(parent, f".{base}.old-{os.getpid()}")
    made = False
    try:
        try:
            if os.path.exists(path) and not os.path.isdir(path):
                raise ValueError(f"export: '{path}' exists and is not a folder")
            os.makedirs(parent, exist_ok=True)
            for stale in os.listdir(parent):  # left by an export killed before its rename
                if stale.startswith(f".{base}.partial-"):
                    shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
            os.makedirs(tmp)
            made = True
        finally:  # also when the folder could not be made: the other ranks are gathering, rank 0 must take part
            _write_weights(model, tmp if made else None, state_dict, max_shard_bytes)
        _write_config(model, tmp)
        tokenizer.save_pretrained(tmp)
        if image_processor is not None:  # a vision-language model's: the export reads images as training did
            image_processor.save_pretrained(tmp)
    except BaseException as e:
        if not made:
            raise
        # a full disk (...) is one line; safetensors and torch may have wrapped its OSError: judged before the
        # partial folder is removed, while the disk is still as the write left it
        full = disk.check(e, path, "the exported model", then="the partial export was removed" + (
            f", the previous export in {path} is intact" if os.path.isdir(path) else ""))
        shutil.rmtree(tmp, ignore_errors=True)
        if full is not None:
            raise full from e
        raise
    # a folder cannot replace a non-empty folder in one rename: move the old one aside, then drop it
    shutil.rmtree(aside, ignore_errors=True)
    had_old = os.path.exists(path)
    if had_old:
        os.rename(path, aside)
    try:
        os.rename(tmp, path)
    except BaseException:
        if had_old:
            os.rename(aside, path)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in os.listdir(parent):  # ours, and any left by an export killed between its two renames
        if old.startswith(f".{base}.old-"):
            shutil.rmtree(os.path.join(parent, old), ignore_errors=True)
    return path
