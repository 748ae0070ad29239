"""Token log-probs of completions, computed without the full logits, and the micro-batches they are taken in.
One concern in one file (past 650 lines on purpose): how a batch's rows are laid out (micro-batches, padding
moved, prompt trees) is what the forward and the chunked head read, and the three change together.

`completion_logprobs` runs the training forward (written out where layers/transformer.py can, else the model's own)
and the chunked head: the log-prob of each completion token (and its entropy) from the last hidden states,
chunk by chunk over the vocabulary with a hand-written backward, so the (tokens x vocabulary) logits never exist
whole. The head applies what the model applies to its final logits (`transformer.head_of`: a scale, a softcap),
as the sampler does.
`micro_batches` packs a step's rows into forwards of equal cost (sorted by length, trimmed to the longest row).
With --shared_prompts (`SharedPrompts`), the rows of a micro-batch that share a prompt run as one sequence, the
prompt once and each completion a branch (`pack`), and the log-probs come back in the same (N, T) layout.

Shapes: N completions, T completion length, V vocabulary.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from layers import vision
from layers import static_recurrent
from layers import transformer
from layers.transformer import head_of, hidden_states

# ----------------------------------------------------------------------------- positions


def position_ids_from_mask(attention_mask):
    """Left padding shifts where real tokens start: position 0 is each row's first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


# ----------------------------------------------------------------------------- token log-probs


def _chunk_stats(z, targets, inv_temperature):
    """One chunk of logits (rows, V) -> each row's log-sum-exp, target log-prob and entropy, in float32.

    The math of the eager loop below, written without in-place ops so that
    torch.compile turns it into a couple of passes over the (bf16) logits.
    """
    z = z.float() * inv_temperature
    top = z.amax(-1, keepdim=True)
    shifted = z - top
    prob = shifted.exp()  # unnormalised
    total = prob.sum(-1, keepdim=True)
    log_total = total.log()
    logp = shifted.gather(-1, targets[:, None]) - log_total
    entropy = log_total - (shifted * prob).sum(-1, keepdim=True) / total
    return (top + log_total)[:, 0], logp[:, 0], entropy[:, 0]


def _chunk_grad(z, targets, lse, grad, inv_temperature):
    """d(sum grad * logp) / d logits for one chunk: grad * (onehot(target) - softmax) / temperature, in z's dtype."""
    prob = (z.float() * inv_temperature - lse[:, None]).exp()
    hit = torch.arange(z.shape[-1], device=z.device) == targets[:, None]
    return ((hit.float() - prob) * (grad[:, None] * inv_temperature)).to(z.dtype)


_FUSED = {}


def fused_head_available(device):
    """On CUDA with Triton, the chunk math runs compiled: the eager version makes about ten float32 passes
    over each (rows, V) chunk of logits, which costs more than the vocabulary matmul itself."""
    return torch.device(device).type == "cuda" and _has_triton()


def _has_triton():
    try:
        import triton  # noqa: F401  (torch.compile's GPU code generator)
    except ImportError:
        return False
    return True


