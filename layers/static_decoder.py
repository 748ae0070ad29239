"""Decoder layers written out: the fast decoder behind `sampling.sample`, and the training forward.

One concern in one file (past 650 lines on purpose): the family table, what it reads from a model (`_spec`), the
one layer function, and its callers, which read the same layer's tensors in two forms (the training forward's live
parameters, the decoder's fused copies) that must change together.

A layer is written once: `layer` computes one decoder layer (norms, q/k/v projections with their head norms and
rotary, attention, the MLP or MoE block, residuals) and `attention` its attention, with the family's options
(a sink per head, a softcap on the scores, a sliding window, the scale). Three callers run them and differ only in
what they pass: the training forward (`hidden_states`: the model's own parameters with autograd, this call's keys,
no cache, compiled whole with `--compile_layers`), and `StaticDecoder`'s prefill and decode (its fused copy of the
weights, a KV cache to write and read, one token per row without a sequence axis in decode, CUDA graphs on GPU).
The MoE blocks and the recurrent layers, which stand alone, are layers/static_moe.py and layers/static_recurrent.py;
the final-logit transform is layers/head.py's, which the training head (logprobs.py) applies too.

`sampling.sample` asks `static_decode_supported(model)` and, when it holds,
decodes with `StaticDecoder`: its own fused copy of the weights, a cache
allocated once, CUDA graphs on GPU. `logprobs.completion_logprobs` asks
`training_forward_supported(model)` and, when it holds, runs
`hidden_states`: the same layers on the model's own parameters, with
autograd. Both compute what the Hugging Face forward computes (the tests
compare them); other models take that forward, and `refusal` says why.

One decoder serves every family in `FAMILIES`: a family is a `Family` row
saying where its layer departs from Llama's (which norms sit where, q/k
norms, how a norm scales, what the embedding and the rotary look like, which
layers are windowed, a softcap, sinks), not a copy of the layer. `_spec` reads
a model's row and modules once into the settings both paths pass to `layer`.
Sliding-window layers attend to the keys whose token position lies less than
the window before the query's. MoE blocks (layers/static_moe.py) read the
model's experts in place instead of copying them; Gated DeltaNet layers
(layers/static_recurrent.py) keep states per row instead of cache slots.
Families with either, or with a gated query, are written out in the sampler
only: `training_forward_supported` leaves their training to the model's own forward.

Of the project it imports layers/head.py (the final-logit transform), layers/kernels.py (the optional Triton
decode attention), layers/lora.py (what an adapted projection applies), layers/static_moe.py and
layers/static_recurrent.py.
"""

import dataclasses
import functools
import types

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from layers import kernels, lora, static_moe, static_recurrent
from layers.head import head_of
from layers.tensor_parallel import WHOLE


@dataclasses.dataclass(frozen=True)
class Family:
    """How a family's decoder layer departs from Llama's (the defaults). `_spec` reads each field, in one place.

    norms: the layer's RMSNorm attributes around attention (its input, its output) and around the MLP (its
    input, its output); None where the family has none. Llama normalises inputs, OLMo 2 outputs, Gemma 2/3 both.
    """
    norms: tuple = ("input_layernorm", None, "post_attention_layernorm", None)
    qk_norm: str = None            # "head": an RMSNorm over each head of q and of k (Qwen3, Gemma 3);
                                   # "projection": over all of q and all of k, before the split into heads (OLMo 2)
    unit_offset: bool = False      # the norms scale by 1 + weight (Gemma)
    upcast: bool = False           # the norms multiply by their weight in float32 and round once (OLMo 2, Gemma)
    embedding: str = "Embedding"   # the embedding module's class: Gemma's scales by its `embed_scale`
    rotary_per_type: bool = False  # one rotary table per layer type (Gemma 3: another base for sliding layers)
    rotary_on: object = None       # f(attention module) -> False on a layer without rotary (SmolLM3's `use_rope`);
                                   # None: rotary on every attention layer
    window: object = None          # f(attention module, config) -> the layer's sliding window, None for full
                                   # attention; None: the attention module's `sliding_window`, where it has one
    softcap: str = None            # the config field whose value c caps each attention score, c tanh(s / c),
                                   # before the softmax (Gemma 2's `attn_logit_softcapping`)
    sinks: bool = False            # a learned logit per head in each softmax's denominator (gpt-oss's `sinks`)
    half_tables: bool = False      # the rotary module gives cos/sin over half a head, which rotates the halves
                                   # (x1 cos - x2 sin, x2 cos + x1 sin): the tables duplicated (gpt-oss)
    partial_rotary: bool = False   # rotary over the first dims of each head only (the tables' width), the rest
                                   # passed through (Qwen3.5)
    gated_query: bool = False      # q_proj gives each head's query and then a gate: the attention's output is
                                   # multiplied by sigmoid(gate) before o_proj (Qwen3.5)
    refuse: tuple = ()             # config fields this decoder does not implement: the model must leave them unset


