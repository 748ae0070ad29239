"""Llama/Qwen2 layers written out: the fast decoder behind `sampling.sample`, and the training forward.

`sampling.sample` asks `static_decode_supported(model)` and, when it holds,
decodes with `StaticDecoder`: its own fused copy of the weights, a cache
allocated once, CUDA graphs on GPU. `grpo.completion_logprobs` asks
`training_forward_supported(model)` and, when it holds, runs
`hidden_states`: the same layers on the model's own parameters, with
autograd. Both compute what the Hugging Face forward computes (the tests
compare them); other models take that forward.

Of the project it imports only kernels.py (the optional Triton decode attention).
"""

import functools
import types

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import kernels

_STATIC_LAYERS = ("Qwen2DecoderLayer", "LlamaDecoderLayer")


def _class_names(module):
    return {c.__name__ for c in type(module).__mro__}  # FSDP2 subclasses the layer class; look through it


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
    """True for a Llama/Qwen2-family causal LM whose layers this file reproduces exactly (sharded or not)."""
    inner, cfg = getattr(model, "model", None), model.config
    layers = getattr(inner, "layers", None)
    if layers is None or getattr(inner, "rotary_emb", None) is None or getattr(inner, "norm", None) is None:
        return False
    if type(getattr(model, "lm_head", None)) is not torch.nn.Linear or type(getattr(inner, "embed_tokens", None)) \
            is not torch.nn.Embedding:
        return False
    if getattr(cfg, "hidden_act", None) != "silu" or any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
        return False
    for layer in layers:
        if not _class_names(layer) & set(_STATIC_LAYERS):
            return False
        a, m = layer.self_attn, layer.mlp
        if any(type(x) is not torch.nn.Linear for x in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)):
            return False
    return True


def static_decode_supported(model):
    """True for a Llama/Qwen2-family causal LM whose layers StaticDecoder reproduces exactly.

    Anything else (other architectures, sliding-window layers, adapters that
    replace the projections, shards it cannot gather) takes the Hugging Face
    forward. Sharded decoder layers are fine when they can gather themselves
    (FSDP2 blocks): the decoder copies them one at a time. The embeddings, final
    norm and head must be whole, as they are inside a sharded root's forward.
    """
    if not _reproduced(model):
        return False
    inner = model.model
    if any(_is_sharded(layer) and not _gathers_itself(layer) for layer in inner.layers):
        return False
    return not any(_is_sharded(m) for m in (inner.embed_tokens, inner.norm, model.lm_head, inner.rotary_emb))


def _rms_norm(x, weight, eps):
    # as Qwen2RMSNorm / LlamaRMSNorm: normalise in float32, scale in the input dtype
    if x.dtype == torch.float32:  # the same arithmetic in one call
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x, cos, signed_sin):
    """Rotary embedding: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1).

    `signed_sin` carries rotate_half's minus sign (its first half negated), so
    the halves only need swapping: a roll by half the head dimension.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)


def _repeat_kv(t, rep):
    """(B, kv_heads, S, hd) -> (B, kv_heads * rep, S, hd): each K/V head repeated for the query heads it serves."""
    return t[:, :, None].expand(-1, -1, rep, -1, -1).flatten(1, 2)


def _signed_sin(sin):
    """The rotary sin table with its first half negated, as `_rotate` takes it."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def _padded_causal_mask(attn):
    """(N, 1, S, S) boolean attention mask: causal, and no key at a padding position of attn (N, S).

    A padding query attends at least to itself, so that its (unused) output stays finite.
    """
    s = attn.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=attn.device).tril()
    return ((causal & attn.bool()[:, None, :]) | torch.eye(s, dtype=torch.bool, device=attn.device))[:, None]


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
    if not _reproduced(model):
        return False
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
    """The final-norm hidden states (N, S, H) of a Llama/Qwen2 model, on its own parameters, differentiable.

    What `model.base_model(...).last_hidden_state` computes (tests compare the
    values and gradients), in fewer elementwise passes and without the
    per-call mask and cache bookkeeping: on a small model the Hugging Face
    forward spends much of its time there. attention_mask None means no
    padding (plain causal attention). With activation checkpointing on, the
    layers the Hugging Face forward would recompute in backward are recomputed,
    with the same checkpoint function. compiled: each layer's arithmetic runs
    through `torch.compile` (`compiled_layer`), one graph shared by all layers.
    """
    inner = model.model
    x = inner.embed_tokens(input_ids)  # the module: its padding_idx row gets no gradient, as in the HF forward
    cos, sin = inner.rotary_emb(x, position_ids)  # (N, S, head_dim) in x's dtype
    cos, sin = cos[:, :, None], _signed_sin(sin)[:, :, None]  # broadcast over heads
    mask = None if attention_mask is None else _padded_causal_mask(attention_mask)
    math = compiled_layer() if compiled else _layer
    for layer in inner.layers:
        call = _fsdp_layer_method(layer) if _gathers_itself(layer) else functools.partial(_layer_on, layer)
        # activation checkpointing exactly where and how the Hugging Face layer would apply it
        if getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled():
            checkpoint = getattr(layer, "_gradient_checkpointing_func", None) or _default_checkpoint
            x = checkpoint(call, math, x, cos, sin, mask)
        else:
            x = call(math, x, cos, sin, mask)
    return _rms_norm(x, inner.norm.weight, inner.norm.variance_epsilon)


