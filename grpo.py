"""The GRPO algorithm as small functions: sampling, token log-probs, advantages, KL, loss.

Shapes: N completions in a batch, P prompts, G completions per prompt
(N = P * G, grouped so that rows g*G .. g*G+G-1 belong to prompt g),
T completion length, V vocabulary.

Of the project it imports only the fast decoder the sampler uses
(static_decoder.py); each function can be called from a test with tensors
and, where needed, a Hugging Face causal LM.
"""

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from static_decoder import StaticDecoder, hidden_states, static_decode_supported, training_forward_supported

# ----------------------------------------------------------------------------- sampling


@dataclass
class Rollout:
    completion_ids: torch.Tensor   # (N, T) sampled tokens, pad after the first EOS
    completion_mask: torch.Tensor  # (N, T) 1 up to and including the first EOS
    truncated: torch.Tensor        # (N,) True when no EOS was produced within the length limit
    logprobs: torch.Tensor         # (N, T) float32 log-prob of each sampled token (temperature applied)


def cat_rollouts(rollouts, pad_id):
    """One Rollout of the rows of several, in order; shorter completions padded (pad_id, mask 0, log-prob 0)."""
    if len(rollouts) == 1:
        return rollouts[0]
    t = max(r.completion_ids.shape[1] for r in rollouts)

    def cat(name, value):
        return torch.cat([F.pad(getattr(r, name), (0, t - r.completion_ids.shape[1]), value=value) for r in rollouts])
    return Rollout(cat("completion_ids", pad_id), cat("completion_mask", 0), torch.cat([r.truncated for r in rollouts]),
                   cat("logprobs", 0.0))


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


_MASK32 = 0xFFFFFFFF


def _mix32(x):
    """The "lowbias32" integer finaliser (Chris Wellons' hash prospector) on int64 tensors holding 32-bit
    values: int64 products wrap, and their low 32 bits are exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def row_keys(seeds, step):
    """A 32-bit key per row, a pure function of (row seed, step): the row's random numbers for that token.

    A counter-based hash instead of a stateful generator: a row draws the same
    numbers whatever else is in its batch (padding, other rows, other ranks), and
    drawing them needs no host synchronisation.
    """
    return _mix32((seeds * 0x9E3779B1 + (step + 1) * 0x85EBCA77) & _MASK32)


def gumbel_noise(keys, vocab):
    """Standard Gumbel noise (n, V), float32, a pure function of each row's key and the vocabulary index.

    Uniforms of 23 bits, u = (k + 1/2) / 2^23, strictly inside (0, 1) in float32, so the noise
    -log(-log u) is always finite (between about -2.8 and 16.6).
    """
    index = torch.arange(vocab, device=keys.device)
    x = _mix32((keys[:, None] ^ (index * 0x27D4EB2F)) & _MASK32)
    u = ((x >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    return -torch.log(-torch.log(u))


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


def _gumbel_max(logits, keys, inv_temperature):
    """argmax(logits / T + Gumbel noise): a draw from softmax(logits / T) (the Gumbel-max trick), and its
    log-prob. Elementwise work and three reductions over the vocabulary, which torch.compile fuses into one
    pass over the (bf16) logits with the noise computed in registers: no float32 copy, no cumulative sum."""
    z = logits.float() * inv_temperature
    token = (z + gumbel_noise(keys, z.shape[-1])).argmax(-1)
    return token, z.gather(-1, token[:, None])[:, 0] - torch.logsumexp(z, -1)


def sample_tokens(logits, temperature, top_k, top_p, keys):
    """Pick one token per row; return it with its log-prob under the distribution that drew it.

    That is softmax(logits / T), renormalised over the top-k / top-p tokens
    when those are on (what vLLM calls processed log-probs): the behaviour
    policy that `importance_weights` corrects for. The training forward
    computes the unfiltered tempered log-prob, so with filters on the two differ
    by the filtered mass, also in `sampler_logprob_diff`.
    Sampling is Gumbel-max with the row's own noise (`keys` (n,) from row_keys):
    argmax over the filtered logits of logits / T + noise.
    """
    if temperature == 0:  # greedy
        logits = logits.float()
        token = logits.argmax(-1)
        return token, torch.log_softmax(logits, -1).gather(-1, token[:, None])[:, 0]
    # compiled where the log-prob head is (CUDA with Triton): one fused pass over the logits
    pick = _fused("gumbel") if fused_head_available(logits.device) else _gumbel_max
    if top_k or top_p < 1.0:  # the tempered logits, -inf outside the filters, take the same draw
        return pick(filter_logits(logits.float() / temperature, top_k, top_p), keys, 1.0)
    return pick(logits, keys, 1.0 / temperature)


@torch.no_grad()
def sample(model, prompt_ids, prompt_mask, *, max_new_tokens, eos_ids, pad_id, temperature=1.0, top_k=0,
           top_p=1.0, seeds=None, check_every=8, all_done=None, static_cache=True, compact=True, cuda_graph=True,
           keep_decoder=False, attention_kernel=False):
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
    attention_kernel: on CUDA, StaticDecoder's attention runs as the split-KV
    Triton kernel of kernels.py instead of SDPA (where the shapes allow it).
    """
    if all_done is None:
        all_done = lambda done: bool(done.all())  # noqa: E731
    n = prompt_ids.shape[0]
    device = prompt_ids.device
    if seeds is None:
        seeds = torch.arange(n, device=device)
    seeds = seeds.to(device=device, dtype=torch.long)
    # every row's keys for the whole completion at once: row_keys is elementwise, so these are the same
    # numbers as drawing step by step
    keys = row_keys(seeds[:, None], torch.arange(max_new_tokens, device=device)[None, :])  # (N, T)
    args = (prompt_ids, prompt_mask.long(), max_new_tokens, torch.as_tensor(eos_ids, device=device), pad_id,
            (temperature, top_k, top_p), keys, check_every, all_done)
    if static_cache and static_decode_supported(model):
        tokens, logps, done = _sample_static(model, *args, compact=compact, cuda_graph=cuda_graph,
                                             keep_decoder=keep_decoder, attention_kernel=attention_kernel)
    else:
        tokens, logps, done = _sample_hf(model, *args)
    mask = completion_mask_from_ids(tokens, eos_ids)
    return Rollout(tokens.masked_fill(mask == 0, pad_id), mask, ~done, logps.masked_fill(mask == 0, 0.0))


