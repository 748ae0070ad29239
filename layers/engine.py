"""The fast decoder: `StaticDecoder`, the written-out layers (layers/transformer.py) over a KV cache allocated once.

It holds the weight copies the sampler decodes on (fused q/k/v and gate/up, a rank's slices under tensor
parallelism), the cache and its masks, prefill, one-token decode, the append of an environment's answer and the
compaction of finished rows. What each layer computes is layers/transformer.py's `layer`; this file decides what it
attends to and where it writes. One concern, the decoder's state: the cache, its masks and the copies are read and
written by every method here, and splitting them would pass that state between files.

Of the project it imports layers/transformer.py, layers/static_moe.py and layers/static_recurrent.py, and the
features it holds when they are on: layers/cuda_graphs.py (`graphs`, the CUDA graphs of decode steps) and
layers/routing.py (`recorder`, routing replay's records); layers/kernels.py (the optional Triton decode attention)
only where it is asked for. Shared prefill (layers/shared_prefill.py) runs the decoder's prefill from outside.
Tensor parallelism hands it a reader of its own (layers/tensor_parallel.py's Slice, in place of `Whole`), and a
LoRA layer says what weight it applies.
"""

import dataclasses
import itertools

import torch
import torch.nn.functional as F

from layers import cuda_graphs, routing, static_moe, static_recurrent, transformer


@dataclasses.dataclass(frozen=True)
class Whole:
    """How the decoder reads the model's weights when it holds them whole (one process, or a layer FSDP2 gathers for
    the copy): each as it applies now, uncut. Tensor parallelism replaces it with this rank's share of a group
    (layers/tensor_parallel.py's Slice), which reads the same weights through the same methods, cut. `to`: the
    copies' (device, dtype), set by the decoder; two readers that differ in it alone are equal."""
    rank: int = 0
    size: int = 1
    group: object = None
    to: tuple = dataclasses.field(default=None, compare=False)

    def span(self, n, what="a dimension", even=True):
        return 0, n

    def whole(self, t):
        return t

    def take(self, t, dim, spans, copy=False):
        """t's spans along dim, concatenated, where spans(reader) -> [(start, stop)] (a Gated DeltaNet layer's
        rows: static_recurrent.delta_net_spans)."""
        parts = [t.narrow(dim, a, b - a) for a, b in spans(self)]
        return torch.cat(parts, dim) if len(parts) > 1 else parts[0].clone() if copy else parts[0]

    def cut(self, t, kind, kv_heads=None):
        return t

    def bias(self, t, kind, kv_heads=None):
        return t

    def weight(self, module, kind, kv_heads=None):
        """The weight a linear layer applies now, detached: its own, or what it says it applies (a LoRA adapter's
        layer, its weight with the adapter's delta merged: `applied_weight`)."""
        applied = getattr(module, "applied_weight", None)
        return applied() if applied is not None else module.weight.detach()


WHOLE = Whole()


