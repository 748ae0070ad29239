"""Routing replay in the training forward: each MoE layer routes each token as the sampler did.

The rows' extra `routing` (N, S, layers, k): with routing replay (layers/routing.py), the experts each token went
to in each MoE layer as the sampler chose them, laid out with the rows (`rows.move`: moved with each row's padding,
or packed with shared prompts, -1 at padding, which routes live); the forward then routes as the sampler did.
"""

from layers import routing as routing_replay


class Forward:
    """The training forward around `inner` (logprobs.Forward or a variant of it), replaying the rows' recorded
    experts (`extras["routing"]`); a forward without records has the routers choose live again."""

    def __init__(self, inner):
        self.inner = inner

    def layout(self, model, input_ids, attention_mask, t, width, extras):
        return self.inner.layout(model, input_ids, attention_mask, t, width, extras)

    def written_out(self, model):
        return self.inner.written_out(model)

    def hidden(self, model, rows, extras):
        routing = (extras or {}).get("routing")
        if routing is not None:  # kept set after the forward: activation checkpointing recomputes in backward
            routing_replay.of(model).replay(rows.move(routing), rows.real)
        elif routing_replay.attached(model) is not None:  # a forward without: the routers choose live again
            routing_replay.attached(model).stop()
        return self.inner.hidden(model, rows, extras)
