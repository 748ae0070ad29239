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
from torch.utils.checkpoint import checkpoint

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
    scaled = logits / temperature
    logp_all = torch.log_softmax(scaled, -1)
    probs = filter_logits(scaled, top_k, top_p).softmax(-1)
    cdf = probs.cumsum(-1)
    token = (cdf < uniform[:, None] * cdf[:, -1:]).sum(-1).clamp(max=logits.shape[-1] - 1)
    return token, logp_all.gather(-1, token[:, None])[:, 0]


@torch.no_grad()
def sample(model, prompt_ids, prompt_mask, *, max_new_tokens, eos_ids, pad_id, temperature=1.0, top_k=0,
           top_p=1.0, seeds=None, check_every=8, all_done=None):
    """Generate completions for left-padded prompts: a prefill, then one token at a time over a KV cache.

    Each row stops at its first EOS; the loop stops once every row has, checking
    on the host only every `check_every` tokens, or at `max_new_tokens`.
    `seeds` (N,) int64 fixes each row's random stream; rows with equal seeds
    and equal prompts sample equal completions.
    `all_done(done) -> bool` decides when to stop; under several processes it
    must agree across ranks (an all-reduce), so that every rank runs the same
    number of forwards and none waits forever on a collective.
    """
    from transformers import DynamicCache

    if all_done is None:
        all_done = lambda done: bool(done.all())  # noqa: E731

    n = prompt_ids.shape[0]
    device = prompt_ids.device
    if seeds is None:
        seeds = torch.arange(n, device=device)
    seeds = seeds.to(device=device, dtype=torch.long)
    eos = torch.as_tensor(eos_ids, device=device)
    attn = prompt_mask.long()
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
        tok, lp = sample_tokens(logits, temperature, top_k, top_p, row_uniform(seeds, t))
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
    tokens, logps = tokens[:, :length], logps[:, :length]
    mask = completion_mask_from_ids(tokens, eos_ids)
    return Rollout(tokens, mask, ~done, logps * mask)


# ----------------------------------------------------------------------------- token log-probs


def _chunk_logprobs(hidden, weight, targets, temperature):
    logits = F.linear(hidden, weight).float() / temperature  # (chunk, V) float32, the only one alive
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, targets[:, None])[:, 0]
    with torch.no_grad():  # entropy is a metric: no gradient through it
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def completion_logprobs(model, input_ids, attention_mask, num_completion_tokens, temperature=1.0,
                        chunk_tokens=None):
    """Log-probs (and entropies) of the last `num_completion_tokens` tokens of each row, in float32.

    The transformer runs once; the vocabulary projection runs over chunks of
    `chunk_tokens` positions, each recomputed in backward (activation
    checkpointing), so no (N, T, V) float32 tensor ever exists. Temperature is
    applied exactly as in `sample`.
    Returns (logp, entropy), each (N, T).
    """
    t = num_completion_tokens
    positions = position_ids_from_mask(attention_mask)
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=positions).last_hidden_state
    hidden = hidden[:, -t - 1:-1]  # (N, T, H): the position before each completion token predicts it
    n, _, h = hidden.shape
    hidden, targets = hidden.reshape(n * t, h), input_ids[:, -t:].reshape(n * t)
    weight = model.get_output_embeddings().weight
    if chunk_tokens is None:
        chunk_tokens = max(1, (1 << 24) // weight.shape[0])  # about 64 MB of float32 logits per chunk
    logps, entropies = [], []
    for start in range(0, n * t, chunk_tokens):
        args = (hidden[start:start + chunk_tokens], weight, targets[start:start + chunk_tokens], temperature)
        if torch.is_grad_enabled():
            lp, ent = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(*args)
        logps.append(lp)
        entropies.append(ent)
    return torch.cat(logps).view(n, t), torch.cat(entropies).view(n, t)


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
