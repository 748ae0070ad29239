"""The model written out: the family table, which path each phase takes, one layer function, the training forward.

One concern in one file (past 650 lines on purpose): what the written-out layers compute for a model. In order:
- `FAMILIES`: a `Family` row per decoder layer class (matched by its exact class, as transformers defines it),
  saying where its layer departs from Llama's (which norms sit where, q/k norms, how a norm scales, the embedding,
  the rotary, which layers are windowed, a softcap, sinks, a gated query): a family is a row, not a copy;
- `decide`: the one gate. For a model and a tensor-parallel size it returns `Paths`, which phase runs on the
  written-out layers and, for each that does not, why; setup decides once and keeps it on the model (`attach`),
  and the sampler and the training forward read it (`paths_of`);
- `_spec` and `LayerParams`: a model's settings per layer, read once, and `layer_params`, the one function that
  puts a layer's tensors beside them, for the training forward (`Live`: the model's own parameters) and the decoder
  (layers/engine.py: fused copies, a rank's slices) alike;
- `layer` and `attention`: one decoder layer's arithmetic, written once: its norms and residual adds around two
  blocks the layer's params carry, `attention_block` and `dense_mlp`, or a feature's in their place (a Gated
  DeltaNet layer, a MoE block, a gated query, a tensor-parallel sum after each: `_feature_blocks`, chosen once where
  the params are built). The training forward, prefill and decode call it and differ only in what they pass;
- the training forward (`hidden_states`): the layers on the model's own parameters with autograd, under FSDP2
  through a registered method per layer, compiled whole with `--compile_layers`; over rows that share a prompt packed
  as trees (`Tree`, --shared_prompts), its attention in two parts, and `tree_refusal` for the model's own forward.

MoE blocks (layers/static_moe.py) read the model's experts in place; Gated DeltaNet layers
(layers/static_recurrent.py) keep states per row. Families with either, or with a gated query, are written out
in the sampler only: their training runs on the model's own forward. The final-logit transform is `head_of`'s
(a layers/head.py Head), which the training head (logprobs.py) applies too.

Of the project it imports layers/head.py (where a model transforms its final logits), layers/lora.py (what an
adapted projection applies), layers/static_moe.py (its MoE block), layers/static_recurrent.py and
layers/tensor_parallel.py (what a slice cannot cut, and the sum after a sliced block).
"""

import dataclasses
import functools
import types

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from layers import lora, static_moe, static_recurrent, tensor_parallel
from layers.head import Head

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed: nothing is a DTensor
    DTensor = ()


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
# the decoder layer's class name in transformers -> its family; a fork's own layer class may key a row too
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


# the class of the MLP's activation module -> what `dense_mlp` applies in its place (`_spec` reads it)
_ACT = {"SiLUActivation": F.silu, "SiLU": F.silu, "GELUTanh": _gelu_tanh}


def _activation(act_fn):
    """`_ACT`'s function for the MLP's activation module, None for one this file does not compute alike."""
    name = type(act_fn).__name__
    if name == "GELUTanh" and not isinstance(getattr(act_fn, "act", None), functools.partial):  # its Python form
        return None
    return _ACT.get(name)


def own_class(module):
    """The class a module was built as: FSDP2's `fully_shard` swaps it for a class of its own made from
    (FSDPModule, the module's class), which this looks through."""
    cls = type(module)
    bases = cls.__bases__
    if len(bases) == 2 and bases[0].__name__ == "FSDPModule" and cls.__name__ == f"FSDP{bases[1].__name__}":
        return bases[1]
    return cls


def _layer_class(layer):
    """The layer's class name as `FAMILIES` knows it."""
    return own_class(layer).__name__


def _layer_family(layer):
    """The layer's `Family` row: its exact class, as transformers defines it (a row keyed by the class's name), or a
    class of a fork's own that a row is keyed by (the class itself). A subclass, or a class of the same name defined
    elsewhere, has none: it may compute something the row does not say."""
    cls = own_class(layer)
    if cls in FAMILIES:
        return FAMILIES[cls]
    return FAMILIES.get(cls.__name__) if cls.__module__.startswith("transformers.models.") else None


# where the classes of a written-out layer's modules may come from: transformers' own, torch's, and this folder's
# adapters (layers/lora.py); a class from anywhere else may compute what the family's row does not say, unless a row
# is keyed by a class of its module (a fork's family: its row describes its modules)
_KNOWN_MODULES = ("transformers.", "torch.", "layers.")


def _foreign_module(layer):
    """(name, class) of the first module inside the layer whose class comes from outside `_KNOWN_MODULES`, or None."""
    vouched = {k.__module__ for k in FAMILIES if isinstance(k, type)}
    for name, m in layer.named_modules():
        cls = own_class(m)
        if not cls.__module__.startswith(_KNOWN_MODULES) and cls.__module__ not in vouched:
            return name or "the layer", cls
    return None


def _eps(norm):
    return norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps  # Gemma's norms say eps


def _is_sharded(module):
    """True when some parameter of `module` is a DTensor shard (FSDP2 outside a gather)."""
    return any(isinstance(p, DTensor) for p in module.parameters())


def _any_dtensor(params):
    return any(isinstance(p, DTensor) for p in params)


def _gathers_itself(module):
    """An FSDP2-sharded block: `unshard()` gathers its full parameters, `reshard()` frees them again."""
    return callable(getattr(module, "unshard", None)) and callable(getattr(module, "reshard", None))


