"""Speed and memory against the baselines people use, measured side by side in one run.

    python bench.py                       # the tiny default model, on CUDA when there is one, else CPU
    python bench.py --json results.json   # also write every figure, the machine, versions and settings
    python bench.py --model=qwen2.5-0.5b  # a Qwen2.5-0.5B-shaped model with random weights (for a GPU)

Rows:
  decode   our sampler vs `model.generate`: generated tokens/s, same model, batch, lengths, sampling settings
  step     one GRPO step (sample, score, reference + policy log-probs, loss, backward, optimizer step) vs
           TRL's GRPOTrainer configured the same way (bench-only dependency; the row is skipped without it)
  memory   peak memory of log-probs + loss + backward with a 151,936-token vocabulary vs the naive full-logits version
Each pair is measured alternately after a warm-up; figures are medians over the repetitions.
"""

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time

import torch

import grpo
import model_loading
import sharding
import tasks
import train

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, vocab_size=151936)


def settings_for(args, device):
    """Shapes per machine: small enough for 2 CPU cores, the project's GPU reference on CUDA."""
    gpu = device.type == "cuda"
    s = dict(
        model=args.model, device=str(device), dtype="bfloat16" if gpu else "float32", threads=torch.get_num_threads(),
        # decode row
        decode_batch=512 if gpu else 128, decode_prompt_len=64 if gpu else 16, decode_new_tokens=512 if gpu else 64,
        # step row: P prompts x G completions, micro-batches of `micro_batch` completions
        prompts=64 if gpu else 16, num_generations=8, micro_batch=64 if gpu else 16,
        step_new_tokens=512 if gpu else 64, beta=0.04, lr=1e-6 if gpu else 1e-3,
        # memory row
        mem_vocab=151936, mem_rows=8, mem_prompt_len=16, mem_completion_len=256,
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


def build_model_dir(root, args):
    """A model folder with weights (so TRL and we load identical ones) and the byte-level tokenizer."""
    path = os.path.join(root, "model")
    overrides = QWEN25_05B if args.model == "qwen2.5-0.5b" else {}
    model_loading.write_tiny_model(path, **overrides)
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
    sampling = dict(temperature=s["temperature"], top_k=s["top_k"], top_p=s["top_p"])

    def ours(max_new=t, **kw):
        return grpo.sample(model, enc.input_ids, enc.attention_mask, max_new_tokens=max_new, eos_ids=never,
                           pad_id=tokenizer.pad_token_id, **sampling, **kw)

    def generate():
        with torch.no_grad():
            out = model.generate(input_ids=enc.input_ids, attention_mask=enc.attention_mask, do_sample=True,
                                 max_new_tokens=t, min_new_tokens=t, pad_token_id=tokenizer.pad_token_id, **sampling)
        assert out.shape[1] == enc.input_ids.shape[1] + t
        return out

    runs = {"ours": ours, "generate": generate, "ours_hf_forward": lambda: ours(static_cache=False)}
    times = {k: [] for k in runs}
    for _ in range(s["warmup"]):
        for fn in runs.values():
            fn()
    for _ in range(s["reps"]):
        for k, fn in runs.items():
            times[k].append(timed(fn, device)[0])
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {f"decode_{k}_tokens_per_s": n * t / v for k, v in med.items()}
    out["sampler_speedup_vs_generate"] = med["generate"] / med["ours"]
    out["sampler_hf_forward_speedup_vs_generate"] = med["generate"] / med["ours_hf_forward"]

    # compaction: rows that finish early leave the decode batch. Enough ids count as EOS here (2 / t of the
    # vocabulary: near-uniform random weights then stop a row after about t / 2 tokens) that rows stop at
    # scattered lengths. In float32 the tokens must be identical either way; in bf16 a smaller batch may take
    # other matmul kernels whose rounding moves a few draws, so the share of identical rows is reported.
    stop_ids = list(range(40, 40 + max(1, round(2 * model.config.vocab_size / t))))
    def stopping(compact):
        return grpo.sample(model, enc.input_ids, enc.attention_mask, max_new_tokens=t, eos_ids=stop_ids,
                           pad_id=tokenizer.pad_token_id, compact=compact, **sampling)
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
    cfg = model.config
    elt = next(model.parameters()).element_size()
    weight_bytes = sum(p.numel() for p in model.parameters()) * elt
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    mean_len = s["decode_prompt_len"] + t / 2
    kv_bytes = 2 * cfg.num_hidden_layers * s["decode_batch"] * cfg.num_key_value_heads * head_dim * mean_len * elt
    achieved = (weight_bytes + kv_bytes) / step
    ceiling = copy_bandwidth(device)
    return {"decode_step_s": step, "decode_bytes_per_step": weight_bytes + kv_bytes,
            "decode_bandwidth_GBps": achieved / 1e9, "copy_bandwidth_GBps": ceiling / 1e9,
            "decode_bandwidth_frac_of_copy": achieved / ceiling}


# ----------------------------------------------------------------------------- one GRPO step: ours vs TRL


class OurStep:
    """train.py's own step (`train.train_step`) on a run built by `train.setup`, on one process."""

    def __init__(self, path, s, device, root):
        # TRL's default AdamW betas and no decay, so both sides do the same work; no checkpoints or logs
        cfg = train.Config(model=path, device=str(device), model_init_kwargs={"dtype": s["dtype"],
                           "attn_implementation": "sdpa"}, task="next_letter", num_generations=s["num_generations"],
                           prompts_per_step=s["prompts"], micro_batch_size=s["micro_batch"], lr=s["lr"],
                           adam_beta1=0.9, adam_beta2=0.999, weight_decay=0.0, beta=s["beta"],
                           temperature=s["temperature"], top_k=s["top_k"], top_p=s["top_p"],
                           max_completion_length=s["step_new_tokens"], max_prompt_length=512, out_dir=root,
                           save_every=0, print_completions_every=0)
        one = sharding.Dist(rank=0, local_rank=0, world_size=1, device=device)
        self.run = train.setup(cfg, one)
        self.policy = self.run.policy.lm
        self.step_no = 0
        self.sample_time, self.train_time, self.train_tokens = [], [], []

    def __call__(self):
        self.step_no += 1
        metrics, _ = train.train_step(self.run, self.step_no)
        self.sample_time.append(metrics["generation_time"])
        self.train_time.append(metrics["update_time"])
        self.train_tokens.append(metrics["batch_tokens"])  # prompt + completion positions of the batch


def trl_version():
    try:
        import trl
        return trl.__version__
    except ImportError:
        return None


def bench_step(path, s, device, root):
    """Alternate: one TRL step, then one of ours (run from TRL's step-end callback), and so on.

    TRL's step time is measured from the moment our step returns to TRL's next step end, so neither
    side's time includes the other's, and both run under the same machine conditions.
    """
    ours = OurStep(path, s, device, root)
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
            "step_ours_train_s": statistics.median(ours.train_time[warmup:])}