def _fused(name):
    if not _FUSED:  # compiled on first use; dynamic: chunks of any number of rows share one kernel
        _FUSED["stats"] = torch.compile(_chunk_stats, dynamic=True)
        _FUSED["grad"] = torch.compile(_chunk_grad, dynamic=True)
    return _FUSED[name]


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """log softmax(hidden @ weight.T / temperature)[target] and the entropy, chunk by chunk of rows.

    Forward keeps one chunk of logits at a time and saves only the inputs and
    each row's log-sum-exp; backward recomputes a chunk's logits and writes the
    gradient d logp / d logits = (onehot(target) - softmax) / temperature
    directly, so each chunk costs two float32 (chunk, V) buffers and no
    autograd graph over the vocabulary. When all rows fit in one chunk, that
    chunk's softmax is kept for backward instead of recomputed. The entropy
    is a metric without gradient unless `entropy_grad` (an entropy bonus in the loss): then backward adds
    d H / d z = -p (log p + H) for z = logits / temperature, with a chunk's logits recomputed.
    `head`: what the model applies to its final logits (`transformer.head_of`), or None.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, entropy_grad=False, head=None):
        n = hidden.shape[0]
        logp = torch.empty(n, device=hidden.device, dtype=torch.float32)
        entropy, lse = torch.empty_like(logp), torch.empty_like(logp)
        kept = None
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            z = F.linear(hidden[s:e], weight).float()
            if head is not None:
                z = head.apply(z)
            if temperature != 1.0:
                z.div_(temperature)
            top = z.amax(-1, keepdim=True)
            z.sub_(top)  # shifted logits, at most 0
            prob = z.exp()  # the only exp per logit: log-sum-exp, log-prob and entropy all come from it
            total = prob.sum(-1, keepdim=True)
            log_total = total.log()
            lse[s:e] = (top + log_total)[:, 0]
            logp[s:e] = (z.gather(-1, targets[s:e, None]) - log_total)[:, 0]
            prob.div_(total)  # softmax
            entropy[s:e] = log_total[:, 0] - z.mul_(prob).sum(-1)  # -sum p log p = log total - sum p z
            if n <= chunk and any(ctx.needs_input_grad[:2]) and not entropy_grad and head is None:
                kept = prob
        ctx.save_for_backward(hidden, weight, targets, lse, kept, entropy if entropy_grad else None)
        ctx.temperature, ctx.chunk, ctx.fused, ctx.entropy_grad = temperature, chunk, False, entropy_grad
        ctx.head = head
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, kept, entropy = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[:2]
        grad_h = torch.empty_like(hidden) if want_h else None
        # the weight's gradient sums over every chunk: in float32, so that bf16 rounding does not grow with
        # the number of chunks (each chunk's product is still one bf16 matmul)
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if want_w else None
        n, chunk = hidden.shape[0], ctx.chunk
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            if kept is not None:  # the only chunk's softmax, kept from the forward
                g = grad_logp[s:e, None].float()
                # -g * softmax (a new tensor: a retained graph may run backward again)
                z = _logit_grad(kept * -g, targets[s:e], g, ctx.temperature).to(hidden.dtype)
            else:
                z = _recomputed_grad(ctx, ctx.saved_tensors, grad_logp, grad_entropy, s, e)
            if want_h:
                grad_h[s:e] = z @ weight
            if want_w:
                if z.dtype == torch.float32:
                    grad_w.addmm_(z.t(), hidden[s:e])
                else:
                    grad_w += z.t() @ hidden[s:e]
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None


def _logit_grad(z, targets, g, temperature):
    """d(sum g * logp) / d logits from z = -g * softmax: g added at each row's target, over the temperature."""
    z.scatter_add_(-1, targets[:, None], g)  # + g at the target
    return z.div_(temperature) if temperature != 1.0 else z


