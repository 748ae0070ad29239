"""Routing replay for Mixture-of-Experts models: train the experts the sampler chose.

A MoE layer's router picks each token's top-k experts. The sampler and the
training forward compute the router's logits in different batches, kernels and
(under FSDP) precisions, so near-ties resolve differently: a token trained
through other experts than those that sampled it has a log-prob from another
function, which inflates the importance ratio and, in long runs, destabilises
training (Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning
Training and Inference Routers": rollout routing replay, R3; verl, slime and
Megatron offer it). With replay on, the sampler records every token's experts
in every MoE layer, and the training forwards use them, with the gates
recomputed from the live router (so the router still gets its gradient).

How: a router module is the one that calls `torch.topk` to choose experts
(Qwen3-MoE's softmax-then-top-k, gpt-oss's top-k-then-softmax, and the
others transformers writes the same way). While a router runs, a
TorchFunctionMode sees that call: when recording it keeps the indices; when
replaying it returns the recorded indices and the router's own scores
gathered at them, in place of the live top-k. Whatever the router does with
them next (renormalise, softmax over the chosen) is its own code.

The fast decoder (layers/engine.py) runs its MoE layers itself, so it records without the routers: its MoE blocks
hand their experts to the step's `record`, and `Records` keeps them per batch row and cache slot.
Of the project it imports nothing.
"""

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_TOPK = (torch.topk, torch.Tensor.topk)


def routers(model):
    """The model's expert routers in layer order: the modules whose class is named *Router* and holds a weight."""
    return [m for m in model.modules() if "router" in type(m).__name__.lower() and getattr(m, "weight", None) is not None]


class _TopK(TorchFunctionMode):
    """Inside one router call: records the top-k indices, or hands back `replay`'s instead."""

    def __init__(self, replay=None):
        super().__init__()
        self.replay, self.live = replay, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func not in _TOPK:
            return out
        self.live.append(out.indices)
        if self.replay is None or len(self.live) > 1:
            return out
        scores = args[0] if args else kwargs["input"]
        rep = self.replay.to(device=scores.device, dtype=out.indices.dtype)
        idx = torch.where(rep >= 0, rep, out.indices)  # -1: a token nothing was recorded for routes live
        return torch.return_types.topk((scores.gather(-1, idx), idx))


class Replay:
    """The routing state of one model: which experts its routers record or replay, and how often they differ.

    `record()`: every router call appends its indices (tokens, k). `replay(indices, real)`: each router call
    takes its layer's experts from indices (N, S, layers, k) for the N x S tokens of the forward (-1: its live
    choice), and counts
    the real tokens (real (N, S) bool) whose live choice would have been another set of experts. The replayed
    choice stays set until the next `replay`, so a layer recomputed in backward (activation checkpointing)
    routes as it did in the forward.
    """

    def __init__(self, model):
        self.routers = routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no expert router to record")
        self.k = None
        self.mode, self.records, self.current, self.real = None, None, None, None
        self.replayed = None  # (indices (N, S, layers, k), real (N, S)) as `replay` was given them
        self.differ = self.decisions = 0  # (token, layer) routing decisions replayed, and those the live router changed
        for layer, router in enumerate(self.routers):
            router.forward = self._wrapped(router.forward, layer)

    def _wrapped(self, forward, layer):
        def routed(*args, **kwargs):
            if self.mode is None:
                return forward(*args, **kwargs)
            replay = self.current[layer] if self.mode == "replay" else None
            with _TopK(replay) as topk:
                out = forward(*args, **kwargs)
            if len(topk.live) != 1:
                raise ValueError(f"routing replay: {type(self.routers[layer]).__name__} chooses experts in "
                                 f"{len(topk.live)} top-k calls; only routers with one can be replayed")
            live = topk.live[0]
            if self.mode == "record":
                self.records[layer].append(live.to(torch.int16))
            elif not self.counted[layer]:  # once per replay: not again where backward recomputes the layer
                self.counted[layer] = True
                replay = replay.to(live)
                same = (live.sort(-1).values == replay.sort(-1).values).all(-1)  # (tokens,)
                real = self.real.reshape(-1).to(same.device) & (replay >= 0).all(-1)
                self.decisions += int(real.sum())
                self.differ += int((~same & real).sum())
            return out
        return routed

    def record(self):
        """Start recording: from now each router call's indices are kept (`take` returns them)."""
        self.mode, self.records = "record", [[] for _ in self.routers]

    def take(self, shape):
        """The indices recorded since the last take, (N, K, layers, k) for a forward of N x K tokens."""
        out = torch.stack([r.pop(0).view(*shape, -1) for r in self.records], dim=2)
        self.k = out.shape[-1]
        return out

    def replay(self, indices, real):
        """From now each router call routes its tokens to indices[:, :, layer] (N, S, layers, k)."""
        self.mode, self.replayed = "replay", (indices, real)
        self.current = [indices[:, :, layer].reshape(-1, indices.shape[-1]) for layer in range(len(self.routers))]
        self.real, self.counted = real, [False] * len(self.routers)

    def stop(self):
        self.mode, self.records, self.current = None, None, None

    def counts(self):
        """(decisions the live router would have made otherwise, decisions replayed) since the last call."""
        out = (float(self.differ), float(self.decisions))
        self.differ = self.decisions = 0
        return out

    @contextlib.contextmanager
    def apart(self):
        """Counts made inside the block are not this model's own: they go to the list it yields, as
        (differ, decisions), and the model's tally goes on as if the block had not run. (With LoRA the reference
        is the same model with its adapters off: its forward replays the sampled experts through these routers,
        and its disagreement is the reference's, not the policy's.)"""
        kept, said = (self.differ, self.decisions), []
        self.differ = self.decisions = 0
        try:
            yield said
        finally:
            said.extend(self.counts())
            self.differ, self.decisions = kept


