"""Programs run in the sandbox during a step (the code task's reward, the python tool, a reward function of one's
own that runs code): their metrics.

Applied by features/apply.py to a run that may run programs: it wraps the run's draw (the rollout and its
scoring, where programs run) to take the sandbox's counts of that draw alone (an evaluation's are not the step's),
and reports them with the step's metrics.
"""

import sharding
from sandbox import executor


def may_run_programs(run):
    """Whether the step's draw may run model-written code: the code task, tools or an environment, reward functions
    of one's own, or a sandbox asked for."""
    cfg = run.cfg
    return cfg.task == "code" or run.agent is not None or bool(cfg.reward_funcs) or cfg.sandbox == "strict"


def apply(run):
    inner = run.draw

    def draw(run, step):
        executor.take_stats()  # what ran before (an evaluation's programs) is not this step's
        out = inner(run, step)
        run.exec_stats = executor.take_stats()
        return out
    run.draw = draw
    run.step_metrics.append(metrics)


def metrics(run, batch, step, so_far):
    """Programs run during the step's draw, over all ranks: how many, how many timed out or could not run, the
    seconds the step waited on them (mean over ranks) and a program's mean wall time; nothing when none ran."""
    stats, d = run.exec_stats, run.d
    keys = ("programs", "timeouts", "sandbox_failures", "program_seconds", "wait_seconds")
    total = dict(zip(keys, sharding.all_reduce_sum([float(stats[k]) for k in keys], d)))
    if not total["programs"]:
        return {}
    return {"exec_programs": total["programs"], "exec_timeouts": total["timeouts"],
            "exec_sandbox_failures": total["sandbox_failures"], "exec_time": total["wait_seconds"] / d.world_size,
            "exec_program_time": total["program_seconds"] / total["programs"]}
