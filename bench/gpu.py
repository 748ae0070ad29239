"""Every GPU row in one command, for whoever is lent a GPU for a few minutes: run this first.

    python -m bench.gpu              # on a CUDA machine: each row below, writing bench/results/<gpu>-<date>-<row>.json
    python -m bench.gpu --dry-run    # anywhere: each row's command checked (its rows and settings parse), not run

Without a CUDA GPU it is a dry run: it checks each row's command as `python -m bench` would parse it and says,
row by row, why it skips. The rows, in the order they run, each within its own time limit so that the whole fits
in `BUDGET_S` (a row past its limit is stopped and recorded as such; the next one runs):

  cuda-tests  the suite's CUDA tests: every kernel and the fast decoder against their PyTorch paths
  decode      Qwen3-0.6B's shape, 64 rows: our sampler vs `model.generate`, and the bytes a decode step reads over
              its time against a copy's bandwidth measured in the same run
  families    every family at its published shape (Llama-3.2-1B, Qwen3-0.6B, ...) vs `model.generate`, and the
              training forward of each
  step        one GRPO step of ours vs TRL's GRPOTrainer, Qwen2.5-0.5B's shape
  longtail    streaming at Qwen3-0.6B's shape with ZeroSync's setting (512-token completions, 8 per prompt):
              decode-only streaming against full rows, then whole steps synchronous, through places, 1 and 2 ahead
  shared      a group's prompt computed once in training vs padded rows (FlexAttention / the flash path on CUDA)

Each row is a plain `python -m bench ...` (or pytest) command: the list below is the one place they are written.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET_S = 480  # the whole script: 8 minutes of a lent GPU, with time left to rerun a row

# (row, seconds it may take, the command: `python -m bench` arguments, or a pytest command line)
ROWS = [
    ("cuda-tests", 75, ["pytest", "tests/test_kernels.py", "tests/test_cuda_families.py", "-q", "-x"]),
    ("decode", 60, ["--model=qwen3-0.6b", "--only=decode", "--set", "decode_batch=64", "--reps=5"]),
    ("families", 120, ["--only=families,trainfwd", "--set", "fam_shapes=real", "--reps=3"]),
    ("step", 75, ["--model=qwen2.5-0.5b", "--only=step", "--reps=3"]),
    ("longtail", 120, ["--model=qwen3-0.6b", "--only=longtail", "--set", "lt_max_new_tokens=512",
                       "--set", "lt_step_generations=8", "--reps=3"]),
    ("shared", 30, ["--only=shared", "--reps=5"]),
]


def command(row, args, out):
    """The argv that runs `row` (writing its results to `out`, for the bench's rows)."""
    if args[0] == "pytest":
        return [sys.executable, "-m", *args]
    return [sys.executable, "-m", "bench", *args, f"--json={out}"]


def check(args):
    """Why `python -m bench args` would not start ('' if it would): its rows, models and --set keys, parsed as the
    bench parses them; a pytest row's test files, that they exist."""
    if args[0] == "pytest":
        missing = [a for a in args[1:] if a.endswith(".py") and not os.path.exists(os.path.join(ROOT, a))]
        return f"no such test file: {', '.join(missing)}" if missing else ""
    from bench.__main__ import parse
    try:
        parse(list(args))
    except SystemExit as e:  # argparse's error, printed on stderr; its exit code here
        return f"the bench refuses its arguments (exit {e.code})"
    return ""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="check each row's command, run none")
    parser.add_argument("--only", default="", help=f"comma-separated rows, of {', '.join(r for r, _, _ in ROWS)}")
    opts = parser.parse_args(argv)
    import torch
    rows = [r for r in ROWS if not opts.only or r[0] in opts.only.split(",")]
    if sum(limit for _, limit, _ in rows) > BUDGET_S:
        raise SystemExit(f"the rows' limits add up to more than the {BUDGET_S}s budget")
    gpu = torch.cuda.get_device_name(0).split()[-1].lower() if torch.cuda.is_available() else None
    dry = opts.dry_run or gpu is None
    why = "--dry-run" if opts.dry_run else f"no CUDA GPU here (torch {torch.__version__} sees none)"
    date = time.strftime("%Y-%m-%d", time.gmtime())
    summary, bad = {"gpu": gpu, "date": date, "rows": {}}, 0
    for name, limit, args in rows:
        out = os.path.join(ROOT, "bench", "results", f"{gpu or 'none'}-{date}-{name}.json")
        cmd = command(name, args, out)
        problem = check(args)
        if problem:
            bad += 1
            print(f"{name}: cannot run: {problem}: {shlex.join(args)}", flush=True)
            summary["rows"][name] = {"status": "bad command", "why": problem}
            continue
        if dry:
            print(f"{name}: skipped, {why}; would run (up to {limit}s): {shlex.join(cmd[1:])}", flush=True)
            summary["rows"][name] = {"status": "skipped", "why": why, "command": cmd[1:]}
            continue
        print(f"{name}: running (up to {limit}s): {shlex.join(cmd[1:])}", flush=True)
        t = time.perf_counter()
        try:
            code = subprocess.run(cmd, cwd=ROOT, timeout=limit).returncode
            status = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            status = f"stopped at its {limit}s limit"
        seconds = time.perf_counter() - t
        print(f"{name}: {status} in {seconds:.0f}s", flush=True)
        summary["rows"][name] = {"status": status, "seconds": round(seconds, 1), "command": cmd[1:],
                                 "results": os.path.relpath(out, ROOT) if os.path.exists(out) else None}
    if not dry:
        with open(os.path.join(ROOT, "bench", "results", f"{gpu}-{date}-gpu-summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
