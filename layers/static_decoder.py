"""Decoder layers written out: the fast decoder behind `sampling.sample`, and the training forward.

One concern in one file (past 650 lines on purpose): the family table and the three places a layer is
written out (the training forward, prefill, decode) must change together; the MoE blocks and the recurrent
layers, which stand alone, are layers/static_moe.py and layers/static_recurrent.py.

`sampling.sample` asks `static_decode_supported(model)` and, when it holds,
decodes with `StaticDecoder`: its own fused copy of the weights, a cache
allocated once, CUDA graphs on GPU. `logprobs.completion_logprobs` asks
`training_forward_supported(model)` and, when it holds, runs
`hidden_states`: the same layers on the model's own parameters, with
autograd. Both compute what the Hugging Face forward computes (the tests
compare them); other models take that forward.

One decoder serves every family in `FAMILIES`: a family is a `Family` row
saying where its layer departs from Llama's (which norms sit where, q/k
norms, how a norm scales, what the embedding and the rotary look like), not
a copy of the layer. Sliding-window layers attend to the keys whose token
position lies less than the window before the query's. MoE blocks
(layers/static_moe.py) read the model's experts in place instead of copying them;
Gated DeltaNet layers (layers/static_recurrent.py) keep states per row instead of
cache slots. Families with either, or with sinks, a gated query or partial
rotary, are written out in the sampler only: `training_forward_supported`
leaves their training to the model's own forward.

Of the project it imports layers/kernels.py (the optional Triton decode attention), layers/lora.py (what an adapted
projection applies), layers/static_moe.py and layers/static_recurrent.py.
"""

import dataclasses
import functools
import types

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from layers import kernels
from layers import lora
from layers import static_moe
from layers import static_recurrent


@dataclasses.dataclass(frozen=True)
class Family:
    """How a family's decoder layer departs from Llama's (the defaults).

    norms: the layer's RMSNorm attributes around attention (its input, its output) and around the MLP (its
    input, its output); None where the family has none. Llama normalises inputs, OLMo 2 outputs, Gemma 3 both.
    """
    norms: tuple = ("input_layernorm", None, "post_attention_layernorm", None)
    qk_norm: str = None            # "head": an RMSNorm over each head of q and of k (Qwen3, Gemma 3);
                                   # "projection": over all of q and all of k, before the split into heads (OLMo 2)
    unit_offset: bool = False      # the norms scale by 1 + weight (Gemma)
    upcast: bool = False           # the norms multiply by their weight in float32 and round once (OLMo 2, Gemma)
    embedding: str = "Embedding"   # the embedding module's class: Gemma's scales by its `embed_scale`
    rotary_per_type: bool = False  # one rotary table per layer type (Gemma 3: another base for sliding layers)
    rope_flag: str = None          # the attention attribute that is false on layers without rotary (SmolLM3)
    window_from_config: bool = False  # every layer windowed by config.sliding_window (Mistral); otherwise the
                                      # attention module's `sliding_window`, where it has one
    sinks: bool = False            # a learned logit per head in each softmax's denominator (gpt-oss's `sinks`)
    half_tables: bool = False      # the rotary module gives cos/sin over half a head, which rotates the halves
                                   # (x1 cos - x2 sin, x2 cos + x1 sin): the tables duplicated (gpt-oss)
    partial_rotary: bool = False   # rotary over the first dims of each head only (the tables' width), the rest
                                   # passed through (Qwen3.5)
    gated_query: bool = False      # q_proj gives each head's query and then a gate: the attention's output is
                                   # multiplied by sigmoid(gate) before o_proj (Qwen3.5)
    refuse: tuple = ()             # config fields this decoder does not implement: the model must leave them unset


_LLAMA = Family()
_OLMO2 = Family(norms=(None, "post_attention_layernorm", None, "post_feedforward_layernorm"), qk_norm="projection",
                upcast=True)
_GEMMA_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")
# the decoder layer's class name -> its family
FAMILIES = {
    "LlamaDecoderLayer": _LLAMA,
    "Qwen2DecoderLayer": _LLAMA,
    "Qwen3DecoderLayer": Family(qk_norm="head"),
    "Qwen3MoeDecoderLayer": Family(qk_norm="head"),  # Qwen3's attention; MoE blocks from layers/static_moe.py
    "Qwen2MoeDecoderLayer": _LLAMA,  # Qwen2's attention; MoE blocks with a shared expert from layers/static_moe.py
    "MistralDecoderLayer": Family(window_from_config=True),
    "SmolLM3DecoderLayer": Family(rope_flag="use_rope"),
    "Olmo2DecoderLayer": _OLMO2,
    "Olmo3DecoderLayer": dataclasses.replace(_OLMO2, rotary_per_type=True),  # and sliding windows
    # biased q/k/v/o (every family may have them), alternating windows, sinks, MoE blocks from layers/static_moe.py
    "GptOssDecoderLayer": Family(upcast=True, sinks=True, half_tables=True),
    # gated attention with partial rotary beside Gated DeltaNet layers (layers/static_recurrent.py)
    "Qwen3_5DecoderLayer": Family(qk_norm="head", unit_offset=True, upcast=True, partial_rotary=True,
                                  gated_query=True),
    "Gemma3DecoderLayer": Family(norms=_GEMMA_NORMS, qk_norm="head", unit_offset=True, upcast=True,
                                 embedding="Gemma3TextScaledWordEmbedding", rotary_per_type=True,
                                 refuse=("final_logit_softcapping", "attn_logit_softcapping",
                                         "use_bidirectional_attention")),
}


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


_ACT = {"silu": F.silu, "gelu_tanh": _gelu_tanh}


def _activation(act_fn):
    """The name in `_ACT` of the MLP's activation module, None for one this file does not compute alike."""
    name = type(act_fn).__name__
    if name in ("SiLUActivation", "SiLU"):
        return "silu"
    if name == "GELUTanh" and isinstance(getattr(act_fn, "act", None), functools.partial):  # not its Python form
        return "gelu_tanh"
    return None


def _layer_family(layer):
    # FSDP2 subclasses the layer class: look through it
    return next((FAMILIES[c.__name__] for c in type(layer).__mro__ if c.__name__ in FAMILIES), None)


def _eps(norm):
    return norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps  # Gemma's norms say eps


def _is_sharded(module):
    """True when some parameter of `module` is a DTensor shard (FSDP2 outside a gather)."""
    return _any_dtensor(module.parameters())


def _any_dtensor(params):
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return any(isinstance(p, DTensor) for p in params)


def _gathers_itself(module):
    """An FSDP2-sharded block: `unshard()` gathers its full parameters, `reshard()` frees them again."""
    return callable(getattr(module, "unshard", None)) and callable(getattr(module, "reshard", None))


