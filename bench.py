"""Speed and memory against the baselines people use, measured side by side in one run.

    python bench.py                       # the tiny default model, on CUDA when there is one, else CPU
    python bench.py --json results.json   # also write every figure, the machine, versions and settings
    python bench.py --model=qwen2.5-0.5b  # a Qwen2.5-0.5B-shaped model with random weights (for a GPU); also qwen2.5-1.5b
    python bench.py --model=tiny-qwen3 --only step   # the tiny default with Qwen3's layers, against TRL
    python bench.py --model=qwen2.5-1.5b --only long --set long_new_tokens=8192 --set long_prompts=16
    python bench.py --train gradient_checkpointing=true   # a train.Config setting for our step (step, long rows)
    python bench.py --only exec           # model-written programs through executor.py's sandbox
    python bench.py --only families       # decode against model.generate for each model family

Rows:
  decode   our sampler vs `model.generate`: generated tokens/s, same model, batch, lengths, sampling settings
  families (not run by default) the decode row for a random model of each family in tests/architectures.py
           (Llama, Qwen3, Qwen3-MoE, Qwen3.5, gpt-oss, Gemma and others): tokens/s of each side, the ratio, the
           ratio over Llama's, and whether the sampler took the fast path or the HF forward
  step     one GRPO step (sample, score, reference + policy log-probs, loss, backward, optimizer step) vs
           TRL's GRPOTrainer configured the same way (bench-only dependency; the row is skipped without it)
  memory   peak memory of log-probs + loss + backward with a 151,936-token vocabulary vs the naive full-logits version
  long     (not run by default) one GRPO step of ours with long completions that all run to the limit, gradient
           checkpointing on: step time, sampling / training split, peak memory, tokens/s, bandwidth and MFU
  multiturn rollouts of several turns with an environment's answer after each: our sampler, which appends each
           answer to the paused rows' KV cache, vs the sampler run again from the prompt for every turn (what TRL
           does without vLLM): time and prefilled tokens
  exec     programs per second through executor.py's sandbox vs a plain `subprocess.run([sys.executable, file])`,
           one at a time and in a pool of one worker per CPU; unit-test rewards per second (code_tests_reward) vs
           running the code and its asserts in one plain process (not run by default)
Each pair is measured alternately after a warm-up; figures are medians over the repetitions. Each row prints a
line as it starts and one as it ends, with its time and its main figures (a row can take minutes).
On CUDA, decode is also reported as a fraction of the copy bandwidth and training as MFU (step and long rows).
"""

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import typing

import torch

import cli
import grpo
import sampling
import model_loading
import sharding
import tasks
import train

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, vocab_size=151936)
QWEN25_15B = dict(QWEN25_05B, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12)
# config_class: the same fields under another family's config (tiny_config writes a Qwen2Config); tiny-qwen3 is
# the tiny default with Qwen3's layers (a norm over each head of q and k), head_dim spelled out as Qwen3 needs
MODELS = {"tiny": {}, "tiny-qwen3": dict(config_class="Qwen3Config", head_dim=16), "qwen2.5-0.5b": QWEN25_05B,
          "qwen2.5-1.5b": QWEN25_15B}


def settings_for(args, device):
    """Shapes per machine: small enough for 2 CPU cores, the project's GPU reference on CUDA."""
    gpu = device.type == "cuda"
    s = dict(
        model=args.model, device=str(device), dtype="bfloat16" if gpu else "float32", threads=torch.get_num_threads(),
        # decode row
        decode_batch=512 if gpu else 128, decode_prompt_len=64 if gpu else 16, decode_new_tokens=512 if gpu else 64,
        # step row: P prompts x G completions, micro-batches of `micro_batch` completions
        # (1.5B: micro-batches of 16, as 64 x 576 positions of its activations would not fit on one 80 GB GPU)
        prompts=64 if gpu else 16, num_generations=8, micro_batch=(16 if args.model == "qwen2.5-1.5b" else 64) if gpu else 16,
        step_new_tokens=512 if gpu else 64, beta=0.04, lr=1e-6 if gpu else 1e-3,
        # long row: P x G completions of long_new_tokens each, EOS out of reach; warm-up steps (--warmup of them)
        # run at long_warmup_new_tokens, then long_reps steps are measured
        long_prompts=32 if gpu else 2, long_num_generations=8 if gpu else 4, long_micro_batch=8 if gpu else 4,
        long_new_tokens=4096 if gpu else 256, long_gradient_checkpointing=True,
        long_warmup_new_tokens=256 if gpu else 32, long_reps=1 if gpu else args.reps,
        # memory row
        mem_vocab=151936, mem_rows=8, mem_prompt_len=16, mem_completion_len=256,
        # multiturn row: turns of about mt_turn_tokens tokens, an answer of mt_answer_tokens after each
        mt_batch=256 if gpu else 32, mt_prompt_len=64 if gpu else 16, mt_new_tokens=1024 if gpu else 160,
        mt_turns=4, mt_turn_tokens=64 if gpu else 16, mt_answer_tokens=64 if gpu else 16,
        # exec row: programs per repetition, one at a time and in the pool
        exec_programs=20, exec_pool_programs=32,
        # families row: tests/architectures.py's models at this hidden size (its 4 heads of hidden / 4 each);
        # rows, prompt length and new tokens such that the decode steps dominate the prefill
        fam_hidden=256, fam_batch=64 if gpu else 16, fam_prompt_len=16, fam_new_tokens=256 if gpu else 128,
        fam_names="",  # comma-separated families of tests/architectures.py to run (Llama always, for the ratio); "": all
        temperature=1.0, top_k=0, top_p=1.0, warmup=args.warmup, reps=args.reps,
    )
    return s


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device):
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t, out


