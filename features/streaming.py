"""Streaming rollouts: rows decoding through a few places, rewards computed as groups land, and with
--max_staleness the sampler working ahead across steps.

Applied by features/apply.py (`apply` below), never read by the core step: it replaces the run's rollout source
(`run.rollout`: train.rollout samples each step's rows at once, on the current weights), takes a batch's rewards
where its groups were scored as they landed (`run.rewards`) and adds its own metrics (`run.step_metrics`). What it
changes in training is the old log-probs of rows carried through a weight change, whose tokens' old log-prob only
the sampler knows: `run.old_logprobs` wraps the core's OldLogprobs (`CarriedOldLogprobs`, at the end of this file).
"""

import time

import torch

import grpo
import rewards
import rollouts
import sampling
import sharding
from features import sampler_options
from features.stream_sampler import Stream


def apply(run, core):
    """--rollouts_in_flight (rows stream through the decode places, scored as their groups land) and
    --max_staleness (the stream runs on across steps). core: the module of the core step (train.py)."""
    if run.cfg.max_staleness:
        run.stream = RolloutStream(run, core.step_rows)
        run.rollout = lambda run, step, round=0: run.stream.batch(step, round)
    elif scores_on_land(run):
        run.rollout = lambda run, step, round=0: landing_rollout(run, step, core.step_rows(run, step, round))
    inner = run.rewards
    run.rewards = lambda run, batch, step, seconds: landed_rewards(inner, run, batch, step, seconds)
    run.step_metrics.append(metrics)
    if run.cfg.max_staleness:  # rows carried through a weight change: the sampler's log-prob is their old one
        old_logprobs = run.old_logprobs
        run.old_logprobs = lambda *args: carried_old_logprobs(old_logprobs, *args)
        run.update_metrics.append(carried_metrics)


def landed_rewards(inner, run, batch, step, seconds):
    """A batch's rewards where its groups were scored as they landed (`Landing`): what is left is the wait for the
    last ones; `inner` (train.rewards_of) for a batch that was not."""
    if batch.landing is None:
        return inner(run, batch, step, seconds)
    total, parts, landed = batch.landing.result()
    seconds.update(landed)
    return total, parts


def landing_rollout(run, step, rows):
    """train.rollout's batch of `rows`, each group scored by a `Landing` as its last row ends."""
    landing = Landing(run, step, rows.prompts, rows.fields, rows.mine.start)
    batch = sampler_options.sampled(run, rows, on_end=landing)
    batch.landing = landing
    return batch


def metrics(run, batch, step, so_far):
    """The stream's metrics: how long the step waited for its rows (`generation_wait_s`), and with --max_staleness
    the tokens' age (`staleness_metrics`)."""
    if not run.cfg.max_staleness:
        return {"generation_wait_s": so_far["generation_time"]}
    return {**staleness_metrics(run, batch.rollout, step), "generation_wait_s": run.stream.wait}


