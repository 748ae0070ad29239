"""The hostmem row: a whole run's peak host memory per process at 1, 2 and 4 processes (CPU, gloo).

A Qwen2-shaped model of `hm_layers` layers of hidden size `hm_hidden` is saved with safetensors weights; train.py
runs `hm_steps` steps on it alone (plain python) and under `torchrun --nproc_per_node N --tp_size=N`, each process
reading its own shards and decoding in one tensor-parallel group. Each run is launched from a process of its own,
whose `getrusage(RUSAGE_CHILDREN)` is then the peak resident memory of the largest process of that run alone.
Reported: each peak, its ratio to one process's, and whether the runs' rewards equal one process's.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# run in a process of its own: RUSAGE_CHILDREN then holds only that run's processes
_PEAK = """
import resource, subprocess, sys
r = subprocess.run(sys.argv[1:], capture_output=True, text=True)
if r.returncode:
    sys.stderr.write(r.stdout[-3000:] + r.stderr[-3000:])
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
sys.exit(r.returncode)
"""


def save_model(path, s):
    """The row's model folder: config, byte tokenizer and safetensors weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import model_loading
    heads = s["hm_hidden"] // 64
    model_loading.write_tiny_model(path, hidden_size=s["hm_hidden"], num_hidden_layers=s["hm_layers"],
                                   intermediate_size=s["hm_hidden"] * 11 // 4, num_attention_heads=heads,
                                   num_key_value_heads=max(1, heads // 4), head_dim=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)).save_pretrained(path)


def bench_hostmem(s, root):
    path = os.path.join(root, "hostmem_model")
    save_model(path, s)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    peaks, rewards = {}, {}
    counts = [int(n) for n in str(s["hm_processes"]).split(",")]
    for n in counts:
        out = os.path.join(root, f"hostmem_{n}")
        args = ["train.py", f"--model={path}", f"--max_steps={s['hm_steps']}", "--beta=0.04", f"--out_dir={out}",
                "--resume=never", "--save_every=0", "--print_completions_every=0", "--device=cpu",
                f"--max_prompt_length={s['hm_prompt_len']}", f"--tp_size={n}",
                *([f"--lora_rank={s['hm_lora']}"] if s["hm_lora"] else [])]
        launcher = [sys.executable] if n == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={n}"]
        r = subprocess.run([sys.executable, "-c", _PEAK, *launcher, *args], cwd=ROOT, env=env, capture_output=True,
                           text=True)
        if r.returncode:
            raise RuntimeError(f"hostmem: the run of {n} processes failed:\n{r.stderr[-3000:]}")
        peaks[n] = int(r.stdout.split()[-1])
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rewards[n] = [json.loads(line)["reward"] for line in f]
        print(f"  {n} process(es): peak {peaks[n] / 2**30:.2f} GiB", flush=True)
    one = peaks[counts[0]]
    return {"hostmem_peak_bytes": peaks, "hostmem_ratio_to_one": {n: p / one for n, p in peaks.items()},
            "hostmem_rewards_equal": all(r == rewards[counts[0]] for r in rewards.values())}
