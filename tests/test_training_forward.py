"""The training forward's fast paths compute what the simple ones do.

Chunked log-probs and the loss against full log_softmax + gather; the
written-out layers (mask-free rows, width, compiled) against the Hugging Face
forward; activation checkpointing against none.
"""

import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpo  # noqa: E402

import logprobs  # noqa: E402
import model_loading  # noqa: E402
from layers import lora  # noqa: E402
from layers import transformer  # noqa: E402
from test_fast_paths import cuda, prompts, tiny_model, with_completions  # noqa: E402


def naive_logprobs(model, ids, attn, t, temperature):
    logits = model(input_ids=ids, attention_mask=attn, position_ids=logprobs.position_ids_from_mask(attn)).logits
    logp_all = torch.log_softmax(logits[:, -t - 1:-1].float() / temperature, -1)
    return logp_all.gather(-1, ids[:, -t:, None])[..., 0], -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("chunk_tokens", [None, 7])  # one chunk, and many (uneven: the last is partial)
def test_chunked_logprobs_loss_and_grads_match_naive(chunk_tokens):
    model, tok = tiny_model()
    model.train()
    enc = prompts(tok)
    g = torch.Generator().manual_seed(1)
    t = 6
    comp = torch.randint(0, 256, (enc.input_ids.shape[0], t), generator=g)
    ids = torch.cat([enc.input_ids, comp], 1)
    attn = torch.cat([enc.attention_mask, torch.ones_like(comp)], 1)
    mask = (torch.rand(ids.shape[0], t, generator=g) > 0.2).float()
    adv = torch.randn(ids.shape[0], generator=g)
    ref = torch.randn(ids.shape[0], t, generator=g) * 0.1 - 5

    def loss_and_grads(logprob_fn):
        model.zero_grad(set_to_none=True)
        logp, ent = logprob_fn()
        loss, _ = grpo.grpo_loss(logp, logp.detach(), ref, adv, mask,
                                 grpo.Objective(beta=0.04, epsilon=0.2, max_completion_length=t),
                                 num_sequences=ids.shape[0], num_tokens=mask.sum())
        loss.backward()
        return logp.detach(), ent.detach(), loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}

    fast = loss_and_grads(lambda: logprobs.completion_logprobs(model, ids, attn, t, 0.9, chunk_tokens=chunk_tokens))
    slow = loss_and_grads(lambda: naive_logprobs(model, ids, attn, t, 0.9))
    for a, b in zip(fast[:3], slow[:3]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for k in slow[3]:
        torch.testing.assert_close(fast[3][k], slow[3][k], atol=1e-6, rtol=1e-4, msg=k)
    assert slow[3]["model.embed_tokens.weight"].abs().sum() > 0


@pytest.mark.parametrize("padding", ["left", "holes", "empty prompt"])
def test_left_padding_needs_no_attention_mask(monkeypatch, padding):
    """Rows rolled so that their left padding comes last attend with plain causal attention, no mask, and give
    the log-probs of the masked naive forward; a mask with holes, or a row without a prompt token (its first
    token has no real predictor), is still applied."""
    model, tok = tiny_model()
    t = 5
    ids, attn = with_completions(prompts(tok), t, seed=6)
    if padding == "holes":
        ids, attn = with_hole(ids, attn)
    if padding == "empty prompt":
        attn[0, :-t] = 0
    assert not attn.all()
    with torch.no_grad():
        want, _ = naive_logprobs(model, ids, attn, t, 0.9)
    masks = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        masks.append(kwargs.get("attn_mask"))
        return sdpa(*args, **kwargs)
    monkeypatch.setattr(transformer.F, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        logp, _ = logprobs.completion_logprobs(model, ids, attn, t, 0.9, fast_forward=True)
    assert len(masks) >= model.config.num_hidden_layers
    assert all((m is None) == (padding == "left") for m in masks)
    if padding == "empty prompt":  # predicted from a padding position: the two forwards need not agree there
        want[0, 0] = logp[0, 0] = 0
    torch.testing.assert_close(logp, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("fast", [True, False], ids=["written-out", "hugging-face"])
def test_width_runs_fewer_positions_with_the_same_counted_logprobs(monkeypatch, fast):
    """width = the longest row's real prompt + counted completion, less 1: the forward gets that many columns,
    and every counted token's log-prob is the masked naive forward's, through either forward."""
    model, tok = tiny_model()
    enc = prompts(tok)
    t = 6
    ids, attn = with_completions(enc, t, seed=7)
    counted = torch.tensor([6, 2, 0, 1, 3, 4])  # completion tokens each row counts
    width = int((enc.attention_mask.sum(1) + counted).max()) - 1
    assert width < ids.shape[1] - 1
    with torch.no_grad():
        want, _ = naive_logprobs(model, ids, attn, t, 0.9)
    seen = []
    inner = model.base_model.forward
    monkeypatch.setattr(logprobs, "hidden_states", lambda m, i, *a, **k: seen.append(i.shape[1]) or
                        transformer.hidden_states(m, i, *a, **k))
    monkeypatch.setattr(model.base_model, "forward", lambda input_ids, **k: seen.append(input_ids.shape[1]) or
                        inner(input_ids=input_ids, **k))
    with torch.no_grad():
        logp, _ = logprobs.completion_logprobs(model, ids, attn, t, 0.9, width=width, fast_forward=fast)
    assert seen == [width]
    keep = torch.arange(t)[None] < counted[:, None]
    torch.testing.assert_close(logp[keep], want[keep], atol=1e-5, rtol=0)
    assert torch.isfinite(logp).all()


def test_chunked_logprobs_in_bfloat16_match_naive():
    """bfloat16 weights (as FSDP computes on GPUs): the log-prob function's dtype handling matches autograd's."""
    model, tok = tiny_model()
    model = model.to(torch.bfloat16).train()
    enc = prompts(tok)
    t = 5
    ids, attn = with_completions(enc, t, seed=2)
    out = []
    for fn in (lambda: logprobs.completion_logprobs(model, ids, attn, t, 0.7, chunk_tokens=4),
               lambda: naive_logprobs(model, ids, attn, t, 0.7)):
        model.zero_grad(set_to_none=True)
        logp, _ = fn()
        assert logp.dtype == torch.float32
        (logp * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
        out.append((logp.detach(), {k: p.grad.float() for k, p in model.named_parameters()}))
    torch.testing.assert_close(out[0][0], out[1][0], atol=2e-2, rtol=0)
    for k, g in out[1][1].items():
        assert g.abs().max() > 0
        torch.testing.assert_close(out[0][1][k], g, atol=2e-2 * g.abs().max().item(), rtol=5e-2, msg=k)


def test_bfloat16_weight_gradient_does_not_degrade_with_more_chunks():
    """The head's weight gradient sums over chunks in float32: 512 chunks are as accurate as one."""
    g = torch.Generator().manual_seed(0)
    n, v, h = 2048, 300, 64
    hidden = torch.randn(n, h, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.3).bfloat16().requires_grad_()
    targets, upstream = torch.randint(0, v, (n,), generator=g), torch.randn(n, generator=g)
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    (torch.log_softmax(h64 @ w64.t(), -1).gather(-1, targets[:, None])[:, 0] * upstream.double()).sum().backward()
    errors = []
    for chunk in (n, 4):
        weight.grad = None
        logp, _ = logprobs._ChunkedTokenLogprobs.apply(hidden, weight, targets, 1.0, chunk)
        (logp * upstream).sum().backward()
        assert weight.grad.dtype == torch.bfloat16
        errors.append(((weight.grad.double() - w64.grad).abs().max() / w64.grad.abs().max()).item())
    assert errors[1] < 2 * errors[0] + 1e-3, errors  # summed in bf16 the 512-chunk error is about 7x larger


def test_chunked_logprobs_backward_twice_with_a_retained_graph():
    """Backward may run twice over a retained graph (kept chunk or recomputed): the gradients add up."""
    model, tok = tiny_model()
    enc = prompts(tok)
    for chunk in (None, 3):
        model.zero_grad(set_to_none=True)
        logp, _ = logprobs.completion_logprobs(model, enc.input_ids, enc.attention_mask, 4, 1.0, chunk_tokens=chunk)
        logp.sum().backward(retain_graph=True)
        once = model.lm_head.weight.grad.clone()
        logp.sum().backward()
        torch.testing.assert_close(model.lm_head.weight.grad, 2 * once)


def test_gradient_checkpointing_gives_the_same_gradients(tmp_path):
    path = model_loading.write_tiny_model(str(tmp_path / "m"))
    grads = []
    for ckpt in (False, True):
        model = model_loading.load_model(path, {"attn_implementation": "sdpa"}, "cpu", seed=0, gradient_checkpointing=ckpt)
        model.train()
        assert model.model.gradient_checkpointing == ckpt
        ids = torch.arange(40).view(2, 20) + 3
        logp, _ = logprobs.completion_logprobs(model, ids, torch.ones_like(ids), 8)
        logp.sum().backward()
        grads.append({k: p.grad for k, p in model.named_parameters()})
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], atol=1e-6, rtol=1e-5, msg=k)


def hf_and_fast_logprobs(model, ids, attn, t, temperature=0.8):
    """completion_logprobs through the Hugging Face forward and through transformer.hidden_states:
    log-probs, and the gradients of a weighted sum of them."""
    out = []
    weights = torch.linspace(-1, 1, ids.shape[0] * t).view(-1, t).to(ids.device)
    for fast in (False, True):
        model.zero_grad(set_to_none=True)
        logp, _ = logprobs.completion_logprobs(model, ids, attn, t, temperature, fast_forward=fast)
        (logp * weights).sum().backward()
        out.append((logp.detach(), {k: p.grad.float() for k, p in model.named_parameters() if p.grad is not None}))
    return out


def with_hole(ids, attn):
    """The mask with a hole in the longest prompt (a masked token between real ones), not only left padding."""
    attn = attn.clone()
    attn[attn.sum(1).argmax(), 3] = 0
    return ids, attn


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("padding", ["left", "none", "holes"])
def test_training_forward_matches_hf_forward(arch, padding):
    """Values and gradients of every parameter, with left padding (moved to the right end, no mask), without
    padding (plain causal), and with a hole in a prompt (a mask)."""
    # Llama: a head_dim other than hidden / heads, and another norm epsilon
    model, tok = tiny_model(arch, **(dict(head_dim=32, rms_norm_eps=1e-5) if arch == "llama" else {}))
    with torch.no_grad():  # norm weights and biases away from their initial ones and zeros
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    model.train()
    assert transformer.decide(model).trains_written_out(model)
    enc = prompts(tok)
    t = 6
    ids, attn = with_completions(enc, t, seed=3, last=9 if padding == "none" else None)
    if padding == "holes":
        ids, attn = with_hole(ids, attn)
    assert_fast_forward_matches_hf(model, ids, attn, t)


def assert_fast_forward_matches_hf(model, ids, attn, t):
    """The written-out training forward's log-probs and every parameter's gradient equal the Hugging Face forward's."""
    (hf_logp, hf_grads), (fast_logp, fast_grads) = hf_and_fast_logprobs(model, ids, attn, t)
    torch.testing.assert_close(fast_logp, hf_logp, atol=1e-5, rtol=0)
    assert fast_grads.keys() == hf_grads.keys() and len(hf_grads) == len(list(model.parameters()))
    for k, g in hf_grads.items():
        assert g.abs().max() > 0, k
        # float32 rounding: each side is a few 1e-6 of the largest entry from a float64 run
        torch.testing.assert_close(fast_grads[k], g, atol=2e-6 * g.abs().max().item(), rtol=1e-4, msg=k)


def assert_bfloat16_forward_as_exact_as_hf(model, ids, attn, t):
    """In bf16 the written-out forward and the Hugging Face one round at different places, so neither equals the
    other; both should be as near the float32 forward of the same (bf16) weights. The bound is the Hugging Face bf16
    run's own distance from float32, measured here, doubled, plus one bf16 rounding of each value (2^-7 of it: the
    two sides may round a value to neighbouring bf16 numbers): the log-probs, and each gradient with 1% of its
    largest entry besides (a tensor where bf16 happens to round little). A machine's rounding moves both sides
    alike, so the bound follows it."""
    hf, fast = hf_and_fast_logprobs(model, ids, attn, t)
    exact, _ = hf_and_fast_logprobs(copy.deepcopy(model).float(), ids, attn, t)
    own = (hf[0].float() - exact[0]).abs().max().item()
    assert own > 0
    torch.testing.assert_close(fast[0].float(), exact[0], atol=2 * own, rtol=2 ** -7)
    for k, g in exact[1].items():
        bound = 2 * (hf[1][k] - g).abs().max().item() + 1e-2 * g.abs().max().item()
        torch.testing.assert_close(fast[1][k], g, atol=bound, rtol=2 ** -7, msg=k)


def assert_close_in_bfloat16(got, want):
    """(log-probs, {name: gradient}) pairs from bf16 runs: log-probs within 3e-2, each gradient within 3% of its
    largest entry (bf16 rounds each side differently)."""
    torch.testing.assert_close(got[0], want[0], atol=3e-2, rtol=0)
    for k, g in want[1].items():
        torch.testing.assert_close(got[1][k], g, atol=3e-2 * g.abs().max().item(), rtol=5e-2, msg=k)


def eager_and_compiled(model, ids, attn, t):
    """(log-probs, float gradients of their sum) through the eager layers, then through the compiled ones."""
    out = []
    for compiled in (False, True):
        model.zero_grad(set_to_none=True)
        logp, _ = logprobs.completion_logprobs(model, ids, attn, t, 0.8, fast_forward=True, compile_layers=compiled)
        logp.sum().backward()
        out.append((logp.detach(), {k: p.grad.float() for k, p in model.named_parameters()}))
    return out


@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_layers_trace_whole_and_match_eager(traced_layers, checkpointing):
    """compile_layers: every layer and micro-batch shape runs one traced graph of the layer (no graph
    break, no retrace), with the eager forward's log-probs and gradients."""
    model, tok = tiny_model()
    model.train()
    if checkpointing:
        model_loading.enable_checkpointing(model)
    batches = [with_completions(prompts(tok), 6, seed=3), with_completions(prompts(tok), 4, seed=4, last=7)]
    for ids, attn in batches + batches[:1]:
        out = eager_and_compiled(model, ids, attn, 3)
        torch.testing.assert_close(out[1][0], out[0][0], atol=1e-6, rtol=0)
        for k, g in out[0][1].items():
            torch.testing.assert_close(out[1][1][k], g, atol=1e-7, rtol=1e-5, msg=k)
    assert len(traced_layers) == 1


@cuda
def test_compiled_layers_match_eager_on_cuda():
    """The same, compiled for real (Inductor, Triton), in bf16 with and without checkpointing."""
    model, tok = tiny_model()
    model = model.to("cuda", torch.bfloat16).train()
    ids, attn = with_completions(prompts(tok, "cuda"), 6, seed=3)
    for checkpointing in (False, True):
        if checkpointing:
            model_loading.enable_checkpointing(model)
        out = eager_and_compiled(model, ids, attn, 6)
        assert_close_in_bfloat16(out[1], out[0])


def test_training_forward_matches_hf_forward_in_bfloat16():
    model, tok = tiny_model()
    model = model.to(torch.bfloat16).train()
    enc = prompts(tok)
    t = 3
    ids, attn = with_completions(enc, t, seed=4)
    assert_bfloat16_forward_as_exact_as_hf(model, ids, attn, t)


def test_training_forward_checkpoints_its_layers(tmp_path):
    """With activation checkpointing on, the fast forward keeps far fewer activations for backward (bytes of
    the saved tensors that are not parameters), same gradients."""
    path = model_loading.write_tiny_model(str(tmp_path / "m"))
    ids = torch.arange(40).view(2, 20) + 3
    saved, grads = [], []
    for ckpt in (False, True):
        model = model_loading.load_model(path, {"attn_implementation": "sdpa"}, "cpu", seed=0, gradient_checkpointing=ckpt)
        model.train()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        kept = [0]

        def pack(x):
            if x.untyped_storage().data_ptr() not in params:  # a weight saved for backward costs no memory
                kept[0] += x.numel() * x.element_size()
            return x
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            logp, _ = logprobs.completion_logprobs(model, ids, torch.ones_like(ids), 8, fast_forward=True)
        logp.sum().backward()
        saved.append(kept[0])
        grads.append({k: p.grad for k, p in model.named_parameters()})
    assert saved[1] < saved[0] / 3, saved  # 2 layers: about 0.16 on torch 2.11 and 2.13
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], atol=1e-6, rtol=1e-5, msg=k)


