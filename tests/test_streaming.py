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


def test_groups_are_scored_as_they_land_while_decoding_goes_on(tmp_path, monkeypatch):
    """With rows streaming, each group's rewards are computed in a worker thread as soon as its last row ends, and
    equal one call over the whole batch; a failing reward names the completion's row in the batch."""
    import dataclasses
    import threading

    import sharding
    import train
    from layers import engine
    cfg = train.Config(device="cpu", out_dir=str(tmp_path), prompts_per_step=3, num_generations=4,
                       max_completion_length=12, rollouts_in_flight=2, save_every=0, max_steps=1,
                       check_model=False)
    run = train.setup(cfg, sharding.Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    calls, steps = [], [0]

    def sized(prompts, completions, **_):  # per completion, as reward functions are
        calls.append((len(completions), threading.current_thread().name))
        return [float(len(c) % 3) for c in completions]
    run.task.reward_funcs[:] = [sized, *run.task.reward_funcs]
    run.weights[:] = [0.5, *run.weights]
    decode = engine.StaticDecoder.decode
    monkeypatch.setattr(engine.StaticDecoder, "decode", lambda self, *a, **k: (steps.__setitem__(0, steps[0] + 1),
                                                                             decode(self, *a, **k))[1])
    landed = train.Landing.__call__
    submitted = []  # the decode steps done when each group was handed over
    monkeypatch.setattr(train.Landing, "__call__", lambda self, rows, ids: (submitted.append(steps[0]),
                                                                            landed(self, rows, ids))[1])
    batch = train.rollout(run, 3)
    assert batch.landing is not None and submitted and submitted[0] < steps[0]  # decoding went on after
    total, parts, _ = train.score(run, batch, 3)
    assert sorted(n for n, _ in calls) == [4, 4, 4] and all(name.startswith("rewards") for _, name in calls)
    want_total, want_parts, _ = train.score(run, dataclasses.replace(batch, landing=None), 3)
    assert torch.equal(total, want_total) and parts.keys() == want_parts.keys()
    assert all(torch.equal(parts[k], want_parts[k]) for k in parts)

    texts = batch.completions  # the same step draws the same completions again
    k = next(i for i in range(4, 12) if texts.count(texts[i]) == 1)  # a row past the first group

    def failing(prompts, completions, **_):
        if texts[k] in completions:
            raise ValueError("no score for this one")
        return [0.0] * len(completions)
    run.task.reward_funcs[:] = [failing]
    run.weights[:] = [1.0]
    with pytest.raises(SystemExit, match=f"on completion {k}: "):
        train.score(run, train.rollout(run, 3), 3)