_LLAMA = Family()
_POST_NORMS = (None, "post_attention_layernorm", None, "post_feedforward_layernorm")  # OLMo 2's: outputs only
_OLMO2 = Family(norms=_POST_NORMS, qk_norm="projection", upcast=True)
_GEMMA_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")
# the decoder layer's class name -> its family
FAMILIES = {
    "LlamaDecoderLayer": _LLAMA,
    "Qwen2DecoderLayer": _LLAMA,
    "Qwen3DecoderLayer": Family(qk_norm="head"),
    "Qwen3MoeDecoderLayer": Family(qk_norm="head"),  # Qwen3's attention; MoE blocks from layers/static_moe.py
    "Qwen2MoeDecoderLayer": _LLAMA,  # Qwen2's attention; MoE blocks with a shared expert from layers/static_moe.py
    "MistralDecoderLayer": Family(window=lambda a, cfg: cfg.sliding_window),  # every layer, or none
    "SmolLM3DecoderLayer": Family(rotary_on=lambda a: a.use_rope),
    "Olmo2DecoderLayer": _OLMO2,
    "Olmo3DecoderLayer": dataclasses.replace(_OLMO2, rotary_per_type=True),  # and sliding windows
    # OLMo 2's post-norms with Qwen3's head norms; every attention module carries `sliding_window`, which only the
    # sliding layers apply, and with windows configured the full layers take no rotary
    "Exaone4DecoderLayer": Family(norms=_POST_NORMS, qk_norm="head",
                                  window=lambda a, cfg: a.sliding_window if a.is_sliding else None,
                                  rotary_on=lambda a: a.sliding_window is None or a.is_sliding),
    # biased q/k/v/o (every family may have them), alternating windows, sinks, MoE blocks from layers/static_moe.py
    "GptOssDecoderLayer": Family(upcast=True, sinks=True, half_tables=True),
    # gated attention with partial rotary beside Gated DeltaNet layers (layers/static_recurrent.py)
    "Qwen3_5DecoderLayer": Family(qk_norm="head", unit_offset=True, upcast=True, partial_rotary=True,
                                  gated_query=True),
    # alternating windows, softcapped attention scores (and final logits: layers/head.py), scaled embeddings
    "Gemma2DecoderLayer": Family(norms=_GEMMA_NORMS, unit_offset=True, upcast=True,
                                 embedding="Gemma2TextScaledWordEmbedding", softcap="attn_logit_softcapping",
                                 refuse=("use_bidirectional_attention",)),
    # Gemma 2's layer with head norms and a rotary per layer type; a config setting the score softcap, which
    # Gemma 3's attention keeps but does not apply, is left to the model's own forward
    "Gemma3DecoderLayer": Family(norms=_GEMMA_NORMS, qk_norm="head", unit_offset=True, upcast=True,
                                 embedding="Gemma3TextScaledWordEmbedding", rotary_per_type=True,
                                 refuse=("attn_logit_softcapping", "use_bidirectional_attention")),
}
SLOTS = ("attn_in", "attn_out", "mlp_in", "mlp_out")  # where `Family.norms` sit, as `layer` names them


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


def _layer_class(layer):
    """The layer's class name as `FAMILIES` knows it (FSDP2 subclasses the layer class: look through it)."""
    return next((c.__name__ for c in type(layer).__mro__ if c.__name__ in FAMILIES), type(layer).__name__)


def _layer_family(layer):
    return FAMILIES.get(_layer_class(layer))


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


def refusal(model):
    """Why the written-out layers do not reproduce the causal LM `model` exactly (sharded or not), in a few words
    that name the layer class and the feature; None when they do."""
    inner, cfg = getattr(model, "model", None), model.config
    layers = getattr(inner, "layers", None)
    if not layers or getattr(inner, "rotary_emb", None) is None or getattr(inner, "norm", None) is None:
        return f"{type(model).__name__}: no model.layers, model.rotary_emb and model.norm as a decoder keeps them"
    name = _layer_class(layers[0])
    fam = FAMILIES.get(name)
    if fam is None:
        return f"{name}: a layer class not in the family table"
    head, embed = getattr(model, "lm_head", None), getattr(inner, "embed_tokens", None)
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return f"{name}: an output layer other than a Linear without bias ({type(head).__name__})"
    if not isinstance(embed, torch.nn.Embedding) or type(embed).__name__ != fam.embedding:
        return f"{name}: embedding {type(embed).__name__}, where the family's is {fam.embedding}"
    for k in fam.refuse:
        if getattr(cfg, k, None):
            return f"{name}: {k} set, which the written-out layers do not compute"
    attention = [layer.self_attn for layer in layers if _attends(layer)]
    if not attention:
        return f"{name}: no attention layer"
    head_dim = attention[0].head_dim
    for key, b in inner.rotary_emb.named_buffers():
        if key.endswith("inv_freq") and (2 * b.numel() > head_dim or
                                         (2 * b.numel() != head_dim and not fam.partial_rotary)):
            return f"{name}: rotary over {2 * b.numel()} of each head's {head_dim} dims, which the family does not declare"
    types_ = getattr(cfg, "layer_types", None) or ["full_attention"] * len(layers)
    for t in types_:
        if t not in ("full_attention", "sliding_attention", "linear_attention"):
            return f"{name}: layers of type {t!r}"
    for i, (layer, kind, window) in enumerate(zip(layers, types_, _windows(model, fam))):
        where = f"{name} {i}"
        if _layer_family(layer) is not fam:
            return f"{where}: a {_layer_class(layer)} among the {name}s"
        m = layer.mlp
        if (kind == "linear_attention") != (not _attends(layer)):
            return f"{where}: layer type {kind!r} on a layer {'with' if _attends(layer) else 'without'} attention"
        if static_moe.is_moe(m):
            if not static_moe.supported(m):
                return f"{where}: MoE block {type(m).__name__} (not in static_moe.BLOCKS, or settings it does not read)"
        elif _activation(getattr(m, "act_fn", None)) is None:
            return f"{where}: MLP activation {type(getattr(m, 'act_fn', None)).__name__}"
        elif not all(lora.linear_like(x) for x in (m.gate_proj, m.up_proj, m.down_proj)):
            return f"{where}: MLP projections other than Linear or LoRALinear"
        if not _attends(layer):
            if not static_recurrent.supported(getattr(layer, "linear_attn", None)):
                return f"{where}: recurrent layer {type(getattr(layer, 'linear_attn', None)).__name__}"
            continue
        a = layer.self_attn
        if not all(lora.linear_like(x) for x in (a.q_proj, a.k_proj, a.v_proj, a.o_proj)):
            return f"{where}: attention projections other than Linear or LoRALinear"
        if fam.gated_query and (a.q_proj.out_features != 2 * cfg.num_attention_heads * a.head_dim or
                                a.q_proj.bias is not None):
            return f"{where}: a gated query whose q_proj is not each head's query then its gate, without bias"
        if (kind == "sliding_attention" and window is None) or (window is not None and window < 1):
            return f"{where}: a sliding window of {window} tokens"
        if fam.qk_norm and _eps(a.q_norm) != _eps(a.k_norm):  # one epsilon serves both
            return f"{where}: q and k norms with different epsilons"
    return None


def _reproduced(model):
    """The `Family` of a causal LM whose layers this file reproduces exactly (sharded or not), else None."""
    return None if refusal(model) else _layer_family(model.model.layers[0])


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
    rule = fam.window or (lambda a, cfg: getattr(a, "sliding_window", None))
    return [rule(layer.self_attn, model.config) if _attends(layer) else None for layer in model.model.layers]


