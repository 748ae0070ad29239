"""The GRPO algorithm as small functions: sampling, token log-probs, advantages, KL, loss.

Shapes: N completions in a batch, P prompts, G completions per prompt
(N = P * G, grouped so that rows g*G .. g*G+G-1 belong to prompt g),
T completion length, V vocabulary.

Nothing here imports the rest of the project; each function can be called
from a test with tensors and, where needed, a Hugging Face causal LM.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# ----------------------------------------------------------------------------- sampling


@dataclass
class Rollout:
    completion_ids: torch.Tensor   # (N, T) sampled tokens, pad after the first EOS
    completion_mask: torch.Tensor  # (N, T) 1 up to and including the first EOS
    truncated: torch.Tensor        # (N,) True when no EOS was produced within the length limit
    logprobs: torch.Tensor         # (N, T) float32 log-prob of each sampled token (temperature applied)


def position_ids_from_mask(attention_mask):
    """Left padding shifts where real tokens start: position 0 is each row's first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def completion_mask_from_ids(ids, eos_ids):
    """1 for every token up to and including the first EOS of its row, 0 after it.

    Works when pad == eos: padding after the first EOS is excluded, the first EOS is kept.
    """
    is_eos = torch.isin(ids, torch.as_tensor(eos_ids, device=ids.device))
    eos_before = is_eos.long().cumsum(-1) - is_eos.long()  # EOS tokens strictly before t
    return (eos_before == 0).to(torch.long)


def row_uniform(seeds, step):
    """One uniform number in (0, 1] per row, a pure function of (row seed, step).

    A counter-based hash instead of a stateful generator: a row draws the same
    numbers whatever else is in its batch (padding, other rows, other ranks), and
    drawing them needs no host synchronisation.
    """
    mask32 = 0xFFFFFFFF
    x = (seeds * 0x9E3779B1 + (step + 1) * 0x85EBCA77) & mask32
    # "lowbias32" integer finaliser (Chris Wellons' hash prospector); int64 products wrap, low 32 bits are exact
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & mask32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & mask32
    x = x ^ (x >> 16)
    return ((x >> 8) + 1).to(torch.float32) / float(1 << 24)


def filter_logits(logits, top_k=0, top_p=1.0):
    """Set logits outside the top-k and outside the top-p nucleus to -inf."""
    if top_k and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _last_below(weights, target):
    """Per row, the last entry of positive weight whose preceding mass is below `target` (n, 1).

    The inverse CDF written so that it lands on a positive-weight entry however
    the cumulative sum rounds (GPU scans are not sequential). A row with no mass
    (NaN logits) gets 0 rather than an index out of range.
    """
    before = weights.cumsum(-1) - weights
    index = torch.arange(weights.shape[-1], device=weights.device)
    return torch.where((before < target) & (weights > 0), index, -1).amax(-1, keepdim=True).clamp(min=0)


