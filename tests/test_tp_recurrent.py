"""A Gated DeltaNet layer split over a tensor-parallel group: the ranks' partial outputs add up to the whole layer's.

One process plays every rank of a group of T: a DeltaNet per rank (layers/static_recurrent.py with a `Slice`),
each fed the same inputs, through prefill of left-padded rows, decode steps, an extend of rows with different
numbers of real tokens, a compaction and more decode steps. Their outputs summed (what the decoder's all-reduce
computes) must equal the whole layer's. The tiny model has 4 key heads and 8 value heads, so that each key head
serves two value heads and a rank that paired its key heads with another rank's value heads would show.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import architectures  # noqa: E402
from layers import static_recurrent  # noqa: E402
from layers.engine import WHOLE  # noqa: E402
from layers.tensor_parallel import Slice  # noqa: E402

NK, NV = 4, 8
# every adapted projection of the layer but in_proj_a: its block of the stacked B stays zero and must be cut too
ADAPTED = "linear_attn.in_proj_qkv,linear_attn.in_proj_z,linear_attn.in_proj_b,linear_attn.out_proj"


def deltanet_module(lora=False):
    model, _ = architectures.tiny("qwen3_5", linear_num_key_heads=NK, linear_num_value_heads=NV)
    if lora:
        architectures.adapt(model, 4, ADAPTED, scale=0.3)
    m = model.model.layers[0].linear_attn
    assert (m.num_k_heads, m.num_v_heads) == (NK, NV)
    return m


def layers(m, size, rows):
    """The whole layer and its `size` ranks, loaded."""
    whole = static_recurrent.DeltaNet(m, rows, "cpu", torch.float32, tp=WHOLE)
    ranks = [static_recurrent.DeltaNet(m, rows, "cpu", torch.float32, tp=Slice(rank=t, size=size))
             for t in range(size)]
    for layer in [whole, *ranks]:
        layer.load(m)
    return whole, ranks


def assert_sums_to(whole_out, rank_outs):
    torch.testing.assert_close(torch.stack(rank_outs).sum(0), whole_out, atol=1e-5, rtol=0)


def assert_states_are_slices(whole, ranks):
    """The recurrent states of the ranks side by side are the whole layer's (value heads in rank order)."""
    torch.testing.assert_close(torch.cat([r.rec for r in ranks], 1), whole.rec, atol=1e-5, rtol=0)


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("size", [2, 4])
def test_rank_outputs_sum_to_the_whole_layer(size, lora):
    torch.manual_seed(0)
    m = deltanet_module(lora)
    rows, p, hidden = 3, 7, m.hidden_size
    whole, ranks = layers(m, size, rows)
    for r in ranks:
        assert (r.nk, r.nv, r.conv.shape[1], r.rec.shape[1]) == (NK // size, NV // size, whole.conv_dim // size,
                                                                NV // size)

    def step(run):
        """run(layer) on the whole layer and on every rank; the whole output after checking the sum."""
        want = run(whole)
        assert_sums_to(want, [run(r) for r in ranks])
        return want

    with torch.no_grad():
        valid = torch.arange(p)[None] >= torch.tensor([0, 3, 6])[:, None]  # left padding: 7, 4 and 1 real tokens
        h = torch.randn(rows, p, hidden)
        out = step(lambda layer: layer.prefill(h, valid))
        assert out[valid].abs().mean() > 0.05  # an output large enough that a wrong slice shows
        assert_states_are_slices(whole, ranks)
        for _ in range(3):
            h = torch.randn(rows, hidden)
            step(lambda layer: layer.decode(h))
        # an extend: 5, 2 and 0 real tokens, the last row's states kept as they are
        width = 5
        valid = torch.arange(width)[None] < torch.tensor([5, 2, 0])[:, None]
        h = torch.randn(rows, width, hidden)
        out = step(lambda layer: layer.extend(h, valid))
        assert_states_are_slices(whole, ranks)
        for layer in [whole, *ranks]:
            layer.compact(torch.tensor([2, 0]))
        for _ in range(3):
            h = torch.randn(2, hidden)
            step(lambda layer: layer.decode(h))
        assert_states_are_slices(whole, ranks)


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_holds_its_share_of_the_weights(size, lora):
    """Every weight copy is cut T ways except those every rank needs whole: the gated norm's weight (dv, shared by
    the heads) and, with adapters, the A of the input projections (it reads the whole hidden state) and the B of
    out_proj (it writes the whole hidden size)."""
    m = deltanet_module(lora)
    whole, ranks = layers(m, size, 2)
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    replicated = nbytes(whole.w["norm"])
    assert replicated == m.head_v_dim * 4
    if lora:
        replicated += nbytes(whole.w["in_lr"][0]) + nbytes(whole.w["out_lr"][1])
        # float32; rank 4: the A of in_proj_qkv, in_proj_z and in_proj_b stacked (12, H), out_proj's B (H, 4)
        assert replicated == 4 * (m.head_v_dim + 3 * 4 * m.hidden_size + m.hidden_size * 4)
    assert (whole.nbytes() - replicated) % size == 0
    for r in ranks:
        assert r.nbytes() == (whole.nbytes() - replicated) // size + replicated


def test_the_whole_layer_when_the_group_has_one_rank():
    """A Slice of size 1 reads what the decoder's whole reader reads: the same copies, the same outputs bit for bit."""
    m = deltanet_module()
    whole = static_recurrent.DeltaNet(m, 2, "cpu", torch.float32, tp=WHOLE)
    one = static_recurrent.DeltaNet(m, 2, "cpu", torch.float32, tp=Slice(rank=0, size=1))
    whole.load(m)
    one.load(m)
    assert whole.w.keys() == one.w.keys()
    for k in whole.w:
        for a, b in zip(*(x if isinstance(x, tuple) else (x,) for x in (whole.w[k], one.w[k]))):
            assert (a is None and b is None) or torch.equal(a, b)
    h = torch.randn(2, 5, m.hidden_size)
    with torch.no_grad():
        assert torch.equal(whole.prefill(h, torch.ones(2, 5, dtype=torch.bool)),
                           one.prefill(h, torch.ones(2, 5, dtype=torch.bool)))


@pytest.mark.parametrize("size", [3, 8])
def test_heads_that_do_not_divide_are_refused(size):
    """3 divides neither 4 key heads nor 8 value heads; 8 divides the value heads but not the key heads."""
    m = deltanet_module()
    with pytest.raises(ValueError, match=rf"key heads \({NK}\).*value heads \({NV}\).*divide by {size}"):
        static_recurrent.DeltaNet(m, 2, "cpu", torch.float32, tp=Slice(rank=0, size=size))