def medians(runs, s, device):
    """{name: median seconds} of each function of `runs` ({name: fn}), after s["warmup"] calls of each; the
    s["reps"] timed calls alternate between them, so a machine's drift touches all alike."""
    for _ in range(s["warmup"]):
        for fn in runs.values():
            fn()
    times = {k: [] for k in runs}
    for _ in range(s["reps"]):
        for k, fn in runs.items():
            times[k].append(timed(fn, device)[0])
    return {k: statistics.median(v) for k, v in times.items()}


def build_model_dir(root, args):
    """A model folder with weights (so TRL and we load identical ones) and the byte-level tokenizer."""
    path = os.path.join(root, "model")
    overrides = dict(MODELS[args.model])
    config_class = overrides.pop("config_class", None)
    model_loading.write_tiny_model(path, **overrides)
    if config_class:
        import transformers
        fields = transformers.AutoConfig.from_pretrained(path).to_diff_dict()
        for key in ("model_type", "transformers_version", "architectures"):  # the class's own
            fields.pop(key, None)
        getattr(transformers, config_class)(**fields).save_pretrained(path)
    model = model_loading.load_model(path, {"dtype": "float32"}, "cpu", seed=0)
    model.save_pretrained(path)
    return path


def load(path, s, device):
    return model_loading.load_model(path, {"dtype": s["dtype"], "attn_implementation": "sdpa"}, device, seed=0)


def letter_prompts(tokenizer, n, length, device):
    rng = random.Random(0)
    text = ["".join(rng.choice("abcdefgh") for _ in range(length - 1)) + ">" for _ in range(n)]
    return tokenizer(text, return_tensors="pt", padding=True, add_special_tokens=False).to(device)


# ----------------------------------------------------------------------------- decode: our sampler vs generate


