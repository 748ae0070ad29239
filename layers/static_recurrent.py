"""Gated DeltaNet layers written out for the fast decoder (engine.StaticDecoder): Qwen3.5's linear attention.

A Gated DeltaNet layer (Yang et al. 2024, "Gated Delta Networks") keeps, per
row, two states instead of a KV cache: the last kernel-1 inputs of its causal
depthwise convolution, and a recurrent matrix per value head (key_dim x
value_dim) that each token decays by exp(g) and corrects towards its value
(the delta rule, step size beta). The layer here computes what the model's
module computes (transformers' Qwen3_5GatedDeltaNet), on the decoder's copies
of its projections, fused into one matmul:

- prefill: padding is zeroed before the projections, as the model zeroes it,
  so a left-padded row's states stay at zero through its padding, as for the
  row alone; the recurrence over the prompt runs the model's own chunked rule;
- decode: one token per row, the convolution and the recurrence in a few
  tensor operations, no host value (graph-capturable);
- extend (an environment's answer appended, rows with answers of different
  lengths): a token at a time, and a row's states move only where its column
  is a real token, so a padding hole never enters them.

A state cannot forget a token once absorbed: the decoder says so
(`forgets_exactly`), and the sampler then looks at rows after every token, so
that none samples past a stop.

Tensor parallelism (`tp`, this rank's share of a group of T ranks, layers/tensor_parallel.py's Slice; the
decoder's whole reader, engine.Whole, with one rank): a rank
holds 1/T of the key heads and the value heads those key heads serve, with
their slices of every projection (and of an adapter's factors), of the
convolution's channels and of the states; the gated norm's weight, shared by
the heads, stays whole. Its output is a partial sum that the caller's
all-reduce completes. Of the project it imports lora (an adapted projection's
low-rank term); the reader `tp` comes from the decoder.
"""

import inspect
import types

import torch
import torch.nn.functional as F

from layers import lora

# the layer classes this file reproduces
CLASSES = ("Qwen3_5GatedDeltaNet",)


def supported(module):
    """True for a Gated DeltaNet layer of a class in `CLASSES` with the settings read here."""
    if type(module).__name__ not in CLASSES and not any(c.__name__ in CLASSES for c in type(module).__mro__):
        return False
    projections = [getattr(module, n, None) for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                                                       "out_proj")]
    # the layer here applies no projection bias (Qwen3.5's have none): one would be dropped, so refuse it
    if not all(lora.linear_like(p) and p.bias is None for p in projections):
        return False
    norm = getattr(module, "norm", None)
    return (module.activation == "silu" and getattr(norm, "activation", None) == "silu"
            and hasattr(norm, "variance_epsilon") and isinstance(getattr(module, "conv1d", None), torch.nn.Conv1d))


def _linear(x, weight, low_rank):
    """x W^T, plus an adapter's low-rank term x A^T B^T where `low_rank` (A, B) is given (lora.stacked_low_rank)."""
    y = F.linear(x, weight)
    return y if low_rank is None else y + F.linear(F.linear(x, low_rank[0]), low_rank[1])


def _rows(t, spans, dim=0):
    """The spans [(start, stop)] of t along dim, concatenated (a view of t where there is one span)."""
    if len(spans) == 1:
        return t.narrow(dim, spans[0][0], spans[0][1] - spans[0][0])
    return torch.cat([t.narrow(dim, a, b - a) for a, b in spans], dim)