class _FusedTokenLogprobs(_ChunkedTokenLogprobs):
    """_ChunkedTokenLogprobs with each chunk's math compiled (`_chunk_stats`, and `_chunk_grad` in its backward;
    `fused_head_available`): for bf16 weights, no float32 copy of a chunk's logits. It knows no head transform; with
    `entropy_grad`, backward's chunks take the eager path (`_recomputed_grad`). Its backward is the parent's, whose
    last gradient (None, for the parent's `head`) autograd drops: this forward takes one input fewer."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, entropy_grad=False):
        n = hidden.shape[0]
        logp = torch.empty(n, device=hidden.device, dtype=torch.float32)
        entropy, lse = torch.empty_like(logp), torch.empty_like(logp)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            lse[s:e], logp[s:e], entropy[s:e] = _fused("stats")(F.linear(hidden[s:e], weight), targets[s:e],
                                                                 1.0 / temperature)
        ctx.save_for_backward(hidden, weight, targets, lse, None, entropy if entropy_grad else None)
        ctx.temperature, ctx.chunk, ctx.fused, ctx.entropy_grad = temperature, chunk, True, entropy_grad
        ctx.head = None
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy


def _recomputed_grad(ctx, saved, grad_logp, grad_entropy, s, e):
    """Chunk s:e's d loss / d logits from its logits recomputed (`saved`: the forward's tensors), in their dtype:
    compiled (`fused`), or eagerly, through the head's transform and with the entropy's gradient where they apply."""
    hidden, weight, targets, lse, _, entropy = saved
    h, targets, lse, grad_logp = hidden[s:e], targets[s:e], lse[s:e], grad_logp[s:e]
    grad_entropy = None if grad_entropy is None else grad_entropy[s:e]
    if ctx.fused and not (ctx.entropy_grad and grad_entropy is not None):
        return _fused("grad")(F.linear(h, weight), targets, lse, grad_logp.float(), 1.0 / ctx.temperature)
    g = grad_logp[:, None].float()
    raw = z = F.linear(h, weight).float()
    if ctx.head is not None:
        z = ctx.head.apply(raw.clone())
    if ctx.temperature != 1.0:
        z.div_(ctx.temperature)
    z.sub_(lse[:, None])  # log softmax
    with_entropy = ctx.entropy_grad and grad_entropy is not None
    if with_entropy:  # the entropy's gradient: -p (log p + H), times its incoming gradient
        extra = z.exp() * (z + entropy[s:e, None]) * -grad_entropy[:, None].float()
    z.exp_().mul_(-g)  # -g * softmax
    if with_entropy:
        z.add_(extra)
    z = _logit_grad(z, targets, g, ctx.temperature)
    if ctx.head is not None:  # the chain rule through the head's transform of the raw logits
        z.mul_(ctx.head.derivative(raw))
    return z.to(h.dtype)


def default_chunk_tokens(vocab_size, device):
    """Rows per chunk of the vocabulary projection: 16M logits on CPU (64 MB in float32), 128M on GPU."""
    budget = 1 << (27 if torch.device(device).type == "cuda" else 24)
    return max(1, budget // vocab_size)


def completion_logprobs(model, input_ids, attention_mask, num_completion_tokens, temperature=1.0,
                        chunk_tokens=None, fused=None, fast_forward=None, width=None, compile_layers=False,
                        entropy_grad=False, forward=None, extras=None):
    """Log-probs (and entropies) of the last `num_completion_tokens` tokens of each row, in float32.

    input_ids (N, S) are left-padded prompts then completions; attention_mask (N, S) marks the real tokens.
    `forward` (the run's, `run.forward`; given none, `default_forward` of `fast_forward` and `compile_layers`) lays the
    rows out over `width` columns (`MicroBatch.width`) and gives the final hidden states that predict the completion
    tokens; `extras`, what a feature's forward reads of the rows (`Around`), passes through unread.
    The vocabulary projection then runs over chunks of `chunk_tokens` positions and is recomputed chunk by chunk
    in backward, so no (N, T, V) float32 tensor ever exists. Temperature is applied exactly as in `sample`.
    Returns (logp, entropy), each (N, T); entropy has no gradient unless `entropy_grad` (for an entropy bonus).
    `fused` (default: on CUDA with Triton) runs each chunk's math compiled."""
    forward = forward or default_forward(fast_forward, compile_layers, width)
    t = num_completion_tokens
    rows = forward.layout(model, input_ids, attention_mask, t, width, extras)
    hidden = rows.predicting(forward.hidden(model, rows, extras))
    return _token_logprobs(model, hidden, input_ids[:, -t:], temperature, chunk_tokens, fused, entropy_grad)


class Forward:
    """The training forward, in two parts: `layout` lays the rows out (`Layout`: each row's padding moved to its
    end), `hidden` runs the model over them; the laid-out rows' `predicting` then picks the positions before the
    completion tokens. The written-out layers (`transformer.hidden_states`, compiled with `compile_layers`) run
    where `fast_forward` says, by default where the run decided (`transformer.paths_of`), else the model's own
    forward (never compiled here).
    A feature's variant wraps a forward (features/routing_replay.py's, features/images.py's, `TreeForward`): it
    has the same three methods and
    hands to its `inner` forward what it does not change.
    """

    def __init__(self, fast_forward=None, compile_layers=False):
        self.fast_forward, self.compile_layers = fast_forward, compile_layers

    def layout(self, model, input_ids, attention_mask, t, width, extras):
        return Layout.of(input_ids, attention_mask, t, width)

    def written_out(self, model):
        if self.fast_forward is None:
            return transformer.paths_of(model).trains_written_out(model)  # the run's, decided at setup
        return self.fast_forward

    def hidden(self, model, rows, extras):
        """The final-norm hidden states (N, width, H) over the laid-out rows."""
        if self.written_out(model):
            return hidden_states(model, rows.ids, rows.mask, rows.positions, compiled=self.compile_layers)
        return model.base_model(input_ids=rows.ids, attention_mask=rows.mask, position_ids=rows.positions,
                                use_cache=False).last_hidden_state


def _lead(attention_mask, t):
    """(each row's leading padding columns (N,), whether the rows are left-padded only with a real prompt token
    each, whether any row is padded)."""
    s = attention_mask.shape[1]
    lead = (attention_mask.cumsum(1) == 0).sum(1)
    # left padding only, and every row with a real prompt token (an empty prompt's first token would be
    # predicted from itself once moved): then the move applies
    movable = ((attention_mask.sum(1) + lead == s) & (lead < s - t)).all()
    return lead, *torch.stack([movable, lead.any()]).tolist()


@dataclass
class Layout:
    """A micro-batch's rows as the forward takes them (`of`).

    Each row's left padding is moved to its right end before the forward, so
    every row starts at column 0 with position 0 and attention needs no mask:
    plain causal attention gives each real token exactly the keys it had, and
    the padding, now after the row's last token, is never attended by a real
    one. Without a mask SDPA takes its flash kernel, with grouped-query
    attention and no copies of K/V, where a mask forces the slower
    memory-efficient kernel and, on CUDA, repeated K/V. A mask with holes
    other than left padding, or a row with no real prompt token, is passed
    to the forward as it is (and `width` is then not applied).
    `width` (with left padding only): the forward runs over the first `width`
    columns of the moved rows: for the row whose real prompt plus counted
    completion is longest, all but its last token (`MicroBatch.width`).
    Completion tokens predicted from past `width` then get finite log-probs
    that mean nothing, for the caller to mask.
    """
    input_ids: torch.Tensor       # (N, S) as given
    attention_mask: torch.Tensor  # (N, S) as given
    t: int                        # completion tokens
    lead: torch.Tensor            # (N,) the columns each row moved left by
    cols: object                  # (N, S) each moved column's source column; None: none moved
    width: int                    # columns the forward runs
    ids: torch.Tensor = None      # (N, width) the laid-out rows
    real: torch.Tensor = None     # (N, width) their real tokens
    mask: object = None           # the forward's attention mask: None (causal), or attention_mask as given
    positions: torch.Tensor = None

    @staticmethod
    def of(input_ids, attention_mask, t, width=None):
        s = input_ids.shape[1]
        lead, left_padded_only, padded = _lead(attention_mask, t)
        if not left_padded_only:
            return Layout.as_given(input_ids, attention_mask, t)
        # each row rolled left by its padding: (pad pad a b c) -> (a b c pad pad)
        cols = (torch.arange(s, device=input_ids.device) + lead[:, None]) % s if padded else None
        rows = Layout(input_ids, attention_mask, t, lead, cols, s if width is None else min(width, s))
        rows.ids, rows.real = rows.move(input_ids), rows.move(attention_mask.bool())
        rows.positions = torch.arange(rows.ids.shape[1], device=input_ids.device).expand(rows.ids.shape)
        return rows

    @staticmethod
    def as_given(input_ids, attention_mask, t):
        """The rows as they are, under their attention mask: where the padding cannot move (`of`)."""
        lead = torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
        return Layout(input_ids, attention_mask, t, lead, None, input_ids.shape[1], input_ids, attention_mask.bool(),
                      attention_mask, position_ids_from_mask(attention_mask))

    def move(self, x):
        """x (N, S, ...), a value per token, laid out as the rows are: moved with its row, cut to `width`."""
        if self.cols is not None:
            x = x.gather(1, self.cols.view(*self.cols.shape, *[1] * (x.dim() - 2)).expand_as(x))
        return x[:, :self.width]

    def predicting(self, hidden):
        """The hidden states (N * T, H) that predict the completion tokens, of the forward's (N, width, H)."""
        (n, s), t, h = self.input_ids.shape, self.t, hidden.shape[-1]
        # the position before each completion token predicts it: column s - t - 1 + j, moved left with its row
        # (clamped: past `width` the last column stands in, for tokens the caller does not count)
        before = (torch.arange(s - t - 1, s - 1, device=hidden.device) - self.lead[:, None]).clamp(
            0, hidden.shape[1] - 1)
        return hidden.gather(1, before[..., None].expand(n, t, h)).reshape(n * t, h)


def _token_logprobs(model, hidden, targets, temperature, chunk_tokens, fused, entropy_grad):
    """The head over the hidden states (N * T, H) that predict targets (N, T): (log-probs, entropies), each (N, T).
    Each chunk's math compiled (`_FusedTokenLogprobs`) where `fused` and the model's logits have no transform."""
    n, t = targets.shape
    weight, head = model.get_output_embeddings().weight, head_of(model)
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0], weight.device)
    args = (hidden, weight, targets.reshape(n * t), float(temperature), chunk, bool(entropy_grad))
    compiled = head is None and (fused_head_available(weight.device) if fused is None else fused)
    logp, entropy = _FusedTokenLogprobs.apply(*args) if compiled else _ChunkedTokenLogprobs.apply(*args, head)
    return logp.view(n, t), entropy.view(n, t)


