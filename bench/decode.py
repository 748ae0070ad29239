"""the bench's sampler rows: decode against model.generate (one model, and each family of tests/architectures.py),
multi-turn rollouts with appended answers against re-running the sampler, and decode's share of the copy
bandwidth."""

import functools
import os
import statistics
import sys

import torch

import model_loading
import sampling
from features import sampler_options
from bench.common import free, letter_prompts, load, medians, timed


# ----------------------------------------------------------------------------- decode: our sampler vs generate


def decode_pair(model, enc, t, pad_id, knobs):
    """(ours, generate): our sampler and `model.generate` on the same prompts and sampling settings `knobs`, each
    row decoding all t new tokens: no EOS on either side (no stop checks in generate, no stop ids in ours).
    ours(max_new, **kw) takes a shorter length and further `sampler_options.sample` keywords."""
    def ours(max_new=t, **kw):
        r = sampler_options.sample(model, enc.input_ids, enc.attention_mask, max_new_tokens=max_new, eos_ids=[],
                            pad_id=pad_id, **knobs, **kw)
        assert bool(r.completion_mask.all()) and r.completion_ids.shape[1] == max_new
        return r

    def generate():
        with torch.no_grad():
            out = model.generate(input_ids=enc.input_ids, attention_mask=enc.attention_mask, do_sample=True,
                                 max_new_tokens=t, eos_token_id=None, pad_token_id=pad_id, **knobs)
        assert out.shape[1] == enc.input_ids.shape[1] + t
        return out

    return ours, generate



def bench_decode(path, s, device):
    tokenizer = model_loading.load_tokenizer(path)
    model = load(path, s, device).eval()
    n, t = s["decode_batch"], s["decode_new_tokens"]
    enc = letter_prompts(tokenizer, n, s["decode_prompt_len"], device)
    knobs = dict(temperature=s["temperature"], top_k=s["top_k"], top_p=s["top_p"])
    ours, generate = decode_pair(model, enc, t, tokenizer.pad_token_id, knobs)
    med = medians({"ours": ours, "generate": generate, "ours_hf_forward": lambda: ours(static_cache=False)}, s, device)
    out = {f"decode_{k}_tokens_per_s": n * t / v for k, v in med.items()}
    out["sampler_speedup_vs_generate"] = med["generate"] / med["ours"]
    out["sampler_hf_forward_speedup_vs_generate"] = med["generate"] / med["ours_hf_forward"]

    # compaction: rows that finish early leave the decode batch. Enough ids count as EOS here (2 / t of the
    # vocabulary: near-uniform random weights then stop a row after about t / 2 tokens) that rows stop at
    # scattered lengths. In float32 the tokens must be identical either way; in bf16 a smaller batch may take
    # other matmul kernels whose rounding moves a few draws, so the share of identical rows is reported.
    stop_ids = list(range(40, 40 + max(1, round(2 * model.config.vocab_size / t))))
    def stopping(compact):
        return sampler_options.sample(model, enc.input_ids, enc.attention_mask, max_new_tokens=t, eos_ids=stop_ids,
                               pad_id=tokenizer.pad_token_id, compact=compact, **knobs)
    ct = {True: [], False: []}
    for _ in range(s["warmup"]):
        a, b = stopping(True), stopping(False)
        same = (a.completion_ids == b.completion_ids).all(1).float().mean().item()
        assert same == 1.0 or s["dtype"] != "float32", "compaction changed the sampled tokens"
    for _ in range(s["reps"]):
        for c in (True, False):
            ct[c].append(timed(lambda: stopping(c), device)[0])
    out["compaction_speedup"] = statistics.median(ct[False]) / statistics.median(ct[True])
    out["compaction_mean_length_frac"] = a.completion_mask.sum(1).float().mean().item() / t
    out["compaction_identical_rows_frac"] = same  # from the last warm-up pair

    if device.type == "cuda":
        out.update(decode_bandwidth(model, enc, ours, s, device))
    return out