def _sample_hf(model, prompt_ids, attn, max_new_tokens, eos, pad_id, sampling, keys, check_every, all_done):
    """The plain loop: the model's own forward over a DynamicCache, all rows to the end."""
    from transformers import DynamicCache

    n, device = prompt_ids.shape[0], prompt_ids.device
    positions = position_ids_from_mask(attn)
    cache = DynamicCache(config=model.config)
    # transformers 5.x renamed the forward's `past_key_values` to `cache` (the old name warns that it will go)
    cache_arg = {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}
    logits = model(input_ids=prompt_ids, attention_mask=attn, position_ids=positions, **cache_arg,
                   use_cache=True, logits_to_keep=1).logits[:, -1]
    next_pos = positions[:, -1] + 1  # (N,)
    tokens = torch.full((n, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logps = torch.zeros(n, max_new_tokens, dtype=torch.float32, device=device)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    length = max_new_tokens
    for t in range(max_new_tokens):
        tok, lp = sample_tokens(logits, *sampling, keys[:, t])
        tokens[:, t] = torch.where(done, pad_id, tok)
        logps[:, t] = torch.where(done, 0.0, lp)
        done = done | torch.isin(tok, eos)
        if t == max_new_tokens - 1 or ((t + 1) % check_every == 0 and all_done(done)):
            length = t + 1
            break
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
        logits = model(input_ids=tokens[:, t:t + 1], attention_mask=attn, position_ids=next_pos[:, None],
                       **cache_arg, use_cache=True).logits[:, -1]
        next_pos = next_pos + 1
    return tokens[:, :length], logps[:, :length], done


def _sample_static(model, prompt_ids, attn, max_new_tokens, eos, pad_id, sampling, keys, check_every,
                   all_done, compact, cuda_graph, keep_decoder, attention_kernel):
    """The fast loop: StaticDecoder, with finished rows compacted out of the decode batch.

    Live state covers only the rows still decoding (`rows` holds their indices in
    the batch); a row's results are written out when it leaves, or at the end.
    """
    n, p = prompt_ids.shape
    device = prompt_ids.device
    dec = StaticDecoder.for_model(model, n, p + max_new_tokens, cuda_graph=cuda_graph,
                                  attention_kernel=attention_kernel)
    positions = position_ids_from_mask(attn)
    logits = dec.prefill(prompt_ids, attn, positions)  # (N, V)
    tokens = torch.full((n, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logps = torch.zeros(n, max_new_tokens, dtype=torch.float32, device=device)
    done = torch.ones(n, dtype=torch.bool, device=device)  # rows no longer live are done
    rows = torch.arange(n, device=device)
    live_tok, live_lp = tokens.clone(), logps.clone()
    live_done = torch.zeros(n, dtype=torch.bool, device=device)
    checked = 0  # tokens up to here have been looked at for EOS
    live_keys = keys
    length = max_new_tokens
    for t in range(max_new_tokens):
        # a finished row keeps sampling until the next check; `sample` masks what follows its first EOS
        live_tok[:, t], live_lp[:, t] = sample_tokens(logits, *sampling, live_keys[:, t])
        last = t == max_new_tokens - 1
        if last or (t + 1) % check_every == 0:
            live_done |= torch.isin(live_tok[:, checked:t + 1], eos).any(1)  # the tokens since the last check
            checked = t + 1
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
                    live_tok, live_lp, live_done, live_keys = live_tok[keep], live_lp[keep], live_done[keep], live_keys[keep]
        logits = dec.decode(live_tok[:, t], p + t)
    tokens[rows], logps[rows] = live_tok, live_lp
    done[rows] = live_done
    if not keep_decoder:  # give the weight copies and the cache back before training needs the memory
        model.__dict__.pop("_static_decoder", None)
    return tokens[:, :length], logps[:, :length], done


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
    if torch.device(device).type != "cuda":
        return False
    try:
        import triton  # noqa: F401  (torch.compile's GPU code generator)
    except ImportError:
        return False
    return True


def _fused(name):
    if not _FUSED:  # compiled on first use; dynamic: chunks of any number of rows share one kernel
        _FUSED["stats"] = torch.compile(_chunk_stats, dynamic=True)
        _FUSED["grad"] = torch.compile(_chunk_grad, dynamic=True)
        _FUSED["gumbel"] = torch.compile(_gumbel_max, dynamic=True)
    return _FUSED[name]


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """log softmax(hidden @ weight.T / temperature)[target] and the entropy, chunk by chunk of rows.

    Forward keeps one chunk of logits at a time and saves only the inputs and
    each row's log-sum-exp; backward recomputes a chunk's logits and writes the
    gradient d logp / d logits = (onehot(target) - softmax) / temperature
    directly, so each chunk costs two float32 (chunk, V) buffers and no
    autograd graph over the vocabulary. When all rows fit in one chunk, that
    chunk's softmax is kept for backward instead of recomputed. The entropy
    is a metric: no gradient. With `fused`, each chunk's math is the compiled
    `_chunk_stats` / `_chunk_grad` instead (for bf16 weights, no float32 copy of a chunk's logits).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, fused=False):
        n = hidden.shape[0]
        logp = torch.empty(n, device=hidden.device, dtype=torch.float32)
        entropy, lse = torch.empty_like(logp), torch.empty_like(logp)
        kept = None
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            if fused:
                lse[s:e], logp[s:e], entropy[s:e] = _fused("stats")(F.linear(hidden[s:e], weight), targets[s:e],
                                                                     1.0 / temperature)
                continue
            z = F.linear(hidden[s:e], weight).float()
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
            if n <= chunk and any(ctx.needs_input_grad[:2]):
                kept = prob
        ctx.save_for_backward(hidden, weight, targets, lse, kept)
        ctx.temperature, ctx.chunk, ctx.fused = temperature, chunk, fused
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
            if ctx.fused:
                z = _fused("grad")(F.linear(h, weight), targets[s:e], lse[s:e], grad_logp[s:e].float(),
                                   1.0 / ctx.temperature)
            else:
                g = grad_logp[s:e, None].float()
                if kept is not None:  # the only chunk's softmax, kept from the forward
                    z = kept * -g  # -g * softmax (a new tensor: a retained graph may run backward again)
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
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def default_chunk_tokens(vocab_size, device):
    """Rows per chunk of the vocabulary projection: 16M logits on CPU (64 MB in float32), 128M on GPU."""
    budget = 1 << (27 if torch.device(device).type == "cuda" else 24)
    return max(1, budget // vocab_size)


def completion_logprobs(model, input_ids, attention_mask, num_completion_tokens, temperature=1.0,
                        chunk_tokens=None, fused=None, fast_forward=None, width=None, compile_layers=False):
    """Log-probs (and entropies) of the last `num_completion_tokens` tokens of each row, in float32.

    input_ids (N, S) are left-padded prompts then completions; attention_mask
    (N, S) marks the real tokens. The transformer runs once; the vocabulary
    projection runs over chunks of `chunk_tokens` positions and is recomputed
    chunk by chunk in backward, so no (N, T, V) float32 tensor ever exists.
    Temperature is applied exactly as in `sample`. Returns (logp, entropy),
    each (N, T); entropy has no gradient.
    `fused` (default: on CUDA with Triton) runs each chunk's math compiled.
    `fast_forward` (default: where supported) runs the transformer as
    `static_decoder.hidden_states` instead of the Hugging Face forward, with
    its layers compiled when `compile_layers` (the Hugging Face forward is
    never compiled here).

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
    t = num_completion_tokens
    n, s = input_ids.shape
    targets = input_ids[:, -t:]
    lead = (attention_mask.cumsum(1) == 0).sum(1)  # (N,) leading padding columns
    # left padding only, and every row with a real prompt token (an empty prompt's first token would be
    # predicted from itself once moved): then the move applies
    movable = ((attention_mask.sum(1) + lead == s) & (lead < s - t)).all()
    left_padded_only, padded = torch.stack([movable, lead.any()]).tolist()
    if left_padded_only:
        if padded:  # each row rolled left by its padding: (pad pad a b c) -> (a b c pad pad)
            cols = torch.arange(s, device=input_ids.device)
            input_ids = input_ids.gather(1, (cols + lead[:, None]) % s)
        if width is not None and width < s:
            input_ids = input_ids[:, :width]
        mask, positions = None, torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape)
    else:
        lead = torch.zeros_like(lead)
        mask, positions = attention_mask, position_ids_from_mask(attention_mask)
    if fast_forward is None:
        fast_forward = training_forward_supported(model)
    if fast_forward:
        hidden = hidden_states(model, input_ids, mask, positions, compiled=compile_layers)
    else:
        hidden = model.base_model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                                  use_cache=False).last_hidden_state
    h = hidden.shape[-1]
    # the position before each completion token predicts it: column s - t - 1 + j, moved left with its row
    # (clamped: past `width` the last column stands in, for tokens the caller does not count)
    before = (torch.arange(s - t - 1, s - 1, device=hidden.device) - lead[:, None]).clamp(0, hidden.shape[1] - 1)
    hidden = hidden.gather(1, before[..., None].expand(n, t, h)).reshape(n * t, h)
    weight = model.get_output_embeddings().weight
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0], weight.device)
    if fused is None:
        fused = fused_head_available(weight.device)
    logp, entropy = _ChunkedTokenLogprobs.apply(hidden, weight, targets.reshape(n * t), float(temperature), chunk,
                                                bool(fused))
    return logp.view(n, t), entropy.view(n, t)