def default_forward(fast_forward=None, compile_layers=False, width=None):
    """The forward of a `completion_logprobs` call given none: the plain `Forward`, run as a tree (`TreeForward`)
    for --shared_prompts' micro-batches (a SharedPrompts `width`)."""
    forward = Forward(fast_forward, compile_layers)
    return TreeForward(forward) if isinstance(width, SharedPrompts) else forward


# ----------------------------------------------------------------------------- shared prompts


@dataclass(frozen=True)
class SharedPrompts:
    """A micro-batch's rows under --shared_prompts, in place of `MicroBatch.width`: each row's completion positions
    that count (1 + its last counted one; 0: none), in the micro-batch's row order, and the width of the padded
    forward, for where the prompts cannot be shared (`completion_logprobs`)."""
    completion: tuple
    width: int

    def rows(self, index):
        """These rows' share (a slice or positions of the micro-batch's rows)."""
        kept = self.completion[index] if isinstance(index, slice) else tuple(self.completion[i] for i in index)
        return SharedPrompts(kept, self.width)


def shares_prompts(model, written_out):
    """Whether the training forward of `model` takes rows packed as trees: the written-out layers always (the dense
    families), the model's own forward where `transformer.tree_refusal` finds nothing (the MoE families, Qwen3.5 with
    its Gated DeltaNet states forked at each prompt's end). The others keep the padded forward: vision-language
    models, and a model the family table does not describe."""
    if vision.is_vision_model(model):
        return False
    return written_out or transformer.tree_refusal(model) is None