def bench_decode(path, s, device):
    tokenizer = model_loading.load_tokenizer(path)
    model = load(path, s, device).eval()
    n, t = s["decode_batch"], s["decode_new_tokens"]
    enc = letter_prompts(tokenizer, n, s["decode_prompt_len"], device)
    never = [model.config.vocab_size]  # an id no row can sample: every row decodes all t tokens, as generate does below
    knobs = dict(temperature=s["temperature"], top_k=s["top_k"], top_p=s["top_p"])

    def ours(max_new=t, **kw):
        return sampling.sample(model, enc.input_ids, enc.attention_mask, max_new_tokens=max_new, eos_ids=never,
                               pad_id=tokenizer.pad_token_id, **knobs, **kw)

    def generate():
        with torch.no_grad():
            out = model.generate(input_ids=enc.input_ids, attention_mask=enc.attention_mask, do_sample=True,
                                 max_new_tokens=t, min_new_tokens=t, pad_token_id=tokenizer.pad_token_id, **knobs)
        assert out.shape[1] == enc.input_ids.shape[1] + t
        return out

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
        return sampling.sample(model, enc.input_ids, enc.attention_mask, max_new_tokens=t, eos_ids=stop_ids,
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
    fast path should not fall below 0.85 of it), and the path the sampler took, asked of static_decoder at run
    time, since which families it decodes changes as families are added."""
    # the family table (configs, randomised norms and biases) is the tests' own: one table for both to grow
    tests_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests")
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    import architectures
    import static_decoder
    n, t, hidden = s["fam_batch"], s["fam_new_tokens"], s["fam_hidden"]
    heads = architectures.COMMON["num_attention_heads"]
    knobs = dict(temperature=s["temperature"], top_k=s["top_k"], top_p=s["top_p"])
    out = {}
    chosen = [f for f in s["fam_names"].split(",") if f]
    unknown = set(chosen) - set(architectures.FAMILIES)
    if unknown:
        raise SystemExit(f"--set fam_names: unknown families {sorted(unknown)} ({', '.join(architectures.FAMILIES)})")
    for name in architectures.FAMILIES:
        if chosen and name != "llama" and name not in chosen:
            continue
        try:
            # wider than the tests' 64, where a CPU decode step is nearly all framework overhead: the matmuls count
            model, tok = architectures.tiny(name, hidden_size=hidden, head_dim=hidden // heads)
            model.to(device=device, dtype=getattr(torch, s["dtype"]))
            enc = letter_prompts(tok, n, s["fam_prompt_len"], device)
            path = "fast" if static_decoder.static_decode_supported(model) else "hf"

            def ours():
                r = sampling.sample(model, enc.input_ids, enc.attention_mask, max_new_tokens=t, eos_ids=[],
                                    pad_id=tok.pad_token_id, **knobs)
                assert bool(r.completion_mask.all()) and r.completion_ids.shape[1] == t
                return r

            def generate():
                with torch.no_grad():
                    o = model.generate(input_ids=enc.input_ids, attention_mask=enc.attention_mask, do_sample=True,
                                       max_new_tokens=t, eos_token_id=None, pad_token_id=tok.pad_token_id, **knobs)
                assert o.shape[1] == enc.input_ids.shape[1] + t
                return o

            med = medians({"ours": ours, "generate": generate}, s, device)
            out[name] = {"path": path, "ours_tokens_per_s": n * t / med["ours"],
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
        r = sampling.sample(model, enc.input_ids, enc.attention_mask, max_new_tokens=budget, eos_ids=stop_ids,
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
            r = sampling.sample(model, ids, attn, max_new_tokens=room, eos_ids=stop_ids, pad_id=pad,
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


# ----------------------------------------------------------------------------- one GRPO step: ours vs TRL


# train.Config fields that bench.py sets itself (a row's shapes, what TRL's side mirrors): --train refuses them
BENCH_OWNED = {"model": "set by --model", "device": "set by --device", "out_dir": "a temporary folder",
               "task": "next_letter, as on TRL's side", "preset": "train.setup applies none: give its settings one by one",
               "model_init_kwargs": "its dtype is --set dtype", "lr": "set by --set lr", "beta": "set by --set beta",
               "num_generations": "set by --set num_generations / long_num_generations",
               "prompts_per_step": "set by --set prompts / long_prompts",
               "micro_batch_size": "set by --set micro_batch / long_micro_batch",
               "max_completion_length": "set by --set step_new_tokens / long_new_tokens",
               **{k: f"set by --set {k}" for k in ("temperature", "top_k", "top_p")}}


def train_overrides(items, error):
    """--train KEY=VALUE items -> {field: value} for train.Config, cast by train.py's own parser (cli.cast);
    `error(message)` (argparse's) names the key that is no Config field, is bench.py's own, or has a bad value."""
    hints = typing.get_type_hints(train.Config)
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or key not in hints:
            error(f"--train {item!r}: " + (f"{key!r} is not a train.Config field (python train.py --help lists them)"
                                           if eq else "expected KEY=VALUE with KEY a train.Config field"))
        if key in BENCH_OWNED:
            error(f"--train {key}: not accepted, {BENCH_OWNED[key]}")
        try:
            out[key] = cli.cast(key, value, hints[key])
            train.validate(dataclasses.replace(train.Config(), **out))  # a bad value stops before any model loads
        except cli.ConfigError as e:
            error(f"--train {item!r}: {e}")
    return out


class OurStep:
    """train.py's own step (`train.train_step`) on a run built by `train.setup`, on one process.

    `overrides` (--train) are applied last, to any row's run. never_eos: the run's EOS ids are replaced by an id
    past the vocabulary, which no row can sample, so every completion runs to `new_tokens`.
    """

    def __init__(self, path, s, device, root, prompts, num_generations, micro_batch, new_tokens, overrides=None,
                 never_eos=False, **config):
        # TRL's default AdamW betas and no decay, so both sides do the same work; no checkpoints or logs
        cfg = train.Config(model=path, device=str(device), model_init_kwargs={"dtype": s["dtype"],
                           "attn_implementation": "sdpa"}, task="next_letter", num_generations=num_generations,
                           prompts_per_step=prompts, micro_batch_size=micro_batch, lr=s["lr"],
                           adam_beta1=0.9, adam_beta2=0.999, weight_decay=0.0, beta=s["beta"],
                           temperature=s["temperature"], top_k=s["top_k"], top_p=s["top_p"],
                           max_completion_length=new_tokens, max_prompt_length=512, out_dir=root,
                           save_every=0, print_completions_every=0, **config)
        cfg = dataclasses.replace(cfg, **(overrides or {}))
        train.validate(cfg)
        one = sharding.Dist(rank=0, local_rank=0, world_size=1, device=device)
        self.run = train.setup(cfg, one)
        self.policy = self.run.policy.lm
        if never_eos:
            self.run.eos_ids = [self.policy.config.vocab_size]
        self.step_no = 0
        self.sample_time, self.train_time, self.train_tokens, self.lengths, self.prompt_lengths = [], [], [], [], []

    def __call__(self):
        self.step_no += 1
        metrics, (batch, *_) = train.train_step(self.run, self.step_no)
        self.sample_time.append(metrics["generation_time"])
        self.train_time.append(metrics["update_time"])
        self.train_tokens.append(metrics["batch_tokens"])  # prompt + completion positions of the batch
        self.lengths.append(metrics["completion_length"])  # mean over the batch
        self.prompt_lengths.append(batch.prompt_mask.sum(1).float().mean().item())


def trl_version():
    try:
        import trl
        return trl.__version__
    except ImportError:
        return None


def bench_step(path, s, device, root, overrides):
    """Alternate: one TRL step, then one of ours (run from TRL's step-end callback), and so on.

    TRL's step time is measured from the moment our step returns to TRL's next step end, so neither
    side's time includes the other's, and both run under the same machine conditions.
    """
    ours = OurStep(path, s, device, root, s["prompts"], s["num_generations"], s["micro_batch"], s["step_new_tokens"],
                   overrides)
    ours_times = []
    total_steps = s["warmup"] + s["reps"]
    if trl_version() is None:
        for _ in range(total_steps):
            ours_times.append(timed(ours, device)[0])
        return {"step_ours_s": statistics.median(ours_times[s["warmup"]:]), "step_trl_s": None,
                "step_speedup_vs_trl": None, "trl": "not installed: pip install trl (bench-only); row skipped",
                **phases(ours, s["warmup"])}, ours

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    task = tasks.get_task("next_letter")
    rows = task.make_prompts(random.Random(12345), s["prompts"] * (total_steps + 1))
    trl_times = []

    class Alternate(TrainerCallback):
        resumed = None

        def on_step_begin(self, args, state, control, **kw):
            if self.resumed is None:
                self.resumed = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync(device)
            trl_times.append(time.perf_counter() - self.resumed)
            ours_times.append(timed(ours, device)[0])
            self.resumed = time.perf_counter()

    cfg = GRPOConfig(
        output_dir=os.path.join(root, "trl"), per_device_train_batch_size=s["micro_batch"],
        gradient_accumulation_steps=s["prompts"] * s["num_generations"] // s["micro_batch"],  # one generation per step
        num_generations=s["num_generations"], max_completion_length=s["step_new_tokens"], beta=s["beta"],
        loss_type="grpo", scale_rewards="group", num_iterations=1, epsilon=0.2,
        gradient_checkpointing=False,  # TRL turns it on by default; ours is off, so both do the same work
        temperature=s["temperature"], top_k=s["top_k"], top_p=s["top_p"], use_vllm=False,
        learning_rate=s["lr"], lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
        max_steps=total_steps, logging_steps=10 ** 9, save_strategy="no", report_to="none", disable_tqdm=True,
        use_cpu=device.type == "cpu", bf16=s["dtype"] == "bfloat16", seed=0, dataloader_num_workers=0,
        shuffle_dataset=False, model_init_kwargs={"dtype": s["dtype"], "attn_implementation": "sdpa"},
    )
    trainer = GRPOTrainer(model=path, reward_funcs=task.reward_funcs, args=cfg, train_dataset=Dataset.from_list(rows),
                          processing_class=model_loading.load_tokenizer(path), callbacks=[Alternate()])
    trainer.train()
    w = s["warmup"]
    ours_med, trl_med = statistics.median(ours_times[w:]), statistics.median(trl_times[w:])
    return {"step_ours_s": ours_med, "step_trl_s": trl_med, "step_speedup_vs_trl": trl_med / ours_med,
            **phases(ours, w)}, ours


def phases(ours, warmup):
    """Where our step's time goes: sampling, and the training phase (reference + policy log-probs, loss,
    backward, optimizer step); the rest is prompts, tokenising and scoring."""
    return {"step_ours_sample_s": statistics.median(ours.sample_time[warmup:]),
            "step_ours_train_s": statistics.median(ours.train_time[warmup:]),
            "step_ours_completion_length": statistics.mean(ours.lengths[warmup:])}  # EOS is in reach in this row


@functools.cache
def matmul_flops(device, n=8192):
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        times.append(timed(lambda: a @ b, device)[0])
    return 2 * n ** 3 / statistics.median(times)


def training_mfu(ours, beta, warmup, device, prefix=""):
    """Model FLOPs utilisation of the training phase: 6 N per policy token (forward + backward), 2 N per reference
    token. Neither attention's FLOPs nor gradient checkpointing's recomputation count (the usual 6 N convention)."""
    params = sum(p.numel() for p in ours.policy.parameters())
    t = statistics.median(ours.train_time[warmup:])
    tokens = statistics.median(ours.train_tokens[warmup:])
    flops = (6 + (2 if beta > 0 else 0)) * params * tokens
    peak = matmul_flops(device)
    return {f"{prefix}train_phase_s": t, f"{prefix}train_flops_per_s": flops / t, "bf16_matmul_flops_per_s": peak,
            f"{prefix}train_mfu": flops / t / peak}


# ----------------------------------------------------------------------------- long: one step with long completions


def bench_long(path, s, device, root, overrides):
    """Our step with long completions, every one to long_new_tokens (EOS out of reach), gradient checkpointing on.

    The --warmup steps run the same batch at long_warmup_new_tokens: they compile the log-prob head (dynamic in
    shape) and warm the kernels, and the sampler captures its CUDA graphs anew on every call anyway. Then
    long_reps steps are measured, each with its peak memory (absolute: weights, optimizer state, reference).
    """
    ours = OurStep(path, s, device, root, s["long_prompts"], s["long_num_generations"], s["long_micro_batch"],
                   s["long_new_tokens"], overrides, never_eos=True, gradient_checkpointing=s["long_gradient_checkpointing"])
    cfg, w = ours.run.cfg, s["warmup"]
    cfg.max_completion_length = s["long_warmup_new_tokens"]
    for _ in range(w):
        ours()
    cfg.max_completion_length = t = s["long_new_tokens"]
    times, memory = [], []
    for _ in range(s["long_reps"]):
        memory.append(memory_during(lambda: times.append(timed(ours, device)[0]), device))
    step, sample = statistics.median(times), statistics.median(ours.sample_time[w:])
    rows, length = cfg.prompts_per_step * cfg.num_generations, statistics.mean(ours.lengths[w:])
    out = {"long_step_s": step, "long_sample_s": sample, "long_train_s": statistics.median(ours.train_time[w:]),
           "long_tokens_per_s": statistics.median(ours.train_tokens[w:]) / step,  # prompt + completion tokens
           "long_generated_tokens_per_s": rows * length / sample, "long_completion_length": length,
           "long_gradient_checkpointing": cfg.gradient_checkpointing,  # --train may have changed it
           "long_peak_bytes": max(p for p, _ in memory), "long_held_bytes": statistics.median(b for _, b in memory),
           "long_memory_method": MEMORY_METHOD[device.type] + ", absolute"}
    if device.type == "cuda":
        # sampling time over t decode steps (the prefill, tokenizing and the first token included: a lower bound)
        nbytes = decode_bytes_per_step(ours.policy, rows, statistics.mean(ours.prompt_lengths[w:]) + t / 2)
        achieved, ceiling = nbytes * t / sample, copy_bandwidth(device)
        out.update(long_decode_bandwidth_GBps=achieved / 1e9, copy_bandwidth_GBps=ceiling / 1e9,
                   long_decode_bandwidth_frac_of_copy=achieved / ceiling)
        out.update(training_mfu(ours, s["beta"], w, device, prefix="long_"))
    return out


# ----------------------------------------------------------------------------- memory: chunked vs naive log-probs


def naive_logprobs(model, ids, attn, t, temperature):
    """The obvious version: full logits for every position, float32, log_softmax over the vocabulary, gather."""
    logits = model(input_ids=ids, attention_mask=attn, position_ids=grpo.position_ids_from_mask(attn)).logits
    logits = logits[:, -t - 1:-1].float() / temperature  # (N, T, V)
    return torch.log_softmax(logits, -1).gather(-1, ids[:, -t:, None])[..., 0]


def _proc_status_kib(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(key + ":"))


MEMORY_METHOD = {"cuda": "torch.cuda.max_memory_allocated", "cpu": "peak resident set (VmHWM after /proc/self/clear_refs)"}


def memory_during(fn, device):
    """(peak, held before) bytes while fn runs, both absolute.

    CUDA: the caching allocator's max_memory_allocated (reset first) and memory_allocated. CPU (Linux): the
    process's peak resident set (VmHWM, reset through /proc/self/clear_refs) and the resident set before;
    tensors this large are mmapped by malloc and handed back on free, so the resident set follows the live
    tensors. tracemalloc would not see torch's CPU allocations at all.
    """
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), base
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    base = _proc_status_kib("VmRSS")
    fn()
    return _proc_status_kib("VmHWM") * 1024, base * 1024


def peak_bytes(fn, device):
    """Peak memory while fn runs, above what was held before it."""
    peak, base = memory_during(fn, device)
    return peak - base


def bench_memory(s, device):
    tokenizer = model_loading.build_byte_tokenizer()
    config = model_loading.tiny_config(tokenizer, vocab_size=s["mem_vocab"])  # the large vocabulary, a small body
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, s["dtype"]), attn_implementation="sdpa").to(device)
    n, p, t = s["mem_rows"], s["mem_prompt_len"], s["mem_completion_len"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, s["mem_vocab"], (n, p + t), generator=g).to(device)
    attn = torch.ones_like(ids)
    mask = torch.ones(n, t, device=device)
    adv = torch.randn(n, generator=g).to(device)
    with torch.no_grad():
        ref = naive_logprobs(model, ids, attn, t, 1.0) + 0.01

    def run(logprob_fn):
        def go():
            logp = logprob_fn()
            loss, _ = grpo.grpo_loss(logp, logp.detach(), ref, adv, mask,
                                     grpo.Objective(beta=s["beta"], epsilon=0.2, max_completion_length=t),
                                     num_sequences=n, num_tokens=mask.sum())
            loss.backward()
            model.zero_grad(set_to_none=True)
        return go

    ours = run(lambda: grpo.completion_logprobs(model, ids, attn, t, 1.0)[0])
    naive = run(lambda: naive_logprobs(model, ids, attn, t, 1.0))
    ours(), naive()  # warm-up: lazily created state does not count
    peaks = {"ours": [], "naive": []}
    for _ in range(2):
        peaks["ours"].append(peak_bytes(ours, device))
        peaks["naive"].append(peak_bytes(naive, device))
    o, nv = statistics.median(peaks["ours"]), statistics.median(peaks["naive"])
    return {"logprob_peak_bytes_ours": o, "logprob_peak_bytes_naive": nv, "logprob_memory_ratio": o / nv,
            "memory_method": MEMORY_METHOD[device.type] + ("" if device.type == "cuda" else " minus resident set before")}


# ----------------------------------------------------------------------------- exec: the sandbox vs a plain process

EXEC_PROGRAM = "print(sum(range(1000)))\n"
EXEC_SOLUTION = "def add(a, b):\n    return a + b\n"
EXEC_TESTS = ["assert add(1, 2) == 3", "assert add(5, 5) == 10", "assert add(-1, 1) == 0"]


def bench_exec(s):
    """Programs per second through executor.py (its mode as GRPO_SANDBOX says, strict by default) against a plain
    `subprocess.run([sys.executable, file])`: no sandbox and the interpreter's usual start, `site` included. Also
    `python -I -S file`, the interpreter's start alone, to tell the sandbox's own cost (`exec_overhead_ms` per
    program) from the flags'. The pool rows run `exec_pool_programs` at once on one worker per CPU (run_many vs a
    thread pool of subprocess.run). The reward row judges a 3-test solution per completion (code_tests_reward: the
    judge and the program's side, two processes in one sandbox) vs the solution and its asserts in one plain process."""
    from concurrent.futures import ThreadPoolExecutor
    import executor
    import rewards
    mode = executor.check()
    n, pool_n, workers = s["exec_programs"], s["exec_pool_programs"], len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as d:
        program, naive = os.path.join(d, "program.py"), os.path.join(d, "naive.py")
        with open(program, "w") as f:
            f.write(EXEC_PROGRAM)
        with open(naive, "w") as f:
            f.write(EXEC_SOLUTION + "\n".join(EXEC_TESTS) + "\n")

        def plain(path=program, flags=()):
            subprocess.run([sys.executable, *flags, path], capture_output=True, check=True, cwd=d)

        def pool(fn):
            with ThreadPoolExecutor(workers) as p:
                list(p.map(lambda _: fn(), range(pool_n)))

        def ours():
            assert executor.run(EXEC_PROGRAM).stdout == "499500\n"

        def ours_pool():
            assert all(r.stdout == "499500\n" for r in executor.run_many([EXEC_PROGRAM] * pool_n))

        def rewards_pool():
            completions = [f"```python\n{EXEC_SOLUTION}```"] * pool_n
            assert rewards.code_tests_reward(None, completions, [EXEC_TESTS] * pool_n) == [1.0] * pool_n

        runs = {"ours": lambda: [ours() for _ in range(n)], "plain": lambda: [plain() for _ in range(n)],
                "isolated": lambda: [plain(flags=("-I", "-S")) for _ in range(n)], "ours_pool": ours_pool,
                "plain_pool": lambda: pool(plain), "rewards": rewards_pool, "naive_rewards": lambda: pool(
                    lambda: plain(naive))}
        med = medians(runs, s, torch.device("cpu"))
    groups = executor._groups()  # what bounds each program as a whole: its control group, if one can be made
    return {"exec_mode": mode, "exec_workers": workers,
            "exec_groups": groups.describe() if groups else "no control group (per-process limits)",
            "exec_ours_programs_per_s": n / med["ours"], "exec_plain_programs_per_s": n / med["plain"],
            "exec_isolated_programs_per_s": n / med["isolated"], "exec_speedup_vs_plain": med["plain"] / med["ours"],
            "exec_overhead_ms": (med["ours"] - med["isolated"]) / n * 1e3,
            "exec_pool_ours_programs_per_s": pool_n / med["ours_pool"],
            "exec_pool_plain_programs_per_s": pool_n / med["plain_pool"],
            "exec_pool_speedup_vs_plain": med["plain_pool"] / med["ours_pool"],
            "exec_rewards_per_s": pool_n / med["rewards"], "exec_naive_rewards_per_s": pool_n / med["naive_rewards"],
            "exec_rewards_ratio_vs_naive": med["naive_rewards"] / med["rewards"]}


# ----------------------------------------------------------------------------- report


def machine(device):
    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), platform.processor())
    except OSError:
        info["cpu"] = platform.processor()
    import transformers
    info["transformers"] = transformers.__version__
    info["trl"] = trl_version()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version())
        try:
            import triton
            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
    return info