# ----------------------------------------------------------------------------- families: decode per architecture


def bench_families(s, device):
    """Our sampler vs `model.generate` on a random model of each family in tests/architectures.py, one after
    the other in one run: the same prompts, the same number of new tokens (no EOS on either side), the same
    sampling settings. Per family: tokens/s of each, their ratio, that ratio over Llama's (a family on the
    fast path should not fall below 0.85 of it), and the path the sampler took, asked of transformer at run
    time, since which families it decodes changes as families are added."""
    # the family table (configs, randomised norms and biases) is the tests' own: one table for both to grow
    tests_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    import architectures
    from layers import transformer
    n, t, hidden = s["fam_batch"], s["fam_new_tokens"], s["fam_hidden"]
    heads = architectures.COMMON["num_attention_heads"]
    knobs = dict(temperature=s["temperature"], top_k=s["top_k"], top_p=s["top_p"])
    out = {}
    chosen = [f for f in s["fam_names"].split(",") if f]
    unknown = set(chosen) - set(architectures.FAMILIES)
    if unknown:
        raise SystemExit(f"--set fam_names: unknown families {sorted(unknown)} ({', '.join(architectures.FAMILIES)})")
    for name in architectures.FAMILIES:
        if (chosen and name != "llama" and name not in chosen) or (s["fam_shapes"] == "real" and name not in REAL_SHAPES):
            continue
        try:
            if s["fam_shapes"] == "real":
                model, tok = real_shaped(architectures, name, device, getattr(torch, s["dtype"]))
            else:
                # wider than the tests' 64, where a CPU decode step is nearly all framework overhead: the matmuls count
                model, tok = architectures.tiny(name, hidden_size=hidden, head_dim=hidden // heads)
                model.to(device=device, dtype=getattr(torch, s["dtype"]))
            if s["fam_lora"]:  # adapters on every linear layer and expert weight ("all"), B random so they count
                architectures.adapt(model, s["fam_lora"], "all", scale=0.01)
            enc = letter_prompts(tok, n, s["fam_prompt_len"], device)
            path = "fast" if transformer.decide(model).samples_written_out() else "hf"

            ours, generate = decode_pair(model, enc, t, tok.pad_token_id, knobs)
            med = medians({"ours": ours, "generate": generate}, s, device)
            out[name] = {"path": path, "params": sum(p.numel() for p in model.parameters()),
                         "layers": model.config.num_hidden_layers, "ours_tokens_per_s": n * t / med["ours"],
                         "generate_tokens_per_s": n * t / med["generate"],
                         "speedup_vs_generate": med["generate"] / med["ours"]}
            print(f"  {name}: {path}, {out[name]['speedup_vs_generate']:.2f}x model.generate", flush=True)
        except Exception as e:  # one family that fails to build or sample is reported, the others still run
            out[name] = {"path": "error", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        finally:
            model = None  # gone before the next family's is built
            free(device)
    llama = out.get("llama", {}).get("speedup_vs_generate")
    for r in out.values():
        r["ratio_over_llama"] = r["speedup_vs_generate"] / llama if llama and "speedup_vs_generate" in r else None
    fast = [r["ratio_over_llama"] for k, r in out.items() if k != "llama" and r["path"] == "fast" and
            r["ratio_over_llama"] is not None]
    return {"families": out, "families_fast_min_ratio_over_llama": min(fast) if fast else None}


# Published shapes (their config.json files), for `--set fam_shapes=real` on a GPU: random weights at the real
# widths, heads, experts, windows and vocabularies. The MoE models and Qwen3.5 keep 8 of their layers (each layer's
# shapes are the real ones; all 48 of Qwen3-30B-A3B's would take 61 GB and minutes to build), the dense ones all.
REAL_SHAPES = {
    "llama": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,  # Llama-3.2-1B
                  num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                  attention_bias=False, mlp_bias=False, rope_theta=500000.0),
    "qwen3": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,  # Qwen3-0.6B
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3_moe": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=8,
                      num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,  # Qwen3-30B-A3B
                      num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936),
    "qwen3_5": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=8, num_attention_heads=16,
                    num_key_value_heads=4, head_dim=256, vocab_size=248320, linear_num_key_heads=16,  # transformers'
                    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,  # defaults
                    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2),
    "gpt_oss": dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=8, num_attention_heads=64,  # gpt-oss-20b
                    num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                    sliding_window=128, vocab_size=201088, max_position_embeddings=131072,
                    layer_types=["sliding_attention", "full_attention"] * 4),
    "gemma3": dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,  # Gemma-3-1B
                   num_key_value_heads=1, head_dim=256, vocab_size=262144, sliding_window=512,
                   query_pre_attn_scalar=256, tie_word_embeddings=True,
                   layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 4 + ["sliding_attention"] * 2),
}


