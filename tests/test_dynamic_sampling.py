"""DAPO's dynamic sampling: groups without a reward signal are dropped and more prompts drawn, against a naive
loop over the same rounds; across processes in tests/test_distributed.py."""

import pytest
import torch

import sharding
import train


def uneven_reward(prompts, completions, **_):
    """Constant (1) on the prompts whose first letter has an even code, else a function of the completion that
    varies within most groups: about half the groups carry a signal."""
    return [1.0 if ord(p.strip()[0]) % 2 == 0 else float(sum(map(ord, c)) % 3) for p, c in zip(prompts, completions)]


def setup(tmp_path, **settings):
    cfg = train.Config(**{**dict(device="cpu", out_dir=str(tmp_path), prompts_per_step=4, num_generations=4,
                                 max_completion_length=4, dynamic_sampling=True, save_every=0, max_steps=1),
                          **settings})
    run = train.setup(cfg, sharding.Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    run.task.reward_funcs[:] = [uneven_reward]
    run.weights[:] = [1.0]
    return run


def naive_draw(run, step):
    """The rounds drawn one by one and each group's rewards compared by hand: the prompts, completions and rewards
    of the first prompts_per_step groups whose rewards are not all equal, then groups without a signal in the
    order drawn, and the number of rounds."""
    P, G = run.cfg.prompts_per_step, run.cfg.num_generations
    with_signal, without = [], []
    for round in range(run.cfg.max_generation_rounds):
        batch = run.rollout(run, step, round)
        total, _, _ = train.score(run, batch, step)
        for g in range(P):
            rows = range(g * G, (g + 1) * G)
            group = [(batch.prompts[i], batch.rollout.completion_ids[i][batch.rollout.completion_mask[i] > 0].tolist(),
                      total[i].item()) for i in rows]
            (with_signal if len({r for _, _, r in group}) > 1 else without).append(group)
        if len(with_signal) >= P:
            break
    chosen = (with_signal[:P] + without)[:P]
    return [row for group in chosen for row in group], round + 1, min(P, len(with_signal))


@pytest.mark.parametrize("rounds", [1, 2, 6])
def test_draw_keeps_the_first_groups_with_a_signal_as_a_naive_loop_does(tmp_path, rounds):
    run = setup(tmp_path, max_generation_rounds=rounds)
    P, G = 4, 4
    for step in (1, 2):
        expected, used, kept = naive_draw(run, step)
        batch, total, parts, seconds, metrics = run.draw(run, step)
        got = [(batch.prompts[i], batch.rollout.completion_ids[i][batch.rollout.completion_mask[i] > 0].tolist(),
                total[i].item()) for i in range(P * G)]
        assert got == expected
        assert parts["uneven_reward"].tolist() == total.tolist() and batch.mine == slice(0, P * G)
        assert metrics["dynamic/rounds"] == used and metrics["dynamic/groups_drawn"] == used * P
        assert metrics["dynamic/groups_kept"] == kept and metrics["dynamic/groups_filled"] == P - kept
        # a group without a signal only when the rounds ran out
        assert kept == P or used == rounds
        if rounds == 6:
            assert kept == P
    if rounds == 1:  # what it kept is what the plain step would train on, in another order
        assert metrics["dynamic/groups_filled"] > 0


def _rows(batch, total):
    return [(batch.prompts[i], batch.rollout.completion_ids[i][batch.rollout.completion_mask[i] > 0].tolist(),
             total[i].item()) for i in range(len(batch.prompts))]


def test_the_sampler_ahead_draws_the_rounds_a_synchronous_step_draws(tmp_path):
    """--max_staleness=1: a step's further round is queued once the round before it has been scored, while the next
    step's rows decode in the stream; at unchanged weights the step keeps the groups, completions and rewards that
    the synchronous step keeps, after as many rounds."""
    # completions of up to 12 tokens: rows of several lengths, so the stream's places turn over
    sync = setup(tmp_path / "sync", max_generation_rounds=6, max_steps=3, max_completion_length=12)
    ahead = setup(tmp_path / "ahead", max_generation_rounds=6, max_steps=3, max_completion_length=12, max_staleness=1)
    rounds = []
    for step in (1, 2, 3):
        want, got = sync.draw(sync, step), ahead.draw(ahead, step)
        assert _rows(got[0], got[1]) == _rows(want[0], want[1]), step
        assert got[4] == want[4]
        rounds.append(got[4]["dynamic/rounds"])
        assert ahead.stream.stream is None or ahead.stream.queued == step + 1  # the next step's rows were queued
    assert max(rounds) > 1, rounds


def test_a_step_trains_on_groups_with_a_signal_while_rounds_remain(tmp_path):
    run = setup(tmp_path, max_generation_rounds=6)
    for step in (1, 2):
        metrics, _ = train.train_step(run, step)
        assert metrics["dynamic/groups_kept"] == 4 and metrics["frac_reward_zero_std"] == 0
        assert metrics["dynamic/groups_drawn"] > 4  # this reward drops some groups at the first round
    run = setup(tmp_path, max_generation_rounds=1)
    metrics, _ = train.train_step(run, 1)
    assert metrics["frac_reward_zero_std"] == metrics["dynamic/groups_filled"] / 4 > 0


def test_resume_with_dynamic_sampling_is_exact(tmp_path):
    """The further rounds are a function of (seed, step, round): 4 steps straight give the metrics of 2 steps, a
    stop and the same command again."""
    import json
    import os
    flags = ["--dynamic_sampling", "--max_generation_rounds=3", "--prompts_per_step=4", "--save_every=2",
             "--print_completions_every=0", "--lr=1e-2"]
    runs = {}
    for name, stops in (("straight", [4]), ("resumed", [2, 4])):
        out = str(tmp_path / name)
        for max_steps in stops:
            train.main([f"--out_dir={out}", f"--max_steps={max_steps}", *flags])
        with open(os.path.join(out, "metrics.jsonl")) as f:
            runs[name] = [{k: v for k, v in json.loads(line).items() if "time" not in k and k != "tokens_per_s"}
                          for line in f]
    assert runs["straight"] == runs["resumed"]
    assert any(m["dynamic/rounds"] > 1 for m in runs["straight"])
