"""LoRA: only adapters train, adapters off is the base model, the merged export is the adapted model."""

import copy
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpo  # noqa: E402

import logprobs  # noqa: E402
import sampling  # noqa: E402
import model_loading  # noqa: E402
from runs import export as run_export  # noqa: E402
from runs import setup as run_setup  # noqa: E402
from layers import lora  # noqa: E402
import train  # noqa: E402
from conftest import finished  # noqa: E402
from launches import export_differs  # noqa: E402

TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def _tiny(tmp_path, seed=0):
    path = model_loading.write_tiny_model(str(tmp_path / "tiny"))
    return model_loading.load_model(path, {"dtype": "float32", "attn_implementation": "sdpa"}, "cpu", seed=seed), \
        model_loading.load_tokenizer(path)


def _batch(tok, n=4, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    enc = tok(["a>", "hello there>", "b>", "xyz>"][:n], return_tensors="pt", padding=True, add_special_tokens=False)
    completion = torch.randint(0, 256, (n, T), generator=g)
    return torch.cat([enc.input_ids, completion], 1), torch.cat([enc.attention_mask, torch.ones_like(completion)], 1), T


def _train_steps(model, tok, steps=3, lr=1e-2):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    ids, mask, T = _batch(tok)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    for _ in range(steps):
        logp, _ = logprobs.completion_logprobs(model, ids, mask, T)
        (-(logp.sum(1) * adv).mean()).backward()
        opt.step()
        opt.zero_grad()


def test_add_lora_replaces_targets_and_freezes_the_rest(tmp_path):
    model, _ = _tiny(tmp_path)
    total = sum(p.numel() for p in model.parameters())
    replaced = lora.add_lora(model, rank=4, alpha=8, target_modules=TARGETS)
    assert len(replaced) == 2 * 7  # two layers, seven projections each
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    # parameter count: r * (in + out) per adapted layer, nothing else added
    h, i = model.config.hidden_size, model.config.intermediate_size
    kv = model.config.num_key_value_heads * (h // model.config.num_attention_heads)
    per_layer = 4 * ((h + h) + (h + kv) * 2 + (h + h) + (h + i) * 2 + (i + h))
    assert sum(p.numel() for n, p in model.named_parameters() if n in trainable) == 2 * per_layer
    assert sum(p.numel() for p in model.parameters()) == total + 2 * per_layer
    with pytest.raises(ValueError, match="lora_target_modules: 'nope' matches no linear layer"):
        lora.add_lora(_tiny(tmp_path)[0], 4, 8, "nope")


def test_default_targets_on_a_dense_model_are_its_seven_projections(tmp_path):
    from config import Config
    assert Config().lora_target_modules == lora.ALL_TARGETS
    everything = lora.add_lora(_tiny(tmp_path)[0], 4, 8, lora.ALL_TARGETS)
    assert sorted(everything) == sorted(lora.add_lora(_tiny(tmp_path)[0], 4, 8, TARGETS))
    model, _ = _tiny(tmp_path)
    lora.add_lora(model, 4, 8, lora.ALL_TARGETS)
    assert lora.lora_summary(model) == ("LoRA rank 4 on q_proj x2, k_proj x2, v_proj x2, o_proj x2, "
                                                 "gate_proj x2, up_proj x2, down_proj x2: 9,728 parameters")
    assert lora.lora_summary(_tiny(tmp_path)[0]) is None


def test_only_adapter_parameters_change(tmp_path):
    model, tok = _tiny(tmp_path)
    lora.add_lora(model, rank=4, alpha=8, target_modules=TARGETS)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _train_steps(model, tok)
    for n, p in model.named_parameters():
        if "lora_" in n:
            assert not torch.equal(p, before[n]), f"{n} did not train"
        else:
            assert torch.equal(p, before[n]), f"{n} changed"


def test_adapters_start_as_the_base_model_and_switch_off_to_it(tmp_path):
    model, tok = _tiny(tmp_path)
    base = copy.deepcopy(model)
    ids, mask, T = _batch(tok)
    base_logp = logprobs.completion_logprobs(base, ids, mask, T)[0]
    lora.add_lora(model, rank=4, alpha=8, target_modules=TARGETS)
    assert torch.allclose(logprobs.completion_logprobs(model, ids, mask, T)[0], base_logp, atol=1e-6)  # B = 0
    _train_steps(model, tok)
    with torch.no_grad():
        adapted = logprobs.completion_logprobs(model, ids, mask, T)[0]
        with lora.adapters_disabled(model):
            off = logprobs.completion_logprobs(model, ids, mask, T)[0]
        again = logprobs.completion_logprobs(model, ids, mask, T)[0]
    assert not torch.allclose(adapted, base_logp, atol=1e-3)
    torch.testing.assert_close(off, base_logp, atol=1e-6, rtol=0)
    torch.testing.assert_close(again, adapted, atol=0, rtol=0)  # switched back on afterwards


def test_sampler_sees_the_adapted_weights(tmp_path):
    model, tok = _tiny(tmp_path)
    lora.add_lora(model, rank=4, alpha=8, target_modules=TARGETS)
    _train_steps(model, tok)
    model.eval()
    enc = tok(["a>", "hello>"], return_tensors="pt", padding=True, add_special_tokens=False)
    eos = model_loading.eos_token_ids(model, tok)
    kw = dict(max_new_tokens=5, eos_ids=eos, pad_id=tok.pad_token_id, seeds=torch.arange(2))
    out = sampling.sample(model, enc.input_ids, enc.attention_mask, **kw)
    ids = torch.cat([enc.input_ids, out.completion_ids], 1)
    mask = torch.cat([enc.attention_mask, torch.ones_like(out.completion_ids)], 1)
    T = out.completion_ids.shape[1]
    with torch.no_grad():
        train_logp = logprobs.completion_logprobs(model, ids, mask, T)[0] * out.completion_mask
        with lora.adapters_disabled(model):
            base_logp = logprobs.completion_logprobs(model, ids, mask, T)[0] * out.completion_mask
    torch.testing.assert_close(out.logprobs, train_logp, atol=1e-5, rtol=0)
    assert not torch.allclose(out.logprobs, base_logp, atol=1e-3)


def test_merged_export_reproduces_adapted_logits(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model, tok = _tiny(tmp_path)
    plain_keys = set(model.state_dict())
    lora.add_lora(model, rank=4, alpha=8, target_modules=TARGETS)
    _train_steps(model, tok)
    path = run_export.export_model(model, tok, str(tmp_path / "export"))
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    assert not any("lora" in k or "base_layer" in k for k in saved), saved
    assert saved <= plain_keys and {k for k in plain_keys if "lm_head" not in k} <= saved
    assert "lora_A" in "".join(model.state_dict())  # the live model keeps its adapters
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids, mask, _ = _batch(tok)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask).logits,
                                   model(input_ids=ids, attention_mask=mask).logits, atol=1e-5, rtol=1e-5)


# LoRA samples through the Hugging Face forward: called with the current keywords, it warns of nothing
@pytest.mark.filterwarnings("error::FutureWarning")
def test_train_with_lora_and_kl_builds_no_reference(tmp_path, monkeypatch):
    built = []
    real = model_loading.build_reference_model
    monkeypatch.setattr(model_loading, "build_reference_model", lambda p, beta: built.append(real(p, beta)) or built[-1])
    out = tmp_path / "out"
    train.main([f"--out_dir={out}", "--lora_rank=4", "--lora_alpha=8", "--beta=0.04", "--lr=1e-2", "--max_steps=3",
                "--num_generations=4", "--prompts_per_step=4", "--micro_batch_size=8", "--print_completions_every=0"])
    assert built == [None]
    lines = [json.loads(l) for l in open(out / "metrics.jsonl")]
    assert lines[0]["kl"] == 0.0 and lines[-1]["kl"] > 0  # adapters-off reference: KL appears once adapters move
    from safetensors import safe_open
    with safe_open(str(out / "model" / "model.safetensors"), "pt") as f:
        assert not any("lora" in k for k in f.keys())


def test_compile_layers_warns_where_the_hugging_face_forward_runs(tmp_path, capsys):
    """Adapted layers train on the written-out layers, which --compile_layers compiles; attention dropout keeps
    the Hugging Face forward, which it does not reach: it says so."""
    import sharding
    d = sharding.Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    dropping = model_loading.write_tiny_model(str(tmp_path / "dropout"), attention_dropout=0.1)
    for lora_rank, dropout in ((0, 0.0), (4, 0.0), (0, 0.1)):
        cfg = train.Config(device="cpu", out_dir=str(tmp_path / f"{lora_rank}-{dropout}"), compile_layers=True,
                           lora_rank=lora_rank, **({"model": dropping} if dropout else {}))
        run_setup.load_models(cfg, d, "cpu")
        said = capsys.readouterr().out
        assert ("compile_layers has no effect" in said) == (dropout > 0), said


def test_fixed_reference_matches_a_separate_copy(tmp_path):
    """The adapters-off reference gives the same log-probs a frozen copy of the starting model would."""
    model, tok = _tiny(tmp_path)
    ref = model_loading.build_reference_model(model, beta=0.04)
    lora.add_lora(model, rank=4, alpha=8, target_modules=TARGETS)
    torch.manual_seed(0)
    for m in lora.lora_modules(model).values():
        torch.nn.init.normal_(m.lora_B, std=0.05)  # as if trained
    ids, mask, T = _batch(tok, seed=3)
    with torch.no_grad(), lora.adapters_disabled(model):
        torch.testing.assert_close(logprobs.completion_logprobs(model, ids, mask, T)[0],
                                   logprobs.completion_logprobs(ref, ids, mask, T)[0], atol=1e-6, rtol=0)


FSDP_WORKER = r'''
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import grpo, logprobs, model_loading
from layers import lora
from runs import export as run_export
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo")
path, targets = sys.argv[2], sys.argv[4]
model = model_loading.load_model(path, {"dtype": "float32"}, "cpu", seed=0)
tok = model_loading.load_tokenizer(path)
lora.add_lora(model, rank=4, alpha=8, target_modules=targets)
torch.manual_seed(1)
for m in lora.lora_modules(model).values():
    torch.nn.init.normal_(m.lora_B, std=0.05)  # non-zero, so adapters on and off differ
full = {k: v.clone() for k, v in model.state_dict().items()}
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
enc = tok(["a>", "hello there>"], return_tensors="pt", padding=True, add_special_tokens=False)
comp = torch.arange(10).view(2, 5) + 97
ids = torch.cat([enc.input_ids, comp], 1)
mask = torch.cat([enc.attention_mask, torch.ones_like(comp)], 1)
def token_logprobs(model):  # through the root's forward, as the sharded trainer calls it
    logits = model(input_ids=ids, attention_mask=mask, position_ids=logprobs.position_ids_from_mask(mask)).logits
    return torch.log_softmax(logits[:, -6:-1].float(), -1).gather(-1, ids[:, -5:, None])[..., 0]
logp = token_logprobs(model)
with torch.no_grad(), lora.adapters_disabled(model):
    ref = token_logprobs(model)
logp.sum().backward()
grads = {n: p.grad is not None for n, p in model.named_parameters()}
assert all(g == ("lora_" in n) for n, g in grads.items()), grads
grad_A = {n: p.grad.full_tensor() for n, p in model.named_parameters() if "lora_A" in n}  # collectives: every rank
model.reshard()  # as train.py's export: from the shards
run_export.export_model(model, tok, sys.argv[3] + ".export" if dist.get_rank() == 0 else None,
                        master=dist.get_rank() == 0, max_shard_bytes=20_000)  # every rank: a gather per tensor
if dist.get_rank() == 0:
    torch.save({"logp": logp.detach(), "ref": ref, "full": full, "grad_A": grad_A}, sys.argv[3])
dist.barrier()  # both ranks done before either tears the group down
dist.destroy_process_group()
'''


def _write_moe(path):
    import architectures
    tok = model_loading.build_byte_tokenizer()
    tok.save_pretrained(path)
    architectures.config("qwen3_moe", tok).save_pretrained(path)
    return path


@pytest.mark.parametrize("write, targets", [(model_loading.write_tiny_model, "q_proj,v_proj,down_proj"),
                                            (_write_moe, "all")], ids=["qwen2", "qwen3_moe"])
def test_lora_under_fsdp2_fully_shard(tmp_path, write, targets):
    """Two processes on CPU (gloo): sharded adapted model = unsharded one; gradients reach only the adapters;
    the sharded export holds the weights merged as the unsharded model merges them (expert weights' adapters
    included for qwen3_moe, written as a matrix per expert)."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = write(str(tmp_path / "tiny"))
    (tmp_path / "worker.py").write_text(FSDP_WORKER)
    out = tmp_path / "result.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # CPU on a GPU machine too
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", "29531", str(tmp_path / "worker.py"), root, path, str(out), targets],
                          capture_output=True, text=True, timeout=240, env=env)
    assert finished(proc, out), proc.stdout[-3000:] + proc.stderr[-3000:]
    got = torch.load(out)
    model = model_loading.load_model(path, {"dtype": "float32"}, "cpu", seed=0)
    lora.add_lora(model, rank=4, alpha=8, target_modules=targets)
    model.load_state_dict(got["full"])
    tok = model_loading.load_tokenizer(path)
    enc = tok(["a>", "hello there>"], return_tensors="pt", padding=True, add_special_tokens=False)
    comp = torch.arange(10).view(2, 5) + 97
    ids = torch.cat([enc.input_ids, comp], 1)
    mask = torch.cat([enc.attention_mask, torch.ones_like(comp)], 1)
    logp, _ = logprobs.completion_logprobs(model, ids, mask, 5)  # the trainer's path, unsharded
    with torch.no_grad(), lora.adapters_disabled(model):
        ref, _ = logprobs.completion_logprobs(model, ids, mask, 5)
    logp.sum().backward()
    torch.testing.assert_close(got["logp"], logp.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["ref"], ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ref, logp.detach(), atol=1e-3)
    params = dict(model.named_parameters())
    assert got["grad_A"].keys() == {n for n in params if n.endswith("lora_A")}
    for n, g in got["grad_A"].items():
        torch.testing.assert_close(g, params[n].grad, atol=1e-5, rtol=1e-4)
    # the sharded export (each rank merging its own rows, in several files) = what one process merges, exactly
    assert export_differs(str(out) + ".export", lora.merge_lora_state_dict(model)) is None
