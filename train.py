"""GRPO training, top to bottom: the settings, the step, then the loop.

One concern in one file (past 650 lines on purpose): the algorithm, read top to bottom in the order it
runs: the step's rollout, scoring, advantages and update, then the loop around it. What a run is built from
(models, task, tools, optimizer) is runs/setup.py.

    python train.py                                   # the tiny offline default, on CPU, a few minutes
    python train.py --help                            # every setting, its type, default and meaning
    python train.py --model=Qwen/Qwen2.5-0.5B-Instruct --task=... --lr 1e-6
    torchrun --nproc_per_node 8 train.py --model=... --task=...

Every setting (config.py: the Config dataclass) can be given as --key=value or --key value.
"""

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
import uuid

from runs import cli  # the settings need nothing heavier: the imports of torch and the rest come after them (below)
from sandbox import executor  # no heavy imports either: its settings are checked with the others
from config import OTHER_NAMES, RECIPES, RUN_KEYS, Config, ConfigError, validate  # the settings (config.py)


# ----------------------------------------------------------------------------- config parsing


def parse_config(argv):
    """The command line (after a recipe's values) as a Config, checked on its own (`validate`)."""
    task = [a.split("=", 1)[1] for a in argv if a.startswith("--task=")]
    if (task and task[-1] in cli.recipe_names(RECIPES)
            and not any(a.startswith(("--preset", "--config")) for a in argv)):
        argv = [f"--preset={task[-1]}"] + list(argv)  # a task with a recipe of its own name starts from it
    cfg = cli.parse(Config, argv, RECIPES, doc=__doc__, other_names=OTHER_NAMES)
    # the processes the run will have: torchrun's, or those a plan is made for
    validate(cfg, cfg.plan_world_size if cfg.plan and cfg.plan_world_size else int(os.environ.get("WORLD_SIZE", "1")))
    return cfg


def tell_torchrun(message):
    """Under torchrun, put this process's one-line error where torchrun reads it: its failure summary then
    quotes the message instead of a link to its documentation. (The format torch.distributed.elastic's
    ErrorHandler writes, without a traceback.)"""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with open(error_file, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}, f)


if __name__ == "__main__":
    # The settings are checked before the imports below, which take seconds (torch, transformers, datasets):
    # a typo stops the run at once. main() parses them again, cheaply. Under torchrun every rank meets the
    # same error here (it depends on the command line alone, and nothing distributed has started): rank 0
    # says it, and the others exit quietly with status 0, so that torchrun's summary lists rank 0 alone.
    try:
        parse_config(sys.argv[1:])  # validated for torchrun's processes, or a plan's
    except ConfigError as e:
        if int(os.environ.get("RANK", "0")) != 0:
            raise SystemExit(0) from None
        tell_torchrun(e.code)
        raise

try:
    import torch

    from runs import disk
    import grpo
    import logprobs
    from layers import lora
    import rewards
    from layers import routing
    from runs import export as run_export
    from runs import log as run_log
    from runs.setup import setup  # the models, task, tools and optimizer of a run
    import rollouts
    import sampling
    import sharding
except KeyboardInterrupt:  # Ctrl-C while importing: one line, not the importer's traceback
    if __name__ != "__main__":
        raise
    print("\ninterrupted while importing torch and transformers", file=sys.stderr)
    raise SystemExit(130)


# ----------------------------------------------------------------------------- optimizer


