"""Mixture-of-Experts blocks written out for the fast decoder (engine.StaticDecoder).

A MoE block is a router (a linear layer whose top-k picks each token's experts
and their gates) and the experts, which transformers 5 keeps as fused 3-D
parameters, (experts, out, in) or (experts, in, out), in `mlp.experts`. The
decoder copies the dense weights it fuses, but never the experts: for a
30B-A3B model a copy would be tens of gigabytes per rank. `MoE` reads them in
place, at every step, so they are always the model's current weights.

How the experts run. Each token's k (token, expert) pairs are sorted by expert
and one grouped matmul (`torch.nn.functional.grouped_mm`: each expert's rows
times that expert's weight, group boundaries given as a tensor of offsets)
computes every pair at once, for gate/up and again for down. Measured on CPU
at decode shapes (16 tokens, top-2 of 8 experts, hidden 256; and top-8 of 128,
hidden 1024), it beat the alternatives that read the weights in place: the
per-expert loop the models' eager forward runs (it needs the hit experts on
the host: a sync per layer, and one small matmul per expert), gathering each
pair's expert matrix and a batched matmul (a copy of k expert matrices per
token: several times slower), and running every expert on every token (E / k
times the arithmetic). It needs no host value, so a CUDA graph can capture it.
Where grouped_mm cannot take the weights (some dtypes and strides on some
devices; a probe at start finds out), the gather and batched matmul stand in.

LoRA on the experts (lora.LoRAExperts, a parametrization whose read
returns W + scaling * B A over every expert): the decoder reads the frozen W
in place and adds the low-rank term for the chosen experts only,
scaling * (x A_e^T) B_e^T, instead of merging all E experts at every step.
Any other parametrization is read through the attribute (merged), as the
model's own forward reads it.

Tensor parallelism (layers/tensor_parallel.py): with a group of T > 1 ranks,
`MoE` holds its own copy of this rank's share instead, cut from the block
when built and refreshed by `MoE.load`: every expert's intermediate dimension
(and the shared expert's) split 1/T, the router replicated, so that every rank
routes alike and returns a partial sum of the block's output for the caller to
all-reduce. LoRA on the experts is merged into that copy when it is loaded. A
block sharded by FSDP2 is never gathered: each rank's share is cut from the
shards (`Slice.take`), the adapters merged into the share from the matching
cut of their factors.

Routing replay (layers/routing.py) records the experts chosen here: `MoE.__call__`
returns them, `block` hands them to the decoder's recorder, and the decoder keeps them per cache slot.
Of the project it imports lora (what an adapted linear layer is) and shards (what a shard is).
"""

import torch
import torch.nn.functional as F
from torch.nn.utils import parametrize

from layers import lora
from layers.shards import is_shard


def _qwen_router(router):
    """Qwen3-MoE (and Qwen2-MoE) routing: softmax over all experts in float32, top-k, renormalised when
    norm_topk_prob, rounded to the logits' dtype."""
    def route(h, weight, bias):
        logits = F.linear(h, weight, bias)
        probs = torch.softmax(logits, -1, dtype=torch.float)
        top, idx = torch.topk(probs, router.top_k, dim=-1)
        if router.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        return top.to(logits.dtype), idx
    return route


def _gpt_oss_router(router):
    """gpt-oss routing: top-k of the biased logits, then a softmax over the k chosen."""
    def route(h, weight, bias):
        top, idx = torch.topk(F.linear(h, weight, bias), router.top_k, dim=-1)
        return torch.softmax(top, dim=1, dtype=top.dtype), idx
    return route