class RolloutStream:
    """--max_staleness=K: the sampler works ahead. While a step's last rows run on, the decode places free of them
    take the rows of the next K steps' prompts; when the step's rows have all ended (on every rank), decoding stops
    there, the step trains, and the next step's decoding goes on from where it stopped, on the new weights, the
    rows in flight keeping their cache (features/stream_sampler.py's `Stream`). No place waits for the longest row
    while rows are queued, and rewards are computed as groups land (`Landing`), so a step waits only for what its
    own last rows have left to decode.

    A step trains its own prompts, those a synchronous step would: which groups a step gets does not depend on how
    fast rows decoded, so a run at any world size trains what one process does. A row of step s starts at step
    s - K at the earliest, so its tokens are at most K versions older than the weights that train them; each
    token's version is recorded, and the loss takes the sampler's log-prob as the old log-prob of an older one
    (`CarriedOldLogprobs`). No row is dropped or cut short for its age: dropping would favour short completions, cutting
    would score unfinished ones. The stream is drained (nothing queued past it) at each checkpoint step and at
    the last, and closed there: a resumed run starts where an uninterrupted one also starts afresh."""

    def __init__(self, run, step_rows):
        cfg, d = run.cfg, run.d
        self.step_rows = step_rows  # the core's (train.step_rows): a step's rows, as a synchronous step samples them
        # steps: (step, round) -> its rows (rollouts.Rows) and their Landing, while they are in the stream
        self.run, self.queued, self.steps = run, 0, {}
        self.n = cfg.prompts_per_step * cfg.num_generations // d.world_size  # rows per step on this rank
        # a tensor-parallel group's ranks decode the group's rows together, each holding all of them
        self.tp = d.tp if getattr(d, "tp", None) is not None and d.tp.size > 1 else None
        self.group = self.tp.size if self.tp else 1
        self.places = (cfg.rollouts_in_flight or self.n * (cfg.max_staleness + 1)) * self.group
        self.stream = None
        self.respond = {}  # with an agent, (step, round) -> the responder of its rows' episodes (the group's rows)

    def last_queued(self, step):
        """The last step whose prompts are queued while `step` decodes: K ahead, but not past a checkpoint."""
        cfg = self.run.cfg
        drain = cfg.max_steps if not cfg.save_every else min(cfg.max_steps, -(-step // cfg.save_every) * cfg.save_every)
        return min(step + cfg.max_staleness, drain)

    def queue(self, step, round=0):
        """Add the rows of the step's prompts (of dynamic sampling's `round`) to the stream."""
        run, cfg, d = self.run, self.run.cfg, self.run.d
        rows = self.step_rows(run, step, round)  # as a synchronous step's
        key = (step, round)
        landing = Landing(run, step, rows.prompts, rows.fields, rows.mine.start) if scores_on_land(run) else None
        if self.stream is None:
            dtype = sharding.mixed_precision_dtypes(cfg.mixed_precision, d.device)[0] if self.tp else None
            turns = {} if run.agent is None else dict(respond=self.answer, max_turns=run.agent.max_turns,
                                                      stop_sequences=run.agent.stop_sequences)
            self.stream = Stream(self.places, self.n * self.group * (cfg.max_staleness + 1) + self.places,
                                 cfg.max_prompt_length, cfg.max_completion_length, run.eos_ids,
                                 run.tokenizer.pad_token_id, sampling.Draw.of(cfg), d.device, on_end=self.landed,
                                 attention_kernel=cfg.decode_attention_kernel, dtype=dtype, tp=self.tp,
                                 share_prompts=cfg.shared_prompts, record_routing=cfg.routing_replay, **turns)
        if run.agent is not None:  # each rank answers its own rows' turns; a group shares the answers
            respond = run.agent.responder(rows.episodes)
            self.respond[key] = self.tp.group_respond(respond, self.n) if self.tp else respond
        group_ids, group_attn, group_seeds = rows.prompt_ids, rows.prompt_mask, rows.seeds
        if self.tp:  # the group's rows, rank r's n at r * n (tensor_parallel.group_rows)
            group_ids, group_attn, group_seeds, _ = self.tp.group_rows(group_ids, group_attn, group_seeds,
                                                                       run.tokenizer.pad_token_id)
        self.stream.add(group_ids, group_attn, group_seeds, [(key, i) for i in range(self.n * self.group)],
                        images=rows.images)
        self.steps[key] = (rows, landing)
        self.queued = max(self.queued, step)

    def answer(self, turns):
        """The stream's respond: turns of rows of several steps (each Turn's row a ((step, round), row) tag), each
        step's answered by its rows' responder, in step order (under tensor parallelism each call is a collective
        that the group's ranks, pausing alike, make in the same order)."""
        answers = {}
        for key in sorted(dict.fromkeys(k for (k, _), _, _ in turns)):
            mine = [t for t in turns if t.row[0] == key]
            answers.update(zip((t.row for t in mine), self.respond[key]([t._replace(row=t.row[1]) for t in mine])))
        return [answers[t.row] for t in turns]

    def landed(self, tags, ids):
        """The stream's on_end: rows that ended, to their step's Landing."""
        for key in dict.fromkeys(k for k, _ in tags):
            landing = self.steps[key][-1]
            if landing is not None:
                landing([i for k, i in tags if k == key], [x for (k, _), x in zip(tags, ids) if k == key])

    def batch(self, step, round=0):
        """The step's Batch: its rows decoded to their ends (with what was queued up to `last_queued` decoding
        meanwhile), taken out of the stream. round > 0: dynamic sampling's further draw of the step, queued now
        (whether it is needed is known once the round before has been scored), the next steps' rows decoding
        beside it."""
        run, d = self.run, self.run.d
        if self.queued < step and self.stream is not None:
            raise RuntimeError(f"step {step}'s rows were never queued (the stream is at step {self.queued})")
        for s in range(max(self.queued, step - 1) + 1, self.last_queued(step) + 1):
            self.queue(s)
        key = (step, round)
        if key not in self.steps:
            self.queue(step, round)
        tags = [(key, i) for i in range(self.n * self.group)]
        run.policy.eval()
        t = time.time()
        with sharding.gathered(run.policy):
            run.policy(self.stream.run, tags, step - 1, sharding.all_done_fn(d))
        self.wait = time.time() - t
        run.policy.train()
        rollout = self.stream.take(tags)
        if self.tp:  # this rank's own rows
            rollout = sampling.group_share(rollout, self.tp, self.n)
        if not self.stream.in_flight():  # drained: the next step starts a new stream, as a resumed run does
            self.stream.close()
            self.stream = None
        rows, landing = self.steps.pop(key)
        if rollout.prompt_routing is not None:  # the stream's prompts are max_prompt_length wide, the step's its own
            rollout.prompt_routing = rollout.prompt_routing[:, -rows.prompt_ids.shape[1]:]
        if run.agent is not None:  # each conversation's last turn, which no tool answered
            self.respond.pop(key)
            run.agent.finish(rows.episodes, rollout)
        completions = run.tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        return rows.sampled(rollout, completions, landing)


def scores_on_land(run):
    """Whether rewards are computed group by group as rows land, while the sampler decodes the others: with rows
    streaming (--rollouts_in_flight), each process sampling alone (not a tensor-parallel group), and no
    environment's episodes (which end with the rollout). A reward model, whose forward is a collective every rank
    must call together, scores at the step's take (`Landing.result`)."""
    tp = getattr(run.d, "tp", None)
    return bool(run.cfg.rollouts_in_flight) and run.agent is None and (tp is None or tp.size == 1)


class Landing:
    """This rank's rewards, computed group by group as the sampler's rows land (`sampling.sample`'s on_end), in one
    worker thread while decoding goes on: a group is scored once its last row on this rank has ended. Reward
    functions score each completion on its own (TRL's contract), so the scores equal one call over the batch; the
    functions are called once per group instead of once per step. A collective function (a reward model, whose
    forward every rank must make together) scores the whole batch in `result`, which every rank calls at the
    step's take, the pause where its rows have all ended. `result` waits for the last group."""

    def __init__(self, run, step, prompts, fields, first_row):
        import concurrent.futures
        self.run, self.step, self.prompts, self.fields = run, step, prompts, fields
        group = [(first_row + r) // run.cfg.num_generations for r in range(len(prompts))]  # (n,) global groups
        self.rows = {g: [r for r in range(len(prompts)) if group[r] == g] for g in dict.fromkeys(group)}
        self.group, self.left, self.ids = group, {g: len(rows) for g, rows in self.rows.items()}, {}
        self.worker, self.scored = concurrent.futures.ThreadPoolExecutor(1, "rewards"), []
        self.local = [fn for fn in run.task.reward_funcs if not getattr(fn, "collective", False)]

    def __call__(self, rows, ids):
        for r, row_ids in zip(rows, ids):
            self.ids[r] = row_ids
            g = self.group[r]
            self.left[g] -= 1
            if not self.left[g] and self.local:
                self.scored.append((self.rows[g], self.worker.submit(self._score, self.rows[g], self.local)))

    def _score(self, rows, funcs):
        """The rows' scores by `funcs`, as ({function: (len(rows),)}, {function: seconds}, their completions)."""
        run, ids, prompts = self.run, [self.ids[r] for r in rows], [self.prompts[r] for r in rows]
        completions = run.tokenizer.batch_decode(ids, skip_special_tokens=True)  # as the sampler decodes them
        fields = rollouts.reward_fields({k: [v[r] for r in rows] for k, v in self.fields.items()}, ids, None,
                                        run.tokenizer, prompts, completions)
        seconds = {}
        parts = rewards.reward_parts(funcs, prompts, completions, fields, seconds=seconds,
                                     context=rollouts.reward_context(run.cfg, self.step), rows=rows)
        return parts, seconds, completions

    def result(self):
        """(total (n,), {function: (n,)}, {function: seconds summed over the groups}); a reward function's error is
        raised here, for the first group it failed on, after the collective functions have run (the other ranks
        wait in them)."""
        n, funcs = len(self.prompts), self.run.task.reward_funcs
        nan = lambda: torch.full((n,), float("nan"), dtype=rewards.REWARD_DTYPE)  # noqa: E731
        parts, seconds, completions = {rewards.reward_name(fn): nan() for fn in self.local}, {}, [""] * n
        failed = None
        try:
            if any(self.left.values()):  # every row of a sample call ends in it: a path that never said so is a bug
                raise RuntimeError(f"rows {[r for r in range(n) if self.left[self.group[r]]]} never landed")
            for rows, done in self.scored:
                p, s, texts = done.result()
                for k, v in p.items():
                    parts[k][rows] = v
                for k, v in s.items():
                    seconds[k] = seconds.get(k, 0.0) + v
                for r, text in zip(rows, texts):
                    completions[r] = text
        except Exception as e:  # raised after the collective functions, which every rank must call
            failed = e
        finally:
            self.worker.shutdown(cancel_futures=True)
        if len(self.local) < len(funcs):  # every rank together, over the step's rows
            try:
                p, s, completions = self._score(list(range(n)), [fn for fn in funcs if fn not in self.local])
            except Exception as e:
                failed = failed or e
            else:
                parts.update(p)
                seconds.update(s)
        if failed is not None:
            raise failed
        parts = {rewards.reward_name(fn): parts[rewards.reward_name(fn)] for fn in funcs}  # the functions' order
        return rewards.weighted_total(parts, self.run.weights, completions), parts, seconds


def staleness_metrics(run, rollout, step):
    """How many versions older than the step's weights (step - 1 training steps) the policy tokens trained are, mean
    and largest, and how many rows attend to K/V older weights computed (`rows_carried`), over every rank."""
    mask = rollout.policy_mask.bool()
    age = (step - 1 - rollout.versions).masked_fill(~mask, 0)  # (n, T)
    total, tokens, carried = sharding.all_reduce_sum(
        [float(age.sum()), float(mask.sum()), float((rollout.context_version < step - 1).sum())], run.d)
    oldest = sharding.all_gather_rows(torch.tensor([[float(age.max()) if age.numel() else 0.0]], device=run.d.device),
                                      run.d).max().item()
    return {"staleness_mean": total / max(tokens, 1.0), "staleness_max": oldest, "rows_carried": carried}


# ----------------------------------------------------------------------------- the old log-probs of carried rows


def carried(rollout, version):
    """(N, T) bool: the policy tokens whose draw attended K/V computed by weights older than `version` (a row
    that decoded through a weight change keeps its cache, so every token of it after the prompt's prefill, the
    ones drawn after the change included). The trainer cannot recompute their behaviour log-prob; the sampler's is
    it. None where no row was carried: a rollout sampled at once (no `context_version`), every row on `version`."""
    if rollout.context_version is None:
        return None
    return (rollout.context_version < version).to(rollout.policy_mask.device)[:, None] & rollout.policy_mask.bool()


def carried_old_logprobs(inner, cfg, minis, loss_mask, rollout, step, device):
    """`run.old_logprobs` with --max_staleness: the update's old log-probs (`inner`: train.OldLogprobs, or its
    importance-weighted variant), within a `CarriedOldLogprobs` where rows were carried through a weight change
    (tokens older than the step's weights, step - 1)."""
    old = inner(cfg, minis, loss_mask, rollout, step, device)
    stale = carried(rollout, step - 1)
    return old if stale is None else CarriedOldLogprobs(old, stale)


class CarriedOldLogprobs:
    """The old log-probs of a batch with rows carried through a weight change, around the core's (`old`,
    train.OldLogprobs, whose tables `logp` and `is_weight` the update reads).

    `stale` (n, T): the tokens of rows carried through a weight change (`carried`): drawn by older weights, or by
    newer ones attending to the K/V older ones computed. The trainer cannot compute their pi_old (those weights, or
    that mix of weights and cache, are gone); the sampler's log-prob is it, exactly (the behaviour policy, as in
    PipelineRL and TRL's ZeroSync). The first pass's ratio for them is then exp(train - sampler). They are left out
    of the trainer-sampler comparison, which measures the arithmetic's agreement at equal weights; their own
    |train - sampler| (`carried_sum`, `carried_tokens`) is how far the weights moved under them."""

    def __init__(self, old, stale):
        self.old, self.stale, self.logp, self.is_weight = old, stale, old.logp, old.is_weight
        self.carried_sum = self.carried_tokens = torch.zeros((), device=old.diff_sum.device)

    def keep(self, j, i, mb, logp):
        """Micro-batch (j, i)'s log-probs at the weights that sampled: its carried tokens' |train - sampler| counted
        apart and the sampler's log-prob taken as theirs; then the core's `keep` (and its variant's: importance
        weights of every token), which compares only the other tokens with the sampler's, as a synchronous step's."""
        old = self.old
        mb_mask, sampler = old.loss_mask[mb.rows, :mb.t], old.sampler[mb.rows, :mb.t]
        stale = self.stale[mb.rows, :mb.t] * mb_mask
        self.carried_sum = self.carried_sum + ((logp - sampler).abs() * stale).sum()
        self.carried_tokens = self.carried_tokens + stale.sum()
        old._add_mismatch("carried", logp, sampler, stale)
        old.keep(j, i, mb, torch.where(stale.bool(), sampler, logp), compared=mb_mask * ~stale.bool())

    def sums(self):
        """The core's sums, and the carried tokens' |train - sampler| (the weights' move under them)."""
        return {**self.old.sums(), "carried_diff_sum": self.carried_sum, "carried_diff_tokens": self.carried_tokens}


def carried_metrics(sums):
    """The carried tokens' figures from the update's sums over every rank (`run.update_metrics`), apart from the
    fresh tokens' (runs/log.py's sampler_metrics): their mean |trainer - sampler| log-prob and their mismatch
    figures (grpo.mismatch_metrics); none where no row was carried."""
    if "carried_diff_tokens" not in sums:
        return {}
    out = {"sampler_logprob_diff_carried_mean": sums["carried_diff_sum"] / max(sums["carried_diff_tokens"], 1.0)}
    part = {k.rsplit("/", 1)[1]: v for k, v in sums.items() if k.startswith("mismatch_sum/carried/")}
    out.update({f"mismatch_carried/{k}": v for k, v in grpo.mismatch_metrics(part).items()} if part else {})
    return out
