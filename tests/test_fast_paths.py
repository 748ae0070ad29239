"""The sampler's fast paths compute what the simple ones do.

StaticDecoder (preallocated cache, fused projections, row compaction, CUDA
graphs on GPU) and the Gumbel-max draw against the Hugging Face forward over a
DynamicCache and plain Python. The training forward's fast paths are in
test_training_forward.py, which shares this file's tiny models and prompts.
"""

import os
import sys

import math

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpo  # noqa: E402

import logprobs  # noqa: E402
import sampling  # noqa: E402
from features import sampler_options  # noqa: E402
import model_loading  # noqa: E402
from layers import engine, transformer  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def tiny_model(arch="qwen2", **overrides):
    from transformers import AutoModelForCausalLM, LlamaConfig

    tok = model_loading.build_byte_tokenizer()
    tok.padding_side = "left"
    torch.manual_seed(0)
    if arch == "llama":
        # biases in attention and MLP exercise the bias slots of the fused weights
        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=1, attention_bias=True, mlp_bias=True,
                          tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                          **overrides)
    else:
        cfg = model_loading.tiny_config(tok, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    return model, tok


def prompts(tok, device="cpu"):
    text = ["a>", "hello world>", "xyz", "b>" * 7, "q", "the quick brown fox>"]
    return tok(text, return_tensors="pt", padding=True, add_special_tokens=False).to(device)



def with_completions(enc, t, seed, last=None):
    """(ids, attention mask) of the prompts followed by t random completion tokens: every position that
    predicts a completion token is a real token, not padding. last: keep only the last columns, as rows
    with no padding at all."""
    comp = torch.randint(0, 256, (enc.input_ids.shape[0], t), generator=torch.Generator().manual_seed(seed))
    comp = comp.to(enc.input_ids.device)
    ids, attn = torch.cat([enc.input_ids, comp], 1), torch.cat([enc.attention_mask, torch.ones_like(comp)], 1)
    if last is not None:
        ids, attn = ids[:, -last:], torch.ones_like(ids[:, -last:])
    return ids, attn

# many ids count as EOS so that rows stop at scattered lengths and compaction has work to do
STOP_IDS = list(range(97, 123))


def run(model, tok, enc, **kw):
    args = dict(max_new_tokens=24, eos_ids=STOP_IDS, pad_id=tok.pad_token_id, temperature=1.0,
                seeds=torch.arange(enc.input_ids.shape[0]) * 7 + 3, keep_decoder=True)  # kept: tests inspect it
    args.update(kw)
    return sampler_options.sample(model, enc.input_ids, enc.attention_mask, **args)


def assert_same_rollout(a, b, logp_atol=1e-5):
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.completion_mask, b.completion_mask)
    assert torch.equal(a.truncated, b.truncated)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=logp_atol, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_transformer_is_used_for_llama_and_qwen2(arch):
    model, _ = tiny_model(arch)
    assert transformer.decide(model).samples_written_out()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_tokens_identical_to_hf_forward(arch):
    model, tok = tiny_model(arch)
    enc = prompts(tok)
    ref = run(model, tok, enc, temperature=0.0, static_cache=False, eos_ids=[10 ** 6])
    for compact in (True, False):
        assert_same_rollout(run(model, tok, enc, temperature=0.0, compact=compact, eos_ids=[10 ** 6]), ref)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_sampled_tokens_identical_to_hf_forward(arch):
    model, tok = tiny_model(arch)
    enc = prompts(tok)
    seeds = torch.arange(6) * 3  # seeds whose rows end at scattered lengths, most before the first check at 8
    ref = run(model, tok, enc, static_cache=False, seeds=seeds)
    lengths = ref.completion_mask.sum(1)
    assert (lengths <= 8).sum() >= 2 and lengths.max() > 8, "rows should stop at scattered lengths for compaction"
    assert ref.truncated.any() or lengths.max() < 24
    for compact in (True, False):
        for check_every in (1, 8):
            before = getattr(model, "_static_decoder", None)
            before = before.compactions if before is not None else 0
            assert_same_rollout(run(model, tok, enc, compact=compact, check_every=check_every, seeds=seeds), ref)
            assert (model._static_decoder.compactions > before) == compact


