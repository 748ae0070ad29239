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

import json
import math
import os
import sys
import time
import uuid

from runs import cli  # the settings need nothing heavier: the imports of torch and the rest come after them (below)
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
    if cfg.plan and cfg.plan_world_size:
        validate(cfg, cfg.plan_world_size)
    else:  # and how torchrun formed them (nodes), where it did
        validate(cfg, int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "0")))
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
    import torch.nn.functional as F

    from runs import disk
    import grpo
    import logprobs
    import rewards
    from runs import export as run_export
    from runs import log as run_log
    from runs.setup import setup as make_run  # the models, task, tools and optimizer of a run
    from features.apply import apply as apply_features  # the optional features, on the run's seams, in order
    import rollouts
    import sampling
    import sharding
except KeyboardInterrupt:  # Ctrl-C while importing: one line, not the importer's traceback
    if __name__ != "__main__":
        raise
    print("\ninterrupted while importing torch and transformers", file=sys.stderr)
    raise SystemExit(130)


# ----------------------------------------------------------------------------- optimizer


LR_SCHEDULES = {  # --lr_schedule: the multiplier on lr after the warm-up, of the progress through the rest (0 to 1)
    "constant": lambda progress: 1.0,
    "linear": lambda progress: max(0.0, 1.0 - progress),
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))),
}


def lr_factor(cfg, opt_step, total_opt_steps):
    """Multiplier on cfg.lr at optimizer step `opt_step` (0-based): a linear warm-up, then the schedule."""
    if opt_step < cfg.warmup_steps:
        return (opt_step + 1) / cfg.warmup_steps
    return LR_SCHEDULES[cfg.lr_schedule]((opt_step - cfg.warmup_steps) / max(1, total_opt_steps - cfg.warmup_steps))


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


# ----------------------------------------------------------------------------- the run


def setup(cfg, d):
    """The run (runs/setup.py: models, task, tools, optimizer), its seams set to the core step's own functions
    below, then the run's optional features applied to them in order (features/apply.py)."""
    run = make_run(cfg, d)
    run.rollout, run.draw, run.rewards, run.micro_batches = rollout, draw, rewards_of, micro_batches
    run.rows_of = sampling.rows_of  # a step's rows from its prompts (images and agents make their own)
    run.forward = logprobs.Forward(compile_layers=cfg.compile_layers)  # the training forward (features wrap it)
    run.old_logprobs = OldLogprobs if cfg.importance_sampling == "none" else WeightedOldLogprobs
    run.update_metrics += [] if cfg.importance_sampling == "none" else [WeightedOldLogprobs.metrics]
    run.select_tokens, run.optimizer_step = every_token, optimizer_step
    run.backward = torch.Tensor.backward  # float16 scales the loss first
    run.objective = lambda run: grpo.Objective.of(cfg)  # the loss's settings: the config's, at every optimizer step
    run.entropy_grad = cfg.entropy_coef != 0  # an entropy bonus in the loss: its gradient through the forward
    apply_features(run, sys.modules[__name__])
    if d.device.type == "cuda":  # the phases' peak memory, around every feature's draw
        PeakMemory(run)
    return run


# ----------------------------------------------------------------------------- the step


def rollout(run, step, round=0):
    """The step's prompts, G completions sampled for each on the current weights; this rank's rows (rollouts.Batch).
    `round` > 0: a further draw of the step (other prompts, other random numbers)."""
    rows = step_rows(run, step, round)
    return sampling.sample_rows(run.policy, run.tokenizer, rows, sampling.Draw.of(run.cfg), run.cfg, run.d, run.eos_ids)


def step_rows(run, step, round=0):
    """This rank's rows (rollouts.Rows) of the step's prompts, G of each (`run.rows_of`)."""
    cfg, G = run.cfg, run.cfg.num_generations
    # prompts are a pure function of (seed, step, round), so a resumed run sees the same ones
    rows = run.task.prompts_for_step(cfg.seed, step, cfg.prompts_per_step, round)
    base = (cfg.seed * 1_000_003 + step) * len(rows) * G + round * 0x9E3779B9
    return run.rows_of(rows, G, run.d, run.tokenizer, cfg, lambda i: i + base)