class Around:
    """A variant of the training forward around `inner` (a `Forward` or another variant): it hands on what it does
    not change. A feature's variant (features/routing_replay.py's, features/images.py's, `TreeForward`) subclasses it
    and overrides the method it changes."""

    def __init__(self, inner):
        self.inner = inner

    def layout(self, model, input_ids, attention_mask, t, width, extras):
        return self.inner.layout(model, input_ids, attention_mask, t, width, extras)

    def written_out(self, model):
        return self.inner.written_out(model)

    def hidden(self, model, rows, extras):
        return self.inner.hidden(model, rows, extras)


class TreeForward(Around):
    """The training forward around `inner` for --shared_prompts, where a micro-batch's `width` is a SharedPrompts
    (`shared_micro_batches` makes them): the rows that share a prompt run as one sequence, the prompt once
    and each completion a branch (`pack`), where `shares_prompts` says the forward takes it and the rows are
    left-padded only, without images; elsewhere the padded forward runs with the SharedPrompts' `width`. The
    log-probs are the same either way, in the same (N, T) layout. The variants inside it run over the packed rows
    (`Packed`, which `inner.hidden` takes as it takes a `Layout`)."""

    def layout(self, model, input_ids, attention_mask, t, width, extras):
        if not isinstance(width, SharedPrompts):
            return self.inner.layout(model, input_ids, attention_mask, t, width, extras)
        extras = extras or {}
        images, written_out = extras.get("images"), self.written_out(model)
        pictures = images is not None and any(g.shape[0] for g in images.grid)
        if not _lead(attention_mask, t)[1] or pictures or not shares_prompts(model, written_out):
            return self.inner.layout(model, input_ids, attention_mask, t, width.width, extras)
        packed = pack(input_ids, attention_mask, t, width.completion, extras.get("routing"), flat=written_out)
        packed.mask = packed.tree if written_out else own_forward_tree_mask(model, packed)
        return packed


@dataclass
class Packed:
    """A micro-batch's rows packed one sequence per distinct prompt (`pack`): the prompt's real tokens once, then each
    of its rows' completions as a branch; the sequences padded at their end to the longest, L positions (B, L), or
    back to back in one row without padding (1, L), `pack(flat=True)`."""
    ids: torch.Tensor        # (B, L)
    positions: torch.Tensor  # (B, L) a prompt's from 0; a branch's from its prompt's end; 0 at padding
    real: torch.Tensor       # (B, L) False at padding
    source: torch.Tensor     # (B, L) each position's token in the micro-batch's (N * S) flattened
    segment: torch.Tensor    # (B, L) -1 in a prompt, the row r in row r's branch, -2 at padding
    before: torch.Tensor     # (N, T) the position (of B * L) whose hidden state predicts each completion token
    tree: transformer.Tree   # the same layout for the written-out attention
    mask: object = None      # the forward's attention mask: the tree (written-out layers) or `own_forward_tree_mask`

    def move(self, x):
        """x (N, S, ...), a value per token of the micro-batch's rows, at the packed positions; -1 at padding."""
        flat = x.reshape(-1, *x.shape[2:])[self.source]
        return torch.where(self.real.view(*self.real.shape, *[1] * (flat.dim() - 2)), flat, -1)

    def predicting(self, hidden):
        """The hidden states (N * T, H) that predict the completion tokens, of the forward's over the sequences."""
        return hidden.reshape(-1, hidden.shape[-1])[self.before.reshape(-1)]

    def positions_computed(self):
        """What the forward runs over, padding between the sequences included."""
        return self.ids.numel()


