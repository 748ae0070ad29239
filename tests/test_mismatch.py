"""The sampler-trainer mismatch metrics (grpo.mismatch_sums / mismatch_metrics, reported as mismatch/* and, for
rows carried through a weight change, mismatch_carried/*) against a float64 reference written out token by token
from the same per-token log-probs; the step line's warning past --mismatch_warn."""

import contextlib
import io
import json
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpo  # noqa: E402
import train  # noqa: E402
from features import streaming  # noqa: E402


def reference(logp, sampler, mask):
    """The figures by their definitions, in float64 Python numbers, one token at a time."""
    rhos, per_seq = [], []
    for row_t, row_s, row_m in zip(logp.tolist(), sampler.tolist(), mask.tolist()):
        lrs = [t - s for t, s, m in zip(row_t, row_s, row_m) if m]
        rhos += [math.exp(x) for x in lrs]
        if lrs:
            per_seq.append(lrs)
    n = len(rhos)
    all_lr = [x for seq in per_seq for x in seq]
    clamp = grpo.MISMATCH_SEQ_CLAMP
    return {"log_ratio": -sum(all_lr) / n, "k3": sum(r - 1 - math.log(r) for r in rhos) / n,
            "chi2_token": sum(r * r for r in rhos) / n - 1,
            "chi2_seq": sum(math.exp(2 * max(-clamp, min(clamp, sum(seq)))) for seq in per_seq) / len(per_seq) - 1,
            "ess": sum(rhos) ** 2 / (n * sum(r * r for r in rhos)),
            "ppl_ratio": sum(math.exp(-sum(seq) / len(seq)) for seq in per_seq) / len(per_seq)}


def finish(parts):
    total = {k: sum(float(p[k]) for p in parts) for k in parts[0]}
    return grpo.mismatch_metrics(total)


def test_the_metrics_equal_their_definitions_over_micro_batches():
    """Random log-probs, a mask with holes and a row with no counted token, split in two micro-batches whose sums
    add; one sequence's summed ratio large enough that the clamp acts."""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(6, 9, generator=g) * 3
    sampler = logp + torch.randn(6, 9, generator=g) * 0.3
    sampler[5] = logp[5] - 4.0  # rho = e^4 on each of 9 tokens: the sequence's sum, 36, is clamped to 20
    mask = (torch.rand(6, 9, generator=g) > 0.3).float()
    mask[2] = 0  # a row the loss does not count
    mask[5] = 1
    got = finish([grpo.mismatch_sums(logp[:3], sampler[:3], mask[:3]), grpo.mismatch_sums(logp[3:], sampler[3:],
                                                                                         mask[3:])])
    want = reference(logp, sampler, mask)
    assert set(got) == set(want)
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-6), k
    # equal weights: every figure at its resting value
    still = finish([grpo.mismatch_sums(logp, logp, mask)])
    assert still == pytest.approx({"log_ratio": 0, "k3": 0, "chi2_token": 0, "chi2_seq": 0, "ess": 1, "ppl_ratio": 1})
    assert grpo.mismatch_metrics({k: 0.0 for k in still | {"tokens": 0, "sequences": 0}}) == {}


def _run(tmp_path, name, flags, spy, old_logprobs=train.OldLogprobs):
    """metrics.jsonl rows and stdout of a short in-process run, with `spy` seeing each `old_logprobs.keep`."""
    keep = old_logprobs.keep

    def spying(self, j, i, mb, logp):
        spy(self, mb, logp)
        return keep(self, j, i, mb, logp)
    old_logprobs.keep = spying
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            train.main([f"--out_dir={tmp_path / name}", "--save_every=0", "--print_completions_every=0", *flags])
    finally:
        old_logprobs.keep = keep
    return [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")], out.getvalue()


def test_a_run_reports_the_reference_figures_fresh_and_carried(tmp_path):
    """--max_staleness=1 with learning, top_k (a filtered draw, so the two disagree visibly), truncated
    padding masked: each step's mismatch/* over the fresh counted tokens and mismatch_carried/* over the
    carried ones equal the reference from the log-probs the trainer compared, and the warning flags the step."""
    seen = {}

    def spy(carried, mb, logp):  # a features.streaming.CarriedOldLogprobs, around the core's OldLogprobs
        mask = carried.old.loss_mask[mb.rows, :mb.t]
        stale = carried.stale[mb.rows, :mb.t].bool() & (mask > 0)
        step = seen.setdefault(len(seen_steps), {"fresh": [], "carried": []})
        sampler = carried.old.sampler[mb.rows, :mb.t]
        step["fresh"].append((logp.double(), sampler.double(), (mask > 0) & ~stale))
        step["carried"].append((logp.double(), sampler.double(), stale))
    seen_steps = []
    real_update = train.update

    def counting(run, batch, adv, step):
        seen_steps.append(step)
        return real_update(run, batch, adv, step)
    train.update = counting
    try:
        # every row of a step after the first starts during the step before: step 1's tokens are fresh, the
        # others' carried
        rows, out = _run(tmp_path, "m", ["--max_steps=4", "--max_staleness=1", "--lr=3e-3", "--top_k=5",
                                         "--max_completion_length=12", '--mismatch_warn={"ess": 0.9999}'], spy,
                        streaming.CarriedOldLogprobs)
    finally:
        train.update = real_update
    counted = {"fresh": 0, "carried": 0}
    for m, step in zip(rows, range(1, 5)):
        for which, prefix in (("fresh", "mismatch"), ("carried", "mismatch_carried")):
            parts = seen[step][which]
            mask = torch.cat([F.pad(k.float(), (0, 12 - k.shape[1])) for _, _, k in parts])
            if not mask.sum():
                assert not any(k.startswith(prefix + "/") for k in m)
                continue
            counted[which] += 1
            logp = torch.cat([F.pad(t, (0, 12 - t.shape[1])) for t, _, _ in parts])
            sampler = torch.cat([F.pad(s, (0, 12 - s.shape[1])) for _, s, _ in parts])
            want = reference(logp, sampler, mask)
            for k, v in want.items():
                assert m[f"{prefix}/{k}"] == pytest.approx(v, rel=1e-6, abs=1e-6), (step, prefix, k)
            assert m[f"{prefix}/ess"] < 1 and m[f"{prefix}/k3"] > 1e-3  # a filtered draw: visibly apart
    assert counted["fresh"] >= 1 and counted["carried"] >= 2, counted
    # the fresh tokens' figures are warned of (the carried ones' are the weights' move, expected)
    flagged = [line for line in out.splitlines() if line.startswith("step ") and "mismatch ess" in line]
    assert len(flagged) == sum("mismatch/ess" in m for m in rows) == counted["fresh"], flagged
    notes = [line for line in out.splitlines() if "disagree past --mismatch_warn" in line]
    assert len(notes) == 1 and "mismatch/ess" in notes[0] and "top_k / top_p" in notes[0], notes


def test_the_default_run_agrees_to_float32_rounding(tmp_path):
    rows, out = _run(tmp_path, "d", ["--max_steps=3"], lambda *a: None)
    for m in rows:
        assert abs(m["mismatch/log_ratio"]) < 1e-5 and abs(m["mismatch/ess"] - 1) < 1e-4
    assert "mismatch" not in out


import torch.nn.functional as F  # noqa: E402
