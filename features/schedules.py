"""What moves on a schedule of its own during a run, around the update's optimizer steps (train.update): float16's
loss scale (a wrapper of `run.backward` and `run.optimizer_step`), adaptive entropy's coefficient (`run.objective`
and a hook after each optimizer step) and the reference's syncs toward the policy (--sync_ref_model: a hook after
each optimizer step); and what the dashboard shows of them.
"""

import dataclasses
import math

import torch

import grpo
import sharding


def apply(run, core):
    cfg = run.cfg
    if run.loss_scale is not None:  # the scale now, and the step's overflows (sharding.LossScale)
        run.backward = lambda loss: (loss * run.loss_scale.scale).backward()  # the scale the run holds now
        inner = run.optimizer_step
        run.optimizer_step = lambda run, opt_step, step_loss: scaled_optimizer_step(inner, run, opt_step, step_loss)
        run.step_metrics.append(lambda run, batch, step, so_far: run.loss_scale.step_metrics())
    if cfg.use_adaptive_entropy:
        run.objective, run.entropy_grad = adaptive_objective, True  # the bonus may be on at any optimizer step
        run.after_optimizer_step.append(control_entropy)
        run.step_metrics.append(lambda run, batch, step, so_far: {"entropy_coef": run.entropy_coef})
    if cfg.sync_ref_model:  # the reference's syncs so far in the run
        run.after_optimizer_step.append(sync_reference)
        run.step_metrics.append(lambda run, batch, step, so_far:
                                {"ref_syncs": core.optimizer_steps(cfg, step) // cfg.ref_model_sync_steps})


def scaled_optimizer_step(inner, run, opt_step, step_loss):
    """`inner` (train.optimizer_step) under float16's dynamic loss scale (sharding.LossScale): backward scaled the
    loss up (`run.backward`), so the gradients are divided back first. A skipped step whose loss was finite, while
    the scale is above 1, is an overflow: the scale is halved and the step is not a bad step; at a scale of 1 or
    less the scale cannot be to blame, and it is one. A step taken counts toward the scale's doubling."""
    run.loss_scale.unscale(run.policy.parameters())
    bad_steps = run.bad_steps
    grad_norm, lr, done = inner(run, opt_step, step_loss)
    # the loss summed over ranks, as `inner` took it: every rank skipped alike, so every rank is here
    overflow = not done and run.loss_scale.scale > 1 and math.isfinite(
        sharding.all_reduce_sum([torch.as_tensor(step_loss, dtype=torch.float32).item()], run.d)[0])
    if overflow:
        run.bad_steps = bad_steps
    if done or overflow:
        run.loss_scale.update(done)
    return grad_norm, lr, done


def adaptive_objective(run):
    """The loss's settings for the next optimizer step with use_adaptive_entropy (`run.objective`): the entropy
    bonus's coefficient is the controlled one where the last step's mean entropy was at or below entropy_target,
    else 0."""
    cfg = run.cfg
    coef = run.entropy_coef if run.last_entropy is not None and run.last_entropy <= cfg.entropy_target else 0.0
    return dataclasses.replace(grpo.Objective.of(cfg), entropy_coef=coef)


def control_entropy(run, opt_step, entropy, tokens):
    """Adaptive entropy control (Skywork-OR1; TRL's use_adaptive_entropy), after each optimizer step, from its
    mean entropy over every rank's counted tokens (`entropy`: this rank's sum; `tokens`: every rank's count): the
    coefficient goes up by entropy_coef_delta while the mean entropy is at or below entropy_target, else down,
    within [entropy_coef_min, entropy_coef_max]; the entropy is kept for `adaptive_objective`."""
    cfg = run.cfg
    entropy = sharding.all_reduce_sum([float(entropy)], run.d)[0] / tokens.item()
    step = cfg.entropy_coef_delta if entropy <= cfg.entropy_target else -cfg.entropy_coef_delta
    run.entropy_coef = min(max(run.entropy_coef + step, cfg.entropy_coef_min), cfg.entropy_coef_max)
    run.last_entropy = entropy


def sync_reference(run, opt_step, entropy, tokens):
    """TR-DPO (--sync_ref_model): every ref_model_sync_steps optimizer steps, the reference mixed toward the policy.
    Counted as TRL counts its global_step (a skipped step too), a function of the step alone, so a resumed run
    syncs where an uninterrupted one does; the step's reference log-probs were taken before (as TRL takes them
    when it generates)."""
    cfg = run.cfg
    if (opt_step + 1) % cfg.ref_model_sync_steps == 0:
        sharding.mix_weights(run.ref, run.policy, cfg.ref_model_mixup_alpha)
