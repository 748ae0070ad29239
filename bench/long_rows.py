"""The long row's sequence-parallel part: one row of `sp_tokens` tokens trained (forward and backward) on a small
dense model on the CPU (gloo), whole on one process and split over C = 2 and 4 (--cp_size, features/sequence_parallel.py).

Each C runs under torchrun with C processes (1: plain python), the model sharded over them as a run shards it. Rank
0 holds the row (a group's forward carries one rank's rows: the others' turn is empty), and every rank computes 1/C
of its positions. Measured on each rank, after a first forward and backward that allocates the gradients: the rise
of its private resident memory (RssAnon, read every millisecond) over a second one, the activations and the
transient buffers, and its time. Reported: the largest rank's rise at each C and its ratio to C = 1's; the time ratio;
and the plan's training phase for that shape (runs/plan.py) less the state that was there before (parameters,
gradients, AdamW's moments), against the rise.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_WORKER = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from transformers import AutoModelForCausalLM
import logprobs, model_loading, sharding
from bench.common import memory_rise
from features import sequence_parallel
out, tokens, hidden, layers = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
sharding.map_large_host_tensors()  # as train.py
d = sharding.setup("cpu")
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(model_loading.tiny_config(
    model_loading.build_byte_tokenizer(), hidden_size=hidden, num_hidden_layers=layers, intermediate_size=3 * hidden,
    num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), head_dim=64,
    max_position_embeddings=tokens + 64))
root = sharding.shard(sharding.Root(model), d)
forward = logprobs.Forward(fast_forward=True)
if d.world_size > 1:
    forward = sequence_parallel.Forward(forward, sequence_parallel.groups(d, d.world_size))
rows = 1 if d.rank == 0 else 0
ids = torch.randint(3, 200, (rows, tokens), generator=torch.Generator().manual_seed(1))
mask, t = torch.ones_like(ids), tokens // 2

def step():
    logp, _ = root(logprobs.completion_logprobs, ids, mask, t, 1.0, forward=forward)
    logp.sum().backward()

step()  # allocates the gradients
start = time.perf_counter()
_, rise = memory_rise(step)  # the activations and the step's transient buffers
seconds = time.perf_counter() - start
with open(os.path.join(out, f"rank{d.rank}.json"), "w") as f:
    json.dump({"rise": rise, "seconds": seconds}, f)
sharding.teardown()
"""


def planned(s, size):
    """The plan's training phase for the measured shape, less what was there before the measured step."""
    from config import Config
    import model_loading
    from runs import plan
    hidden, tokens = s["sp_hidden"], s["sp_tokens"]
    config = model_loading.tiny_config(model_loading.build_byte_tokenizer(), hidden_size=hidden,
                                       num_hidden_layers=s["sp_layers"], intermediate_size=3 * hidden,
                                       num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128),
                                       head_dim=64, max_position_embeddings=tokens + 64)
    cfg = Config(device="cpu", beta=0.0, micro_batch_size=1, prompts_per_step=size, num_generations=1,
                 max_prompt_length=tokens - tokens // 2, max_completion_length=tokens // 2, cp_size=size)
    parts = dict(plan.plan(cfg, config, size, "cpu").phase("training").parts)
    before = ("policy parameters", "gradients", "AdamW moments", "AdamW steps")
    return sum(b for k, b in parts.items() if k not in before)


def bench_split_rows(s, root):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    worker = os.path.join(root, "split_rows.py")
    with open(worker, "w") as f:
        f.write(_WORKER)
    rise, seconds, plans = {}, {}, {}
    for size in [int(c) for c in str(s["sp_sizes"]).split(",")]:
        out = os.path.join(root, f"split_{size}")
        os.makedirs(out, exist_ok=True)
        launcher = [sys.executable] if size == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                       f"--nproc_per_node={size}"]
        r = subprocess.run([*launcher, worker, ROOT, out, str(s["sp_tokens"]), str(s["sp_hidden"]),
                            str(s["sp_layers"])], cwd=ROOT, env=env, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"long: the row split over {size} processes failed:\n{r.stderr[-3000:]}")
        ranks = [json.load(open(os.path.join(out, f"rank{k}.json"))) for k in range(size)]
        rise[size], seconds[size] = max(k["rise"] for k in ranks), max(k["seconds"] for k in ranks)
        plans[size] = planned(s, size)
        print(f"  one row of {s['sp_tokens']:,} tokens over {size} process(es): activations {rise[size] / 2**20:,.0f} "
              f"MiB (planned {plans[size] / 2**20:,.0f}), {seconds[size]:.1f} s", flush=True)
    one = min(rise)
    return {"long_split_rise_bytes": rise, "long_split_seconds": seconds, "long_split_planned_bytes": plans,
            "long_split_rise_ratio": {c: rise[c] / rise[one] for c in rise},
            "long_split_time_ratio": {c: seconds[c] / seconds[one] for c in seconds}}