def pack(input_ids, attention_mask, t, completion, routing=None, flat=False):
    """The rows input_ids (N, S), left-padded prompts then T = `t` completion tokens, packed as `Packed` trees.

    Rows whose real prompt tokens are the same form a sequence (a group, or what of it is in the micro-batch); with
    routing replay's `routing` (N, S, layers, k), rows whose prompts' recorded experts differ too are apart (a
    prompt computed once routes once: as the sampler routed it in each of its rows, where they agree). Row r's
    branch holds its completion tokens up to its last counted one, not included (completion[r] - 1 of them: the last
    predicts nothing): its first completion token is predicted by the prompt's last position, its j-th by its branch's
    (j - 1)-th. Past completion[r] (tokens the caller does not count) the branch's last position stands in.
    `flat`: the sequences back to back in one row, without the padding that makes them as long as the longest (the
    written-out layers: their attention reads the prompts and branches by index, whatever the layout; the model's own
    forward takes a (B, 1, L, L) mask, whose cost would grow with the square of all the sequences together).
    """
    n, s = input_ids.shape
    p, dev = s - t, input_ids.device
    real_prompt = attention_mask[:, :p].bool()
    key = torch.where(real_prompt, input_ids[:, :p], -1)
    if routing is not None:
        key = torch.cat([key, torch.where(real_prompt[..., None, None], routing[:, :p], -2).flatten(1)], 1)
    _, group = torch.unique(key, dim=0, return_inverse=True)
    prompt_len = real_prompt.sum(1).tolist()
    rows_of = {}  # prompt -> its rows, in order of first appearance
    for r, g in enumerate(group.tolist()):
        rows_of.setdefault(g, []).append(r)
    rows_of = list(rows_of.values())
    branch = [max(0, min(c, t) - 1) for c in completion]  # tokens in each row's branch
    lengths = [prompt_len[rows[0]] + sum(branch[r] for r in rows) for rows in rows_of]
    length = max(lengths)
    offset = [sum(lengths[:b]) if flat else b * length for b in range(len(rows_of))]  # each sequence's first position
    src, pos, seg = [], [], []
    seq, start = [0] * n, [0] * n  # each row's sequence and where its branch starts there
    for b, rows in enumerate(rows_of):
        pl = prompt_len[rows[0]]
        first = rows[0] * s + p - pl  # the prompt's first real token in the flattened rows
        parts = [(torch.arange(first, first + pl), torch.arange(pl), torch.full((pl,), -1))]
        at = pl
        for r in rows:
            seq[r], start[r] = b, at
            parts.append((torch.arange(r * s + p, r * s + p + branch[r]), torch.arange(pl, pl + branch[r]),
                          torch.full((branch[r],), r)))
            at += branch[r]
        pad = 0 if flat else length - at
        parts.append((torch.full((pad,), first), torch.zeros(pad, dtype=torch.long), torch.full((pad,), -2)))
        for out, i in ((src, 0), (pos, 1), (seg, 2)):
            out.append(torch.cat([part[i] for part in parts]))
    src, pos, seg = (torch.cat(x)[None].to(dev) if flat else torch.stack(x).to(dev) for x in (src, pos, seg))
    nseq, total = len(rows_of), src.numel()
    prompt_len = torch.tensor([prompt_len[rows[0]] for rows in rows_of], device=dev)  # (B,)
    offset = torch.tensor(offset, device=dev)
    seq, start, branch = (torch.tensor(x, device=dev) for x in (seq, start, branch))  # (N,)
    base = offset[seq]  # each row's sequence's first position, flattened
    pm, cm = int(prompt_len.max()), int(branch.max())
    i, c = torch.arange(pm, device=dev), torch.arange(cm, device=dev)
    prompt = (offset[:, None] + i).clamp(max=total - 1)  # (B, Pm); past a prompt's end, any real position
    in_branch = c < branch[:, None]                                 # (N, Cm)
    branches = torch.where(in_branch, (base + start)[:, None] + c, base[:, None])
    # where each position's attention output lands in cat(prompt block (B * Pm), branch block (N * Cm))
    inverse = torch.zeros(total, dtype=torch.long, device=dev)
    in_prompt = i < prompt_len[:, None]
    inverse[prompt[in_prompt]] = torch.arange(nseq * pm, device=dev).view(nseq, pm)[in_prompt]
    inverse[branches[in_branch]] = nseq * pm + torch.arange(n * cm, device=dev).view(n, cm)[in_branch]
    j = torch.arange(t, device=dev)
    last_prompt = base + prompt_len[seq] - 1
    before = torch.where((j[None] == 0) | (branch[:, None] == 0), last_prompt[:, None],
                         (base + start - 1)[:, None] + torch.minimum(j[None], branch[:, None]))
    tree = transformer.Tree(prompt, prompt_len, branches if cm else None, seq, inverse)
    return Packed(input_ids.reshape(-1)[src], pos, seg != -2, src, seg, before, tree)


