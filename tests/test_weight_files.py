"""Weight files read shard by shard (runs/weights.py; model_loading.empty_model and fill_shards): a hub id from its
folder in the Hugging Face cache, `.bin` files, gpt-oss's experts in MXFP4.

One process plays each rank of two in turn, on torch's fake process group (a group whose collectives carry
nothing, so no other process is started), which lets the test see every read: each rank reads at most its own
shards plus one tensor, and holds exactly its chunk of each weight as the whole-loading path loads it. Two real
processes load these folders in test_distributed.py's sharded-loading launch."""

import contextlib
import functools
import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist

import model_loading
import sharding
from runs import weights


# ----------------------------------------------------------------------------- ranks and reads


@contextlib.contextmanager
def as_rank(rank, world=2):
    """sharding.Dist of `rank` among `world` processes, on a fake process group in this process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        # a mesh named for the rank: FSDP2 caches meshes by their layout and names, and would hand rank 1 rank 0's
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(f"as_rank{rank}",))
        yield sharding.Dist(rank, rank, world, torch.device("cpu"), mesh)
    finally:
        dist.destroy_process_group()


class Reads:
    """Every tensor read from a weights file, [(name, bytes)]: through safetensors' safe_open (which
    torch.distributed.checkpoint's Hugging Face reader and runs/weights.py both call) and runs/weights.BinFile. A
    header's shapes and dtypes are not reads."""

    def __init__(self, monkeypatch):
        import safetensors
        self.log = []
        real_open, real_bin = safetensors.safe_open, weights.BinFile
        monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: _Handle(real_open(*a, **k), self.log))
        monkeypatch.setattr(weights, "BinFile", lambda f: _Handle(real_bin(f), self.log))


class _Handle:
    def __init__(self, handle, log):
        self.handle, self.log = handle, log

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def __getattr__(self, name):  # keys(), metadata()
        return getattr(self.handle, name)

    def get_slice(self, name):
        return _Slice(self.handle.get_slice(name), name, self.log)

    def get_tensor(self, name):
        t = self.handle.get_tensor(name)
        self.log.append((name, t.nbytes))
        return t


class _Slice:
    def __init__(self, s, name, log):
        self.s, self.name, self.log = s, name, log

    def __getattr__(self, name):  # get_shape(), get_dtype(); a .bin tensor's shape and dtype
        return getattr(self.s, name)

    def __getitem__(self, index):
        t = self.s[index]
        self.log.append((self.name, t.nbytes))
        return t


def load_as_ranks(folder, monkeypatch, world=2, adapt=None, seed=0, **kwargs):
    """[(this rank's shards {name: tensor}, the bytes it read, the largest tensor's bytes)] for each rank, the
    policy built on meta (`adapt`ed there: LoRA's adapters), sharded as the trainer does and filled from the
    folder's files, the global random generator seeded with `seed` before each rank's load."""
    import torch.distributed.checkpoint as dcp
    # the fake group's collectives carry nothing: each rank plans its reads alone, as it does in a real group
    monkeypatch.setattr(dcp, "load", functools.partial(dcp.load, no_dist=True))
    reads = Reads(monkeypatch)
    stored = weights.tensors(folder)
    largest = max(torch.Size(s).numel() * d.itemsize for s, d, _ in stored.values())
    out = []
    for rank in range(world):
        with as_rank(rank, world) as d:
            torch.manual_seed(seed)
            empty, why = model_loading.empty_model(folder, kwargs, adapt=adapt)
            assert why is None, why
            root = sharding.shard(sharding.Root(empty), d, "fp32")
            reads.log.clear()
            model_loading.fill_shards(root, folder, "cpu")
            out.append(({n: p.to_local().clone() for n, p in root.lm.named_parameters()},
                        sum(b for _, b in reads.log), largest))
    return out


def stored_bytes(folder):
    return sum(torch.Size(s).numel() * d.itemsize for s, d, _ in weights.tensors(folder).values())


def check_shards(folder, whole, monkeypatch, world=2, adapt=None):
    """Each rank holds exactly its dim-0 chunk of every weight of `whole` (the whole-loading path's model) and read
    at most its share of the files' bytes plus one tensor."""
    total = stored_bytes(folder)
    want = dict(whole.named_parameters())
    for rank, (shards, read, largest) in enumerate(load_as_ranks(folder, monkeypatch, world, adapt)):
        assert shards.keys() == want.keys()
        for n, mine in shards.items():
            assert torch.equal(mine, torch.chunk(want[n].detach(), world)[rank]), (n, rank)
        assert 0 < read <= total / world + largest, (rank, read, total, largest)


def save(path, model, tokenizer):
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def tiny_qwen2(seed=0, **overrides):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    tokenizer = model_loading.build_byte_tokenizer()
    return AutoModelForCausalLM.from_config(model_loading.tiny_config(tokenizer, **overrides)), tokenizer


# ----------------------------------------------------------------------------- a hub id


