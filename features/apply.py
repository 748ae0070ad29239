"""The optional features a run applies, in one place and in order (`apply`), as torchtitan's `parallelize` applies
parallelism to a model. The features themselves, one file each, are listed in features/__init__.py.
"""

from runs import log as run_log
from features import (code_execution, dynamic_sampling, images, lora_reference, routing_replay, sampler_options,
                      schedules, sequence_parallel, shared_prompts, streaming, token_selection)


def apply(run, core):
    """Apply the run's features to its seams, in order; `core` is the module of the core step (train.py), whose
    functions a feature wraps or calls (passed, not imported: `python train.py` runs it as __main__)."""
    cfg = run.cfg
    if cfg.lora_rank and cfg.beta > 0:
        lora_reference.apply(run)
    if cfg.cp_size > 1:  # the training forward's variants, innermost first (run.forward)
        sequence_parallel.apply(run)
    if run.images is not None:
        images.apply(run)
    if cfg.routing_replay:
        routing_replay.apply(run)
    if cfg.shared_prompts:
        shared_prompts.apply(run)
    if sampler_options.asked(cfg, run.d, run.agent, run.images) or cfg.routing_replay:  # before streaming's rollout
        sampler_options.apply(run, core)
    if cfg.rollouts_in_flight or cfg.max_staleness:
        streaming.apply(run, core)
    if run.reward_model is not None:  # around every way of scoring (streaming's too)
        run.rewards = core.freeing_reward_model(run.rewards)
    if cfg.dynamic_sampling:
        dynamic_sampling.apply(run, core)
    if run.agent is not None:  # tools or an environment: their calls and turns (the sampler answers the turns)
        run.step_metrics.append(run_log.tool_metrics)
    if code_execution.may_run_programs(run):  # after the draw's features: it wraps the whole draw
        code_execution.apply(run)
    if cfg.top_entropy_quantile < 1 or cfg.off_policy_mask_threshold is not None:
        token_selection.apply(run, core)
    schedules.apply(run, core)