def own_forward_tree_mask(model, packed):
    """The tree's attention mask for the model's own forward, as its attention takes a prepared 4-D mask: (B, 1, L, L)
    True where a position attends (sdpa), or 0 there and the dtype's lowest elsewhere (eager); a dict of them by layer
    type where windows differ (`transformer.tree_windows`), or where Gated DeltaNet layers take the tree itself
    (`static_recurrent.Fork`). A position attends to the real positions before it in
    its prompt and its own branch, within its layer's window counted in positions; padding to itself."""
    seg, pos = packed.segment, packed.positions
    length = seg.shape[1]
    i = torch.arange(length, device=seg.device)
    attends = ((i[None, None] <= i[None, :, None]) & packed.real[:, None]
               & ((seg[:, None] == -1) | (seg[:, None] == seg[:, :, None])))
    attends = attends | torch.eye(length, dtype=torch.bool, device=seg.device)

    def form(window):
        allowed = attends if window is None else attends & (pos[:, :, None] - pos[:, None] < window)
        allowed = allowed[:, None]
        if model.config._attn_implementation == "eager":  # added to the scores
            return torch.zeros(allowed.shape, dtype=model.dtype, device=seg.device).masked_fill(
                ~allowed, torch.finfo(model.dtype).min)
        return allowed
    windows = transformer.tree_windows(model)
    recurrent = transformer.recurrent_modules(model)
    if recurrent:  # Gated DeltaNet layers (Qwen3.5) take the tree's layout in place of a mask, and fork their states
        for module in recurrent:
            static_recurrent.take_forks(module)
        kinds = set(model.config.layer_types) - {"linear_attention"}
        return {"linear_attention": static_recurrent.Fork(packed.tree),
                **{kind: form(windows.get(kind, windows.get(None))) for kind in kinds}}
    if list(windows) == [None]:
        return form(windows[None])
    return {kind: form(w) for kind, w in windows.items()}


@dataclass
class MicroBatch:
    """The rows of one forward/backward and the columns they need."""
    rows: torch.Tensor  # (m,) indices into the batch
    cols: slice         # columns of the (N, P + T) prompt + completion tensors these rows use
    t: int              # completion positions kept: per-token (N, T) tensors are read as x[rows, :t]
    width: int          # positions the forward runs once `completion_logprobs` (width=...) has moved each row's
                        # padding to its end: the longest real prompt + counted completion of these rows, less its
                        # last token (which predicts nothing); with shared prompts, a SharedPrompts

    def take(self, *sequences):
        """Each (N, P + T) tensor cut down to this micro-batch's rows and columns."""
        return tuple(x[self.rows, self.cols] for x in sequences)


def micro_batches(attention_mask, token_mask, num_completion_tokens, size, max_tokens=0):
    """Split a batch into micro-batches of `size` rows that spend little compute on padding.

    attention_mask (N, P + T) over left-padded prompts then completions; token_mask (N, T) marks the completion tokens
    that count (loss, metrics). Rows are ordered by the columns they need (real prompt tokens, then the completion up to
    its last counted token; none when no token counts, as for masked truncated completions), longest first, so rows of
    similar length share a micro-batch; each then drops the columns none of its rows needs: leading prompt padding, and
    completion positions after every row's last counted token. Neither changes a counted token's log-prob: padding is
    never attended, and in a causal model later positions do not affect earlier ones. The forward then runs each
    micro-batch's `width` positions (`MicroBatch.width`), not the longest prompt plus the longest completion.
    `max_tokens` > 0: a token budget in place of `size` (`within_tokens`)."""
    p = attention_mask.shape[1] - num_completion_tokens
    position = torch.arange(1, num_completion_tokens + 1, device=token_mask.device)
    completion_len = ((token_mask > 0) * position).amax(1)  # 1 + the last counted position; 0 if none counts
    # a row with nothing counted needs no column
    prompt_len = torch.where(completion_len > 0, attention_mask[:, :p].long().sum(1), 0)
    need = (prompt_len + completion_len).tolist()
    prompt_len, completion_len = prompt_len.tolist(), completion_len.tolist()

    def micro_batch(rows):  # rows[0] is the longest: its last token predicts nothing
        t = max(1, max(completion_len[i] for i in rows))
        # keep at least the last prompt column: it predicts the first completion token
        start = max(0, min(p - 1, p - max(prompt_len[i] for i in rows)))
        return MicroBatch(torch.tensor(rows, device=attention_mask.device), slice(start, p + t), t,
                          max(1, need[rows[0]] - 1))

    order = sorted(range(len(need)), key=lambda i: -need[i])  # stable: equal lengths keep batch order
    parts = within_tokens(order, need, max_tokens) if max_tokens > 0 else \
        [order[i:i + size] for i in range(0, len(order), size)]
    return [micro_batch(rows) for rows in parts]


def within_tokens(order, need, max_tokens):
    """`micro_batches` with a token budget (--micro_batch_tokens): the rows in `order` (longest first; `need`, the
    columns each needs) cut into micro-batches of as many rows as keep rows x width within `max_tokens` (a row longer
    than that alone), so that the forward's activations stay about the same size whether completions are short or
    long."""
    out = [[]]  # each micro-batch's rows, longest first: its first row sets its width
    for i in order:
        rows = out[-1]
        if rows and (len(rows) + 1) * max(1, need[rows[0]] - 1) > max_tokens:
            out.append([])
        out[-1].append(i)
    return [rows for rows in out if rows]