def _l2norm(x, eps=1e-6):
    """x over its last dim scaled to unit length, as the model's recurrent rule computes it."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_net_spans(tp, nk, nv, dk, dv):
    """The rows of a Gated DeltaNet layer (nk key heads of dk, nv value heads of dv) that rank tp.rank of a
    tensor-parallel group of tp.size holds, in the model's coordinates, as lists of (start, stop): "qkv" its rows of
    in_proj_qkv (q, k and v each by heads), which are also its channels of the convolution; "values" its value
    heads' dv-wide rows of in_proj_z and columns of out_proj; "heads" its value heads (rows of in_proj_b and
    in_proj_a, A_log, dt_bias); "in" its rows of the four input projections stacked (an adapter's stacked B).
    Contiguous shares: key head i serves value heads [i nv/nk, (i + 1) nv/nk), so a rank's nk/T key heads serve
    exactly its nv/T value heads."""
    if nk % tp.size or nv % tp.size:
        raise ValueError(f"tensor parallelism over {tp.size} ranks: the Gated DeltaNet's key heads ({nk}) and "
                         f"value heads ({nv}) must each divide by {tp.size}")
    (k0, k1), (v0, v1) = tp.span(nk, "key heads"), tp.span(nv, "value heads")
    key, value = nk * dk, nv * dv
    qkv = [(k0 * dk, k1 * dk), (key + k0 * dk, key + k1 * dk), (2 * key + v0 * dv, 2 * key + v1 * dv)]
    c = 2 * key + value
    return {"qkv": qkv, "values": [(v0 * dv, v1 * dv)], "heads": [(v0, v1)],
            "in": qkv + [(c + v0 * dv, c + v1 * dv), (c + value + v0, c + value + v1),
                         (c + value + nv + v0, c + value + nv + v1)]}


class DeltaNet:
    """One Gated DeltaNet layer over a batch of rows: its fused input projection and its per-row states.

    conv (rows, channels, kernel - 1): the last inputs of the convolution; rec (rows, value heads, key_dim,
    value_dim) float32: the recurrent matrix. Rows are batch rows, as the decoder's cache rows."""

    def __init__(self, module, max_batch, device, dtype, tp):
        """tp: how the decoder reads weights, this rank's share of a tensor-parallel group (engine.Whole: the whole
        layer); its sizes are the rank's."""
        m = module
        self.tp = tp
        nk, nv, self.dk, self.dv = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
        # this rank's rows of each projection, in the model's coordinates (delta_net_spans; the whole layer's with
        # one rank): key head i serves value heads [i nv/nk, (i + 1) nv/nk), as the repeat_interleave of the
        # model's rule and of _step
        self.spans = delta_net_spans(tp, nk, nv, self.dk, self.dv)
        (v0, v1), = self.spans["heads"]
        self.nk, self.nv = nk // tp.size, v1 - v0
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = m.conv_kernel_size
        self.eps = m.norm.variance_epsilon
        self.conv = torch.zeros(max_batch, self.conv_dim, self.kernel - 1, device=device, dtype=dtype)
        self.rec = torch.zeros(max_batch, self.nv, self.dk, self.dv, device=device, dtype=torch.float32)
        # the model's chunked delta rule for prefill (the function its own forward calls)
        cls = next(c for c in type(m).__mro__ if c.__name__ in CLASSES)
        self.chunk_rule = inspect.getmodule(cls).torch_chunk_gated_delta_rule
        self.w = {}  # filled by load, which the decoder calls with the layer gathered

    def _mine(self, m):
        """This rank's slices of the layer's tensors (the whole ones with one rank): (the input projections' pieces
        in the fused order, the other tensors, the adapters' low-rank pairs). An FSDP2-sharded layer's are cut from
        its shards (tensor_parallel's `Slice.take`: each rank names its spans as a function of its Slice), its gated
        norm and its adapters' factors gathered whole (small: r rows or columns each), then cut here."""
        tp, sizes = self.tp, (m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim)

        def rows(t, name, dim=0, j=None):  # its spans `name` of t, or the j-th of them alone
            return tp.take(t, dim, lambda s: delta_net_spans(s, *sizes)[name][slice(j, None if j is None else j + 1)])

        sp = self.spans
        parts = [m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a]
        pieces = [rows(p.weight, name, j=j) for p, name in zip(parts, ("qkv", "values", "heads", "heads"))
                  for j in range(len(sp[name]))]
        conv_b = m.conv1d.bias
        own = {"out": rows(m.out_proj.weight, "values", 1), "conv": rows(m.conv1d.weight, "qkv")[:, 0],
               "conv_b": None if conv_b is None else rows(conv_b, "qkv"), "A_log": rows(m.A_log, "heads"),
               "dt_bias": rows(m.dt_bias, "heads"), "norm": tp.whole(m.norm.weight)}
        # an adapter's A reads the whole input and B writes the outputs: the input projections keep their rows of
        # B, out_proj its columns of A (its B, applied to a partial sum, is linear, so the ranks' terms add up)
        read = lambda t: tp.whole(t.detach())  # noqa: E731
        in_lr, out_lr = lora.stacked_low_rank(parts, read), lora.stacked_low_rank([m.out_proj], read)
        low_rank = {"in_lr": None if in_lr is None else (in_lr[0], _rows(in_lr[1], sp["in"])),
                    "out_lr": None if out_lr is None else (_rows(out_lr[0], sp["values"], 1), out_lr[1])}
        return pieces, own, low_rank

    @torch.no_grad()
    def load(self, m):
        """Copy the layer's weights in (the projections fused), into the same tensors after the first load (captured
        graphs hold them); under FSDP2 the decoder calls this while the layer is gathered."""
        fused, own, low_rank = self._mine(m)
        # adapters (LoRA) stay apart from the weights, their low-rank terms added as LoRALinear adds them: merged,
        # their rounding would move the gates, and the recurrence carries such a change along the whole row
        if "in" not in self.w:
            self.w["in"] = torch.cat([p.detach() for p in fused])
            self.w.update({k: None if t is None else t.detach().clone() for k, t in own.items()})
            self.w.update({k: None if lr is None else tuple(t.clone() for t in lr) for k, lr in low_rank.items()})
        else:
            torch.cat([p.detach() for p in fused], out=self.w["in"])
            for k, t in own.items():
                if t is not None:
                    self.w[k].copy_(t)
            for k, lr in low_rank.items():
                if lr is not None:
                    for mine, t in zip(self.w[k], lr):
                        mine.copy_(t)

    def nbytes(self):
        """Bytes of the weight copies this layer holds (its states apart)."""
        tensors = [t for v in self.w.values() if v is not None for t in (v if isinstance(v, tuple) else (v,))]
        return sum(t.numel() * t.element_size() for t in tensors)

    def snapshot(self):
        return self.conv.clone(), self.rec.clone()

    def restore(self, states):
        self.conv.copy_(states[0])
        self.rec.copy_(states[1])

    def reset(self, rows):
        """Empty states for the batch rows `rows` (a tensor): a new row enters there, by `extend`."""
        self.conv[rows] = 0
        self.rec[rows] = 0

    def copy_rows(self, src, dst):
        """Batch rows dst (a tensor) take the states of rows src."""
        self.conv[dst] = self.conv[src]
        self.rec[dst] = self.rec[src]

    def compact(self, keep):
        k = keep.numel()
        self.conv[:k] = self.conv[keep]
        self.rec[:k] = self.rec[keep]

    def _split(self, h):
        """The fused projection of h (..., H): the convolution's input (..., C), z (..., value heads, dv), b, a."""
        proj = _linear(h, self.w["in"], self.w["in_lr"])
        c, v = self.conv_dim, self.value_dim
        z = proj[..., c:c + v].unflatten(-1, (self.nv, self.dv))
        return proj[..., :c], z, proj[..., c + v:c + v + self.nv], proj[..., c + v + self.nv:]

    def _gates(self, b, a):
        """beta (step size) and g (log decay) per value head, as the model computes them."""
        return b.sigmoid(), -self.w["A_log"].float().exp() * F.softplus(a.float() + self.w["dt_bias"])

    def _heads(self, mixed):
        """q, k (..., key heads, dk) and v (..., value heads, dv) from the convolution's output."""
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.unflatten(-1, (self.nk, self.dk)), k.unflatten(-1, (self.nk, self.dk)),
                v.unflatten(-1, (self.nv, self.dv)))

    def _out(self, core, z):
        """The gated RMSNorm over each value head, then the output projection: core, z (..., nv, dv). With tp, the
        rank's partial sum of the output (its value heads through its columns of out_proj)."""
        dtype = z.dtype
        x = core.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = (self.w["norm"] * x.to(dtype)) * F.silu(z.float())
        return _linear(x.to(dtype).flatten(-2), self.w["out"], self.w["out_lr"])

    def prefill(self, h, valid):
        """h (N, P, H) the layer's normed inputs, valid (N, P) the real tokens: the layer's output (N, P, H); rows
        [0, N) of the states set to what the prompts leave."""
        n, p, _ = h.shape
        h = h * valid[:, :, None].to(h.dtype)  # padding enters as zeros, as in the model
        mixed, z, b, a = self._split(h)
        x = mixed.transpose(1, 2)  # (N, C, P)
        conv = F.conv1d(x, self.w["conv"][:, None], self.w["conv_b"], padding=self.kernel - 1,
                        groups=self.conv_dim)[:, :, :p]
        keep = F.pad(x, (max(0, self.kernel - 1 - p), 0))[:, :, -(self.kernel - 1):] if self.kernel > 1 else x[:, :, :0]
        self.conv[:n] = keep
        q, k, v = self._heads(F.silu(conv).to(h.dtype).transpose(1, 2))
        beta, g = self._gates(b, a)
        core, state = self.chunk_rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)
        self.rec[:n] = state
        return self._out(core, z)

    def _step(self, mixed, z, b, a, conv, rec):
        """One token per row from its projections (rows, ...) and states; (output, new conv, new rec)."""
        window = torch.cat([conv, mixed[:, :, None]], -1)  # (rows, C, kernel)
        out = (window * self.w["conv"]).sum(-1)
        if self.w["conv_b"] is not None:
            out = out + self.w["conv_b"]
        q, k, v = self._heads(F.silu(out))
        beta, g = self._gates(b, a)
        rep = self.nv // self.nk
        q, k = (t.repeat_interleave(rep, dim=1).float() for t in (q, k))  # each key head serves rep value heads
        q, k, v = _l2norm(q), _l2norm(k), v.float()
        q = q / (self.dk ** 0.5)
        rec = rec * g.exp()[:, :, None, None]
        delta = (v - (rec * k[:, :, :, None]).sum(-2)) * beta.float()[:, :, None]
        rec = rec + k[:, :, :, None] * delta[:, :, None, :]
        core = (rec * q[:, :, :, None]).sum(-2)  # (rows, nv, dv)
        return self._out(core.to(z.dtype), z), window[:, :, 1:], rec

    def decode(self, h):
        """h (b, H), one token for each of the first b rows: the layer's output (b, H); their states updated."""
        bsz = h.shape[0]
        out, conv, rec = self._step(*self._split(h), self.conv[:bsz], self.rec[:bsz])
        self.conv[:bsz].copy_(conv)
        self.rec[:bsz].copy_(rec)
        return out

    def extend(self, h, valid, rows=None):
        """h (b, K, H) a block of tokens per row, valid (b, K) the real ones: the output (b, K, H), each row's
        states moved by its real tokens only, a token at a time. rows: the batch rows (a slice or a tensor (b,));
        default the first b."""
        bsz, width, _ = h.shape
        rows = slice(0, bsz) if rows is None else rows
        mixed, z, b, a = self._split(h)
        conv, rec = self.conv[rows], self.rec[rows]
        outs = []
        for c in range(width):
            out, new_conv, new_rec = self._step(mixed[:, c], z[:, c], b[:, c], a[:, c], conv, rec)
            real = valid[:, c]
            conv = torch.where(real[:, None, None], new_conv, conv)
            rec = torch.where(real[:, None, None, None], new_rec, rec)
            outs.append(out)
        self.conv[rows] = conv
        self.rec[rows] = rec
        return torch.stack(outs, 1)