def draw(run, step, round=0):
    """The step's batch on this rank, scored: (batch, total (n,), {function: (n,)}, seconds of scoring, the draw's
    own metrics: none here). round > 0: a further draw of the step (other prompts, other random numbers), which
    dynamic sampling makes (features/dynamic_sampling.py replaces `run.draw`)."""
    batch = run.rollout(run, step, round)
    total, parts, seconds = score(run, batch, step)
    return batch, total, parts, seconds, {}



def score(run, batch, step):
    """Rewards of this rank's completions: (total (n,), {function: (n,)}), NaN where nothing scored, and the
    seconds scoring took ({"reward_time": s}, and "reward_time/<function>" for each of several functions), the
    slowest rank's.

    A reward function that fails (or returns absurd values) on any rank stops every rank with its message.
    """
    problem, seconds, t = None, {}, time.time()
    try:
        total, parts = run.rewards(run, batch, step, seconds)
    except rewards.RewardFunctionError as e:
        problem = f"step {step}: {e}"
    times = [time.time() - t] + list(seconds.values())
    problem = sharding.first_problem(problem, run.d)
    if problem:
        raise SystemExit(problem)
    if run.d.world_size > 1:  # a step waits for its slowest rank
        times = sharding.all_gather_rows(torch.tensor([times], dtype=torch.float64), run.d).max(0).values.tolist()
    names = ["reward_time"] + ([f"reward_time/{name}" for name in seconds] if len(seconds) > 1 else [])
    return total, parts, dict(zip(names, times))


def rewards_of(run, batch, step, seconds):
    """The batch's rewards, (total (n,), {function: (n,)}); each function's seconds go into `seconds`."""
    return rollouts.score_batch(batch, run.task.reward_funcs, run.weights, run.tokenizer,
                                rollouts.reward_context(run.cfg, step), seconds)


def freeing_reward_model(inner):
    """`run.rewards` of a run with a reward model (features/apply.py): `inner`'s, then the reward model's gathered
    root weights freed (it runs forward only: nothing else frees them)."""
    def rewards_then_free(run, batch, step, seconds):
        out = inner(run, batch, step, seconds)
        sharding.free_gathered(run.reward_model[0])
        return out
    return rewards_then_free


def advantages(run, all_total, all_parts):
    """(advantages (N,), group std (P,)) of every rank's rewards: the total (N,) and each function's {name: (N,)}.
    GDPO (normalize_then_sum) normalises each function within its group before the sum."""
    signal, scale, G = all_total, run.cfg.scale_rewards, run.cfg.num_generations
    if run.cfg.multi_objective_aggregation == "normalize_then_sum":
        signal, scale = grpo.decoupled_rewards(torch.stack(list(all_parts.values()), 1), run.weights, G), "batch"
    return grpo.group_advantages(signal, G, scale)


def forward_extras(run, batch):
    """What each micro-batch's forward takes from the features besides its tokens (routing records, images: the
    functions in `run.forward_extras`), as a function of the micro-batch: the `extras` that `run.forward`'s
    variants read (logprobs.completion_logprobs carries them without reading). Made where a feature added one."""
    makers = [extra(run, batch) for extra in run.forward_extras]
    return lambda mb: {k: v for make in makers for k, v in make(mb).items()}


def reference_logprobs(run, ids, mask, micro, extras):
    """The reference's log-probs, fixed during the update: one tensor per micro-batch. `run.reference` runs the
    reference's forward: the reference model's (runs/setup.py), or a feature's (LoRA: the policy, adapters off)."""
    with torch.no_grad():
        logp = [run.reference(logprobs.completion_logprobs, *mb.take(ids, mask), mb.t, run.cfg.temperature,
                              width=mb.width, forward=run.forward, extras=extras(mb))[0] for mb in micro]
    if run.ref is not None:
        sharding.free_gathered(run.ref)  # never backward: nothing else would free the root's gathered weights
    return logp