def real_shaped(architectures, name, device, dtype):
    """(model, tokenizer): family `name` at its published shape (REAL_SHAPES), random weights built on `device`."""
    from transformers import AutoModelForCausalLM
    if name not in REAL_SHAPES:
        raise ValueError(f"no published shape for {name} in REAL_SHAPES")
    shape = dict(REAL_SHAPES[name])
    tok = model_loading.build_byte_tokenizer()
    tok.padding_side = "left"
    vocab = shape.pop("vocab_size")
    cfg = architectures.config(name, tok, **shape)
    cfg.vocab_size = vocab  # the tokenizer's ids are a few hundred; the head and embeddings keep the real size
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype,
                                                 attn_implementation="eager" if name == "gpt_oss" else "sdpa")
    return model.eval(), tok


# ----------------------------------------------------------------------------- multi-turn: answers appended vs re-run


def bench_multiturn(path, s, device):
    """Rollouts of several turns, an environment's answer of `mt_answer_tokens` tokens after each: our sampler,
    which appends each answer to the paused rows' KV cache, against running the sampler again from the prompt
    for every turn, the prompt then holding the conversation so far (what TRL does without vLLM). Both sample
    with the same settings (not the same draws: a re-run restarts each row's random stream), so the turns and
    tokens they generate are reported beside the times; a turn ends at one of a few stop ids, after about
    `mt_turn_tokens` tokens."""
    tokenizer = model_loading.load_tokenizer(path)
    model = load(path, s, device).eval()
    n, budget, turns, k = s["mt_batch"], s["mt_new_tokens"], s["mt_turns"], s["mt_answer_tokens"]
    enc = letter_prompts(tokenizer, n, s["mt_prompt_len"], device)
    stop_ids = list(range(40, 40 + max(1, round(model.config.vocab_size / s["mt_turn_tokens"]))))
    pad = tokenizer.pad_token_id

    def answer(row, ids):
        return [100 + (row + len(ids) + j) % 20 for j in range(k)]  # fixed by the row and its length so far

    def ours():
        respond = lambda ts: [answer(t.row, t.ids) for t in ts]  # noqa: E731
        r = sampler_options.sample(model, enc.input_ids, enc.attention_mask, max_new_tokens=budget, eos_ids=stop_ids,
                            pad_id=pad, respond=respond, max_turns=turns)
        fed = enc.attention_mask.sum().item() + int((r.completion_mask - r.policy_mask).sum())  # prompts + answers
        ours.turns = r.turns.float().mean().item()
        return [row[:m].tolist() for row, m in zip(r.completion_ids, r.completion_mask.sum(1))], fed

    def rerun():
        done = [[] for _ in range(n)]
        live, fed = list(range(n)), 0
        prompts = [row[m.bool()].tolist() for row, m in zip(enc.input_ids, enc.attention_mask)]
        for turn in range(turns):
            if not live:
                break
            text = [prompts[i] + done[i] for i in live]
            width = max(len(x) for x in text)
            ids = torch.tensor([[pad] * (width - len(x)) + x for x in text], device=device)
            attn = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in text], device=device)
            fed += int(attn.sum())  # every turn prefills the whole conversation again
            room = budget - min(len(done[i]) for i in live)
            r = sampler_options.sample(model, ids, attn, max_new_tokens=room, eos_ids=stop_ids, pad_id=pad,
                                seeds=torch.tensor(live, device=device) + 1000 * turn)
            still = []
            for j, i in enumerate(live):
                new = r.completion_ids[j, :r.completion_mask[j].sum()].tolist()[:budget - len(done[i])]
                done[i] += new
                ended = bool(new) and new[-1] in stop_ids
                if ended and turn + 1 < turns and len(done[i]) + k < budget:
                    done[i] += answer(i, done[i])
                    still.append(i)
            live = still
        return done, fed

    times, work = {"ours": [], "rerun": []}, {}
    for _ in range(s["warmup"]):
        ours(), rerun()
    for _ in range(s["reps"]):
        for key, fn in (("ours", ours), ("rerun", rerun)):
            elapsed, (trajectories, fed) = timed(fn, device)
            times[key].append(elapsed)
            work.setdefault(key, []).append((fed, statistics.mean(len(x) for x in trajectories)))
    med = {key: statistics.median(v) for key, v in times.items()}
    fed = {key: statistics.mean(f for f, _ in v) for key, v in work.items()}
    length = {key: statistics.mean(m for _, m in v) for key, v in work.items()}
    return {"multiturn_speedup_vs_rerun": med["rerun"] / med["ours"], "multiturn_ours_s": med["ours"],
            "multiturn_rerun_s": med["rerun"], "multiturn_prefill_tokens_ours": fed["ours"],
            "multiturn_prefill_tokens_rerun": fed["rerun"], "multiturn_prefill_ratio": fed["rerun"] / fed["ours"],
            "multiturn_mean_turns": ours.turns, "multiturn_mean_length_ours": length["ours"],
            "multiturn_mean_length_rerun": length["rerun"]}


