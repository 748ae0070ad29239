"""Tensor-parallel decoding (layers/tensor_parallel.py, StaticDecoder with a Slice) against one rank decoding alone.

One torchrun launch of tests/tp_decode.py (4 processes, gloo, float32) decodes each family's rows in groups of 2
and of 4; these tests read what every rank wrote. A train.py run with --tp_size=2 is one of test_distributed.py's.
The same launch exports three models sharded over its 4 processes (the export at 1 and 2 processes: test_lora.py,
test_distributed.py).
"""

import glob
import json
import os

import pytest
import torch

import architectures
import tp_decode
from launches import ROOT, export_differs, launch

SCRIPT = os.path.join(ROOT, "tests", "tp_decode.py")
TOLERANCE = 1e-5  # float32: the all-reduces add the ranks' partial sums in another order than one matmul does


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tp") / "decoded")
    launch(SCRIPT, [out], nproc=4, timeout=600)
    return out


@pytest.fixture(scope="module")
def decoded(launched):
    out = launched
    rows = [json.loads(line) for path in sorted(glob.glob(out + ".*")) for line in open(path) if line.strip()]
    assert {r["rank"] for r in rows} == {0, 1, 2, 3}
    return rows


def _trimmed(tokens, mask):
    return [t[:sum(m)] for t, m in zip(tokens, mask)]


def test_every_rank_samples_what_one_rank_samples(decoded):
    """Greedy and sampled tokens, one turn and several (environment answers fed back), top-k: the same tokens,
    masks and turns as the whole decoder, on every rank of groups of 2 and of 4; log-probs within float32 noise."""
    seen = set()
    for r in decoded:
        where = (r["family"], r["case"], r["size"], r["rank"])
        assert _trimmed(r["tokens"], r["mask"]) == _trimmed(r["whole_tokens"], r["whole_mask"]), where
        assert r["mask"] == r["whole_mask"] and r["policy"] == r["whole_policy"], where
        assert r["logprob_diff"] <= TOLERANCE, where
        seen.add((r["family"], r["case"], r["size"]))
    rows = {name: row for name, row in architectures.FAMILIES.items() if row.tp is not None}
    for family in [*rows, *(name + "_kv2" for name, row in rows.items() if row.tp_kv_copies)]:
        for size in (2, 4):
            assert {(family, "greedy", size), (family, "turns", size)} <= seen
    # the multi-turn case took answers: some row paused and resumed
    assert all(max(r["turns"]) > 1 for r in decoded if r["case"] == "turns")


def test_greedy_tokens_equal_generate(decoded):
    for r in decoded:
        if r["case"] == "greedy":
            for i, (ours, mask) in enumerate(zip(r["tokens"], r["mask"])):
                n = sum(mask)
                assert ours[:n] == r["generate"][i][:n], (r["family"], r["size"], r["rank"], i)


def test_each_rank_holds_its_share_of_the_weights(decoded):
    """A rank's decoder holds 1/T of the weights the whole decoder reads (its copies and the MoE experts it reads
    in place), plus what stays whole on every rank: the norms (each layer's, a recurrent layer's gated norm, the
    final one), MoE routers and shared-expert gates; and on rank 0 only the biases of the projections back to the
    hidden size. The vocabulary splits in ceil(V / T) rows, so shares differ by at most one row of the embedding
    and one of the head."""
    checked = 0
    for r in decoded:
        if r["family"].endswith("_kv2"):  # with fewer K/V heads than ranks, ranks hold copies of them
            continue
        whole, first = r["kept_whole"]
        everything = r["whole_bytes"] + r["in_place"]
        sliced = everything - whole - first
        mine = r["bytes"] - whole - (first if r["tp_rank"] == 0 else 0)
        row = r["hidden"] * r["element"] * (1 if r["tied"] else 2)
        assert abs(mine - sliced / r["size"]) <= row, (r["family"], r["size"], r["rank"], mine, sliced)
        assert whole < 0.1 * everything  # the remainder is small beside what is sliced
        checked += 1
    assert checked
    # the shares of a group add up to the whole: nothing is held twice but what is kept whole
    for family in {r["family"] for r in decoded if not r["family"].endswith("_kv2")}:
        for size in (2, 4):
            group = [r for r in decoded if r["family"] == family and r["size"] == size and r["case"] == "greedy"
                     and r["rank"] < size]
            whole, first = group[0]["kept_whole"]
            total = sum(r["bytes"] for r in group)
            assert total == group[0]["whole_bytes"] + group[0]["in_place"] + (size - 1) * whole, (family, size)


@pytest.fixture(scope="module")
def sharded(launched):
    rows = [json.loads(line) for path in sorted(glob.glob(launched + "-sharded.*")) for line in open(path)
            if line.strip()]
    assert {r["rank"] for r in rows} == {0, 1, 2, 3}
    return rows