def _reproduced(model):
    """The `Family` of a causal LM whose layers this file reproduces exactly (sharded or not), else None."""
    inner, cfg = getattr(model, "model", None), model.config
    layers = getattr(inner, "layers", None)
    if not layers or getattr(inner, "rotary_emb", None) is None or getattr(inner, "norm", None) is None:
        return None
    fam = _layer_family(layers[0])
    head, embed = getattr(model, "lm_head", None), getattr(inner, "embed_tokens", None)
    if fam is None or type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    if not isinstance(embed, torch.nn.Embedding) or type(embed).__name__ != fam.embedding:
        return None
    if any(getattr(cfg, k, None) for k in fam.refuse):
        return None
    attention = [layer.self_attn for layer in layers if _attends(layer)]
    if not attention:
        return None
    head_dim = attention[0].head_dim
    for name, b in inner.rotary_emb.named_buffers():
        if name.endswith("inv_freq") and (2 * b.numel() > head_dim or
                                          (2 * b.numel() != head_dim and not fam.partial_rotary)):
            return None  # rotary over part of each head, where the family does not say so
    types_ = getattr(cfg, "layer_types", None) or ["full_attention"] * len(layers)
    if any(t not in ("full_attention", "sliding_attention", "linear_attention") for t in types_):
        return None
    for layer, kind, window in zip(layers, types_, _windows(model, fam)):
        if _layer_family(layer) is not fam:
            return None
        m = layer.mlp
        if (kind == "linear_attention") != (not _attends(layer)):
            return None
        if static_moe.is_moe(m):
            if not static_moe.supported(m):
                return None
        elif _activation(getattr(m, "act_fn", None)) is None or \
                not all(lora.linear_like(x) for x in (m.gate_proj, m.up_proj, m.down_proj)):
            return None
        if not _attends(layer):
            if not static_recurrent.supported(getattr(layer, "linear_attn", None)):
                return None
            continue
        a = layer.self_attn
        if not all(lora.linear_like(x) for x in (a.q_proj, a.k_proj, a.v_proj, a.o_proj)):
            return None
        if fam.gated_query and (a.q_proj.out_features != 2 * cfg.num_attention_heads * a.head_dim or
                                a.q_proj.bias is not None):
            return None
        if (kind == "sliding_attention" and window is None) or (window is not None and window < 1):
            return None  # a sliding layer whose window this file cannot tell
        if fam.qk_norm and _eps(a.q_norm) != _eps(a.k_norm):  # one epsilon serves both
            return None
    return fam


def _query_parts(q_weight, heads, fam, kv):
    """The fused projection's parts: q_proj's weight, k's and v's; with a gated query, q_proj holds each head's
    query then its gate (heads, 2, head_dim, H): the queries first, the gates after k and v."""
    if not fam.gated_query:
        return [q_weight, *kv]
    per_head = q_weight.view(heads, 2, -1, q_weight.shape[-1])
    return [per_head[:, 0].flatten(0, 1), *kv, per_head[:, 1].flatten(0, 1)]


def _attends(layer):
    """True for a layer with softmax attention (not a recurrent one)."""
    return getattr(layer, "self_attn", None) is not None


def _windows(model, fam):
    """Each layer's sliding window in tokens, None for full attention (and for recurrent layers)."""
    if fam.window_from_config:
        return [model.config.sliding_window] * len(model.model.layers)
    return [getattr(getattr(layer, "self_attn", None), "sliding_window", None) for layer in model.model.layers]


def _rotary_keys(model, fam):
    """Each layer's rotary table: the layer type's (one table unless the family has one per type), None
    for a layer without rotary."""
    cfg = model.config
    kinds = getattr(cfg, "layer_types", None) or ["full_attention"] * len(model.model.layers)
    return [None if not _attends(layer) or (fam.rope_flag and not getattr(layer.self_attn, fam.rope_flag)) else
            kind if fam.rotary_per_type else "all" for layer, kind in zip(model.model.layers, kinds)]


def _rotary(rotary_emb, fam, x, positions, key):
    """(cos, sin) of the rotary table `key` for positions (N, S), from the model's own rotary module."""
    cos, sin = rotary_emb(x, positions, key) if fam.rotary_per_type else rotary_emb(x, positions)
    if fam.half_tables:  # x1 cos - x2 sin, x2 cos + x1 sin is rotate_half's form with each table repeated
        cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    return cos, sin


def static_decode_supported(model):
    """True for a causal LM of a family in `FAMILIES` whose layers StaticDecoder reproduces exactly.

    Anything else (other architectures, settings a family's row refuses, adapters
    that replace the projections, shards it cannot gather) takes the Hugging Face
    forward. Sharded decoder layers are fine when they can gather themselves
    (FSDP2 blocks): the decoder copies them one at a time. The embeddings, final
    norm and head must be whole, as they are inside a sharded root's forward.
    MoE blocks are read in place at every step (layers/static_moe.py), never copied:
    sharded ones would need a gather per step, which the model's own forward
    already does, so a model with sharded experts takes that forward.
    """
    if not _reproduced(model) or not _fixed_rotary(model.model.rotary_emb):
        return False
    inner = model.model
    if any(_is_sharded(layer) and not _gathers_itself(layer) for layer in inner.layers):
        return False
    if any(static_moe.is_moe(layer.mlp) and _is_sharded(layer.mlp) for layer in inner.layers):
        return False
    return not any(_is_sharded(m) for m in (inner.embed_tokens, inner.norm, model.lm_head, inner.rotary_emb))


def _fixed_rotary(rotary_emb):
    """False for rotary types whose tables depend on the longest position of the call ("dynamic" scaling,
    "longrope"): the decoder computes each row's tables once, for every slot, at prefill."""
    kinds = getattr(rotary_emb, "rope_type", "default")
    kinds = kinds.values() if isinstance(kinds, dict) else [kinds]
    return not any("dynamic" in k or k == "longrope" for k in kinds)


def _rms_norm(x, weight, eps, upcast=False):
    """RMSNorm over x's last dim, in float32, scaled by weight. As Llama's norm, the scaling happens in x's
    dtype; upcast: in float32, rounded once after it (OLMo 2's, Gemma's)."""
    if x.dtype == torch.float32:  # the same arithmetic either way, in one call
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if upcast:
        return (normed * weight.float()).to(x.dtype)
    return weight * normed.to(x.dtype)