def lr_factor(cfg, opt_step, total_opt_steps):
    """Multiplier on cfg.lr at optimizer step `opt_step` (0-based)."""
    if opt_step < cfg.warmup_steps:
        return (opt_step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    progress = (opt_step - cfg.warmup_steps) / max(1, total_opt_steps - cfg.warmup_steps)
    if cfg.lr_schedule == "linear":
        return max(0.0, 1.0 - progress)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def optimizer_steps(cfg, steps):
    """Optimizer steps in the first `steps` steps: each pass over a step's batch makes one per mini-batch."""
    return steps * cfg.num_iterations * cfg.steps_per_generation


def set_hyperparameters(optimizer, cfg, opt_step):
    """This optimizer step's learning rate (a function of the step, so a resumed run follows the schedule of the
    settings it runs with) and the AdamW settings of the config (a loaded optimizer state brings its own)."""
    lr = cfg.lr * lr_factor(cfg, opt_step, optimizer_steps(cfg, cfg.max_steps))
    for group in optimizer.param_groups:
        group.update(lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay)
    return lr


# ----------------------------------------------------------------------------- the step


def rollout(run, step, round=0):
    """The step's prompts, G completions sampled for each; this rank's rows. `round` > 0: dynamic sampling's
    further draws of the step (other prompts, other random numbers)."""
    cfg = run.cfg
    if cfg.max_staleness:
        run.stream = run.stream or RolloutStream(run)
        return run.stream.batch(step, round)
    rows = step_rows(run, step, round)
    landing = Landing(run, step, rows.prompts, rows.fields, rows.mine.start) if scores_on_land(run) else None
    batch = sampling.sample_rows(run.policy, run.tokenizer, rows, sampling.Draw.of(cfg), cfg, run.d, run.eos_ids,
                                 run.agent, record_routing=cfg.routing_replay, on_end=landing)
    batch.landing = landing
    return batch


def step_rows(run, step, round=0):
    """This rank's rows (rollouts.Rows) of the step's prompts, G of each."""
    cfg, G = run.cfg, run.cfg.num_generations
    # prompts are a pure function of (seed, step, round), so a resumed run sees the same ones
    rows = run.task.prompts_for_step(cfg.seed, step, cfg.prompts_per_step, round)
    base = (cfg.seed * 1_000_003 + step) * len(rows) * G + round * 0x9E3779B9
    return sampling.rows_of(rows, G, run.d, run.tokenizer, cfg, lambda i: i + base, run.agent, run.images)


class RolloutStream:
    """--max_staleness=K: the sampler works ahead. While a step's last rows run on, the decode places free of them
    take the rows of the next K steps' prompts; when the step's rows have all ended (on every rank), decoding stops
    there, the step trains, and the next step's decoding goes on from where it stopped, on the new weights, the
    rows in flight keeping their cache (sampling.Stream). No place waits for the longest row while rows are
    queued, and rewards are computed as groups land (`Landing`), so a step waits only for what its own last rows
    have left to decode.

    A step trains its own prompts, those a synchronous step would: which groups a step gets does not depend on how
    fast rows decoded, so a run at any world size trains what one process does. A row of step s starts at step
    s - K at the earliest, so its tokens are at most K versions older than the weights that train them; each
    token's version is recorded, and the loss takes the sampler's log-prob as the old log-prob of an older one
    (`OldLogprobs`). No row is dropped or cut short for its age: dropping would favour short completions, cutting
    would score unfinished ones. The stream is drained (nothing queued past it) at each checkpoint step and at
    the last, and closed there: a resumed run starts where an uninterrupted one also starts afresh."""

    def __init__(self, run):
        cfg, d = run.cfg, run.d
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
        rows = step_rows(run, step, round)  # as a synchronous step's
        key = (step, round)
        landing = Landing(run, step, rows.prompts, rows.fields, rows.mine.start) if scores_on_land(run) else None
        if self.stream is None:
            dtype = sharding.mixed_precision_dtypes(cfg.mixed_precision, d.device)[0] if self.tp else None
            turns = {} if run.agent is None else dict(respond=self.answer, max_turns=run.agent.max_turns,
                                                      stop_sequences=run.agent.stop_sequences)
            self.stream = sampling.Stream(self.places, self.n * self.group * (cfg.max_staleness + 1) + self.places,
                                          cfg.max_prompt_length, cfg.max_completion_length, run.eos_ids,
                                          run.tokenizer.pad_token_id, sampling.Draw.of(cfg), d.device,
                                          on_end=self.landed, attention_kernel=cfg.decode_attention_kernel,
                                          dtype=dtype, tp=self.tp, share_prompts=cfg.shared_prompts,
                                          record_routing=cfg.routing_replay, **turns)
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
        completions = run.tokenizer.batch_decode(ids, skip_special_tokens=True)  # as sampling.generate decodes
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


def draw(run, step):
    """The step's batch on this rank, scored: (batch, total (n,), {function: (n,)}, seconds of scoring, dynamic
    sampling's metrics).

    With dynamic_sampling (DAPO's), a group whose advantages are all 0 (its rewards all equal: no signal) is
    dropped, and further rounds of prompts_per_step prompts are drawn until prompts_per_step groups have a
    signal, at most max_generation_rounds rounds; short of that, the step fills up with groups without one (the
    first drawn) and says how many (`dynamic/groups_filled`). Every rank decides from every rank's rewards, so
    all make the same collective calls; the step's rows are then shared out over the ranks as always.
    """
    cfg, d, G, P = run.cfg, run.d, run.cfg.num_generations, run.cfg.prompts_per_step
    batch = rollout(run, step)
    total, parts, seconds = score(run, batch, step)
    if not cfg.dynamic_sampling:
        return batch, total, parts, seconds, {}
    rounds, drawn, kept = [], [], []  # this rank's rows of each round; every rank's rewards; (round, group) kept
    for round in range(cfg.max_generation_rounds):
        if round:
            batch = rollout(run, step, round)
            total, parts, more = score(run, batch, step)
            seconds = {k: seconds.get(k, 0.0) + v for k, v in more.items()}
        rounds.append((batch, total, parts))
        all_total = sharding.all_gather_rows(total, d)                                                   # (N,)
        drawn.append(all_total)
        try:
            adv = advantages(run, all_total, {k: sharding.all_gather_rows(v, d) for k, v in parts.items()})[0]
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


def score(run, batch, step):
    """Rewards of this rank's completions: (total (n,), {function: (n,)}), NaN where nothing scored, and the
    seconds scoring took ({"reward_time": s}, and "reward_time/<function>" for each of several functions), the
    slowest rank's.

    A reward function that fails (or returns absurd values) on any rank stops every rank with its message.
    """
    problem, seconds, t = None, {}, time.time()
    try:
        if batch.landing is not None:  # scored as the groups landed: what is left is the wait for the last ones
            total, parts, seconds = batch.landing.result()
        else:
            total, parts = rollouts.score_batch(batch, run.task.reward_funcs, run.weights, run.tokenizer,
                                                rollouts.reward_context(run.cfg, step), seconds)
    except rewards.RewardFunctionError as e:
        problem = f"step {step}: {e}"
    times = [time.time() - t] + list(seconds.values())
    problem = sharding.first_problem(problem, run.d)
    if problem:
        raise SystemExit(problem)
    if run.reward_model is not None:
        sharding.free_gathered(run.reward_model[0])  # forward only: nothing else frees its gathered root weights
    if run.d.world_size > 1:  # a step waits for its slowest rank
        times = sharding.all_gather_rows(torch.tensor([times], dtype=torch.float64), run.d).max(0).values.tolist()
    names = ["reward_time"] + ([f"reward_time/{name}" for name in seconds] if len(seconds) > 1 else [])
    return total, parts, dict(zip(names, times))


def execution_metrics(d, stats):
    """Programs run in the sandbox during the step's rollout and scoring (executor.take_stats()), over all ranks:
    how many, how many timed out or could not run, the seconds the step waited on them (mean over ranks) and a
    program's mean wall time; nothing when none ran."""
    keys = ("programs", "timeouts", "sandbox_failures", "program_seconds", "wait_seconds")
    total = dict(zip(keys, sharding.all_reduce_sum([float(stats[k]) for k in keys], d)))
    if not total["programs"]:
        return {}
    return {"exec_programs": total["programs"], "exec_timeouts": total["timeouts"],
            "exec_sandbox_failures": total["sandbox_failures"], "exec_time": total["wait_seconds"] / d.world_size,
            "exec_program_time": total["program_seconds"] / total["programs"]}


def advantages(run, all_total, all_parts):
    """(advantages (N,), group std (P,)) of every rank's rewards: the total (N,) and each function's {name: (N,)}.
    GDPO (normalize_then_sum) normalises each function within its group before the sum."""
    signal, scale, G = all_total, run.cfg.scale_rewards, run.cfg.num_generations
    if run.cfg.multi_objective_aggregation == "normalize_then_sum":
        signal, scale = grpo.decoupled_rewards(torch.stack(list(all_parts.values()), 1), run.weights, G), "batch"
    return grpo.group_advantages(signal, G, scale)


def routes(route, mb):
    """The micro-batch's experts per token (routing replay), or None without it."""
    return None if route is None else mb.take(route)[0]


def images_of(run, mb):
    """The micro-batch's prompts' images (the batch being trained's, vision.PromptImages), or None."""
    images = getattr(run, "step_images", None)  # a run made elsewhere (a test's namespace) may not carry any
    return None if images is None else images.rows(mb.rows)


def reference_logprobs(run, ids, mask, micro, route=None):
    """The reference model's log-probs, fixed during the update: one tensor per micro-batch."""
    policy = run.policy
    model = run.ref if run.ref is not None else policy  # with LoRA, no copy: the policy with its adapters off
    # routing replay: the reference replays the sampled experts too; its disagreement is counted as its own
    # (a separate reference model has a Replay of its own; with LoRA, the policy's counts it apart)
    replay = routing.attached(policy.lm) if model is policy and route is not None else None
    with torch.no_grad(), lora.adapters_disabled(policy) if model is policy else contextlib.nullcontext(), \
            (replay.apart() if replay else contextlib.nullcontext([])) as counted:
        logp = [model(logprobs.completion_logprobs, *mb.take(ids, mask), mb.t, run.cfg.temperature, width=mb.width,
                      compile_layers=run.cfg.compile_layers, routing=routes(route, mb),
                      images=images_of(run, mb))[0] for mb in micro]
    if route is not None:  # summed over the step's mini-batches; logged and reset with the step's metrics
        counted = counted if replay else routing.of(model.lm).counts()
        run.ref_routing = [a + b for a, b in zip(run.ref_routing, counted)]
    if model is run.ref:
        sharding.free_gathered(model)  # never backward: nothing else would free the root's gathered weights
    return logp


def sampling_logprobs(run, ids, mask, micro, route=None):
    """The policy's (log-probs, entropies) at its current weights, without gradient: one pair per micro-batch.
    Before the step's first optimizer step, these are the weights that sampled."""
    cfg, policy = run.cfg, run.policy
    with torch.no_grad():
        return [policy(logprobs.completion_logprobs, *mb.take(ids, mask), mb.t, cfg.temperature, width=mb.width,
                       compile_layers=cfg.compile_layers, routing=routes(route, mb), images=images_of(run, mb))
                for mb in micro]


def update(run, batch, advantages, step):
    """Reference log-probs, then mu passes over the batch, each one optimizer step per mini-batch
    (steps_per_generation): the mini-batch's micro-batched loss and backward (`backward_mini_batch`), then the
    optimizer step (`optimizer_step`).

    Each mini-batch's loss is normalised by its own counts over all ranks, so an optimizer step's gradient is
    that of its mini-batch alone (with one mini-batch, the whole batch's). The old log-probs are those of the
    weights that sampled (`OldLogprobs`). With one mini-batch, the first pass's forward is at those weights: its
    log-probs, kept, are the old log-probs of the later passes. With several, mini-batch 2's first forward comes
    after an optimizer step, so a forward without gradient takes every row's old log-probs first (as TRL then
    does). Either way they are compared with the sampler's (`sampler_logprob_diff`). With sync_ref_model the
    reference is mixed toward the policy after every ref_model_sync_steps-th optimizer step of the run; this
    step's reference log-probs were taken before (TRL takes them when it generates).
    Returns the sums and maxima behind the step's metrics (on this rank), the gradient norm and learning
    rate of the last optimizer step, and how many optimizer steps were skipped.
    """
    cfg, d = run.cfg, run.d
    n_mini = cfg.steps_per_generation
    run.step_images = batch.images  # each forward below takes its micro-batch's rows of them
    ids = torch.cat([batch.prompt_ids, batch.rollout.completion_ids], dim=1)                  # (n, S + T)
    mask = torch.cat([batch.prompt_mask, torch.ones_like(batch.rollout.completion_ids)], dim=1)
    T = batch.rollout.completion_ids.shape[1]
    route = None  # routing replay: each token's experts as the sampler chose them, (n, S + T, layers, k)
    if batch.rollout.routing is not None:
        route = torch.cat([batch.rollout.prompt_routing, batch.rollout.routing], dim=1)
    loss_mask = batch.rollout.policy_mask.float()  # (n, T) the policy's tokens: an environment's are context only
    if cfg.mask_truncated_completions:
        loss_mask = loss_mask * (~batch.rollout.truncated).float()[:, None]
    # mini-batch j: the step's rows i with i % n_mini == j, whatever the world size (n / n_mini of them on each rank);
    # its normalisers over all ranks, so any world size gives the same gradient
    rows = logprobs.mini_batch_rows(ids.shape[0], batch.mine.start, n_mini, d.device)
    N = batch.prompt_ids.shape[0] * d.world_size // n_mini
    num_tokens = [torch.tensor(c, device=d.device).clamp(min=1)
                  for c in sharding.all_reduce_sum([loss_mask[r].sum().item() for r in rows], d)]
    # in each, rows of similar length together (with shared_prompts, each group's rows), each micro-batch cut to the
    # columns its rows use
    minis = [[logprobs.MicroBatch(r[mb.rows], mb.cols, mb.t, mb.width)
              for mb in logprobs.micro_batches(mask[r], loss_mask[r], T, cfg.micro_batch_size, cfg.micro_batch_tokens,
                                               prompt_ids=batch.prompt_ids[r] if cfg.shared_prompts else None)]
             for r in rows]
    if d.world_size > 1 and cfg.micro_batch_tokens:  # as many forwards (FSDP collectives) on every rank
        counts = sharding.all_gather_rows(torch.tensor([[len(m) for m in minis]], device=d.device), d).amax(0)
        minis = [logprobs.split_micro_batches(m, c) for m, c in zip(minis, counts.tolist())]
    ref_logp = [reference_logprobs(run, ids, mask, m, route) for m in minis] if cfg.beta > 0 else None
    # (n, T) tokens whose context older weights computed (max_staleness): their old log-prob is the sampler's
    stale = rollouts.carried(batch.rollout, step - 1) if batch.rollout.context_version is not None else None
    old = OldLogprobs(cfg, minis, loss_mask, batch.rollout.logprobs, d.device, stale)
    threshold = [None] * n_mini  # each mini-batch's entropy quantile
    if n_mini > 1:  # every mini-batch's old log-probs before the first optimizer step (and its entropies, if asked)
        for j, micro in enumerate(minis):
            out = sampling_logprobs(run, ids, mask, micro, route)
            for i, (mb, (logp, _)) in enumerate(zip(micro, out)):
                old.keep(j, i, mb, logp)
            if cfg.top_entropy_quantile < 1:
                threshold[j] = entropy_threshold(run, ids, mask, micro, loss_mask, [e for _, e in out])
    elif cfg.top_entropy_quantile < 1:
        threshold[0] = entropy_threshold(run, ids, mask, minis[0], loss_mask)

    inputs = dict(ids=ids, mask=mask, loss_mask=loss_mask, route=route, advantages=advantages, num_sequences=N,
                  sampler=batch.rollout.logprobs)
    skipped = 0
    for iteration in range(cfg.num_iterations):
        # the metrics are the last pass's: sums over its every micro-batch, so each counted token once; "loss",
        # summed over its n_mini optimizer steps, is divided by n_mini below (an optimizer step's mean loss)
        sums = {"loss": 0.0, "kl": 0.0, "clip_low": 0.0, "clip_high": 0.0, "entropy": 0.0, "tokens": 0.0,
                "is_weight": 0.0, "kept": 0.0}
        for j, micro in enumerate(minis):
            step_loss, step_entropy = backward_mini_batch(run, j, micro, inputs, old, ref_logp, num_tokens[j],
                                                          threshold[j], sums)
            opt_step = ((step - 1) * cfg.num_iterations + iteration) * n_mini + j  # the run's optimizer steps before
            grad_norm, lr, done = optimizer_step(run, opt_step, step_loss)
            skipped += not done
            if cfg.use_adaptive_entropy:  # this optimizer step's mean entropy over every rank's counted tokens
                control_entropy(run, sharding.all_reduce_sum([float(step_entropy)], d)[0] / num_tokens[j].item())
    sums["loss"] = sums["loss"] / n_mini
    sums.update(old.sums())
    return sums, old.diff_max, grad_norm, lr, skipped


class OldLogprobs:
    """Each micro-batch's log-probs at the weights that sampled (pi_old), with the importance weights against the
    sampler's log-probs where asked, and the running |trainer - sampler| log-prob over the counted tokens (summed,
    and the largest).

    `stale` (n, T), with max_staleness: the tokens of rows carried through a weight change (rollouts.carried):
    drawn by older weights, or by newer ones attending to the K/V older ones computed. The trainer cannot compute
    their pi_old (those weights, or that mix of weights and cache, are gone); the sampler's log-prob is it,
    exactly (the behaviour policy, as in PipelineRL and TRL's ZeroSync). The first pass's ratio for them is then
    exp(train - sampler). They are left out of the trainer-sampler comparison, which measures the arithmetic's
    agreement at equal weights; their own |train - sampler| (`carried_sum`, `carried_tokens`) is how far the
    weights moved under them."""

    def __init__(self, cfg, minis, loss_mask, sampler, device, stale=None):
        self.cfg, self.loss_mask, self.sampler, self.stale = cfg, loss_mask, sampler, stale
        self.logp, self.is_weight = [[None] * len(m) for m in minis], [[None] * len(m) for m in minis]
        self.diff_sum = self.diff_max = self.diff_tokens = torch.zeros((), device=device)
        self.carried_sum = self.carried_tokens = torch.zeros((), device=device)
        # the importance weights' extremes over the counted tokens (with --importance_sampling)
        self.is_min, self.is_max = torch.tensor(math.inf, device=device), torch.tensor(-math.inf, device=device)
        self.mismatch = {}  # "fresh" / "carried" -> summed grpo.mismatch_sums of the trainer against the sampler

    def sums(self):
        """The comparison's part of the step's sums (summed over ranks with the loss's; run_log.sampler_metrics):
        |trainer - sampler| of the compared tokens and of the carried ones, each kind's mismatch sums, and the
        importance weights' extremes (reduced as extremes: run_log.weight_extremes)."""
        out = {"lp_diff_sum": self.diff_sum, "lp_diff_tokens": self.diff_tokens}
        for which, part in self.mismatch.items():
            out.update({f"mismatch_sum/{which}/{k}": v for k, v in part.items()})
        if self.cfg.importance_sampling != "none":
            out["is_weight_min"], out["is_weight_max"] = self.is_min, self.is_max
        if self.stale is not None:  # the carried tokens' |train - sampler|: the weights' move under them
            out["carried_diff_sum"], out["carried_diff_tokens"] = self.carried_sum, self.carried_tokens
        return out

    def _add_mismatch(self, which, logp, sampler, mask):
        part = grpo.mismatch_sums(logp, sampler, mask)
        have = self.mismatch.get(which)
        self.mismatch[which] = part if have is None else {k: have[k] + v for k, v in part.items()}

    def keep(self, j, i, mb, logp):
        cfg = self.cfg
        mb_mask, sampler = self.loss_mask[mb.rows, :mb.t], self.sampler[mb.rows, :mb.t]
        compared = mb_mask
        if self.stale is not None:
            stale = self.stale[mb.rows, :mb.t] * mb_mask
            self.carried_sum = self.carried_sum + ((logp - sampler).abs() * stale).sum()
            self.carried_tokens = self.carried_tokens + stale.sum()
            self._add_mismatch("carried", logp, sampler, stale)
            logp, compared = torch.where(stale.bool(), sampler, logp), mb_mask * ~stale.bool()
        self._add_mismatch("fresh", logp, sampler, compared)
        self.logp[j][i] = logp
        diff = (logp - sampler).abs() * compared
        self.diff_sum, self.diff_tokens = self.diff_sum + diff.sum(), self.diff_tokens + compared.sum()
        self.diff_max = torch.maximum(self.diff_max, diff.max())
        if cfg.importance_sampling != "none":
            self.is_weight[j][i] = grpo.importance_weights(logp, sampler, mb_mask, cfg.importance_sampling,
                                                           cfg.importance_sampling_min, cfg.importance_sampling_max)
            w, counted = self.is_weight[j][i].expand_as(mb_mask), mb_mask > 0  # a sequence's weight on its tokens
            self.is_min = torch.minimum(self.is_min, torch.where(counted, w, math.inf).min())
            self.is_max = torch.maximum(self.is_max, torch.where(counted, w, -math.inf).max())


def backward_mini_batch(run, j, micro, inputs, old, ref_logp, num_tokens, threshold, sums):
    """Mini-batch j's loss and backward, one micro-batch at a time; adds its micro-batches' metrics to `sums` and
    returns this optimizer step's loss and entropy sums on this rank (on the device: nothing waits here)."""
    cfg, d, policy = run.cfg, run.d, run.policy
    ids, mask, loss_mask, advantages = inputs["ids"], inputs["mask"], inputs["loss_mask"], inputs["advantages"]
    objective = dataclasses.replace(grpo.Objective.of(cfg), entropy_coef=entropy_bonus(run))
    step_loss = step_entropy = 0.0
    for i, mb in enumerate(micro):
        logp, entropy = policy(logprobs.completion_logprobs, *mb.take(ids, mask), mb.t, cfg.temperature,
                               width=mb.width, compile_layers=cfg.compile_layers,
                               entropy_grad=cfg.entropy_coef != 0 or cfg.use_adaptive_entropy,
                               routing=routes(inputs["route"], mb), images=images_of(run, mb))
        mb_mask = loss_mask[mb.rows, :mb.t]
        if old.logp[j][i] is None:  # one mini-batch, first pass: this forward is at the weights that sampled
            old.keep(j, i, mb, logp.detach())
        keep = select_tokens(cfg, entropy, logp, inputs["sampler"][mb.rows, :mb.t], advantages[mb.rows], mb_mask,
                             threshold)
        is_weight = old.is_weight[j][i]
        loss, m = grpo.grpo_loss(logp, old.logp[j][i], ref_logp[j][i] if ref_logp is not None else None,
                                 advantages[mb.rows], mb_mask, objective, num_sequences=inputs["num_sequences"],
                                 num_tokens=num_tokens, is_weight=is_weight, keep=keep, entropy=entropy)
        # this rank's loss is its share of a sum over all ranks; FSDP averages gradients over ranks (float16: the
        # loss scaled up, the gradients divided back in optimizer_step)
        (loss * (d.world_size if run.loss_scale is None else d.world_size * run.loss_scale.scale)).backward()
        step_loss += loss.detach()  # summed on the device: no wait until the step's metrics are read
        sums["loss"] += loss.detach()
        for k in ("kl", "clip_low", "clip_high"):
            sums[k] += m[k] * m["tokens"]
        step_entropy += (entropy.detach() * mb_mask).sum()
        sums["entropy"] += (entropy.detach() * mb_mask).sum()
        sums["tokens"] += m["tokens"]
        if is_weight is not None:
            sums["is_weight"] += (is_weight * mb_mask).sum()
        if keep is not None:
            sums["kept"] += (keep * mb_mask).sum()
    return step_loss, step_entropy


def optimizer_step(run, opt_step, step_loss):
    """The run's optimizer step number `opt_step` (0-based) after a mini-batch's backward: the gradient clipped, the
    learning rate set, the step taken unless the loss or the gradient is not finite (then skipped and counted, on
    every rank alike: the loss summed over ranks), the gradients zeroed, and with sync_ref_model the reference mixed
    toward the policy. Returns (gradient norm, learning rate, whether the step was taken). Under float16 the
    gradients are unscaled first, and a finite loss with a gradient that is not is an overflow: the step is skipped
    and the loss scale halved (sharding.LossScale), which is not a bad step; at a scale of 1 or less the scale
    cannot be to blame, and it is one."""
    cfg, d, policy = run.cfg, run.d, run.policy
    if run.loss_scale is not None:
        run.loss_scale.unscale(policy.parameters())
    grad_norm = sharding.full_tensor(torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm))
    loss_sum = sharding.all_reduce_sum([torch.as_tensor(step_loss, dtype=torch.float32).item()], d)[0]
    lr = set_hyperparameters(run.optimizer, cfg, opt_step)
    done = math.isfinite(grad_norm.item()) and math.isfinite(loss_sum)
    # float16: a finite loss whose gradient is not, while the scale is above 1 (so the scale can be to blame)
    overflow = not done and run.loss_scale is not None and math.isfinite(loss_sum) and run.loss_scale.scale > 1
    if done:
        run.optimizer.step()
        run.bad_steps = 0
    elif not overflow:
        run.bad_steps += 1
    if run.loss_scale is not None and (done or overflow):
        run.loss_scale.update(done)
    run.optimizer.zero_grad(set_to_none=True)
    # TR-DPO: counted as TRL counts its global_step (a skipped step too), a function of the step alone, so a resumed
    # run syncs where an uninterrupted one does
    if cfg.sync_ref_model and (opt_step + 1) % cfg.ref_model_sync_steps == 0:
        sharding.mix_weights(run.ref, policy, cfg.ref_model_mixup_alpha)
    return grad_norm, lr, done


