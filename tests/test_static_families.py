"""Every family transformer.FAMILIES declares takes the fast paths and computes what the model does.

One tiny random model per row of tests/architectures.py's table (norms, biases and
the other one-dimensional parameters moved off their initial values, sliding
windows short enough for these sequences to cross them). The
references are the slow obvious ones: `model.generate` for greedy tokens, a
plain forward of each row's real tokens alone for the sampler's log-probs, and
the Hugging Face forward for the training forward's values and gradients.
"""

import dataclasses
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
from layers import lora  # noqa: E402
import sampling  # noqa: E402
from features import sampler_options  # noqa: E402
from layers import cuda_graphs, engine, transformer  # noqa: E402
from layers import static_moe  # noqa: E402
from test_fast_paths import prompts, with_completions  # noqa: E402
from test_multiturn import multi_turn  # noqa: E402
from test_training_forward import (assert_bfloat16_forward_as_exact_as_hf, assert_fast_forward_matches_hf,  # noqa: E402
                                  hf_and_fast_logprobs, with_hole)

# the families whose layers transformer writes out, and which of them train on the model's own forward: read off
# tests/architectures.py's table
CASES = architectures.WRITTEN_OUT
WINDOWED = architectures.WINDOWED
MOE = architectures.MOE
SAMPLER_ONLY = architectures.SAMPLER_ONLY  # written out in the sampler only: they train on the model's own forward
DENSE = architectures.TRAINED_WRITTEN_OUT


def build(case, **kw):
    return architectures.tiny(case, **kw)


def per_row_logprobs(model, enc, rollout, temperature=1.0):
    """(N, T) log-probs of each completion token under a forward over the row's real tokens alone (its
    prompt without padding, then its completion), 0 past the completion's end."""
    out = torch.zeros_like(rollout.logprobs)
    for i in range(enc.input_ids.shape[0]):
        prompt = enc.input_ids[i][enc.attention_mask[i].bool()]
        n = int(rollout.completion_mask[i].sum())
        comp = rollout.completion_ids[i, :n]
        with torch.no_grad():
            logits = model(torch.cat([prompt, comp])[None]).logits[0, len(prompt) - 1:-1].float()
        out[i, :n] = torch.log_softmax(logits / temperature, -1).gather(-1, comp[:, None])[:, 0]
    return out


