"""The export row: how much each process's resident memory rises while the trained model is written out, and how
long it takes, at 1, 2 and 4 processes (CPU, gloo), for three ways of writing it:

  gather   the whole model gathered on rank 0 (`get_model_state_dict(full_state_dict=True, cpu_offload=True)`), then
           `save_pretrained` (the export before runs/export.py wrote one tensor at a time)
  stream   runs/export.py: each tensor gathered in turn, rank 0 writing it into its file
  dcp      torch.distributed.checkpoint's Hugging Face writer: each rank writes its shards, then rank 0 copies them
           into whole tensors (`HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)`)

The model is a Qwen2 shape of `ex_layers` layers of hidden size `ex_hidden` with an `ex_vocab`-token vocabulary,
untied, in `ex_dtype`, built on the meta device and sharded with fully_shard per block and at the root, as train.py
does, its shards filled with random values. Each process measures its own rise: the peak resident set (VmHWM, reset
through /proc/self/clear_refs just before) minus the resident set before the export. Large host tensors are mapped
and unmapped on their own as in train.py (sharding.map_large_host_tensors), so what is freed leaves the process.
"""

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_WORKER = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import torch, torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen2Config
import model_loading, sharding
from runs import export as run_export
out, method, hidden, layers, vocab, dtype = sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7]), sys.argv[7]
sharding.map_large_host_tensors()
d = sharding.setup("cpu")
heads = hidden // 64
config = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=hidden * 11 // 4,
                     num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), vocab_size=vocab,
                     tie_word_embeddings=False)
with torch.device("meta"):
    lm = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
root = sharding.Root(lm)
if d.world_size > 1:
    sharding.shard(root, d, mixed_precision="fp32")
root.to_empty(device="cpu")
torch.manual_seed(d.rank)
with torch.no_grad():
    for p in root.parameters():
        (p.to_local() if hasattr(p, "to_local") else p).normal_(0, 0.02)
largest = max(p.numel() * p.element_size() for p in lm.parameters())
tok = model_loading.build_byte_tokenizer()
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def peak():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM"))
sharding.return_host_memory()
if dist.is_initialized():
    dist.barrier()
before = rss()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM from here
t = time.perf_counter()
path = f"{out}/model"
if method == "stream":
    run_export.export_model(lm, tok, path, master=d.master)
elif method == "gather":
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    full = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if d.master:  # as the export was: every tensor checked for NaN and inf, then save_pretrained
        assert all(int((~torch.isfinite(t)).sum()) == 0 for t in full.values())
        lm.save_pretrained(path, state_dict={k.removeprefix("lm."): v for k, v in full.items()})
    del full
elif method == "dcp":
    import torch.distributed.checkpoint as dcp
    writer = dcp.HuggingFaceStorageWriter(path, save_distributed=True, enable_consolidation=True)
    dcp.save(lm.state_dict(), storage_writer=writer, no_dist=d.world_size == 1)
if dist.is_initialized():
    dist.barrier()
seconds = time.perf_counter() - t
with open(f"{out}/rank{d.rank}.json", "w") as f:
    json.dump({"rise": peak() - before, "before": before, "seconds": seconds, "largest": largest}, f)
sharding.teardown()
"""


def bench_export(s, root):
    script = os.path.join(root, "export_worker.py")
    with open(script, "w") as f:
        f.write(_WORKER)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    found = {}
    for n in [int(x) for x in str(s["ex_processes"]).split(",")]:
        for method in s["ex_methods"].split(","):
            out = os.path.join(root, f"export_{method}_{n}")
            os.makedirs(out, exist_ok=True)
            launcher = [sys.executable] if n == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                        f"--nproc_per_node={n}"]
            args = [script, ROOT, out, method, str(s["ex_hidden"]), str(s["ex_layers"]), str(s["ex_vocab"]),
                    s["ex_dtype"]]
            t = time.perf_counter()
            for k in range(n):
                if os.path.exists(os.path.join(out, f"rank{k}.json")):
                    os.remove(os.path.join(out, f"rank{k}.json"))
            r = subprocess.run([*launcher, *args], cwd=ROOT, env=env, capture_output=True, text=True)
            # gloo sometimes aborts while the group is torn down (tests/launches.py, exited_after_finishing): the
            # figures stand when every rank wrote its own
            if r.returncode and not all(os.path.exists(os.path.join(out, f"rank{k}.json")) for k in range(n)):
                raise RuntimeError(f"export: {method} at {n} processes failed:\n{(r.stdout + r.stderr)[-3000:]}")
            ranks = [json.load(open(os.path.join(out, f"rank{k}.json"))) for k in range(n)]
            size = sum(os.path.getsize(os.path.join(out, "model", f)) for f in os.listdir(os.path.join(out, "model"))
                       if f.endswith(".safetensors"))
            found[f"{method}_{n}"] = {"rise_bytes": [x["rise"] for x in ranks], "seconds": ranks[0]["seconds"],
                                      "largest_tensor_bytes": ranks[0]["largest"], "written_bytes": size}
            rises = ", ".join(f"{x['rise'] / 2**30:.2f}" for x in ranks)
            print(f"  {method} at {n}: rise per rank {rises} GiB (largest tensor {ranks[0]['largest'] / 2**30:.2f} "
                  f"GiB), {ranks[0]['seconds']:.1f}s, {size / 2**30:.2f} GiB written "
                  f"(launch {time.perf_counter() - t:.0f}s)", flush=True)
    return {"export": found}