def _refusal(model):
    """Why the family table does not describe the causal LM `model` (sharded or not), for every phase, in a few
    words that name the layer class and the feature; None when it does."""
    inner, cfg = getattr(model, "model", None), model.config
    layers = getattr(inner, "layers", None)
    if not layers or getattr(inner, "rotary_emb", None) is None or getattr(inner, "norm", None) is None:
        return f"{type(model).__name__}: no model.layers, model.rotary_emb and model.norm as a decoder keeps them"
    name = _layer_class(layers[0])
    fam = _layer_family(layers[0])
    if fam is None:
        where = own_class(layers[0]).__module__
        return (f"{name}: a layer class not in the family table" if name not in FAMILIES else
                f"{name} from {where}: not transformers' own class of that name (a subclass, or a fork's copy)")
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
            return (f"{name}: rotary over {2 * b.numel()} of each head's {head_dim} dims, which the family does not "
                    "declare")
    types_ = getattr(cfg, "layer_types", None) or ["full_attention"] * len(layers)
    for t in types_:
        if t not in ("full_attention", "sliding_attention", "linear_attention"):
            return f"{name}: layers of type {t!r}"
    for i, (layer, kind, window) in enumerate(zip(layers, types_, _windows(model, fam))):
        where = f"{name} {i}"
        if _layer_family(layer) is not fam or own_class(layer) is not own_class(layers[0]):
            return f"{where}: a {_layer_class(layer)} from {own_class(layer).__module__} among the {name}s"
        foreign = _foreign_module(layer)
        if foreign:
            return (f"{where}: {foreign[0]} is a {foreign[1].__name__} from {foreign[1].__module__}, which the "
                    f"family's row does not describe")
        m = layer.mlp
        if (kind == "linear_attention") != (not _attends(layer)):
            return f"{where}: layer type {kind!r} on a layer {'with' if _attends(layer) else 'without'} attention"
        if is_moe(m):
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


def _query_parts(q_weight, head_dim, kv):
    """The fused projection's parts of a gated query: q_proj's weight holds each head's query then its gate
    (heads, 2, head_dim, H): the queries first, then k's and v's weights (kv), the gates last."""
    per_head = q_weight.view(-1, 2, head_dim, q_weight.shape[-1])
    return [per_head[:, 0].flatten(0, 1), *kv, per_head[:, 1].flatten(0, 1)]


def _attends(layer):
    """True for a layer with softmax attention (not a recurrent one)."""
    return getattr(layer, "self_attn", None) is not None


def _windows(model, fam):
    """Each layer's sliding window in tokens, None for full attention (and for recurrent layers)."""
    rule = fam.window or (lambda a, cfg: getattr(a, "sliding_window", None))
    return [rule(layer.self_attn, model.config) if _attends(layer) else None for layer in model.model.layers]


def _rotary(rotary_emb, fam, x, positions, key):
    """(cos, sin) of the rotary table `key` for positions (N, S), from the model's own rotary module."""
    cos, sin = rotary_emb(x, positions, key) if fam.rotary_per_type else rotary_emb(x, positions)
    if fam.half_tables:  # x1 cos - x2 sin, x2 cos + x1 sin is rotate_half's form with each table repeated
        cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    return cos, sin


@dataclasses.dataclass
class LayerParams:
    """What `layer` reads of one decoder layer: its settings, read by `_spec` from the family's row and the layer's
    modules (the same in training, prefill and decode), and its tensors, put in by `layer_params` (the training
    forward's live parameters, or the decoder's fused copies), with the layer's two blocks (`mix`, `mlp`). A
    feature of a family is a field here, a line of `layer_params` and the lines of the blocks that use it.

    Norms are (weight as applied, epsilon), None where the family has none; linear layers are (weight, bias) and,
    with a LoRA adapter on, (A, B, scaling) after them (`_linear`); `qkv` and `gate_up` are lists of them whose
    outputs are concatenated: one fused matmul (the decoder's) or one per projection (the model's own).
    """
    # settings
    upcast: bool = False      # the norms multiply by their weight in float32 and round once
    eps: dict = None          # norm slot (SLOTS) -> its epsilon; "qk": the q/k norms'
    act: object = None        # the MLP's activation (None: a MoE block)
    rope: object = None       # the key of the layer's rotary table; None: no rotary
    window: object = None     # its sliding window in tokens; None: full attention
    heads: int = 0            # query heads (a rank's, sliced); 0: a layer without attention
    kv_heads: int = 0
    head_dim: int = 0
    qk_v: object = None       # (qkv, p) -> (q and k, v), normed as Family.qk_norm says: `_qk_v`, `_head_normed`,
                              # `_projection_normed`
    rotary: object = None     # (x, cos, sin) -> x rotated: `_rotary_heads`, or `_partial_rotary` (Qwen3.5)
    gated: bool = False       # Family.gated_query: q_proj gives each head's query, then a gate
    scaling: float = None     # the attention scores' scale
    softcap: float = None     # c in c tanh(s / c) over each score; None: none
    # tensors
    attn_in: object = None    # the norms at SLOTS
    attn_out: object = None
    mlp_in: object = None
    mlp_out: object = None
    qkv: list = None          # q, k, v, and the query's gate after them (see _query_parts)
    o: tuple = None
    qk_table: object = None   # qk_norm "head": q's and k's norm weights over their heads, one table
    q_norm: object = None     # qk_norm "projection": the norms' weights over the whole projections
    k_norm: object = None
    sinks: object = None      # a learned logit per head in each softmax's denominator
    gate_up: list = None      # gate, up
    down: tuple = None
    moe: object = None        # static_moe.MoE (the decoder's; the training forward runs dense layers only)
    recurrent: object = None  # static_recurrent.DeltaNet in place of attention (the decoder's)
    # the blocks `layer` runs on the normed input (`layer_params` puts them in)
    mix: object = None        # (h, p, rope, attend, recurrent) -> output: `attention_block`, or a feature's
    mlp: object = None        # (h, p, record) -> output: `dense_mlp`, or a feature's (a MoE block)
    # the decoder's
    reduce: object = None     # tensor parallelism: the group's sum of a partial output (layers/tensor_parallel.py)
    cache_row: int = None     # the layer's row of the KV cache
    moe_row: int = None       # its place among the MoE layers (routing records)


