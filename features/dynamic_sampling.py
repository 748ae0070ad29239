"""Dynamic sampling (DAPO, Yu et al. 2025): a step keeps drawing groups until enough have a signal.

Applied by features/apply.py: it replaces the run's `draw` (train.draw: one rollout, scored) with rounds of
them, and shares the kept rows out over the ranks; its metrics (`dynamic/*`) come back with the draw.
"""

import dataclasses

import torch

import rollouts
import sharding


def apply(run, core):
    run.draw = lambda run, step: draw(run, step, core)


def draw(run, step, core):
    """The step's batch on this rank, scored: (batch, total (n,), {function: (n,)}, seconds of scoring, dynamic
    sampling's metrics). core: the module of the core step (train.py), whose `draw` makes each round.

    With dynamic_sampling (DAPO's), a group whose advantages are all 0 (its rewards all equal: no signal) is
    dropped, and further rounds of prompts_per_step prompts are drawn until prompts_per_step groups have a
    signal, at most max_generation_rounds rounds; short of that, the step fills up with groups without one (the
    first drawn) and says how many (`dynamic/groups_filled`). Every rank decides from every rank's rewards, so
    all make the same collective calls; the step's rows are then shared out over the ranks as always.
    """
    cfg, d, G, P = run.cfg, run.d, run.cfg.num_generations, run.cfg.prompts_per_step
    rounds, drawn, kept = [], [], []  # this rank's rows of each round; every rank's rewards; (round, group) kept
    for round in range(cfg.max_generation_rounds):
        batch, total, parts, more, _ = core.draw(run, step, round)
        seconds = more if not round else {k: seconds.get(k, 0.0) + v for k, v in more.items()}
        rounds.append((batch, total, parts))
        all_total = sharding.all_gather_rows(total, d)                                                   # (N,)
        drawn.append(all_total)
        try:
            adv = core.advantages(run, all_total, {k: sharding.all_gather_rows(v, d) for k, v in parts.items()})[0]
        except ValueError as e:  # rewards too large to normalise (the same on every rank)
            raise SystemExit(f"step {step}: {e}") from e
        kept += [(round, g) for g in (adv.view(P, G).abs().sum(1) > 0).nonzero()[:, 0].tolist()]
        if len(kept) >= P:
            break
    kept = kept[:P]
    fill = [(r, g) for r in range(len(rounds)) for g in range(P) if (r, g) not in kept][:P - len(kept)]
    rows = [(r, g * G + i) for r, g in kept + fill for i in range(G)]  # (N,) the step's rows: (round, global row)
    batch, total, parts = share_rows(run, rounds, rows)
    every = torch.cat(drawn)
    every = every[~torch.isnan(every)]
    metrics = {"dynamic/rounds": len(rounds), "dynamic/groups_drawn": len(rounds) * P,
               "dynamic/groups_kept": len(kept), "dynamic/groups_filled": len(fill),
               "dynamic/reward_drawn": every.mean().item() if every.numel() else float("nan")}
    return batch, total, parts, seconds, metrics


def share_rows(run, rounds, rows):
    """This rank's share of the step's `rows`, (round, global row) pairs of `rounds` (each round's scored batch
    on this rank: its global rows rank * n ... (rank + 1) * n - 1). Each rank sends the rows it holds to every
    rank (one all_gather of objects, on the CPU: a pickled CUDA tensor would land on the sender's device), each
    keeps its own. Episodes travel without their environment and tools: those served the rollout and rewards."""
    d = run.d
    n = len(rows) // d.world_size
    held = [(k, r, i - d.rank * n) for k, (r, i) in enumerate(rows) if d.rank * n <= i < (d.rank + 1) * n]
    local = rollouts.cat_scored(rounds, run.tokenizer.pad_token_id)  # round r's row i at r * n + i
    piece = rollouts.take_rows(local, [r * n + i for _, r, i in held], slice(0, n))
    if d.world_size == 1:
        return piece
    batch, total, parts = piece
    piece = (dataclasses.replace(batch, prompt_ids=batch.prompt_ids.cpu(), prompt_mask=batch.prompt_mask.cpu(),
                                 rollout=batch.rollout.to("cpu"),
                                 episodes=None if batch.episodes is None else
                                 [dataclasses.replace(e, env=None, tools={}) for e in batch.episodes]),
             total.cpu(), {k: v.cpu() for k, v in parts.items()})
    pieces = sharding.all_gather_objects(([k for k, _, _ in held], piece), d)
    whole = rollouts.cat_scored([p for _, p in pieces], run.tokenizer.pad_token_id)
    at = {k: j for j, k in enumerate(k for ks, _ in pieces for k in ks)}  # a step row's place in `whole`
    mine = slice(d.rank * n, (d.rank + 1) * n)
    batch, total, parts = rollouts.take_rows(whole, [at[k] for k in range(mine.start, mine.stop)], mine)
    batch.prompt_ids, batch.prompt_mask = batch.prompt_ids.to(d.device), batch.prompt_mask.to(d.device)
    batch.rollout = batch.rollout.to(d.device)
    return batch, total.to(rounds[0][1].device), {k: v.to(rounds[0][1].device) for k, v in parts.items()}
