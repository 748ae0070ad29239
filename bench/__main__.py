"""Speed and memory against the baselines people use, measured side by side in one run.

    python -m bench                       # the tiny default model, on CUDA when there is one, else CPU
    python -m bench --json results.json   # also write every figure, the machine, versions and settings
    python -m bench --model=qwen2.5-0.5b  # a Qwen2.5-0.5B-shaped model with random weights (for a GPU); also qwen2.5-1.5b
    python -m bench --model=tiny-qwen3 --only step   # the tiny default with Qwen3's layers, against TRL
    python -m bench --model=qwen2.5-1.5b --only long --set long_new_tokens=8192 --set long_prompts=16
    python -m bench --train gradient_checkpointing=true   # a train.Config setting for our step (step, long rows)
    python -m bench --only exec           # model-written programs through sandbox/executor.py's sandbox
    python -m bench --only hostmem        # peak host memory per process at 1, 2, 4 processes (CPU, minutes)
    python -m bench --only export         # each process's memory rise while the trained model is written out
    python -m bench --only families       # decode against model.generate for each model family
    python -m bench --only shared         # the training phase with each group's prompt computed once vs padded rows
    python -m bench --only families,trainfwd --set fam_shapes=real   # the same at published shapes (GPU)

Rows:
  decode   our sampler vs `model.generate`: generated tokens/s, same model, batch, lengths, sampling settings
  families (not run by default) the decode row for a random model of each family in tests/architectures.py
           (Llama, Qwen3, Qwen3-MoE, Qwen3.5, gpt-oss, Gemma and others): tokens/s of each side, the ratio, the
           ratio over Llama's, and whether the sampler took the fast path or the HF forward; `--set
           fam_shapes=real`: each family at its published shape (for a GPU), `--set fam_lora=R`: with LoRA adapters
  trainfwd (not run by default) forward + backward of the training log-probs per family: the written-out layers
           against the model's own forward (`fam_shapes` and `fam_names` apply)
  step     one GRPO step (sample, score, reference + policy log-probs, loss, backward, optimizer step) vs
           TRL's GRPOTrainer configured the same way (bench-only dependency; the row is skipped without it)
  memory   peak memory of log-probs + loss + backward with a 151,936-token vocabulary vs the naive full-logits version
  long     (not run by default) one GRPO step of ours with long completions that all run to the limit, gradient
           checkpointing on: step time, sampling / training split, peak memory, tokens/s, bandwidth and MFU
  multiturn rollouts of several turns with an environment's answer after each: our sampler, which appends each
           answer to the paused rows' KV cache, vs the sampler run again from the prompt for every turn (what TRL
           does without vLLM): time and prefilled tokens
  hostmem  (not run by default; CPU, minutes) a whole run's peak host memory per process at 1, 2 and 4
           processes (`torchrun`, gloo, each reading its own shards of a safetensors model, `--tp_size` = the
           processes): each peak and its ratio to one process's
  export   (not run by default; CPU, minutes) the export of a sharded model at 1, 2 and 4 processes: how far each
           process's resident memory rises and how long it takes, gathered whole on rank 0 and save_pretrained,
           one tensor at a time (runs/export.py), torch.distributed.checkpoint's Hugging Face writer
  shared   (not run by default) the training phase of one group (a 512-token prompt, G = 8 completions of 128
           tokens) with its prompt computed once (--shared_prompts) vs the padded rows: time, tensors kept for
           backward, peak memory and positions computed, on the written-out layers and the model's own forward; and
           the attention alone: causal SDPA over padded rows, one tree mask, the two-part SDPA, FlexAttention
  exec     programs per second through sandbox/executor.py's sandbox vs a plain `subprocess.run([sys.executable, file])`,
           one at a time and in a pool of one worker per CPU; unit-test rewards per second (code_tests_reward) vs
           running the code and its asserts in one plain process (not run by default)
  reader   (not run by default) the reader's path: the functions one default step of `python train.py` runs, their
           lines def to end, the files they lie in, the feature files among them and the share of their code that
           ran (bench/reader.py)
Each pair is measured alternately after a warm-up; figures are medians over the repetitions. Each row prints a
line as it starts and one as it ends, with its time and its main figures (a row can take minutes).
On CUDA, decode is also reported as a fraction of the copy bandwidth and training as MFU (step and long rows).
"""

import argparse
import contextlib
import io
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time

import torch

