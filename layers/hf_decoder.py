"""The general sampler path: the model's own forward, on a cache whose attention masks we write.

Every architecture the written-out decoder (layers/transformer.py) does not
reproduce decodes here, through the model's own modules, so coverage follows
transformers. What the model's own masks cannot know is how a row's tokens lie
in the cache once the sampler has paused it, appended an environment's answer
to some rows and not others, or made it forget what it sampled past a stop:
the cache then has holes, columns that belong to no token of the row. So the
masks are ours, built per layer type from each column's token position:

- full attention: a query sees the real columns at or before its own;
- sliding attention: of those, the ones less than `window` positions back,
  counted in the row's own tokens (positions), never in cache columns;
- linear attention / recurrent layers (Gated DeltaNet, Mamba-style): their
  state has no columns, so a hole cannot be masked after the fact. A block
  appended with padding (rows answered with answers of different lengths)
  runs one column at a time and a row's state is put back where its column
  was padding; and the sampler looks at such rows after every token, so a
  row never samples past its stop (`forgets_exactly` is False).

What this cannot express (another attention implementation than eager or
sdpa, a layer type without a rule here, a cache layer kind it does not know)
is refused by `unsupported(model)` with one line. Of the project it imports nothing.

A vision-language model's prompt arrives with its images as `images`: a function that runs the prefill's language
model with the image embeddings in place (vision.hidden_states), the prompt's rotary positions (3, N, P) and each
row's `delta`, the shift of its text positions past the prompt; every later token then takes position + delta on
each rotary axis.
"""

import inspect

import torch

_WINDOWED = ("sliding_attention",)
_FULL = ("full_attention",)
_RECURRENT = ("linear_attention", "mamba", "conv")


def _text_config(model):
    cfg = model.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def layer_types(model):
    """Each decoder layer's kind as the config names it; all full attention for configs that name none."""
    cfg = _text_config(model)
    kinds = getattr(cfg, "layer_types", None)
    if kinds:
        return list(kinds)
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True):  # a window on every layer (Mistral's older configs)
        return ["sliding_attention"] * cfg.num_hidden_layers
    return ["full_attention"] * cfg.num_hidden_layers


def unsupported(model):
    """Why the general path cannot sample `model` exactly, in a few words; None when it can."""
    cfg = _text_config(model)
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in ("eager", "sdpa"):
        return (f"attn_implementation={impl} (the sampler writes its own attention masks, which need eager or "
                f"sdpa; set model_init_kwargs.attn_implementation)")
    kind = _without_rule(model)
    if kind is not None:
        return f"layers of type {kind!r}"
    if any(k in _WINDOWED for k in layer_types(model)) and not getattr(cfg, "sliding_window", None):
        return "sliding-window layers without a sliding_window size"
    return None


def _without_rule(model):
    """The first of the model's layer types that has no mask rule here, or None."""
    return next((k for k in layer_types(model) if k not in _FULL + _WINDOWED + _RECURRENT), None)


def check_layer_types(model):
    """Raise ValueError naming the architecture and a layer type without a mask rule here: the model's forward
    would look up a mask for its own layer kinds and find none (a KeyError deep inside it), so such a model
    cannot run here at all, checked or not."""
    kind = _without_rule(model)
    if kind is not None:
        raise ValueError(f"{type(model).__name__}: the sampler cannot reproduce layers of type {kind!r}")


def _dtype_min(dtype):
    return torch.finfo(dtype).min if dtype.is_floating_point else torch.finfo(torch.float32).min