def test_unpadded_prompts_identical_to_hf_forward():
    """Prompts of one length take the mask-free decode path."""
    model, tok = tiny_model()
    enc = tok(["abcdef", "ghijkl", "mnopqr"], return_tensors="pt", add_special_tokens=False)
    assert enc.attention_mask.all()
    assert_same_rollout(run(model, tok, enc, seeds=torch.arange(3)), run(model, tok, enc, seeds=torch.arange(3), static_cache=False))


def test_filters_and_temperature_identical_to_hf_forward():
    model, tok = tiny_model()
    enc = prompts(tok)
    for kw in (dict(temperature=0.7, top_k=20), dict(temperature=1.3, top_p=0.9)):
        assert_same_rollout(run(model, tok, enc, **kw), run(model, tok, enc, static_cache=False, **kw))


def test_row_does_not_depend_on_its_batch():
    """A row sampled alone equals the same row sampled among others (padding, compaction, companions)."""
    model, tok = tiny_model()
    enc = prompts(tok)
    full = run(model, tok, enc)
    for i in (1, 4):
        alone = tok([tok.decode(enc.input_ids[i][enc.attention_mask[i].bool()])], return_tensors="pt",
                    add_special_tokens=False)
        one = run(model, tok, alone, seeds=torch.tensor([i * 7 + 3]))
        L = one.completion_ids.shape[1]
        assert torch.equal(one.completion_ids[0], full.completion_ids[i, :L])
        assert (full.completion_mask[i, L:] == 0).all()


def test_sampler_logprobs_equal_training_forward():
    model, tok = tiny_model()
    enc = prompts(tok)
    r = run(model, tok, enc, temperature=0.8)
    ids = torch.cat([enc.input_ids, r.completion_ids], 1)
    attn = torch.cat([enc.attention_mask, torch.ones_like(r.completion_ids)], 1)
    with torch.no_grad():
        logp, _ = logprobs.completion_logprobs(model, ids, attn, r.completion_ids.shape[1], temperature=0.8)
    torch.testing.assert_close(logp * r.completion_mask, r.logprobs, atol=1e-5, rtol=0)


def test_prefill_and_decode_logits_match_hf_forward():
    model, tok = tiny_model()
    enc = prompts(tok)
    n, p = enc.input_ids.shape
    pos = logprobs.position_ids_from_mask(enc.attention_mask)
    dec = engine.StaticDecoder.for_model(model, n, p + 4)
    with torch.no_grad():
        got = dec.prefill(enc.input_ids, enc.attention_mask, pos)
        want = model(input_ids=enc.input_ids, attention_mask=enc.attention_mask, position_ids=pos).logits[:, -1]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        nxt = torch.arange(n) + 5
        got = dec.decode(nxt, p)
        ids = torch.cat([enc.input_ids, nxt[:, None]], 1)
        attn = torch.cat([enc.attention_mask, torch.ones(n, 1, dtype=torch.long)], 1)
        want = model(input_ids=ids, attention_mask=attn, position_ids=logprobs.position_ids_from_mask(attn)).logits[:, -1]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("sdpa", [False, True])