def sampling_logprobs(run, ids, mask, micro, extras):
    """The policy's (log-probs, entropies) at its current weights, without gradient: one pair per micro-batch.
    Before the step's first optimizer step, these are the weights that sampled."""
    cfg, policy = run.cfg, run.policy
    with torch.no_grad():
        return [policy(logprobs.completion_logprobs, *mb.take(ids, mask), mb.t, cfg.temperature, width=mb.width,
                       forward=run.forward, extras=extras(mb)) for mb in micro]


def micro_batches(run, batch, rows, mask, loss_mask, T):
    """A mini-batch's micro-batches (its rows `rows`): rows of similar length together, each micro-batch cut to the
    columns its rows use (logprobs.micro_batches). `run.micro_batches` may group them otherwise (shared prompts)."""
    cfg = run.cfg
    return [logprobs.MicroBatch(rows[mb.rows], mb.cols, mb.t, mb.width)
            for mb in logprobs.micro_batches(mask[rows], loss_mask[rows], T, cfg.micro_batch_size,
                                             cfg.micro_batch_tokens)]


def update(run, batch, advantages, step):
    """Reference log-probs, then mu passes over the batch (num_iterations), each one optimizer step per mini-batch
    (steps_per_generation, `mini_batches`): the mini-batch's micro-batched loss and backward
    (`backward_mini_batch`), then the optimizer step (`optimizer_step`). The old log-probs are those of the weights
    that sampled (`OldLogprobs`): with one mini-batch, the first pass's forward is at those weights, and its
    log-probs, kept, are the later passes' old log-probs; with several, they are read first (`before_first_step`).
    Returns the sums and maxima behind the step's metrics (on this rank; run_log.step_metrics), the gradient norm
    and learning rate of the last optimizer step, and how many optimizer steps were skipped.
    """
    cfg, d = run.cfg, run.d
    ids = torch.cat([batch.prompt_ids, batch.rollout.completion_ids], dim=1)                  # (n, S + T)
    mask = torch.cat([batch.prompt_mask, torch.ones_like(batch.rollout.completion_ids)], dim=1)
    loss_mask = batch.rollout.policy_mask.float()  # (n, T) the policy's tokens: an environment's are context only
    if cfg.mask_truncated_completions:
        loss_mask = loss_mask * (~batch.rollout.truncated).float()[:, None]
    minis, num_tokens = mini_batches(run, batch, mask, loss_mask)
    extras = forward_extras(run, batch) if run.forward_extras else lambda mb: {}  # by default no forward extras
    ref_logp = [reference_logprobs(run, ids, mask, m, extras) for m in minis] if cfg.beta > 0 else None
    old = run.old_logprobs(cfg, minis, loss_mask, batch.rollout, step, d.device)
    inputs = dict(ids=ids, mask=mask, loss_mask=loss_mask, extras=extras, advantages=advantages,
                  num_sequences=batch.prompt_ids.shape[0] * d.world_size // len(minis))
    # (j, i, mb, logp, entropy) -> the tokens counted; with several mini-batches, given the entropies read first
    keep = run.select_tokens(run, batch, inputs, minis,
                             before_first_step(run, ids, mask, minis, old, extras) if len(minis) > 1 else None)
    skipped = 0
    for iteration in range(cfg.num_iterations):
        # the metrics are the last pass's: sums over its every micro-batch, so each counted token once; "loss",
        # summed over its optimizer steps, is divided by their number below (an optimizer step's mean loss)
        sums = {}
        for j, micro in enumerate(minis):
            mini = backward_mini_batch(run, j, micro, inputs, old, ref_logp, num_tokens[j], keep)
            sums = {k: sums.get(k, 0.0) + v for k, v in mini.items()}
            # the run's optimizer steps before this one
            opt_step = ((step - 1) * cfg.num_iterations + iteration) * len(minis) + j
            grad_norm, lr, done = run.optimizer_step(run, opt_step, mini["loss"])
            skipped += not done
            for after in run.after_optimizer_step:  # what moves on a schedule of its own (features/schedules.py)
                after(run, opt_step, mini["entropy"], num_tokens[j])
    sums["loss"] = sums["loss"] / len(minis)
    sums.update(old.sums())
    return sums, grad_norm, lr, skipped


def mini_batches(run, batch, mask, loss_mask):
    """The step's mini-batches, each a list of micro-batches, and each mini-batch's counted tokens over all ranks.
    Mini-batch j: the step's rows i with i % steps_per_generation == j, whatever the world size (n /
    steps_per_generation of them on each rank). Its loss is normalised by its own counts over all ranks, so an
    optimizer step's gradient is that of its mini-batch alone, and any world size gives the same one. In each, the
    micro-batches of `run.micro_batches` (`micro_batches` below unless a feature groups rows otherwise); with a
    token budget, as many on every rank (each forward makes FSDP collectives)."""
    cfg, d = run.cfg, run.d
    rows = logprobs.mini_batch_rows(mask.shape[0], batch.mine.start, cfg.steps_per_generation, d.device)
    num_tokens = [torch.tensor(c, device=d.device).clamp(min=1)
                  for c in sharding.all_reduce_sum([loss_mask[r].sum().item() for r in rows], d)]
    T = batch.rollout.completion_ids.shape[1]
    minis = [run.micro_batches(run, batch, r, mask, loss_mask, T) for r in rows]
    if d.world_size > 1 and cfg.micro_batch_tokens:
        counts = sharding.all_gather_rows(torch.tensor([[len(m) for m in minis]], device=d.device), d).amax(0)
        minis = [logprobs.split_micro_batches(m, c) for m, c in zip(minis, counts.tolist())]
    return minis, num_tokens


def before_first_step(run, ids, mask, minis, old, extras):
    """With several mini-batches, every row's old log-probs before the first optimizer step moves the weights that
    sampled them: one forward without gradient each, kept in `old` (mini-batch 2's first forward with gradient
    comes after an optimizer step, and TRL too reads them first). Returns each micro-batch's entropies at those
    weights, per mini-batch, for `run.select_tokens`."""
    entropies = []
    for j, micro in enumerate(minis):
        out = sampling_logprobs(run, ids, mask, micro, extras)
        for i, (mb, (logp, _)) in enumerate(zip(micro, out)):
            old.keep(j, i, mb, logp)
        entropies.append([e for _, e in out])
    return entropies


class OldLogprobs:
    """Each micro-batch's log-probs at the weights that sampled (pi_old), and the running |trainer - sampler| log-prob
    over the counted tokens (summed, and the largest). `run.old_logprobs` makes one per update: this class, or a
    variant (importance weights: `WeightedOldLogprobs`; rows carried through a weight change:
    features/streaming.py)."""

    def __init__(self, cfg, minis, loss_mask, rollout, step, device):
        self.cfg, self.loss_mask, self.sampler = cfg, loss_mask, rollout.logprobs
        self.logp, self.is_weight = [[None] * len(m) for m in minis], [[None] * len(m) for m in minis]
        self.diff_sum = self.diff_max = self.diff_tokens = torch.zeros((), device=device)
        self.mismatch = {}  # "fresh" (or a variant's own kind of token) -> summed grpo.mismatch_sums

    def sums(self):
        """The comparison's part of the step's sums (summed over ranks with the loss's; run_log.sampler_metrics):
        |trainer - sampler| of the compared tokens, its largest, and each kind's mismatch sums."""
        out = {"lp_diff_sum": self.diff_sum, "lp_diff_tokens": self.diff_tokens, "max/lp_diff": self.diff_max}
        for which, part in self.mismatch.items():
            out.update({f"mismatch_sum/{which}/{k}": v for k, v in part.items()})
        return out

    def _add_mismatch(self, which, logp, sampler, mask):
        part = grpo.mismatch_sums(logp, sampler, mask)
        have = self.mismatch.get(which)
        self.mismatch[which] = part if have is None else {k: have[k] + v for k, v in part.items()}

    def keep(self, j, i, mb, logp, compared=None):
        """Micro-batch (j, i)'s log-probs at the weights that sampled, compared with the sampler's (`compare`) over
        its counted tokens, or over the tokens `compared` (features/streaming.py leaves its carried tokens out)."""
        counted = self.loss_mask[mb.rows, :mb.t]
        self.compare(logp, self.sampler[mb.rows, :mb.t], counted if compared is None else compared)
        self.logp[j][i] = logp

    def compare(self, logp, sampler, compared):
        """|trainer - sampler| over the tokens `compared` (summed, and the largest), and their mismatch sums."""
        self._add_mismatch("fresh", logp, sampler, compared)
        diff = (logp - sampler).abs() * compared
        self.diff_sum, self.diff_tokens = self.diff_sum + diff.sum(), self.diff_tokens + compared.sum()
        self.diff_max = torch.maximum(self.diff_max, F.pad(diff.flatten(), (0, 1)).max())  # (no rows: 0)


class WeightedOldLogprobs(OldLogprobs):
    """`run.old_logprobs` with --importance_sampling: the old log-probs, and each micro-batch's importance weights
    against the sampler's log-probs (grpo.importance_weights, which the loss takes), with their sum and extremes
    over the counted tokens."""

    def __init__(self, cfg, minis, loss_mask, rollout, step, device):
        super().__init__(cfg, minis, loss_mask, rollout, step, device)
        self.is_sum = 0.0
        self.is_min, self.is_max = torch.tensor(math.inf, device=device), torch.tensor(-math.inf, device=device)

    def sums(self):
        """The comparison's sums, the importance weights' sum over the counted tokens, and their extremes (as
        maxima: the smallest negated)."""
        return {**super().sums(), "is_weight": self.is_sum, "max/-is_weight": -self.is_min,
                "max/is_weight": self.is_max}

    @staticmethod
    def metrics(sums):
        """The importance weights' mean over the counted tokens, smallest and largest, from the step's sums over
        every rank (`run.update_metrics`)."""
        return {"is_weight": sums["is_weight"] / max(sums["tokens"], 1.0), "is_weight_min": -sums["max/-is_weight"],
                "is_weight_max": sums["max/is_weight"]}

    def keep(self, j, i, mb, logp, compared=None):
        """Micro-batch (j, i)'s log-probs at the weights that sampled, compared with the sampler's, and its
        importance weights over every counted token."""
        super().keep(j, i, mb, logp, compared)
        self._weights(j, i, logp, self.sampler[mb.rows, :mb.t], self.loss_mask[mb.rows, :mb.t])

    def _weights(self, j, i, logp, sampler, mb_mask):
        """The importance weights of the sampler's tokens (grpo.importance_weights), their sum over the counted
        tokens, and their extremes."""
        cfg = self.cfg
        self.is_weight[j][i] = grpo.importance_weights(logp, sampler, mb_mask, cfg.importance_sampling,
                                                       cfg.importance_sampling_min, cfg.importance_sampling_max)
        self.is_sum += (self.is_weight[j][i] * mb_mask).sum()
        w, counted = self.is_weight[j][i].expand_as(mb_mask), mb_mask > 0  # a sequence's weight on its tokens
        self.is_min = torch.minimum(self.is_min, F.pad(torch.where(counted, w, math.inf).flatten(), (0, 1),
                                                       value=math.inf).min())
        self.is_max = torch.maximum(self.is_max, F.pad(torch.where(counted, w, -math.inf).flatten(), (0, 1),
                                                       value=-math.inf).max())


def backward_mini_batch(run, j, micro, inputs, old, ref_logp, num_tokens, keep):
    """Mini-batch j's loss and backward, one micro-batch at a time. Returns the sums behind this optimizer step's
    metrics on this rank, over its micro-batches (on the device: nothing waits here)."""
    cfg, d, policy = run.cfg, run.d, run.policy
    ids, mask, loss_mask, advantages = inputs["ids"], inputs["mask"], inputs["loss_mask"], inputs["advantages"]
    objective = run.objective(run)
    sums = {"loss": 0.0, "kl": 0.0, "clip_low": 0.0, "clip_high": 0.0, "entropy": 0.0, "tokens": 0.0}
    for i, mb in enumerate(micro):
        logp, entropy = policy(logprobs.completion_logprobs, *mb.take(ids, mask), mb.t, cfg.temperature,
                               width=mb.width, entropy_grad=run.entropy_grad, forward=run.forward,
                               extras=inputs["extras"](mb))
        mb_mask = loss_mask[mb.rows, :mb.t]
        if old.logp[j][i] is None:  # one mini-batch, first pass: this forward is at the weights that sampled
            old.keep(j, i, mb, logp.detach())
        loss, m = grpo.grpo_loss(logp, old.logp[j][i], ref_logp[j][i] if ref_logp is not None else None,
                                 advantages[mb.rows], mb_mask, objective, num_sequences=inputs["num_sequences"],
                                 num_tokens=num_tokens, is_weight=old.is_weight[j][i],
                                 keep=keep(j, i, mb, logp, entropy), entropy=entropy)
        # this rank's loss is its share of a sum over all ranks; FSDP averages gradients over ranks
        sharding.all_reduce_after(policy, d, last=i == len(micro) - 1)
        run.backward(loss * d.world_size)
        sums["loss"] += loss.detach()  # summed on the device: no wait until the step's metrics are read
        for k in ("kl", "clip_low", "clip_high"):
            sums[k] += m[k] * m["tokens"]
        sums["entropy"] += (entropy.detach() * mb_mask).sum()
        sums["tokens"] += m["tokens"]
    return sums


def every_token(run, batch, inputs, minis, entropies):
    """Which tokens' policy terms count in each micro-batch: every one (grpo_loss's keep=None). `run.select_tokens`
    may keep fewer (features/token_selection.py: TRL's entropy and off-policy masks)."""
    return lambda j, i, mb, logp, entropy: None


def optimizer_step(run, opt_step, step_loss):
    """The run's optimizer step number `opt_step` (0-based) after a mini-batch's backward: the gradient clipped, the
    learning rate set, the step taken unless the loss or the gradient is not finite (then skipped and counted, on
    every rank alike: the loss summed over ranks), and the gradients zeroed. Returns (gradient norm, learning rate,
    whether the step was taken). Float16's loss scale wraps it (features/schedules.py)."""
    cfg, d, policy = run.cfg, run.d, run.policy
    grad_norm = sharding.full_tensor(torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm))
    loss_sum = sharding.all_reduce_sum([torch.as_tensor(step_loss, dtype=torch.float32).item()], d)[0]
    lr = set_hyperparameters(run.optimizer, cfg, opt_step)
    done = math.isfinite(grad_norm.item()) and math.isfinite(loss_sum)
    if done:
        run.optimizer.step()
    run.bad_steps = 0 if done else run.bad_steps + 1
    run.optimizer.zero_grad(set_to_none=True)
    return grad_norm, lr, done