# ----------------------------------------------------------------------------- training: the state forked in a tree


class Fork:
    """What a Gated DeltaNet module of the model's own forward takes as its attention mask when the rows that share a
    prompt run as trees (--shared_prompts; `take_forks`): the tree's layout, transformer.Tree's fields (prompt,
    prompt_len, branch, group, inverse), which say where each prompt's and each branch's positions are in the (B, L)
    sequences, flattened."""

    def __init__(self, tree):
        self.tree = tree


def take_forks(module):
    """Let the model's own Gated DeltaNet `module` take a `Fork` for its attention mask: its forward, on this
    instance, runs `fork` then, and its class's forward otherwise. It stays so (a layer recomputed in backward under
    activation checkpointing runs its forward again); a copy of the model (deepcopy) keeps it, bound to the copy."""
    if "forward" not in module.__dict__:
        module.forward = types.MethodType(_forward_or_fork, module)


def _forward_or_fork(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    if isinstance(attention_mask, Fork):
        return fork(self, hidden_states, attention_mask.tree)
    return type(self).forward(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)


def _chunk_rule(module):
    """The chunked gated delta rule the module's own forward calls (its file's, a kernel where one is installed)."""
    cls = next(c for c in type(module).__mro__ if c.__name__ in CLASSES)
    return inspect.getmodule(cls).torch_chunk_gated_delta_rule


def _conv_tail(x, length, width):
    """The last `width` inputs of each prompt, x (B, Pm, C) with `length` (B,) real ones: (B, width, C), zeros before
    a prompt's first token (what the causal convolution's padding gives a row)."""
    j = length[:, None] - width + torch.arange(width, device=x.device)  # (B, width)
    tail = x.gather(1, j.clamp(min=0)[..., None].expand(-1, -1, x.shape[-1]))
    return tail * (j >= 0)[..., None].to(x.dtype)


def fork(m, h, tree):
    """The Gated DeltaNet module m (transformers' Qwen3_5GatedDeltaNet) over a tree's sequences, h (B, L, H) the
    layer's normed inputs -> (B, L, H), differentiable, the module's own projections, norm and rule.

    Each prompt runs once from zero states; each branch continues from its prompt's: the convolution over the
    prompt's last kernel-1 inputs then the branch's, the chunked delta rule from the prompt's final recurrent state
    (`initial_state`), as a row's one pass over prompt and completion computes. A prompt's state is indexed per
    branch (no state is updated in place), so its gradient sums over the branches. Prompts shorter than the longest
    hold padding at their end: there beta and g are zero (no update, no decay), so the state past it is the state
    at the prompt's end."""
    mixed = m.in_proj_qkv(h).flatten(0, 1)  # (B * L, C): the projections are per token
    z = m.in_proj_z(h)
    beta_all, a = m.in_proj_b(h).sigmoid().flatten(0, 1), m.in_proj_a(h).flatten(0, 1)
    g_all = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
    weight, bias, k = m.conv1d.weight, m.conv1d.bias, m.conv_kernel_size
    rule = _chunk_rule(m)

    def heads(conv):  # the convolution's output (n, len, C) -> q, k, v (n, len, heads, dim)
        q, key, v = torch.split(F.silu(conv), [m.key_dim, m.key_dim, m.value_dim], dim=-1)
        return (q.unflatten(-1, (-1, m.head_k_dim)), key.unflatten(-1, (-1, m.head_k_dim)),
                v.unflatten(-1, (-1, m.head_v_dim)))

    xp = mixed[tree.prompt]  # (B, Pm, C)
    pm = xp.shape[1]
    conv = F.conv1d(xp.transpose(1, 2), weight, bias, padding=k - 1, groups=m.conv_dim)[:, :, :pm]
    real = torch.arange(pm, device=h.device)[None] < tree.prompt_len[:, None]  # (B, Pm)
    beta = torch.where(real[..., None], beta_all[tree.prompt], 0)
    g = torch.where(real[..., None], g_all[tree.prompt], 0)
    out, state = rule(*heads(conv.transpose(1, 2)), g=g, beta=beta, initial_state=None, output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
    outs = [out.flatten(0, 1)]
    if tree.branch is not None:
        xb = torch.cat([_conv_tail(xp, tree.prompt_len, k - 1)[tree.group], mixed[tree.branch]], 1)
        conv = F.conv1d(xb.transpose(1, 2), weight, bias, groups=m.conv_dim)  # (R, C, Cm)
        out, _ = rule(*heads(conv.transpose(1, 2)), g=g_all[tree.branch], beta=beta_all[tree.branch],
                      initial_state=state[tree.group], output_final_state=False, use_qk_l2norm_in_kernel=True)
        outs.append(out.flatten(0, 1))
    core = torch.cat(outs)[tree.inverse]  # (B * L, value heads, dv), in the sequences' order
    core = m.norm(core.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim))  # the gated norm per value head
    return m.out_proj(core.reshape(*h.shape[:2], -1))