def _head_norm(x, table, eps, upcast=False):
    """`_rms_norm` over each head of x (..., heads, head_dim), table (heads, head_dim) the weight of each: q's
    and k's heads normalised in one pass."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], None, eps) * table
    return _rms_norm(x, table, eps, upcast)  # broadcasts the table


def _norm_weight(weight, fam):
    """A norm's weight as `_rms_norm` applies it: Gemma's stored less one, and float32 where the family
    scales in float32."""
    if fam.unit_offset:
        return weight.float() + 1.0
    return weight.float() if fam.upcast else weight


def _rotate(x, cos, signed_sin):
    """Rotary embedding: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1).

    `signed_sin` carries rotate_half's minus sign (its first half negated), so
    the halves only need swapping: a roll by half the head dimension. Tables in float32 for x in
    bf16 (OLMo's rotary keeps them so) rotate in float32: the caller rounds the result once, as OLMo does.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)


def _repeat_kv(t, rep):
    """(B, kv_heads, S, hd) -> (B, kv_heads * rep, S, hd): each K/V head repeated for the query heads it serves."""
    return t[:, :, None].expand(-1, -1, rep, -1, -1).flatten(1, 2)


def _signed_sin(sin):
    """The rotary sin table with its first half negated, as `_rotate` takes it."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def _sink_attention(q, k, v, mask, scale, sinks):
    """Attention whose softmax has one more logit per head, the learned sink, in its denominator only (gpt-oss).

    q (..., Q, hd), k and v (..., L, hd), mask broadcasting to (..., Q, L) (True: attend; None: all), sinks
    broadcasting to (..., 1, 1) (the heads' axis where q has it). As the model's eager attention computes it:
    the sink joins the logits as a last column, the row's maximum is subtracted, the softmax taken and the
    sink's column dropped.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    logits = torch.cat([scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)], -1)
    logits = logits - logits.max(-1, keepdim=True).values
    return torch.matmul(torch.softmax(logits, -1)[..., :-1].to(v.dtype), v)


def _padded_causal_mask(attn):
    """(N, 1, S, S) boolean attention mask: causal, and no key at a padding position of attn (N, S).

    A padding query attends at least to itself, so that its (unused) output stays finite.
    """
    s = attn.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=attn.device).tril()
    return ((causal & attn.bool()[:, None, :]) | torch.eye(s, dtype=torch.bool, device=attn.device))[:, None]


def _in_window(query_pos, key_pos, window):
    """(N, Sq, Sk) True where the key's token position is less than `window` before the query's: the Hugging
    Face sliding window (query - key < window), counted in the row's own positions, so that padding or cache
    slots between a row's tokens never narrow it. Keys after the query pass too: the causal mask drops them."""
    return (query_pos[:, :, None] - key_pos[:, None, :]) < window


# ----------------------------------------------------------------------------- the training forward


def training_forward_supported(model):
    """True when `hidden_states` may stand in for the Hugging Face forward in training.

    The architectures StaticDecoder reproduces, whole or sharded by FSDP2 the
    way sharding.shard does it: each decoder layer its own group, which
    `hidden_states` calls through a method registered with FSDP (so the
    layer's weights are gathered around it, as around its own forward), and
    everything else (embeddings, final norm, head) already gathered, as inside
    the root's forward. A model in training mode with attention dropout keeps
    the Hugging Face forward. Forward hooks registered on the layers,
    projections or norms do not run here.
    """
    if model.training and getattr(model.config, "attention_dropout", 0.0):
        return False
    fam = _reproduced(model)
    if not fam or fam.sinks or fam.gated_query or fam.partial_rotary or \
            any(static_moe.is_moe(layer.mlp) or not _attends(layer) for layer in model.model.layers):
        return False  # MoE blocks, sinks and hybrid layers train on the model's own forward (its experts
        # kernels and routers for routing replay, its chunked recurrent kernels)
    layers = model.model.layers
    if any(_is_sharded(layer) and not _one_fsdp_group(layer) for layer in layers):
        return False
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    return not _any_dtensor(p for p in model.parameters() if id(p) not in in_layers)


def _one_fsdp_group(layer):
    """An FSDP2 group of its own with no other group inside: one gather brings all its weights."""
    from torch.distributed.fsdp import FSDPModule
    return isinstance(layer, FSDPModule) and not any(isinstance(m, FSDPModule) for m in layer.modules()
                                                     if m is not layer)


def hidden_states(model, input_ids, attention_mask, position_ids, compiled=False):
    """The final-norm hidden states (N, S, H) of a model `_reproduced` admits, on its own parameters, differentiable.

    What `model.base_model(...).last_hidden_state` computes (tests compare the
    values and gradients), in fewer elementwise passes and without the
    per-call mask and cache bookkeeping: on a small model the Hugging Face
    forward spends much of its time there. attention_mask None means no
    padding (plain causal attention). Sliding windows count position_ids, which
    agree with the Hugging Face forward's columns wherever a row's real tokens
    are contiguous (left and right padding). With activation checkpointing on,
    the layers the Hugging Face forward would recompute in backward are
    recomputed, with the same checkpoint function. compiled: each layer's
    arithmetic runs through `torch.compile` (`compiled_layer`), one graph shared
    by the layers of one kind.
    """
    inner = model.model
    fam = _layer_family(inner.layers[0])
    x = inner.embed_tokens(input_ids)  # the module: its padding_idx row gets no gradient, as in the HF forward
    rotary_keys, windows = _rotary_keys(model, fam), _windows(model, fam)
    tables = {None: (None, None)}
    for key in set(rotary_keys) - {None}:
        cos, sin = _rotary(inner.rotary_emb, fam, x, position_ids, key)  # (N, S, head_dim)
        tables[key] = cos[:, :, None], _signed_sin(sin)[:, :, None]  # broadcast over heads
    masks = {None: None if attention_mask is None else _padded_causal_mask(attention_mask)}
    s = input_ids.shape[1]
    for w in set(windows) - {None}:
        if s <= w:  # no two positions of a row are a window apart
            masks[w] = masks[None]
        else:
            base = masks[None] if masks[None] is not None else \
                torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            masks[w] = base & _in_window(position_ids, position_ids, w)[:, None]
    math = compiled_layer() if compiled else _layer
    for layer, key, window in zip(inner.layers, rotary_keys, windows):
        call = _fsdp_layer_method(layer) if _gathers_itself(layer) else functools.partial(_layer_on, layer)
        cos, sin = tables[key]
        mask = masks[window]
        # activation checkpointing exactly where and how the Hugging Face layer would apply it
        if getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled():
            checkpoint = getattr(layer, "_gradient_checkpointing_func", None) or _default_checkpoint
            x = checkpoint(call, math, x, cos, sin, mask)
        else:
            x = call(math, x, cos, sin, mask)
    return _rms_norm(x, _norm_weight(inner.norm.weight, fam), _eps(inner.norm), fam.upcast)


def _layer_on(layer, math, x, cos, sin, mask):
    """`math` (`_layer` or its compiled form) on this layer's parameters, as they are at the call: gathered,
    under FSDP, by the hooks around `_fsdp_layer_method`."""
    if math is not _layer:  # compiled: rows and positions dynamic (after FSDP's casts, which copy)
        _dynamic_shape(x, 0, 1), _dynamic_shape(cos, 0, 1), _dynamic_shape(sin, 0, 1), _dynamic_shape(mask, 0, 2, 3)
    return math(x, cos, sin, mask, _layer_params(layer))


def _fsdp_layer_method(layer):
    """`_layer_on` as a method of an FSDP2-sharded layer, registered with FSDP as a forward method: its hooks
    gather the layer's weights before the call and free them after, and reduce-scatter their gradients in
    backward, as they do around the layer's own forward."""
    if "grpo_layer" not in layer.__dict__:
        from torch.distributed.fsdp import register_fsdp_forward_method
        layer.grpo_layer = types.MethodType(_layer_on, layer)
        register_fsdp_forward_method(layer, "grpo_layer")
    return layer.grpo_layer


def _default_checkpoint(fn, *args):
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)


