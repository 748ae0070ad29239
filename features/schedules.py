"""The metrics of what moves on a schedule of its own during a run: float16's loss scale, adaptive entropy's
coefficient, and the reference's syncs toward the policy (--sync_ref_model). Their arithmetic is the update's
(train.optimizer_step, train.control_entropy); what the dashboard shows of them is added here.
"""


def apply(run, core):
    cfg = run.cfg
    if run.loss_scale is not None:  # the scale now, and the step's overflows (sharding.LossScale)
        run.step_metrics.append(lambda run, batch, step, so_far: run.loss_scale.step_metrics())
    if cfg.use_adaptive_entropy:
        run.step_metrics.append(lambda run, batch, step, so_far: {"entropy_coef": run.entropy_coef})
    if cfg.sync_ref_model:  # the reference's syncs so far in the run
        run.step_metrics.append(lambda run, batch, step, so_far:
                                {"ref_syncs": core.optimizer_steps(cfg, step) // cfg.ref_model_sync_steps})