def of(model):
    """The model's Replay, made on first use (it wraps the routers' forwards once)."""
    state = model.__dict__.get("_routing_replay")
    if state is None:
        state = model.__dict__["_routing_replay"] = Replay(model)
    return state


def attached(model):
    """The model's Replay if routing replay was set up on it, else None."""
    return model.__dict__.get("_routing_replay")


class Records:
    """Routing replay on the fast decoder (layers/engine.py's StaticDecoder.record): the experts every MoE layer chose
    for each token, by row and cache slot (a slot written again, after a row forgot it, keeps the last token's), -1
    where none was recorded. `routes` (rows, slots, MoE layers, k) int16. A MoE block hands its experts to the
    `record(p, experts)` of the step it runs in (layers/static_moe.py's `block`), which writes them at the slots that
    step fills, in the layer's row `p.moe_row`. It holds no decoder: the decoder holds it (`dec.recorder`)."""

    def __init__(self, rows, slots, layers, k, device):
        self.routes = torch.full((rows, slots, layers, k), -1, dtype=torch.int16, device=device)

    def prefill(self, n, p):
        """The record of a prefill of rows [0, n) into slots [0, p): experts (n * p, k)."""
        return lambda lp, experts: self.routes[:n, :p, lp.moe_row].copy_(experts.view(n, p, -1))

    def decode(self, at, slot):
        """The record of a decode step of the rows `at` (a slice, or a tensor), each at its slot (an int, or a tensor
        of one per row): experts (b, k), each row's at its slot."""
        def record(p, experts):
            self.routes[at, slot, p.moe_row] = experts.to(self.routes.dtype)
        return record

    def extend(self, cache_rows, real_slots, real_rows, real_cols, shape):
        """The record of an extend's blocks of `shape` (b, K), of which only the real tokens (real_rows, real_cols)
        are kept, at their cache rows and slots."""
        return lambda p, experts: self.routes.__setitem__(
            (cache_rows, real_slots, p.moe_row), experts.view(*shape, -1)[real_rows, real_cols].to(self.routes.dtype))

    def routed(self, fed, rows, prompt_width, length):
        """The experts recorded for the prompt slots (m, P, MoE layers, k) and for the completion's slots P .. P +
        length - 1 of the batch rows `rows`; -1 where `fed` (m, length), which says which of those slots hold a
        token of the row, is False."""
        comp = self.routes[rows, prompt_width:prompt_width + length]
        return self.routes[rows, :prompt_width], comp.masked_fill(~fed[:, :, None, None], -1)