def _layer_on(layer, math, x, cos, sin, mask):
    """`math` (`_layer` or its compiled form) on this layer's parameters, as they are at the call: gathered,
    under FSDP, by the hooks around `_fsdp_layer_method`."""
    if math is not _layer:  # compiled: rows and positions dynamic (after FSDP's casts, which copy)
        _dynamic_shape(x, 0, 1), _dynamic_shape(cos, 0, 1), _dynamic_shape(sin, 0, 1), _dynamic_shape(mask, 0, 2, 3)
    return math(x, cos, sin, mask, *_layer_params(layer))


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
    """A decoder layer's tensors and constants, in `_layer`'s order after (x, cos, sin, mask)."""
    a, m = layer.self_attn, layer.mlp
    n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
    return (n1.weight, a.q_proj.weight, a.q_proj.bias, a.k_proj.weight, a.k_proj.bias, a.v_proj.weight,
            a.v_proj.bias, a.o_proj.weight, a.o_proj.bias, n2.weight, m.gate_proj.weight, m.gate_proj.bias,
            m.up_proj.weight, m.up_proj.bias, m.down_proj.weight, m.down_proj.bias,
            n1.variance_epsilon, n2.variance_epsilon, a.head_dim, a.scaling)


def _layer(x, cos, sin, mask, n1, wq, bq, wk, bk, wv, bv, wo, bo, n2, wg, bg, wu, bu, wd, bd, eps1, eps2, hd, scaling):
    """One decoder layer as a function of tensors (None for a missing bias), the weights among them, so that
    one compiled graph serves every layer."""
    b, s, _ = x.shape
    h = _rms_norm(x, n1, eps1)
    q, k, v = (F.linear(h, w, bias).view(b, s, -1, hd) for w, bias in ((wq, bq), (wk, bk), (wv, bv)))
    q, k, v = _rotate(q, cos, sin).transpose(1, 2), _rotate(k, cos, sin).transpose(1, 2), v.transpose(1, 2)
    # grouped-query attention (each K/V head serves `rep` query heads): SDPA's enable_gqa needs no copies of
    # K/V, but on CUDA the kernel that takes a mask (memory-efficient) lacks it, so masked CUDA calls copy
    rep = q.shape[1] // k.shape[1]
    gqa = rep > 1 and (mask is None or not q.is_cuda)
    if rep > 1 and not gqa:
        k, v = _repeat_kv(k, rep), _repeat_kv(v, rep)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling,
                                       enable_gqa=gqa)
    x = x + F.linear(o.transpose(1, 2).reshape(b, s, -1), wo, bo)
    h = _rms_norm(x, n2, eps2)
    return x + F.linear(F.silu(F.linear(h, wg, bg)) * F.linear(h, wu, bu), wd, bd)


_COMPILED = {}