def _layer_params(layer):
    """A decoder layer's tensors (None for a missing bias or norm) and constants, as `_layer` reads them."""
    fam = _layer_family(layer)
    a, m = layer.self_attn, layer.mlp

    def norm(module):
        return None if module is None else (module.weight, _eps(module))
    p = {slot: norm(getattr(layer, name) if name else None)
         for slot, name in zip(("attn_in", "attn_out", "mlp_in", "mlp_out"), fam.norms)}
    p.update({k: _linear_params(lin) for k, lin in (("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj),
                                                     ("o", a.o_proj), ("gate", m.gate_proj), ("up", m.up_proj),
                                                     ("down", m.down_proj))})
    p.update(q_norm=norm(a.q_norm) if fam.qk_norm else None, k_norm=norm(a.k_norm) if fam.qk_norm else None,
             qk_norm=fam.qk_norm, offset=fam.unit_offset, upcast=fam.upcast, act=_activation(m.act_fn),
             head_dim=a.head_dim, scaling=a.scaling)
    return p


def _linear_params(lin):
    """(weight, bias) of a linear layer; for one with a LoRA adapter switched on, (A, B, scaling) after them."""
    if type(lin) is lora.LoRALinear and lin.enabled:
        return lin.weight, lin.bias, lin.lora_A, lin.lora_B, lin.scaling
    return lin.weight, lin.bias


def _linear(x, p):
    """x through a linear layer's `_linear_params`: the low-rank term apart from the weight, as LoRALinear adds it
    (the frozen weight then needs no gradient of its own)."""
    y = F.linear(x, p[0], p[1])
    return y if len(p) == 2 else y + F.linear(F.linear(x, p[2]), p[3]) * p[4]


def _norm(x, norm, p):
    """The layer's norm `norm` ((weight, eps), or None for none: x itself) as its family applies it."""
    if norm is None:
        return x
    weight, eps = norm
    return _rms_norm(x, weight.float() + 1.0 if p["offset"] else weight, eps, p["upcast"])


def _layer(x, cos, sin, mask, p):
    """One decoder layer as a function of tensors, the weights among them (`_layer_params`), so that one
    compiled graph serves every layer. cos None: a layer without rotary."""
    b, s, _ = x.shape
    hd = p["head_dim"]
    h = _norm(x, p["attn_in"], p)
    q, k, v = (_linear(h, p[n]) for n in ("q", "k", "v"))
    if p["qk_norm"] == "projection":
        q, k = _norm(q, p["q_norm"], p), _norm(k, p["k_norm"], p)
    q, k, v = (t.view(b, s, -1, hd) for t in (q, k, v))
    if p["qk_norm"] == "head":
        q, k = _norm(q, p["q_norm"], p), _norm(k, p["k_norm"], p)
    if cos is not None:
        q, k = _rotate(q, cos, sin).to(q.dtype), _rotate(k, cos, sin).to(k.dtype)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    # grouped-query attention (each K/V head serves `rep` query heads): SDPA's enable_gqa needs no copies of
    # K/V, but on CUDA the kernel that takes a mask (memory-efficient) lacks it, so masked CUDA calls copy
    rep = q.shape[1] // k.shape[1]
    gqa = rep > 1 and (mask is None or not q.is_cuda)
    if rep > 1 and not gqa:
        k, v = _repeat_kv(k, rep), _repeat_kv(v, rep)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=p["scaling"],
                                       enable_gqa=gqa)
    x = x + _norm(_linear(o.transpose(1, 2).reshape(b, s, -1), p["o"]), p["attn_out"], p)
    h = _norm(x, p["mlp_in"], p)
    mlp = _linear(_ACT[p["act"]](_linear(h, p["gate"])) * _linear(h, p["up"]), p["down"])
    return x + _norm(mlp, p["mlp_out"], p)


_COMPILED = {}


def compiled_layer():
    """`_layer` through torch.compile, built on first use: the norms, rotary, gate and residual adds
    fused around the matmuls and the attention kernel, which eager runs as separate passes. The weights
    are the graph's inputs, so every layer shares it; rows and positions are dynamic (`_dynamic_shape`),
    the weights' shapes static. A few variants still compile apart: with and without grad (the
    reference's forward), a micro-batch of one row, an attention mask, a layer without rotary."""
    if "layer" not in _COMPILED:
        _COMPILED["layer"] = compile_layer()
    return _COMPILED["layer"]


def compile_layer(backend="inductor"):
    return torch.compile(_layer, backend=backend, fullgraph=True)


def _dynamic_shape(t, *dims):
    """Mark these dims of t dynamic for torch.compile (not an error where it specialises them, as for 1)."""
    if t is not None:
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(t, dim)