def shared_micro_batches(attention_mask, token_mask, num_completion_tokens, size, max_tokens=0, *, prompt_ids):
    """`micro_batches` for rows that share prompts (--shared_prompts; `prompt_ids` (N, P), the left-padded prompts):
    each micro-batch's width is a SharedPrompts, and a group's rows (the rows with the same real prompt tokens) stay
    together where they can.

    Groups go longest first (the positions their tree computes: the prompt once plus each row's completion up to its
    last counted token, less that token), and each group's rows longest first. `size` cuts that order every `size`
    rows: as many micro-batches as without sharing (ranks under FSDP run as many forwards), a group split only where
    it holds more rows than room is left, each part then computing the prompt once. With `max_tokens`, a micro-batch
    takes rows while the positions its forward computes stay within it: its sequences (one per prompt) times the
    longest sequence, the padding between them included (a row longer than that alone). A micro-batch keeps every
    prompt column its rows use, so rows of one group keep equal prompts.
    """
    t_all = num_completion_tokens
    p = attention_mask.shape[1] - t_all
    real_prompt = attention_mask[:, :p].bool()
    prompt_len = real_prompt.sum(1).tolist()
    position = torch.arange(1, t_all + 1, device=token_mask.device)
    completion_len = ((token_mask > 0) * position).amax(1).tolist()  # 1 + the last counted position; 0 if none
    group = torch.unique(torch.where(real_prompt, prompt_ids, -1), dim=0, return_inverse=True)[1].tolist()
    members = {}
    for i, g in enumerate(group):
        members.setdefault(g, []).append(i)

    def branch(i):  # positions a row's branch computes
        return max(0, completion_len[i] - 1)
    groups = sorted(members.values(), key=lambda rows: -(prompt_len[rows[0]] + sum(branch(i) for i in rows)))
    order = [i for rows in groups for i in sorted(rows, key=lambda i: -completion_len[i])]

    def computed(rows):  # sequences x the longest one
        seqs = {}
        for i in rows:
            seqs[group[i]] = seqs.get(group[i], prompt_len[i]) + branch(i)
        return len(seqs) * max(seqs.values())

    def micro_batch(rows):
        t = max(1, max(completion_len[i] for i in rows))
        start = max(0, min(p - 1, p - max(prompt_len[i] for i in rows)))
        need = max(prompt_len[i] + completion_len[i] if completion_len[i] else 0 for i in rows)
        shared = SharedPrompts(tuple(completion_len[i] for i in rows), max(1, need - 1))
        return MicroBatch(torch.tensor(rows, device=attention_mask.device), slice(start, p + t), t, shared)

    out, rows = [], []
    for i in order:
        if rows and (len(rows) >= size if max_tokens <= 0 else computed(rows + [i]) > max_tokens):
            out.append(micro_batch(rows))
            rows = []
        rows.append(i)
    if rows:
        out.append(micro_batch(rows))
    return out


def split_micro_batches(micro, count):
    """`micro` split further until there are `count` micro-batches: the one with the most rows is halved.

    Under several processes every rank must run as many forwards and backwards (each is a collective under
    FSDP); a token budget gives each rank its own number. A half keeps its micro-batch's columns, a superset
    of what its rows need. Needs count <= the number of rows.
    """
    micro = list(micro)
    while len(micro) < count:
        i = max(range(len(micro)), key=lambda j: len(micro[j].rows))
        mb = micro.pop(i)
        half = len(mb.rows) // 2
        if half == 0:
            raise ValueError(f"split_micro_batches: {count} micro-batches asked of fewer rows")
        widths = [mb.width.rows(slice(None, half)), mb.width.rows(slice(half, None))] \
            if isinstance(mb.width, SharedPrompts) else [mb.width] * 2
        micro[i:i] = [MicroBatch(mb.rows[:half], mb.cols, mb.t, widths[0]),
                      MicroBatch(mb.rows[half:], mb.cols, mb.t, widths[1])]
    return micro


def mini_batch_rows(num_rows, first_row, count, device=None):
    """This rank's rows of each of `count` mini-batches (one optimizer step each): (num_rows / count,) indices each.

    The rank holds `num_rows` consecutive rows of the step's batch, from global row `first_row`; mini-batch j is every
    global row i with i % count == j. The split is then the same for any number of processes, every rank holds as many
    rows of each mini-batch (as many forwards: FSDP's collectives match), and each group of G consecutive completions is
    spread over the mini-batches. (TRL shuffles the rows and cuts them in order.)"""
    rows = torch.arange(num_rows, device=device)
    return [rows[(rows + first_row) % count == j] for j in range(count)]