def test_training_forward_falls_back_where_it_does_not_apply():
    model, _ = tiny_model(attention_dropout=0.1)
    assert transformer.decide(model.eval()).trains_written_out(model.eval())  # dropout is off in eval mode
    assert not transformer.decide(model.train()).trains_written_out(model.train())
    model, _ = tiny_model()
    lora.add_lora(model, rank=2, alpha=4, target_modules=["q_proj", "v_proj"])
    assert transformer.decide(model).trains_written_out(model)  # adapted projections are read with their adapters
    model.model.layers[0].self_attn.q_proj = torch.nn.Sequential(model.model.layers[0].self_attn.q_proj)
    assert not transformer.decide(model).trains_written_out(model)  # a projection it does not know


def test_default_dtype_is_float32_on_cpu(tmp_path):
    path = model_loading.write_tiny_model(str(tmp_path / "m"))
    assert model_loading.load_model(path, {}, "cpu").dtype == torch.float32


# ----------------------------------------------------------------------------- CUDA-only paths


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_fused_head_matches_eager_chunks(dtype):
    """The compiled chunk math (the default on CUDA) against the eager chunks: log-probs, entropy, both gradients."""
    g = torch.Generator().manual_seed(3)
    n, v, h = 300, 1000, 64
    hidden0 = torch.randn(n, h, generator=g).to("cuda", dtype)
    weight0 = (torch.randn(v, h, generator=g) * 0.3).to("cuda", dtype)
    targets = torch.randint(0, v, (n,), generator=g).cuda()
    upstream = torch.randn(n, generator=g).cuda()
    out = []
    for fused, chunk in ((False, 7), (True, 7), (True, 1000)):
        hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
        chunked = logprobs._FusedTokenLogprobs if fused else logprobs._ChunkedTokenLogprobs
        logp, ent = chunked.apply(hidden, weight, targets, 0.7, chunk)
        (logp * upstream).sum().backward()
        out.append((logp.detach(), ent, hidden.grad.float(), weight.grad.float()))
    for got in out[1:]:
        for a, b in zip(got, out[0]):
            # bf16: the (rows, H) and (V, H) products round per chunk, so entries compare against the largest
            tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2 * b.abs().max().item(), rtol=2e-2)
            torch.testing.assert_close(a, b, **tol)
    assert out[0][3].abs().max() > 0


@cuda
# left padding moved to the row's end and no padding: causal, enable_gqa; a hole: masked, K/V copied per head
@pytest.mark.parametrize("padding", ["left", "none", "holes"])
def test_cuda_training_forward_matches_hf_forward(padding):
    model, tok = tiny_model()
    model = model.to("cuda", torch.bfloat16).train()
    enc = prompts(tok, "cuda")
    t = 3
    ids, attn = with_completions(enc, t, seed=5, last=5 if padding == "none" else None)
    if padding == "holes":
        ids, attn = with_hole(ids, attn)
    assert_bfloat16_forward_as_exact_as_hf(model, ids, attn, t)
