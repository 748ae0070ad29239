"""Sequence parallelism (--cp_size, features/sequence_parallel.py): the written-out training forward split by
positions over a group, its attention between two all-to-alls, against the whole forward.

One torchrun launch of tests/sp_layers.py (4 processes, gloo, float32) runs each family's rows split in groups of 2
and of 4; these tests read what every rank wrote. train.py runs at --cp_size=2 and 4 against one process are in
test_distributed.py. The refusals are unit calls.
"""

import glob
import json
import os

import pytest
from transformers import AutoModelForCausalLM

import architectures
import config
import model_loading
import sp_layers
from features import sequence_parallel
from launches import ROOT, launch
from runs.cli import ConfigError

TOLERANCE = 1e-5  # float32: the attention sums its keys in another order once positions are exchanged


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sp") / "split")
    launch(os.path.join(ROOT, "tests", "sp_layers.py"), [out], nproc=4, timeout=600)
    lines = [json.loads(line) for path in sorted(glob.glob(out + ".*")) for line in open(path)]
    assert {(x["family"], x["size"], x["case"], x["rank"]) for x in lines} == {
        (f, s, c, r) for f in sp_layers.CASES for s in (2, 4) for c in ("split", "wrong order") for r in range(4)}
    return lines


def test_a_split_forward_gives_the_whole_forwards_hidden_states_and_gradients(split):
    """Every family (1 K/V head for 2 and 4 ranks: repeated; a sliding window; Gemma 2's softcaps), groups of 2 and
    of 4, rows and widths differing by rank: each rank's rows' hidden states are the whole forward's, and the
    layers' gradients summed over the ranks are one process's, within float32's reordering."""
    for x in (x for x in split if x["case"] == "split"):
        assert x["hidden_diff"] <= TOLERANCE * x["hidden_max"], x
        assert x["grad_rel_diff"] <= TOLERANCE and x["grads"] == x["whole_grads"], x


def test_positions_put_back_in_the_wrong_order_are_seen(split):
    """The comparison above fails where each attention's output goes back to the wrong positions."""
    for x in (x for x in split if x["case"] == "wrong order"):
        assert x["hidden_diff"] > 0.1 * x["hidden_max"] and x["grad_rel_diff"] > 0.1, x


def _model(family, **overrides):
    tok = model_loading.build_byte_tokenizer()
    return AutoModelForCausalLM.from_config(architectures.config(family, tok, **overrides))


def test_what_cannot_be_split_is_refused_in_one_line():
    """A recurrent layer names its class; heads that do not divide say both numbers; a dense written-out model and a
    model trained on its own forward (MoE) pass. Settings it cannot take stop at the command line."""
    assert sequence_parallel.refusal(_model("qwen3"), 2) is None
    assert sequence_parallel.refusal(_model("qwen3_5"), 2).startswith(
        "Qwen3_5GatedDeltaNet carries a recurrent state along the sequence")
    assert sequence_parallel.refusal(_model("qwen3_moe"), 2) is None  # its own forward, the exchange as attention
    assert sequence_parallel.refusal(_model("llama"), 8) == "LlamaForCausalLM's 4 attention heads do not divide into " \
                                                            "8 groups"
    for setting, said in (("shared_prompts", "cannot take --shared_prompts"),):
        with pytest.raises(ConfigError) as e:
            config.validate(config.Config(cp_size=2, **{setting: True}), 2)
        assert e.value.code.startswith(f"config error: --cp_size: {said}")
    with pytest.raises(ConfigError) as e:
        config.validate(config.Config(cp_size=2), 1)
    assert "--cp_size: sequence parallelism: a group of 2 needs torchrun" in e.value.code


def test_turns_are_even_across_ranks_and_empty_turns_pad_nothing(monkeypatch):
    """A token budget gives ranks different numbers of micro-batches: before taking turns a rank splits its own up to
    the most any rank has (here another rank's 3 against its 1 of 4 rows: halved, then the larger half halved), then its
turn k carries its micro-batch
    k // 2 and the other's turn an empty one, one column wide (so that the group's forward pads to the rows it
    carries, not to an empty turn's width)."""
    import torch
    import logprobs
    import sharding
    from types import SimpleNamespace
    monkeypatch.setattr(sharding, "all_gather_rows", lambda x, d: torch.cat([x, torch.tensor([3])]))
    monkeypatch.setattr(sequence_parallel.dist, "get_world_size", lambda group: 2)
    mine = [logprobs.MicroBatch(torch.arange(4), slice(0, 30), 6, 25)]
    for rank in (0, 1):
        turns = sequence_parallel.in_turn(mine, SimpleNamespace(device="cpu"), rank, None)
        assert len(turns) == 6
        own = [mb for k, mb in enumerate(turns) if k % 2 == rank]
        assert [mb.rows.tolist() for mb in own] == [[0], [1], [2, 3]] and {mb.width for mb in own} == {25}
        assert all(len(mb.rows) == 0 and mb.width == 1 for k, mb in enumerate(turns) if k % 2 != rank)