class StaticDecoder:
    """The decoder of a model `transformer.decide` admits, over a preallocated KV cache, on its own copy of the weights.

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

    # what the optional features set on a decoder, none of it made by its constructor:
    graphs = None  # the CUDA graphs of its decode steps (layers/cuda_graphs.py), set by for_model where they are on
    recorder = None  # routing replay's records per row and slot (layers/routing.py's Records), while on (`record`)
    # no row holds anything in the slots before this one (a Stream's rows, whose prompts are left-padded to the
    # longest a run may have): eager steps read the cache from here on, graphs from slot 0
    first_slot = 0
    admissions = 0  # rows admitted into the places of rows that ended (`admit`)
    compactions = 0  # how often finished rows were dropped (tests check that it happens)
    forgets_exactly = True  # a row's cache can drop exactly the slots past its stop; False with a recurrent layer

    @classmethod
    def for_model(cls, model, batch, length, cuda_graph=True, tp=WHOLE, dtype=None, device=None):
        """The model's decoder for `batch` rows of `length` slots, kept on the model between calls. tp: this rank's
        share of a tensor-parallel group (layers/tensor_parallel.py: its share of every layer and of the
        vocabulary); dtype, device: the copies' (the model's own head's by default; under tensor parallelism the
        sharded model's compute dtype and device, its shards being where FSDP2 keeps them, host memory with CPU
        offload). The decode attention is SDPA (`use_kernel` changes it)."""
        dec = getattr(model, "_static_decoder", None)
        device, dtype = device or model.lm_head.weight.device, dtype or model.lm_head.weight.dtype
        if dec is None or dec.device != device or dec.dtype != dtype or batch > dec.max_batch or \
                length > dec.max_len or dec.tp != tp:
            model.__dict__.pop("_static_decoder", None)  # grow: free the old buffers first
            dec = None  # (this name held them too)
            # slots in multiples of 64: fewer regrowths, aligned
            dec = cls(model, batch, -(-length // 64) * 64, tp=tp, dtype=dtype, device=device)
            model.__dict__["_static_decoder"] = dec  # not a submodule: no state_dict entry, no .to() surprises
        dec.graphs = (dec.graphs or cuda_graphs.Graphs(dec)) if cuda_graph and device.type == "cuda" else None
        dec.load(model)
        return dec

    def use_kernel(self, asked):
        """On CUDA, where `asked` and the shapes allow it, decode attention by the split-KV Triton kernel of
        layers/kernels.py (a feature: imported only when asked for), else by SDPA."""
        if self.device.type != "cuda":
            return
        kernel = None
        if asked:
            from layers import kernels
            kernel = _decode_kernel if kernels.triton_supports(self.head_dim, self.n_heads // self.n_kv) else None
        if kernel is not self.decode_kernel:  # graphs captured with the other attention must not replay
            if self.graphs is not None:
                self.graphs.clear()
            self.decode_kernel = kernel

    def __init__(self, model, max_batch, max_len, tp=WHOLE, dtype=None, device=None):
        cfg, spec = model.config, transformer._spec(model)  # spec: what every layer computes besides its weights
        self.fam = spec.fam
        self.device, self.dtype = device or model.lm_head.weight.device, dtype or model.lm_head.weight.dtype
        self.max_batch, self.max_len = max_batch, max_len
        self.config_kv = cfg.num_key_value_heads
        self.n_heads, self.n_kv = cfg.num_attention_heads, self.config_kv
        self.head_dim = next(s.head_dim for s in spec.layers if s.heads)
        self.vocab = model.lm_head.weight.shape[0]
        self.head = spec.head  # the final logits' transform (layers/head.py), as the training head applies it
        # each layer's settings as this decoder runs it (a rank's: `_slice`), with its row of the KV cache (an
        # attention layer's; recurrent layers keep states per row instead) and of routing replay's records (MoE's)
        kv, moe = itertools.count(), itertools.count()
        self.settings = [dataclasses.replace(s, cache_row=next(kv) if s.heads else None,
                                             moe_row=None if s.act is not None else next(moe)) for s in spec.layers]
        self.n_cached, self.n_moe = next(kv), next(moe)  # attention layers, MoE layers
        self.tp = tp
        if tp.size > 1:
            self._slice(tp)
        self.embed_scale = None if spec.embed_scale is None else spec.embed_scale.to(self.device, self.dtype)
        self.final_eps = transformer._eps(model.model.norm)
        # the rotary tables (each layer's "rope" names one; None: no rotary) and the sliding windows of the layers
        self.rotary_keys = sorted({s.rope for s in spec.layers} - {None})
        windows = sorted({s.window for s in spec.layers} - {None})
        self.windows = _Windows(windows, max_batch, max_len, self.device) if windows else None
        self.recurrent = {}  # recurrent layers' states per row (layers/static_recurrent.py), made by their first copy
        self._allocate(model, max_batch, max_len)

    def _slice(self, tp):
        """Tensor parallelism: this rank's heads (the K/V cache holds its K/V heads only; with fewer K/V heads than
        ranks, each rank holds the one K/V head its query heads read: `kv_share`), its vocabulary rows, and the
        group's sum of the partial outputs after each block (`reduce`); transformer.decide has said that the model
        can be cut so. Slices cut from FSDP2's shards come in the copies' dtype and device (`to`, which two Slices
        do not compare)."""
        self.tp = dataclasses.replace(tp, to=(self.device, self.dtype))
        self.n_heads, self.n_kv = self.n_heads // tp.size, max(1, self.config_kv // tp.size)
        self.vocab_span = tp.span(self.vocab, even=False)  # this rank's rows of the embedding and the head
        self.settings = [dataclasses.replace(s, reduce=tp.reduce, **(dict(heads=self.n_heads, kv_heads=self.n_kv)
                                                                      if s.heads else {}))
                         for s in self.settings]

    def _allocate(self, model, max_batch, max_len):
        """The cache, its masks, the rotary tables per row and slot, and the inputs of a CUDA graph's step."""
        kw = dict(device=self.device, dtype=self.dtype)
        shape = (self.n_cached, max_batch, self.n_kv, max_len, self.head_dim)
        self.k_cache, self.v_cache = torch.zeros(shape, **kw), torch.zeros(shape, **kw)
        self.key_mask = torch.zeros(max_batch, max_len, dtype=torch.bool, device=self.device)
        # rotary tables per row and slot, one per rotary key, in the dtype the model's rotary gives them; sin
        # with its first half negated (see transformer._rotary_heads)
        probe = torch.zeros(1, **kw), torch.zeros(1, 1, dtype=torch.long, device=self.device)
        tables = [transformer._rotary(model.model.rotary_emb, self.fam, *probe, key)[0] for key in self.rotary_keys]
        rot_dim = tables[0].shape[-1] if tables else self.head_dim  # < head_dim: partial rotary
        self.cos = [torch.zeros(max_batch, max_len, rot_dim, device=self.device, dtype=t.dtype) for t in tables]
        self.sin = [torch.zeros_like(c) for c in self.cos]
        self.w = ([{} for _ in model.model.layers], {})  # weight copies, by `load`: (per layer {name: tensor}, root's)
        self.p = None  # per layer, what `layer` reads (transformer.LayerParams): settings and copies, from `load`
        self.row_index = torch.arange(max_batch, device=self.device)
        self.trues = torch.ones(max_batch, dtype=torch.bool, device=self.device)  # what graphs write into key_mask
        # decode attention's kernel (transformer.attention's): None, SDPA, on CUDA (or the Triton one: `use_kernel`);
        # on a CPU the plain grouped attention, two batched matmuls, which beat SDPA's setup cost at small CPU shapes
        self.decode_kernel = None if self.device.type == "cuda" else _decode_plain
        self.unpadded = False
        self.unmarked = None  # (rows, first slot, last slot) decoded unpadded without marking key_mask (below)

    @torch.no_grad()
    def load(self, model):
        """Copy the model's weights in, layer by layer (transformer.layer_params, its tensors as `_Copies` takes them:
        fused, this rank's slices). Under FSDP2 a whole decoder gathers each layer just for its copy; a sliced one
        cuts each rank's slices from the layer's shards (layers/tensor_parallel.py's `Slice.take`), so that no rank
        holds a whole layer. The first load allocates the copies, later ones copy into the same tensors, which
        captured graphs hold."""
        p = []
        for i, (l, settings) in enumerate(zip(model.model.layers, self.settings)):
            # transformer.decide let it through: it gathers itself
            gather = self.tp.size == 1 and transformer._is_sharded(l)
            if gather:
                l.unshard()  # a collective: every rank loads the same layers in the same order
            p.append(transformer.layer_params(l, settings, self.fam, _Copies(self, i)))
            if gather:
                l.reshard()
        self.p = p
        self._load_root(model)

    def _load_root(self, model):
        """The embedding, final norm and head, as the reader `tp` reads them, in the copies' dtype and device: this
        rank's vocabulary rows of the embedding and head (a sharded root's cut from its shards, the final norm
        gathered whole; `Whole`: all of them); a tied head is the embedding's copy."""
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        tied = embed is head or (not transformer._any_dtensor([embed]) and head.data_ptr() == embed.data_ptr())
        to, root = dict(device=self.device, dtype=self.dtype), self.w[1]
        _put(root, "embed", [self.tp.cut(embed, "vocabulary").to(**to)])
        _put(root, "norm", [transformer._norm_weight(self.tp.whole(model.model.norm.weight).to(**to), self.fam)])
        if tied:
            root["lm_head"] = root["embed"]
        elif root.get("lm_head") is not root["embed"]:  # planned on the meta device, a tied copy may be untied
            _put(root, "lm_head", [self.tp.cut(head, "vocabulary").to(**to)])
        self.rotary = model.model.rotary_emb

    def weight_bytes(self):
        """Bytes of the weight copies this decoder holds (each tensor once; a tied head is the embedding): its
        layers' fused copies, MoE blocks' and recurrent layers' own (none for experts read in place), embedding,
        final norm and head. Under tensor parallelism, this rank's share."""
        seen, total = set(), sum(r.nbytes() for r in self.recurrent.values())
        for d in [*self.w[0], self.w[1]]:
            for k, v in d.items():
                if k == "moe":  # a MoE block's
                    total += v.nbytes()
                elif id(v) not in seen:
                    seen.add(id(v))
                    total += v.numel() * v.element_size()
        return total

    def worth_compacting(self, live, current):
        """Compaction copies the cache: eagerly when a quarter of the rows left (on CUDA graphs, when the bucket
        shrinks: layers/cuda_graphs.py)."""
        if self.graphs is not None:
            return self.graphs.worth_compacting(self, live, current)
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
        for buf in (self.key_mask, *self.cos, *self.sin, *([] if self.windows is None else [self.windows.pos]),
                    *([] if self.recorder is None else [self.recorder.routes])):
            buf[:k] = buf[keep]
        for layer in self.recurrent.values():
            layer.compact(keep)

    def _embed(self, ids):
        if self.tp.size > 1:
            return self._sliced_embed(ids)
        return transformer._embed(ids, self.w[1]["embed"], self.embed_scale)

    def _sliced_embed(self, ids):
        """`_embed` under tensor parallelism: this rank's vocabulary rows, summed over the group."""
        x = self.tp.embed(ids, self.w[1]["embed"], self.vocab_span[0])
        return x if self.embed_scale is None else x * self.embed_scale.to(x.dtype)

    def _layers(self, x, rope, attend, recurrent, record):
        """x through every layer (`layer`). rope: rotary key -> (cos, sin) of these tokens; attend(p, q, k, v):
        a layer's attention, its new K/V written to its cache row first (`_block_attention`, `_decode_attention`);
        recurrent(state, h): a recurrent layer's output; record(p, experts): where a MoE layer's experts are
        recorded (the recorder's, None without one). The same functions serve every layer."""
        for p in self.p:
            x = transformer.layer(x, p, None if p.rope is None else rope[p.rope], attend, recurrent, record)
        return x

    def _block_attention(self, write, keys, masks):
        """Prefill and extend: each layer's attention over a block of tokens per row, q (B, S, heads, hd), k, v
        (B, S, kv heads, hd); write(cache row, k, v) stores the new K/V, keys(cache row) gives the cached K, V
        (B, kv heads, L, hd); masks: window (None: full attention) -> attention mask (B, 1, S, L)."""
        def attend(p, q, k, v):
            write(p.cache_row, k.transpose(1, 2), v.transpose(1, 2))
            kk, vv = keys(p.cache_row)
            return transformer.attention(q.transpose(1, 2), kk, vv, masks[p.window], p).transpose(1, 2)
        return attend

    def _decode_attention(self, b, at, slot, kv_len, reads):
        """Decode: each layer's attention for one token per row of the first b, q (b, heads, hd), k, v (b, kv heads,
        hd), its new K/V written at the rows `at`, each at its `slot` first; reads: window (None: full attention) ->
        (the first cache slot its layers read, their key mask). The query heads that share a KV head are grouped as
        the query axis, so grouped-query attention needs no copy of K/V per query head."""
        nh, nkv, hd, kernel = self.n_heads, self.n_kv, self.head_dim, self.decode_kernel

        def attend(p, q, k, v):
            i, (first, mask) = p.cache_row, reads[p.window]
            self.k_cache[i, at, :, slot], self.v_cache[i, at, :, slot] = k, v  # (b, nkv, hd) each
            kk, vv = self.k_cache[i, :b, :, first:kv_len], self.v_cache[i, :b, :, first:kv_len]  # (b, nkv, L, hd)
            out = transformer.attention(q.view(b, nkv, nh // nkv, hd), kk, vv, mask, p, kernel=kernel)
            return out.reshape(b, nh, hd)
        return attend

    def _logits(self, x):
        """The logits (n, V) of x (n, H); under tensor parallelism this rank's vocabulary columns, `vocab_span`."""
        head = self.w[1]
        z = F.linear(transformer._rms_norm(x, head["norm"], self.final_eps, self.fam.upcast), head["lm_head"])
        return z if self.head is None else self.head.apply(z)

    @torch.no_grad()
    def prefill(self, ids, attn, positions):
        """Run the prompts (N, P), fill cache slots [0, P); return the last position's logits (N, V)."""
        n, p = ids.shape
        x = self._embed(ids)
        # rotary tables for every position a row will use: prompt positions, then the completion's
        all_pos = torch.cat([positions, positions[:, -1:] + 1 + torch.arange(self.max_len - p, device=ids.device)], 1)
        rope = {}
        for key, cos_t, sin_t in zip(self.rotary_keys, self.cos, self.sin):
            cos, sin = transformer._rotary(self.rotary, self.fam, x, all_pos, key)
            cos_t[:n], sin_t[:n] = cos, transformer._signed_sin(sin)  # see transformer._rotary_heads
            rope[key] = (cos_t[:n, :p, None], sin_t[:n, :p, None])
        self.key_mask[:n] = False
        self.key_mask[:n, :p] = attn.bool()
        # without left padding, eager decode over the filled slots needs no mask at all
        self.unpadded = self.graphs is None and bool(attn.bool().all())
        self.unmarked = None
        causal = transformer._padded_causal_mask(attn)
        masks = self.windows.prefill(n, p, all_pos, causal, positions) if self.windows else {None: causal}

        def write(i, k, v):
            self.k_cache[i, :n, :, :p] = k
            self.v_cache[i, :n, :, :p] = v

        def keys(i):
            return self.k_cache[i, :n, :, :p], self.v_cache[i, :n, :, :p]

        real, record = attn.bool(), None if self.recorder is None else self.recorder.prefill(n, p)
        x = self._layers(x, rope, self._block_attention(write, keys, masks), lambda layer, h: layer.prefill(h, real),
                         record)
        return self._logits(x[:, -1])

    @torch.no_grad()
    def admit(self, rows, positions):
        """Make the batch rows `rows` (a tensor (k,)) empty places for new rows whose left-padded prompts have the
        positions (k, P): their cache slots forgotten, their rotary tables (and window positions) those of the new
        rows' tokens, their recurrent states empty. The prompts then enter by `extend`, as an environment's answer
        does, while the other rows keep their cache: admission of a row into a place, of which prefill is the case
        of every place at once."""
        self._mark()
        self.admissions += rows.numel()
        self.unpadded = False  # the places' first slots are padding now: decode reads the mask
        if self.windows is not None:
            self.windows.narrow_from = None  # rows at other positions: slots no longer align across rows
        p, lo = positions.shape[1], self.first_slot  # no row holds a token before `first_slot`: no table there
        all_pos = torch.cat([positions[:, lo:],
                             positions[:, -1:] + 1 + torch.arange(self.max_len - p, device=self.device)], 1)
        probe = torch.zeros(1, device=self.device, dtype=self.dtype)
        for key, cos_t, sin_t in zip(self.rotary_keys, self.cos, self.sin):
            cos, sin = transformer._rotary(self.rotary, self.fam, probe, all_pos, key)
            cos_t[rows, lo:], sin_t[rows, lo:] = cos, transformer._signed_sin(sin)
        if self.windows is not None:
            self.windows.pos[rows, lo:] = all_pos
        self.key_mask[rows] = False
        if self.recorder is not None:  # the new rows' records start empty, their prompts' padding included
            self.recorder.routes[rows] = -1
        for layer in self.recurrent.values():
            layer.reset(rows)

    @torch.no_grad()
    def copy_rows(self, src, dst, lo, hi):
        """Batch rows dst (a tensor) take the cache slots [lo, hi) of rows src, with their recurrent states and
        routing records: rows admitted with the same prompt, which one of them ran (sampling's shared admission)."""
        self.k_cache[:, dst, :, lo:hi] = self.k_cache[:, src, :, lo:hi]
        self.v_cache[:, dst, :, lo:hi] = self.v_cache[:, src, :, lo:hi]
        self.key_mask[dst, lo:hi] = self.key_mask[src, lo:hi]
        if self.recorder is not None:
            self.recorder.routes[dst, lo:hi] = self.recorder.routes[src, lo:hi]
        for layer in self.recurrent.values():
            layer.copy_rows(src, dst)

    def _decode_body(self, tok, slot, kv_len, lo):
        """One token for the first b rows, whose tokens are `tok` (b,); each row's K/V go to its cache slot: `slot`
        is an int shared by all rows, or a tensor (b,) of one slot per row (the form CUDA graphs capture, read on
        the device at replay; rows that took turns of different lengths). Keys in slots [lo, kv_len)."""
        b, x = tok.shape[0], self._embed(tok)  # (b, H)
        at = self.row_index[:b] if torch.is_tensor(slot) else slice(0, b)  # per-row slots: no host value is read
        cos, sin = [c[at, slot][:, None] for c in self.cos], [s[at, slot][:, None] for s in self.sin]  # (b, 1, hd)
        mask = self._decode_mask(b, at, slot, lo, kv_len)
        reads = self.windows.decode(mask, at, slot, lo, kv_len) if self.windows else {None: (lo, mask)}
        record = None if self.recorder is None else self.recorder.decode(at, slot)
        rope = dict(zip(self.rotary_keys, zip(cos, sin)))
        return self._logits(self._layers(x, rope, self._decode_attention(b, at, slot, kv_len, reads),
                                         lambda layer, h: layer.decode(h), record))

    def _decode_mask(self, b, at, slot, lo, kv_len):
        """The key mask (b, 1, 1, L) of a decode step (broadcast over heads and queries), each row's slot marked in
        key_mask first (from a device tensor: a Python True would be copied from the host). Eager decode without
        left padding, every row at the same slot, attends to every filled slot: no mask (None); the slots it fills
        are marked in key_mask later (`_mark`), only if a step that reads the mask comes, as this one does."""
        if self.unpadded and not torch.is_tensor(slot):
            self.unmarked = (b, slot if self.unmarked is None else self.unmarked[1], slot)
            return None
        self._mark()  # never under CUDA graphs: `unpadded` (which leaves slots unmarked) is eager decode's alone
        self.key_mask[at, slot] = self.trues[:b]
        return self.key_mask[:b, None, None, lo:kv_len]

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
        top = slot if top is None else top
        if self.graphs is not None:  # on CUDA graphs: the step's graph replayed (layers/cuda_graphs.py)
            return self.graphs.decode(self, tok, slot, top)
        return self._decode_body(tok, slot, top + 1, self.first_slot)  # eager: attend over the filled slots only

    @torch.no_grad()
    def extend(self, ids, valid, start, top, batch_rows=None):
        """Append a block of tokens to each live row's cache and return the logits after each row's last one.

        ids, valid (b, K): row i's new tokens are ids[i, :valid[i].sum()] (at least one), written to slots
        start[i], start[i] + 1, ... (start (b,) a tensor); `top` (host int) is the largest slot written. Each
        new token attends to its row's real cache slots before it and to the row's new tokens up to itself:
        the prefill of an environment's answer in the middle of decoding, with nothing before it recomputed.
        batch_rows (b,): the batch rows the blocks are for (a tensor; default the first b), the others untouched.
        """
        self._mark()
        if self.windows is not None:
            self.windows.narrow_from = None  # rows' blocks of different lengths: slots no longer align across rows
        b, k = ids.shape
        at = slice(0, b) if batch_rows is None else batch_rows  # the cache rows read and written
        rows = (self.row_index[:b] if batch_rows is None else batch_rows)[:, None].expand(b, k)
        slots = start[:, None] + torch.arange(k, device=ids.device)  # (b, K)
        slots = torch.where(valid, slots, start[:, None])  # padding columns read a real slot, write nothing
        real_rows, real_cols = valid.nonzero(as_tuple=True)
        real_slots = slots[real_rows, real_cols]
        cache_rows = real_rows if batch_rows is None else batch_rows[real_rows]
        self.key_mask[cache_rows, real_slots] = True
        kv_len, lo = top + 1, self.first_slot
        key_slot = torch.arange(lo, kv_len, device=ids.device)
        # (b, 1, K, L): a real key at or before the query's own slot; padding queries see their row's keys
        mask = self.key_mask[at, None, None, lo:kv_len] & (key_slot <= slots[:, None, :, None])
        masks = self.windows.extend(mask, rows, slots, kv_len, lo, batch_rows) if self.windows else {None: mask}
        cos = [c[rows, slots][:, :, None] for c in self.cos]  # (b, K, 1, hd)
        sin = [s[rows, slots][:, :, None] for s in self.sin]

        def write(i, kk, vv):  # (b, nkv, K, hd): only the real tokens' K/V reach the cache
            self.k_cache[i, cache_rows, :, real_slots] = kk.transpose(1, 2)[real_rows, real_cols]
            self.v_cache[i, cache_rows, :, real_slots] = vv.transpose(1, 2)[real_rows, real_cols]

        def keys(i):
            return self.k_cache[i, at, :, lo:kv_len], self.v_cache[i, at, :, lo:kv_len]

        record = None if self.recorder is None else \
            self.recorder.extend(cache_rows, real_slots, real_rows, real_cols, (b, k))
        rope = dict(zip(self.rotary_keys, zip(cos, sin)))
        x = self._layers(self._embed(ids), rope, self._block_attention(write, keys, masks),
                         lambda layer, h: layer.extend(h, valid, at), record)  # (b, K, H)
        last = valid.long().sum(1) - 1
        return self._logits(x[self.row_index[:b], last])

    def record(self, on):
        """Routing replay: from the next prefill on, keep the experts every MoE layer chose for each token, by
        row and cache slot (a slot written again, after a row forgot it, keeps the last token's: layers/routing.py's
        Records, `recorder`); off: keep none."""
        on = on and self.n_moe > 0
        if on == (self.recorder is not None):
            if on:
                self.recorder.routes.fill_(-1)
            return
        if self.graphs is not None:
            self.graphs.clear()  # captured graphs record, or not, as they were captured
        if not on:
            self.recorder = None
            return
        k = next(p.moe.k for p in self.p if p.moe is not None)
        self.recorder = routing.Records(self.max_batch, self.max_len, self.n_moe, k, self.device)

    def routed(self, prompt_width, length, rows):
        """The experts recorded for the prompt slots (m, P, MoE layers, k) and for completion positions
        0 .. length - 1 (m, length, MoE layers, k) of the batch rows `rows` (a tensor (m,)), completion position j at
        slot P + j (P = prompt_width); -1 where the slot holds no token of the row (never fed, or forgotten): the
        router's live choice there. The caller takes a row's before its place takes another row or is compacted
        away."""
        self._mark()
        return self.recorder.routed(self.key_mask[rows, prompt_width:prompt_width + length], rows, prompt_width, length)

    @torch.no_grad()
    def truncate(self, rows, ends):
        """Forget rows' cache slots from ends[i] on (rows, ends (m,) tensors): what a row sampled past a stop
        is no longer attended, and is overwritten as the row goes on."""
        self._mark()
        if self.windows is not None:
            self.windows.narrow_from = None  # forgotten slots are holes until written again
        keep = torch.arange(self.max_len, device=self.device) < ends[:, None]  # (m, L)
        self.key_mask[rows] &= keep


class _Windows:
    """A decoder's sliding windows (`sizes`, those of its layers that have one): each slot's token position `pos`
    (b, L), filled at prefill as the rotary tables are (a slot's position never changes, however the row's turns go),
    and the masks of the windowed layers, which eager decode may narrow by slots instead (`narrowed`)."""

    def __init__(self, sizes, max_batch, max_len, device):
        self.sizes = sizes
        self.pos = torch.zeros(max_batch, max_len, dtype=torch.long, device=device)
        self.narrow_from = None  # the first slot from which windows may narrow by slots; None: they may not

    def prefill(self, n, p, all_pos, causal, positions):
        """The masks of a prefill of rows [0, n) into slots [0, p) (`masked`), their slots' positions all_pos."""
        self.pos[:n] = all_pos
        self.narrow_from = p  # from here each slot is every row's next token (see `narrowed`)
        return self.masked(causal, positions, p)

    def extend(self, mask, rows, slots, kv_len, lo, batch_rows):
        """The masks of StaticDecoder.extend's blocks: queries at the cache rows and slots (b, K) given, keys the
        rows' slots [lo, kv_len) (batch_rows, a tensor: the rows of the blocks; None: the first b)."""
        key_pos = None if batch_rows is None else self.pos[batch_rows]
        return self.masked(mask, self.pos[rows, slots], kv_len, lo=lo, key_pos=key_pos)

    def decode(self, mask, at, slot, lo, kv_len):
        """A decode step's reads (StaticDecoder._decode_attention): window -> (the first slot its layers read, their
        mask); a window narrowed by slots (`narrowed`; slots given per row, a tensor, narrow none) is read from its
        first slot, unmasked."""
        starts = {} if torch.is_tensor(slot) else self.narrowed(slot, kv_len)
        masks = self.masked(mask, self.pos[at, slot][:, None], kv_len, skip=starts, lo=lo)
        return {w: (starts.get(w, lo), m) for w, m in masks.items()}

    def narrowed(self, slot, kv_len):
        """window -> first slot, for the windows whose keys at this eager step are exactly the `window` slots up to
        `slot` for every row: all rows at `slot` (kv_len = slot + 1), and since `narrow_from` every slot a real
        token of every row, at consecutive positions (prefill fixes each slot's position), so a window over
        positions is a window over slots. Those layers read just those slots, unmasked: on a CPU, where no graph
        fixes the span, a short window then costs what it reads."""
        if self.narrow_from is None or kv_len != slot + 1:
            return {}
        return {w: slot - w + 1 for w in self.sizes if slot - w + 1 >= self.narrow_from}

    def masked(self, mask, query_pos, kv_len, skip=(), lo=0, key_pos=None):
        """masks: window -> `mask` (None: full attention) narrowed to the keys in slots [lo, kv_len) within the
        window of query positions query_pos (b, Q), the keys' positions those of `pos` (or `key_pos` (b, L)); mask and
        the result broadcast as (b, 1, Q, kv_len - lo). The windows in `skip` get none (their layers narrow by slots
        instead)."""
        masks = {None: mask}
        for w in self.sizes:
            if w in skip:
                masks[w] = None
                continue
            if kv_len <= w:  # no two tokens of these slots are a window apart
                masks[w] = mask
                continue
            keys = self.pos[:query_pos.shape[0], lo:kv_len] if key_pos is None else key_pos[:, lo:kv_len]
            near = transformer._in_window(query_pos, keys, w)[:, None]
            masks[w] = near if mask is None else mask & near
        return masks


def _put(store, name, parts):
    """store[name]: the parts concatenated (a fused weight), read once: the first time into a new tensor, later
    into the same one (captured graphs hold it)."""
    store[name] = torch.cat([t.detach() for t in parts], out=store.get(name))
    return store[name]


class _Copies:
    """transformer.layer_params' tensors for the decoder's layer i: each weight as the layer applies it now (a LoRA
    adapter's delta merged in), read by the decoder's reader `tp` (`Whole`; under tensor parallelism this rank's
    Slice, which cuts each by the kind layer_params names), the pieces of a fused projection concatenated, copied
    into the decoder's store. A sharded layer's weights are FSDP2 shards: a Slice cuts each from them
    (`Slice.take`), and gathers its norms whole."""

    def __init__(self, dec, i):
        self.dec, self.i, self.store, self.tp = dec, i, dec.w[0][i], dec.tp

    def norm(self, name, module, eps):
        return _put(self.store, name, [transformer._norm_weight(self.tp.whole(module.weight), self.dec.fam)]), eps

    def linears(self, name, modules, cuts, split_gate=None):
        """One fused (weight, bias) of the projections; split_gate: q_proj's rows hold each head's query and then
        its gate, split_gate rows each: the queries first, the gates after the others (see
        transformer.gated_attention_block)."""
        weights = [self.tp.weight(m, cut, self.dec.config_kv) for m, cut in zip(modules, cuts)]
        w = _put(self.store, name, _gated_query(weights, split_gate) if split_gate else weights)
        return [(w, None if all(m.bias is None for m in modules) else self._biases(name, modules, cuts))]

    def _biases(self, name, modules, cuts):
        """The projections' fused bias, zeros for a projection that has none (`linears`)."""
        biases = [m.bias if m.bias is not None else
                  torch.zeros(m.out_features, device=self.dec.device, dtype=self.dec.dtype) for m in modules]
        kv = self.dec.config_kv
        return _put(self.store, name + "_b", [self.tp.bias(t, cut, kv) for t, cut in zip(biases, cuts)])

    def linear(self, name, module, cut):
        bias = self.tp.bias(module.bias, cut)
        return (_put(self.store, name, [self.tp.weight(module, cut)]),
                None if bias is None else _put(self.store, name + "_b", [bias]))

    def tensor(self, name, t, cut):
        return _put(self.store, name, [self.tp.cut(t, cut)])

    def table(self, name, norms):
        return _put(self.store, name, [transformer._norm_weight(self.tp.whole(n.weight), self.dec.fam).expand(heads, -1)
                                       for n, heads in norms])

    def moe(self, block):
        """The block's MoE: kept from load to load (captured graphs read its tensors); whole, it reads the experts in
        place (layers/static_moe.py), sliced it holds this rank's share, refreshed at each load."""
        mine = self.store.get("moe")
        if mine is None or mine.block is not block:
            mine = self.store["moe"] = static_moe.MoE(block) if self.tp.size == 1 else static_moe.MoE(block, tp=self.tp)
        elif self.tp.size > 1:
            mine.load(block)
        return mine

    def recurrent(self, module):
        d, mine = self.dec, self.dec.recurrent.get(self.i)
        if mine is None:  # the first load: the layer's states are allocated (at the decoder's size) with its copy
            mine = d.recurrent[self.i] = static_recurrent.DeltaNet(module, d.max_batch, d.device, d.dtype, tp=d.tp)
            d.forgets_exactly = False  # a recurrent state cannot forget (see layers/static_recurrent.py)
        mine.load(module)
        return mine


def _gated_query(weights, split_gate):
    """`_Copies.linears`' weights with a gated query (no bias: transformer.decide refuses a gated query with one):
    cut by heads, a share of q_proj is whole heads, each its query then its gate: split as the whole is."""
    return transformer._query_parts(weights[0], split_gate, weights[1:])


def _decode_plain(q, k, v, mask, scale):
    """`attention`'s kernel in decode on a CPU: transformer.grouped_attention, mask (B, 1, 1, L) as its key mask."""
    return transformer.grouped_attention(q, k, v, None if mask is None else mask[:, 0, 0], scale)


def _decode_kernel(q, k, v, mask, scale):
    """`attention`'s kernel in decode with --decode_attention_kernel: the split-KV Triton kernel (layers/kernels.py,
    a feature: imported only here), mask (B, 1, 1, L) as its key mask (B, L)."""
    from layers import kernels
    return kernels.decode_attention(q, k, v, None if mask is None else mask[:, 0, 0], scale)
