"""static_moe.MoE cut for tensor parallelism: T ranks' partial sums add up to the whole block.

One process plays every rank of a group of T: each `MoE(mlp, Slice(rank=t, size=T))` holds its share of the
same whole block, the outputs are summed (what the all-reduce does), and the sum is compared with the block read
in place (`MoE(mlp)`, itself checked against the model's forward in test_static_families.py). The tiny models are
tests/architectures.py's, with the expert biases (zero at initialisation, and two-dimensional, so that
`randomise` leaves them) drawn at random, so that a bias cut wrong, or added by every rank, shows.
"""

import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import architectures  # noqa: E402
from layers import static_moe, transformer  # noqa: E402
from layers.tensor_parallel import Slice  # noqa: E402

EXPERT_LORA = "experts.gate_up_proj,experts.down_proj"
SHARED_LORA = "shared_expert.gate_proj,shared_expert.up_proj,shared_expert.down_proj"


def _blocks(model):
    return [layer.mlp for layer in model.model.layers if transformer.is_moe(layer.mlp)]


def _biased_shared_expert(model, g):
    """Qwen2-MoE's config gives its shared expert no biases: every linear layer of it (and its gate) replaced by
    a biased one with the same weight and a random bias."""
    for mlp in _blocks(model):
        s = mlp.shared_expert
        for owner, name in [(s, "gate_proj"), (s, "up_proj"), (s, "down_proj"), (mlp, "shared_expert_gate")]:
            old = getattr(owner, name)
            new = nn.Linear(old.in_features, old.out_features, bias=True)
            with torch.no_grad():
                new.weight.copy_(old.weight)
                new.bias.copy_(torch.randn(new.bias.shape, generator=g) * 0.3)
            setattr(owner, name, new)


def build(case, lora=False, **overrides):
    """(model, the MoE blocks): case is a family, or "qwen2_moe_biased" (a biased shared expert)."""
    family = "qwen2_moe" if case == "qwen2_moe_biased" else case
    model, _ = architectures.tiny(family, **overrides)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for mlp in _blocks(model):
            for name in ("gate_up_proj_bias", "down_proj_bias"):
                b = getattr(mlp.experts, name, None)
                if b is not None:
                    b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    if case == "qwen2_moe_biased":
        _biased_shared_expert(model, g)
    if lora:
        targets = EXPERT_LORA + ("," + SHARED_LORA if family == "qwen2_moe" else "")
        architectures.adapt(model, 4, targets, scale=0.3)
    return model, _blocks(model)


def tokens(model, n=14):
    # large enough that gpt-oss's clamp (swiglu_limit 7) bites on some gate and up values
    g = torch.Generator().manual_seed(2)
    return torch.randn(n, model.config.hidden_size, generator=g) * 4


def expected_nbytes(mlp, rank, size):
    """What one rank holds: 1/T of every expert weight and of the gate_up bias (the intermediate dimension cut),
    the down bias on rank 0 alone, the router whole; the shared expert likewise (1/T of gate, up, their biases
    and down; down's bias on rank 0), its gate whole."""
    def nb(t):
        return 0 if t is None else t.nbytes

    e = mlp.experts
    router = getattr(mlp, "gate", None) or mlp.router
    cut = nb(e.gate_up_proj) + nb(e.down_proj) + nb(getattr(e, "gate_up_proj_bias", None))
    rank0 = nb(getattr(e, "down_proj_bias", None))
    whole = nb(router.weight) + nb(getattr(router, "bias", None))
    shared = getattr(mlp, "shared_expert", None)
    if shared is not None:
        cut += sum(nb(m.weight) + nb(m.bias) for m in (shared.gate_proj, shared.up_proj)) + nb(shared.down_proj.weight)
        rank0 += nb(shared.down_proj.bias)
        whole += nb(mlp.shared_expert_gate.weight) + nb(mlp.shared_expert_gate.bias)
    assert cut % size == 0
    return cut // size + (rank0 if rank == 0 else 0) + whole


