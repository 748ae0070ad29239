"""LoRA's default targets ("all") on MoE and hybrid families: what gets adapters, and that the adapted model is the
base model plus exactly the low-rank deltas, experts' fused weights included (LoRAExperts)."""

import contextlib
import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import architectures  # noqa: E402
import grpo  # noqa: E402
import logprobs  # noqa: E402
import model_loading  # noqa: E402
from runs import export as run_export  # noqa: E402
from layers import lora  # noqa: E402
from layers import static_moe  # noqa: E402

# the MoE and hybrid families whose row in tests/architectures.py names the particular modules LoRA must reach
FAMILIES = [n for n, row in architectures.FAMILIES.items() if row.adapted]
RANK, ALPHA = 4, 8


def _expected(model):
    """{name: (in, out, experts)} for what "all" should adapt, found by walking the decoder layers by hand."""
    want = {}
    for i, layer in enumerate(model.model.layers):
        for name, m in layer.named_modules():
            full = f"model.layers.{i}.{name}"
            if isinstance(m, torch.nn.Linear) and "router" not in name and not name.endswith(".gate"):
                want[full] = (m.in_features, m.out_features, 1)
            if type(m).__name__.endswith("Experts"):
                for p_name, p in m.named_parameters(recurse=False):
                    if p.dim() == 3:  # (E, a, b): in + out = a + b whichever way round it is stored
                        want[f"{full}.{p_name}"] = (p.shape[1], p.shape[2], p.shape[0])
    return want


def _ids(tok, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (3, 10), generator=g)