@dataclass
class MicroBatch:
    """The rows of one forward/backward and the columns they need."""
    rows: torch.Tensor  # (m,) indices into the batch
    cols: slice         # columns of the (N, P + T) prompt + completion tensors these rows use
    t: int              # completion positions kept: per-token (N, T) tensors are read as x[rows, :t]
    width: int          # positions the forward runs once each row's padding is moved to its end: the longest
                        # real prompt + counted completion of these rows, less its last token (which predicts
                        # nothing); completion_logprobs(width=...)

    def take(self, *sequences):
        """Each (N, P + T) tensor cut down to this micro-batch's rows and columns."""
        return tuple(x[self.rows, self.cols] for x in sequences)


def micro_batches(attention_mask, token_mask, num_completion_tokens, size, max_tokens=0):
    """Split a batch into micro-batches that spend little compute on padding.

    attention_mask (N, P + T) over left-padded prompts then completions;
    token_mask (N, T) marks the completion tokens that count (loss, metrics).
    Rows are ordered by the columns they need (real prompt tokens, then the
    completion up to its last counted token; none when no token counts, as for
    masked truncated completions), longest first, so rows of similar length
    share a micro-batch; each then drops the columns none of its rows needs:
    leading prompt padding, and completion positions after every row's last
    counted token. Neither changes a counted token's log-prob: padding is
    never attended, and in a causal model later positions do not affect earlier ones.
    `completion_logprobs` then moves each row's padding to its end, so the
    forward runs `width` positions: the longest real prompt + counted
    completion of the rows (less its last token, which predicts nothing), not
    the longest prompt plus the longest completion.
    A micro-batch takes `size` rows, or with `max_tokens` > 0 as many rows as
    keep rows x width within it (a row longer than that alone): the forward's
    activations then stay about the same size whether completions are short or long.
    """
    t_all = num_completion_tokens
    p = attention_mask.shape[1] - t_all
    prompt_len = attention_mask[:, :p].long().sum(1)
    position = torch.arange(1, t_all + 1, device=token_mask.device)
    completion_len = ((token_mask > 0) * position).amax(1)  # 1 + the last counted position; 0 if none counts
    prompt_len = torch.where(completion_len > 0, prompt_len, 0)  # a row with nothing counted needs no column
    need = (prompt_len + completion_len).tolist()
    prompt_len, completion_len = prompt_len.tolist(), completion_len.tolist()
    order = sorted(range(len(need)), key=lambda i: -need[i])  # stable: equal lengths keep batch order

    def micro_batch(rows, longest_prompt, longest_completion):
        t = max(1, longest_completion)
        # keep at least the last prompt column: it predicts the first completion token
        start = max(0, min(p - 1, p - longest_prompt))
        return MicroBatch(torch.tensor(rows, device=attention_mask.device), slice(start, p + t), t, width(rows))

    def width(rows):  # rows[0] is the longest; its last token predicts nothing
        return max(1, need[rows[0]] - 1)

    out, rows, lp, lc = [], [], 0, 0  # the micro-batch being filled and its longest prompt and completion
    for i in order:  # longest first: a micro-batch's first row sets its width
        if rows and (len(rows) >= size if max_tokens <= 0 else (len(rows) + 1) * width(rows) > max_tokens):
            out.append(micro_batch(rows, lp, lc))
            rows, lp, lc = [], 0, 0
        rows.append(i)
        lp, lc = max(lp, prompt_len[i]), max(lc, completion_len[i])
    if rows:
        out.append(micro_batch(rows, lp, lc))
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
        micro[i:i] = [MicroBatch(mb.rows[:half], mb.cols, mb.t, mb.width),
                      MicroBatch(mb.rows[half:], mb.cols, mb.t, mb.width)]
    return micro


