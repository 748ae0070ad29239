"""The training forward split by positions (features/sequence_parallel.py) against the whole forward, for
tests/test_sequence_parallel.py: run under torchrun with gloo (4 processes), it writes one JSON line per (family,
group size, case) to the file named by its argument.

Every rank builds the same tiny model (float32) and holds rows of its own: left-padded prompts of different lengths
and a different number of rows on each rank, so that the group pads rows and columns; one of rank 1's prompts has a
hole, so its layout keeps a mask that the group's attention must apply to every row. The written-out families and two
that train on their own forward (Qwen3-MoE; gpt-oss with sinks and sliding windows). The whole forward runs each
rank's rows alone; the split one runs them in groups of C = 2 (ranks 0-1, 2-3) and C = 4. Compared: the final
hidden states of each rank's rows, and the gradients of the layers' parameters summed over the ranks (each rank's
loss is a fixed random weighting of its rows' hidden states, so the sum is one process's gradient of all the
rows). A case "wrong order" puts each attention's positions back in the wrong order: the comparison must see it.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import architectures  # noqa: E402
import logprobs  # noqa: E402
import model_loading  # noqa: E402
from features import sequence_parallel  # noqa: E402

# family -> config overrides: GQA with fewer K/V heads than ranks (1 K/V head), one per two query heads at C = 2
# and copied at C = 4 (2), a sliding window on every layer, a softcap and a final softcap
CASES = {"qwen3": dict(num_key_value_heads=1), "llama": dict(num_key_value_heads=2),
         "mistral_window": dict(num_key_value_heads=4), "gemma2": dict(),
         "qwen3_moe": dict(), "gpt_oss": dict(num_key_value_heads=1)}  # on their own forward; gpt-oss: sinks, window


def rows_of(rank, vocab):
    """This rank's rows: 2 + rank % 2 of them, prompts of 3 to 9 real tokens left-padded, 6 completion tokens."""
    g = torch.Generator().manual_seed(10 + rank)
    n, width, t = 2 + rank % 2, 15 + rank, 6
    ids = torch.randint(3, vocab, (n, width), generator=g)
    mask = torch.ones(n, width, dtype=torch.long)
    for i in range(n):
        mask[i, :int(torch.randint(0, width - t - 3, (1,), generator=g))] = 0
    if rank == 1:  # a hole inside a prompt: this rank's layout keeps the mask, the others' rows are plain causal
        mask[0, width - t - 2] = 0
    return ids * mask, mask, t


def run(model, rows, forward, weights):
    """(hidden states of the rows that predict completion tokens, gradients of the loss over them)."""
    model.zero_grad()
    ids, mask, t = rows
    layout = forward.layout(model, ids, mask, t, None, None)
    hidden = layout.predicting(forward.hidden(model, layout, None))
    (hidden * weights).sum().backward()
    return hidden.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def main(out_path):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tok = model_loading.build_byte_tokenizer()
    lines = []
    for family, overrides in CASES.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(architectures.config(family, tok, **overrides))
        architectures.randomise(model).float().train()
        rows = rows_of(rank, len(tok))
        n, t = rows[0].shape[0], rows[2]
        weights = torch.randn(n * t, model.config.hidden_size, generator=torch.Generator().manual_seed(rank))
        whole_h, whole_g = run(model, rows, logprobs.Forward(), weights)
        for size in (2, 4):
            group = sequence_parallel.groups(_Dist(rank, world), size)
            for case in ("split", "wrong order"):
                forward = sequence_parallel.Forward(logprobs.Forward(), group)
                original = sequence_parallel._positions_for_heads
                if case == "wrong order":  # each rank's positions come back as another rank's
                    sequence_parallel._positions_for_heads = lambda x, s, g: original(x.roll(x.shape[1] // s, 1), s, g)
                try:
                    h, grads = run(model, rows, forward, weights)
                finally:
                    sequence_parallel._positions_for_heads = original
                grad_diff = 0.0
                for k, g in grads.items():  # each rank's gradient is its positions' share: summed, one process's
                    total, want = g.clone(), whole_g[k].clone()
                    dist.all_reduce(total), dist.all_reduce(want)
                    grad_diff = max(grad_diff, (total - want).abs().max().item() / max(1e-6, want.abs().max().item()))
                lines.append({"family": family, "size": size, "case": case, "rank": rank,
                              "hidden_diff": (h - whole_h).abs().max().item(), "hidden_max": whole_h.abs().max().item(),
                              "grad_rel_diff": grad_diff, "grads": len(grads), "whole_grads": len(whole_g)})
    with open(f"{out_path}.{rank}", "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    dist.barrier()
    dist.destroy_process_group()


class _Dist:
    def __init__(self, rank, world):
        self.rank, self.world_size = rank, world


if __name__ == "__main__":
    main(sys.argv[1])