def entropy_bonus(run):
    """The entropy bonus's coefficient for the next optimizer step: entropy_coef, or with use_adaptive_entropy the
    controlled coefficient where the last step's mean entropy was at or below entropy_target, else 0."""
    cfg = run.cfg
    if not cfg.use_adaptive_entropy:
        return cfg.entropy_coef
    return run.entropy_coef if run.last_entropy is not None and run.last_entropy <= cfg.entropy_target else 0.0


def control_entropy(run, entropy):
    """Adaptive entropy control (Skywork-OR1; TRL's use_adaptive_entropy), after each optimizer step: the
    coefficient goes up by entropy_coef_delta while the mean entropy is at or below entropy_target, else down,
    within [entropy_coef_min, entropy_coef_max]; the entropy is kept for `entropy_bonus`."""
    cfg = run.cfg
    step = cfg.entropy_coef_delta if entropy <= cfg.entropy_target else -cfg.entropy_coef_delta
    run.entropy_coef = min(max(run.entropy_coef + step, cfg.entropy_coef_min), cfg.entropy_coef_max)
    run.last_entropy = entropy


def entropy_threshold(run, ids, mask, micro, loss_mask, entropy=None):
    """The (1 - top_entropy_quantile) quantile of the entropies of every counted token of `micro` (a mini-batch),
    on every rank, at the weights that sampled: their `entropy` (one per micro-batch), or else one forward without
    gradient per micro-batch, so that the tokens kept do not depend on how the mini-batch is split (TRL takes
    the quantile over each micro-batch). None without tokens."""
    cfg, d = run.cfg, run.d
    if entropy is None:
        entropy = [e for _, e in sampling_logprobs(run, ids, mask, micro)]
    local = torch.cat([e[loss_mask[mb.rows, :mb.t] > 0] for e, mb in zip(entropy, micro)]).float()
    if d.world_size > 1:  # every rank's tokens, each rank's padded with NaN to the most any rank has
        most = int(sharding.all_gather_rows(torch.tensor([local.numel()], device=d.device), d).max().item())
        padded = torch.full((most,), float("nan"), device=local.device)
        padded[:local.numel()] = local
        local = sharding.all_gather_rows(padded, d)
        local = local[~torch.isnan(local)]
    return torch.quantile(local, 1 - cfg.top_entropy_quantile) if local.numel() else None