def git_state():
    """The commit and the files changed since (bench often runs on a working tree), or None outside a checkout."""
    def git(*a):
        return subprocess.run(["git", *a], cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True,
                              text=True, timeout=30, check=True).stdout
    try:
        return {"commit": git("rev-parse", "HEAD").strip(), "changed": git("status", "--porcelain").splitlines()}
    except (OSError, subprocess.SubprocessError):
        return None


def fmt(x, unit=""):
    if x is None:
        return "skipped"
    if unit == "B":
        return f"{x / 2 ** 20:,.0f} MiB"
    if unit == "s":
        return f"{x * 1e3:,.1f} ms"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def table(r, s):
    """The rows that ran, as a markdown table."""
    def has(*keys):
        return all(r.get(k) is not None for k in keys)
    rows = []
    if has("sampler_speedup_vs_generate"):
        rows += [
            ("decode tokens/s", fmt(r["decode_ours_tokens_per_s"]), fmt(r["decode_generate_tokens_per_s"]),
             "model.generate", f"{r['sampler_speedup_vs_generate']:.2f}x"),
            ("decode tokens/s, our loop on the HF forward", fmt(r["decode_ours_hf_forward_tokens_per_s"]),
             fmt(r["decode_generate_tokens_per_s"]), "model.generate", f"{r['sampler_hf_forward_speedup_vs_generate']:.2f}x"),
            ("decode with EOS, compaction on vs off", "", "", "compaction off", f"{r['compaction_speedup']:.2f}x")]
    if has("decode_bandwidth_frac_of_copy"):
        rows.append(("decode bandwidth", f"{r['decode_bandwidth_GBps']:,.0f} GB/s", f"{r['copy_bandwidth_GBps']:,.0f} GB/s",
                     "copy bandwidth", f"{r['decode_bandwidth_frac_of_copy']:.2f}"))
    if has("step_ours_s"):
        rows += [
            ("GRPO step time", fmt(r["step_ours_s"], "s"), fmt(r["step_trl_s"], "s"), "TRL GRPOTrainer",
             f"{r['step_speedup_vs_trl']:.2f}x" if r["step_speedup_vs_trl"] else "skipped (TRL not installed)"),
            ("our step: sampling / training phase", f"{fmt(r['step_ours_sample_s'], 's')} / "
             f"{fmt(r['step_ours_train_s'], 's')}", "", "",
             f"mean completion {r['step_ours_completion_length']:.1f} of {s['step_new_tokens']} tokens")]
    if has("train_mfu"):
        rows.append(("training phase MFU", f"{r['train_flops_per_s'] / 1e12:,.1f} TFLOP/s",
                     f"{r['bf16_matmul_flops_per_s'] / 1e12:,.0f} TFLOP/s", "bf16 matmul", f"{r['train_mfu']:.2f}"))
    if has("logprob_memory_ratio"):
        rows.append(("log-prob + loss peak memory", fmt(r["logprob_peak_bytes_ours"], "B"),
                     fmt(r["logprob_peak_bytes_naive"], "B"), "full logits", f"{r['logprob_memory_ratio']:.3f} (ours/naive)"))
    if has("multiturn_speedup_vs_rerun"):
        rows += [
            (f"{s['mt_turns']}-turn rollout time", fmt(r["multiturn_ours_s"], "s"), fmt(r["multiturn_rerun_s"], "s"),
             "sampler re-run per turn", f"{r['multiturn_speedup_vs_rerun']:.2f}x"),
            ("multi-turn: prefilled tokens", fmt(r["multiturn_prefill_tokens_ours"]),
             fmt(r["multiturn_prefill_tokens_rerun"]), "sampler re-run per turn",
             f"{r['multiturn_prefill_ratio']:.2f}x fewer"),
            ("multi-turn: mean turns; mean trajectory length", f"{r['multiturn_mean_turns']:.2f}; "
             f"{r['multiturn_mean_length_ours']:.0f}", f"{r['multiturn_mean_length_rerun']:.0f}", "(the same work)", "")]
    if has("long_step_s"):
        shape = f"{s['long_prompts']} x {s['long_num_generations']} x {s['long_new_tokens']:,} tokens"
        rows += [
            (f"long step, {shape}" + (", checkpointing" if r["long_gradient_checkpointing"] else ""),
             fmt(r["long_step_s"], "s"), "", "", f"{fmt(r['long_tokens_per_s'])} tokens/s"),
            ("long step: sampling / training phase", f"{fmt(r['long_sample_s'], 's')} / {fmt(r['long_train_s'], 's')}",
             "", "", f"mean completion {r['long_completion_length']:,.1f} tokens"),
            ("long step peak memory", fmt(r["long_peak_bytes"], "B"), fmt(r["long_held_bytes"], "B"),
             "held before the step", "")]
    if has("long_decode_bandwidth_frac_of_copy"):
        rows.append(("long step decode bandwidth", f"{r['long_decode_bandwidth_GBps']:,.0f} GB/s",
                     f"{r['copy_bandwidth_GBps']:,.0f} GB/s", "copy bandwidth", f"{r['long_decode_bandwidth_frac_of_copy']:.2f}"))
    if has("long_train_mfu"):
        rows.append(("long step training phase MFU", f"{r['long_train_flops_per_s'] / 1e12:,.1f} TFLOP/s",
                     f"{r['bf16_matmul_flops_per_s'] / 1e12:,.0f} TFLOP/s", "bf16 matmul", f"{r['long_train_mfu']:.2f}"))
    if has("exec_ours_programs_per_s"):
        rows += [
            (f"programs/s, one at a time ({r['exec_mode']} sandbox, {r.get('exec_groups', '?')})",
             f"{r['exec_ours_programs_per_s']:.1f}",
             f"{r['exec_plain_programs_per_s']:.1f}", "subprocess.run([python, file])",
             f"{r['exec_speedup_vs_plain']:.2f}x"),
            ("sandbox cost per program over python -I -S", f"{r['exec_overhead_ms']:.1f} ms",
             f"{r['exec_isolated_programs_per_s']:.1f}", "python -I -S file (programs/s)", ""),
            (f"programs/s, pool of {r['exec_workers']}", f"{r['exec_pool_ours_programs_per_s']:.1f}",
             f"{r['exec_pool_plain_programs_per_s']:.1f}", "thread pool of subprocess.run",
             f"{r['exec_pool_speedup_vs_plain']:.2f}x"),
            (f"unit-test rewards/s, pool of {r['exec_workers']}", f"{r['exec_rewards_per_s']:.1f}",
             f"{r['exec_naive_rewards_per_s']:.1f}", "code + asserts in one plain process",
             f"{r['exec_rewards_ratio_vs_naive']:.2f}x")]
    tables = [markdown(("measure", "ours", "baseline", "baseline is", "ratio"), rows)] if rows else []
    if r.get("families"):
        tables.append(family_table(r, s))
    return "\n\n".join(tables)