def compiled_layer():
    """`_layer` through torch.compile, built on first use: the norms, rotary, SiLU gate and residual adds
    fused around the matmuls and the attention kernel, which eager runs as separate passes. The weights
    are the graph's inputs, so every layer shares it; rows and positions are dynamic (`_dynamic_shape`),
    the weights' shapes static. A few variants still compile apart: with and without grad (the
    reference's forward), a micro-batch of one row, an attention mask."""
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
    """A Llama/Qwen2 decoder over a preallocated KV cache, on its own copy of the model's weights.

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
    the padded sequence, so rows of a bucket are a contiguous view.
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
        a0 = layers[0].self_attn
        self.device, self.dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
        self.max_batch, self.max_len = max_batch, max_len
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, a0.head_dim
        self.scale = a0.scaling
        self.eps = [(l.input_layernorm.variance_epsilon, l.post_attention_layernorm.variance_epsilon) for l in layers]
        self.final_eps = model.model.norm.variance_epsilon
        kw = dict(device=self.device, dtype=self.dtype)
        shape = (len(layers), max_batch, self.n_kv, max_len, self.head_dim)
        self.k_cache, self.v_cache = torch.zeros(shape, **kw), torch.zeros(shape, **kw)
        self.key_mask = torch.zeros(max_batch, max_len, dtype=torch.bool, device=self.device)
        self.cos = torch.zeros(max_batch, max_len, self.head_dim, **kw)  # rotary tables per row and position
        self.sin = torch.zeros_like(self.cos)  # sin with its first half negated (see _rotate)
        self.w = None  # weight copies, allocated by the first load
        self.tok_in = torch.zeros(max_batch, dtype=torch.long, device=self.device)  # graph inputs
        self.slot_in = torch.zeros(max_batch, dtype=torch.long, device=self.device)  # each row's cache slot
        self.row_index = torch.arange(max_batch, device=self.device)
        self.graphs = {}  # (batch bucket, cache span) -> (graph, logits output)
        # a graph attends over a fixed span of cache slots: spans grow in steps (at most 8 of them), so early
        # tokens do not read the whole cache, at the price of one graph per span
        self.span_step = 64 * -(-max_len // (64 * 8))
        self.use_graph = False
        self.sdpa_decode = self.device.type == "cuda"  # decode attention: SDPA, or two batched matmuls (CPU)
        self.attention_kernel = False  # decode attention by kernels.decode_attention (CUDA, Triton) instead
        self.unpadded = False
        self.unmarked = None  # (rows, first slot, last slot) decoded unpadded without marking key_mask (below)
        self.compactions = 0  # how often finished rows were dropped (tests check that it happens)

    @torch.no_grad()
    def load(self, model):
        """Copy the model's weights in (fused), layer by layer; under FSDP2 each layer is gathered just for its copy."""
        def biases(*lins):  # the fused projections' bias pieces; None when none of them has a bias
            if all(lin.bias is None for lin in lins):
                return None
            return [lin.bias if lin.bias is not None else
                    torch.zeros(lin.out_features, device=self.device, dtype=self.dtype) for lin in lins]

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

        first = self.w is None
        if first:
            self.w = ([{} for _ in model.model.layers], {})
        for l, mine in zip(model.model.layers, self.w[0]):
            gather = _is_sharded(l)  # static_decode_supported let it through: it gathers itself
            if gather:
                l.unshard()  # a collective: every rank loads the same layers in the same order
            a, m = l.self_attn, l.mlp
            put(mine, {
                "ln1": [l.input_layernorm.weight], "ln2": [l.post_attention_layernorm.weight],
                "qkv": [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight],
                "qkv_b": biases(a.q_proj, a.k_proj, a.v_proj),
                "o": [a.o_proj.weight], "o_b": biases(a.o_proj),
                "gate_up": [m.gate_proj.weight, m.up_proj.weight],
                "gate_up_b": biases(m.gate_proj, m.up_proj),
                "down": [m.down_proj.weight], "down_b": biases(m.down_proj),
            })
            if gather:
                l.reshard()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        if first and head.data_ptr() == embed.data_ptr():  # tied: one copy serves both
            put(self.w[1], {"embed": [embed], "norm": [model.model.norm.weight]})
            self.w[1]["lm_head"] = self.w[1]["embed"]
        else:
            put(self.w[1], {"embed": [embed], "norm": [model.model.norm.weight], "lm_head": [head]})
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
        for buf in (self.key_mask, self.cos, self.sin):
            buf[:k] = buf[keep]

    def _layers(self, x, cos, sin, write, keys, attn_mask):
        """Prefill: x (B, S, H) through every layer; write(layer, k, v) stores the new K/V; keys(layer) -> cached K, V."""
        b, s, _ = x.shape
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        for i, w in enumerate(self.w[0]):
            eps1, eps2 = self.eps[i]
            h = _rms_norm(x, w["ln1"], eps1)
            qkv = F.linear(h, w["qkv"], w["qkv_b"]).view(b, s, nh + 2 * nkv, hd)
            qk = _rotate(qkv[:, :, :nh + nkv], cos, sin)  # rotary on queries and keys in one pass
            q, k = qk[:, :, :nh].transpose(1, 2), qk[:, :, nh:].transpose(1, 2)  # (B, nh, S, hd), (B, nkv, S, hd)
            write(i, k, qkv[:, :, nh + nkv:].transpose(1, 2))
            kk, vv = keys(i)
            o = F.scaled_dot_product_attention(q, _repeat_kv(kk, nh // nkv), _repeat_kv(vv, nh // nkv),
                                               attn_mask=attn_mask, scale=self.scale)
            o = o.transpose(1, 2).reshape(b, s, nh * hd)
            x = self._mlp(x, o, w, eps2)
        return x

    def _decode_layers(self, x, cos, sin, write, keys, attn_mask):
        """Decode: x (B, H), one token per row, through every layer: the arithmetic of `_layers` with no
        sequence axis, which saves a sixth of the operations per token (views and transposes), a
        difference that shows on small CPU batches."""
        b = x.shape[0]
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        for i, w in enumerate(self.w[0]):
            eps1, eps2 = self.eps[i]
            qkv = F.linear(_rms_norm(x, w["ln1"], eps1), w["qkv"], w["qkv_b"]).view(b, nh + 2 * nkv, hd)
            qk = _rotate(qkv[:, :nh + nkv], cos, sin)  # (B, nh + nkv, hd)
            write(i, qk[:, nh:], qkv[:, nh + nkv:])  # (B, nkv, hd) each
            kk, vv = keys(i)  # (B, nkv, L, hd)
            # group the query heads that share a KV head as the "sequence" axis, so grouped-query attention
            # needs no copy of K/V per query head
            qg = qk[:, :nh].view(b, nkv, nh // nkv, hd)
            if self.sdpa_decode and not self.attention_kernel:
                o = F.scaled_dot_product_attention(qg, kk, vv, attn_mask=attn_mask, scale=self.scale)
            else:  # the split-KV Triton kernel (CUDA), or on CPU its plain version: two batched matmuls, which
                # beat SDPA's setup cost at small CPU shapes
                o = kernels.decode_attention(qg, kk, vv, None if attn_mask is None else attn_mask[:, 0, 0],
                                             self.scale)
            x = self._mlp(x, o.reshape(b, nh * hd), w, eps2)
        return x

    @staticmethod
    def _mlp(x, o, w, eps):
        """The rest of a layer after attention: output projection and residual, then the MLP and its residual."""
        x = x + F.linear(o, w["o"], w["o_b"])
        gate, up = F.linear(_rms_norm(x, w["ln2"], eps), w["gate_up"], w["gate_up_b"]).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate).mul_(up), w["down"], w["down_b"])

    def _logits(self, x):
        head = self.w[1]
        return F.linear(_rms_norm(x, head["norm"], self.final_eps), head["lm_head"])

    @torch.no_grad()
    def prefill(self, ids, attn, positions):
        """Run the prompts (N, P), fill cache slots [0, P); return the last position's logits (N, V)."""
        n, p = ids.shape
        head = self.w[1]
        x = F.embedding(ids, head["embed"])
        # rotary tables for every position a row will use: prompt positions, then the completion's
        last = positions[:, -1:]
        all_pos = torch.cat([positions, last + 1 + torch.arange(self.max_len - p, device=ids.device)], dim=1)
        cos, sin = self.rotary(x, all_pos)
        sin = _signed_sin(sin)  # see _rotate
        self.cos[:n], self.sin[:n] = cos, sin
        self.key_mask[:n] = False
        self.key_mask[:n, :p] = attn.bool()
        # without left padding, eager decode over the filled slots needs no mask at all
        self.unpadded = not self.use_graph and bool(attn.bool().all())
        self.unmarked = None
        mask = _padded_causal_mask(attn)

        def write(i, k, v):
            self.k_cache[i, :n, :, :p] = k
            self.v_cache[i, :n, :, :p] = v

        def keys(i):
            return self.k_cache[i, :n, :, :p], self.v_cache[i, :n, :, :p]

        x = self._layers(x, cos[:, :p, None], sin[:, :p, None], write, keys, mask)
        return self._logits(x[:, -1])

    def _decode_body(self, b, slot, kv_len, tok=None):
        """One token for the first b rows, whose tokens are `tok` (eager) or in tok_in (graphs); each row's K/V go
        to its cache slot: `slot` is an int shared by all rows, or a tensor (b,) of one slot per row (the form
        graphs capture, read on the device at replay; rows that took turns of different lengths)."""
        x = F.embedding(self.tok_in[:b] if tok is None else tok, self.w[1]["embed"])  # (b, H)
        if torch.is_tensor(slot):  # per-row slots, graph-safe: no host value is read
            rows = self.row_index[:b]
            cos, sin = self.cos[rows, slot][:, None], self.sin[rows, slot][:, None]  # (b, 1, hd): over heads
            self.key_mask[rows, slot] = True
            attn_mask = self.key_mask[:b, None, None, :kv_len]  # (b, 1, 1, L): broadcast over heads and queries
        else:
            cos, sin = self.cos[:b, slot, None], self.sin[:b, slot, None]
            # eager decode without left padding, every row at the same slot, attends to every filled slot: no mask.
            # The slots it fills are marked in key_mask later, only if a step that reads the mask comes
            if self.unpadded:
                first = self.unmarked[1] if self.unmarked is not None else slot
                self.unmarked = (b, first, slot)
                attn_mask = None
            else:
                self.key_mask[:b, slot] = True
                attn_mask = self.key_mask[:b, None, None, :kv_len]

        def write(i, k, v):  # (b, nkv, hd) each
            if torch.is_tensor(slot):
                self.k_cache[i, rows, :, slot] = k
                self.v_cache[i, rows, :, slot] = v
            else:
                self.k_cache[i, :b, :, slot] = k
                self.v_cache[i, :b, :, slot] = v

        def keys(i):
            return self.k_cache[i, :b, :, :kv_len], self.v_cache[i, :b, :, :kv_len]

        return self._logits(self._decode_layers(x, cos, sin, write, keys, attn_mask))

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
        cos, sin = self.cos[rows, slots][:, :, None], self.sin[rows, slots][:, :, None]  # (b, K, 1, hd)

        def write(i, kk, vv):  # (b, nkv, K, hd): only the real tokens' K/V reach the cache
            self.k_cache[i, real_rows, :, real_slots] = kk.transpose(1, 2)[real_rows, real_cols]
            self.v_cache[i, real_rows, :, real_slots] = vv.transpose(1, 2)[real_rows, real_cols]

        def keys(i):
            return self.k_cache[i, :b, :, :kv_len], self.v_cache[i, :b, :, :kv_len]

        x = self._layers(F.embedding(ids, self.w[1]["embed"]), cos, sin, write, keys, mask)  # (b, K, H)
        last = valid.long().sum(1) - 1
        return self._logits(x[self.row_index[:b], last])

    @torch.no_grad()
    def truncate(self, rows, ends):
        """Forget rows' cache slots from ends[i] on (rows, ends (m,) tensors): what a row sampled past a stop
        is no longer attended, and is overwritten as the row goes on."""
        self._mark()
        keep = torch.arange(self.max_len, device=self.device) < ends[:, None]  # (m, L)
        self.key_mask[rows] &= keep

    def _capture(self, b, span):
        # warm-up on a side stream, then capture; running the body computes this very step's values, so the
        # cache slots it writes get the same contents the replay writes
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._decode_body(b, self.slot_in, span)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._decode_body(b, self.slot_in, span)
        return graph, out