from runs import cli
from bench.common import MODELS, build_model_dir, free, medians
from bench.decode import bench_decode, bench_families, bench_multiturn
from bench.export import bench_export
from bench.hostmem import bench_hostmem
from bench.long_rows import bench_split_rows
from bench.longtail import bench_longtail, bench_longtail_steps, step_modes
from bench.shared import bench_shared
from bench.step import (bench_long, bench_memory, bench_step, bench_training_forward, train_overrides, training_mfu,
                         trl_version)


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
        # and one row of sp_tokens trained whole and at each --cp_size of sp_sizes on the CPU (gloo), a dense model of
        # sp_layers layers of hidden size sp_hidden; "" skips it
        sp_tokens=8192, sp_hidden=256, sp_layers=4, sp_sizes="1,2,4",
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
        # trainfwd row: rows x tokens, the last tf_completion of them scored (fam_shapes, fam_names as above)
        tf_rows=8 if gpu else 4, tf_len=1024 if gpu else 128, tf_completion=512 if gpu else 64,
        fam_lora=0,  # > 0: LoRA of this rank on each family's default targets ("all") before it is measured
        fam_shapes="tiny",  # or "real": each family at its published shape (bench.decode.REAL_SHAPES; for a GPU)
        fam_names="",  # comma-separated families of tests/architectures.py to run (Llama always, for the ratio); "": all
        # hostmem row: a model of hm_layers layers of hidden size hm_hidden (271M parameters), hm_steps steps
        hm_hidden=1024, hm_layers=24, hm_steps=2, hm_prompt_len=16, hm_processes="1,2,4,2x2", hm_lora=0,
        hm_moe=0,  # > 0: a Qwen3-MoE shape of this many experts a layer, trained with --routing_replay
        # longtail row: lt_places decode places, lt_rows_per_place times as many rows, ending at log-normal lengths
        # (median lt_median tokens, sigma lt_sigma) of at most lt_max_new_tokens
        lt_places=64 if gpu else 16, lt_rows_per_place=4, lt_max_new_tokens=512, lt_median=46, lt_sigma=1.0,
        # and steps of lt_step_prompts x lt_step_generations such rows, a reward of lt_reward_ms per completion,
        # lt_warmup_steps + lt_step_reps steps of each mode
        lt_step_prompts=8, lt_step_generations=8, lt_reward_ms=20, lt_warmup_steps=2, lt_step_reps=6,
        # export row: a Qwen2 shape of ex_layers layers of hidden size ex_hidden, an ex_vocab vocabulary, untied
        ex_hidden=1024, ex_layers=24, ex_vocab=151936, ex_dtype="bfloat16", ex_processes="1,2,4",
        ex_methods="gather,stream,dcp",
        # shared row: sh_prompts groups of sh_generations completions of sh_completion_len tokens after a prompt of
        # sh_prompt_len, micro-batches of sh_micro_batch rows
        sh_prompts=1, sh_generations=8, sh_prompt_len=512, sh_completion_len=128, sh_micro_batch=8,
        temperature=1.0, top_k=0, top_p=1.0, warmup=args.warmup, reps=args.reps,
    )
    return s


# ----------------------------------------------------------------------------- exec: the sandbox vs a plain process

EXEC_PROGRAM = "print(sum(range(1000)))\n"
EXEC_SOLUTION = "def add(a, b):\n    return a + b\n"
EXEC_TESTS = ["assert add(1, 2) == 3", "assert add(5, 5) == 10", "assert add(-1, 1) == 0"]