def _rotary_keys(model, fam):
    """Each layer's rotary table: the layer type's (one table unless the family has one per type), None
    for a layer without rotary."""
    cfg = model.config
    kinds = getattr(cfg, "layer_types", None) or ["full_attention"] * len(model.model.layers)
    return [None if not _attends(layer) or (fam.rotary_on and not fam.rotary_on(layer.self_attn)) else
            kind if fam.rotary_per_type else "all" for layer, kind in zip(model.model.layers, kinds)]


def _rotary(rotary_emb, fam, x, positions, key):
    """(cos, sin) of the rotary table `key` for positions (N, S), from the model's own rotary module."""
    cos, sin = rotary_emb(x, positions, key) if fam.rotary_per_type else rotary_emb(x, positions)
    if fam.half_tables:  # x1 cos - x2 sin, x2 cos + x1 sin is rotate_half's form with each table repeated
        cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    return cos, sin


@dataclasses.dataclass
class Spec:
    """What the written-out forward computes for one model besides its weights, read by `_spec` from the model's
    `Family` row, modules and config, once for training, prefill and decode alike.

    layers: per layer, the settings `layer` and `attention` read (copied into each layer's `p`): "upcast",
      "eps" (norm slot -> epsilon; "qk": the q/k norms'), "act" (the MLP's activation), and for an attention
      layer "heads", "kv_heads", "head_dim", "qk_norm", "gated", "scaling", "softcap"; and for its caller "rope"
      (its rotary table's key, None: no rotary) and "window" (its sliding window, None: full attention).
    embed_scale: what the embedding is multiplied by (Gemma's `embed_scale`), None for nothing.
    head: the final logits' transform (layers/head.py), None for none.
    """
    fam: Family
    layers: list
    embed_scale: object
    head: object


def _spec(model, fam=None):
    """`model`'s Spec; fam: the family to read it as (its own row by default)."""
    inner, cfg = model.model, model.config
    fam = fam or _layer_family(inner.layers[0])
    softcap = (getattr(cfg, fam.softcap, None) or None) if fam.softcap else None
    settings = []
    for layer, rope, window in zip(inner.layers, _rotary_keys(model, fam), _windows(model, fam)):
        s = dict(rope=rope, window=window, upcast=fam.upcast,
                 eps={slot: _eps(getattr(layer, name)) for slot, name in zip(SLOTS, fam.norms) if name})
        if not static_moe.is_moe(layer.mlp):
            s["act"] = _ACT[_activation(layer.mlp.act_fn)]
        if _attends(layer):
            a = layer.self_attn
            s.update(heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=a.head_dim,
                     qk_norm=fam.qk_norm, gated=fam.gated_query, scaling=a.scaling, softcap=softcap)
            if fam.qk_norm:
                s["eps"]["qk"] = _eps(a.q_norm)
        settings.append(s)
    return Spec(fam, settings, getattr(inner.embed_tokens, "embed_scale", None), head_of(model))


def decode_refusal(model):
    """Why StaticDecoder does not decode `model`, None when it does (see `static_decode_supported`)."""
    why = refusal(model)
    if why:
        return why
    inner = model.model
    if not _fixed_rotary(inner.rotary_emb):
        return f"{_layer_class(inner.layers[0])}: rotary tables that depend on the longest position of each call"
    if any(_is_sharded(layer) and not _gathers_itself(layer) for layer in inner.layers):
        return "sharded decoder layers that cannot gather themselves"
    if any(static_moe.is_moe(layer.mlp) and _is_sharded(layer.mlp) for layer in inner.layers):
        return "sharded MoE experts (read in place, they would need a gather per step)"
    if any(_is_sharded(m) for m in (inner.embed_tokens, inner.norm, model.lm_head, inner.rotary_emb)):
        return "a sharded embedding, final norm, head or rotary module"
    return None