def select_tokens(cfg, entropy, logp, sampler_logp, advantages, mask, threshold=None):
    """None, or (m, T) / (m, 1) in {0, 1}: the tokens whose policy term counts in this micro-batch (TRL's entropy
    and off-policy masks; neither changes a normaliser). threshold: the step's entropy quantile
    (`entropy_threshold`); None (no counted token) keeps none (docs/objective.md: "Which tokens count")."""
    keep = None
    if cfg.top_entropy_quantile < 1:
        keep = (grpo.high_entropy_mask(entropy.detach(), mask, threshold=threshold) if threshold is not None
                else torch.zeros_like(mask))
    if cfg.off_policy_mask_threshold is not None:
        off = grpo.off_policy_mask(advantages[:, None], logp, sampler_logp, mask, cfg.off_policy_mask_threshold)
        keep = off if keep is None else keep * off
    return keep


def peak_memory(d):
    """The GPU memory allocated at most since the last call, in GiB (None on a CPU); starts the next count."""
    if d.device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(d.device) / 2**30
    torch.cuda.reset_peak_memory_stats(d.device)
    return peak


def train_step(run, step):
    """One GRPO step. Returns its metrics, reduced over all ranks, and what tables and prints show of the batch:
    (this rank's batch, its total rewards, every rank's reward parts, this rank's advantages)."""
    cfg, d = run.cfg, run.d
    t0 = time.time()
    executor.take_stats()  # model-written code run from here on (tools, rewards) is this step's; an evaluation's is not
    memory = {}
    peak_memory(d)
    # 1. sample G completions per prompt and 2. score them: (n,); with dynamic sampling, until enough have a signal
    batch, total, parts, reward_time, dynamic = draw(run, step)
    memory["memory/generation_gib"] = peak_memory(d)
    t_gen = time.time() - t0 - reward_time["reward_time"]
    exec_stats = executor.take_stats()
    all_total = sharding.all_gather_rows(total, d)                   # (N,): every group whole on every rank
    all_parts = {k: sharding.all_gather_rows(v, d) for k, v in parts.items()}
    try:
        all_adv, group_std = advantages(run, all_total, all_parts)   # 3. advantages within groups
    except ValueError as e:  # rewards too large to normalise (the same on every rank)
        raise SystemExit(f"step {step}: {e}") from e
    t1 = time.time()
    sums, lp_diff_max, grad_norm, lr, skipped = update(run, batch, all_adv[batch.mine].to(d.device), step)  # 4.
    memory["memory/training_gib"] = peak_memory(d)
    scaled = run.loss_scale.step_metrics() if run.loss_scale is not None else {}  # float16's loss scale
    say_skipped(run, step, skipped, scaled.get("overflow_steps", 0), grad_norm)
    # float64: the mismatch's sums are float64 (a float32 value is carried exactly)
    local = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=d.device) for v in sums.values()]).tolist()
    t_update = time.time() - t1  # .tolist() waited for the device
    metrics = {"step": step, **run_log.step_metrics(run, batch, dict(zip(sums, local)), lp_diff_max.item(),
                                                    all_total, parts, all_adv, group_std),
               "grad_norm": grad_norm.item(), "lr": lr, "skipped_steps": skipped, **dynamic,
               **({"entropy_coef": run.entropy_coef} if cfg.use_adaptive_entropy else {}), **scaled}
    step_time = time.time() - t0
    if d.device.type == "cuda":  # what `--plan` predicts for the phases, per GPU (this rank's)
        metrics.update(memory)
    rollout = batch.rollout
    if rollout.held_steps is not None and int(rollout.held_steps.sum()):  # this rank's decode places at work
        metrics["slots_busy"] = (rollout.policy_mask.sum() / rollout.held_steps.sum()).item()
    if cfg.max_staleness:
        metrics.update(staleness_metrics(run, rollout, step), generation_wait_s=run.stream.wait)
    elif cfg.rollouts_in_flight:
        metrics["generation_wait_s"] = t_gen
    metrics.update(step_time=step_time, generation_time=t_gen, update_time=t_update, **reward_time,
                   tokens_per_s=metrics["batch_tokens"] / step_time, **execution_metrics(d, exec_stats))
    if cfg.sync_ref_model:  # the reference's syncs so far in the run
        metrics["ref_syncs"] = optimizer_steps(cfg, step) // cfg.ref_model_sync_steps
    if cfg.routing_replay:  # of the policy's replayed (token, layer) routing decisions, the share it would change
        differ, decisions = sharding.all_reduce_sum(list(routing.of(run.policy.lm).counts()), d)
        metrics["routing_replay_differ"] = differ / max(1.0, decisions)
        if cfg.beta > 0:  # the reference's own: how far its routers are from the experts the policy sampled
            differ, decisions = sharding.all_reduce_sum(run.ref_routing, d)
            metrics["routing_replay_differ_ref"] = differ / max(1.0, decisions)
            run.ref_routing = [0.0, 0.0]
    return metrics, (batch, total, parts, all_adv[batch.mine])  # this rank's rows, for Logger.show_completions