def _random_B(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for a in lora.lora_modules(model).values():
            a.lora_B.copy_(torch.randn(a.lora_B.shape, generator=g) * 0.1)


@pytest.mark.parametrize("family", FAMILIES)
def test_all_adapts_every_layer_linear_and_expert_weight(family):
    model, _ = architectures.tiny(family)
    want = _expected(model)
    adapted = lora.add_lora(model, RANK, ALPHA, "all")
    assert sorted(adapted) == sorted(want)
    # the walk is not vacuous: each family's particular layers are among them
    particular = architectures.FAMILIES[family].adapted
    assert all(f"model.layers.0.{p}" in want for p in particular), sorted(want)
    assert not any("router" in n or n.endswith(".gate") or "lm_head" in n or "embed" in n for n in adapted)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    assert sum(p.numel() for p in trainable.values()) == sum(RANK * (i + o) * e for i, o, e in want.values())
    summary = lora.lora_summary(model)
    assert summary.startswith(f"LoRA rank {RANK} on ") and summary.endswith(
        f": {sum(p.numel() for p in trainable.values()):,} parameters")
    if architectures.FAMILIES[family].layers == "moe":
        assert "experts.gate_up_proj x2" in summary and "experts.down_proj x2" in summary


@pytest.mark.parametrize("family", FAMILIES)
def test_adapted_model_is_the_base_plus_the_deltas(family):
    model, tok = architectures.tiny(family)
    base = copy.deepcopy(model)
    ids = _ids(tok)
    lora.add_lora(model, RANK, ALPHA, "all")
    with torch.no_grad():
        base_logits = base(ids).logits
        assert torch.equal(model(ids).logits, base_logits)  # B = 0: the base model, bit for bit
    _random_B(model)
    # the slow obvious version: the base copy with scaling * B A added to each adapted weight by hand
    merged = copy.deepcopy(base)
    params = dict(merged.named_parameters())
    with torch.no_grad():
        for name, a in lora.lora_modules(model).items():
            if isinstance(a, lora.LoRALinear):
                params[f"{name}.weight"].add_(a.scaling * a.lora_B @ a.lora_A)
                continue
            owner, rest = name.split(".parametrizations.")
            w = params[f"{owner}.{rest.split('.')[0]}"]
            assert a.lora_A.shape[:2] == (w.shape[0], RANK) and a.lora_B.shape[2] == RANK
            # how the block stores a fused expert weight (static_moe.BLOCKS): "out_in" (E, out, in), read
            # F.linear(x, W[e]) (Qwen3-MoE); "in_out" (E, in, out), read x @ W[e] (gpt-oss)
            layout = static_moe._block_spec(merged.get_submodule(owner.rsplit(".", 1)[0]))[2]
            for e in range(w.shape[0]):
                d = a.scaling * a.lora_B[e] @ a.lora_A[e]  # (out, in)
                w[e] += d if layout == "out_in" else d.T
        adapted = model(ids).logits
        # merged and apart round differently, by float32 noise in proportion to the logits (up to ~4 here)
        tol = 1e-5 * max(1.0, base_logits.abs().max().item())
        torch.testing.assert_close(adapted, merged(ids).logits, atol=tol, rtol=1e-5)
        assert (adapted - base_logits).abs().max() > 1e-2  # the deltas are big enough to tell
        with lora.adapters_disabled(model):
            assert torch.equal(model(ids).logits, base_logits)
        torch.testing.assert_close(model(ids).logits, adapted, atol=0, rtol=0)  # switched back on


@pytest.mark.parametrize("family", FAMILIES)
def test_merged_export_loads_as_a_plain_model(family, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model, tok = architectures.tiny(family)
    lora.add_lora(model, RANK, ALPHA, "all")
    _random_B(model)
    path = run_export.export_model(model, tok, str(tmp_path / "export"))
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        saved = list(f.keys())
    assert not any("lora" in k or "parametrizations" in k for k in saved), saved
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                  attn_implementation=model.config._attn_implementation).eval()
    assert not lora.lora_modules(loaded)
    ids = _ids(tok, seed=2)
    with torch.no_grad():
        # merged, each weight is rounded once more than with its adapter apart: the bound is the float32 model's own
        # distance from a float64 run of it, a few times over, where a wrong merge moves logits by O(1)
        double = copy.deepcopy(model).double()
        if getattr(double.config, "_experts_implementation", None) not in (None, "eager"):
            double.set_experts_implementation("eager")  # the grouped matmul takes no float64
        exact = double(ids).logits
        own = (model(ids).logits - exact).abs().max().item()
        assert 0 < own < 1e-3
        torch.testing.assert_close(loaded(ids).logits.double(), exact, atol=4 * own, rtol=0)


@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
def test_each_experts_implementation_reads_the_adapted_weight_once_per_forward(implementation):
    """However the experts' forward reads its fused weights, it sees W + delta, merged once per forward (the eager
    loop reads the whole weight once per expert it runs)."""
    model, tok = architectures.tiny("qwen3_moe")
    lora.add_lora(model, RANK, ALPHA, "all")
    _random_B(model)
    ids = _ids(tok, seed=3)
    with torch.no_grad():
        want = model(ids).logits  # grouped_mm, the default
    model.set_experts_implementation(implementation)
    assert model.config._experts_implementation == implementation
    merges = []
    experts = [a for a in lora.lora_modules(model).values() if isinstance(a, lora.LoRAExperts)]
    hooks = [a.register_forward_hook(lambda m, args, out: merges.append(m)) for a in experts]
    with torch.no_grad():
        got = model(ids).logits
    for h in hooks:
        h.remove()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(merges) == len(experts) == 4  # two layers, two fused weights each: one merge apiece


def test_only_adapters_train_and_checkpointing_gives_the_same_gradients():
    grads = []
    for checkpointing in (False, True):
        model, tok = architectures.tiny("qwen3_moe")
        lora.add_lora(model, RANK, ALPHA, "all")
        _random_B(model)
        if checkpointing:
            model_loading.enable_checkpointing(model)
        model.train()
        ids = _ids(tok, seed=4)
        logp, _ = logprobs.completion_logprobs(model, ids, torch.ones_like(ids), 4)
        logp.sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("experts.parametrizations.gate_up_proj" in n for n in grads[0])
    for n, g in grads[0].items():
        assert g.abs().sum() > 0, n
        torch.testing.assert_close(grads[1][n], g, atol=1e-6, rtol=1e-5, msg=n)


def test_explicit_names_reach_expert_weights_and_misses_list_them():
    model, _ = architectures.tiny("qwen3_moe")
    assert lora.add_lora(model, RANK, ALPHA, "experts.gate_up_proj,q_proj") == [
        f"model.layers.{i}.{n}" for i in range(2) for n in ("self_attn.q_proj", "mlp.experts.gate_up_proj")]
    model, _ = architectures.tiny("qwen3_moe")
    with pytest.raises(ValueError) as e:
        lora.add_lora(model, RANK, ALPHA, "q_proj,gate_proj")  # the dense layers' name: no such layer
    assert str(e.value) == ("lora_target_modules: 'gate_proj' matches no linear layer or expert weight (the model has: "
                            "experts.down_proj, experts.gate_up_proj, k_proj, lm_head, o_proj, q_proj, v_proj)")
    assert not lora.lora_modules(model) and all(p.requires_grad for p in model.parameters())


def test_checkpoint_round_trip_restores_expert_adapters_and_their_optimizer_state(tmp_path):
    import sharding
    d = sharding.Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))

    def adapted():
        model, tok = architectures.tiny("qwen3_moe")
        lora.add_lora(model, RANK, ALPHA, "all")
        root = sharding.Root(model)
        return root, torch.optim.AdamW([p for p in root.parameters() if p.requires_grad], lr=1e-2), tok

    root, opt, tok = adapted()
    _random_B(root.lm)
    ids = _ids(tok, seed=5)
    root.lm(ids).logits.sum().backward()
    opt.step()
    sharding.save_checkpoint(str(tmp_path), 1, root, opt, {}, d)
    fresh, fresh_opt, _ = adapted()  # B = 0 again, other A, no optimizer state
    assert sharding.load_latest_checkpoint(str(tmp_path), fresh, fresh_opt, d)["step"] == 1
    names = [n for n, _ in root.named_parameters()]
    assert any(n.endswith("experts.parametrizations.gate_up_proj.0.lora_B") for n in names)
    for n, p, q in zip(names, root.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q), n
    for state, fresh_state in zip(opt.state_dict()["state"].values(), fresh_opt.state_dict()["state"].values(),
                                  strict=True):
        assert torch.equal(state["exp_avg"], fresh_state["exp_avg"])
    with torch.no_grad():
        torch.testing.assert_close(fresh.lm(ids).logits, root.lm(ids).logits, atol=0, rtol=0)


