"""The hostmem row: a whole run's peak host memory per process at 1, 2 and 4 processes (CPU, gloo), and at 4 as
HSDP's 2 replicas x 2 shards (`hm_processes` "2x2").

A Qwen2-shaped model of `hm_layers` layers of hidden size `hm_hidden` (with `hm_moe` = E, a Qwen3-MoE shape of E
experts a layer, trained with --routing_replay) is saved with safetensors weights; train.py runs `hm_steps` steps
on it alone (plain python) and under `torchrun --nproc_per_node N --tp_size=N`, each process reading its own shards
and decoding in one tensor-parallel group (a mesh R x S: --replicas=R, groups of S, each reading its replica's
shards). Each run is launched from a process of its own,
whose `getrusage(RUSAGE_CHILDREN)` is then the peak resident memory of the largest process of that run alone.
Reported: each peak, its ratio to one process's, and whether the runs' rewards equal one process's.

Then the plan's loading and export figures against what the processes hold (`hostmem_phases`): at each number of
processes a worker loads the folder as train.py does (runs/setup.py's load_models: the policy and the reference,
each process reading its own shards) and exports it (runs/export.py), each process measuring the rise of its private
resident memory (RssAnon, read every millisecond) over each phase; the files' pages it maps while reading them are
page cache, measured apart (VmHWM's rise over the loading, less the private rise), and so are the modules loading
imports on first use (torch.distributed.checkpoint, FSDP, the model's class: the interpreter's, which the plan
leaves out as it leaves out torch's, about 55 MiB a process), imported and measured before the loading. Each
process's own figures are kept beside the largest (`per_rank`).
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
    """The row's model folder: config, byte tokenizer and safetensors weights. Qwen2-shaped, or with hm_moe = E
    Qwen3-MoE-shaped: E experts a layer, 4 of them per token, each of intermediate size hidden / 2 (a matrix per
    expert in the files, as Qwen3-MoE is published)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    import model_loading
    heads, hidden = s["hm_hidden"] // 64, s["hm_hidden"]
    shape = dict(hidden_size=hidden, num_hidden_layers=s["hm_layers"], intermediate_size=hidden * 11 // 4,
                 num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=64)
    model_loading.write_tiny_model(path, **shape)
    if s.get("hm_moe"):  # the tokenizer written above, the config replaced by a MoE one
        tok = model_loading.build_byte_tokenizer()
        Qwen3MoeConfig(**shape, num_experts=s["hm_moe"], num_experts_per_tok=4, moe_intermediate_size=hidden // 2,
                       norm_topk_prob=True, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id, bos_token_id=None, tie_word_embeddings=True,
                       max_position_embeddings=512).save_pretrained(path)
    from transformers import AutoConfig
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)).save_pretrained(path)


_PHASES = r"""
import json, os, sys, threading, time
sys.path.insert(0, sys.argv[1])
import sharding
from config import Config
from runs import export, setup
path, out, lora, moe, replicas = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
sharding.map_large_host_tensors()  # as train.py
d = sharding.setup("cpu", replicas=replicas)
cfg = Config(model=path, beta=0.04, out_dir=out, device="cpu", lora_rank=lora, routing_replay=bool(moe),
             check_model=False)

def status():
    with open("/proc/self/status") as f:
        return {l.split(":")[0]: int(l.split()[1]) * 1024 for l in f if l.startswith(("VmHWM", "VmRSS", "RssAnon"))}

def rise(fn):
    sharding.return_host_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from here
    before, top, done = status(), [0], []
    def watch():
        while not done:
            top[0] = max(top[0], status()["RssAnon"])
            time.sleep(0.001)
    t = threading.Thread(target=watch)
    t.start()
    result = fn()
    done.append(1)
    t.join()
    after = status()
    top[0] = max(top[0], after["RssAnon"])
    return result, top[0] - before["RssAnon"], after["VmHWM"] - before["VmRSS"]

def imports():  # the modules loading imports on first use, apart: the interpreter's, not the phase's tensors
    import torch, model_loading
    import torch.distributed.checkpoint, torch.distributed.fsdp, torch.distributed.tensor
    config = model_loading.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model_loading.causal_lm_class(config).from_config(config)

_, modules, _ = rise(imports)
(tok, policy, ref), load, load_hwm = rise(lambda: setup.load_models(cfg, d, "cpu"))
sharding.free_gathered(policy)
_, exp, _ = rise(lambda: export.export_model(policy.lm, tok, os.path.join(out, "model"), master=d.master))
with open(os.path.join(out, f"phases_rank{d.rank}.json"), "w") as f:
    json.dump({"loading": load, "loading_mapped": load_hwm - load, "loading_imports": modules, "export": exp}, f)
"""