def _check_sum(parts, whole_moe, h):
    with torch.no_grad():
        want, want_experts = whole_moe(h)
        outs = [p(h) for p in parts]
    got = sum(o for o, _ in outs)
    torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=0)
    for _, experts in outs:
        assert torch.equal(experts, want_experts)


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen2_moe", "qwen2_moe_biased", "gpt_oss"])
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("size", [2, 4])
def test_ranks_partial_sums_add_up_to_the_whole_block(case, lora, size):
    """The T partial outputs sum to the whole block's output, every rank picks the block's experts, and each
    rank holds 1/T of the expert weights (plus the replicated router and shared gate, and on rank 0 the down
    biases); with the grouped matmul and its stand-in. With LoRA the adapters are merged into the shares."""
    model, blocks = build(case, lora)
    h = tokens(model)
    for mlp in blocks:
        whole = static_moe.MoE(mlp)
        parts = [static_moe.MoE(mlp, Slice(rank=t, size=size)) for t in range(size)]
        _check_sum(parts, whole, h)
        for t, p in enumerate(parts):
            assert p.nbytes() == expected_nbytes(mlp, t, size)
        for p in parts:
            p.grouped = False
        whole.grouped = False
        _check_sum(parts, whole, h)
        assert whole.nbytes() == 0


@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss"])
def test_size_one_reads_the_block_in_place_as_before(case):
    """A group of one is the block read in place: no copy, the same output bit for bit."""
    model, blocks = build(case)
    h = tokens(model)
    for mlp in blocks:
        one = static_moe.MoE(mlp, Slice(rank=0, size=1))
        assert one.held is None and one.nbytes() == 0
        with torch.no_grad():
            a, ea = one(h)
            b, eb = static_moe.MoE(mlp)(h)
        assert torch.equal(a, b) and torch.equal(ea, eb)


@pytest.mark.parametrize("case", ["qwen2_moe_biased", "gpt_oss"])
def test_load_refreshes_the_shares_in_place(case):
    """The shares are copies: a change to the block shows only after `load`, which copies into the same tensors
    (a captured CUDA graph reads them), after which the sum is the changed block again."""
    model, blocks = build(case)
    h = tokens(model)
    mlp = blocks[0]
    parts = [static_moe.MoE(mlp, Slice(rank=t, size=2)) for t in range(2)]
    ptrs = [{k: v.data_ptr() for k, v in p.held.items() if v is not None} for p in parts]
    with torch.no_grad():
        before = sum(p(h)[0] for p in parts)
        for p in mlp.parameters():
            p.mul_(-1.5 if p.dim() == 1 else 1.5)
        assert torch.equal(sum(p(h)[0] for p in parts), before)  # nothing read in place
    for p in parts:
        p.load(mlp)
    assert ptrs == [{k: v.data_ptr() for k, v in p.held.items() if v is not None} for p in parts]
    _check_sum(parts, static_moe.MoE(mlp), h)


@pytest.mark.parametrize("case, overrides, size, what", [
    ("qwen3_moe", dict(moe_intermediate_size=30), 4, "the MoE's intermediate size (30)"),
    # 2I = 12 divides by 4, but I = 6 (gate, up) pairs do not: a rank would get half a pair
    ("gpt_oss", dict(intermediate_size=6), 4, "the MoE's intermediate size (6)"),
    ("qwen2_moe", dict(shared_expert_intermediate_size=50), 4, "the shared expert's intermediate size (50)"),
])
def test_a_size_that_does_not_divide_is_refused_naming_it(case, overrides, size, what):
    model, blocks = build(case, **overrides)
    with pytest.raises(ValueError, match=f"{what} does not divide by {size}".replace("(", r"\(").replace(")", r"\)")):
        static_moe.MoE(blocks[0], Slice(rank=1, size=size))
