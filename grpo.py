"""The GRPO objective as small functions: token log-probs, micro-batches, advantages, KL, loss.

Shapes: N completions in a batch, P prompts, G completions per prompt
(N = P * G, grouped so that rows g*G .. g*G+G-1 belong to prompt g),
T completion length, V vocabulary.

The sampler that produces the rollouts is sampling.py. Of the project this
file imports only the written-out training forward (static_decoder.py); each
function can be called from a test with tensors and, where needed, a Hugging
Face causal LM.
"""

import dataclasses
import math
import typing
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import routing as routing_replay
import vision
from static_decoder import hidden_states, training_forward_supported

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
    d H / d z = -p (log p + H) for z = logits / temperature, in the unfused path (a chunk's logits
    recomputed). With `fused`, each chunk's math is the compiled
    `_chunk_stats` / `_chunk_grad` instead (for bf16 weights, no float32 copy of a chunk's logits).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, fused=False, entropy_grad=False, head=None):
        n = hidden.shape[0]
        fused = fused and head is None  # the compiled chunk math knows no head transform
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
        ctx.temperature, ctx.chunk, ctx.fused, ctx.entropy_grad = temperature, chunk, fused, entropy_grad
        ctx.head = head
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, kept, entropy = ctx.saved_tensors
        with_entropy = ctx.entropy_grad and grad_entropy is not None
        want_h, want_w = ctx.needs_input_grad[:2]
        grad_h = torch.empty_like(hidden) if want_h else None
        # the weight's gradient sums over every chunk: in float32, so that bf16 rounding does not grow with
        # the number of chunks (each chunk's product is still one bf16 matmul)
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if want_w else None
        n, chunk = hidden.shape[0], ctx.chunk
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            h = hidden[s:e]
            if ctx.fused and not with_entropy:
                z = _fused("grad")(F.linear(h, weight), targets[s:e], lse[s:e], grad_logp[s:e].float(),
                                   1.0 / ctx.temperature)
            else:
                g = grad_logp[s:e, None].float()
                if kept is not None:  # the only chunk's softmax, kept from the forward
                    z = kept * -g  # -g * softmax (a new tensor: a retained graph may run backward again)
                else:
                    raw = z = F.linear(h, weight).float()
                    if ctx.head is not None:
                        z = ctx.head.apply(raw.clone())
                    if ctx.temperature != 1.0:
                        z.div_(ctx.temperature)
                    z.sub_(lse[s:e, None])  # log softmax
                    if with_entropy:  # the entropy's gradient: -p (log p + H), times its incoming gradient
                        gh = grad_entropy[s:e, None].float()
                        extra = z.exp() * (z + entropy[s:e, None]) * -gh
                    z.exp_().mul_(-g)  # -g * softmax
                    if with_entropy:
                        z.add_(extra)
                z.scatter_add_(-1, targets[s:e, None], g)  # + g at the target
                if ctx.temperature != 1.0:
                    z.div_(ctx.temperature)
                if ctx.head is not None:  # the chain rule through the head's transform of the raw logits
                    z.mul_(ctx.head.derivative(raw))
                z = z.to(hidden.dtype)
            if want_h:
                grad_h[s:e] = z @ weight
            if want_w:
                if z.dtype == torch.float32:
                    grad_w.addmm_(z.t(), h)
                else:
                    grad_w += z.t() @ h
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None, None


@dataclass(frozen=True)
class Head:
    """What a model does to its logits after the vocabulary projection: logits * scale, then, with a softcap c,
    c * tanh(logits / c) (Gemma 2/3/4's `final_logit_softcapping`, Cohere's `logit_scale`, Granite's and
    MiniCPM's `logits_scaling`). The sampler reads the model's own logits, so the training head must apply the
    same, or the two disagree silently."""
    scale: float = 1.0
    softcap: float = 0.0

    def apply(self, z):
        """z: raw float32 logits, changed in place where that is possible."""
        if self.scale != 1.0:
            z.mul_(self.scale)
        if self.softcap:
            z = z.div_(self.softcap).tanh_().mul_(self.softcap)
        return z

    def derivative(self, raw):
        """d apply(raw) / d raw, elementwise."""
        if not self.softcap:
            return self.scale
        return (1 - (raw * (self.scale / self.softcap)).tanh().square()) * self.scale


def head_of(model):
    """The model's logit transform as a Head, or None when its logits are the projection's output as they are."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    scale = float(getattr(model, "logit_scale", None) or getattr(cfg, "logit_scale", None) or 1.0)
    if getattr(cfg, "logits_scaling", None):
        scale /= float(cfg.logits_scaling)
    softcap = float(getattr(cfg, "final_logit_softcapping", None) or 0.0)
    return Head(scale, softcap) if scale != 1.0 or softcap else None


def default_chunk_tokens(vocab_size, device):
    """Rows per chunk of the vocabulary projection: 16M logits on CPU (64 MB in float32), 128M on GPU."""
    budget = 1 << (27 if torch.device(device).type == "cuda" else 24)
    return max(1, budget // vocab_size)


def completion_logprobs(model, input_ids, attention_mask, num_completion_tokens, temperature=1.0,
                        chunk_tokens=None, fused=None, fast_forward=None, width=None, compile_layers=False,
                        entropy_grad=False, routing=None, images=None):
    """Log-probs (and entropies) of the last `num_completion_tokens` tokens of each row, in float32.

    input_ids (N, S) are left-padded prompts then completions; attention_mask
    (N, S) marks the real tokens. The transformer runs once; the vocabulary
    projection runs over chunks of `chunk_tokens` positions and is recomputed
    chunk by chunk in backward, so no (N, T, V) float32 tensor ever exists.
    Temperature is applied exactly as in `sample`. Returns (logp, entropy),
    each (N, T); entropy has no gradient unless `entropy_grad` (for an entropy bonus).
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
    `routing` (N, S, layers, k): with routing replay (routing.py), the experts
    each token goes to in each MoE layer, moved with its row; the forward then
    routes as the sampler did.
    `images`: the rows' vision.PromptImages (a vision-language model's prompts with images): the language model
    runs with their embeddings in place of the prompts' image tokens and their rotary positions (vision.py), as
    in the sampler's prefill.
    """
    t = num_completion_tokens
    n, s = input_ids.shape
    targets = input_ids[:, -t:]
    lead = (attention_mask.cumsum(1) == 0).sum(1)  # (N,) leading padding columns
    # left padding only, and every row with a real prompt token (an empty prompt's first token would be
    # predicted from itself once moved): then the move applies
    movable = ((attention_mask.sum(1) + lead == s) & (lead < s - t)).all()
    left_padded_only, padded = torch.stack([movable, lead.any()]).tolist()
    real = attention_mask.bool()
    pictures = None  # the prompts' image tokens, moved with their rows
    if images is not None and any(g.shape[0] for g in images.grid):
        pictures = vision.image_mask(model, input_ids, s - t, real)
    if left_padded_only:
        if padded:  # each row rolled left by its padding: (pad pad a b c) -> (a b c pad pad)
            cols = (torch.arange(s, device=input_ids.device) + lead[:, None]) % s
            input_ids, real = input_ids.gather(1, cols), real.gather(1, cols)
            pictures = None if pictures is None else pictures.gather(1, cols)
            if routing is not None:
                routing = routing.gather(1, cols[:, :, None, None].expand_as(routing))
        if width is not None and width < s:
            input_ids, real = input_ids[:, :width], real[:, :width]
            pictures = None if pictures is None else pictures[:, :width]
            routing = None if routing is None else routing[:, :width]
        mask, positions = None, torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape)
    else:
        lead = torch.zeros_like(lead)
        mask, positions = attention_mask, position_ids_from_mask(attention_mask)
    if routing is not None:  # kept set after the forward: activation checkpointing recomputes in backward
        routing_replay.of(model).replay(routing, real)
    elif routing_replay.attached(model) is not None:  # a forward without: the routers choose live again
        routing_replay.attached(model).stop()
    if fast_forward is None:
        fast_forward = training_forward_supported(model)
    if pictures is not None:
        rope, _ = vision.rope_positions(model, input_ids, pictures, images, real)
        hidden = vision.hidden_states(model, input_ids, pictures, images, attention_mask=mask, position_ids=rope,
                                      use_cache=False).last_hidden_state
    elif fast_forward:
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
                                                bool(fused), bool(entropy_grad), head_of(model))
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


def mini_batch_rows(num_rows, first_row, count, device=None):
    """This rank's rows of each of `count` mini-batches (one optimizer step each): (num_rows / count,) indices each.

    The rank holds `num_rows` consecutive rows of the step's batch, from global row `first_row`; mini-batch j is
    every global row i with i % count == j. The split is then the same for any number of processes, every rank
    holds as many rows of each mini-batch (as many forwards: FSDP's collectives match), and each group of G
    consecutive completions is spread over the mini-batches. (TRL shuffles the rows and cuts them in order.)
    """
    rows = torch.arange(num_rows, device=device)
    return [rows[(rows + first_row) % count == j] for j in range(count)]


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


def decoupled_rewards(parts, weights, group_size):
    """GDPO's reward: each reward function's column normalised within its group, then their weighted sum.

    parts (N, F), NaN where a function did not score a completion (it then adds nothing, as TRL's nansum);
    weights (F,). Returns (N,) float64, NaN where no function scored. The caller then centres the sum within
    each group and divides by the batch's std (group_advantages with scale "batch"); TRL subtracts the batch
    mean instead, which is the same up to rounding, since each normalised column has mean 0 in every group, where
    every function scored every completion. A group whose rewards are all equal still gets exactly 0.
    """
    columns = [group_advantages(parts[:, f], group_size, "group")[0].double() for f in range(parts.shape[1])]
    normalised = torch.stack(columns, 1)  # (N, F); 0 where NaN
    total = (normalised * torch.as_tensor(weights, dtype=torch.float64, device=normalised.device)).sum(1)
    return torch.where(torch.isnan(parts).all(1).to(total.device), float("nan"), total)


# ----------------------------------------------------------------------------- KL and loss


def k3_kl(ref_logp, logp):
    """Per-token KL(policy || ref) estimate exp(d) - d - 1 with d = ref - logp (Schulman's k3).

    Unbiased, non-negative, and computed in float32 with exp's argument capped so
    that it stays finite for any finite input, also from bfloat16.
    """
    d = ref_logp.float() - logp.float()
    return (torch.expm1(d.clamp(max=20.0)) - d).clamp(min=0.0)


# The objective along four axes (docs/objective.md). `loss_type` keeps TRL's names; each name is a policy
# term and an aggregation, so a paper is a combination of settings, not a branch of its own.
POLICY_TERM = {"grpo": "clip", "dapo": "clip", "dr_grpo": "clip", "bnpo": "clip", "luspo": "clip",
               "cispo": "cispo", "sapo": "sapo", "vespo": "vespo"}
AGGREGATION = {"grpo": "sequence_mean", "sapo": "sequence_mean", "dapo": "token_mean", "bnpo": "token_mean",
               "cispo": "token_mean", "vespo": "token_mean", "dr_grpo": "constant", "luspo": "sequence_sum"}
LOSS_TYPES = tuple(POLICY_TERM)
IMPORTANCE_SAMPLING = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


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


# ----------------------------------------------------------------------------- the ratio


def log_ratio(logp, old_logp, mask, level="token"):
    """log pi / pi_old: per token (n, T), or with level "sequence" one per sequence (n, 1), the mean of the
    token log-ratios over its counted tokens (GSPO; TRL's importance_sampling_level). The sequence form keeps
    the gradient of every token's log-prob, so each token's gradient is the sequence ratio times 1/|o_i|."""
    diff = logp - old_logp
    if level == "token":
        return diff
    if level == "sequence":
        return (diff * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)  # (n, 1)
    raise ValueError(f"importance_sampling_level: unknown value {level!r} "
                     f"(one of {', '.join(IMPORTANCE_SAMPLING_LEVELS)})")


# ----------------------------------------------------------------------------- the policy term
# Each returns the per-token loss (to be minimised) of ratio (n, T) or (n, 1) and advantages (n, 1).


def clipped_term(ratio, adv, *, epsilon, epsilon_high, delta=None):
    """PPO's -min(rho A, clip(rho, 1 - epsilon, 1 + epsilon_high) A). `delta`: the unclipped rho is also capped
    at delta (two-sided clipping, INTELLECT-2; TRL's `delta`), so a negative advantage cannot push a token whose
    ratio has run far above 1 without bound."""
    clipped = ratio.clamp(1 - epsilon, 1 + epsilon_high)
    if delta is not None:
        ratio = ratio.clamp(max=delta)
    return -torch.min(ratio * adv, clipped * adv)


def cispo_term(ratio, adv, logp, *, epsilon_high):
    """CISPO (MiniMax-M1): -sg(min(rho, epsilon_high)) A log pi. The ratio is clipped and detached, so every token
    keeps a gradient (A log pi, weighted); as in TRL the bound is epsilon_high itself, not 1 + epsilon_high."""
    return -ratio.clamp(max=epsilon_high).detach() * adv * logp


def sapo_term(ratio, adv, *, temperature_pos, temperature_neg):
    """SAPO: -(4 / tau) sigmoid(tau (rho - 1)) A, tau = temperature_pos where A > 0, else temperature_neg. A soft
    gate instead of a hard clip: at rho = 1 its gradient is that of rho A, and it fades as rho moves away."""
    tau = torch.where(adv > 0, temperature_pos, temperature_neg)
    return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv


def vespo_term(logp, old_logp, adv, mask, *, k_pos, lambda_pos, k_neg, lambda_neg, is_weight=None):
    """VESPO: -sg(phi(w)) A log pi, with w the sequence's importance ratio exp(sum_t log pi / pi_old) and the gamma
    weight phi(w) = e^lambda w^k e^(-lambda w), 1 at w = 1, fading on both sides; (k, lambda) = (k_pos,
    lambda_pos) where A >= 0, else the _neg pair. An importance weight pi_old / pi_sampler (`is_weight`, (n, T)
    or (n, 1)) enters w rather than multiplying the term. Computed in log space with TRL's bounds: the log-ratios
    clamped to [-20, 20], log w to [log 1e-8, 20]; phi is detached (a weight on A log pi, as in TRL)."""
    with torch.no_grad():
        log_w = ((logp - old_logp).clamp(-20.0, 20.0) * mask).sum(1, keepdim=True)               # (n, 1)
        if is_weight is not None:
            log_is = is_weight.float().log().clamp(math.log(1e-8), 20.0)
            log_w = log_w + (log_is * mask if log_is.shape[1] > 1 else log_is).sum(1, keepdim=True)
        log_w = log_w.clamp(math.log(1e-8), 20.0)
        k = torch.where(adv >= 0, k_pos, k_neg)
        lam = torch.where(adv >= 0, lambda_pos, lambda_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return -phi * adv * logp


# ----------------------------------------------------------------------------- which tokens count


def high_entropy_mask(entropy, mask, quantile=None, threshold=None):
    """1 for the counted tokens whose entropy is at least `threshold`, else 0 (TRL's top_entropy_quantile,
    "Beyond the 80/20 rule"). Without a threshold, it is the (1 - quantile) quantile of the counted tokens given
    here: quantile 0.2 keeps the top 20%, 0 the highest alone."""
    counted = mask > 0
    if threshold is None:
        if not counted.any():
            return torch.zeros_like(mask)
        threshold = torch.quantile(entropy[counted].float(), 1 - quantile)
    return ((entropy >= threshold) & counted).to(mask.dtype)


def off_policy_mask(adv, logp, sampler_logp, mask, threshold):
    """(n, 1): 0 for a sequence with a negative advantage whose mean log pi_sampler - log pi over its counted
    tokens exceeds `threshold`, else 1 (DeepSeek-V3.2's off-policy sequence mask; TRL's off_policy_mask_threshold).
    Detached: a mask, not a term."""
    kl = torch.nan_to_num(sampler_logp - logp.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
    return ((adv >= 0) | (mean_kl <= threshold)).to(mask.dtype)


# ----------------------------------------------------------------------------- aggregation


def aggregate(per_token, mask, how, num_sequences, num_tokens, max_completion_length):
    """The micro-batch's share of the batch loss. The normalisers describe the whole batch (all micro-batches,
    accumulation steps and ranks), so summing over micro-batches gives the full-batch loss and gradient:
      sequence_mean (grpo, sapo): mean over sequences of the per-sequence token mean (DeepSeekMath)
      token_mean (dapo, bnpo, cispo, vespo): sum over tokens / tokens in the batch (DAPO's token-level loss)
      constant (dr_grpo): sum over tokens / (sequences * max_completion_length) (Dr. GRPO)
      sequence_sum (luspo): mean over sequences of the per-sequence token sum (LUSPO)
    """
    if how == "sequence_mean":
        return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / num_sequences
    if how == "token_mean":
        return (per_token * mask).sum() / num_tokens
    if how == "constant":
        return (per_token * mask).sum() / (num_sequences * max_completion_length)
    if how == "sequence_sum":
        return (per_token * mask).sum() / num_sequences
    raise ValueError(f"aggregation: unknown value {how!r}")


# ----------------------------------------------------------------------------- the loss


@dataclass(frozen=True)
class Objective:
    """The settings of the loss, by the names of config.py's Config fields (`Objective.of(cfg)` copies them): a new
    setting of the objective is a field here and one there. docs/objective.md maps papers onto them."""
    loss_type: str = "grpo"               # a policy term (POLICY_TERM) and an aggregation (AGGREGATION)
    beta: float = 0.04                    # the k3 KL's coefficient; 0 = no KL term
    epsilon: float = 0.2                  # PPO's clip below
    epsilon_high: typing.Optional[float] = None  # ... above (cispo: the cap of the weight); None = epsilon
    delta: typing.Optional[float] = None  # two-sided clip: the unclipped ratio also capped at delta
    importance_sampling_level: str = "token"  # the ratio per token or per sequence (GSPO)
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0              # vespo: the gamma weight's power where the advantage is >= 0
    vespo_lambda_pos: float = 3.0         # ... and its decay
    vespo_k_neg: float = 3.0              # ... where the advantage is < 0
    vespo_lambda_neg: float = 2.0
    entropy_coef: float = 0.0             # minus this times the mean entropy of the counted tokens
    use_bias_correction_kl: bool = False  # the k3 term times the ratio (DeepSeek-V3.2; TRL's default)
    max_completion_length: int = 1        # dr_grpo's constant normaliser

    @classmethod
    def of(cls, cfg):
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})

    @property
    def clip_high(self):
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def grpo_loss(logp, old_logp, ref_logp, advantages, mask, objective, *, num_sequences, num_tokens, is_weight=None,
              keep=None, entropy=None):
    """Policy term plus beta * k3 KL for one micro-batch, normalised over the whole batch.

    logp (n, T) requires grad; old_logp is the detached log-prob of the policy
    that sampled (logp.detach() when each batch is used once, so the ratio is 1);
    ref_logp is None when beta == 0; advantages (n,); mask (n, T).
    objective: an `Objective`. Its loss_type is a policy term (POLICY_TERM: clip, cispo, sapo, vespo) and an aggregation
    (AGGREGATION; see `aggregate`); its importance_sampling_level the ratio per token or per sequence (`log_ratio`).
    num_sequences, num_tokens: the whole batch's (all micro-batches, accumulation steps and ranks).
    is_weight: None, or `importance_weights` (n, T) or (n, 1), multiplying each
    token's policy term (not the KL term), as in TRL.
    keep: None, or (n, T) / (n, 1) in {0, 1} multiplying the policy term (not the KL term, not the
    normalisers), as TRL applies its entropy and off-policy masks (`high_entropy_mask`, `off_policy_mask`).
    entropy_coef: minus entropy_coef times the mean entropy over the batch's counted tokens (sum over this
    micro-batch's / num_tokens): `entropy` (n, T) must then carry its gradient (completion_logprobs(entropy_grad=True)).
    use_bias_correction_kl: the k3 term is multiplied by the ratio pi / pi_old,
    gradient included (TRL's `use_bias_correction_kl`, on by default in TRL 1.16;
    from the DeepSeek-V3.2 report): the KL gradient is then that of KL(pi || ref)
    also when the batch was sampled by an older policy. At ratio 1 the loss's
    value is unchanged, but its gradient is not.
    Returns (loss, metrics) with metric means over this micro-batch's tokens, as 0-dim tensors on the loss's
    device: reading them (.item()) waits for the device, so callers sum them and read once per step.
    """
    o = objective
    loss_type, beta, epsilon, epsilon_high = o.loss_type, o.beta, o.epsilon, o.clip_high
    if loss_type not in POLICY_TERM:
        raise ValueError(f"loss_type: unknown value {loss_type!r} (one of {', '.join(LOSS_TYPES)})")
    mask = mask.to(logp.dtype)
    ratio = torch.exp(log_ratio(logp, old_logp, mask, o.importance_sampling_level))  # (n, T) or (n, 1)
    adv = advantages[:, None].to(logp.dtype)  # (n, 1)
    term = POLICY_TERM[loss_type]
    if term == "clip":
        per_token = clipped_term(ratio, adv, epsilon=epsilon, epsilon_high=epsilon_high, delta=o.delta)
    elif term == "cispo":
        per_token = cispo_term(ratio, adv, logp, epsilon_high=epsilon_high)
    elif term == "sapo":
        per_token = sapo_term(ratio, adv, temperature_pos=o.sapo_temperature_pos,
                              temperature_neg=o.sapo_temperature_neg)
    else:  # vespo: its own sequence ratio from the token log-ratios, the importance weight inside it
        per_token = vespo_term(logp, old_logp, adv, mask, k_pos=o.vespo_k_pos, lambda_pos=o.vespo_lambda_pos,
                               k_neg=o.vespo_k_neg, lambda_neg=o.vespo_lambda_neg, is_weight=is_weight)
    if keep is not None:
        per_token = per_token * keep
    if is_weight is not None and term != "vespo":
        per_token = per_token * is_weight
    kl = None
    if beta != 0:
        kl = k3_kl(ref_logp, logp)
        per_token = per_token + beta * (kl * ratio if o.use_bias_correction_kl else kl)
    per_token = per_token.expand_as(logp)  # (n, 1) when sequence-level without KL
    loss = aggregate(per_token, mask, AGGREGATION[loss_type], num_sequences, num_tokens, o.max_completion_length)
    if o.entropy_coef != 0:  # the same meaning for every loss_type: a mean over tokens, as in TRL
        loss = loss - o.entropy_coef * (entropy * mask).sum() / num_tokens
    with torch.no_grad():
        count = mask.sum().clamp(min=1)
        if term == "clip":  # tokens whose clipped side was taken: no gradient
            low = (ratio < 1 - epsilon) & (adv < 0)
            high = (ratio > 1 + epsilon_high) & (adv > 0)
        elif term == "cispo":  # tokens whose weight was capped (TRL's cispo clip ratio)
            high = (ratio > epsilon_high) & (adv > 0)
            low = torch.zeros_like(high)
        else:  # a soft gate (sapo) or a weight (vespo) clips nothing
            low = high = torch.zeros_like(adv, dtype=torch.bool)
        metrics = {
            "kl": (kl * mask).sum() / count if kl is not None else torch.zeros((), device=mask.device),
            "clip_low": (low.to(mask.dtype) * mask).sum() / count,
            "clip_high": (high.to(mask.dtype) * mask).sum() / count,
            "tokens": mask.sum(),
        }
    return loss, metrics