@functools.cache  # once per run: the step and long rows share it
def copy_bandwidth(device, nbytes=1 << 30):
    """Bytes read + written per second by a large device-to-device copy: the machine's memory ceiling."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.copy_(x)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / statistics.median(times)


def decode_bandwidth(model, enc, ours, s, device):
    """Achieved bandwidth of one decode step: weights + the filled KV cache read, over the step time.

    The step time is (t_full - t_one) / (t - 1): a whole completion minus a prefill-and-one-token run.
    KV bytes count the filled slots only (prompt + half the completion on average), not the padding up
    to the cache's capacity, so the figure does not flatter the kernel for reading empty slots.
    """
    t = s["decode_new_tokens"]
    full = statistics.median(timed(ours, device)[0] for _ in range(3))
    one = statistics.median(timed(lambda: ours(max_new=1), device)[0] for _ in range(3))
    step = (full - one) / (t - 1)
    nbytes = decode_bytes_per_step(model, s["decode_batch"], s["decode_prompt_len"] + t / 2)
    achieved = nbytes / step
    ceiling = copy_bandwidth(device)
    return {"decode_step_s": step, "decode_bytes_per_step": nbytes,
            "decode_bandwidth_GBps": achieved / 1e9, "copy_bandwidth_GBps": ceiling / 1e9,
            "decode_bandwidth_frac_of_copy": achieved / ceiling}


def decode_bytes_per_step(model, rows, mean_len):
    """Bytes one decode step must read: every weight once, and the K and V of `mean_len` filled positions per row."""
    cfg = model.config
    elt = next(model.parameters()).element_size()
    weight_bytes = sum(p.numel() for p in model.parameters()) * elt
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return weight_bytes + 2 * cfg.num_hidden_layers * rows * cfg.num_key_value_heads * head_dim * mean_len * elt