class PeakMemory:
    """On a GPU, the most memory this rank's allocator held while sampling (the whole draw: `run.draw` wrapped) and
    while training (from the draw's end to the step's metrics: the update), in GiB: what `--plan` predicts for the
    phases, per GPU (this rank's). train.setup applies it after the features, around their draw."""

    def __init__(self, run):
        self.draw, self.device, self.generation = run.draw, run.d.device, None
        run.draw = self.measured_draw
        run.step_metrics.insert(0, self.metrics)  # read first, right after the update

    def peak(self):
        """The GPU memory allocated at most since the last call, in GiB; starts the next count."""
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak

    def measured_draw(self, run, step):
        self.peak()
        out = self.draw(run, step)
        self.generation = self.peak()
        return out

    def metrics(self, run, batch, step, so_far):
        return {"memory/generation_gib": self.generation, "memory/training_gib": self.peak()}


def train_step(run, step):
    """One GRPO step. Returns its metrics, reduced over all ranks, and what tables and prints show of the batch:
    (this rank's batch, its total rewards, every rank's reward parts, this rank's advantages).

    The features a run applies (features/apply.py) plug in at the run's seams, never here: `run.draw` and
    `run.rollout` (the batch), `run.reference`, `run.forward`, `run.forward_extras` and `run.micro_batches` (the
    update's forwards), `run.step_metrics` (each feature's own metrics)."""
    d = run.d
    t0 = time.time()
    # 1. sample G completions per prompt and 2. score them: (n,)
    batch, total, parts, reward_time, drawn = run.draw(run, step)
    t_gen = time.time() - t0 - reward_time["reward_time"]
    all_total = sharding.all_gather_rows(total, d)                   # (N,): every group whole on every rank
    all_parts = {k: sharding.all_gather_rows(v, d) for k, v in parts.items()}
    try:
        all_adv, group_std = advantages(run, all_total, all_parts)   # 3. advantages within groups
    except ValueError as e:  # rewards too large to normalise (the same on every rank)
        raise SystemExit(f"step {step}: {e}") from e
    t1 = time.time()
    sums, grad_norm, lr, skipped = update(run, batch, all_adv[batch.mine].to(d.device), step)  # 4.
    if skipped:
        say_skipped(run, step, skipped, grad_norm)
    # float64: the mismatch's sums are float64 (a float32 value is carried exactly)
    local = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=d.device) for v in sums.values()]).tolist()
    t_update = time.time() - t1  # .tolist() waited for the device
    metrics = {"step": step, **run_log.step_metrics(run, batch, dict(zip(sums, local)), all_total, parts, all_adv,
                                                    group_std),
               "grad_norm": grad_norm.item(), "lr": lr, "skipped_steps": skipped, **drawn}
    step_time = time.time() - t0
    rollout = batch.rollout
    if rollout.held_steps is not None and int(rollout.held_steps.sum()):  # this rank's decode places at work
        metrics["slots_busy"] = (rollout.policy_mask.sum() / rollout.held_steps.sum()).item()
    metrics.update(step_time=step_time, generation_time=t_gen, update_time=t_update, **reward_time,
                   tokens_per_s=metrics["batch_tokens"] / step_time)
    for contribute in run.step_metrics:  # each feature's own (features/apply.py)
        metrics.update(contribute(run, batch, step, metrics))
    return metrics, (batch, total, parts, all_adv[batch.mine])  # this rank's rows, for Logger.show_completions