def say_skipped(run, step, skipped, overflowed, grad_norm):
    """The step's skipped optimizer steps, on rank 0: float16 overflows (the scale halved) apart from the others."""
    if overflowed and run.d.master:
        print(f"step {step}: {overflowed} optimizer step(s) skipped for a float16 overflow; the loss scale is now "
              f"{run.loss_scale.scale:g}", flush=True)
    if skipped > overflowed and run.d.master:
        print(f"step {step}: {skipped - overflowed} optimizer step(s) skipped, the loss or gradient norm was not "
              f"finite (last grad_norm {grad_norm.item():.3g}); a skipped step leaves the weights as they were",
              flush=True)


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


# ----------------------------------------------------------------------------- the loop


def synced_ref(run):
    """The reference when its weights are state (sync_ref_model mixes the policy into them), else None: a frozen
    reference is rebuilt from the initial weights, and is not in checkpoints."""
    return run.ref if run.cfg.sync_ref_model else None


def resume(run):
    """Load out_dir's newest complete checkpoint, if any; the trainer state saved with it (step, wandb id, path,
    world size), or None."""
    resumed = sharding.load_latest_checkpoint(run.cfg.out_dir, run.policy, run.optimizer, run.d, ref=synced_ref(run))
    if resumed is not None:
        run.bad_steps = resumed.get("bad_steps", 0)
        control = resumed.get("entropy_control")  # use_adaptive_entropy's state, if the run saved one
        if control is not None and run.cfg.use_adaptive_entropy:
            run.entropy_coef, run.last_entropy = control["coef"], control["last_entropy"]
        scale = resumed.get("loss_scale")  # float16's loss scale, where the run saved one
        if scale is not None and run.loss_scale is not None:
            run.loss_scale = sharding.LossScale(**scale)
    return resumed