def test_graph_safe_decode_form_matches_eager_on_cpu(arch, sdpa):
    """The decode body CUDA graphs capture (slot as a tensor, attention over a wider masked span, through
    SDPA as on CUDA) gives the logits and cache of the eager form; run here on the CPU, since the graphs
    themselves need a GPU."""
    model, tok = tiny_model(arch)
    enc = prompts(tok)
    n, p = enc.input_ids.shape
    pos = logprobs.position_ids_from_mask(enc.attention_mask)
    dec = engine.StaticDecoder.for_model(model, n, p + 8, cuda_graph=False)
    logits, caches = {}, {}
    for form in ("eager", "graph"):
        # SDPA as on CUDA (None), or the eager reference: the CPU matmul attention
        dec.decode_kernel = None if sdpa and form == "graph" else engine._decode_plain
        with torch.no_grad():
            dec.prefill(enc.input_ids, enc.attention_mask, pos)
            out = []
            for t in range(3):
                tok_t = torch.arange(n) * 3 + t + 5
                slot = p + t
                if form == "eager":
                    out.append(dec._decode_body(tok_t, slot, slot + 1, 0))
                else:
                    out.append(dec._decode_body(tok_t, torch.tensor([slot]), dec.max_len, 0))  # every slot, masked
        logits[form] = torch.stack(out)
        caches[form] = (dec.k_cache[:, :n, :, :p + 3].clone(), dec.v_cache[:, :n, :, :p + 3].clone())
    torch.testing.assert_close(logits["graph"], logits["eager"], atol=1e-5, rtol=1e-5)
    for a, b in zip(caches["graph"], caches["eager"]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert caches["graph"][0][:, :, :, p:].abs().sum() > 0  # the decode steps wrote their slots


def test_decoder_copy_follows_weight_updates():
    """The decoder keeps its own copy of the weights between calls; a changed model must be seen."""
    model, tok = tiny_model()
    enc = prompts(tok)
    run(model, tok, enc, temperature=0.0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    # weights this large give large logits: float32 rounding in the log-probs differs by up to ~3e-5
    # between the two computations on some CPUs, so the tolerance is looser than elsewhere
    assert_same_rollout(run(model, tok, enc, temperature=0.0, eos_ids=[10 ** 6]),
                        run(model, tok, enc, temperature=0.0, eos_ids=[10 ** 6], static_cache=False), logp_atol=1e-4)


def test_decoder_memory_is_freed_unless_kept():
    model, tok = tiny_model()
    enc = prompts(tok)
    kept = run(model, tok, enc)
    assert getattr(model, "_static_decoder", None) is not None
    freed = run(model, tok, enc, keep_decoder=False)
    assert getattr(model, "_static_decoder", None) is None
    assert_same_rollout(freed, kept)


def test_decoder_grows_for_longer_and_larger_batches():
    model, tok = tiny_model()
    enc = prompts(tok)
    run(model, tok, enc, max_new_tokens=4)
    small = model._static_decoder
    big = tok(["z" * 90] * 9, return_tensors="pt", add_special_tokens=False)
    assert_same_rollout(run(model, tok, big, max_new_tokens=50, seeds=torch.arange(9)),
                        run(model, tok, big, max_new_tokens=50, seeds=torch.arange(9), static_cache=False))
    assert model._static_decoder is not small and model._static_decoder.max_len >= 140


def test_unsupported_architecture_falls_back_to_hf_forward():
    from transformers import AutoModelForCausalLM, GPT2Config

    tok = model_loading.build_byte_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2,
                                                        n_positions=128)).eval()
    assert not transformer.decide(model).samples_written_out()
    tok.padding_side = "left"
    r = run(model, tok, prompts(tok))
    assert r.completion_ids.shape[0] == 6


def test_sliding_window_layers_take_the_fast_path():
    """Windows shorter than the rows (more in test_static_families.py)."""
    model, tok = tiny_model(use_sliding_window=True, sliding_window=5, max_window_layers=0)
    assert transformer.decide(model).samples_written_out()
    enc = prompts(tok)
    assert_same_rollout(run(model, tok, enc), run(model, tok, enc, static_cache=False))


def _naive_mix32(x):
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2 ** 32
    x ^= x >> 15
    x = (x * 0x846CA68B) % 2 ** 32
    return x ^ (x >> 16)


def naive_gumbel(seed, step, vocab):
    """One row's noise in plain Python integers and doubles, straight from the hash's definition."""
    key = _naive_mix32((seed * 0x9E3779B1 + (step + 1) * 0x85EBCA77) % 2 ** 32)
    out = []
    for i in range(vocab):
        u = ((_naive_mix32((key ^ (i * 0x27D4EB2F)) % 2 ** 32) >> 9) + 0.5) / 2 ** 23
        out.append(-math.log(-math.log(u)))
    return torch.tensor(out, dtype=torch.float64)