class StaticDecoder:
    """The decoder of a model `_reproduced` admits, over a preallocated KV cache, on its own copy of the weights.

    The same arithmetic as the Hugging Face layers (RMSNorm in float32, rotary
    tables from the model's own rotary module, SDPA attention), without the
    per-call framework work that dominates decoding small batches. Q/K/V and
    gate/up are fused into one matmul each. The copies cost one model's weights
    in memory (plus the cache), freed after each `sample` call unless it keeps
    them (keep_decoder). Kept, they are refreshed in place at every call, so
    the captured graphs (one per batch bucket and cache span)
    stay valid across optimizer steps and never see an FSDP hook: under FSDP the
    weights are read once, while gathered, and decode runs on the copy.

    Cache layout (layers, batch, kv_heads, slots, head_dim): slot = token index in
    the padded sequence, so rows of a bucket are a contiguous view. Each row's
    rotary tables (and, with sliding windows, token positions) are kept per slot,
    filled at prefill: a slot's position never changes, however the row's turns go.
    """

    @classmethod
    def for_model(cls, model, batch, length, cuda_graph=True, attention_kernel=False):
        dec = getattr(model, "_static_decoder", None)
        device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
        if dec is None or dec.device != device or dec.dtype != dtype or batch > dec.max_batch or length > dec.max_len:
            if dec is not None:  # grow: free the old buffers first
                del model._static_decoder, dec
            dec = cls(model, batch, -(-length // 64) * 64)  # slots in multiples of 64: fewer regrowths, aligned
            model.__dict__["_static_decoder"] = dec  # not a submodule: no state_dict entry, no .to() surprises
        dec.use_graph = cuda_graph and device.type == "cuda"
        kernel = attention_kernel and device.type == "cuda" and kernels.triton_supports(dec.head_dim,
                                                                                        dec.n_heads // dec.n_kv)
        if kernel != dec.attention_kernel:  # graphs captured with the other attention must not replay
            dec.graphs.clear()
            dec.attention_kernel = kernel
        dec.load(model)
        return dec

    def __init__(self, model, max_batch, max_len):
        cfg, layers = model.config, model.model.layers
        a0 = next(l.self_attn for l in layers if _attends(l))
        self.fam = fam = _layer_family(layers[0])
        self.qk_norm, self.upcast = fam.qk_norm, fam.upcast  # read in every layer of every step
        self.device, self.dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
        self.max_batch, self.max_len = max_batch, max_len
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, a0.head_dim
        self.scale = a0.scaling
        dense = [l.mlp for l in layers if not static_moe.is_moe(l.mlp)]
        self.act = _ACT[_activation(dense[0].act_fn)] if dense else None
        # MoE layers: their place among the MoE layers (routing replay records per MoE layer), experts' top-k
        self.moe_index = {}
        for i, l in enumerate(layers):
            if static_moe.is_moe(l.mlp):
                self.moe_index[i] = len(self.moe_index)
        self.routes = None  # (rows, slots, MoE layers, k) int16 experts per token, while recording (`record`)
        self.record_at = None  # where the step being run records its experts: (MoE layer, experts (T, k)) -> None
        embed_scale = getattr(model.model.embed_tokens, "embed_scale", None)
        self.embed_scale = None if embed_scale is None else embed_scale.to(self.device, self.dtype)  # as HF rounds it
        slots = ("attn_in", "attn_out", "mlp_in", "mlp_out")
        self.eps = [{**{slot: _eps(getattr(l, name)) for slot, name in zip(slots, fam.norms) if name},
                     **({"qk": _eps(l.self_attn.q_norm)} if fam.qk_norm and _attends(l) else {})} for l in layers]
        self.final_eps = _eps(model.model.norm)
        # per layer: which rotary table (None: no rotary) and which sliding window (None: full attention)
        rotary_keys, windows = _rotary_keys(model, fam), _windows(model, fam)
        self.rotary_keys = sorted(set(rotary_keys) - {None})
        self.plan = [(None if key is None else self.rotary_keys.index(key), window)
                     for key, window in zip(rotary_keys, windows)]
        self.windows = sorted(set(windows) - {None})
        kw = dict(device=self.device, dtype=self.dtype)
        # the KV cache of the attention layers (kv_index: layer -> its row of the cache); recurrent layers keep
        # their states per row instead (layers/static_recurrent.py)
        self.kv_index = {i: n for n, i in enumerate(i for i, l in enumerate(layers) if _attends(l))}
        self.recurrent = {i: static_recurrent.DeltaNet(l.linear_attn, max_batch, self.device, self.dtype)
                          for i, l in enumerate(layers) if not _attends(l)}
        self.forgets_exactly = not self.recurrent  # a recurrent state cannot forget (see layers/static_recurrent.py)
        shape = (len(self.kv_index), max_batch, self.n_kv, max_len, self.head_dim)
        self.k_cache, self.v_cache = torch.zeros(shape, **kw), torch.zeros(shape, **kw)
        self.key_mask = torch.zeros(max_batch, max_len, dtype=torch.bool, device=self.device)
        # rotary tables per row and slot, one per rotary key, in the dtype the model's rotary gives them; sin
        # with its first half negated (see _rotate)
        self.rotary = model.model.rotary_emb
        probe = torch.zeros(1, **kw), torch.zeros(1, 1, dtype=torch.long, device=self.device)
        tables = [_rotary(self.rotary, fam, *probe, key)[0] for key in self.rotary_keys]
        self.rot_dim = tables[0].shape[-1] if tables else self.head_dim  # < head_dim: partial rotary
        self.cos = [torch.zeros(max_batch, max_len, self.rot_dim, device=self.device, dtype=t.dtype) for t in tables]
        self.sin = [torch.zeros_like(c) for c in self.cos]
        self.rotary_cast = any(c.dtype != self.dtype for c in self.cos)
        # each slot's token position, for sliding windows
        self.pos = torch.zeros(max_batch, max_len, dtype=torch.long, device=self.device) if self.windows else None
        self.w = None  # weight copies, allocated by the first load
        self.tok_in = torch.zeros(max_batch, dtype=torch.long, device=self.device)  # graph inputs
        self.slot_in = torch.zeros(max_batch, dtype=torch.long, device=self.device)  # each row's cache slot
        self.row_index = torch.arange(max_batch, device=self.device)
        self.trues = torch.ones(max_batch, dtype=torch.bool, device=self.device)  # what graphs write into key_mask
        self.graphs = {}  # (batch bucket, cache span) -> (graph, logits output)
        # a graph attends over a fixed span of cache slots: spans grow in steps (at most 8 of them), so early
        # tokens do not read the whole cache, at the price of one graph per span
        self.span_step = 64 * -(-max_len // (64 * 8))
        self.use_graph = False
        self.sdpa_decode = self.device.type == "cuda"  # decode attention: SDPA, or two batched matmuls (CPU)
        self.attention_kernel = False  # decode attention by kernels.decode_attention (CUDA, Triton) instead
        self.unpadded = False
        self.narrow_from = None  # the first slot from which windows may narrow by slots; None: they may not
        self.unmarked = None  # (rows, first slot, last slot) decoded unpadded without marking key_mask (below)
        self.compactions = 0  # how often finished rows were dropped (tests check that it happens)
        self.n_rows = None  # rows at the last prefill

    @torch.no_grad()
    def load(self, model):
        """Copy the model's weights in (fused), layer by layer; under FSDP2 each layer is gathered just for its copy."""
        fam, nh, nkv = self.fam, self.n_heads, self.n_kv

        def biases(*lins):  # the fused projections' bias pieces; None when none of them has a bias
            if all(lin.bias is None for lin in lins):
                return None
            return [lin.bias if lin.bias is not None else
                    torch.zeros(lin.out_features, device=self.device, dtype=self.dtype) for lin in lins]

        def norm(module, *heads):  # a norm's weight as _rms_norm applies it; with heads, its table over them
            if module is None:
                return None
            w = _norm_weight(module.weight, fam)
            return [w] if not heads else [w.expand(n, -1) for n in heads]

        def put(mine, new):
            """new: name -> the source tensors fused into it (or None). Each is read once: the first load
            concatenates into new tensors, later ones into the same tensors (captured graphs hold them)."""
            for k, parts in new.items():
                if parts is None:
                    mine.setdefault(k, None)
                elif k not in mine:
                    mine[k] = torch.cat([p.detach() for p in parts]) if len(parts) > 1 else parts[0].detach().clone()
                elif not (k == "lm_head" and mine[k] is mine["embed"]):
                    torch.cat([p.detach() for p in parts], out=mine[k])

        W = lora.applied_weight
        first = self.w is None
        if first:
            self.w = ([{} for _ in model.model.layers], {})
        for i, (l, mine) in enumerate(zip(model.model.layers, self.w[0])):
            gather = _is_sharded(l)  # static_decode_supported let it through: it gathers itself
            if gather:
                l.unshard()  # a collective: every rank loads the same layers in the same order
            a, m = getattr(l, "self_attn", None), l.mlp
            mine["linear"] = self.recurrent.get(i)
            if a is None:  # a recurrent layer: its own copies (layers/static_recurrent.py)
                mine["linear"].load(l.linear_attn)
            moe = static_moe.is_moe(m)
            if not moe:
                mine["moe"] = None
            elif mine.get("moe") is None or mine["moe"].block is not m:  # kept: captured graphs read its tensors
                mine["moe"] = static_moe.MoE(m)  # the experts stay where they are (layers/static_moe.py)
            put(mine, {slot: norm(getattr(l, name) if name else None)
                       for slot, name in zip(("attn_in", "attn_out", "mlp_in", "mlp_out"), fam.norms)})
            put(mine, {
                "qkv": None, "qkv_b": None, "qk_norm": None, "q_norm": None, "k_norm": None, "o": None, "o_b": None,
                "sinks": None,
            } if a is None else {
                # q, k, v, and after them the query's gate where the family has one
                # each as the layer applies it now: with an adapter, its delta merged in (lora.applied_weight)
                "qkv": _query_parts(W(a.q_proj), nh, fam, [W(a.k_proj), W(a.v_proj)]),
                "qkv_b": biases(a.q_proj, a.k_proj, a.v_proj),
                # q/k norms: one table over the heads of q and k (Qwen3, Gemma), or q's and k's apart (OLMo 2)
                "qk_norm": norm(a.q_norm, nh) + norm(a.k_norm, nkv) if fam.qk_norm == "head" else None,
                "q_norm": norm(a.q_norm) if fam.qk_norm == "projection" else None,
                "k_norm": norm(a.k_norm) if fam.qk_norm == "projection" else None,
                "o": [W(a.o_proj)], "o_b": biases(a.o_proj),
                "sinks": [a.sinks] if fam.sinks else None,
            })
            put(mine, {
                "gate_up": None if moe else [W(m.gate_proj), W(m.up_proj)],
                "gate_up_b": None if moe else biases(m.gate_proj, m.up_proj),
                "down": None if moe else [W(m.down_proj)], "down_b": None if moe else biases(m.down_proj),
            })
            if gather:
                l.reshard()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        if first and head.data_ptr() == embed.data_ptr():  # tied: one copy serves both
            put(self.w[1], {"embed": [embed], "norm": norm(model.model.norm)})
            self.w[1]["lm_head"] = self.w[1]["embed"]
        else:
            put(self.w[1], {"embed": [embed], "norm": norm(model.model.norm), "lm_head": [head]})
        self.rotary = model.model.rotary_emb

    def batch_for(self, n):
        """The decode batch that serves n live rows: n itself, or on graphs the next power of two."""
        if not self.use_graph:
            return n
        return min(self.max_batch, 1 << max(0, n - 1).bit_length())

    def worth_compacting(self, live, current):
        """Compaction copies the cache: on graphs do it when the bucket shrinks, eagerly when a quarter of the rows left."""
        if self.use_graph:
            return self.batch_for(live) < self.batch_for(current)
        return live <= 0.75 * current

    @torch.no_grad()
    def compact(self, keep, filled):
        """Move the rows `keep` (indices into the current live rows) to the front of every buffer.

        Only the `filled` cache slots hold anything yet; the rest need no copy.
        """
        self._mark()
        k = keep.numel()
        self.compactions += 1
        for buf in (self.k_cache, self.v_cache):
            buf[:, :k, :, :filled] = buf[:, keep, :, :filled]
        for buf in (self.key_mask, *self.cos, *self.sin, *([] if self.pos is None else [self.pos]),
                    *([] if self.routes is None else [self.routes])):
            buf[:k] = buf[keep]
        for layer in self.recurrent.values():
            layer.compact(keep)

    def _embed(self, ids):
        x = F.embedding(ids, self.w[1]["embed"])
        return x if self.embed_scale is None else x * self.embed_scale

    def _project(self, x, lead, w, eps, rope, cos, sin):
        """A layer's attention inputs from x (*lead, H): q and k (*lead, nh + nkv, hd), normed and rotated by
        the rotary table `rope` of cos, sin (None: no rotary) as the family does, v (*lead, nkv, hd), and the
        query's gate (*lead, nh * hd), None where the family has none."""
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        h = x if w["attn_in"] is None else _rms_norm(x, w["attn_in"], eps["attn_in"], self.upcast)
        qkv = F.linear(h, w["qkv"], w["qkv_b"])
        gate = None
        if self.fam.gated_query:  # the gates come after q, k and v (see _query_parts)
            qkv, gate = qkv[..., :(nh + 2 * nkv) * hd], qkv[..., (nh + 2 * nkv) * hd:]
        if self.qk_norm == "projection":  # over all of q and all of k, before the split into heads
            q = _rms_norm(qkv[..., :nh * hd], w["q_norm"], eps["qk"], self.upcast)
            k = _rms_norm(qkv[..., nh * hd:(nh + nkv) * hd], w["k_norm"], eps["qk"], self.upcast)
            qk = torch.cat([q, k], -1).view(*lead, nh + nkv, hd)
            v = qkv[..., (nh + nkv) * hd:].view(*lead, nkv, hd)
        else:
            heads = qkv.unflatten(-1, (nh + 2 * nkv, hd))
            qk, v = heads[..., :nh + nkv, :], heads[..., nh + nkv:, :]
            if self.qk_norm == "head":  # each head of q and k, in one pass
                qk = _head_norm(qk, w["qk_norm"], eps["qk"], self.upcast)
        if rope is not None:
            rd = self.rot_dim
            if rd == hd:
                qk = _rotate(qk, cos[rope], sin[rope])  # rotary on queries and keys in one pass
            else:  # partial rotary: the first rd dims of each head rotate, the rest pass
                qk = torch.cat([_rotate(qk[..., :rd], cos[rope], sin[rope]).to(qk.dtype), qk[..., rd:]], -1)
            if self.rotary_cast:
                qk = qk.to(self.dtype)
        return qk, v, gate

    def _mixer_in(self, x, w, eps):
        return x if w["attn_in"] is None else _rms_norm(x, w["attn_in"], eps["attn_in"], self.upcast)

    def _layers(self, x, cos, sin, write, keys, masks, recurrent):
        """Prefill: x (B, S, H) through every layer; write(cache row, k, v) stores the new K/V; keys(cache row) ->
        cached K, V. cos, sin: (B, S, 1, hd) per rotary table; masks: window (None: full attention) -> attention
        mask; recurrent(layer, h): a recurrent layer's output for its normed inputs h (B, S, H)."""
        b, s, _ = x.shape
        nh, nkv = self.n_heads, self.n_kv
        for i, w in enumerate(self.w[0]):
            rope, window = self.plan[i]
            eps = self.eps[i]
            if w["linear"] is not None:
                x = self._mlp(x, recurrent(w["linear"], self._mixer_in(x, w, eps)), w, eps, i, projected=True)
                continue
            qk, v, gate = self._project(x, (b, s), w, eps, rope, cos, sin)
            q, k = qk[:, :, :nh].transpose(1, 2), qk[:, :, nh:].transpose(1, 2)  # (B, nh, S, hd), (B, nkv, S, hd)
            write(self.kv_index[i], k, v.transpose(1, 2))
            kk, vv = keys(self.kv_index[i])
            if w["sinks"] is not None:
                o = _sink_attention(q, _repeat_kv(kk, nh // nkv), _repeat_kv(vv, nh // nkv), masks[window],
                                    self.scale, w["sinks"].view(nh, 1, 1))
            else:
                o = F.scaled_dot_product_attention(q, _repeat_kv(kk, nh // nkv), _repeat_kv(vv, nh // nkv),
                                                   attn_mask=masks[window], scale=self.scale)
            o = o.transpose(1, 2).reshape(b, s, nh * self.head_dim)
            x = self._mlp(x, o if gate is None else o * torch.sigmoid(gate), w, eps, i)
        return x

    def _decode_layers(self, x, cos, sin, write, keys, masks, recurrent, starts=None):
        """Decode: x (B, H), one token per row, through every layer: the arithmetic of `_layers` with no
        sequence axis, which saves a sixth of the operations per token (views and transposes), a
        difference that shows on small CPU batches. starts: window -> the first cache slot its layers read,
        with no mask (see `_narrowed`)."""
        b = x.shape[0]
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        for i, w in enumerate(self.w[0]):
            rope, window = self.plan[i]
            eps = self.eps[i]
            if w["linear"] is not None:
                x = self._mlp(x, recurrent(w["linear"], self._mixer_in(x, w, eps)), w, eps, i, projected=True)
                continue
            qk, v, gate = self._project(x, (b,), w, eps, rope, cos, sin)
            write(self.kv_index[i], qk[:, nh:], v)  # (B, nkv, hd) each
            kk, vv = keys(self.kv_index[i])  # (B, nkv, L, hd)
            attn_mask = masks[window]
            if starts and window in starts:
                kk, vv, attn_mask = kk[:, :, starts[window]:], vv[:, :, starts[window]:], None
            # group the query heads that share a KV head as the "sequence" axis, so grouped-query attention
            # needs no copy of K/V per query head
            qg = qk[:, :nh].view(b, nkv, nh // nkv, hd)
            if w["sinks"] is not None:
                o = _sink_attention(qg, kk, vv, attn_mask, self.scale, w["sinks"].view(nkv, nh // nkv, 1))
            elif self.sdpa_decode and not self.attention_kernel:
                o = F.scaled_dot_product_attention(qg, kk, vv, attn_mask=attn_mask, scale=self.scale)
            else:  # the split-KV Triton kernel (CUDA), or on CPU its plain version: two batched matmuls, which
                # beat SDPA's setup cost at small CPU shapes
                o = kernels.decode_attention(qg, kk, vv, None if attn_mask is None else attn_mask[:, 0, 0],
                                             self.scale)
            o = o.reshape(b, nh * hd)
            x = self._mlp(x, o if gate is None else o * torch.sigmoid(gate), w, eps, i)
        return x

    def _mlp(self, x, o, w, eps, i, projected=False):
        """The rest of layer i after attention: output projection (unless `projected`: a recurrent layer's output)
        and residual, then the MLP and its residual."""
        a = o if projected else F.linear(o, w["o"], w["o_b"])
        if w["attn_out"] is not None:
            a = _rms_norm(a, w["attn_out"], eps["attn_out"], self.upcast)
        x = x + a
        h = x if w["mlp_in"] is None else _rms_norm(x, w["mlp_in"], eps["mlp_in"], self.upcast)
        if w["moe"] is not None:
            m, experts = w["moe"](h.reshape(-1, h.shape[-1]))  # tokens (T, H)
            m = m.view(h.shape)
            if self.record_at is not None:
                self.record_at(self.moe_index[i], experts)
        else:
            gate, up = F.linear(h, w["gate_up"], w["gate_up_b"]).chunk(2, dim=-1)
            m = F.linear(self.act(gate).mul_(up), w["down"], w["down_b"])
        return x + (m if w["mlp_out"] is None else _rms_norm(m, w["mlp_out"], eps["mlp_out"], self.upcast))

    def _logits(self, x):
        head = self.w[1]
        return F.linear(_rms_norm(x, head["norm"], self.final_eps, self.upcast), head["lm_head"])

    def _windowed(self, mask, query_pos, kv_len, skip=()):
        """masks: window -> `mask` (None: full attention) narrowed to the keys in slots [0, kv_len) within the
        window of query positions query_pos (b, Q); mask and the result broadcast as (b, 1, Q, kv_len). The
        windows in `skip` get none (their layers narrow by slots instead)."""
        masks = {None: mask}
        for w in self.windows:
            if w in skip:
                masks[w] = None
                continue
            if kv_len <= w:  # no two tokens of these slots are a window apart
                masks[w] = mask
                continue
            near = _in_window(query_pos, self.pos[:query_pos.shape[0], :kv_len], w)[:, None]
            masks[w] = near if mask is None else mask & near
        return masks

    @torch.no_grad()
    def prefill(self, ids, attn, positions):
        """Run the prompts (N, P), fill cache slots [0, P); return the last position's logits (N, V)."""
        n, p = ids.shape
        self.n_rows = n
        x = self._embed(ids)
        # rotary tables for every position a row will use: prompt positions, then the completion's
        last = positions[:, -1:]
        all_pos = torch.cat([positions, last + 1 + torch.arange(self.max_len - p, device=ids.device)], dim=1)
        for key, cos_t, sin_t in zip(self.rotary_keys, self.cos, self.sin):
            cos, sin = _rotary(self.rotary, self.fam, x, all_pos, key)
            cos_t[:n], sin_t[:n] = cos, _signed_sin(sin)  # see _rotate
        if self.pos is not None:
            self.pos[:n] = all_pos
        self.key_mask[:n] = False
        self.key_mask[:n, :p] = attn.bool()
        # without left padding, eager decode over the filled slots needs no mask at all
        self.unpadded = not self.use_graph and bool(attn.bool().all())
        self.unmarked = None
        self.narrow_from = p  # from here each slot is every row's next token (see _narrowed)
        masks = self._windowed(_padded_causal_mask(attn), positions, p)

        def write(i, k, v):
            self.k_cache[i, :n, :, :p] = k
            self.v_cache[i, :n, :, :p] = v

        def keys(i):
            return self.k_cache[i, :n, :, :p], self.v_cache[i, :n, :, :p]

        self.record_at = None if self.routes is None else \
            (lambda j, experts: self.routes[:n, :p, j].copy_(experts.view(n, p, -1)))
        real = attn.bool()
        x = self._layers(x, [c[:n, :p, None] for c in self.cos], [s[:n, :p, None] for s in self.sin], write, keys,
                         masks, lambda layer, h: layer.prefill(h, real))
        return self._logits(x[:, -1])

    def _decode_body(self, b, slot, kv_len, tok=None):
        """One token for the first b rows, whose tokens are `tok` (eager) or in tok_in (graphs); each row's K/V go
        to its cache slot: `slot` is an int shared by all rows, or a tensor (b,) of one slot per row (the form
        graphs capture, read on the device at replay; rows that took turns of different lengths)."""
        x = self._embed(self.tok_in[:b] if tok is None else tok)  # (b, H)
        if torch.is_tensor(slot):  # per-row slots, graph-safe: no host value is read
            rows = self.row_index[:b]
            cos, sin = [c[rows, slot][:, None] for c in self.cos], [s[rows, slot][:, None] for s in self.sin]
            self.key_mask[rows, slot] = self.trues[:b]  # a device tensor: a Python True would be copied from the host
            attn_mask = self.key_mask[:b, None, None, :kv_len]  # (b, 1, 1, L): broadcast over heads and queries
            query_pos = None if self.pos is None else self.pos[rows, slot][:, None]
        else:
            cos, sin = [c[:b, slot, None] for c in self.cos], [s[:b, slot, None] for s in self.sin]  # (b, 1, hd)
            # eager decode without left padding, every row at the same slot, attends to every filled slot: no mask.
            # The slots it fills are marked in key_mask later, only if a step that reads the mask comes
            if self.unpadded:
                first = self.unmarked[1] if self.unmarked is not None else slot
                self.unmarked = (b, first, slot)
                attn_mask = None
            else:
                self.key_mask[:b, slot] = True
                attn_mask = self.key_mask[:b, None, None, :kv_len]
            query_pos = None if self.pos is None else self.pos[:b, slot, None]
        starts = {} if torch.is_tensor(slot) else self._narrowed(slot, kv_len)
        masks = self._windowed(attn_mask, query_pos, kv_len, skip=starts) if self.windows else {None: attn_mask}

        def write(i, k, v):  # (b, nkv, hd) each
            if torch.is_tensor(slot):
                self.k_cache[i, rows, :, slot] = k
                self.v_cache[i, rows, :, slot] = v
            else:
                self.k_cache[i, :b, :, slot] = k
                self.v_cache[i, :b, :, slot] = v

        def keys(i):
            return self.k_cache[i, :b, :, :kv_len], self.v_cache[i, :b, :, :kv_len]

        def record(j, experts):  # (b, k): each row's experts at its slot
            if torch.is_tensor(slot):
                self.routes[rows, slot, j] = experts.to(self.routes.dtype)
            else:
                self.routes[:b, slot, j] = experts.to(self.routes.dtype)

        self.record_at = None if self.routes is None else record
        return self._logits(self._decode_layers(x, cos, sin, write, keys, masks, lambda layer, h: layer.decode(h),
                                                starts))

    def _narrowed(self, slot, kv_len):
        """window -> first slot, for the windows whose keys at this eager step are exactly the `window` slots up to
        `slot` for every row: all rows at `slot` (kv_len = slot + 1), and since `narrow_from` every slot a real
        token of every row, at consecutive positions (prefill fixes each slot's position), so a window over
        positions is a window over slots. Those layers read just those slots, unmasked: on a CPU, where no graph
        fixes the span, a short window then costs what it reads."""
        if self.narrow_from is None or kv_len != slot + 1:
            return {}
        return {w: slot - w + 1 for w in self.windows if slot - w + 1 >= self.narrow_from}

    def _mark(self):
        """Mark in key_mask the slots that unpadded decode steps filled without marking them."""
        if self.unmarked is not None:
            b, first, last = self.unmarked
            self.key_mask[:b, first:last + 1] = True
            self.unmarked = None

    @torch.no_grad()
    def decode(self, tok, slot, top=None):
        """Logits (n, V) for the next token of the n live rows, given their last tokens (n,) and cache slots.

        slot: an int, every row's slot, or a tensor (n,) of each row's own slot, the largest of them `top` (a
        host int). Positions need no input: prefill filled each row's rotary table by slot.
        """
        n = tok.shape[0]
        if torch.is_tensor(slot):
            self._mark()
        top = slot if top is None else top
        if not self.use_graph:
            return self._decode_body(n, slot, top + 1, tok)  # eager: attend over the filled slots only
        b = self.batch_for(n)
        self.tok_in[:n] = tok
        self.slot_in[:n] = slot
        self.slot_in[n:b] = 0  # bucket rows past the live ones: stale rows, any slot will do
        span = min(self.max_len, -(-(top + 1) // self.span_step) * self.span_step)  # slots [0, span) hold top
        if (b, span) not in self.graphs:
            self.graphs[b, span] = self._capture(b, span)
        graph, out = self.graphs[b, span]
        graph.replay()
        return out[:n]

    @torch.no_grad()
    def extend(self, ids, valid, start, top):
        """Append a block of tokens to each live row's cache and return the logits after each row's last one.

        ids, valid (b, K): row i's new tokens are ids[i, :valid[i].sum()] (at least one), written to slots
        start[i], start[i] + 1, ... (start (b,) a tensor); `top` (host int) is the largest slot written. Each
        new token attends to its row's real cache slots before it and to the row's new tokens up to itself:
        the prefill of an environment's answer in the middle of decoding, with nothing before it recomputed.
        """
        self._mark()
        self.narrow_from = None  # rows' blocks of different lengths: slots no longer align across rows
        b, k = ids.shape
        rows = self.row_index[:b, None].expand(b, k)
        slots = start[:, None] + torch.arange(k, device=ids.device)  # (b, K)
        slots = torch.where(valid, slots, start[:, None])  # padding columns read a real slot, write nothing
        real_rows, real_cols = valid.nonzero(as_tuple=True)
        real_slots = slots[real_rows, real_cols]
        self.key_mask[real_rows, real_slots] = True
        kv_len = top + 1
        key_slot = torch.arange(kv_len, device=ids.device)
        # (b, 1, K, L): a real key at or before the query's own slot; padding queries see their row's keys
        mask = self.key_mask[:b, None, None, :kv_len] & (key_slot <= slots[:, None, :, None])
        masks = self._windowed(mask, self.pos[rows, slots], kv_len) if self.windows else {None: mask}
        cos = [c[rows, slots][:, :, None] for c in self.cos]  # (b, K, 1, hd)
        sin = [s[rows, slots][:, :, None] for s in self.sin]

        def write(i, kk, vv):  # (b, nkv, K, hd): only the real tokens' K/V reach the cache
            self.k_cache[i, real_rows, :, real_slots] = kk.transpose(1, 2)[real_rows, real_cols]
            self.v_cache[i, real_rows, :, real_slots] = vv.transpose(1, 2)[real_rows, real_cols]

        def keys(i):
            return self.k_cache[i, :b, :, :kv_len], self.v_cache[i, :b, :, :kv_len]

        self.record_at = None if self.routes is None else \
            (lambda j, experts: self.routes.__setitem__(
                (real_rows, real_slots, j), experts.view(b, k, -1)[real_rows, real_cols].to(self.routes.dtype)))
        x = self._layers(self._embed(ids), cos, sin, write, keys, masks,
                         lambda layer, h: layer.extend(h, valid))  # (b, K, H)
        last = valid.long().sum(1) - 1
        return self._logits(x[self.row_index[:b], last])

    def record(self, on):
        """Routing replay: from the next prefill on, keep the experts every MoE layer chose for each token, by
        row and cache slot (a slot written again, after a row forgot it, keeps the last token's); off: keep none."""
        on = on and bool(self.moe_index)
        if on == (self.routes is not None):
            if on:
                self.routes.fill_(-1)
            return
        self.graphs.clear()  # captured graphs record, or not, as they were captured
        if not on:
            self.routes = None
            return
        k = next(w["moe"].k for w in self.w[0] if w["moe"] is not None)
        self.routes = torch.full((self.max_batch, self.max_len, len(self.moe_index), k), -1, dtype=torch.int16,
                                 device=self.device)

    def routed(self, prompt_width, length):
        """The experts recorded for the prompt slots (N, P, MoE layers, k) and for completion positions
        0 .. length - 1 (N, length, MoE layers, k), completion position j at slot P + j (P = prompt_width); -1 where
        the slot holds no token of the row (never fed, or forgotten): the router's live choice there. Rows in
        their order at prefill (the caller does not compact a recording batch)."""
        self._mark()
        n = self.routes.shape[0] if self.n_rows is None else self.n_rows
        comp = self.routes[:n, prompt_width:prompt_width + length]
        fed = self.key_mask[:n, prompt_width:prompt_width + length]
        return self.routes[:n, :prompt_width], comp.masked_fill(~fed[:, :, None, None], -1)

    @torch.no_grad()
    def truncate(self, rows, ends):
        """Forget rows' cache slots from ends[i] on (rows, ends (m,) tensors): what a row sampled past a stop
        is no longer attended, and is overwritten as the row goes on."""
        self._mark()
        self.narrow_from = None  # forgotten slots are holes until written again
        keep = torch.arange(self.max_len, device=self.device) < ends[:, None]  # (m, L)
        self.key_mask[rows] &= keep

    def _graph_body(self, b, span):
        """The decode step a graph of batch bucket b and cache span `span` captures: its tokens in tok_in[:b],
        each row's slot in slot_in[:b], read on the device at replay."""
        return self._decode_body(b, self.slot_in[:b], span)

    def _capture(self, b, span):
        # warm-up on a side stream, then capture; running the body computes this very step's values, so the
        # cache slots it writes get the same contents the replay writes. Recurrent states are not slots: each
        # run would feed them the token again, so they are put back as they were before the replay runs
        saved = [layer.snapshot() for layer in self.recurrent.values()]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._graph_body(b, span)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._graph_body(b, span)
        for layer, states in zip(self.recurrent.values(), saved):
            layer.restore(states)
        return graph, out