@dataclasses.dataclass
class Spec:
    """What the written-out forward computes for one model besides its weights, read by `_spec` from the model's
    `Family` row, modules and config, once for training, prefill and decode alike.

    layers: per layer, a LayerParams holding its settings (no tensors).
    embed_scale: what the embedding is multiplied by (Gemma's `embed_scale`), None for nothing.
    head: the final logits' transform (layers/head.py), None for none.
    """
    fam: Family
    layers: list
    embed_scale: object
    head: object


def _spec(model, fam=None):
    """`model`'s Spec; fam: the family to read it as (by default its own row: as the run's decision found it, or
    looked up for a model used outside a run, without deciding all of its paths again)."""
    inner, cfg, paths = model.model, model.config, model.__dict__.get("_paths")
    fam = fam or (paths.family if paths is not None else _layer_family(inner.layers[0]))
    softcap = (getattr(cfg, fam.softcap, None) or None) if fam.softcap else None
    kinds = getattr(cfg, "layer_types", None) or ["full_attention"] * len(inner.layers)
    settings = []
    for layer, kind, window in zip(inner.layers, kinds, _windows(model, fam)):
        s = dict(window=window, upcast=fam.upcast,
                 eps={slot: _eps(getattr(layer, name)) for slot, name in zip(SLOTS, fam.norms) if name})
        if not is_moe(layer.mlp):
            s["act"] = _ACT[type(layer.mlp.act_fn).__name__]  # one `_refusal` admitted (`_activation`)
        if _attends(layer):
            a = layer.self_attn
            # the layer's rotary table: its layer type's where the family has one per type; None: no rotary
            s.update(heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=a.head_dim,
                     qk_v=_QK_V[fam.qk_norm], gated=fam.gated_query, scaling=a.scaling, softcap=softcap,
                     rotary=_partial_rotary if fam.partial_rotary else _rotary_heads,
                     rope=None if fam.rotary_on and not fam.rotary_on(a) else kind if fam.rotary_per_type else "all")
            s["eps"]["qk"] = _eps(a.q_norm) if fam.qk_norm else None
        settings.append(LayerParams(**s))
    return Spec(fam, settings, getattr(inner.embed_tokens, "embed_scale", None), head_of(model))