def family_table(r, s):
    """The families row: one line per family, and a line for each that failed."""
    rows, failed = [], []
    for name, f in r["families"].items():
        if f["path"] == "error":
            rows.append((name, "error", "", "", "", ""))
            failed.append(f"{name}: {f['error']}")
            continue
        rel = f["ratio_over_llama"]
        rows.append((name, f["path"], fmt(f["ours_tokens_per_s"]), fmt(f["generate_tokens_per_s"]),
                     f"{f['speedup_vs_generate']:.2f}x", "" if rel is None else f"{rel:.2f}"))
    low = r.get("families_fast_min_ratio_over_llama")
    notes = [f"decode per family: {s['fam_batch']} rows, {s['fam_prompt_len']}-token prompts, {s['fam_new_tokens']} "
             f"new tokens, hidden {s['fam_hidden']}; path: the sampler's (fast: static_decoder, hf: the model's "
             f"forward); lowest fast-path ratio over Llama's, Llama aside: "
             f"{'none' if low is None else f'{low:.2f}'} (target >= 0.85)"] + failed
    return "\n".join([markdown(("family", "path", "ours tokens/s", "model.generate tokens/s", "ratio",
                                 "ratio / Llama's"), rows)] + notes)


def markdown(head, rows):
    widths = [max(len(str(x[i])) for x in rows + [head]) for i in range(len(head))]
    lines = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |" for row in [head] + rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def free(device):
    """Give a finished row's models back before the next row (its peak memory counts from here)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


ROWS = ("decode", "families", "step", "memory", "long", "multiturn", "exec")


@contextlib.contextmanager
def row_lines(name, what, results, found):
    """A line as a row starts and one as it ends, with its time and `found(results)`: a row can take minutes."""
    t = time.perf_counter()
    print(f"{name}: {what} ...", flush=True)
    yield
    print(f"{name}: done in {time.perf_counter() - t:.0f}s: {found(results)}", flush=True)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write all results to this path")
    parser.add_argument("--model", default="tiny", choices=list(MODELS))
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--only", default="decode,step,memory,multiturn", help=f"comma-separated rows to run, of {', '.join(ROWS)}")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 = torch's default")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a setting (see 'settings' in the JSON), e.g. --set micro_batch=32")
    parser.add_argument("--train", action="append", default=[], metavar="KEY=VALUE",
                        help="a train.Config setting for our step (step and long rows; TRL's side is unchanged), "
                             "e.g. --train gradient_checkpointing=true; repeatable")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.reps < 1:
        parser.error("--warmup and --reps must be >= 1")
    if args.threads < 0:
        parser.error("--threads must be >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    s = settings_for(args, device)
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in s or not value:
            parser.error(f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(s)}")
        try:
            s[key] = cli.cast(key, value, type(s[key])) if s[key] is not None else value
        except cli.ConfigError as e:
            parser.error(f"--set {item!r}: {e}")
    if s["long_reps"] < 1:
        parser.error("--set long_reps must be >= 1")
    overrides = train_overrides(args.train, parser.error)
    only = set(args.only.split(","))
    unknown = only - set(ROWS)
    if unknown:
        parser.error(f"--only: unknown rows {sorted(unknown)} ({', '.join(ROWS)})")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = {k: None for k in ("sampler_speedup_vs_generate", "sampler_hf_forward_speedup_vs_generate",
                                 "compaction_speedup", "step_speedup_vs_trl", "logprob_memory_ratio",
                                 "decode_ours_tokens_per_s", "decode_generate_tokens_per_s",
                                 "decode_ours_hf_forward_tokens_per_s", "step_ours_s", "step_trl_s",
                                 "logprob_peak_bytes_ours", "logprob_peak_bytes_naive", "long_step_s")}
    reps = f"{s['warmup']} warm-up + {s['reps']} timed"
    with tempfile.TemporaryDirectory() as root:
        path = build_model_dir(root, args)
        if "decode" in only:
            with row_lines("decode", f"our sampler vs model.generate, {reps} runs each", results,
                           lambda r: f"ours {fmt(r['decode_ours_tokens_per_s'])} tokens/s, model.generate "
                                     f"{fmt(r['decode_generate_tokens_per_s'])}"):
                results.update(bench_decode(path, s, device))
            free(device)
        if "families" in only:
            with row_lines("families", f"our sampler vs model.generate per model family, {reps} runs each", results,
                           lambda r: ", ".join(f"{k} {v['path']} {v.get('speedup_vs_generate', 0):.2f}x"
                                               for k, v in r["families"].items())):
                results.update(bench_families(s, device))
        if "step" in only:
            with row_lines("step", f"ours vs TRL {trl_version() or '(not installed: skipped)'}, {reps} steps each",
                           results, lambda r: f"ours {fmt(r['step_ours_s'], 's')}, TRL {fmt(r['step_trl_s'], 's')}"):
                step, ours = bench_step(path, s, device, root, overrides)
                results.update(step)
                if device.type == "cuda":
                    results.update(training_mfu(ours, s["beta"], s["warmup"], device))
                del ours
            free(device)
        if "memory" in only:
            with row_lines("memory", "chunked vs full-logits log-probs", results,
                           lambda r: f"ours {fmt(r['logprob_peak_bytes_ours'], 'B')}, full logits "
                                     f"{fmt(r['logprob_peak_bytes_naive'], 'B')}"):
                results.update(bench_memory(s, device))
            free(device)
        if "multiturn" in only:
            with row_lines("multiturn", "answers appended to the cache vs the sampler re-run from the prompt each "
                           "turn", results, lambda r: f"{r['multiturn_speedup_vs_rerun']:.2f}x the re-run's speed, "
                           f"{r['multiturn_prefill_ratio']:.2f}x fewer prefilled tokens"):
                results.update(bench_multiturn(path, s, device))
            free(device)
        if "long" in only:
            with row_lines("long", f"our step, {s['long_prompts']} x {s['long_num_generations']} completions of "
                           f"{s['long_new_tokens']} tokens, {s['warmup']} warm-up + {s['long_reps']} timed steps",
                           results, lambda r: r.get("long_error") or f"{fmt(r['long_step_s'], 's')} per step"):
                try:
                    results.update(bench_long(path, s, device, root, overrides))
                except torch.OutOfMemoryError as e:  # say so, and keep the other rows' figures (e.g. at 8192 tokens)
                    results["long_error"] = f"out of memory: {str(e).splitlines()[0]}"
        if "exec" in only:
            with row_lines("exec", "programs through the sandbox vs plain subprocess.run", results,
                           lambda r: f"{r['exec_speedup_vs_plain']:.2f}x the programs per second of plain subprocess.run"):
                results.update(bench_exec(s))
    report = {"date": started, "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": shlex.join(["python", "bench.py", *argv]), "argv": sys.argv, "machine": machine(device),
              "git": git_state(), "settings": s, "train_overrides": overrides, **results}
    print(table(results, s))
    if results.get("long_error"):
        print(f"long row: {results['long_error']}; smaller shapes: --set long_prompts=... / long_micro_batch=...")
    m = report["machine"]
    memory = results.get("memory_method") or results.get("long_memory_method")
    print(f"{started} | {m.get('gpu', m['cpu'])}, {m['cpu_cores']} cores, torch threads {m['torch_threads']} | torch "
          f"{m['torch']}, transformers {m['transformers']}, trl {m['trl']}" + (f" | memory: {memory}" if memory else "")
          + (f" | --train {overrides}" if overrides else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