def say_skipped(run, step, skipped, grad_norm):
    """The step's skipped optimizer steps, on rank 0: float16 overflows (the scale halved) apart from the others."""
    overflowed = run.loss_scale.unreported() if run.loss_scale is not None else 0
    if overflowed and run.d.master:
        print(f"step {step}: {overflowed} optimizer step(s) skipped for a float16 overflow; the loss scale is now "
              f"{run.loss_scale.scale:g}", flush=True)
    if skipped > overflowed and run.d.master:
        print(f"step {step}: {skipped - overflowed} optimizer step(s) skipped, the loss or gradient norm was not "
              f"finite (last grad_norm {grad_norm.item():.3g}); a skipped step leaves the weights as they were",
              flush=True)


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
    d = sharding.setup(cfg.device, cfg.mixed_precision, replicas=mesh_replicas(cfg))
    try:
        validate(cfg, d.world_size)
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


def mesh_replicas(cfg):
    """The copies of the model the processes hold (HSDP; sharding.setup): --replicas, else with several nodes one
    per node where the plan says a node's processes hold the model's shards (runs/plan.py), else 1 (flat)."""
    nodes, local = sharding.nodes_and_local()
    if cfg.replicas or nodes == 1 or cfg.plan:
        return cfg.replicas or 1
    from runs import plan
    return plan.node_replicas(cfg, nodes * local, local)


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