def matmul_flops(device, n=8192):
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        times.append(timed(lambda: a @ b, device)[0])
    return 2 * n ** 3 / statistics.median(times)


def training_mfu(ours, s, device):
    """Model FLOPs utilisation of the training phase: 6 N per policy token (forward + backward), 2 N per reference token."""
    params = sum(p.numel() for p in ours.policy.parameters())
    w = s["warmup"]
    t = statistics.median(ours.train_time[w:])
    tokens = statistics.median(ours.train_tokens[w:])
    flops = (6 + (2 if s["beta"] > 0 else 0)) * params * tokens
    peak = matmul_flops(device)
    return {"train_phase_s": t, "train_flops_per_s": flops / t, "bf16_matmul_flops_per_s": peak, "train_mfu": flops / t / peak}


# ----------------------------------------------------------------------------- memory: chunked vs naive log-probs


def naive_logprobs(model, ids, attn, t, temperature):
    """The obvious version: full logits for every position, float32, log_softmax over the vocabulary, gather."""
    logits = model(input_ids=ids, attention_mask=attn, position_ids=grpo.position_ids_from_mask(attn)).logits
    logits = logits[:, -t - 1:-1].float() / temperature  # (N, T, V)
    return torch.log_softmax(logits, -1).gather(-1, ids[:, -t:, None])[..., 0]


def _proc_status_kib(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(key + ":"))