def _silu_halves(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _gpt_oss_gate(experts):
    """gpt-oss's clamped SwiGLU: gate and up interleaved, gate clamped above, up on both sides, sigmoid of
    alpha * gate, and 1 added to up."""
    alpha, limit = experts.alpha, experts.limit

    def gate_fn(gate_up):
        gate, up = gate_up[..., ::2].clamp(max=limit), gate_up[..., 1::2].clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return gate_fn


# the MoE block's class name -> (router attribute, router function, expert layout, the experts' gate function).
# layout "out_in": (E, out, in), read F.linear(x, W[e]); "in_out": (E, in, out), read x @ W[e]
BLOCKS = {
    "Qwen3MoeSparseMoeBlock": ("gate", _qwen_router, "out_in", None),
    "Qwen2MoeSparseMoeBlock": ("gate", _qwen_router, "out_in", None),  # and a shared expert (below)
    "GptOssMLP": ("router", _gpt_oss_router, "in_out", _gpt_oss_gate),
}


def _block_spec(mlp):
    return next((BLOCKS[c.__name__] for c in type(mlp).__mro__ if c.__name__ in BLOCKS), None)


def supported(mlp):
    """True for a MoE block this file computes as the model does: a block in `BLOCKS` whose router holds the
    settings it reads and whose experts are plain 3-D parameters (or LoRA-adapted ones)."""
    spec = _block_spec(mlp)
    if spec is None:
        return False
    router, experts = getattr(mlp, spec[0], None), mlp.experts
    if router is None or getattr(router, "weight", None) is None or not hasattr(router, "top_k"):
        return False
    if spec[1] is _qwen_router and not hasattr(router, "norm_topk_prob"):
        return False
    if spec[3] is None and type(getattr(experts, "act_fn", None)).__name__ not in ("SiLUActivation", "SiLU"):
        return False
    shared = getattr(mlp, "shared_expert", None)
    if shared is not None and not _plain_shared_expert(mlp):
        return False
    ws = [experts.gate_up_proj, experts.down_proj]
    return all(w.dim() == 3 for w in ws)


def _plain_shared_expert(mlp):
    """Qwen2-MoE's shared expert: a SiLU MLP of plain linear layers, scaled by sigmoid of a linear gate."""
    shared, gate = mlp.shared_expert, getattr(mlp, "shared_expert_gate", None)
    lins = [getattr(shared, n, None) for n in ("gate_proj", "up_proj", "down_proj")] + [gate]
    return (all(lora.linear_like(x) for x in lins) and
            type(getattr(shared, "act_fn", None)).__name__ in ("SiLUActivation", "SiLU"))


class _Weight:
    """One fused expert weight, read in place: the base (E, in, out) view for grouped_mm, and LoRA's factors when
    a LoRAExperts parametrization adapts it (its read would merge all E experts)."""

    def __init__(self, experts, name, layout):
        self.experts, self.name, self.layout = experts, name, layout
        self.lora = None
        if parametrize.is_parametrized(experts, name):
            chain = getattr(experts.parametrizations, name)
            if len(chain) == 1 and all(hasattr(chain[0], a) for a in ("lora_A", "lora_B", "scaling", "enabled")):
                self.lora = chain[0]  # the base weight is chain.original, read at each call
            else:
                self.lora = False  # another parametrization: read the attribute, merged as the model reads it

    def base(self):
        """The weight as (E, in, out), a view of the model's parameter (no copy)."""
        if self.lora is None:
            w = getattr(self.experts, self.name)
        elif self.lora is False:
            w = getattr(self.experts, self.name)
        else:
            w = getattr(self.experts.parametrizations, self.name).original
        w = w.detach()
        return w.transpose(1, 2) if self.layout == "out_in" else w

    def low_rank(self):
        """(A (E, in, r), B (E, r, out), scaling) of an enabled LoRA adapter, else None."""
        lora = self.lora
        if not lora or not lora.enabled:
            return None
        return lora.lora_A.detach().transpose(1, 2), lora.lora_B.detach().transpose(1, 2), lora.scaling


class _Held:
    """A tensor-parallel rank's copy of one fused expert weight, held in the model's layout: `base` is the same
    (E, in, out) view `_Weight` gives, so the matmuls are unchanged. Adapters are merged into it at load."""
    lora = None

    def __init__(self, tensor, layout):
        self.tensor, self.layout = tensor, layout

    def base(self):
        return self.tensor.transpose(1, 2) if self.layout == "out_in" else self.tensor

    def low_rank(self):
        return None


def _expert_slices(mlp, layout, interleaved, tp):
    """This rank's share of the experts, name -> a new tensor in the model's layout (None: a bias only rank 0
    adds). An adapted weight is read through its attribute, which merges the adapter (`_expert_share`)."""
    e, what = mlp.experts, "the MoE's intermediate size"
    w_out = 1 if layout == "out_in" else 2  # gate_up's output dimension, down's input dimension
    gu_bias, down_bias = getattr(e, "gate_up_proj_bias", None), getattr(e, "down_proj_bias", None)
    out = {"gate_up": _expert_share(e, "gate_up_proj", w_out, lambda t, d: tp.experts(t, d, interleaved, what), tp),
           "down": _expert_share(e, "down_proj", 3 - w_out, lambda t, d: tp.part(t, d, what), tp)}
    if gu_bias is not None:
        out["gate_up_bias"] = tp.experts(gu_bias.detach(), 1, interleaved, what)
    if down_bias is not None:
        out["down_bias"] = _own(tp.first(down_bias.detach()))
    return out


def _expert_share(experts, name, dim, cut, tp):
    """cut(w, dim): this rank's share of the fused expert weight `name` as the experts apply it now, w whole. A
    LoRAExperts adapter on an FSDP2 shard: the base weight cut from its shards, plus the delta of the matching cut of
    the factor on the cut's side (B (E, out, r) by its outputs, A (E, r, in) by its inputs) and the other factor
    gathered whole (r wide: small), so that no rank merges or holds the whole weight."""
    chain = getattr(experts.parametrizations, name, None) if parametrize.is_parametrized(experts, name) else None
    lo = chain[0] if chain is not None and len(chain) == 1 else None
    if lo is None or not hasattr(lo, "lora_A") or not is_shard(chain.original):
        return cut(getattr(experts, name).detach(), dim)  # merged by the attribute's read, then cut
    w = cut(chain.original.detach(), dim)
    if not lo.enabled:
        return w
    inputs = dim != (2 if lo.transposed else 1)  # its outputs' dim: 2 of (E, in, out), 1 of (E, out, in)
    # the factor cut alike: B (E, out, r) along its dim 1, A (E, r, in) along its dim 2
    return w + lora.part_delta(lo, lo.lora_A.detach(), lo.lora_B.detach(), lambda t: cut(t, 2 if inputs else 1),
                               inputs, tp.whole)


def _shared_slices(mlp, tp):
    """This rank's share of Qwen2-MoE's shared expert: gate and up fused into one (2I/T, H) weight (this rank's
    gate rows, then its up rows, as `_silu_halves` reads them), down cut by its inputs, and the shared expert's
    gate replicated (sigmoid(gate(h)) scales every rank's partial sum alike). Adapters merged (an FSDP2 shard's into
    its cut: lora.applied_part)."""
    s, g, what = mlp.shared_expert, mlp.shared_expert_gate, "the shared expert's intermediate size"

    def applied(m, dim):
        return lora.applied_share(m, lambda t: tp.part(t, dim, what), dim == 1, tp.whole)

    out = {"shared_gate_up": torch.cat([applied(m, 0) for m in (s.gate_proj, s.up_proj)]),
           "shared_down": applied(s.down_proj, 1),
           "shared_gate": _own(lora.applied_part(g, tp.whole, whole=tp.whole))}  # whole, gathered if sharded
    if s.gate_proj.bias is not None or s.up_proj.bias is not None:
        out["shared_gate_up_bias"] = torch.cat([tp.part(_bias(m, tp), 0, what) for m in (s.gate_proj, s.up_proj)])
    if s.down_proj.bias is not None:
        out["shared_down_bias"] = _own(tp.first(s.down_proj.bias.detach()))
    if g.bias is not None:
        out["shared_gate_bias"] = _own(tp.whole(g.bias.detach()))
    return out


def _bias(linear, tp):
    """A linear layer's bias, zeros where it has none (its partner in a fused pair has one; in the dtype and on the
    device of the shares cut from FSDP2's shards where the weight is one)."""
    w = linear.weight
    if linear.bias is not None:
        return linear.bias.detach()
    device, dtype = tp.to if is_shard(w) and tp.to else (w.device, w.dtype)
    return torch.zeros(w.shape[0], device=device, dtype=dtype)


def _own(t):
    return None if t is None else t.clone()


def _probe_grouped(w):
    """True when grouped_mm takes this weight (E, in, out) on its device and dtype. On CUDA only bf16: there other
    dtypes take a path that reads the offsets on the host (torch 2.11), which a CUDA graph cannot capture."""
    if w.is_cuda and w.dtype != torch.bfloat16:
        return False
    try:
        x = torch.zeros(1, w.shape[1], device=w.device, dtype=w.dtype)
        offs = torch.full((w.shape[0],), 1, device=w.device, dtype=torch.int32)
        F.grouped_mm(x, w, offs=offs)
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


class MoE:
    """A MoE block's forward over tokens h (T, H), on the model's own router and expert parameters.

    __call__ returns (the block's output (T, H), the chosen experts (T, k)). The arithmetic is the model's:
    router logits and gates as its router computes them, each chosen expert's projections, the gate function,
    each output scaled by its gate and summed into the token's row in the hidden dtype.

    tp: this rank's share of a tensor-parallel group (layers/tensor_parallel.py). None or size 1: the parameters
    are read in place. Larger: the block must be whole or FSDP2-sharded when built (never gathered: the shares are
    then cut from its shards); the MoE holds this rank's share (the router and the shared expert's gate whole, the
    expert and shared-expert intermediate dimensions cut 1/T, the down biases on rank 0 alone), __call__ returns
    this rank's partial sum of the output, and `load` refreshes the share from the block.
    """

    def __init__(self, mlp, tp=None):
        router_attr, router_fn, layout, gate_fn = _block_spec(mlp)
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.block = mlp
        self.router = getattr(mlp, router_attr)
        self.route = router_fn(self.router)
        experts = mlp.experts
        self.k = self.router.top_k
        base = experts.parametrizations.gate_up_proj.original if \
            parametrize.is_parametrized(experts, "gate_up_proj") else experts.gate_up_proj  # not merged to be measured
        self.n_experts = base.shape[0]
        self.gate_fn = _silu_halves if gate_fn is None else gate_fn(experts)
        self.layout, self.interleaved = layout, gate_fn is _gpt_oss_gate  # its gate reads gate and up interleaved
        self.experts = experts
        self.biased = getattr(experts, "gate_up_proj_bias", None) is not None
        self.shared = getattr(mlp, "shared_expert", None)  # every token's expert beside the routed ones (Qwen2-MoE)
        self.shared_gate = getattr(mlp, "shared_expert_gate", None)
        self.held = None
        if self.tp is None:
            self.gate_up, self.down = _Weight(experts, "gate_up_proj", layout), _Weight(experts, "down_proj", layout)
        else:
            self.load(mlp)
            self.gate_up, self.down = _Held(self.held["gate_up"], layout), _Held(self.held["down"], layout)
        self.grouped = _probe_grouped(self.gate_up.base()) and _probe_grouped(self.down.base())
        # the LoRA factors' shapes (rank r) may not suit grouped_mm where the base weights do (bf16 wants rows of
        # 16 bytes): probed apart
        factors = [t for w in (self.gate_up, self.down) if w.lora for t in (w.lora.lora_A, w.lora.lora_B)]
        self.grouped_lora = self.grouped and all(_probe_grouped(t.detach().transpose(1, 2)) for t in factors)
        self.expert_ids = torch.arange(self.n_experts, device=self.gate_up.base().device)

    def load(self, mlp):
        """Copy this rank's share of `mlp` (the same block, whole, or sharded: cut from its shards) into the tensors
        the MoE holds, in place (a captured CUDA graph reads them); nothing to do when it reads the block in place.
        Adapters on the experts or the shared expert are merged as they are now: load again after they change,
        or after one is switched on or off."""
        if self.tp is None:
            return
        with torch.no_grad():
            router = getattr(mlp, _block_spec(mlp)[0])
            bias = getattr(router, "bias", None)
            share = {"router": _own(self.tp.whole(router.weight.detach())),
                     "router_bias": _own(None if bias is None else self.tp.whole(bias.detach())),
                     **_expert_slices(mlp, self.layout, self.interleaved, self.tp)}
            if getattr(mlp, "shared_expert", None) is not None:
                share.update(_shared_slices(mlp, self.tp))
            if self.held is None:
                self.held = share
                return
            names = sorted(k for k, t in share.items() if t is not None)
            if names != sorted(k for k, t in self.held.items() if t is not None):
                raise ValueError(f"MoE.load: the block has {names}, not the tensors the MoE was built with")
            for name in names:
                self.held[name].copy_(share[name])

    def nbytes(self):
        """Bytes of the weights this MoE holds: this rank's share with tp, 0 when it reads the block in place."""
        return 0 if self.held is None else sum(t.nbytes for t in self.held.values() if t is not None)

    def _matmul(self, x, weight, order_expert, offs, bias):
        """Each row of x (sorted by expert) times its expert's weight, plus its expert's bias and LoRA term."""
        w = weight.base()
        if self.grouped:
            y = F.grouped_mm(x, w, offs=offs)
        else:
            y = torch.bmm(x[:, None], w[order_expert])[:, 0]
        if bias is not None:
            y = y + bias[order_expert]
        lr = weight.low_rank()
        if lr is not None:
            a, b, scaling = lr
            if self.grouped_lora:
                y = y + F.grouped_mm(F.grouped_mm(x, a, offs=offs), b, offs=offs) * scaling
            else:
                y = y + torch.bmm(torch.bmm(x[:, None], a[order_expert]), b[order_expert])[:, 0] * scaling
        return y

    def __call__(self, h):
        held = self.held
        if held is None:
            router_w, router_b = self.router.weight, getattr(self.router, "bias", None)
            e = self.experts
            gu_bias, down_bias = (e.gate_up_proj_bias, e.down_proj_bias) if self.biased else (None, None)
        else:
            router_w, router_b = held["router"], held["router_bias"]
            gu_bias, down_bias = held.get("gate_up_bias"), held.get("down_bias")
        gates, idx = self.route(h, router_w, router_b)  # (T, k) each
        # the (token, expert) pairs grouped by expert, and where each expert's group ends, found on the device
        # (no host sync: bincount on CUDA reads its input's maximum)
        order_expert, order = idx.reshape(-1).sort(stable=True)
        offs = torch.searchsorted(order_expert, self.expert_ids, right=True, out_int32=True)
        token = order // self.k
        up = self._matmul(h[token], self.gate_up, order_expert, offs, gu_bias)
        out = self._matmul(self.gate_fn(up), self.down, order_expert, offs, down_bias)
        out = out * gates.reshape(-1)[order, None]
        routed = torch.zeros_like(h).index_add_(0, token, out.to(h.dtype))
        if self.shared is not None and held is None:  # in place, as the experts: the block is whole (transformer)
            s = self.shared  # its layers' own forward: plain, or with an adapter's low-rank term
            shared = s.down_proj(F.silu(s.gate_proj(h)) * s.up_proj(h))
            routed = routed + torch.sigmoid(self.shared_gate(h)) * shared
        elif self.shared is not None:  # this rank's share, gate and up fused
            shared = F.linear(_silu_halves(F.linear(h, held["shared_gate_up"], held.get("shared_gate_up_bias"))),
                              held["shared_down"], held.get("shared_down_bias"))
            routed = routed + torch.sigmoid(F.linear(h, held["shared_gate"], held.get("shared_gate_bias"))) * shared
        return routed, idx


def block(h, p, record=None):
    """A MoE block in place of a decoder layer's MLP (transformer.layer's `p.mlp`, put in by
    transformer.layer_params): the output of the layer's MoE (`p.moe`) for the normed h (*lead, H), and routing
    replay's `record(p, experts)` (the decoder's, None when it does not record) given the experts it chose."""
    m, experts = p.moe(h.reshape(-1, h.shape[-1]))  # tokens (T, H)
    if record is not None:
        record(p, experts)
    return m.view(h.shape)
