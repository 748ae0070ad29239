"""The bench's training rows: one GRPO step against TRL's GRPOTrainer, one step with long completions, the peak
memory of chunked against naive log-probs, and the training phase's MFU."""

import dataclasses
import functools
import os
import random
import sys
import statistics
import time
import typing

import torch

import grpo
import logprobs
import model_loading
import sharding
import tasks
import train
from runs import cli
from bench.common import sync, timed
from bench.decode import copy_bandwidth, decode_bytes_per_step


# ----------------------------------------------------------------------------- one GRPO step: ours vs TRL


# train.Config fields that the bench sets itself (a row's shapes, what TRL's side mirrors): --train refuses them
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
    `error(message)` (argparse's) names the key that is no Config field, is the bench's own, or has a bad value."""
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
    logits = model(input_ids=ids, attention_mask=attn, position_ids=logprobs.position_ids_from_mask(attn)).logits
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

    ours = run(lambda: logprobs.completion_logprobs(model, ids, attn, t, 1.0)[0])
    naive = run(lambda: naive_logprobs(model, ids, attn, t, 1.0))
    ours(), naive()  # warm-up: lazily created state does not count
    peaks = {"ours": [], "naive": []}
    for _ in range(2):
        peaks["ours"].append(peak_bytes(ours, device))
        peaks["naive"].append(peak_bytes(naive, device))
    o, nv = statistics.median(peaks["ours"]), statistics.median(peaks["naive"])
    return {"logprob_peak_bytes_ours": o, "logprob_peak_bytes_naive": nv, "logprob_memory_ratio": o / nv,
            "memory_method": MEMORY_METHOD[device.type] + ("" if device.type == "cuda" else " minus resident set before")}


# ----------------------------------------------------------------------------- training forward per family


def bench_training_forward(s, device):
    """Per family of tests/architectures.py (tiny on a CPU; with `--set fam_shapes=real`, bench/decode.py's published
    shapes): forward and backward of `logprobs.completion_logprobs` over a batch, the whole model trained, on the
    Hugging Face forward and, where `transformer.decide` lets it, on the written-out layers. The
    ratio says whether writing a family's training forward out pays."""
    from layers import transformer
    from bench.decode import REAL_SHAPES, real_shaped
    from bench.common import free, medians
    tests_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    import architectures
    n, length, t = s["tf_rows"], s["tf_len"], s["tf_completion"]
    dtype = getattr(torch, s["dtype"])
    chosen = [f for f in s["fam_names"].split(",") if f]
    out = {}
    for name in architectures.FAMILIES:
        real = s["fam_shapes"] == "real"
        if (chosen and name not in chosen) or (real and name not in REAL_SHAPES):
            continue
        model = None
        try:
            if real:
                model, _ = real_shaped(architectures, name, device, dtype)
            else:
                model, _ = architectures.tiny(name, hidden_size=s["fam_hidden"],
                                              head_dim=s["fam_hidden"] // architectures.COMMON["num_attention_heads"])
                model.to(device=device, dtype=dtype)
            model.train()
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(0, 250, (n, length), generator=g).to(device)
            attn = torch.ones_like(ids)
            attn[: n // 2, : length // 8] = 0  # half the rows left-padded

            def step(fast):
                model.zero_grad(set_to_none=True)
                logp, _ = logprobs.completion_logprobs(model, ids, attn, t, fast_forward=fast)
                logp.sum().backward()

            runs = {"hf": lambda: step(False)}
            written = transformer.decide(model).trains_written_out(model)
            if written:
                runs["written_out"] = lambda: step(True)
            med = medians(runs, s, device)
            r = {"hf_s": med["hf"], "tokens_per_s_hf": n * length / med["hf"], "written_out": written}
            if written:
                r.update(written_out_s=med["written_out"], speedup_written_out=med["hf"] / med["written_out"])
            out[name] = r
            print(f"  {name}: hf {r['hf_s'] * 1e3:.0f} ms" + (f", written out {r['written_out_s'] * 1e3:.0f} ms "
                                                              f"({r['speedup_written_out']:.2f}x)" if written else ""),
                  flush=True)
        except Exception as e:  # one family that fails is reported, the others still run
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        finally:
            model = None
            free(device)
    return {"training_forward": out}