def mesh(spec):
    """(processes, replicas) of an hm_processes entry: "4" is 4 processes on one flat mesh, "2x2" 2 replicas x 2."""
    r, _, n = str(spec).rpartition("x")
    return (int(r) * int(n), int(r)) if r else (int(n), 1)


def bench_phases(s, root, path, env, counts):
    """{processes: {phase: (planned, measured), ...}} for loading and export: the plan's figure per process
    (runs/plan.py, at these settings) and the largest process's private rise (`_PHASES`); also the loading's mapped file pages."""
    from config import Config
    from runs import plan
    config = plan.model_config(Config(model=path))
    out = {}
    for spec in counts:
        n, replicas = mesh(spec)
        folder = os.path.join(root, f"phases_{spec}")
        os.makedirs(folder, exist_ok=True)
        launcher = [sys.executable] if n == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={n}"]
        r = subprocess.run([*launcher, os.path.join(root, "phases.py"), ROOT, path, folder, str(s["hm_lora"]),
                            str(s.get("hm_moe", 0)), str(replicas)], cwd=ROOT, env=env, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"hostmem: the phases of {n} processes failed:\n{r.stderr[-3000:]}")
        ranks = [json.load(open(os.path.join(folder, f"phases_rank{k}.json"))) for k in range(n)]
        cfg = Config(model=path, beta=0.04, device="cpu", lora_rank=s["hm_lora"], routing_replay=bool(s.get("hm_moe")),
                     max_prompt_length=s["hm_prompt_len"])
        p = plan.plan(cfg, config, n, "cpu", replicas=replicas)
        row = out[spec] = {phase: (p.phase(phase).total, max(k[phase] for k in ranks))
                           for phase in ("loading", "export")}
        row["loading_mapped"] = max(k["loading_mapped"] for k in ranks)
        row["loading_imports"] = max(k["loading_imports"] for k in ranks)
        row["per_rank"] = ranks
        print(f"  {spec} process(es): " + ", ".join(f"{ph} planned {a / 2**20:.0f} MiB, measured {b / 2**20:.0f} MiB"
                                                  for ph, (a, b) in list(row.items())[:2])
              + f"; modules imported first {row['loading_imports'] / 2**20:.0f} MiB; loading per rank "
              + ", ".join(f"{k['loading'] / 2**20:.0f}" for k in ranks) + " MiB", flush=True)
    return out


def bench_hostmem(s, root):
    path = os.path.join(root, "hostmem_model")
    save_model(path, s)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    peaks, rewards = {}, {}
    counts = str(s["hm_processes"]).split(",")
    for spec in counts:
        n, replicas = mesh(spec)
        out = os.path.join(root, f"hostmem_{spec}")
        args = ["train.py", f"--model={path}", f"--max_steps={s['hm_steps']}", "--beta=0.04", f"--out_dir={out}",
                "--resume=never", "--save_every=0", "--print_completions_every=0", "--device=cpu",
                f"--max_prompt_length={s['hm_prompt_len']}", f"--tp_size={n // replicas}",
                f"--replicas={replicas}",
                *([f"--lora_rank={s['hm_lora']}"] if s["hm_lora"] else []),
                *(["--routing_replay"] if s.get("hm_moe") else [])]
        launcher = [sys.executable] if n == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={n}"]
        r = subprocess.run([sys.executable, "-c", _PEAK, *launcher, *args], cwd=ROOT, env=env, capture_output=True,
                           text=True)
        if r.returncode:
            raise RuntimeError(f"hostmem: the run of {n} processes failed:\n{r.stderr[-3000:]}")
        peaks[spec] = int(r.stdout.split()[-1])
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rewards[spec] = [json.loads(line)["reward"] for line in f]
        print(f"  {spec} process(es): peak {peaks[spec] / 2**30:.2f} GiB", flush=True)
    one = peaks[counts[0]]
    with open(os.path.join(root, "phases.py"), "w") as f:
        f.write(_PHASES)
    phases = bench_phases(s, root, path, env, counts)
    return {"hostmem_peak_bytes": peaks, "hostmem_ratio_to_one": {n: p / one for n, p in peaks.items()},
            "hostmem_rewards_equal": all(r == rewards[counts[0]] for r in rewards.values()),
            "hostmem_phases": phases}