def tp_refusal(model, size):
    """Why StaticDecoder cannot slice `model`'s layers over a tensor-parallel group of `size` ranks, None when it
    can. Sharded blocks, experts and root tensors are fine there: the slices are cut from them once per call."""
    if size == 1:
        return None
    why = refusal(model)
    if why:
        return why
    inner, cfg = model.model, model.config
    name = _layer_class(inner.layers[0])
    if not _fixed_rotary(inner.rotary_emb):
        return f"{name}: rotary tables that depend on the longest position of each call"
    if _layer_family(inner.layers[0]).qk_norm == "projection":
        return f"{name}: q and k norms over the whole projection, which a rank holding some heads cannot compute"
    if cfg.num_attention_heads % size:
        return (f"{name}: num_attention_heads = {cfg.num_attention_heads} does not divide over {size} "
                f"tensor-parallel ranks")
    # what the MLPs, the experts and the recurrent layers are cut along
    for what in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                 "linear_num_key_heads", "linear_num_value_heads"):
        n = getattr(cfg, what, None)
        if isinstance(n, int) and n % size:
            return f"{name}: {what} = {n} does not divide over {size} tensor-parallel ranks"
    vocab = model.lm_head.weight.shape[0]
    if -(-vocab // size) * (size - 1) >= vocab:
        return f"{name}: a vocabulary of {vocab} leaves the last of {size} tensor-parallel ranks no rows"
    kv = cfg.num_key_value_heads
    if kv % size and size % kv:
        return (f"{name}: num_key_value_heads = {kv} neither divides over {size} tensor-parallel ranks nor "
                f"divides {size}")
    if any(_is_sharded(layer) and not _gathers_itself(layer) for layer in inner.layers):
        return "sharded decoder layers that cannot gather themselves"
    return None


def _whole(t, device):
    """t whole on `device`: a DTensor shard gathered (a collective: every rank calls it for the same tensors in
    order), first moved to the device where FSDP2 keeps it in host memory (CPUOffloadPolicy)."""
    return t.to(device).full_tensor() if _any_dtensor([t]) else t.to(device)


def static_decode_supported(model):
    """True for a causal LM of a family in `FAMILIES` whose layers StaticDecoder reproduces exactly.

    Anything else (other architectures, settings a family's row refuses, adapters
    that replace the projections, shards it cannot gather) takes the Hugging Face
    forward (`decode_refusal` says why). Sharded decoder layers are fine when they can gather themselves
    (FSDP2 blocks): the decoder copies them one at a time. The embeddings, final
    norm and head must be whole, as they are inside a sharded root's forward.
    MoE blocks are read in place at every step (layers/static_moe.py), never copied:
    sharded ones would need a gather per step, which the model's own forward
    already does, so a model with sharded experts takes that forward.
    """
    return decode_refusal(model) is None


def _fixed_rotary(rotary_emb):
    """False for rotary types whose tables depend on the longest position of the call ("dynamic" scaling,
    "longrope"): the decoder computes each row's tables once, for every slot, at prefill."""
    kinds = getattr(rotary_emb, "rope_type", "default")
    kinds = kinds.values() if isinstance(kinds, dict) else [kinds]
    return not any("dynamic" in k or k == "longrope" for k in kinds)


# ----------------------------------------------------------------------------- the layer, written once


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


def _norm(x, norm, upcast):
    """x through a layer's norm (weight as `_norm_weight` gives it, epsilon), or x itself where there is none."""
    return x if norm is None else _rms_norm(x, norm[0], norm[1], upcast)


def _rotate(x, cos, signed_sin):
    """Rotary embedding: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1).

    `signed_sin` carries rotate_half's minus sign (its first half negated), so
    the halves only need swapping: a roll by half the head dimension. Tables in float32 for x in
    bf16 (OLMo's rotary keeps them so) rotate in float32: the caller rounds the result once, as OLMo does.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)


def _rotary_heads(x, cos, sin):
    """`_rotate` over the first dims of each head of x (..., heads, head_dim), as many as the tables are wide (all
    of them but with partial rotary), the rest passed through; rounded once to x's dtype."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        out = _rotate(x, cos, sin)
    else:
        out = torch.cat([_rotate(x[..., :rd], cos, sin).to(x.dtype), x[..., rd:]], -1)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _repeat_kv(t, rep):
    """(B, kv_heads, S, hd) -> (B, kv_heads * rep, S, hd): each K/V head repeated for the query heads it serves."""
    return t[:, :, None].expand(-1, -1, rep, -1, -1).flatten(1, 2)


def _signed_sin(sin):
    """The rotary sin table with its first half negated, as `_rotate` takes it."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def _linear(x, p):
    """x through a linear layer's params: (weight, bias), and for one with a LoRA adapter switched on (A, B,
    scaling) after them, its low-rank term added apart from the weight as LoRALinear adds it (the frozen weight
    then needs no gradient of its own)."""
    y = F.linear(x, p[0], p[1])
    return y if len(p) == 2 else y + F.linear(F.linear(x, p[2]), p[3]) * p[4]


def _linears(x, parts):
    """x through a group of projections whose outputs are concatenated: one fused matmul (the decoder's copy) or
    one per projection (the training forward, on the model's own)."""
    if len(parts) == 1:
        return _linear(x, parts[0])
    return torch.cat([_linear(x, part) for part in parts], -1)


def _qkv(h, p):
    """The attention's inputs from the normed h (*lead, H): q and k together (*lead, heads + kv_heads, head_dim),
    normed as the family does, v (*lead, kv_heads, head_dim), and the query's gate (*lead, heads * head_dim) or None."""
    nh, nkv, hd = p["heads"], p["kv_heads"], p["head_dim"]
    qkv = _linears(h, p["qkv"])
    gate = None
    if p["gated"]:  # the gates come after q, k and v (see _query_parts)
        qkv, gate = qkv[..., :(nh + 2 * nkv) * hd], qkv[..., (nh + 2 * nkv) * hd:]
    if p["qk_norm"] == "projection":  # over all of q and all of k, before the split into heads
        eps = p["eps"]["qk"]
        q = _rms_norm(qkv[..., :nh * hd], p["q_norm"], eps, p["upcast"])
        k = _rms_norm(qkv[..., nh * hd:(nh + nkv) * hd], p["k_norm"], eps, p["upcast"])
        return torch.cat([q, k], -1).unflatten(-1, (nh + nkv, hd)), \
            qkv[..., (nh + nkv) * hd:(nh + 2 * nkv) * hd].unflatten(-1, (nkv, hd)), gate
    heads = qkv.unflatten(-1, (-1, hd))
    qk, v = heads[..., :nh + nkv, :], heads[..., nh + nkv:nh + 2 * nkv, :]
    if p["qk_norm"] == "head":  # each head of q and k, in one pass
        qk = _head_norm(qk, p["qk_table"], p["eps"]["qk"], p["upcast"])
    return qk, v, gate


def attention(q, k, v, mask, p, causal=False, gqa=False, kernel=None):
    """softmax(q k^T * scale) v per head, with the options of the layer's settings p: "scaling", "softcap" (each
    score s becomes c tanh(s / c), Gemma 2) and "sinks" (a learned logit per head in the softmax's denominator
    only, gpt-oss; None: none).

    q (B, heads, Q, hd); k, v (B, kv heads, L, hd), kv heads dividing heads (grouped-query attention: each K/V
    head serves heads / kv heads query heads; decode passes them grouped, the queries sharing a K/V head as its
    Q axis). mask broadcasting to (B, heads, Q, L), True: attend; None: every key, or with `causal` the keys
    up to the query's own column. gqa: SDPA may serve grouped heads itself, with no copy of K/V (else they are
    repeated). kernel(q, k, v, mask, scale): the attention without options, instead of SDPA (decode on a CPU,
    or the Triton kernel). With an option the scores are computed as the model's eager attention does.
    """
    scale, cap, sinks = p["scaling"], p["softcap"], p["sinks"]
    plain = cap is None and sinks is None
    rep = q.shape[1] // k.shape[1]
    if rep > 1 and not (plain and gqa):
        k, v = _repeat_kv(k, rep), _repeat_kv(v, rep)
    if plain:
        if kernel is not None:
            return kernel(q, k, v, mask, scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=rep > 1 and gqa)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    if sinks is None:
        return torch.matmul(torch.softmax(scores, -1, dtype=torch.float32).to(v.dtype), v)
    # the sink joins the scores as a last column (sinks (heads,) viewed over q's head axes), the row's maximum is
    # subtracted, the softmax taken and the sink's column dropped
    scores = torch.cat([scores, sinks.to(scores.dtype).view(q.shape[1], -1, 1).expand(*scores.shape[:-1], 1)], -1)
    scores = scores - scores.max(-1, keepdim=True).values
    return torch.matmul(torch.softmax(scores, -1)[..., :-1].to(v.dtype), v)


def layer(x, p, rope, attend, recurrent=None, record=None):
    """One decoder layer, x (*lead, H) -> (*lead, H): the only place its arithmetic is written.

    The training forward (`_layer`), prefill and decode (`StaticDecoder._layers`) call it and differ only in
    what they pass. lead is (B, S) in training and prefill, (B,) in decode (one token per row and no sequence
    axis: fewer views per token, which shows on small CPU batches).
    p: the layer's settings (`Spec.layers`), "reduce" (tensor parallelism: the sum over the group of the attention's
      and the MLP's partial outputs; absent or None: whole layers), and tensors: norms as (weight as applied, eps)
      or None; "qkv", "gate_up": lists of linear params whose outputs are concatenated, "o", "down": linear params
      (`_linear`);
      "qk_table" (head norms: q's and k's weights over their heads), "q_norm", "k_norm" (norms over the
      projections); "sinks"; "moe" (a static_moe.MoE) and "recurrent" (a static_recurrent.DeltaNet), None but
      in the decoder. The training forward reads the model's own parameters (`_layer_params`), the decoder
      its fused copies (`StaticDecoder.load`).
    rope: (cos, sin) of the layer's rotary table, broadcasting over q's and k's heads; None: no rotary.
    attend(q (*lead, heads, hd), k, v (*lead, kv heads, hd)) -> (*lead, heads, hd): `attention` over the
      caller's keys: this call's own (training), or a KV cache the new k and v are written to first.
    recurrent(state, h): a recurrent layer's output for its normed input; record(experts): routing replay's
      record of a MoE block's choice (decoder only).
    """
    upcast = p["upcast"]
    h = _norm(x, p["attn_in"], upcast)
    if p["recurrent"] is not None:
        a = recurrent(p["recurrent"], h)  # output projection included
    else:
        qk, v, gate = _qkv(h, p)
        if rope is not None:
            qk = _rotary_heads(qk, *rope)  # queries and keys in one pass
        nh = p["heads"]
        o = attend(qk[..., :nh, :], qk[..., nh:, :], v).flatten(-2)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        a = _linear(o, p["o"])
    reduce = p.get("reduce")  # tensor parallelism: this rank's heads gave a partial sum (layers/tensor_parallel.py)
    if reduce is not None:
        a = reduce(a)
    x = x + _norm(a, p["attn_out"], upcast)
    h = _norm(x, p["mlp_in"], upcast)
    if p["moe"] is not None:
        m, experts = p["moe"](h.reshape(-1, h.shape[-1]))  # tokens (T, H)
        m = m.view(h.shape)
        if record is not None:
            record(experts)
    else:
        parts = p["gate_up"]
        gate, up = _linear(h, parts[0]).chunk(2, dim=-1) if len(parts) == 1 else [_linear(h, q) for q in parts]
        m = _linear(p["act"](gate) * up, p["down"])
    if reduce is not None:
        m = reduce(m)
    return x + _norm(m, p["mlp_out"], upcast)


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


def _embed(ids, weight, scale, padding_idx=None):
    """The embedding of ids, times the family's scale (None: none) in the weight's dtype, as Gemma's rounds it."""
    x = F.embedding(ids, weight, padding_idx)
    return x if scale is None else x * scale.to(x.dtype)


# ----------------------------------------------------------------------------- the training forward


def training_refusal(model):
    """Why `hidden_states` does not stand in for the Hugging Face forward in training, None when it does (see
    `training_forward_supported`)."""
    if model.training and getattr(model.config, "attention_dropout", 0.0):
        return "attention dropout in training mode"
    why = refusal(model)
    if why:
        return why
    layers = model.model.layers
    name = _layer_class(layers[0])
    if any(static_moe.is_moe(layer.mlp) for layer in layers):
        return "MoE blocks, which train on the model's own expert kernels and routers (routing replay)"
    if any(not _attends(layer) for layer in layers):
        return "recurrent layers, which train on the model's own chunked kernels"
    if _layer_family(layers[0]).gated_query:
        return f"{name}: a gated query, whose projection interleaves each head's query and gate"
    if any(_is_sharded(layer) and not _one_fsdp_group(layer) for layer in layers):
        return "sharded decoder layers that are not one FSDP group each"
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    if _any_dtensor(p for p in model.parameters() if id(p) not in in_layers):
        return "a sharded embedding, final norm or head"
    return None


def training_forward_supported(model):
    """True when `hidden_states` may stand in for the Hugging Face forward in training.

    The architectures StaticDecoder reproduces, whole or sharded by FSDP2 the
    way sharding.shard does it: each decoder layer its own group, which
    `hidden_states` calls through a method registered with FSDP (so the
    layer's weights are gathered around it, as around its own forward), and
    everything else (embeddings, final norm, head) already gathered, as inside
    the root's forward. A model in training mode with attention dropout keeps
    the Hugging Face forward; so do MoE blocks and recurrent layers, which train
    on the model's own kernels (`training_refusal` says why). Forward hooks
    registered on the layers, projections or norms do not run here.
    """
    return training_refusal(model) is None


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
    spec = _spec(model)
    embed = inner.embed_tokens  # its padding_idx row gets no gradient, as in the HF forward
    x = _embed(input_ids, embed.weight, spec.embed_scale, embed.padding_idx)
    tables = {None: (None, None)}
    for key in {s["rope"] for s in spec.layers} - {None}:
        cos, sin = _rotary(inner.rotary_emb, spec.fam, x, position_ids, key)  # (N, S, head_dim)
        tables[key] = cos[:, :, None], _signed_sin(sin)[:, :, None]  # broadcast over heads
    masks = {None: None if attention_mask is None else _padded_causal_mask(attention_mask)}
    s = input_ids.shape[1]
    for w in {st["window"] for st in spec.layers} - {None}:
        if s <= w:  # no two positions of a row are a window apart
            masks[w] = masks[None]
        else:
            base = masks[None] if masks[None] is not None else \
                torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            masks[w] = base & _in_window(position_ids, position_ids, w)[:, None]
    math = compiled_layer() if compiled else _layer
    for layer, settings in zip(inner.layers, spec.layers):
        call = _fsdp_layer_method(layer) if _gathers_itself(layer) else functools.partial(_layer_on, layer)
        cos, sin = tables[settings["rope"]]
        mask = masks[settings["window"]]
        # activation checkpointing exactly where and how the Hugging Face layer would apply it
        if getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled():
            checkpoint = getattr(layer, "_gradient_checkpointing_func", None) or _default_checkpoint
            x = checkpoint(call, math, x, cos, sin, mask, settings, spec.fam)
        else:
            x = call(math, x, cos, sin, mask, settings, spec.fam)
    return _rms_norm(x, _norm_weight(inner.norm.weight, spec.fam), _eps(inner.norm), spec.fam.upcast)


def _layer_on(layer, math, x, cos, sin, mask, settings, fam):
    """`math` (`_layer` or its compiled form) on this layer's parameters, as they are at the call: gathered,
    under FSDP, by the hooks around `_fsdp_layer_method`."""
    if math is not _layer:  # compiled: rows and positions dynamic (after FSDP's casts, which copy)
        _dynamic_shape(x, 0, 1), _dynamic_shape(cos, 0, 1), _dynamic_shape(sin, 0, 1), _dynamic_shape(mask, 0, 2, 3)
    return math(x, cos, sin, mask, _layer_params(layer, settings, fam))


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


def _layer_params(layer, settings, fam):
    """A decoder layer's `p` for `layer`, on the model's own parameters (the decoder's copies hold the same, fused):
    its settings (`Spec.layers`), each projection with its low-rank term apart (`_linear_params`), each norm's
    weight as the family applies it (differentiable)."""
    a, m = layer.self_attn, layer.mlp
    p = dict(settings, moe=None, recurrent=None)
    p.update({slot: None if name is None else (_norm_weight(getattr(layer, name).weight, fam), settings["eps"][slot])
              for slot, name in zip(SLOTS, fam.norms)})
    p.update(qkv=[_linear_params(lin) for lin in (a.q_proj, a.k_proj, a.v_proj)], o=_linear_params(a.o_proj),
             gate_up=[_linear_params(m.gate_proj), _linear_params(m.up_proj)], down=_linear_params(m.down_proj),
             sinks=a.sinks if fam.sinks else None, qk_table=None, q_norm=None, k_norm=None)
    if fam.qk_norm == "head":
        p["qk_table"] = torch.cat([_norm_weight(a.q_norm.weight, fam).expand(settings["heads"], -1),
                                   _norm_weight(a.k_norm.weight, fam).expand(settings["kv_heads"], -1)])
    elif fam.qk_norm == "projection":
        p["q_norm"], p["k_norm"] = _norm_weight(a.q_norm.weight, fam), _norm_weight(a.k_norm.weight, fam)
    return p


def _linear_params(lin):
    """(weight, bias) of a linear layer; for one with a LoRA adapter switched on, (A, B, scaling) after them."""
    if type(lin) is lora.LoRALinear and lin.enabled:
        return lin.weight, lin.bias, lin.lora_A, lin.lora_B, lin.scaling
    return lin.weight, lin.bias


def _layer(x, cos, sin, mask, p):
    """The training layer: `layer` over this call's own keys (no cache), a function of tensors, the weights among
    them (`_layer_params`), so that one compiled graph serves every layer. cos None: a layer without rotary."""
    return layer(x, p, None if cos is None else (cos, sin), lambda q, k, v: _self_attention(q, k, v, mask, p))


def _self_attention(q, k, v, mask, p):
    """`attention` of a training layer's q (B, S, heads, hd), k, v (B, S, kv heads, hd) over the same positions,
    mask None: causal (no padding). Grouped-query attention by SDPA's enable_gqa, which needs no copies of K/V,
    but on CUDA the kernel that takes a mask (memory-efficient) lacks it, so masked CUDA calls copy."""
    o = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, p, causal=mask is None,
                  gqa=mask is None or not q.is_cuda)
    return o.transpose(1, 2)


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
    def for_model(cls, model, batch, length, cuda_graph=True, attention_kernel=False, tp=WHOLE, dtype=None,
                  device=None):
        """The model's decoder for `batch` rows of `length` slots, kept on the model between calls. tp: this rank's
        `tensor_parallel.Slice` (its share of every layer and of the vocabulary); dtype, device: the copies' (the
        model's own head's by default; under tensor parallelism the sharded model's compute dtype and device, its
        shards being where FSDP2 keeps them, host memory with CPU offload)."""
        dec = getattr(model, "_static_decoder", None)
        device, dtype = device or model.lm_head.weight.device, dtype or model.lm_head.weight.dtype
        if dec is None or dec.device != device or dec.dtype != dtype or batch > dec.max_batch or \
                length > dec.max_len or dec.tp != tp:
            if dec is not None:  # grow: free the old buffers first
                del model._static_decoder, dec
            # slots in multiples of 64: fewer regrowths, aligned
            dec = cls(model, batch, -(-length // 64) * 64, tp=tp, dtype=dtype, device=device)
            model.__dict__["_static_decoder"] = dec  # not a submodule: no state_dict entry, no .to() surprises
        dec.use_graph = cuda_graph and device.type == "cuda"
        kernel = attention_kernel and device.type == "cuda" and kernels.triton_supports(dec.head_dim,
                                                                                        dec.n_heads // dec.n_kv)
        if kernel != dec.attention_kernel:  # graphs captured with the other attention must not replay
            dec.graphs.clear()
            dec.attention_kernel = kernel
        dec.load(model)
        return dec

    def __init__(self, model, max_batch, max_len, tp=WHOLE, dtype=None, device=None):
        cfg, layers = model.config, model.model.layers
        a0 = next(l.self_attn for l in layers if _attends(l))
        self.spec = spec = _spec(model)  # what every layer computes besides its weights (read by `load`)
        self.fam = fam = spec.fam
        self.device, self.dtype = device or model.lm_head.weight.device, dtype or model.lm_head.weight.dtype
        self.max_batch, self.max_len = max_batch, max_len
        # tensor parallelism: this rank's heads (the K/V cache holds its K/V heads only) and vocabulary rows
        self.tp = tp
        why = tp_refusal(model, tp.size)
        if why:
            raise ValueError(why)
        # with fewer K/V heads than ranks, each rank holds the one K/V head its query heads read (a copy per
        # size / kv_heads ranks, as Megatron-LM and vLLM replicate them)
        self.config_kv = kv = cfg.num_key_value_heads
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads // tp.size, max(1, kv // tp.size), a0.head_dim
        self.kv_rank = tp.rank if kv >= tp.size else tp.rank // (tp.size // kv)  # which share of the K/V heads
        self.vocab = model.lm_head.weight.shape[0]
        self.vocab_span = tp.span(self.vocab, even=False)  # this rank's rows of the embedding and the head
        self.head = spec.head  # the final logits' transform (layers/head.py), as the training head applies it
        # MoE layers: their place among the MoE layers (routing replay records per MoE layer), experts' top-k
        self.moe_index = {}
        for i, l in enumerate(layers):
            if static_moe.is_moe(l.mlp):
                self.moe_index[i] = len(self.moe_index)
        self.routes = None  # (rows, slots, MoE layers, k) int16 experts per token, while recording (`record`)
        self.record_at = None  # where the step being run records its experts: (MoE layer, experts (T, k)) -> None
        self.embed_scale = None if spec.embed_scale is None else spec.embed_scale.to(self.device, self.dtype)
        self.final_eps = _eps(model.model.norm)
        # the rotary tables (each layer's "rope" names one; None: no rotary) and the sliding windows of the layers
        self.rotary_keys = sorted({s["rope"] for s in spec.layers} - {None})
        self.windows = sorted({s["window"] for s in spec.layers} - {None})
        kw = dict(device=self.device, dtype=self.dtype)
        # the KV cache of the attention layers (kv_index: layer -> its row of the cache); recurrent layers keep
        # their states per row instead (layers/static_recurrent.py)
        self.kv_index = {i: n for n, i in enumerate(i for i, l in enumerate(layers) if _attends(l))}
        self.recurrent = {i: static_recurrent.DeltaNet(l.linear_attn, max_batch, self.device, self.dtype,
                                                       tp=tp if tp.size > 1 else None)
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
        rot_dim = tables[0].shape[-1] if tables else self.head_dim  # < head_dim: partial rotary
        self.cos = [torch.zeros(max_batch, max_len, rot_dim, device=self.device, dtype=t.dtype) for t in tables]
        self.sin = [torch.zeros_like(c) for c in self.cos]
        # each slot's token position, for sliding windows
        self.pos = torch.zeros(max_batch, max_len, dtype=torch.long, device=self.device) if self.windows else None
        self.w = None  # weight copies, allocated by the first load
        self.p = None  # per layer, what `layer` reads: its settings and its copies, built by `load`
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
        """Copy the model's weights in (fused), layer by layer; under FSDP2 each layer is gathered just for its copy.
        Each layer's `p` then holds its settings (`Spec`) and these copies, in the form `layer` reads."""
        fam, nh, nkv, tp = self.fam, self.n_heads, self.n_kv, self.tp
        # tensor parallelism (layers/tensor_parallel.py): the projections into heads and into the MLP cut by their
        # outputs, those back to the hidden size by their inputs, their biases added once; one rank: whole
        col = (lambda t: t) if tp.size == 1 else (lambda t: tp.part(t, 0, "a projection's outputs"))
        kv_share = dataclasses.replace(tp, rank=self.kv_rank, size=self.config_kv // nkv)  # kv heads in shares of nkv
        kv_col = (lambda t: t) if tp.size == 1 else (lambda t: kv_share.part(t, 0, "the K/V projections"))

        def qkv(parts):  # q, k, v and the query's gate where there is one: this rank's heads of each
            return None if parts is None else [kv_col(t) if j in (1, 2) else col(t) for j, t in enumerate(parts)]
        row = (lambda t: t) if tp.size == 1 else (lambda t: tp.part(t, -1, "a projection's inputs"))

        def each(fn, parts):
            return None if parts is None else [fn(t) for t in parts]

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
                # the experts stay where they are (layers/static_moe.py); sliced, this rank's share is copied
                mine["moe"] = static_moe.MoE(m) if tp.size == 1 else static_moe.MoE(m, tp=tp)
            elif tp.size > 1:
                mine["moe"].load(m)
            put(mine, {slot: norm(getattr(l, name) if name else None) for slot, name in zip(SLOTS, fam.norms)})
            put(mine, {
                "qkv": None, "qkv_b": None, "qk_norm": None, "q_norm": None, "k_norm": None, "o": None, "o_b": None,
                "sinks": None,
            } if a is None else {
                # q, k, v, and after them the query's gate where the family has one
                # each as the layer applies it now: with an adapter, its delta merged in (lora.applied_weight)
                "qkv": qkv(_query_parts(W(a.q_proj), self.spec.layers[i]["heads"], fam,
                                        [W(a.k_proj), W(a.v_proj)])),
                "qkv_b": qkv(biases(a.q_proj, a.k_proj, a.v_proj)),
                # q/k norms: one table over the heads of q and k (Qwen3, Gemma), or q's and k's apart (OLMo 2)
                "qk_norm": norm(a.q_norm, nh) + norm(a.k_norm, nkv) if fam.qk_norm == "head" else None,
                "q_norm": norm(a.q_norm) if fam.qk_norm == "projection" else None,
                "k_norm": norm(a.k_norm) if fam.qk_norm == "projection" else None,
                "o": [row(W(a.o_proj))], "o_b": None if tp.rank else biases(a.o_proj),
                "sinks": [col(a.sinks)] if fam.sinks else None,
            })
            put(mine, {
                "gate_up": None if moe else [col(W(m.gate_proj)), col(W(m.up_proj))],
                "gate_up_b": None if moe else each(col, biases(m.gate_proj, m.up_proj)),
                "down": None if moe else [row(W(m.down_proj))],
                "down_b": None if moe or tp.rank else biases(m.down_proj),
            })
            if gather:
                l.reshard()
        self.p = [self._layer_p(settings, mine) for settings, mine in zip(self.spec.layers, self.w[0])]
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        tied = embed is head or (not _any_dtensor([embed]) and head.data_ptr() == embed.data_ptr())
        final_norm = model.model.norm
        if tp.size > 1:  # this rank's vocabulary rows; a sharded root's tensors gathered one at a time
            a, b = self.vocab_span
            embed = _whole(embed, self.device)[a:b].to(self.dtype)
            head = embed if tied else _whole(head, self.device)[a:b].to(self.dtype)
            final_norm = types.SimpleNamespace(weight=_whole(final_norm.weight, self.device).to(self.dtype))
        if first and tied:  # tied: one copy serves both
            put(self.w[1], {"embed": [embed], "norm": norm(final_norm)})
            self.w[1]["lm_head"] = self.w[1]["embed"]
        else:
            put(self.w[1], {"embed": [embed], "norm": norm(final_norm), "lm_head": [head]})
        self.rotary = model.model.rotary_emb

    def weight_bytes(self):
        """Bytes of the weight copies this decoder holds (each tensor once; a tied head is the embedding): its
        layers' fused copies, MoE blocks' and recurrent layers' own (none for experts read in place), embedding,
        final norm and head. Under tensor parallelism, this rank's share."""
        seen, total = set(), 0
        for d in [*self.w[0], self.w[1]]:
            for k, v in d.items():
                if k in ("moe", "linear") and v is not None:  # a MoE block's, a recurrent layer's
                    total += v.nbytes()
                elif torch.is_tensor(v) and id(v) not in seen:
                    seen.add(id(v))
                    total += v.numel() * v.element_size()
        return total

    def _layer_p(self, settings, w):
        """A layer's `p` for `layer`: its settings, and its copies w as (weight, bias) pairs and (weight, eps) norms.
        Under tensor parallelism the heads are this rank's, and the group's all-reduce joins the partial outputs."""
        eps = settings["eps"]
        if self.tp.size > 1:
            settings = dict(settings, reduce=self.tp.reduce)
            if "heads" in settings:
                settings.update(heads=self.n_heads, kv_heads=self.n_kv)
        p = dict(settings, moe=w["moe"], recurrent=w["linear"], sinks=w["sinks"], qk_table=w["qk_norm"],
                 q_norm=w["q_norm"], k_norm=w["k_norm"], qkv=[(w["qkv"], w["qkv_b"])], o=(w["o"], w["o_b"]),
                 gate_up=[(w["gate_up"], w["gate_up_b"])], down=(w["down"], w["down_b"]))
        p.update({slot: None if w[slot] is None else (w[slot], eps[slot]) for slot in SLOTS})
        return p

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
        if self.tp.size == 1:
            return _embed(ids, self.w[1]["embed"], self.embed_scale)
        # this rank's vocabulary rows: the others' tokens embed as zeros here, and the sum over the group is exact
        a, b = self.vocab_span
        mine = (ids >= a) & (ids < b)
        x = F.embedding((ids - a).clamp(0, max(b - a - 1, 0)), self.w[1]["embed"]) * mine[..., None]
        x = self.tp.reduce(x)
        return x if self.embed_scale is None else x * self.embed_scale.to(x.dtype)

    def _layers(self, x, rope, attend, recurrent):
        """x through every layer (`layer`). rope: rotary key -> (cos, sin) of these tokens; attend(i, p, q, k, v):
        layer i's attention, its new K/V written to the cache first (`_block_attention`, `_decode_attention`);
        recurrent(state, h): a recurrent layer's output."""
        for i, p in enumerate(self.p):
            record = None if self.record_at is None or i not in self.moe_index else \
                functools.partial(self.record_at, self.moe_index[i])
            x = layer(x, p, None if p["rope"] is None else rope[p["rope"]], functools.partial(attend, i, p),
                      recurrent, record)
        return x

    def _block_attention(self, write, keys, masks):
        """Prefill and extend: each layer's attention over a block of tokens per row, q (B, S, heads, hd), k, v
        (B, S, kv heads, hd); write(cache row, k, v) stores the new K/V, keys(cache row) gives the cached K, V
        (B, kv heads, L, hd); masks: window (None: full attention) -> attention mask (B, 1, S, L)."""
        def attend(i, p, q, k, v):
            c = self.kv_index[i]
            write(c, k.transpose(1, 2), v.transpose(1, 2))
            kk, vv = keys(c)
            return attention(q.transpose(1, 2), kk, vv, masks[p["window"]], p).transpose(1, 2)
        return attend

    def _decode_attention(self, write, keys, masks, starts):
        """Decode: each layer's attention for one token per row, q (B, heads, hd), k, v (B, kv heads, hd). The query
        heads that share a KV head are grouped as the query axis, so grouped-query attention needs no copy of K/V
        per query head. starts: window -> the first cache slot its layers read, with no mask (see `_narrowed`)."""
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        # SDPA on CUDA; else the split-KV Triton kernel (CUDA), or on a CPU its plain version, two batched matmuls,
        # which beat SDPA's setup cost at small CPU shapes
        kernel = None if self.sdpa_decode and not self.attention_kernel else _decode_kernel

        def attend(i, p, q, k, v):
            c = self.kv_index[i]
            write(c, k, v)  # (B, nkv, hd) each
            kk, vv = keys(c)  # (B, nkv, L, hd)
            window = p["window"]
            mask = masks[window]
            if starts and window in starts:
                kk, vv, mask = kk[:, :, starts[window]:], vv[:, :, starts[window]:], None
            b = q.shape[0]
            return attention(q.view(b, nkv, nh // nkv, hd), kk, vv, mask, p, kernel=kernel).reshape(b, nh, hd)
        return attend

    def _logits(self, x):
        """The logits (n, V) of x (n, H); under tensor parallelism this rank's vocabulary columns, `vocab_span`."""
        head = self.w[1]
        z = F.linear(_rms_norm(x, head["norm"], self.final_eps, self.fam.upcast), head["lm_head"])
        return z if self.head is None else self.head.apply(z)

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
        rope = {key: (c[:n, :p, None], s[:n, :p, None]) for key, c, s in zip(self.rotary_keys, self.cos, self.sin)}
        x = self._layers(x, rope, self._block_attention(write, keys, masks), lambda layer, h: layer.prefill(h, real))
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
        rope = dict(zip(self.rotary_keys, zip(cos, sin)))
        return self._logits(self._layers(x, rope, self._decode_attention(write, keys, masks, starts),
                                         lambda layer, h: layer.decode(h)))

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
        rope = dict(zip(self.rotary_keys, zip(cos, sin)))
        x = self._layers(self._embed(ids), rope, self._block_attention(write, keys, masks),
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


def _decode_kernel(q, k, v, mask, scale):
    """`attention`'s kernel in decode where SDPA is not used: kernels.decode_attention, mask (B, 1, 1, L) as its
    key mask (B, L)."""
    return kernels.decode_attention(q, k, v, None if mask is None else mask[:, 0, 0], scale)