def fake_cache(cache, repo, folder, files=None, revision="0123abcd" * 5):
    """The Hugging Face cache's layout for `repo` holding `folder`'s files (or those named): blobs, a snapshot of
    links to them, refs/main naming the snapshot; returns the snapshot folder."""
    root = os.path.join(cache, "models--" + repo.replace("/", "--"))
    snapshot = os.path.join(root, "snapshots", revision)
    os.makedirs(snapshot, exist_ok=True)
    os.makedirs(os.path.join(root, "blobs"), exist_ok=True)
    os.makedirs(os.path.join(root, "refs"), exist_ok=True)
    for i, f in enumerate(sorted(files or os.listdir(folder))):
        blob = os.path.join(root, "blobs", f"{i:040x}")
        shutil.copy(os.path.join(folder, f), blob)
        os.symlink(os.path.relpath(blob, snapshot), os.path.join(snapshot, f))
    with open(os.path.join(root, "refs", "main"), "w") as f:
        f.write(revision)
    return snapshot


def test_a_hub_id_loads_shard_by_shard_from_its_cached_folder(tmp_path, monkeypatch):
    """A hub id whose files are in the Hugging Face cache (HF_HUB_CACHE, offline) is its snapshot folder, read
    shard by shard like any folder; one whose cache holds the config alone (as --plan leaves it) stays a hub id
    and loads whole, saying why in one line."""
    import huggingface_hub
    cache = str(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", cache)  # read when huggingface_hub was imported
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    folder = save(tmp_path / "saved", *tiny_qwen2(tie_word_embeddings=False))
    snapshot = fake_cache(cache, "org/tiny", folder)
    assert model_loading.model_folder("org/tiny") == snapshot
    assert model_loading.model_folder("org/tiny", {"revision": os.path.basename(snapshot)}) == snapshot
    check_shards(snapshot, model_loading.load_model(folder), monkeypatch)
    fake_cache(cache, "org/config-only", folder, files=["config.json"])
    assert model_loading.model_folder("org/config-only") == "org/config-only"
    assert model_loading.model_folder("org/absent") == "org/absent"
    _, why = model_loading.empty_model("org/config-only")
    assert "not all in the Hugging Face cache" in why and "hf download org/config-only" in why


# ----------------------------------------------------------------------------- .bin weights


def save_bin(path, model, tokenizer, parts=1):
    """A folder of `.bin` weights as transformers 4 wrote them (torch.save of the state dict, `parts` files and an
    index when more than one): transformers 5 writes safetensors only."""
    save(path, model, tokenizer)
    os.remove(os.path.join(path, "model.safetensors"))
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"
             or not model.config.tie_word_embeddings}
    names = sorted(state)
    if parts == 1:
        torch.save(state, os.path.join(path, weights.BIN_WEIGHTS))
        return str(path)
    weight_map = {}
    for i in range(parts):
        f = f"pytorch_model-{i + 1:05d}-of-{parts:05d}.bin"
        torch.save({k: state[k] for k in names[i::parts]}, os.path.join(path, f))
        weight_map.update({k: f for k in names[i::parts]})
    with open(os.path.join(path, weights.BIN_INDEX), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    torch.save({"not": "weights"}, os.path.join(path, "training_args.bin"))  # a Trainer's, beside the weights
    return str(path)


@pytest.mark.parametrize("parts,tied", [(1, True), (2, False)])
def test_bin_weights_are_read_lazily_shard_by_shard(tmp_path, monkeypatch, parts, tied):
    """`.bin` weights (one file, or several and their index) are mapped from disk and read a rank's rows at a
    time: each rank holds its chunk of the weights the safetensors copy of the same model loads to."""
    model, tokenizer = tiny_qwen2(tie_word_embeddings=tied)
    safe = model_loading.load_model(save(tmp_path / "safe", model, tokenizer))
    folder = save_bin(tmp_path / "bin", model, tokenizer, parts)
    assert not any(f.endswith(".safetensors") for f in os.listdir(folder))
    check_shards(folder, safe, monkeypatch)


def test_old_format_bin_weights_load_whole_and_say_how_to_convert(tmp_path):
    """A `.bin` file in torch.save's old (not zip) format cannot be mapped: such a folder loads whole, and why
    names the conversion command."""
    model, tokenizer = tiny_qwen2()
    folder = save_bin(tmp_path / "old", model, tokenizer)
    torch.save(torch.load(os.path.join(folder, weights.BIN_WEIGHTS)), os.path.join(folder, weights.BIN_WEIGHTS),
               _use_new_zipfile_serialization=False)
    empty, why = model_loading.empty_model(folder)
    assert empty is None and "old format" in why and f"save_pretrained('{folder}-safetensors')" in why
    assert "\n" not in why
    whole = model_loading.load_model(folder)
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), model.state_dict().values()))


# ----------------------------------------------------------------------------- gpt-oss's MXFP4 experts

FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # the E2M1 values of codes 0-7; 8-15 are their negatives