def test_slices_cut_from_fsdp_shards_are_those_of_the_whole_layers(sharded):
    """Models fully_shard-ed over the 4 processes (tp_decode.SHARDED, LoRA on every layer: biases, a gated query, a
    Gated DeltaNet layer, fused and interleaved experts, a shared expert, K/V heads held on two ranks at T = 4): every
    copy of every rank's decoder, cut from the shards, is bit for bit the one cut from the whole model, in float32
    and in bf16 by FSDP2's mixed precision."""
    for r in sharded:
        assert r["differ"] == [], (r["family"], r["dtype"], r["size"], r["rank"], r["differ"])
    assert {(r["family"], r["size"]) for r in sharded} == {(f, t) for f in tp_decode.SHARDED for t in (2, 4)}


def test_no_rank_materializes_a_whole_layer_or_the_whole_embedding(sharded):
    """While a decoder loads its slices from the shards, no tensor any rank allocates is as large as a whole layer
    (what FSDP2's `unshard` gathers) or, for the root, as the whole embedding (what `full_tensor` gathers); and none but
    the copies it keeps (and a recurrent layer's states) is as large as its layer's largest weight: what a rank sends
    and receives is its piece of one tensor, about 1/T of it (the vocabulary's shares are ceil(V / T) rows; a rank of
    each of the W / T groups takes each share, so a rank may send W / T rows more)."""
    for r in sharded:
        where = (r["family"], r["dtype"], r["size"], r["rank"])
        row, ranks = r["embed_bytes"] // r["vocab"], 4
        for layer, n, kept in r["made"]:
            if layer == "root":
                assert n <= (-(-r["vocab"] // r["size"]) + ranks // r["size"]) * row < r["embed_bytes"], (where, n)
            else:
                assert n < min(r["layer_bytes"]), (where, layer, n)
                assert kept or n < r["largest"][layer], (where, layer, n)


def test_export_of_a_model_sharded_over_four_processes(launched):
    """Each tensor gathered in turn from 4 ranks' shards (one rank's empty) and written by rank 0 into files of
    20 kB: the folder loads with from_pretrained and holds exactly the weights one process merges, tied (Qwen2)
    and untied with LoRA (Llama), and Qwen3-MoE's experts with their adapters, written as a matrix per expert."""
    with open(launched + "-export.json") as f:
        exported = json.load(f)
    assert sorted(exported) == ["llama", "qwen2", "qwen3_moe"]
    for family, (folder, want) in exported.items():
        assert export_differs(folder, torch.load(want)) is None, (family, export_differs(folder, torch.load(want)))
        assert len(glob.glob(os.path.join(folder, "model-*-of-*.safetensors"))) > 1, family
    with open(os.path.join(exported["qwen3_moe"][0], "model.safetensors.index.json")) as f:
        assert "model.layers.0.mlp.experts.5.up_proj.weight" in json.load(f)["weight_map"]


def test_tp_size_that_does_not_divide_the_processes_is_refused():
    import config
    from runs.cli import ConfigError
    with pytest.raises(ConfigError, match="tp_size"):
        config.validate(config.Config(tp_size=3), world_size=4)


def test_vocabulary_slices_draw_the_whole_vocabularys_token():
    """Each slice's best joined (what the ranks of a group gather) is the draw over the whole vocabulary: the same
    token, ties to the lowest id as argmax breaks them, the same log-prob."""
    import sampling
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 37, generator=g) * 3
    logits[0, 5] = logits[0, 30] = 50.0  # a greedy tie across two slices: the lower id wins
    keys = sampling.row_keys(torch.arange(6), 3)
    for draw in (sampling.Draw(0.0), sampling.Draw(0.7), sampling.Draw(0.7, top_k=5)):
        want_tok, want_lp = draw.whole(logits, keys)
        for size in (2, 3, 4):
            for tok, lp in _sliced_draws(draw, logits, keys, size):  # every rank's
                assert torch.equal(tok, want_tok), (draw, size)
                assert torch.allclose(lp, want_lp, atol=1e-5), (draw, size)


def _sliced_draws(draw, logits, keys, size):
    """Draw.sliced on each rank of a group of `size` simulated in one process: a first pass collects what each rank
    gives the group's gather, a second hands every rank all of it, as the collective would."""
    from layers.tensor_parallel import Slice
    parts = {}

    class Group(Slice):
        def gather_rows(self, x):
            parts[self.rank] = x
            return torch.cat([parts[r] for r in range(self.size)]) if len(parts) == self.size else x

    out = []
    for _ in range(2):
        for rank in range(size):
            tp = Group(rank, size)
            a, b = tp.span(logits.shape[1], even=False)
            out.append(draw.sliced(logits[:, a:b], keys, tp, logits.shape[1]))
    return out[size:]