@pytest.mark.parametrize("case", CASES)
def test_family_takes_the_fast_paths(case):
    model, _ = build(case)
    assert transformer.decide(model).samples_written_out()
    assert transformer.decide(model.train()).trains_written_out(model.train()) == (case not in SAMPLER_ONLY)


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_equal_generate(case):
    model, tok = build(case)
    enc = prompts(tok)
    t = 16
    ours = sampler_options.sample(model, enc.input_ids, enc.attention_mask, max_new_tokens=t, eos_ids=[tok.eos_token_id],
                           pad_id=tok.pad_token_id, temperature=0.0)
    with torch.no_grad():
        ref = model.generate(input_ids=enc.input_ids, attention_mask=enc.attention_mask, do_sample=False,
                             max_new_tokens=t, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    ref = ref[:, enc.input_ids.shape[1]:]
    for i in range(ref.shape[0]):
        n = int(ours.completion_mask[i].sum())
        assert ours.completion_ids[i, :n].tolist() == ref[i, :n].tolist()
        assert n == t or ref[i, n - 1] == tok.eos_token_id


@pytest.mark.parametrize("case", CASES)
def test_sampled_logprobs_equal_a_forward_of_each_row(case):
    """One turn, rows stopping at scattered lengths (the decoder drops finished rows as it goes)."""
    model, tok = build(case)
    enc = prompts(tok)
    r = sampler_options.sample(model, enc.input_ids, enc.attention_mask, max_new_tokens=24, eos_ids=list(range(97, 110)),
                        pad_id=tok.pad_token_id, temperature=0.8, seeds=torch.arange(6) * 3, check_every=4)
    lengths = r.completion_mask.sum(1)
    assert lengths.min() < lengths.max()
    want = per_row_logprobs(model, enc, r, temperature=0.8)
    # log-probs of order 1-10: float32 rounding of the two computations stays far below 1e-4
    torch.testing.assert_close(r.logprobs, want * r.completion_mask, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", CASES)
def test_multi_turn_logprobs_equal_a_forward_of_each_row(case):
    """Answers appended into the cache between turns: the policy's tokens get the log-probs of a forward over
    the whole trajectory, and the rows run past the sliding windows."""
    model, tok = build(case)
    enc = prompts(tok)
    r = multi_turn(model, tok, enc)
    assert (r.turns > 1).any() and r.turns.unique().numel() > 1 and (r.completion_mask > r.policy_mask).any()
    want = per_row_logprobs(model, enc, r)
    pol = r.policy_mask.bool()
    torch.testing.assert_close(r.logprobs[pol], want[pol], atol=1e-4, rtol=0)
    assert (r.logprobs[~pol] == 0).all()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("sdpa", [False, True])
def test_graph_safe_decode_form_matches_eager(case, sdpa):
    """The decode body CUDA graphs capture (slots as a tensor, attention over a wider masked span, SDPA as on
    CUDA) against the eager form, on the CPU: with sliding windows the span reaches past them. The decoder holds
    more rows than the batch, as after compaction to a smaller graph bucket."""
    model, tok = build(case)
    enc = prompts(tok)
    n, p = enc.input_ids.shape
    pos = logprobs.position_ids_from_mask(enc.attention_mask)
    dec = engine.StaticDecoder.for_model(model, n + 3, p + 8, cuda_graph=False)
    graphs, logits = cuda_graphs.Graphs(dec), {}
    for form in ("eager", "graph"):
        dec.decode_kernel = None if sdpa and form == "graph" else engine._decode_plain  # None: SDPA, as on CUDA
        with torch.no_grad():
            dec.prefill(enc.input_ids, enc.attention_mask, pos)
            out = []
            for t in range(3):
                tok_t = torch.arange(n) * 3 + t + 5
                if form == "eager":
                    out.append(dec._decode_body(tok_t, p + t, p + t + 1, dec.first_slot))
                else:
                    graphs.tok_in[:n], graphs.slot_in[:n] = tok_t, p + t
                    out.append(graphs.body(dec, n, dec.max_len))  # what a graph of bucket n captures
        logits[form] = torch.stack(out)
    torch.testing.assert_close(logits["graph"], logits["eager"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", DENSE)
@pytest.mark.parametrize("padding", ["left", "none", "holes"])
def test_training_forward_matches_hf_forward(case, padding):
    """Values and gradients of every parameter against the Hugging Face forward. With a hole in a prompt a
    sliding window counts the row's own positions, the Hugging Face mask its columns: there the reference is
    each row's own forward over its real tokens (values only)."""
    model, tok = build(case)
    model.train()
    t = 6
    ids, attn = with_completions(prompts(tok), t, seed=3, last=9 if padding == "none" else None)
    if padding == "holes":
        ids, attn = with_hole(ids, attn)
        if case in WINDOWED:
            return assert_holes_count_positions(model, ids, attn)
    assert_fast_forward_matches_hf(model, ids, attn, t)


def assert_holes_count_positions(model, ids, attn):
    pos = logprobs.position_ids_from_mask(attn)
    with torch.no_grad():
        got = transformer.hidden_states(model, ids, attn, pos)
        for i in range(ids.shape[0]):
            real = attn[i].bool()
            want = model.base_model(input_ids=ids[i][real][None]).last_hidden_state[0]
            torch.testing.assert_close(got[i][real], want, atol=1e-5 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("case", ["qwen3", "olmo2", "olmo3", "gemma3"])
def test_training_forward_matches_hf_forward_in_bfloat16(case):
    """bf16 weights: the norms round where each family's own norm rounds (OLMo 2 and Gemma scale in float32)."""
    model, tok = build(case)
    model = model.to(torch.bfloat16).train()
    t = 3
    ids, attn = with_completions(prompts(tok), t, seed=4)
    assert_bfloat16_forward_as_exact_as_hf(model, ids, attn, t)


@pytest.mark.parametrize("case", ["qwen3", "olmo2", "gemma3", "smollm3", "gemma2", "exaone4"])
def test_compiled_layers_trace_whole_and_match_eager(traced_layers, case):
    """compile_layers: the layer traces whole for every family: one graph per kind of layer (with and without
    a window mask, with and without rotary), with the eager forward's log-probs and gradients; Gemma 2's
    softcapped attention included."""
    model, tok = build(case)
    model.train()
    ids, attn = with_completions(prompts(tok), 6, seed=3, last=9)
    out = []
    for compiled in (False, True):
        model.zero_grad(set_to_none=True)
        logp, _ = logprobs.completion_logprobs(model, ids, attn, 3, 0.8, fast_forward=True, compile_layers=compiled)
        logp.sum().backward()
        out.append((logp.detach(), {k: p.grad for k, p in model.named_parameters()}))
    torch.testing.assert_close(out[1][0], out[0][0], atol=1e-6, rtol=0)
    for k, g in out[0][1].items():
        torch.testing.assert_close(out[1][1][k], g, atol=1e-7, rtol=1e-5, msg=k)
    assert 1 <= len(traced_layers) <= 2


@pytest.mark.parametrize("name, overrides, why", [
    ("gemma3", dict(attn_logit_softcapping=5.0), "Gemma3DecoderLayer: attn_logit_softcapping set"),
    ("gemma3", dict(use_bidirectional_attention=True), "Gemma3DecoderLayer: use_bidirectional_attention set"),
    ("qwen3", dict(hidden_act="gelu"), "Qwen3DecoderLayer 0: MLP activation GELUActivation"),
    ("exaone4", dict(layer_types=["chunked_attention", "full_attention"]),
     "Exaone4DecoderLayer: layers of type 'chunked_attention'"),
])
def test_what_the_decoder_does_not_reproduce_falls_back_saying_why(name, overrides, why):
    """Refused with the layer class and the feature, on both paths."""
    model, _ = architectures.tiny(name, **overrides)
    assert not transformer.decide(model).samples_written_out()
    assert not transformer.decide(model).trains_written_out(model)
    assert transformer.decide(model).sampler.startswith(why), transformer.decide(model).sampler


def test_a_forks_layer_class_with_a_row_of_its_own_is_written_out(monkeypatch):
    """A fork may key a family row by its own layer class: that class, and no other, then takes the row's path."""
    model, _ = architectures.tiny("qwen3")
    fork = type("ForkLayer", (type(model.model.layers[0]),), {})
    for each in model.model.layers:
        each.__class__ = fork
    assert transformer.decide(model).sampler.startswith("ForkLayer: a layer class not in the family table")
    monkeypatch.setitem(transformer.FAMILIES, fork, transformer.FAMILIES["Qwen3DecoderLayer"])
    paths = transformer.decide(model)
    assert paths.sampler is None and paths.training is None, paths
    assert sampling.check_exact(model) is None


class _ScaledAttention(torch.nn.Module):
    """A fork's change to Qwen3's attention: a learned scalar on its output (mixed into the class below)."""

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return out * self.out_scale, weights


@pytest.mark.parametrize("fork", ["attention", "layer", "same name"])
def test_a_forks_subclass_is_not_taken_for_its_family(fork):
    """A family is its exact class as transformers defines it. A fork's subclass of Qwen3's attention with a learned
    scalar on the output, a subclass of the layer, or a class of the layer's very name defined elsewhere has no row:
    every phase takes the model's own forward, which computes what the fork added (the start-up check finds it
    exact), whatever --check_model says, since the decision does not depend on it."""
    model, _ = architectures.tiny("qwen3")
    layer = model.model.layers[1]
    if fork == "attention":
        layer.self_attn.__class__ = type("ForkAttention", (_ScaledAttention, type(layer.self_attn)), {})
        layer.self_attn.out_scale = torch.nn.Parameter(torch.tensor(0.5))
        why = "Qwen3DecoderLayer 1: self_attn is a ForkAttention from test_static_families"
    else:
        name = "ForkLayer" if fork == "layer" else type(layer).__name__
        for each in model.model.layers:
            each.__class__ = type(name, (type(each),), {})
        why = ("ForkLayer: a layer class not in the family table" if fork == "layer" else
               "Qwen3DecoderLayer from test_static_families: not transformers' own class")
    paths = transformer.decide(model)
    assert paths.sampler.startswith(why) and paths.training == paths.sampler, paths
    assert sampling.check_exact(model) is None
    if fork == "attention":  # read as Qwen3 anyway, the written-out layers would miss the scale
        transformer.attach(model, dataclasses.replace(paths, sampler=None, training=None))
        assert sampling.check_exact(model) is not None


@pytest.mark.parametrize("case", ["qwen3", "olmo2", "gemma3"])
def test_norms_round_as_the_family_does(case):
    """In bf16 each norm, as the decoders apply it (its weight as `_norm_weight` keeps it, over heads as a
    table), gives the bits of the family's own norm module: where the weight multiplies (bf16 or float32)
    and Gemma's 1 + weight included."""
    model, _ = build(case)
    model = model.to(torch.bfloat16)
    fam = transformer._layer_family(model.model.layers[0])
    layer = model.model.layers[0]
    a = layer.self_attn
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, model.config.hidden_size, generator=g) * 4).bfloat16()
    for norm in [getattr(layer, n) for n in fam.norms if n] + [model.model.norm]:
        got = transformer._rms_norm(x, transformer._norm_weight(norm.weight, fam), transformer._eps(norm),
                                       fam.upcast)
        torch.testing.assert_close(got, norm(x), atol=0, rtol=0)
    q = (torch.randn(3, 5, a.q_proj.out_features, generator=g) * 4).bfloat16()
    if fam.qk_norm == "head":
        q = q.unflatten(-1, (-1, a.head_dim))
        table = transformer._norm_weight(a.q_norm.weight, fam).expand(q.shape[-2], -1)  # the decoder's form
        torch.testing.assert_close(transformer._head_norm(q, table, transformer._eps(a.q_norm), fam.upcast),
                                   a.q_norm(q), atol=0, rtol=0)
    got = transformer._rms_norm(q, transformer._norm_weight(a.q_norm.weight, fam), transformer._eps(a.q_norm),
                                   fam.upcast)
    torch.testing.assert_close(got, a.q_norm(q), atol=0, rtol=0)


def test_rotary_that_depends_on_the_call_falls_back_in_the_sampler():
    """Dynamic scaling recomputes the tables from the longest position of each call: the decoder, which
    computes every slot's table at prefill, leaves it to the Hugging Face forward. The training forward
    calls the model's own rotary module as that forward does."""
    model, _ = architectures.tiny("llama", rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=1e4))
    assert not transformer.decide(model).samples_written_out()
    assert transformer.decide(model).trains_written_out(model)


def _moe_blocks(model):
    return [layer.mlp for layer in model.model.layers if transformer.is_moe(layer.mlp)]


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("adapters", [False, True])
def test_moe_block_equals_the_model_block(case, grouped, adapters):
    """static_moe.MoE on the model's own parameters against the block's forward, tokens of a sequence: the
    grouped matmul and its stand-in (gather and batched matmul), with LoRA on the experts' fused weights
    (the low-rank term for the chosen experts against the model's merged weight) and without."""
    model, _ = build(case)
    if adapters:
        architectures.adapt(model, 4, "experts.gate_up_proj,experts.down_proj")
    g = torch.Generator().manual_seed(2)
    h = torch.randn(2, 7, model.config.hidden_size, generator=g)
    for mlp in _moe_blocks(model):
        moe = static_moe.MoE(mlp)
        assert moe.grouped  # float32 on CPU: grouped_mm takes it
        moe.grouped = grouped
        with torch.no_grad():
            got, experts = moe(h.view(-1, h.shape[-1]))
            want = mlp(h)
            want = want[0] if isinstance(want, tuple) else want  # gpt-oss's block returns its router scores too
            _, _, want_experts = (getattr(mlp, "gate", None) or mlp.router)(h.view(-1, h.shape[-1]))
        torch.testing.assert_close(got.view(h.shape), want, atol=1e-5 * want.abs().max().item(), rtol=0)
        assert torch.equal(experts, want_experts)


def test_moe_decoder_keeps_no_copy_of_the_experts_and_follows_their_adapters():
    """The decoder's own tensors hold no expert weight (it reads them in place), and with LoRA on the experts
    (the adapters' B random, so that they change the model) the sampler's log-probs, over several turns, equal
    one forward of the adapted model over each row's trajectory; with the adapters off, the base model's."""
    model, tok = build("qwen3_moe")
    architectures.adapt(model, 4, "experts.gate_up_proj,experts.down_proj")
    assert transformer.decide(model).samples_written_out()
    enc = prompts(tok)
    for adapted in (True, False):
        for a in lora.lora_modules(model).values():
            a.enabled = adapted
        r = multi_turn(model, tok, enc)
        pol = r.policy_mask.bool()
        torch.testing.assert_close(r.logprobs[pol], per_row_logprobs(model, enc, r)[pol], atol=1e-4, rtol=0)
    dec = engine.StaticDecoder.for_model(model, 2, 8, cuda_graph=False)
    expert_elems = sum(p.numel() for mlp in _moe_blocks(model) for p in mlp.experts.parameters())
    own = [t for layer in dec.w[0] for t in layer.values() if torch.is_tensor(t)]
    assert own and sum(t.numel() for t in own) < expert_elems / 2  # attention, norms and routers' scale only
    assert not any(t.dim() == 3 for t in own)


def test_sharded_experts_take_the_model_forward(monkeypatch):
    """Experts are read in place: a model whose MoE blocks are sharded (FSDP2 outside a gather) samples on its
    own forward, which gathers them."""
    model, _ = build("qwen3_moe")
    blocks = _moe_blocks(model)
    monkeypatch.setattr(transformer, "_is_sharded", lambda m: m is blocks[0])
    assert not transformer.decide(model).samples_written_out()


def test_kept_moe_decoder_reads_the_experts_as_they_are_now():
    """With the decoder kept between calls (keep_decoder), the experts changed in place (as an optimizer step
    changes them) decode as they are at the next call: the decoder holds no stale copy."""
    model, tok = build("qwen3_moe")
    enc = prompts(tok)
    kw = dict(max_new_tokens=10, eos_ids=[], pad_id=tok.pad_token_id, seeds=torch.arange(6), keep_decoder=True)
    sampler_options.sample(model, enc.input_ids, enc.attention_mask, **kw)
    kept = model._static_decoder
    with torch.no_grad():
        for mlp in _moe_blocks(model):
            mlp.experts.down_proj.mul_(3.0)
            mlp.gate.weight.mul_(-1.0)
    r = sampler_options.sample(model, enc.input_ids, enc.attention_mask, **kw)
    assert model._static_decoder is kept
    torch.testing.assert_close(r.logprobs, per_row_logprobs(model, enc, r) * r.completion_mask, atol=1e-4, rtol=0)


def test_sharded_hybrid_and_moe_families_sample_as_the_whole_model():
    """Two processes, FSDP2 (tests/sharded_families.py): Qwen3.5 on the written-out layers, each block gathered
    for its copy; Qwen3-MoE and gpt-oss, whose sharded experts cannot be read in place, on their own forward."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(root, "tests", "sharded_families.py"), "qwen3_5", "qwen3_moe", "gpt_oss"]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    lines = {tuple(line.split()) for line in r.stdout.splitlines() if line.endswith(" ok")}
    assert lines == {(rank, fam, path, "ok") for rank in "01"
                     for fam, path in (("qwen3_5", "fast"), ("qwen3_moe", "hf"), ("gpt_oss", "hf"))}


@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss"])
def test_moe_in_bfloat16_with_lora_on_experts(case):
    """bf16 weights with rank-4 adapters on the experts: grouped_mm takes the base weights but not the adapters'
    narrow factors (rows under 16 bytes), which then run as batched matmuls; the sampler's log-probs stay within
    bf16 rounding of the model's own forward, on average over the tokens (bf16 logits of order 10 round by a
    few hundredths), and the adapters' effect is ten times larger."""
    model, tok = build(case)
    architectures.adapt(model, 4, "experts.gate_up_proj,experts.down_proj", scale=0.3)
    model = model.to(torch.bfloat16)
    moe = [static_moe.MoE(mlp) for mlp in _moe_blocks(model)]
    assert all(m.grouped and not m.grouped_lora for m in moe)
    enc = prompts(tok)
    kw = dict(max_new_tokens=12, eos_ids=[], pad_id=tok.pad_token_id, seeds=torch.arange(6))
    r = sampler_options.sample(model, enc.input_ids, enc.attention_mask, **kw)
    want = per_row_logprobs(model, enc, r)
    with lora.adapters_disabled(model):
        base = per_row_logprobs(model, enc, r)
    off, effect = (r.logprobs - want).abs().mean(), (base - want).abs().mean()
    assert off < 0.02 and effect > 10 * off


def test_recurrent_states_put_back_around_a_repeated_step():
    """CUDA graph capture runs the decode body twice before the replay runs it: KV slots are written again with
    the same values, but a recurrent state would take the token again (it does: the logits move), so capture
    puts the states back (`snapshot` / `restore`) and the replay gives the step's first result."""
    model, tok = build("qwen3_5")
    enc = prompts(tok)
    n, p = enc.input_ids.shape
    dec = engine.StaticDecoder.for_model(model, n, p + 8, cuda_graph=False)
    dec.prefill(enc.input_ids, enc.attention_mask, logprobs.position_ids_from_mask(enc.attention_mask))
    tok = torch.arange(n) + 5
    slot = torch.full((n,), p)
    layers = list(dec.recurrent.values())
    before = [layer.snapshot() for layer in layers]
    with torch.no_grad():
        once = dec._decode_body(tok, slot, dec.max_len, 0).clone()
        after_once = [layer.snapshot() for layer in layers]
        for layer, states in zip(layers, before):
            layer.restore(states)
        dec._decode_body(tok, slot, dec.max_len, 0)
        twice = dec._decode_body(tok, slot, dec.max_len, 0)
        assert (twice - once).abs().max() > 1e-3  # the state took the token twice
        for layer, states in zip(layers, before):
            layer.restore(states)
        again = dec._decode_body(tok, slot, dec.max_len, 0)
    torch.testing.assert_close(again, once, atol=0, rtol=0)
    for layer, (conv, rec) in zip(layers, after_once):
        assert torch.equal(layer.conv, conv) and torch.equal(layer.rec, rec)


def test_recurrent_states_follow_their_rows_through_compaction():
    """Rows stopping at scattered lengths are dropped from the batch as they finish: the recurrent states move
    with their rows, and each row's log-probs still equal a forward of the row alone."""
    model, tok = build("qwen3_5")
    enc = prompts(tok)
    r = sampler_options.sample(model, enc.input_ids, enc.attention_mask, max_new_tokens=24, eos_ids=list(range(97, 110)),
                        pad_id=tok.pad_token_id, temperature=0.8, seeds=torch.arange(6) * 3, check_every=4,
                        keep_decoder=True)
    assert model._static_decoder.compactions > 0
    want = per_row_logprobs(model, enc, r, temperature=0.8)
    torch.testing.assert_close(r.logprobs, want * r.completion_mask, atol=1e-4, rtol=0)


def ours_against_the_model(model, tok, enc, new_tokens=6):
    """How far our paths' log-probs lie from the model's own forward over the same trajectory: the largest
    difference over a few sampled tokens per row, for the sampler and (where written out) the training forward."""
    r = sampler_options.sample(model, enc.input_ids, enc.attention_mask, max_new_tokens=new_tokens, eos_ids=[],
                        pad_id=tok.pad_token_id, seeds=torch.arange(enc.input_ids.shape[0]) * 7 + 3)
    want = per_row_logprobs(model, enc, r)
    out = {"sampler": (r.logprobs - want).abs().max().item()}
    if transformer.decide(model).trains_written_out(model):
        ids = torch.cat([enc.input_ids, r.completion_ids], 1)
        mask = torch.cat([enc.attention_mask, r.completion_mask], 1)
        with torch.no_grad():
            train, _ = logprobs.completion_logprobs(model, ids, mask, new_tokens)
        out["training"] = (train - want).abs().max().item()
    return out


def test_each_declared_feature_matters(monkeypatch):
    """A wrong layer is caught: for every written-out family, each difference from Llama its row declares
    (tests/architectures.py's `features`), switched off in turn (`KNOCKOUTS`), moves some log-prob of every path the
    family takes (sampler, training forward) by far more than the 1e-4 the exactness tests allow: at least 0.05
    (weights large enough for sharp attention, caps small enough to bite, windows the rows cross)."""
    change = {}
    for name in CASES:
        model, tok = build(name)
        enc = prompts(tok)
        assert max(ours_against_the_model(model, tok, enc).values()) < 1e-4, name  # exact with the feature on
        for feature in architectures.FAMILIES[name].features:
            with monkeypatch.context() as m:
                architectures.KNOCKOUTS[feature](m)
                change[name, feature] = min(ours_against_the_model(model, tok, enc).values())
    smallest = min(change, key=change.get)
    print(f"\nsmallest log-prob change with one declared feature switched off: {change[smallest]:.3g} {smallest}")
    assert change[smallest] >= 0.05, "\n".join(f"{v:.3g} {k}" for k, v in sorted(change.items(), key=lambda kv: kv[1]))