def to_mxfp4(w):
    """(blocks, scales) of a fused expert tensor `w` (E, in, out), by the OCP MX format's definition as gpt-oss
    stores it: along `in`, blocks of 32 values share a power of two 2^(scale - 127), the smallest that brings their
    largest magnitude to at most 6, and each value is the nearest 4-bit float, two to a byte (low nibble first)."""
    experts, n_in, n_out = w.shape
    x = w.transpose(1, 2).reshape(experts, n_out, n_in // 32, 32)
    exponent = torch.ceil(torch.log2(x.abs().amax(-1).clamp_min(1e-30) / 6))
    scaled = x / torch.exp2(exponent)[..., None]
    codes = (scaled.abs()[..., None] - FP4).abs().argmin(-1) + 8 * (scaled < 0)
    blocks = (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)


def save_mxfp4(path):
    """A tiny gpt-oss folder as gpt-oss is published: its experts in MXFP4 (`*_blocks`, `*_scales`) beside the other
    weights, and quantization_config {quant_method: mxfp4} in its config. Returns (folder, the unquantized model)."""
    import architectures
    from safetensors.torch import load_file, save_file
    model, tokenizer = architectures.tiny("gpt_oss")
    save(path, model, tokenizer)
    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        state[name + "_blocks"], state[name + "_scales"] = to_mxfp4(state.pop(name))
    save_file(state, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                      "model.embed_tokens", "lm_head"]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path), model


def test_mxfp4_experts_are_dequantized_shard_by_shard_as_transformers_does(tmp_path, monkeypatch):
    """gpt-oss's MXFP4 checkpoint: each rank reads its own experts' blocks and scales and dequantizes them with
    transformers' convert_moe_packed_tensors, holding its chunk of what transformers' own dequantizing load gives
    (the whole-loading path); the model's config no longer claims MXFP4 weights, so its export is plain."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    folder, original = save_mxfp4(tmp_path / "mxfp4")
    assert model_loading.checkpoint_quantization(folder) == "mxfp4"  # what the line after loading names
    whole = model_loading.load_model(folder)  # from_pretrained with Mxfp4Config(dequantize=True)
    assert getattr(whole.config, "quantization_config", None) is None
    stored = load_file(os.path.join(folder, "model.safetensors"))
    name = "model.layers.1.mlp.experts.down_proj"
    deq = convert_moe_packed_tensors(stored[name + "_blocks"], stored[name + "_scales"], dtype=torch.float32)
    assert torch.equal(whole.get_parameter(name), deq)
    ref = original.get_parameter(name)
    assert (deq - ref).norm() < 0.2 * ref.norm()  # the writer above quantizes as the format defines
    check_shards(folder, whole, monkeypatch)
    empty, _ = model_loading.empty_model(folder)
    assert getattr(empty.config, "quantization_config", None) is None


@pytest.mark.parametrize("method", ["fp8", "bitsandbytes"])
def test_other_quantizations_are_refused_in_one_line(tmp_path, method):
    model, tokenizer = tiny_qwen2()
    folder = save(tmp_path / method, model, tokenizer)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": method}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    for load in (model_loading.load_model, model_loading.empty_model):
        with pytest.raises(ValueError, match=f"quant_method '{method}' is not supported") as e:
            load(folder)
        assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- LoRA


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_lora_adapters_load_shard_by_shard_as_on_the_whole_model(tmp_path, monkeypatch, family):
    """LoRA's adapters added to the model on meta before sharding (every linear layer of the decoder, and a MoE
    model's fused experts through a parametrization): each rank reads at most its share of the files plus one
    tensor, as without adapters, and holds exactly its chunk of every base weight and of every adapter as
    add_lora gives them on the whole model from the same seed (A drawn in add_lora's order, B zero)."""
    import architectures
    from layers import lora
    model, tokenizer = tiny_qwen2(tie_word_embeddings=False) if family == "qwen2" else architectures.tiny(family)
    folder = save(tmp_path / family, model, tokenizer)
    adapt = functools.partial(lora.add_lora, rank=4, alpha=8, target_modules="all")
    whole = model_loading.load_model(folder)
    torch.manual_seed(0)
    adapted = adapt(whole)
    assert any(".experts." in n for n in adapted) == (family == "qwen3_moe")
    adapters = [n for n, _ in whole.named_parameters() if n.endswith(("lora_A", "lora_B"))]
    assert len(adapters) == 2 * len(adapted)
    assert all(whole.get_parameter(n).abs().sum() > 0 for n in adapters if n.endswith("lora_A"))
    check_shards(folder, whole, monkeypatch, adapt=adapt)


# ----------------------------------------------------------------------------- vision-language models


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_vision_language_models_load_shard_by_shard(tmp_path, monkeypatch, family):
    """A vision-language model's language model and vision tower read shard by shard: a Qwen2.5-VL checkpoint names
    its language model `model.layers.*` and its vision tower `visual.*` (renamed by transformers as it loads them,
    here by its own rules), a Qwen3-VL one names them as the model holds them. Each rank holds exactly its chunk of
    every weight as the whole-loading path loads it, and read at most its share of the files plus one tensor."""
    import test_vision
    model, tokenizer, _ = test_vision.tiny_vl(family)
    folder = save(tmp_path / family, model, tokenizer)
    stored = weights.tensors(folder)
    assert any(n.startswith("visual.") for n in stored) == (family == "qwen2_5_vl")
    whole = model_loading.load_model(folder)
    assert type(whole) is type(model)
    check_shards(folder, whole, monkeypatch)