def test_gumbel_max_sampling_equals_naive():
    """Draw.whole picks argmax(logits / T + noise) with the noise of the row's own (seed, step)."""
    g = torch.Generator().manual_seed(0)
    seeds = torch.tensor([0, 1, 7, 2 ** 40 + 3, 123456789])
    logits = torch.randn(5, 300, generator=g) * 3
    for temperature in (1.0, 0.7):
        tok, lp = sampling.Draw(temperature, 0, 1.0).whole(logits, sampling.row_keys(seeds, 4))
        for i, seed in enumerate(seeds.tolist()):
            noisy = logits[i].double() / temperature + naive_gumbel(seed, 4, 300)
            top2 = noisy.topk(2).values
            assert tok[i] == noisy.argmax() or top2[0] - top2[1] < 1e-5  # or a float32 near-tie
        want_lp = torch.log_softmax(logits / temperature, -1).gather(-1, tok[:, None])[:, 0]
        torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
    noise = sampling.gumbel_noise(sampling.row_keys(seeds, 4), 300)
    for i, seed in enumerate(seeds.tolist()):
        torch.testing.assert_close(noise[i].double(), naive_gumbel(seed, 4, 300), atol=1e-5, rtol=1e-6)


def test_gumbel_sampling_never_picks_a_token_without_mass():
    """A large vocabulary with whole stretches at -inf, filtered rows, and the extremes of the noise."""
    g = torch.Generator().manual_seed(1)
    n, v = 500, 10_000
    logits = torch.randn(n, v, generator=g) * 4
    logits[:, 1024:3072] = float("-inf")
    logits[: n // 2, :1024] = float("-inf")
    keys = sampling.row_keys(torch.arange(n), 7)
    tok, lp = sampling.Draw(1.0, 0, 1.0).whole(logits, keys)
    assert torch.isfinite(logits.gather(1, tok[:, None])).all()
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0], atol=1e-5, rtol=0)
    tok_k, lp_k = sampling.Draw(1.0, 5, 1.0).whole(logits, keys)  # top-5: one of each row's five largest
    top5 = logits.topk(5).values
    assert (logits.gather(1, tok_k[:, None]) >= top5[:, -1:]).all()
    # its log-prob renormalised over those five: the distribution that drew it
    torch.testing.assert_close(lp_k, logits.gather(1, tok_k[:, None])[:, 0] - top5.logsumexp(-1), atol=1e-5, rtol=0)
    noise = sampling.gumbel_noise(sampling.row_keys(torch.arange(2000), 0), 1000)
    assert torch.isfinite(noise).all() and -3 < noise.min() and noise.max() < 17
    assert abs(noise.mean().item() - 0.5772) < 0.01 and abs(noise.std().item() - math.pi / math.sqrt(6)) < 0.01


def test_row_keys_matrix_equals_stepwise():
    seeds = torch.tensor([0, 5, 2 ** 40 + 3])
    mat = sampling.row_keys(seeds[:, None], torch.arange(6)[None, :])
    for t in range(6):
        assert torch.equal(mat[:, t], sampling.row_keys(seeds, t))
    assert mat.unique().numel() == 18 and (mat >= 0).all() and (mat < 2 ** 32).all()


def test_all_rows_finished_but_not_stopped():
    """Under several processes, a rank whose rows all finished keeps decoding (an empty batch) until all agree."""
    model, tok = tiny_model()
    enc = prompts(tok)
    calls = []
    kw = dict(max_new_tokens=20, eos_ids=list(range(250)), all_done=lambda done: calls.append(bool(done.all())),
              check_every=2)
    a, b = run(model, tok, enc, **kw), run(model, tok, enc, static_cache=False, **kw)
    assert calls == [True] * 18  # checks after tokens 2, 4, ..., 18 on each path; the 20th ends the loop
    assert a.completion_mask.sum(1).tolist() == [1] * enc.input_ids.shape[0]
    assert_same_rollout(a, b)


# ----------------------------------------------------------------------------- CUDA-only paths


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decode_matches_eager(dtype):
    model, tok = tiny_model()
    model = model.to("cuda", dtype)
    enc = prompts(tok, "cuda")
    kw = dict(seeds=torch.arange(6, device="cuda") * 7 + 3)
    eager = run(model, tok, enc, cuda_graph=False, **kw)
    graph = run(model, tok, enc, cuda_graph=True, **kw)
    assert_same_rollout(graph, eager, logp_atol=1e-5 if dtype == torch.float32 else 2e-2)
    again = run(model, tok, enc, cuda_graph=True, **kw)  # replayed graphs, no new capture
    assert_same_rollout(again, graph, logp_atol=0)
    if dtype == torch.float32:
        assert_same_rollout(graph, run(model, tok, enc, static_cache=False, **kw), logp_atol=1e-4)