# ----------------------------------------------------------------------------- advantages


def group_advantages(rewards, group_size, scale="group", eps=1e-4):
    """(r - mean) / (std + eps) within each group of `group_size` consecutive completions.

    `rewards` (N,) float, NaN where no reward function could score a completion:
    those are left out of the statistics and get advantage 0. A group whose
    valid rewards are all equal (or has fewer than two) gets exactly 0.
    scale: "group" divides by the group's std (the paper), "batch" by the std of
    the whole batch (more robust to low-variance groups), "none" only centres
    (Dr. GRPO argues the std division biases towards easy and hard questions).
    The statistics are taken in float64, where no finite float32 rewards can
    overflow; ValueError when the advantages do not fit float32 (only possible
    with scale "none" and rewards near float32's limit) or a reward is infinite.
    Returns (advantages (N,) float32, group_std (P,) float64).
    """
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards: unknown value {scale!r} (group, batch or none)")
    r = rewards.double().view(-1, group_size)  # (P, G)
    if torch.isinf(r).any():
        raise ValueError(f"group_advantages: {torch.isinf(r).sum().item()} reward(s) are infinite; "
                         f"rewards must be finite, or NaN where none was given")
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
        batch_std = all_valid.std() if all_valid.numel() > 1 else torch.zeros((), dtype=r.dtype, device=r.device)
        adv = centred / (batch_std + eps)
    else:
        adv = centred
    adv = torch.where(flat, 0.0, adv).float()
    if not torch.isfinite(adv).all():
        raise ValueError(f"group_advantages: advantages up to {centred.abs().max().item():.4g} do not fit float32 "
                         f"(scale_rewards={scale!r}); scale the rewards down or use scale_rewards='group'")
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
IMPORTANCE_SAMPLING = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_weights(old_logp, sampler_logp, mask, mode, low=0.0, high=3.0):
    """Weights correcting for the sampler's probabilities differing from the trainer's (detached).

    The sampler (a KV-cache decode, often in bf16) and the training forward
    compute slightly different log-probs for the same policy, so the batch was
    drawn from pi_sampler while the objective assumes pi_old. Each token's
    policy loss is reweighted by the ratio pi_old / pi_sampler, truncated so
    that its variance stays bounded (Yao et al. 2025, "Your efficient RL
    framework secretly brings you off-policy RL training"; TRL's
    `vllm_importance_sampling_mode` offers the same four forms):
      token_truncate:    per token, the ratio clipped to [low, high]
      token_mask:        per token, the ratio, or 0 where it lies outside [low, high]
      sequence_truncate: per sequence, exp(sum of the token log-ratios) clipped to [low, high]
      sequence_mask:     per sequence, that ratio, or 0 where it lies outside [low, high]
    old_logp, sampler_logp (n, T) float32; mask (n, T) marks the tokens that count.
    Returns (n, T) for token modes, (n, 1) for sequence modes.
    """
    diff = (old_logp.float() - sampler_logp.float()) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(1, keepdim=True)
    ratio = torch.exp(diff.clamp(max=80.0))  # finite in float32; anything this large is clipped or masked anyway
    if mode.endswith("truncate"):
        return ratio.clamp(low, high)
    if mode.endswith("mask"):
        return torch.where((ratio >= low) & (ratio <= high), ratio, 0.0)
    raise ValueError(f"importance_sampling: unknown value {mode!r} (one of {', '.join(IMPORTANCE_SAMPLING)})")