def _inverse_cdf(filtered, top, uniform, block=1024):
    """A token drawn with probability proportional to exp(filtered - top), by inverse CDF; returns (index, total).

    A large vocabulary is searched in two levels (block sums, then inside one
    block) so that no full-width scan runs per token; a small one takes the
    plain cumulative sum and a binary search.
    """
    n, v = filtered.shape
    if v <= 4 * block:
        cdf = (filtered - top).exp_().cumsum(-1)
        total = cdf[:, -1]
        # the first index whose cdf reaches u * total = the number of entries below it (cdf is non-decreasing)
        return torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:])[:, 0].clamp(max=v - 1), total
    nb = -(-v // block)
    weights = torch.empty(n, nb * block, device=filtered.device, dtype=torch.float32)
    weights[:, v:].zero_()  # padding to whole blocks carries no mass
    torch.sub(filtered, top, out=weights[:, :v]).exp_()
    weights = weights.view(n, nb, block)
    sums = weights.sum(-1)  # (n, nb)
    total = sums.sum(-1)
    target = uniform[:, None] * total[:, None]  # (n, 1), > 0
    b = _last_below(sums, target)  # the block holding the target
    mass_before = (sums.cumsum(-1) - sums).gather(1, b)
    inner = weights.gather(1, b[:, :, None].expand(-1, -1, block))[:, 0]  # (n, block)
    j = _last_below(inner, target - mass_before)
    return (b * block + j)[:, 0], total


def sample_tokens(logits, temperature, top_k, top_p, uniform):
    """Pick one token per row; return it with its log-prob under the unfiltered tempered distribution.

    The log-prob ignores top-k / top-p on purpose: it is what the training
    forward computes for the same token, so the first iteration's ratio is 1.
    Sampling is by inverse CDF with the row's own uniform number.
    """
    logits = logits.float()
    if temperature == 0:  # greedy
        token = logits.argmax(-1)
        return token, torch.log_softmax(logits, -1).gather(-1, token[:, None])[:, 0]
    scaled = logits if temperature == 1 else logits / temperature
    top = scaled.amax(-1, keepdim=True)
    filtered = filter_logits(scaled, top_k, top_p)
    # unnormalised probabilities exp(filtered - top): the search compares against u * total, so no division
    token, total = _inverse_cdf(filtered, top, uniform)
    if filtered is not scaled:  # the log-prob is normalised over the unfiltered distribution
        total = (scaled - top).exp().sum(-1)
    return token, scaled.gather(-1, token[:, None])[:, 0] - top[:, 0] - total.log()


@torch.no_grad()
def sample(model, prompt_ids, prompt_mask, *, max_new_tokens, eos_ids, pad_id, temperature=1.0, top_k=0,
           top_p=1.0, seeds=None, check_every=8, all_done=None, static_cache=True, compact=True, cuda_graph=True,
           keep_decoder=False):
    """Generate completions for left-padded prompts: a prefill, then one token at a time over a KV cache.

    Each row stops at its first EOS; the loop stops once every row has, checking
    on the host only every `check_every` tokens, or at `max_new_tokens`.
    `seeds` (N,) int64 fixes each row's random stream; rows with equal seeds
    and equal prompts sample equal completions.
    `all_done(done) -> bool` decides when to stop; under several processes it
    must agree across ranks (an all-reduce), so that every rank runs the same
    number of forwards and none waits forever on a collective.

    static_cache: for Llama/Qwen2-family models, decode with `StaticDecoder`
    (a preallocated cache and no per-token framework overhead); other models,
    or static_cache=False, run the Hugging Face forward over a DynamicCache.
    compact: at each check, drop finished rows from the decode batch.
    cuda_graph: on CUDA, replay each decode step as a captured CUDA graph.
    keep_decoder: keep StaticDecoder's weight copies, cache and graphs on the
    model for the next call (no re-copy or re-capture) at the price of that
    memory between calls; by default they are freed when sampling ends.
    """
    if all_done is None:
        all_done = lambda done: bool(done.all())  # noqa: E731
    n = prompt_ids.shape[0]
    device = prompt_ids.device
    if seeds is None:
        seeds = torch.arange(n, device=device)
    seeds = seeds.to(device=device, dtype=torch.long)
    # every row's random numbers for the whole completion at once: row_uniform is elementwise, so these
    # are the same numbers as drawing step by step
    uniforms = row_uniform(seeds[:, None], torch.arange(max_new_tokens, device=device)[None, :])  # (N, T)
    args = (prompt_ids, prompt_mask.long(), max_new_tokens, torch.as_tensor(eos_ids, device=device), pad_id,
            (temperature, top_k, top_p), uniforms, check_every, all_done)
    if static_cache and static_decode_supported(model):
        tokens, logps, done = _sample_static(model, *args, compact=compact, cuda_graph=cuda_graph,
                                             keep_decoder=keep_decoder)
    else:
        tokens, logps, done = _sample_hf(model, *args)
    mask = completion_mask_from_ids(tokens, eos_ids)
    return Rollout(tokens.masked_fill(mask == 0, pad_id), mask, ~done, logps.masked_fill(mask == 0, 0.0))


def _sample_hf(model, prompt_ids, attn, max_new_tokens, eos, pad_id, sampling, uniforms, check_every, all_done):
    """The plain loop: the model's own forward over a DynamicCache, all rows to the end."""
    from transformers import DynamicCache

    n, device = prompt_ids.shape[0], prompt_ids.device
    positions = position_ids_from_mask(attn)
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=prompt_ids, attention_mask=attn, position_ids=positions, past_key_values=cache,
                   use_cache=True, logits_to_keep=1).logits[:, -1]
    next_pos = positions[:, -1] + 1  # (N,)
    tokens = torch.full((n, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logps = torch.zeros(n, max_new_tokens, dtype=torch.float32, device=device)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    length = max_new_tokens
    for t in range(max_new_tokens):
        tok, lp = sample_tokens(logits, *sampling, uniforms[:, t])
        tokens[:, t] = torch.where(done, pad_id, tok)
        logps[:, t] = torch.where(done, 0.0, lp)
        done = done | torch.isin(tok, eos)
        if t == max_new_tokens - 1 or ((t + 1) % check_every == 0 and all_done(done)):
            length = t + 1
            break
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
        logits = model(input_ids=tokens[:, t:t + 1], attention_mask=attn, position_ids=next_pos[:, None],
                       past_key_values=cache, use_cache=True).logits[:, -1]
        next_pos = next_pos + 1
    return tokens[:, :length], logps[:, :length], done


def _sample_static(model, prompt_ids, attn, max_new_tokens, eos, pad_id, sampling, uniforms, check_every,
                   all_done, compact, cuda_graph, keep_decoder):
    """The fast loop: StaticDecoder, with finished rows compacted out of the decode batch.

    Live state covers only the rows still decoding (`rows` holds their indices in
    the batch); a row's results are written out when it leaves, or at the end.
    """
    n, p = prompt_ids.shape
    device = prompt_ids.device
    dec = StaticDecoder.for_model(model, n, p + max_new_tokens, cuda_graph=cuda_graph)
    positions = position_ids_from_mask(attn)
    logits = dec.prefill(prompt_ids, attn, positions)  # (N, V)
    tokens = torch.full((n, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logps = torch.zeros(n, max_new_tokens, dtype=torch.float32, device=device)
    done = torch.ones(n, dtype=torch.bool, device=device)  # rows no longer live are done
    rows = torch.arange(n, device=device)
    live_tok, live_lp = tokens.clone(), logps.clone()
    live_done = torch.zeros(n, dtype=torch.bool, device=device)
    live_uni = uniforms
    length = max_new_tokens
    for t in range(max_new_tokens):
        # a finished row keeps sampling until the next check; `sample` masks what follows its first EOS
        live_tok[:, t], live_lp[:, t] = sample_tokens(logits, *sampling, live_uni[:, t])
        last = t == max_new_tokens - 1
        if last or (t + 1) % check_every == 0:
            live_done = torch.isin(live_tok[:, :t + 1], eos).any(1)
            done[rows] = live_done
            if last or all_done(done):
                length = t + 1
                break
            if compact:
                keep = (~live_done).nonzero()[:, 0]
                if dec.worth_compacting(keep.numel(), rows.numel()):
                    tokens[rows], logps[rows] = live_tok, live_lp
                    dec.compact(keep, p + t + 1)
                    rows = rows[keep]
                    live_tok, live_lp, live_uni = live_tok[keep], live_lp[keep], live_uni[keep]
        logits = dec.decode(live_tok[:, t], p + t)
    tokens[rows], logps[rows] = live_tok, live_lp
    done[rows] = live_done
    if not keep_decoder:  # give the weight copies and the cache back before training needs the memory
        model.__dict__.pop("_static_decoder", None)
    return tokens[:, :length], logps[:, :length], done


# ----------------------------------------------------------------------------- the static-cache decoder

_STATIC_LAYERS = ("Qwen2DecoderLayer", "LlamaDecoderLayer")


def _class_names(module):
    return {c.__name__ for c in type(module).__mro__}  # FSDP2 subclasses the layer class; look through it


def _is_sharded(module):
    """True when some parameter of `module` is a DTensor shard (FSDP2 outside a gather)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return any(isinstance(w, DTensor) for w in module.parameters())


def _gathers_itself(module):
    """An FSDP2-sharded block: `unshard()` gathers its full parameters, `reshard()` frees them again."""
    return callable(getattr(module, "unshard", None)) and callable(getattr(module, "reshard", None))


def static_decode_supported(model):
    """True for a Llama/Qwen2-family causal LM whose layers StaticDecoder reproduces exactly.

    Anything else (other architectures, sliding-window layers, adapters that
    replace the projections, shards it cannot gather) takes the Hugging Face
    forward. Sharded decoder layers are fine when they can gather themselves
    (FSDP2 blocks): the decoder copies them one at a time. The embeddings, final
    norm and head must be whole, as they are inside a sharded root's forward.
    """
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
    if any(_is_sharded(layer) and not _gathers_itself(layer) for layer in layers):
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
    def for_model(cls, model, batch, length, cuda_graph=True):
        dec = getattr(model, "_static_decoder", None)
        device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
        if dec is None or dec.device != device or dec.dtype != dtype or batch > dec.max_batch or length > dec.max_len:
            if dec is not None:  # grow: free the old buffers first
                del model._static_decoder, dec
            dec = cls(model, batch, -(-length // 64) * 64)  # slots in multiples of 64: fewer regrowths, aligned
            model.__dict__["_static_decoder"] = dec  # not a submodule: no state_dict entry, no .to() surprises
        dec.use_graph = cuda_graph and device.type == "cuda"
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
        self.slot_in = torch.zeros(1, dtype=torch.long, device=self.device)
        self.graphs = {}  # (batch bucket, cache span) -> (graph, logits output)
        # a graph attends over a fixed span of cache slots: spans grow in steps (at most 8 of them), so early
        # tokens do not read the whole cache, at the price of one graph per span
        self.span_step = 64 * -(-max_len // (64 * 8))
        self.use_graph = False
        self.unpadded = False
        self.compactions = 0  # how often finished rows were dropped (tests check that it happens)

    @torch.no_grad()
    def load(self, model):
        """Copy the model's weights in (fused), layer by layer; under FSDP2 each layer is gathered just for its copy."""
        def bias(*lins):  # one bias for the fused projections; None when none of them has one
            if all(lin.bias is None for lin in lins):
                return None
            return torch.cat([lin.bias if lin.bias is not None else
                              torch.zeros(lin.out_features, device=self.device, dtype=self.dtype) for lin in lins])

        def put(mine, new):  # first load: new tensors; later: in place, since captured graphs hold these addresses
            for k, v in new.items():
                if k not in mine:
                    mine[k] = None if v is None else v.detach().clone()
                elif mine[k] is not None and not (k == "lm_head" and mine[k] is mine["embed"]):
                    mine[k].copy_(v)

        first = self.w is None
        if first:
            self.w = ([{} for _ in model.model.layers], {})
        for l, mine in zip(model.model.layers, self.w[0]):
            gather = _is_sharded(l)  # static_decode_supported let it through: it gathers itself
            if gather:
                l.unshard()  # a collective: every rank loads the same layers in the same order
            a, m = l.self_attn, l.mlp
            put(mine, {
                "ln1": l.input_layernorm.weight, "ln2": l.post_attention_layernorm.weight,
                "qkv": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                "qkv_b": bias(a.q_proj, a.k_proj, a.v_proj),
                "o": a.o_proj.weight, "o_b": bias(a.o_proj),
                "gate_up": torch.cat([m.gate_proj.weight, m.up_proj.weight]),
                "gate_up_b": bias(m.gate_proj, m.up_proj),
                "down": m.down_proj.weight, "down_b": bias(m.down_proj),
            })
            if gather:
                l.reshard()
        head = {"embed": model.model.embed_tokens.weight, "norm": model.model.norm.weight, "lm_head": model.lm_head.weight}
        if first and head["lm_head"].data_ptr() == head["embed"].data_ptr():  # tied: one copy serves both
            put(self.w[1], {"embed": head["embed"], "norm": head["norm"]})
            self.w[1]["lm_head"] = self.w[1]["embed"]
        else:
            put(self.w[1], head)
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
        k = keep.numel()
        self.compactions += 1
        for buf in (self.k_cache, self.v_cache):
            buf[:, :k, :, :filled] = buf[:, keep, :, :filled]
        for buf in (self.key_mask, self.cos, self.sin):
            buf[:k] = buf[keep]

    def _layers(self, x, cos, sin, write, keys, attn_mask):
        """x (B, S, H) through every layer; write(layer, k, v) stores the new K/V; keys(layer) -> cached K, V."""
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
            if s == 1:
                # one query per row: group the query heads that share a KV head as the "sequence" axis, so
                # grouped-query attention needs no copy of K/V per query head
                qg = q.view(b, nkv, nh // nkv, hd)
                if x.is_cuda:
                    o = F.scaled_dot_product_attention(qg, kk, vv, attn_mask=attn_mask, scale=self.scale)
                else:  # small CPU shapes: two batched matmuls beat the fused kernel's setup cost
                    scores = torch.matmul(qg, kk.transpose(-1, -2)).mul_(self.scale)
                    if attn_mask is not None:
                        scores.masked_fill_(~attn_mask, float("-inf"))
                    o = torch.matmul(scores.softmax(-1), vv)
            else:
                rep = nh // nkv
                kk = kk[:, :, None].expand(-1, -1, rep, -1, -1).reshape(b, nh, -1, hd)
                vv = vv[:, :, None].expand(-1, -1, rep, -1, -1).reshape(b, nh, -1, hd)
                o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=attn_mask, scale=self.scale)
            o = o.reshape(b, nh, s, hd).transpose(1, 2).reshape(b, s, nh * hd)
            x = x + F.linear(o, w["o"], w["o_b"])
            h = _rms_norm(x, w["ln2"], eps2)
            gate, up = F.linear(h, w["gate_up"], w["gate_up_b"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate).mul_(up), w["down"], w["down_b"])
        return x

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
        half = self.head_dim // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)  # see _rotate
        self.cos[:n], self.sin[:n] = cos, sin
        self.key_mask[:n] = False
        self.key_mask[:n, :p] = attn.bool()
        # without left padding, eager decode over the filled slots needs no mask at all
        self.unpadded = not self.use_graph and bool(attn.bool().all())
        causal = torch.ones(p, p, dtype=torch.bool, device=ids.device).tril()
        # a padding query attends at least to itself, so its (unused) output stays finite
        mask = (causal & attn.bool()[:, None, :]) | torch.eye(p, dtype=torch.bool, device=ids.device)
        mask = mask[:, None]  # (N, 1, P, P)

        def write(i, k, v):
            self.k_cache[i, :n, :, :p] = k
            self.v_cache[i, :n, :, :p] = v

        def keys(i):
            return self.k_cache[i, :n, :, :p], self.v_cache[i, :n, :, :p]

        x = self._layers(x, cos[:, :p, None], sin[:, :p, None], write, keys, mask)
        return self._logits(x[:, -1])

    def _decode_body(self, b, slot, kv_len):
        """One token for the first b rows, whose tokens are in tok_in; K/V go to `slot` (an int, or on graphs a tensor)."""
        x = F.embedding(self.tok_in[:b, None], self.w[1]["embed"])  # (b, 1, H)
        if torch.is_tensor(slot):  # graph-safe forms: the slot is read on the device at replay
            cos, sin = (t[:b].index_select(1, slot)[:, :, None] for t in (self.cos, self.sin))  # (b, 1, 1, hd)
            self.key_mask[:b].index_fill_(1, slot, True)
            attn_mask = self.key_mask[:b, None, None, :kv_len]  # (b, 1, 1, L): broadcast over heads and queries
        else:
            cos, sin = self.cos[:b, slot:slot + 1, None], self.sin[:b, slot:slot + 1, None]
            attn_mask = None
            if not self.unpadded:  # eager decode without left padding attends to every filled slot: no mask
                self.key_mask[:b, slot] = True
                attn_mask = self.key_mask[:b, None, None, :kv_len]

        def write(i, k, v):
            if torch.is_tensor(slot):
                self.k_cache[i, :b].index_copy_(2, slot, k)
                self.v_cache[i, :b].index_copy_(2, slot, v)
            else:
                self.k_cache[i, :b, :, slot] = k[:, :, 0]
                self.v_cache[i, :b, :, slot] = v[:, :, 0]

        def keys(i):
            return self.k_cache[i, :b, :, :kv_len], self.v_cache[i, :b, :, :kv_len]

        return self._logits(self._layers(x, cos, sin, write, keys, attn_mask)[:, 0])

    @torch.no_grad()
    def decode(self, tok, slot):
        """Logits (n, V) for the next token of the n live rows, given their last tokens (n,) at cache `slot`.

        Positions need no input: prefill filled each row's rotary table by slot.
        """
        n = tok.shape[0]
        b = self.batch_for(n)
        self.tok_in[:n] = tok
        if not self.use_graph:
            return self._decode_body(n, slot, slot + 1)  # eager: attend over the filled slots only
        self.slot_in.fill_(slot)
        span = min(self.max_len, -(-(slot + 1) // self.span_step) * self.span_step)  # slots [0, span) hold slot
        if (b, span) not in self.graphs:
            self.graphs[b, span] = self._capture(b, span)
        graph, out = self.graphs[b, span]
        graph.replay()
        return out[:n]

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


# ----------------------------------------------------------------------------- token log-probs


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """log softmax(hidden @ weight.T / temperature)[target] and the entropy, chunk by chunk of rows.

    Forward keeps one chunk of logits at a time and saves only the inputs and
    each row's log-sum-exp; backward recomputes a chunk's logits and writes the
    gradient d logp / d logits = (onehot(target) - softmax) / temperature
    directly, so each chunk costs two float32 (chunk, V) buffers and no
    autograd graph over the vocabulary. When all rows fit in one chunk, that
    chunk's log-probs are kept for backward instead of recomputed. The entropy
    is a metric: no gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk):
        n = hidden.shape[0]
        logp = torch.empty(n, device=hidden.device, dtype=torch.float32)
        entropy, lse = torch.empty_like(logp), torch.empty_like(logp)
        kept = None
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            z = F.linear(hidden[s:e], weight).float()
            if temperature != 1.0:
                z.div_(temperature)
            lse[s:e] = torch.logsumexp(z, -1)
            z.sub_(lse[s:e, None])  # now the log-probs of every token
            logp[s:e] = z.gather(-1, targets[s:e, None])[:, 0]
            entropy[s:e] = -z.exp().mul_(z).sum(-1)
            if n <= chunk and any(ctx.needs_input_grad[:2]):
                kept = z
        ctx.save_for_backward(hidden, weight, targets, lse, kept)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, targets, lse, kept = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[:2]
        grad_h = torch.empty_like(hidden) if want_h else None
        # the weight's gradient sums over every chunk: in float32, so that bf16 rounding does not grow with
        # the number of chunks (each chunk's product is still one bf16 matmul)
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if want_w else None
        n, chunk = hidden.shape[0], ctx.chunk
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            h = hidden[s:e]
            g = grad_logp[s:e, None].float()
            if kept is not None:  # the only chunk, kept from the forward
                z = kept.exp().mul_(-g)  # -g * softmax (not in place: a retained graph may run backward again)
            else:
                z = F.linear(h, weight).float()
                if ctx.temperature != 1.0:
                    z.div_(ctx.temperature)
                z.sub_(lse[s:e, None]).exp_().mul_(-g)  # -g * softmax
            z.scatter_add_(-1, targets[s:e, None], g)  # + g at the target
            if ctx.temperature != 1.0:
                z.div_(ctx.temperature)
            z = z.to(hidden.dtype)
            if want_h:
                grad_h[s:e] = z @ weight
            if want_w:
                if z.dtype == torch.float32:
                    grad_w.addmm_(z.t(), h)
                else:
                    grad_w += z.t() @ h
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None


def default_chunk_tokens(vocab_size, device):
    """Rows per chunk of the vocabulary projection: about 64 MB of float32 logits on CPU, 256 MB on GPU."""
    budget = 1 << (26 if torch.device(device).type == "cuda" else 24)
    return max(1, budget // vocab_size)


def completion_logprobs(model, input_ids, attention_mask, num_completion_tokens, temperature=1.0,
                        chunk_tokens=None):
    """Log-probs (and entropies) of the last `num_completion_tokens` tokens of each row, in float32.

    The transformer runs once; the vocabulary projection runs over chunks of
    `chunk_tokens` positions and is recomputed chunk by chunk in backward, so
    no (N, T, V) float32 tensor ever exists. Temperature is applied exactly as
    in `sample`. Returns (logp, entropy), each (N, T); entropy has no gradient.
    """
    t = num_completion_tokens
    positions = position_ids_from_mask(attention_mask)
    # no padding (every prompt the same length): plain causal attention, with no mask to build or apply
    mask = None if bool(attention_mask.all()) else attention_mask
    hidden = model.base_model(input_ids=input_ids, attention_mask=mask, position_ids=positions).last_hidden_state
    hidden = hidden[:, -t - 1:-1]  # (N, T, H): the position before each completion token predicts it
    n, _, h = hidden.shape
    hidden, targets = hidden.reshape(n * t, h), input_ids[:, -t:].reshape(n * t)
    weight = model.get_output_embeddings().weight
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0], weight.device)
    logp, entropy = _ChunkedTokenLogprobs.apply(hidden, weight, targets, float(temperature), chunk)
    return logp.view(n, t), entropy.view(n, t)


# ----------------------------------------------------------------------------- advantages


def group_advantages(rewards, group_size, scale="group", eps=1e-4):
    """(r - mean) / (std + eps) within each group of `group_size` consecutive completions.

    `rewards` (N,) float, NaN where no reward function could score a completion:
    those are left out of the statistics and get advantage 0. A group whose
    valid rewards are all equal (or has fewer than two) gets exactly 0.
    scale: "group" divides by the group's std (the paper), "batch" by the std of
    the whole batch (more robust to low-variance groups), "none" only centres
    (Dr. GRPO argues the std division biases towards easy and hard questions).
    Returns (advantages (N,), group_std (P,)).
    """
    r = rewards.float().view(-1, group_size)  # (P, G)
    valid = ~torch.isnan(r)
    n = valid.sum(1, keepdim=True)
    r0 = torch.where(valid, r, 0.0)
    mean = r0.sum(1, keepdim=True) / n.clamp(min=1)
    centred = torch.where(valid, r - mean, 0.0)
    std = (centred.pow(2).sum(1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()  # unbiased, like torch.std
    hi = torch.where(valid, r, float("-inf")).amax(1, keepdim=True)
    lo = torch.where(valid, r, float("inf")).amin(1, keepdim=True)
    flat = (hi <= lo) | (n < 2)  # all equal: no signal, and rounding in `mean` must not invent one
    if scale == "group":
        adv = centred / (std + eps)
    elif scale == "batch":
        all_valid = r[valid]
        batch_std = all_valid.std() if all_valid.numel() > 1 else torch.zeros((), device=r.device)
        adv = centred / (batch_std + eps)
    elif scale == "none":
        adv = centred
    else:
        raise ValueError(f"scale_rewards: unknown value {scale!r} (group, batch or none)")
    adv = torch.where(flat, 0.0, adv)
    return adv.reshape(-1), std.squeeze(1)


# ----------------------------------------------------------------------------- KL and loss


def k3_kl(ref_logp, logp):
    """Per-token KL(policy || ref) estimate exp(d) - d - 1 with d = ref - logp (Schulman's k3).

    Unbiased, non-negative, and computed in float32 with exp's argument capped so
    that it stays finite for any finite input, also from bfloat16.
    """
    d = ref_logp.float() - logp.float()
    return (torch.expm1(d.clamp(max=20.0)) - d).clamp(min=0.0)


LOSS_TYPES = ("grpo", "dapo", "dr_grpo")


def grpo_loss(logp, old_logp, ref_logp, advantages, mask, *, beta, epsilon, epsilon_high, loss_type,
              num_sequences, num_tokens, max_completion_length):
    """Clipped surrogate plus beta * k3 KL for one micro-batch, normalised over the whole batch.

    logp (n, T) requires grad; old_logp is the detached log-prob of the policy
    that sampled (logp.detach() when each batch is used once, so the ratio is 1);
    ref_logp is None when beta == 0; advantages (n,); mask (n, T).
    The normalisers describe the whole batch (all micro-batches, all ranks), so
    summing this loss's gradients over micro-batches gives the full-batch gradient:
      grpo:    mean over sequences of the per-sequence token mean (DeepSeekMath)
      dapo:    sum over all tokens / all tokens in the batch (DAPO's token-level loss)
      dr_grpo: sum over all tokens / (sequences * max_completion_length) (Dr. GRPO)
    Returns (loss, metrics) with metric means over this micro-batch's tokens.
    """
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None].to(logp.dtype)  # (n, 1)
    surrogate = torch.min(ratio * adv, ratio.clamp(1 - epsilon, 1 + epsilon_high) * adv)
    per_token = -surrogate
    kl = None
    if beta != 0:
        kl = k3_kl(ref_logp, logp)
        per_token = per_token + beta * kl
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / num_sequences
    elif loss_type == "dapo":
        loss = (per_token * mask).sum() / num_tokens
    elif loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (num_sequences * max_completion_length)
    else:
        raise ValueError(f"loss_type: unknown value {loss_type!r} (one of {', '.join(LOSS_TYPES)})")
    with torch.no_grad():
        count = mask.sum().clamp(min=1)
        low = ((ratio < 1 - epsilon) & (adv < 0)).to(mask.dtype)   # clipped from below: no gradient
        high = ((ratio > 1 + epsilon_high) & (adv > 0)).to(mask.dtype)
        metrics = {
            "kl": ((kl * mask).sum() / count).item() if kl is not None else 0.0,
            "clip_low": ((low * mask).sum() / count).item(),
            "clip_high": ((high * mask).sum() / count).item(),
            "tokens": mask.sum().item(),
        }
    return loss, metrics