def main(argv):
    cfg = parse_config(argv)
    if cfg.plan:  # the memory plan from the model's config alone: no process group, no weights, no out_dir
        if int(os.environ.get("RANK", "0")) == 0:
            from runs import plan
            print(plan.run(cfg), flush=True)
        return
    set_threads(cfg.threads)
    sharding.map_large_host_tensors()  # freed host memory goes back to the system: a process holds what it uses
    d = sharding.setup(cfg.device, cfg.mixed_precision)
    try:
        validate(cfg, d.world_size)
        sharding.tensor_parallel(d, cfg.tp_size)
        try:
            lock = sharding.lock_out_dir(cfg.out_dir, d)  # this run owns out_dir until it ends
        except sharding.OutDirBusy as e:  # on every rank: the lock is taken together
            raise sharding.EveryRank(str(e)) from e
        except OSError as e:  # a file where the folder should be, no permission, ...
            raise ConfigError("out_dir", f"cannot use {cfg.out_dir!r} as the run's folder ({e.strerror or e})") from e
        with lock:
            try:
                loop(cfg, d)
            except OSError as e:  # a full disk, a quota, ...: one line, and how to go on
                if e.errno not in disk.REASONS:
                    raise
                # a checkpoint, the export, metrics.jsonl or config.json (disk.WriteError): what was partly written is
                # gone; anything else (the tiny model's files, ...): the file and the cause
                said = str(e) if isinstance(e, disk.WriteError) else \
                    f"{e.filename or cfg.out_dir}: {disk.REASONS[e.errno]}"
                newest = sharding.checkpoint_dirs(cfg.out_dir)
                then = f"resumes from {newest[0]}" if newest else "starts over (no checkpoint was saved)"
                remedy = disk.REMEDIES[e.errno]
                raise SystemExit(f"{said}. {remedy[0].upper()}{remedy[1:]}; then the same command {then}"
                                 if d.master else 1) from e
    except BaseException:
        if d.world_size == 1:  # a world of one's group (a precision named on one process) ends with the run
            sharding.teardown()
        raise
    sharding.teardown()