def peak_bytes(fn, device):
    """Peak memory while fn runs, above what was held before it.

    CUDA: the caching allocator's max_memory_allocated. CPU (Linux): the process's peak resident set
    (VmHWM, reset through /proc/self/clear_refs) minus the resident set before; tensors this large are
    mmapped by malloc and handed back on free, so the resident set follows the live tensors.
    tracemalloc would not see torch's CPU allocations at all.
    """
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    base = _proc_status_kib("VmRSS")
    fn()
    return (_proc_status_kib("VmHWM") - base) * 1024


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
            loss, _ = grpo.grpo_loss(logp, logp.detach(), ref, adv, mask, beta=s["beta"], epsilon=0.2, epsilon_high=0.2,
                                     loss_type="grpo", num_sequences=n, num_tokens=mask.sum(), max_completion_length=t)
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
            "memory_method": "torch.cuda.max_memory_allocated" if device.type == "cuda" else
            "peak resident set (VmHWM after /proc/self/clear_refs) minus resident set before"}


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
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def fmt(x, unit=""):
    if x is None:
        return "skipped"
    if unit == "B":
        return f"{x / 2 ** 20:,.0f} MiB"
    if unit == "s":
        return f"{x * 1e3:,.1f} ms"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def table(r):
    rows = [
        ("decode tokens/s", fmt(r["decode_ours_tokens_per_s"]), fmt(r["decode_generate_tokens_per_s"]), "model.generate",
         f"{r['sampler_speedup_vs_generate']:.2f}x"),
        ("decode tokens/s, our loop on the HF forward", fmt(r["decode_ours_hf_forward_tokens_per_s"]),
         fmt(r["decode_generate_tokens_per_s"]), "model.generate", f"{r['sampler_hf_forward_speedup_vs_generate']:.2f}x"),
        ("decode with EOS, compaction on vs off", "", "", "compaction off", f"{r['compaction_speedup']:.2f}x"),
        ("GRPO step time", fmt(r["step_ours_s"], "s"), fmt(r["step_trl_s"], "s"), "TRL GRPOTrainer",
         f"{r['step_speedup_vs_trl']:.2f}x" if r["step_speedup_vs_trl"] else "skipped (TRL not installed)"),
        ("our step: sampling / training phase", f"{fmt(r.get('step_ours_sample_s'), 's')} / "
         f"{fmt(r.get('step_ours_train_s'), 's')}", "", "", ""),
        ("log-prob + loss peak memory", fmt(r["logprob_peak_bytes_ours"], "B"), fmt(r["logprob_peak_bytes_naive"], "B"),
         "full logits", f"{r['logprob_memory_ratio']:.3f} (ours/naive)"),
    ]
    if "decode_bandwidth_frac_of_copy" in r:
        rows.append(("decode bandwidth", f"{r['decode_bandwidth_GBps']:,.0f} GB/s", f"{r['copy_bandwidth_GBps']:,.0f} GB/s",
                     "copy bandwidth", f"{r['decode_bandwidth_frac_of_copy']:.2f}"))
    if "train_mfu" in r:
        rows.append(("training phase MFU", f"{r['train_flops_per_s'] / 1e12:,.1f} TFLOP/s",
                     f"{r['bf16_matmul_flops_per_s'] / 1e12:,.0f} TFLOP/s", "bf16 matmul", f"{r['train_mfu']:.2f}"))
    head = ("measure", "ours", "baseline", "baseline is", "ratio")
    widths = [max(len(str(x[i])) for x in rows + [head]) for i in range(5)]
    lines = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |" for row in [head] + rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write all results to this path")
    parser.add_argument("--model", default="tiny", choices=["tiny", "qwen2.5-0.5b"])
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--only", default="decode,step,memory", help="comma-separated rows to run")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 = torch's default")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a setting (see 'settings' in the JSON), e.g. --set micro_batch=32")
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
        s[key] = type(s[key])(value) if s[key] is not None else value
    only = set(args.only.split(","))
    unknown = only - {"decode", "step", "memory"}
    if unknown:
        parser.error(f"--only: unknown rows {sorted(unknown)} (decode, step, memory)")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = {k: None for k in ("sampler_speedup_vs_generate", "sampler_hf_forward_speedup_vs_generate",
                                 "compaction_speedup", "step_speedup_vs_trl", "logprob_memory_ratio",
                                 "decode_ours_tokens_per_s", "decode_generate_tokens_per_s",
                                 "decode_ours_hf_forward_tokens_per_s", "step_ours_s", "step_trl_s",
                                 "logprob_peak_bytes_ours", "logprob_peak_bytes_naive")}
    with tempfile.TemporaryDirectory() as root:
        path = build_model_dir(root, args)
        if "decode" in only:
            print("decode: our sampler vs model.generate ...", flush=True)
            results.update(bench_decode(path, s, device))
        if "step" in only:
            print(f"step: ours vs TRL {trl_version() or '(not installed: skipped)'} ...", flush=True)
            step, ours = bench_step(path, s, device, root)
            results.update(step)
            if device.type == "cuda":
                results.update(training_mfu(ours, s, device))
        if "memory" in only:
            print("memory: chunked vs full-logits log-probs ...", flush=True)
            results.update(bench_memory(s, device))
    report = {"date": started, "command": "python bench.py " + " ".join(argv), "machine": machine(device),
              "settings": s, **results}
    if all(results[k] is not None for k in ("sampler_speedup_vs_generate", "compaction_speedup", "logprob_memory_ratio")):
        print(table({**results, "step_speedup_vs_trl": results["step_speedup_vs_trl"]}))
    else:
        print(json.dumps(results, indent=1))
    m = report["machine"]
    print(f"{started} | {m.get('gpu', m['cpu'])}, {m['cpu_cores']} cores | torch {m['torch']}, transformers "
          f"{m['transformers']}, trl {m['trl']} | memory: {results.get('memory_method')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