def head_of(model):
    """The model's final-logit transform (a layers/head.Head: a scale, a softcap), or None when its logits are the
    projection's output as they are. The decoder (`Spec.head`) and the training head (logprobs.py) both take it
    from here, so the two cannot disagree."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    scale = float(getattr(model, "logit_scale", None) or getattr(cfg, "logit_scale", None) or 1.0)
    scale /= float(getattr(cfg, "logits_scaling", None) or 1.0)
    softcap = float(getattr(cfg, "final_logit_softcapping", None) or 0.0)
    return None if scale == 1.0 and not softcap else Head(scale, softcap)


def layer_params(l, settings, fam, take):
    """The LayerParams of the decoder layer `l`: its `settings` (`Spec.layers`) with its tensors as `take` gives them,
    `Live` (the training forward) or the decoder's copies (engine.py), and its blocks: `attention_block` and
    `dense_mlp`, or a feature's in their place (`_feature_blocks`). The one place that says which tensor of a
    layer feeds which part of `layer`; `take` says only in what form.

    take.norm(name, module, eps) -> a norm; take.linears(name, modules, cuts, split_gate) -> the list `qkv`/`gate_up`
    hold (split_gate: q_proj's rows are each head's query then its gate, split_gate rows each); take.linear(name,
    module, cut) -> one linear; what families and features take besides: `_attention_options`, `_feature_blocks`.
    `cut` names how tensor parallelism cuts a weight (layers/tensor_parallel.py's), which a whole decoder and
    training ignore."""
    a, m = getattr(l, "self_attn", None), l.mlp
    t = {slot: None if name is None else take.norm(slot, getattr(l, name), settings.eps[slot])
         for slot, name in zip(SLOTS, fam.norms)}
    t.update(mix=attention_block, mlp=dense_mlp)
    if a is not None:
        t["qkv"] = take.linears("qkv", [a.q_proj, a.k_proj, a.v_proj], ("heads", "kv_heads", "kv_heads"),
                                split_gate=settings.head_dim if settings.gated else None)
        t["o"] = take.linear("o", a.o_proj, "inputs")
        if fam.qk_norm or fam.sinks:
            _attention_options(t, a, settings, fam, take)
    if not is_moe(m):
        t["gate_up"] = take.linears("gate_up", [m.gate_proj, m.up_proj], ("columns", "columns"))
        t["down"] = take.linear("down", m.down_proj, "inputs")
    if a is None or is_moe(m) or settings.gated or settings.reduce is not None:
        _feature_blocks(t, l, settings, take)
    return dataclasses.replace(settings, **t)


def _feature_blocks(t, l, settings, take):
    """`layer_params`' blocks where a feature puts its own, in `t`: a Gated DeltaNet layer in place of attention
    (`recurrent_block`, its state the decoder's: layers/static_recurrent.py), a MoE block in place of the MLP
    (`static_moe.block`), a gated query's attention (`gated_attention_block`), and under tensor parallelism each
    block followed by the group's sum of its partial output (`tensor_parallel.summed`). take.moe(block) and
    take.recurrent(module) give what those blocks read."""
    if not _attends(l):
        t["recurrent"], t["mix"] = take.recurrent(l.linear_attn), recurrent_block
    if is_moe(l.mlp):
        t["moe"], t["mlp"] = take.moe(l.mlp), static_moe.block
    if settings.gated and _attends(l):
        t["mix"] = gated_attention_block
    if settings.reduce is not None:
        t["mix"], t["mlp"] = tensor_parallel.summed(t["mix"]), tensor_parallel.summed(t["mlp"])


def _attention_options(t, a, settings, fam, take):
    """`layer_params`' tensors of the attention module `a` for the family's q/k norms and sinks, put in `t`:
    take.table(name, [(norm, heads)]) -> head norms over their heads; take.tensor(name, t, cut) -> a tensor."""
    if fam.qk_norm == "head":
        t["qk_table"] = take.table("qk_table", [(a.q_norm, settings.heads), (a.k_norm, settings.kv_heads)])
    elif fam.qk_norm == "projection":  # sliced decoding refuses these (transformer.decide): they stay whole
        t["q_norm"], t["k_norm"] = take.norm("q_norm", a.q_norm, None)[0], take.norm("k_norm", a.k_norm, None)[0]
    if fam.sinks:
        t["sinks"] = take.tensor("sinks", a.sinks, "heads")


@dataclasses.dataclass
class Live:
    """`layer_params`' tensors for the training forward: the model's own parameters as they are at the call
    (gathered, under FSDP), differentiable; each projection with its LoRA adapter's low-rank term apart
    (`linear`), and each norm's weight as the family applies it."""
    fam: Family

    def norm(self, name, module, eps):
        return _norm_weight(module.weight, self.fam), eps

    def linears(self, name, modules, cuts, split_gate=None):
        if split_gate:  # q_proj's rows interleave each head's query and gate, which only the decoder's copy splits
            raise ValueError("the training forward does not run a gated query (transformer.decide refuses it)")
        return [self.linear(name, lin, None) for lin in modules]

    def linear(self, name, module, cut):
        """(weight, bias), and (A, B, scaling) after them from a switched-on LoRA adapter (`linear_params`)."""
        return module.linear_params() if type(module) is lora.LoRALinear else (module.weight, module.bias)

    def tensor(self, name, t, cut):
        return t

    def table(self, name, norms):
        return torch.cat([_norm_weight(n.weight, self.fam).expand(heads, -1) for n, heads in norms])

    def moe(self, block):
        return None  # MoE blocks train on the model's own forward (transformer.decide)

    def recurrent(self, module):
        return None  # so do recurrent layers


@dataclasses.dataclass(frozen=True)
class Paths:
    """How each phase runs one model, decided once (`decide`): for each, None where it runs on the written-out
    layers, else why not, in a few words that name the layer class and the feature.

    sampler: the decoder (engine.StaticDecoder) over `tp_size` ranks. At tp_size 1 a refused model samples on its
      own forward (layers/hf_decoder.py); a sliced decoder has no such fallback, and its refusal stops the run.
    training: the training forward (`hidden_states`), for the policy and the reference alike; a refused model trains
      on its own forward. A model in training mode with attention dropout takes its own forward too, whatever
      this says (`trains_written_out`): the mode changes while the structure does not.
    """
    tp_size: int
    sampler: object
    training: object
    dropout: bool
    family: Family = None  # the model's row in FAMILIES (`_layer_family`), None where it has none

    def samples_written_out(self):
        return self.sampler is None

    def trains_written_out(self, model):
        return self.training is None and not (model.training and self.dropout)

    def banner(self):
        def path(refused):
            return "written-out layers" if refused is None else f"the model's own forward ({refused})"
        sliced = f" sliced over {self.tp_size} tensor-parallel ranks" if self.tp_size > 1 else ""
        return f"sampler on {path(self.sampler)}{sliced}, training on {path(self.training)}"


def decide(model, tp_size=1):
    """The `Paths` of the causal LM `model` (whole, or sharded by FSDP2 as sharding.shard does it, asked inside the
    root's forward, where the embeddings and head are whole) with a tensor-parallel group of `tp_size` ranks.

    The one place that says what the written-out layers reproduce exactly. Every phase needs the family's row to
    describe the model (`_refusal`). The sampler's decoder also needs rotary tables fixed at prefill and layers it
    can gather (it copies them, one at a time, into its own fused tensors); whole, it reads MoE experts in place, so
    they must not be sharded, and the root's tensors must be whole; sliced (layers/tensor_parallel.py), every
    dimension it cuts must divide. The training forward runs dense attention layers only (MoE blocks and recurrent
    layers train on the model's own kernels), each its own FSDP group, with the root's tensors gathered. Forward
    hooks registered on the layers, projections or norms do not run on the written-out paths.
    """
    common = _refusal(model)
    layers = getattr(getattr(model, "model", None), "layers", None)
    return Paths(tp_size, common or _sampler_refusal(model, tp_size), common or _training_refusal(model),
                 bool(getattr(model.config, "attention_dropout", 0.0)), _layer_family(layers[0]) if layers else None)


def paths_of(model, tp_size=None):
    """The run's decision for `model` where setup attached one (`attach`; for `tp_size` ranks, None: any), else
    decided now (a model used outside a run, as tests and benches do)."""
    paths = model.__dict__.get("_paths")
    return paths if paths is not None and tp_size in (None, paths.tp_size) else decide(model, tp_size or 1)


def attach(model, paths):
    """Keep `paths` on the model for the sampler and the training forward to read (not a module attribute)."""
    model.__dict__["_paths"] = paths


def _sampler_refusal(model, tp_size):
    inner = model.model
    name = _layer_class(inner.layers[0])
    if not _fixed_rotary(inner.rotary_emb):
        return f"{name}: rotary tables that depend on the longest position of each call"
    if any(_is_sharded(layer) and not _gathers_itself(layer) for layer in inner.layers):
        return "sharded decoder layers that cannot gather themselves"
    if tp_size > 1:  # sharded experts and root tensors are fine: the slices are cut from them at each load
        why = tensor_parallel.refusal(model.config, model.lm_head.weight.shape[0], tp_size,
                                      whole_projection_norms=_layer_family(inner.layers[0]).qk_norm == "projection")
        return f"{name}: {why}" if why else None
    if any(is_moe(layer.mlp) and _is_sharded(layer.mlp) for layer in inner.layers):
        return "sharded MoE experts (read in place, they would need a gather per step)"
    if any(_is_sharded(m) for m in (inner.embed_tokens, inner.norm, model.lm_head, inner.rotary_emb)):
        return "a sharded embedding, final norm, head or rotary module"
    return None


def _training_refusal(model):
    layers = model.model.layers
    name = _layer_class(layers[0])
    if any(is_moe(layer.mlp) for layer in layers):
        return "MoE blocks, which train on the model's own expert kernels and routers"
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


def _fixed_rotary(rotary_emb):
    """False for rotary types whose tables depend on the longest position of the call ("dynamic" scaling,
    "longrope"): the decoder computes each row's tables once, for every slot, at prefill."""
    kinds = getattr(rotary_emb, "rope_type", "default")
    kinds = kinds.values() if isinstance(kinds, dict) else [kinds]
    return not any("dynamic" in k or k == "longrope" for k in kinds)


# ----------------------------------------------------------------------------- the layer, written once


def _rms_norm(x, weight, eps, upcast=False):
    """RMSNorm over x's last dim, in float32, scaled by weight. As Llama's norm, the scaling happens in x's
    dtype; upcast: in float32, rounded once after it (OLMo 2's, Gemma's): `_rounded_rms_norm`."""
    if x.dtype != torch.float32:
        return _rounded_rms_norm(x, weight, eps, upcast)
    return F.rms_norm(x, weight.shape, weight, eps)  # the same arithmetic either way, in one call


def _rounded_rms_norm(x, weight, eps, upcast):
    """`_rms_norm` of x in a dtype narrower than float32: normalised in float32, then scaled in x's dtype (Llama)
    or in float32 and rounded once after it (upcast)."""
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


def _rotary_heads(x, cos, sin):
    """Rotary embedding over each head of x (..., heads, head_dim): x * cos + rotate_half(x) * sin,
    rotate_half(x) = (-x2, x1), rounded once to x's dtype.

    `sin` carries rotate_half's minus sign (its first half negated, `_signed_sin`), so the halves only need
    swapping: a roll by half the head dimension. Tables in float32 for x in bf16 (OLMo's rotary keeps them so)
    rotate in float32, and the result is rounded once, as OLMo does.
    """
    out = torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _partial_rotary(x, cos, sin):
    """`_rotary_heads` over the first dims of each head of x, as many as the tables are wide (Qwen3.5's partial
    rotary), the rest passed through: a layer's `rotary` where its family's `partial_rotary` says so."""
    rd = cos.shape[-1]
    return torch.cat([_rotary_heads(x[..., :rd], cos, sin), x[..., rd:]], -1)


def _signed_sin(sin):
    """The rotary sin table with its first half negated, as `_rotary_heads` takes it."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def _linear(x, p):
    """x through a linear layer's params (weight, bias); where a LoRA adapter's (A, B, scaling) follow them, its
    low-rank term added apart from the weight (`LoRALinear.linear_params` says why)."""
    y = F.linear(x, p[0], p[1])
    return y if len(p) == 2 else y + F.linear(F.linear(x, p[2]), p[3]) * p[4]


def _linears(x, parts):
    """x through a group of projections whose outputs are concatenated: one fused matmul (the decoder's copy) or
    one per projection (the training forward, on the model's own)."""
    if len(parts) == 1:
        return _linear(x, parts[0])
    return torch.cat([_linear(x, part) for part in parts], -1)


def _qk_v(qkv, p):
    """q and k together (*lead, heads + kv_heads, head_dim) and v (*lead, kv_heads, head_dim), of the q, k and v
    projections' outputs concatenated (*lead, (heads + 2 kv_heads) * head_dim); any columns after v's (a gated
    query's gates) are not read. A family with q/k norms has them applied by its layers' `qk_v` (`_QK_V`)."""
    nq = p.heads + p.kv_heads
    heads = qkv.unflatten(-1, (-1, p.head_dim))
    return heads[..., :nq, :], heads[..., nq:nq + p.kv_heads, :]


def _head_normed(qkv, p):
    """`_qk_v` with an RMSNorm over each head of q and k, in one pass (qk_norm "head": Qwen3, Gemma 3)."""
    qk, v = _qk_v(qkv, p)
    return _head_norm(qk, p.qk_table, p.eps["qk"], p.upcast), v


def _projection_normed(qkv, p):
    """`_qk_v` with norms over all of q and all of k, before the split into heads (OLMo 2's qk_norm "projection")."""
    nh, nkv, hd = p.heads, p.kv_heads, p.head_dim
    eps = p.eps["qk"]
    q = _rms_norm(qkv[..., :nh * hd], p.q_norm, eps, p.upcast)
    k = _rms_norm(qkv[..., nh * hd:(nh + nkv) * hd], p.k_norm, eps, p.upcast)
    return torch.cat([q, k], -1).unflatten(-1, (nh + nkv, hd)), \
        qkv[..., (nh + nkv) * hd:(nh + 2 * nkv) * hd].unflatten(-1, (nkv, hd))


# Family.qk_norm -> what a layer's `qk_v` is (`_spec` reads it)
_QK_V = {None: _qk_v, "head": _head_normed, "projection": _projection_normed}


def is_moe(mlp):
    """True for an MLP that routes tokens to experts (it has an `experts` module): layers/static_moe.py runs it."""
    return hasattr(mlp, "experts")


def grouped_attention(q, k, v, key_mask=None, scale=None):
    """Attention without options, as two batched matmuls (the sampler's decode on a CPU, and the reference the
    Triton decode kernel is tested against): q (B, nkv, rep, hd), the rep query heads sharing each K/V head; k, v
    (B, nkv, L, hd); key_mask (B, L) bool, True = attend (`_masked_softmax`). Softmax in float32. Returns
    (B, nkv, rep, hd) in q's dtype."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)  # (B, nkv, rep, L)
    p = s.softmax(-1) if key_mask is None else _masked_softmax(s, key_mask)
    return torch.matmul(p, v.float()).to(q.dtype)


def _masked_softmax(s, key_mask):
    """The softmax of scores s (B, nkv, rep, L) over the keys key_mask (B, L) keeps; a row with no key to attend
    gives zeros (0/0 in the softmax, its weights zeroed after)."""
    dropped = ~key_mask[:, None, None, :]  # (B, 1, 1, L): broadcast over heads and queries
    return s.masked_fill_(dropped, float("-inf")).softmax(-1).masked_fill_(dropped, 0.0)


def attention(q, k, v, mask, p, causal=False, gqa=False, kernel=None):
    """softmax(q k^T * p.scaling) v per head; with a softcap or sinks in the layer's settings p, `_scored_attention`.

    q (B, heads, Q, hd); k, v (B, kv heads, L, hd), kv heads dividing heads (grouped-query attention: each K/V
    head serves heads / kv heads query heads; decode passes them grouped, the queries sharing a K/V head as its
    Q axis). mask broadcasting to (B, heads, Q, L), True: attend; None: every key, or with `causal` the keys
    up to the query's own column. gqa: SDPA may serve grouped heads itself, with no copy of K/V (else each K/V
    head is repeated for the query heads it serves). kernel(q, k, v, mask, scale): the attention without
    options, instead of SDPA (decode on a CPU, or the Triton kernel).
    """
    if p.softcap is not None or p.sinks is not None:
        return _scored_attention(q, k, v, mask, p, causal)
    rep = q.shape[1] // k.shape[1]
    if rep > 1 and not gqa:
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if kernel is not None:
        return kernel(q, k, v, mask, p.scaling)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=p.scaling,
                                          enable_gqa=rep > 1 and gqa)


def _scored_attention(q, k, v, mask, p, causal):
    """`attention` with its options, the scores computed as the model's eager attention does: "softcap" (each score
    s becomes c tanh(s / c), Gemma 2) and "sinks" (a learned logit per head in the softmax's denominator only,
    gpt-oss; None: none)."""
    scale, cap, sinks = p.scaling, p.softcap, p.sinks
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
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
    """One decoder layer, x (*lead, H) -> (*lead, H): the only place its arithmetic is written, its norms and
    residual adds around its two blocks, which `p` carries: the attention (`attention_block`) and the MLP
    (`dense_mlp`), or the blocks a feature puts in their place (`_feature_blocks`).

    The training forward (`_layer`), prefill and decode (`StaticDecoder._layers`) call it and differ only in
    what they pass. lead is (B, S) in training and prefill, (B,) in decode (one token per row and no sequence
    axis: fewer views per token, which shows on small CPU batches).
    p: the layer's LayerParams (`layer_params`): settings, tensors and blocks.
    rope: (cos, sin) of the layer's rotary table, broadcasting over q's and k's heads; None: no rotary.
    attend(p, q (*lead, heads, hd), k, v (*lead, kv heads, hd)) -> (*lead, heads, hd): `attention` over the
      caller's keys: this call's own (training), or a KV cache (p.cache_row) the new k and v are written to first.
    recurrent, record: the decoder's, for the blocks features put in (`recurrent_block`, `static_moe.block`). The
      callers pass the same functions to every layer: nothing is built per layer per step.
    """
    upcast = p.upcast
    a = p.mix(_norm(x, p.attn_in, upcast), p, rope, attend, recurrent)
    x = x + _norm(a, p.attn_out, upcast)
    m = p.mlp(_norm(x, p.mlp_in, upcast), p, record)
    return x + _norm(m, p.mlp_out, upcast)


def attention_block(h, p, rope, attend, recurrent=None):
    """The attention's output for the normed h (*lead, H), o_proj included: q, k and v projected and normed as the
    family does (`p.qk_v`), then the heads' attention (`_attend`)."""
    qk, v = p.qk_v(_linears(h, p.qkv), p)
    return _linear(_attend(qk, v, p, rope, attend), p.o)


def _attend(qk, v, p, rope, attend):
    """The heads' attention output (*lead, heads * hd) of q and k together (*lead, heads + kv heads, hd) and v:
    rotary over the queries and keys in one pass, then `attend`."""
    if rope is not None:
        qk = p.rotary(qk, *rope)
    return attend(p, qk[..., :p.heads, :], qk[..., p.heads:, :], v).flatten(-2)


def dense_mlp(h, p, record=None):
    """The MLP's output for the normed h (*lead, H): down(act(gate) * up), gate and up one fused matmul (the
    decoder's copy) or one each (the training forward, on the model's own)."""
    parts = p.gate_up
    gate, up = _linear(h, parts[0]).chunk(2, dim=-1) if len(parts) == 1 else [_linear(h, q) for q in parts]
    return _linear(p.act(gate) * up, p.down)


def gated_attention_block(h, p, rope, attend, recurrent=None):
    """`attention_block` with a gated query (Qwen3.5): q_proj gives each head's query and then a gate, which the
    decoder's fused projection holds after q, k and v (`_query_parts`); the attention's output is multiplied by
    sigmoid(gate) before o_proj."""
    qkv = _linears(h, p.qkv)
    gates = (p.heads + 2 * p.kv_heads) * p.head_dim  # where the gates begin
    qk, v = p.qk_v(qkv, p)
    return _linear(_attend(qk, v, p, rope, attend) * torch.sigmoid(qkv[..., gates:]), p.o)


def recurrent_block(h, p, rope, attend, recurrent):
    """A Gated DeltaNet layer's output in place of attention, its output projection included: the caller's
    recurrent(state, h) (the decoder's prefill or decode) on the layer's state `p.recurrent`
    (layers/static_recurrent.py)."""
    return recurrent(p.recurrent, h)


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


def _one_fsdp_group(layer):
    """An FSDP2 group of its own with no other group inside: one gather brings all its weights."""
    from torch.distributed.fsdp import FSDPModule
    return isinstance(layer, FSDPModule) and not any(isinstance(m, FSDPModule) for m in layer.modules()
                                                     if m is not layer)


def hidden_states(model, input_ids, attention_mask, position_ids, compiled=False):
    """The final-norm hidden states (N, S, H) of a model `decide` lets train here, on its own parameters, with grad.

    What `model.base_model(...).last_hidden_state` computes (tests compare the values and gradients), in fewer
    elementwise passes and without the per-call mask and cache bookkeeping: on a small model the Hugging Face forward
    spends much of its time there. attention_mask None means no padding (plain causal attention); padding, sliding
    windows and rows a feature lays out: `_masks`. With activation checkpointing on, `_checkpointed`. compiled: each
    layer's arithmetic runs through `torch.compile` (`compiled_layer`), one graph shared by the layers of one kind.
    """
    inner = model.model
    spec = _spec(model)
    embed = inner.embed_tokens  # its padding_idx row gets no gradient, as in the HF forward
    x = _embed(input_ids, embed.weight, spec.embed_scale, embed.padding_idx)
    tables = {None: (None, None)}
    for key in {s.rope for s in spec.layers} - {None}:
        cos, sin = _rotary(inner.rotary_emb, spec.fam, x, position_ids, key)  # (N, S, head_dim)
        tables[key] = cos[:, :, None], _signed_sin(sin)[:, :, None]  # broadcast over heads
    windows = {st.window for st in spec.layers}
    masks = {None: None} if attention_mask is None and windows == {None} else \
        _masks(windows, attention_mask, position_ids, x.device)
    math = _laid_out_layer if hasattr(attention_mask, "attend") else compiled_layer() if compiled else _layer
    live = Live(spec.fam)  # the layers' own parameters, as each call finds them
    for layer, settings in zip(inner.layers, spec.layers):
        call = _fsdp_layer_method(layer) if _gathers_itself(layer) else functools.partial(_layer_on, layer)
        if getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled():
            call = _checkpointed(layer, call)
        x = call(math, x, *tables[settings.rope], masks[settings.window], settings, live)
    return _rms_norm(x, _norm_weight(inner.norm.weight, spec.fam), _eps(inner.norm), spec.fam.upcast)


def _masks(windows, attention_mask, position_ids, device):
    """The training forward's attention masks, by sliding window (None: full attention). Sliding windows count
    position_ids, which agree with the Hugging Face forward's columns wherever a row's real tokens are contiguous
    (left and right padding).
    attention_mask: (N, S) the rows' real tokens, None for no padding; or rows a feature lays out, whose
    `attend(window)` gives each window's attention of its own, mask(q, k, v, p) (`_laid_out_layer`): rows that share
    a prompt packed as one sequence each (`Tree`, --shared_prompts; position_ids then continue from each prompt's end
    in every branch), or a rank's positions under sequence parallelism. Those layers run eagerly (not compiled)."""
    if hasattr(attention_mask, "attend"):  # each window's attention over the laid-out rows
        return {w: attention_mask.attend(w) for w in windows}
    masks = {None: None if attention_mask is None else _padded_causal_mask(attention_mask)}
    s = position_ids.shape[1]
    for w in windows - {None}:
        if s <= w:  # no two positions of a row are a window apart
            masks[w] = masks[None]
        else:
            base = masks[None] if masks[None] is not None else \
                torch.ones(s, s, dtype=torch.bool, device=device).tril()
            masks[w] = base & _in_window(position_ids, position_ids, w)[:, None]
    return masks


def _checkpointed(layer, call):
    """`call` with activation checkpointing exactly where and how the Hugging Face layer would apply it: the layers
    its forward would recompute in backward are recomputed, with the same checkpoint function."""
    checkpoint = getattr(layer, "_gradient_checkpointing_func", None) or _default_checkpoint
    return functools.partial(checkpoint, call)


def _layer_on(layer, math, x, cos, sin, mask, settings, live):
    """`math` (`_layer` or its compiled form) on this layer's parameters, as they are at the call: gathered,
    under FSDP, by the hooks around `_fsdp_layer_method`."""
    return math(x, cos, sin, mask, layer_params(layer, settings, live.fam, live))


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


def _layer(x, cos, sin, mask, p):
    """The training layer: `layer` over this call's own keys (no cache), a function of tensors, the weights among
    them (`layer_params`), so that one compiled graph serves every layer. cos None: a layer without rotary."""
    return layer(x, p, None if cos is None else (cos, sin), lambda p, q, k, v: _self_attention(q, k, v, mask, p))


def _laid_out_layer(x, cos, sin, mask, p):
    """`_layer` over rows a feature lays out (`_masks`): `mask` is an attention of its own, mask(q, k, v, p) with
    q (B, S, heads, hd), k, v (B, S, kv heads, hd): a TreeMask (`_tree_attention`), or a feature's."""
    return layer(x, p, None if cos is None else (cos, sin), lambda p, q, k, v: mask(q, k, v, p))


def _self_attention(q, k, v, mask, p):
    """`attention` of a training layer's q (B, S, heads, hd), k, v (B, S, kv heads, hd) over the same positions,
    mask None: causal (no padding). Grouped-query attention by SDPA's enable_gqa, which needs no copies of K/V, but
    on CUDA the kernel that takes a mask (memory-efficient) lacks it, so masked CUDA calls copy."""
    o = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, p, causal=mask is None,
                  gqa=mask is None or not q.is_cuda)
    return o.transpose(1, 2)


# ----------------------------------------------------------------------------- shared prompts: one tree per prompt


@dataclasses.dataclass
class Tree:
    """Rows that share a prompt, packed as one sequence each (logprobs.py's `pack`, --shared_prompts): the prompt
    once, then each row's completion as a branch, its positions continuing from the prompt's end (every token keeps
    the position it has in its own row). The training forward runs the sequences back to back in one row, without
    padding between them (the written-out layers), or as a (B, L) batch each padded to the longest (the model's own
    forward, whose 4-D mask would otherwise cover every sequence's positions against every other's); the indices here
    point into its positions, flattened, whichever the layout: the attention reads them by index.

    Each completion attends to its prompt and to its own branch, never to another branch. `_tree_attention` computes
    that as two SDPA calls with boolean masks instead of one (L, L) mask that is mostly false: the prompts attend
    causally among themselves, (B, Pm) queries; each branch's tokens, (R, Cm) queries, attend to their sequence's
    prompt and their own branch's earlier tokens, (Pm + Cm) keys. The prompt's keys and values are shared by its
    branches, so its gradient sums over them by autograd. Entries past a prompt's or a branch's length are padding:
    they index a real position, no real query attends them, and their outputs are never read.
    """
    prompt: torch.Tensor      # (B, Pm) each sequence's prompt positions, in order (padded)
    prompt_len: torch.Tensor  # (B,)
    branch: torch.Tensor      # (R, Cm) each branch's positions, in order (padded); None when no branch has a token
    group: torch.Tensor       # (R,) the sequence whose prompt each branch continues
    inverse: torch.Tensor     # (B * L,) where each position's output is in cat(prompt block, branch block), flattened

    def attend(self, window):
        """The masks of the layers with this sliding window (None: full attention), a TreeMask. The window counts
        positions, as in a row alone: a branch's token at j sees the prompt's last `window - 1 - j` tokens."""
        pm, dev = self.prompt.shape[1], self.prompt.device
        i = torch.arange(pm, device=dev)
        prompts = None  # causal
        if window is not None and pm > window:
            prompts = (i[None] <= i[:, None]) & (i[:, None] - i[None] < window)
        branches = None
        if self.branch is not None:
            r, cm = self.branch.shape
            c = torch.arange(cm, device=dev)
            start = self.prompt_len[self.group][:, None, None]  # (R, 1, 1) the position of each branch's first token
            to_prompt = i[None, None] < start                    # (R, 1, Pm)
            to_branch = c[None] <= c[:, None]                    # (Cm, Cm) causal within the branch
            if window is not None:
                to_prompt = to_prompt & (start + c[None, :, None] - i[None, None] < window)  # (R, Cm, Pm)
                to_branch = to_branch & (c[:, None] - c[None] < window)
            branches = torch.cat([to_prompt.expand(r, cm, pm), to_branch.expand(r, cm, cm)], -1)[:, None]
        return TreeMask(self, prompts, branches)


@dataclasses.dataclass
class TreeMask:
    """A Tree with the masks of one sliding window: prompts (Pm, Pm) or None for causal; branches (R, 1, Cm, Pm + Cm)
    over each branch's prompt keys then its own."""
    tree: Tree
    prompts: torch.Tensor
    branches: torch.Tensor

    def __call__(self, q, k, v, p):
        return _tree_attention(q, k, v, self, p)


def _tree_attention(q, k, v, mask, p):
    """`attention` over a Tree's sequences: q (B, L, heads, hd), k, v (B, L, kv heads, hd) -> (B, L, heads, hd)."""
    tree, shape = mask.tree, q.shape
    q, k, v = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)  # (B * L, heads, hd)

    def block(x, index):  # (n, heads, len, hd): the positions of `index` (n, len), in attention's layout
        return x[index].transpose(1, 2)
    kp, vp = block(k, tree.prompt), block(v, tree.prompt)
    out = [attention(block(q, tree.prompt), kp, vp, mask.prompts, p, causal=mask.prompts is None,
                     gqa=mask.prompts is None or not q.is_cuda)]
    if tree.branch is not None:  # each branch's keys: its prompt's, then its own
        kb = torch.cat([kp[tree.group], block(k, tree.branch)], 2)
        vb = torch.cat([vp[tree.group], block(v, tree.branch)], 2)
        out.append(attention(block(q, tree.branch), kb, vb, mask.branches, p, gqa=not q.is_cuda))
    return torch.cat([o.transpose(1, 2).flatten(0, 1) for o in out])[tree.inverse].view(shape)


