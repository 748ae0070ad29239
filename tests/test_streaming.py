"""Rows streaming through fewer decode places than there are rows (`sampling.sample(in_flight=...)`, the run's
`--rollouts_in_flight`): when a row ends, its place takes the next row, whose prompt enters that place's cache
while the other rows keep theirs. Each row must sample what it samples with every row in one batch (its own
seed), one turn and several, on each kind of layer a place is emptied and refilled for: attention over a KV
cache (with sliding windows), MoE blocks, Gated DeltaNet states."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import architectures  # noqa: E402
from test_multiturn import STOP_IDS, answering, multi_turn  # noqa: E402


def _one_of_each_kind():
    """The first written-out family of the tests' table for each kind of layer, and the first with windows."""
    chosen = {}
    for name, row in architectures.FAMILIES.items():
        if row.written_out:
            chosen.setdefault(row.layers, name)
            if "window" in row.features:
                chosen.setdefault("window", name)
    return sorted(set(chosen.values()))


@pytest.mark.parametrize("family", _one_of_each_kind())
@pytest.mark.parametrize("turns", [1, 3])
def test_streamed_rows_sample_what_one_batch_samples(family, turns):
    model, tok = architectures.tiny(family)
    text = ["a>", "hello world>", "xyz", "b>" * 7, "q", "the quick brown fox>"] * 2
    enc = tok(text, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():  # stops likely, not certain: rows end at varied lengths, some at the limit
        model.get_output_embeddings().weight[STOP_IDS] *= 2

    def run(**kw):
        respond = answering(lambda r, k: (r % 3) + 2 * k) if turns > 1 else None
        return multi_turn(model, tok, enc, max_turns=turns, respond=respond, **kw)
    whole = run()
    streamed = run(in_flight=4, keep_decoder=True)
    admitted = model.__dict__.pop("_static_decoder").admissions
    assert admitted == len(text) - 4  # every row past the first four took the place of one that ended
    lengths = whole.completion_mask.sum(1)
    assert lengths.unique().numel() > 1, lengths  # rows ended at different steps: places freed at different times
    if turns > 1:
        assert (whole.turns > 1).any()
    for k in ("completion_ids", "completion_mask", "policy_mask", "truncated", "turns"):
        assert torch.equal(getattr(streamed, k), getattr(whole, k)), k
    torch.testing.assert_close(streamed.logprobs, whole.logprobs, atol=1e-5, rtol=0)