@cuda
def test_cuda_graph_spans_and_buckets_match_eager():
    """Long completions cross several cache spans (one graph each) while compaction shrinks the batch bucket."""
    model, tok = tiny_model()
    model = model.to("cuda")
    enc = prompts(tok, "cuda")
    kw = dict(seeds=torch.arange(6, device="cuda") * 5 + 1, max_new_tokens=300, eos_ids=[97, 98, 99])
    eager = run(model, tok, enc, cuda_graph=False, **kw)
    graph = run(model, tok, enc, cuda_graph=True, **kw)
    assert len({span for _, span in model._static_decoder.graphs.captured}) >= 3
    assert_same_rollout(graph, eager, logp_atol=1e-5)


@cuda
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_cuda_decode_attention_kernel_samples_like_sdpa(arch):
    """The split-KV Triton kernel in the decoder, eager and in graphs (with compaction), against SDPA; the
    llama model's 4 query heads share one KV head."""
    pytest.importorskip("triton")
    from layers import kernels
    model, tok = tiny_model(arch)
    model = model.to("cuda")
    dec_shape = model.config.hidden_size // model.config.num_attention_heads
    assert kernels.triton_supports(dec_shape, model.config.num_attention_heads // model.config.num_key_value_heads)
    enc = prompts(tok, "cuda")
    kw = dict(seeds=torch.arange(6, device="cuda") * 5 + 1, max_new_tokens=100)
    for graph in (False, True):
        sdpa = run(model, tok, enc, cuda_graph=graph, **kw)
        kernel = run(model, tok, enc, cuda_graph=graph, attention_kernel=True, **kw)
        assert model._static_decoder.decode_kernel is engine._decode_kernel
        assert_same_rollout(kernel, sdpa, logp_atol=1e-4)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_compiled_gumbel_sampling_matches_eager(dtype):
    """The compiled sampler (one fused pass over the logits) against the eager Gumbel-max, on a real vocabulary."""
    assert logprobs.fused_head_available("cuda")
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(300, 151_936, generator=g) * 3).to("cuda", dtype)
    keys = sampling.row_keys(torch.arange(300, device="cuda"), 5)
    for n in (300, 17):  # dynamic shapes: one kernel for any number of rows
        tok, lp = sampling.Draw(0.7, 0, 1.0).whole(logits[:n], keys[:n])
        want_tok, want_lp = sampling._gumbel_max(logits[:n], keys[:n], 1 / 0.7)
        # log may round differently compiled: only a near-tie of the two best noisy logits may resolve otherwise
        noisy = logits[:n].float() / 0.7 + sampling.gumbel_noise(keys[:n], logits.shape[1])
        top2 = noisy.topk(2).values
        assert ((tok == want_tok) | (top2[:, 0] - top2[:, 1] < 1e-4)).all()
        same = tok == want_tok
        torch.testing.assert_close(lp[same], want_lp[same], atol=1e-4, rtol=0)
        assert torch.isfinite(lp).all()
    # filtered: the compiled draw over the filtered logits (-inf outside top-k / top-p)
    filtered = sampling.filter_logits(logits.float() / 0.7, 50, 0.9)
    tok, lp = sampling.Draw(0.7, 50, 0.9).whole(logits, keys)
    want_tok, want_lp = sampling._gumbel_max(filtered, keys, 1.0)
    top2 = (filtered + sampling.gumbel_noise(keys, logits.shape[1])).topk(2).values
    assert ((tok == want_tok) | (top2[:, 0] - top2[:, 1] < 1e-4)).all()
    assert torch.isfinite(filtered.gather(1, tok[:, None])).all() and torch.isfinite(lp).all()


@cuda
def test_cuda_greedy_matches_hf_forward():
    model, tok = tiny_model()
    model = model.to("cuda")
    enc = prompts(tok, "cuda")
    a = run(model, tok, enc, temperature=0.0, eos_ids=[10 ** 6])
    b = run(model, tok, enc, temperature=0.0, eos_ids=[10 ** 6], static_cache=False)
    assert torch.equal(a.completion_ids, b.completion_ids)
