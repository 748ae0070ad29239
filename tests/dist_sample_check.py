"""Sampling with sharded weights on 2 processes whose completions end at different lengths.

    torchrun --standalone --nproc_per_node 2 tests/dist_sample_check.py OUT_JSON

Rank 0's rows all end at their first token (every id counts as EOS there);
rank 1's never end. With the all-reduced stop rule both must run the same
number of forwards and return, whether the weights are gathered once for the
loop or all-gathered again at every forward. Writes what it saw to OUT_JSON
(one file per rank, suffixed with the rank).
"""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import grpo  # noqa: E402
import model_loading  # noqa: E402
import sharding  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

MAX_NEW = 10


def count_all_gathers():
    """Wrap the process-group all-gathers FSDP uses (the name differs across torch versions)."""
    calls = [0]
    for name in ("all_gather_into_tensor", "all_gather_single"):
        if hasattr(dist, name):
            original = getattr(dist, name)

            def counted(*args, _original=original, **kwargs):
                calls[0] += 1
                return _original(*args, **kwargs)
            setattr(dist, name, counted)
    return calls


def main(out_json):
    d = sharding.setup("cpu")
    tokenizer = model_loading.build_byte_tokenizer()
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(model_loading.tiny_config(tokenizer), dtype=torch.float32)
    root = sharding.shard(sharding.Root(lm), d, "fp32").eval()
    vocab = lm.config.vocab_size
    eos_ids = list(range(vocab)) if d.rank == 0 else [vocab + 7]  # rank 0: everything ends; rank 1: nothing does
    prompt = torch.randint(0, 256, (3, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)
    seeds = torch.arange(3) + 3 * d.rank
    calls = count_all_gathers()
    kwargs = dict(max_new_tokens=MAX_NEW, eos_ids=eos_ids, pad_id=tokenizer.pad_token_id, seeds=seeds,
                  check_every=1, all_done=sharding.all_done_fn(d))

    before = calls[0]
    with sharding.gathered(root):
        gathered_rollout = root(grpo.sample, prompt, mask, **kwargs)
    gathered_calls = calls[0] - before

    before = calls[0]
    per_forward_rollout = root(grpo.sample, prompt, mask, **kwargs)  # blocks all-gather at every forward
    per_forward_calls = calls[0] - before

    groups = len(sharding._fsdp_modules(root))
    with open(f"{out_json}.{d.rank}", "w") as f:
        json.dump({"length_gathered": gathered_rollout.completion_ids.shape[1],
                   "length_per_forward": per_forward_rollout.completion_ids.shape[1],
                   "same_tokens": torch.equal(gathered_rollout.completion_ids, per_forward_rollout.completion_ids),
                   "done": (~gathered_rollout.truncated).tolist(),
                   "all_gathers_gathered": gathered_calls, "all_gathers_per_forward": per_forward_calls,
                   "fsdp_groups": groups}, f)
    sharding.teardown()


if __name__ == "__main__":
    main(sys.argv[1])