def bench_exec(s):
    """Programs per second through sandbox/executor.py (its mode as GRPO_SANDBOX says, strict by default) against a plain
    `subprocess.run([sys.executable, file])`: no sandbox and the interpreter's usual start, `site` included. Also
    `python -I -S file`, the interpreter's start alone, to tell the sandbox's own cost (`exec_overhead_ms` per
    program) from the flags'. The pool rows run `exec_pool_programs` at once on one worker per CPU (run_many vs a
    thread pool of subprocess.run). The reward row judges a 3-test solution per completion (code_tests_reward: the
    judge and the program's side, two processes in one sandbox) vs the solution and its asserts in one plain process."""
    from concurrent.futures import ThreadPoolExecutor
    from sandbox import executor
    import tasks.code
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
            assert tasks.code.code_tests_reward(None, completions, [EXEC_TESTS] * pool_n) == [1.0] * pool_n

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
    if has("shared_written_out_speedup"):
        shape = f"{s['sh_prompt_len']}-token prompt, G = {s['sh_generations']} x {s['sh_completion_len']}"
        for name, label in (("written_out", "written-out layers"), ("own_forward", "model's own forward")):
            rows += [
                (f"shared prompts, training phase ({label}), {shape}", fmt(r[f"shared_{name}_shared_s"], "s"),
                 fmt(r[f"shared_{name}_padded_s"], "s"), "padded rows", f"{r[f'shared_{name}_speedup']:.2f}x"),
                (f"shared prompts, tensors kept for backward ({label})",
                 fmt(r[f"shared_{name}_shared_saved_bytes"], "B"), fmt(r[f"shared_{name}_padded_saved_bytes"], "B"),
                 "padded rows",
                 f"{r[f'shared_{name}_saved_ratio']:.2f} (shared/padded)")]
            if has(f"shared_{name}_memory_ratio"):
                rows.append((f"shared prompts, peak memory ({label})", fmt(r[f"shared_{name}_shared_peak_bytes"], "B"),
                             fmt(r[f"shared_{name}_padded_peak_bytes"], "B"), "padded rows",
                             f"{r[f'shared_{name}_memory_ratio']:.2f} (shared/padded)"))
        rows.append(("shared prompts, positions computed", fmt(r["shared_positions_shared"]),
                     fmt(r["shared_positions_padded"]), "padded rows", f"{r['shared_positions_ratio']:.2f}x fewer"))
        a = r["shared_attention_ms"]
        rows.append(("attention alone, fwd + bwd: two-part SDPA / one tree mask" +
                     (" / flex" if "flex" in a else ""),
                     " / ".join(f"{a[k]:.1f} ms" for k in ("two-part", "one tree mask", "flex") if k in a),
                     f"{a['padded causal']:.1f} ms", "causal SDPA, padded rows",
                     f"{a['padded causal'] / a['two-part']:.2f}x"))
        if r.get("shared_flex_error"):
            rows.append(("attention alone, FlexAttention", "did not run", "", "", r["shared_flex_error"][:90]))
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
             f"new tokens, hidden {s['fam_hidden']}; path: the sampler's (fast: transformer, hf: the model's "
             f"forward); lowest fast-path ratio over Llama's, Llama aside: "
             f"{'none' if low is None else f'{low:.2f}'} (target >= 0.85)"] + failed
    return "\n".join([markdown(("family", "path", "ours tokens/s", "model.generate tokens/s", "ratio",
                                 "ratio / Llama's"), rows)] + notes)


def markdown(head, rows):
    widths = [max(len(str(x[i])) for x in rows + [head]) for i in range(len(head))]
    lines = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |" for row in [head] + rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)



ROWS = ("decode", "families", "reader", "trainfwd", "step", "memory", "long", "multiturn", "exec", "hostmem",
        "longtail", "export", "shared")


@contextlib.contextmanager
def row_lines(name, what, results, found):
    """A line as a row starts and one as it ends, with its time and `found(results)`: a row can take minutes."""
    t = time.perf_counter()
    print(f"{name}: {what} ...", flush=True)
    yield
    print(f"{name}: done in {time.perf_counter() - t:.0f}s: {found(results)}", flush=True)


def parse(argv):
    """(args, device, settings, --train overrides, rows to run) of the command line; a bad one exits naming it."""
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
    return args, device, s, overrides, only


def long_rows(path, s, device, root, overrides, results):
    """The long row: our step over long completions, then one long row trained whole and split (--cp_size)."""
    with row_lines("long", f"our step, {s['long_prompts']} x {s['long_num_generations']} completions of "
                   f"{s['long_new_tokens']} tokens, {s['warmup']} warm-up + {s['long_reps']} timed steps",
                   results, lambda r: r.get("long_error") or f"{fmt(r['long_step_s'], 's')} per step"):
        try:
            results.update(bench_long(path, s, device, root, overrides))
        except torch.OutOfMemoryError as e:  # say so, and keep the other rows' figures (e.g. at 8192 tokens)
            results["long_error"] = f"out of memory: {str(e).splitlines()[0]}"
    if s["sp_sizes"]:
        with row_lines("long", f"one row of {s['sp_tokens']:,} tokens trained whole and split over "
                       f"{s['sp_sizes']} processes (--cp_size, CPU)", results,
                       lambda r: ", ".join(f"C={c}: {v:.2f}x the activations, "
                                           f"{r['long_split_time_ratio'][c]:.2f}x the time"
                                           for c, v in r["long_split_rise_ratio"].items())):
            results.update(bench_split_rows(s, root))