def tree_refusal(model):
    """Why the model's own forward cannot take rows packed as trees (--shared_prompts), None where it can. (The
    written-out training forward always can: `hidden_states` takes the Tree as its attention_mask.) It can where the
    family table describes the model, so that its masks are known (every layer softmax attention, its sliding windows
    one per layer type), and its attention takes a 4-D mask as given (sdpa, eager): the MoE families (Qwen3-MoE,
    Qwen2-MoE, gpt-oss), which train on their own forward, a dense family on it (in training mode with attention
    dropout), and Qwen3.5, whose Gated DeltaNet layers (`_refusal` checks that layers/static_recurrent.py reads them)
    take the tree's layout and fork their states at each prompt's end (`static_recurrent.fork`). Not: a model the
    table does not describe, whose forward may build its own masks."""
    common = _refusal(model)
    if common is not None:
        return common
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in ("sdpa", "eager"):
        return f"attention implementation {impl!r}, which may not take a 4-D mask as given"
    if tree_windows(model) is None:
        return "sliding windows that differ between layers of one layer type"
    return None


def recurrent_modules(model):
    """The model's Gated DeltaNet modules (its recurrent layers' `linear_attn`), in layer order."""
    return [layer.linear_attn for layer in model.model.layers if not _attends(layer)]


def tree_windows(model):
    """The sliding windows of the model's own forward for a tree's masks: {None: window} where every layer has the
    same (None: full attention), else {layer type: window} (the mapping the forward looks its masks up in); None
    where layers of one type differ."""
    windows = _windows(model, _layer_family(model.model.layers[0]))
    if len(set(windows)) == 1:
        return {None: windows[0]}
    kinds = getattr(model.config, "layer_types", None)
    if not kinds or len(kinds) != len(windows):
        return None
    out = {}
    for kind, w in zip(kinds, windows):
        if out.setdefault(kind, w) != w:
            return None
    return out


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
    graph = torch.compile(_layer, backend=backend, fullgraph=True)

    def compiled(x, cos, sin, mask, p):  # rows and positions dynamic (marked after FSDP's casts, which copy)
        _dynamic_shape(x, 0, 1), _dynamic_shape(cos, 0, 1), _dynamic_shape(sin, 0, 1), _dynamic_shape(mask, 0, 2, 3)
        return graph(x, cos, sin, mask, p)
    return compiled


def _dynamic_shape(t, *dims):
    """Mark these dims of t dynamic for torch.compile (not an error where it specialises them, as for 1)."""
    if t is not None:
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(t, dim)