def grpo_loss(logp, old_logp, ref_logp, advantages, mask, *, beta, epsilon, epsilon_high, loss_type,
              num_sequences, num_tokens, max_completion_length, is_weight=None, bias_correction_kl=False):
    """Clipped surrogate plus beta * k3 KL for one micro-batch, normalised over the whole batch.

    logp (n, T) requires grad; old_logp is the detached log-prob of the policy
    that sampled (logp.detach() when each batch is used once, so the ratio is 1);
    ref_logp is None when beta == 0; advantages (n,); mask (n, T).
    is_weight: None, or `importance_weights` (n, T) or (n, 1), multiplying each
    token's surrogate term (not the KL term), as in TRL.
    bias_correction_kl: the k3 term is multiplied by the ratio pi / pi_old,
    gradient included (TRL's `use_bias_correction_kl`, on by default in TRL 1.16;
    from the DeepSeek-V3.2 report): the KL gradient is then that of KL(pi || ref)
    also when the batch was sampled by an older policy. At ratio 1 the loss's
    value is unchanged, but its gradient is not.
    The normalisers describe the whole batch (all micro-batches, all ranks), so
    summing this loss's gradients over micro-batches gives the full-batch gradient:
      grpo:    mean over sequences of the per-sequence token mean (DeepSeekMath)
      dapo:    sum over all tokens / all tokens in the batch (DAPO's token-level loss)
      dr_grpo: sum over all tokens / (sequences * max_completion_length) (Dr. GRPO)
    Returns (loss, metrics) with metric means over this micro-batch's tokens, as 0-dim tensors on the loss's
    device: reading them (.item()) waits for the device, so callers sum them and read once per step.
    """
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None].to(logp.dtype)  # (n, 1)
    surrogate = torch.min(ratio * adv, ratio.clamp(1 - epsilon, 1 + epsilon_high) * adv)
    per_token = -surrogate if is_weight is None else -surrogate * is_weight
    kl = None
    if beta != 0:
        kl = k3_kl(ref_logp, logp)
        per_token = per_token + beta * (kl * ratio if bias_correction_kl else kl)
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
            "kl": (kl * mask).sum() / count if kl is not None else torch.zeros((), device=mask.device),
            "clip_low": (low * mask).sum() / count,
            "clip_high": (high * mask).sum() / count,
            "tokens": mask.sum(),
        }
    return loss, metrics