def set_threads(threads):
    """The CPU threads of torch's operations in this process: `threads` when > 0; with 0, torch's default
    (OMP_NUM_THREADS, else one per core) unless several processes share this node without OMP_NUM_THREADS
    (launched by other than torchrun): then its cores are shared out among them."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if threads == 0 and "OMP_NUM_THREADS" not in os.environ and local > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // local)
    if threads:
        torch.set_num_threads(threads)


def loop(cfg, d):
    """Setup, the loop, the export; out_dir is locked for this run."""
    problem = run_log.start_problem(cfg, d, RUN_KEYS)
    if problem:  # told to every rank
        raise sharding.EveryRank(problem)
    t_start = time.time()
    run = setup(cfg, d)
    resumed = resume(run) or {"step": 0, "path": None, "wandb_id": None}
    if cfg.eval_only:
        return evaluate_only(run, resumed)
    start_step, last_checkpoint = resumed["step"], resumed["path"]
    run_id = resumed["wandb_id"] or uuid.uuid4().hex[:12]  # os.urandom: leaves the seeded generators alone
    if d.master:
        run_log.write_config(cfg)
        print(run_log.banner(run, resumed), flush=True)
    config = run.policy.lm.config
    moe = bool(getattr(getattr(config, "text_config", None) or config, "num_experts", None) or
               getattr(getattr(config, "text_config", None) or config, "num_local_experts", None))
    bf16 = bool(sharding.fsdp_modules(run.policy)) and sharding.mixed_precision_dtypes(cfg.mixed_precision,
                                                                                      d.device)[0] == torch.bfloat16
    logger = run_log.Logger(cfg, d.master, resume_step=start_step, run_id=run_id, moe=moe, bf16=bf16)
    history, step, t_loop = [], start_step, time.time()
    try:
        for step in range(start_step + 1, cfg.max_steps + 1):
            metrics, shown = train_step(run, step)
            history.append(metrics.get("dynamic/reward_drawn", metrics["reward"]))  # every completion drawn
            if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.max_steps):
                metrics.update(evaluate(run, step))
            logger.show_completions(run, step, *shown)
            if step % cfg.log_every == 0 or step == cfg.max_steps or "eval/reward" in metrics or run.bad_steps:
                logger.log(metrics, eta=(time.time() - t_loop) / (step - start_step) * (cfg.max_steps - step))
            if run.bad_steps >= cfg.max_bad_steps:
                raise SystemExit(f"step {step}: the last {run.bad_steps} optimizer steps had a non-finite loss or "
                                 f"gradient norm and were skipped (--max_bad_steps={cfg.max_bad_steps}); stopping. "
                                 f"Nothing non-finite was applied or saved. Check the rewards' scale or lower --lr")
            if cfg.save_every and (step % cfg.save_every == 0 or step == cfg.max_steps):
                last_checkpoint = save(run, step, run_id)
    except KeyboardInterrupt:
        if d.master:
            saved = (f"the last checkpoint is {last_checkpoint}; run the same command again to resume from it"
                     if last_checkpoint else "no checkpoint was saved yet; the same command starts over")
            print(f"\ninterrupted during step {step}: {saved}", flush=True)
        raise SystemExit(130)
    finally:
        logger.close()
    export(run, start_step, history, t_start)


def evaluate(run, step):
    """Held-out evaluation (eval/ metrics), with one line on how it went."""
    t = time.time()
    try:
        metrics = sampling.evaluate(run.policy, run.tokenizer, run.task, run.weights, run.cfg, run.d, run.eos_ids,
                                    run.agent, step=step, images=run.images)
    except rewards.RewardFunctionError as e:
        raise SystemExit(f"evaluation at step {step}: {e}") from e
    if run.reward_model is not None:
        sharding.free_gathered(run.reward_model[0])
    if run.d.master:
        print(f"eval at step {step} on {len(run.task.eval_rows)} held-out prompts ({time.time() - t:.1f}s): "
              + " | ".join(f"{k[5:]} {v:.4g}" for k, v in metrics.items() if k.count("/") == 1), flush=True)
    return metrics


def evaluate_only(run, resumed):
    """--eval_only: the held-out evaluation of the policy this command would train from (out_dir's newest
    checkpoint, else --model), written to out_dir/eval.jsonl; nothing is trained, saved or exported."""
    cfg, d = run.cfg, run.d
    if d.master:
        print(f"evaluating {resumed['path'] or cfg.model} (step {resumed['step']}) on {cfg.eval_prompts} held-out "
              f"prompts of task {cfg.task}", flush=True)
    metrics = evaluate(run, resumed["step"])
    if d.master:
        line = {"step": resumed["step"], "checkpoint": resumed["path"], "model": cfg.model, **metrics}
        with open(os.path.join(cfg.out_dir, "eval.jsonl"), "a") as f:
            f.write(json.dumps(run_log.strict_json(line)) + "\n")
    return metrics


def save(run, step, run_id):
    """A checkpoint of this step (every rank writes its shard); its folder."""
    t = time.time()
    trainer_state = {"wandb_id": run_id, "bad_steps": run.bad_steps,  # the learning rate is a function of the step
                     "data": {"seed": run.cfg.seed, "next_step": step + 1}}  # prompts are f(seed, step)
    if run.cfg.use_adaptive_entropy:
        trainer_state["entropy_control"] = {"coef": run.entropy_coef, "last_entropy": run.last_entropy}
    if run.loss_scale is not None:
        trainer_state["loss_scale"] = run.loss_scale.state()
    try:
        path = sharding.save_checkpoint(run.cfg.out_dir, step, run.policy, run.optimizer, trainer_state, run.d,
                                        keep=run.cfg.keep_checkpoints, ref=synced_ref(run))
    except RuntimeError as e:  # non-finite weights: nothing is written, the earlier checkpoints stay
        raise SystemExit(str(e)) from e
    if run.d.master:
        print(f"saved {path} in {time.time() - t:.1f}s", flush=True)
    return path


def export(run, start_step, history, t_start):
    """The trained policy as one Hugging Face folder with full tensors, and a summary of the run."""
    cfg, d, t = run.cfg, run.d, time.time()
    export_dir = os.path.join(cfg.out_dir, "model")
    sharding.free_gathered(run.policy)  # the root group may still hold unsharded tensors from its last forward
    try:  # every rank: each tensor is gathered in turn and rank 0 writes it
        run_export.export_model(run.policy.lm, run.tokenizer, export_dir, master=d.master,
                                   image_processor=None if run.images is None else run.images.image_processor)
    except ValueError as e:  # non-finite weights: nothing is written
        raise SystemExit(str(e)) from e
    if not d.master:
        return
    print(f"exported the policy to {export_dir} in {time.time() - t:.1f}s")
    if history:  # the steps this call ran (a resumed run: those after the checkpoint)
        k = max(1, len(history) // 10)
        print(f"done: steps {start_step + 1}-{cfg.max_steps} in {time.time() - t_start:.0f}s | reward over the first "
              f"10% of them {sum(history[:k]) / k:.3f} -> last 10% {sum(history[-k:]) / k:.3f}")
    else:
        print(f"done: {cfg.out_dir} already holds step {start_step} of {cfg.max_steps}; no step left to run")
    print(f"metrics: {os.path.join(cfg.out_dir, 'metrics.jsonl')} | config: "
          f"{os.path.join(cfg.out_dir, 'config.json')} | model: {export_dir}")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except KeyboardInterrupt:  # outside the loop (which says where its checkpoint is): loading, the export
        print("\ninterrupted", file=sys.stderr)
        raise SystemExit(130)
    except SystemExit as e:
        # errors about the user's input are one line; GRPO_DEBUG=1 shows where they came from
        if os.environ.get("GRPO_DEBUG", "0") not in ("", "0") and e.__cause__ is not None:
            import traceback
            traceback.print_exception(e.__cause__)
        if isinstance(e, (ConfigError, sharding.EveryRank)) and "RANK" in os.environ:
            # every rank meets it (a setting, out_dir): said once, by rank 0, as a bad setting is above. The group
            # goes down without a barrier: were a rank not to meet it after all (another node's machine), it
            # would wait in one for ever, where now it fails at its next collective
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            if int(os.environ["RANK"]) != 0:
                raise SystemExit(0) from None
        if isinstance(e.code, str):
            tell_torchrun(e.code)
        raise