@pytest.mark.parametrize("family", architectures.WITH_LORA)
def test_adapted_models_sample_on_the_fast_decoder(family):
    """Adapters on the linear layers (the default targets, experts included) keep the written-out sampler, which
    reads each adapted weight with its delta merged in: over several turns, its log-probs equal one forward of the
    adapted model over each row's trajectory; with the adapters off, the base model's. The training forward is the
    written-out one where the family has it (test_adapted_dense_models_train_on_the_written_out_layers)."""
    from layers import transformer
    from test_fast_paths import prompts
    from test_multiturn import multi_turn
    from test_static_families import per_row_logprobs
    model, tok = architectures.tiny(family)
    lora.add_lora(model, RANK, ALPHA, "all")
    _random_B(model)
    assert any(type(m) is lora.LoRALinear for m in model.modules())
    assert transformer.decide(model).samples_written_out()
    model.eval()
    enc = prompts(tok)
    rollouts = {}
    for adapted in (True, False):
        with contextlib.ExitStack() as stack:
            if not adapted:
                stack.enter_context(lora.adapters_disabled(model))
            r = rollouts[adapted] = multi_turn(model, tok, enc)
            pol = r.policy_mask.bool()
            torch.testing.assert_close(r.logprobs[pol], per_row_logprobs(model, enc, r)[pol], atol=1e-4, rtol=0)
    assert not torch.equal(rollouts[True].completion_ids, rollouts[False].completion_ids)  # the deltas tell


@pytest.mark.parametrize("family", [n for n in architectures.WITH_LORA if n in architectures.TRAINED_WRITTEN_OUT])
def test_adapted_dense_models_train_on_the_written_out_layers(family):
    """The written-out training forward with adapters (each adapted projection's low-rank term added apart, as
    LoRALinear adds it): log-probs and every adapter's gradient equal the model's own forward's; with the adapters
    off (the reference's forward), the base model's log-probs."""
    from layers import transformer
    from test_fast_paths import prompts, with_completions
    from test_training_forward import hf_and_fast_logprobs
    model, tok = architectures.tiny(family)
    lora.add_lora(model, RANK, ALPHA, "all")
    _random_B(model)
    model.train()
    assert transformer.decide(model).trains_written_out(model)
    ids, attn = with_completions(prompts(tok), 6, seed=3)
    (hf_logp, hf_grads), (fast_logp, fast_grads) = hf_and_fast_logprobs(model, ids, attn, 6)
    torch.testing.assert_close(fast_logp, hf_logp, atol=1e-5, rtol=0)
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and fast_grads.keys() == hf_grads.keys() == adapters
    for k, g in hf_grads.items():
        assert g.abs().max() > 0, k
        torch.testing.assert_close(fast_grads[k], g, atol=2e-6 * g.abs().max().item(), rtol=1e-4, msg=k)
    with torch.no_grad(), lora.adapters_disabled(model):
        off = [logprobs.completion_logprobs(model, ids, attn, 6, fast_forward=fast)[0] for fast in (False, True)]
    torch.testing.assert_close(off[1], off[0], atol=1e-5, rtol=0)
    assert (off[0] - hf_logp).abs().max() > 1e-3  # the adapters change the model
