"""Routing replay in training (--routing_replay; R3, Ma et al. 2025): each token of a mixture-of-experts policy goes,
in every training forward, to the experts the sampler chose for it (layers/routing.py replays them in the routers).

Applied by features/apply.py: the sampler records the experts (`run.sample_options`), every forward of the update
takes its micro-batch's records (`run.forward_extras`), the reference's forwards count their disagreement as their
own (`run.reference` wrapped), and the step reports how often the live routers would have chosen otherwise.
"""

import torch

import logprobs
import sharding
from layers import routing


def apply(run):
    run.sample_options["record_routing"] = True
    run.forward = Forward(run.forward)
    run.forward_extras.append(extras)
    if run.reference is not None:
        run.reference = CountedReference(run, run.reference)
    run.step_metrics.append(metrics)


def extras(run, batch):
    """The micro-batch's experts per token, (m, S + T, layers, k): the prompt's and the completion's records
    (`Forward` below replays them)."""
    rollout = batch.rollout
    if rollout.routing is None:
        return lambda mb: {}
    route = torch.cat([rollout.prompt_routing, rollout.routing], dim=1)
    return lambda mb: {"routing": mb.take(route)[0]}


class CountedReference:
    """The reference's forward (`inner`, as train.reference_logprobs calls it), its routers' disagreement with the
    replayed experts added to `run.ref_routing`. A separate reference model counts on its own routers; with LoRA
    the reference is the policy's forward with its adapters off, whose count is kept apart from the policy's."""

    def __init__(self, run, inner):
        self.run, self.inner = run, inner

    def __call__(self, fn, *args, **kwargs):
        run = self.run
        if (kwargs.get("extras") or {}).get("routing") is None:
            return self.inner(fn, *args, **kwargs)
        if run.ref is None:  # the policy itself (LoRA): its own tally goes on as if this forward had not run
            with routing.of(run.policy.lm).apart() as counted:
                out = self.inner(fn, *args, **kwargs)
        else:
            out = self.inner(fn, *args, **kwargs)
            counted = routing.of(run.ref.lm).counts()
        run.ref_routing = [a + b for a, b in zip(run.ref_routing, counted)]
        return out


def metrics(run, batch, step, so_far):
    """Of the policy's replayed (token, layer) routing decisions, the share its live routers would change; with a
    reference, the same of the reference's (how far its routers are from the experts the policy sampled)."""
    differ, decisions = sharding.all_reduce_sum(list(routing.of(run.policy.lm).counts()), run.d)
    out = {"routing_replay_differ": differ / max(1.0, decisions)}
    if run.cfg.beta > 0:
        differ, decisions = sharding.all_reduce_sum(run.ref_routing, run.d)
        out["routing_replay_differ_ref"] = differ / max(1.0, decisions)
        run.ref_routing = [0.0, 0.0]
    return out


class Forward(logprobs.Around):
    """The training forward (routing replay's variant, `run.forward`) around `inner` (logprobs.Forward or a variant
    of it), replaying the rows' recorded experts (`extras["routing"]`); a forward without records has the routers
    choose live again."""

    def hidden(self, model, rows, extras):
        records = (extras or {}).get("routing")
        if records is not None:  # kept set after the forward: activation checkpointing recomputes in backward
            routing.of(model).replay(rows.move(records), rows.real)
        elif routing.attached(model) is not None:  # a forward without: the routers choose live again
            routing.attached(model).stop()
        return self.inner.hidden(model, rows, extras)