def longtail_rows(path, s, device, root, results, reps):
    """The longtail rows: decode-only streaming against full rows, then whole steps in the four modes."""
    with row_lines("longtail", f"long-tailed rows through {s['lt_places']} places: batches one after another "
                   f"and streaming, against full rows, {reps} runs each", results,
                   lambda r: f"batches {r['longtail_batches_vs_full']:.2f}x, streaming "
                             f"{r['longtail_streaming_vs_full']:.2f}x full rows' tokens/s (at most "
                             f"{r['longtail_queue_bound_vs_full']:.2f}x taking rows in order, "
                             f"{r['longtail_bound_vs_full']:.2f}x in any order, while a step waits for its longest "
                             f"row); "
                             f"places busy {r['longtail_batches_slots_busy']:.0%} / "
                             f"{r['longtail_streaming_slots_busy']:.0%}; on the model's own forward streaming is "
                             f"{r['longtail_own_forward_streaming_speedup_vs_batches']:.2f}x its batches"):
        results.update(bench_longtail(path, s, device))
    free(device)
    with row_lines("longtail", f"steps of {s['lt_step_prompts']} x {s['lt_step_generations']} such rows, a "
                   f"{s['lt_reward_ms']} ms reward per completion: (a) synchronous, (b) streaming, (c), (d) "
                   f"the sampler 1 and 2 steps ahead", results,
                   lambda r: ", ".join(f"({m[0]}) {r[f'longtail_{m}_vs_a']:.2f}x" for m in step_modes(s)) +
                   " (a)'s steps/s; places busy " +
                   " / ".join(f"{r[f'longtail_{m}_slots_busy']:.0%}" for m in step_modes(s)) +
                   "; decoding at " + " / ".join(f"{r[f'longtail_{m}_decode_vs_full']:.2f}x"
                                                 for m in step_modes(s)) + " full rows' tokens/s"):
        results.update(bench_longtail_steps(path, s, device, root, results["longtail_full_tokens_per_s"]))
    free(device)


def reader_row(results):
    """The reader's path (bench/reader.py): a default run traced in this process, its own output kept quiet."""
    from bench.reader import bench_reader
    with row_lines("reader", "the code one default step runs, traced (bench/reader.py)", results,
                   lambda r: f"{r['reader_lines']} lines in {r['reader_files']} files, {r['reader_functions']} "
                             f"functions, {r['reader_exec_frac']:.0%} of its code lines run; feature files entered: "
                             f"{r['reader_feature_files'] or 'none'}"):
        with contextlib.redirect_stdout(io.StringIO()):
            results.update(bench_reader())


def main(argv):
    args, device, s, overrides, only = parse(argv)
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
        if "trainfwd" in only:
            with row_lines("trainfwd", f"training forward + backward per family, {reps} runs each", results,
                           lambda r: ", ".join(f"{k} " + (f"{v['speedup_written_out']:.2f}x" if "speedup_written_out" in v else
                                                             "hf only" if "hf_s" in v else "error")
                                               for k, v in r["training_forward"].items())):
                results.update(bench_training_forward(s, device))
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
            long_rows(path, s, device, root, overrides, results)
        if "longtail" in only:
            longtail_rows(path, s, device, root, results, reps)
        if "shared" in only:
            with row_lines("shared", f"the training phase with each prompt computed once vs the padded rows, "
                           f"{s['sh_prompt_len']}-token prompt, G = {s['sh_generations']} x {s['sh_completion_len']}, "
                           f"{reps} runs each", results,
                           lambda r: f"{r['shared_written_out_speedup']:.2f}x faster, "
                                     f"{r['shared_positions_ratio']:.2f}x fewer positions; the prefill "
                                     f"{r['shared_prefill_speedup']:.2f}x faster"):
                results.update(bench_shared(path, s, device))
            free(device)
        if "hostmem" in only:
            with row_lines("hostmem", f"a whole run's peak host memory per process at {s['hm_processes']} processes",
                           results, lambda r: ", ".join(f"{n}: {v:.2f}x" for n, v in r["hostmem_ratio_to_one"].items())
                           + f" of one process's; rewards equal: {r['hostmem_rewards_equal']}"):
                results.update(bench_hostmem(s, root))
        if "export" in only:
            with row_lines("export", f"each process's memory rise while the model is written out, at "
                           f"{s['ex_processes']} processes", results,
                           lambda r: ", ".join(f"{k}: {max(v['rise_bytes']) / 2**30:.2f} GiB"
                                               for k, v in r["export"].items())):
                results.update(bench_export(s, root))
        if "reader" in only:
            reader_row(results)
        if "exec" in only:
            with row_lines("exec", "programs through the sandbox vs plain subprocess.run", results,
                           lambda r: f"{r['exec_speedup_vs_plain']:.2f}x the programs per second of plain subprocess.run"):
                results.update(bench_exec(s))
    report = {"date": started, "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": shlex.join(["python", "the bench", *argv]), "argv": sys.argv, "machine": machine(device),
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