class HFDecoder:
    """A batch of rows over the model's own forward and a DynamicCache that grows a column per fed token.

    Columns are appended for every row at once; `valid` (N, L) marks the columns that hold one of the row's
    tokens and `pos` (N, L) each column's position id. The interface is the sampler's: prefill, decode one
    token per row, extend rows by a block of tokens, truncate (forget) rows' tokens from a position on; and, for
    rows streaming through places, grow by empty rows, admit (a row forgets all it held), prefill admitted rows
    on their own cache, and keep some rows. Then each row's columns are packed to the front (`pack`).
    """

    def __init__(self, model, ids, attn, positions, routing=None, images=None):
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicSlidingWindowLayer, DynamicLayer, LinearAttentionCacheLayerMixin

        check_layer_types(model)
        self.model = model
        cfg = _text_config(model)
        self.kinds = layer_types(model)
        self.one_mask = not getattr(cfg, "layer_types", None)  # a model that takes one mask, not one per layer type
        self.window = getattr(cfg, "sliding_window", None)
        self.cache = DynamicCache(config=model.config)
        # a sliding layer's own cache drops columns past the window, counted in columns; ours keeps them all and
        # the mask applies the window in positions
        self.cache.layers = [DynamicLayer() if type(layer) is DynamicSlidingWindowLayer else layer
                             for layer in self.cache.layers]
        self.recurrent = [layer for layer in self.cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]
        self.forgets_exactly = not self.recurrent
        params = inspect.signature(model.forward).parameters
        # transformers 5.x renamed the forward's past_key_values to cache (the old name warns where both exist)
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        # sdpa takes a boolean mask whatever the compute dtype (under FSDP2 mixed precision the parameters rest in
        # float32 and compute in bf16); eager adds its mask to the scores
        self.additive = getattr(model.config, "_attn_implementation", None) != "sdpa"
        # a routing.Replay that records: each token's experts kept by column, (N, layers, columns, k) as a cache's
        # keys are, so that admitting, packing and dropping rows move them with the cache (`_tensors`)
        self.routing, self.routes = routing, {}
        if routing is not None:
            routing.record()
        self.valid = torch.zeros(ids.shape[0], 0, dtype=torch.bool, device=ids.device)
        self.pos = torch.zeros(ids.shape[0], 0, dtype=torch.long, device=ids.device)
        self.images, self.delta = (images, images[2]) if images is not None else (None, None)
        # with no rows, every place is empty until rows are admitted (a stream's start)
        self.first_logits = self._forward(ids, attn.bool(), positions, prefill=True, keep=1)[:, -1] if len(ids) \
            else None
        self.images = None  # the prefill's alone

    def _masks(self, q_valid, q_pos):
        """The attention mask of each layer type for queries appended as the last columns, (N, 1, K, L): True where
        a query may attend (sdpa), or 0 / the dtype's minimum to add to the scores (eager)."""
        n, k = q_valid.shape
        length = self.valid.shape[1]
        q_col = torch.arange(length - k, length, device=q_valid.device)
        k_col = torch.arange(length, device=q_valid.device)
        see = self.valid[:, None, :] & (k_col <= q_col[:, None])  # (N, K, L): real keys, not after the query
        see |= k_col == q_col[:, None]  # a padding query sees itself, so that its (unused) output stays finite
        masks = {}
        for kind in dict.fromkeys(self.kinds):
            if kind in _RECURRENT:
                masks[kind] = None
                continue
            allowed = see
            if kind in _WINDOWED:
                allowed = see & (q_pos[:, :, None] - self.pos[:, None, :] < self.window)
            if not self.additive:
                masks[kind] = allowed[:, None]
                continue
            masks[kind] = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device).masked_fill_(
                ~allowed, _dtype_min(self.dtype))[:, None]
        return masks

    def _forward(self, ids, valid, positions, prefill=False, keep=0):
        """Append columns for ids (N, K), whose real tokens `valid` marks, at `positions`; return the logits of the
        last `keep` of them (0: all), (N, keep or K, V)."""
        self.valid = torch.cat([self.valid, valid], 1)
        self.pos = torch.cat([self.pos, positions], 1)
        masks = self._masks(valid, positions)
        if prefill and "linear_attention" in masks and not bool(valid.all()):
            # left padding before any state exists: the model zeroes those inputs, which leaves the state at zero
            masks["linear_attention"] = valid.long()
        if self.one_mask:
            masks = masks[self.kinds[0]]
        if self.images is not None:  # a prompt with images: their embeddings and the rotary positions of the grid
            run, rope, _ = self.images
            hidden = run(ids, attention_mask=masks, position_ids=rope, use_cache=True,
                         **{self.cache_kw: self.cache}).last_hidden_state
            logits = self.model.get_output_embeddings()(hidden[:, -keep:] if keep else hidden)
        else:
            rope = positions if self.delta is None else positions + self.delta[:, None]
            logits = self.model(input_ids=ids, attention_mask=masks, position_ids=rope, use_cache=True,
                                logits_to_keep=keep, **{self.cache_kw: self.cache}).logits
        if self.routing is not None:
            new = self.routing.take(ids.shape).transpose(1, 2)  # (N, layers, K, k): a column per token fed
            old = self.routes.get("experts")
            self.routes["experts"] = new if old is None else torch.cat([old, new], 2)
        return logits

    def decode(self, tok, positions, real=None):
        """One token per row at position ids `positions` (N,); the logits after it (N, V). real (N,): False where
        the token is no row's (a finished row writing on): its column is a hole from the start."""
        real = torch.ones_like(tok, dtype=torch.bool) if real is None else real
        return self._forward(tok[:, None], real[:, None], positions[:, None])[:, -1]

    def extend(self, ids, valid, positions):
        """Each row's block ids[i, :valid[i].sum()] at `positions` (N, K); the logits after each row's last one."""
        n, k = ids.shape
        last = valid.long().sum(1) - 1
        rows = torch.arange(n, device=ids.device)
        if not self.recurrent or bool(valid.all()):
            return self._forward(ids, valid, positions)[rows, last]
        # a recurrent state would absorb the padding: one column at a time, the state put back where it was padding
        out = None
        for c in range(k):
            saved = self._states()
            logits = self._forward(ids[:, c:c + 1], valid[:, c:c + 1], positions[:, c:c + 1])[:, -1]
            self._restore(saved, ~valid[:, c])
            out = logits if out is None else torch.where((last == c)[:, None], logits, out)
        return out

    def prefill_rows(self, rows, ids, attn, positions, images=None):
        """Rows `rows` (a tensor), just admitted (they hold nothing), take their prompts: ids (k, P) left-padded,
        attn their real tokens, positions theirs, images `sample`'s prefill images of these rows (or None). A
        prefill of those rows alone on an empty cache (left padding before any state leaves a recurrent state at
        zero, and image embeddings and rotary positions enter it, as at the first prefill), written into their own
        first P columns, which are holes in them: the cache grows only where it is narrower than P."""
        n, width = self.valid.shape
        p = ids.shape[1]
        whole = {}  # (holder, key) -> the tensor of every row
        for holder, key, columns in self._tensors():
            t = whole[id(holder), key] = holder[key]
            holder[key] = t.new_zeros(len(rows), t.shape[1], 0, *t.shape[3:]) if columns else t[rows]
        all_valid, all_pos, all_delta = self.valid, self.pos, self.delta
        self.valid, self.pos = all_valid.new_zeros(len(rows), 0), all_pos.new_zeros(len(rows), 0)
        self.images = images
        self.delta = images[2] if images is not None else None if all_delta is None else all_delta[rows]
        try:
            self._forward(ids, attn.bool(), positions, prefill=True, keep=1)
        finally:
            self.images = None
        grow = max(0, p - width)
        for holder, key, columns in self._tensors():  # a layer first filled now was empty for every row
            sub, full = holder[key], whole.pop((id(holder), key), None)
            if full is None:
                full = sub.new_zeros(n, *sub.shape[1:2], width, *sub.shape[3:]) if columns else \
                    sub.new_zeros(n, *sub.shape[1:])
            if columns:
                if grow:
                    full = torch.cat([full, full.new_zeros(*full.shape[:2], grow, *full.shape[3:])], 2)
                full[rows, :, :p] = sub
            else:
                full.index_copy_(0, rows, sub)
            holder[key] = full
        widen = (lambda t: torch.cat([t, t.new_zeros(n, grow)], 1)) if grow else (lambda t: t)
        sub_valid, sub_pos, sub_delta = self.valid, self.pos, self.delta
        self.valid, self.pos = widen(all_valid), widen(all_pos)
        self.valid[rows, :p], self.pos[rows, :p] = sub_valid, sub_pos
        if sub_delta is not None:  # rows whose prompts held images now have their deltas
            self.delta = (all_delta.clone() if all_delta is not None else sub_delta.new_zeros(n)).index_copy_(
                0, rows, sub_delta)
        else:
            self.delta = all_delta

    def _tensors(self):
        """Every tensor the cache holds, as (holder, key, has_columns) with the tensor at holder[key]: attention
        layers' keys and values (rows, heads, columns, dim), recurrent layers' states (rows, ...), and while routing
        is recorded each token's experts (rows, MoE layers, columns, k)."""
        slots = []
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", False) and torch.is_tensor(layer.keys) and layer.keys.dim() == 4:
                slots += [(vars(layer), "keys", True), (vars(layer), "values", True)]
            for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
                slots += [(states, i, False) for i, t in states.items() if torch.is_tensor(t)]
        return slots + [(self.routes, "experts", True)] * ("experts" in self.routes)

    def grow(self, k):
        """k more rows, empty (every column a hole, zero states), for rows to be admitted."""
        self.valid = torch.cat([self.valid, self.valid.new_zeros(k, self.valid.shape[1])])
        self.pos = torch.cat([self.pos, self.pos.new_zeros(k, self.pos.shape[1])])
        self.delta = None if self.delta is None else torch.cat([self.delta, self.delta.new_zeros(k)])
        for holder, key, _ in self._tensors():
            holder[key] = torch.cat([holder[key], holder[key].new_zeros(k, *holder[key].shape[1:])])

    def admit(self, rows):
        """Rows `rows` (a tensor) forget every token: their columns become holes, their recurrent states zero (a
        state from nothing), ready for a new row's prompt (`prefill_rows`, or a one-token prompt fed with the batch)."""
        self.valid[rows] = False
        if self.delta is not None:  # a text prompt's positions are its tokens'
            self.delta[rows] = 0
        for holder, key, columns in self._tensors():
            if not columns:
                holder[key] = holder[key].index_fill(0, rows, 0)
        self.pack()

    def keep_rows(self, keep):
        """Keep rows `keep` (a tensor) alone, in that order."""
        self.valid, self.pos = self.valid[keep], self.pos[keep]
        self.delta = None if self.delta is None else self.delta[keep]
        for holder, key, _ in self._tensors():
            holder[key] = holder[key][keep]
        self.pack()

    def pack(self):
        """Move each row's real columns to the front, in their order, and drop the columns no row then holds: the
        cache is as wide as the row with the most tokens (rows admitted or dropped leave holes; the masks go by each
        column's position and realness, and a row's columns keep their order, so what a query sees is unchanged)."""
        width = int(self.valid.sum(1).max()) if len(self.valid) else 0
        if width == self.valid.shape[1]:
            return
        order = torch.sort((~self.valid).to(torch.int8), dim=1, stable=True).indices[:, :width]  # (N, width)
        self.valid, self.pos = self.valid.gather(1, order), self.pos.gather(1, order)
        for holder, key, columns in self._tensors():
            if columns:
                t = holder[key]
                holder[key] = t.gather(2, order[:, None, :, None].expand(t.shape[0], t.shape[1], width, t.shape[3]))

    def _states(self):
        return [[(d, i, t.clone()) for d in (layer.conv_states, layer.recurrent_states)
                 for i, t in d.items() if torch.is_tensor(t)] for layer in self.recurrent]

    def _restore(self, saved, rows):
        for states in saved:
            for d, i, t in states:
                d[i][rows] = t[rows]

    def truncate(self, batch_rows, ends, first_pos):
        """Forget rows' tokens at positions from first_pos + ends on: their columns are no longer attended."""
        forget = (self.pos[batch_rows] >= (first_pos[batch_rows] + ends)[:, None]) & self.valid[batch_rows]
        self.valid[batch_rows] = self.valid[batch_rows] & ~forget

    def routed(self, prompt_width, first_pos, length, rows):
        """The experts recorded for rows `rows` (a tensor (m,)): for their prompts, left-padded to prompt_width
        (m, P, layers, k), and for completion positions 0 .. length - 1 (m, length, layers, k). A position's record
        is its last real column's (a forgotten token's column is not real), wherever packing moved it; -1 where no
        token was fed (padding, a row's last token): the router's live choice there."""
        routes = self.routes["experts"][rows].transpose(1, 2)  # (m, columns, layers, k)
        j, valid = self.pos[rows] - first_pos[rows, None], self.valid[rows]  # j: each column's completion position

        def by_position(lo, hi):  # index i holds position lo + i
            real = valid & (j >= lo) & (j < hi)
            r, c = real.nonzero(as_tuple=True)
            col = torch.zeros(len(rows), hi - lo, dtype=torch.long, device=routes.device)
            col[r, j[r, c] - lo] = c
            fed = torch.zeros(len(rows), hi - lo, dtype=torch.bool, device=routes.device)
            fed[r, j[r, c] - lo] = True
            out = routes.gather(1, col[:, :, None, None].expand(-1, -1, *routes.shape[2:]))
            return out.masked_fill(~fed[:, :, None, None], -1)
        return by_position(-prompt_width, 0), by_position(0, length)
