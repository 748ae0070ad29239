"""The GRPO objective as small functions: advantages, KL, the ratio, the policy terms, which tokens count,
aggregation, and the loss that composes them (the token log-probs they take, and micro-batches: logprobs.py).

Shapes: N completions in a batch, P prompts, G completions per prompt
(N = P * G, grouped so that rows g*G .. g*G+G-1 belong to prompt g),
T completion length, V vocabulary.

The sampler that produces the rollouts is sampling.py. This file imports
nothing else of the project: each function can be called from a test with
tensors.
"""

import dataclasses
import math
import typing
from dataclasses import dataclass

import torch


# ----------------------------------------------------------------------------- advantages


def group_advantages(rewards, group_size, scale="group", eps=1e-4):
    """(r - mean) / (std + eps) within each group of `group_size` consecutive completions.

    `rewards` (N,) float, NaN where no reward function could score a completion: those are left out of the statistics
    and get advantage 0. A group whose valid rewards are all equal (or has fewer than two) gets exactly 0. scale:
    "group" divides by the group's std (the paper); "batch" and "none": `rescaled`. The statistics are taken in float64,
    where no finite float32 rewards can overflow; ValueError when the advantages do not fit float32 (only possible with
    scale "none" and rewards near float32's limit) or a reward is infinite. Returns (advantages (N,) float32, group_std
    (P,) float64)."""
    r = rewards.double().view(-1, group_size)  # (P, G)
    valid = ~torch.isnan(r)
    n = valid.sum(1, keepdim=True)
    mean = torch.where(valid, r, 0.0).sum(1, keepdim=True) / n.clamp(min=1)
    centred = torch.where(valid, r - mean, 0.0)
    std = (centred.pow(2).sum(1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()  # unbiased, like torch.std
    hi = torch.where(valid, r, float("-inf")).amax(1, keepdim=True)
    lo = torch.where(valid, r, float("inf")).amin(1, keepdim=True)
    flat = (hi <= lo) | (n < 2)  # all equal: no signal, and rounding in `mean` must not invent one
    adv = centred / (std + eps) if scale == "group" else rescaled(centred, r, valid, scale, eps)
    adv = torch.where(flat, 0.0, adv).float()
    if torch.isinf(r).any() or not torch.isfinite(adv).all():
        raise unfit_rewards(r, centred, scale)
    return adv.reshape(-1), std.squeeze(1)


def rescaled(centred, r, valid, scale, eps):
    """The centred rewards `centred` (P, G) of group_advantages, for the scales other than "group": "batch"
    divides by the std of the whole batch's valid rewards `r[valid]` (more robust to low-variance groups), "none"
    only centres (Dr. GRPO argues the std division biases towards easy and hard questions)."""
    if scale == "batch":
        all_valid = r[valid]
        batch_std = all_valid.std() if all_valid.numel() > 1 else torch.zeros((), dtype=r.dtype, device=r.device)
        return centred / (batch_std + eps)
    if scale != "none":
        raise ValueError(f"scale_rewards: unknown value {scale!r} (group, batch or none)")
    return centred


def unfit_rewards(r, centred, scale):
    """group_advantages' ValueError for rewards `r` (P, G) with an infinite one, or whose centred values `centred`
    give advantages that do not fit float32."""
    if torch.isinf(r).any():
        return ValueError(f"group_advantages: {torch.isinf(r).sum().item()} reward(s) are infinite; "
                          f"rewards must be finite, or NaN where none was given")
    return ValueError(f"group_advantages: advantages up to {centred.abs().max().item():.4g} do not fit float32 "
                      f"(scale_rewards={scale!r}); scale the rewards down or use scale_rewards='group'")


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

    Unbiased, non-negative, and computed in float32 with exp's argument capped so that it stays finite for any finite
    input, also from bfloat16."""
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


# The sampler-trainer mismatch, measured as the other stacks measure it (verl's `rollout_corr/*`, prime-rl's
# mismatch KL), with rho = pi_trainer / pi_sampler per token: the importance weight the batch would need.
MISMATCH_SEQ_CLAMP = 20.0  # a sequence's summed log ratio is clamped to +-this before exp(2 x): finite in float32


def mismatch_sums(logp, sampler_logp, mask):
    """Sums over the counted tokens (`mask` (n, T) 0/1) of one micro-batch, to add over micro-batches and ranks and
    finish with `mismatch_metrics`: tokens, sequences (rows with a counted token), the log ratio sampler - trainer,
    k3 (rho - 1 - log rho), rho - 1 and rho^2 - 1, and per sequence exp(2 S) - 1 (S its summed log trainer -
    sampler, clamped) and its perplexity ratio exp(mean over its tokens of sampler - trainer) - 1. Each is a sum of
    deviations from equal weights (expm1), in float64, so that a float32 run's mismatch of 1e-7 is not lost in a
    sum of rho^2 near N."""
    mask = mask.double()
    lr = (logp.double() - sampler_logp.double()) * mask  # log rho, 0 where not counted
    tokens = mask.sum(1)
    seq = (tokens > 0).double()
    total, rho_m1 = lr.sum(1), torch.expm1(lr) * mask  # rho - 1
    return {"tokens": mask.sum(), "sequences": seq.sum(), "log_ratio": -lr.sum(),
            "k3": (rho_m1 - lr).sum(), "rho_m1": rho_m1.sum(),
            "rho2_m1": (torch.expm1(2 * lr) * mask).sum(),
            "seq_rho2_m1": (torch.expm1(2 * total.clamp(-MISMATCH_SEQ_CLAMP, MISMATCH_SEQ_CLAMP)) * seq).sum(),
            "ppl_m1": (torch.expm1(-total / tokens.clamp(min=1)) * seq).sum()}


def mismatch_metrics(sums):
    """The mismatch figures of the summed `mismatch_sums` (docs/metrics.md): mean log ratio (sampler - trainer, a
    KL(sampler || trainer) estimate), k3, the per-token and per-sequence chi-square (mean rho^2 - 1), the effective
    sample size of the token weights ((sum rho)^2 / (N sum rho^2): 1 for equal weights) and the mean per-sequence
    perplexity ratio (trainer's over sampler's). Empty without a counted token."""
    n, seqs = float(sums["tokens"]), float(sums["sequences"])
    if not n:
        return {}
    return {"log_ratio": sums["log_ratio"] / n, "k3": sums["k3"] / n, "chi2_token": sums["rho2_m1"] / n,
            "chi2_seq": sums["seq_rho2_m1"] / seqs, "ess": (n + sums["rho_m1"]) ** 2 / (n * (n + sums["rho2_m1"])),
            "ppl_ratio": 1 + sums["ppl_m1"] / seqs}


# ----------------------------------------------------------------------------- the ratio


def log_ratio(logp, old_logp, mask, level="token"):
    """log pi / pi_old: per token (n, T), or with level "sequence" one per sequence (`sequence_log_ratio`)."""
    diff = logp - old_logp
    return diff if level == "token" else sequence_log_ratio(diff, mask, level)


def sequence_log_ratio(diff, mask, level="sequence"):
    """One log-ratio per sequence (n, 1): the mean of the token log-ratios `diff` over its counted tokens (GSPO;
    TRL's importance_sampling_level). It keeps the gradient of every token's log-prob, so each token's gradient is
    the sequence ratio times 1/|o_i|."""
    if level != "sequence":
        raise ValueError(f"importance_sampling_level: unknown value {level!r} "
                         f"(one of {', '.join(IMPORTANCE_SAMPLING_LEVELS)})")
    return (diff * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)  # (n, 1)


# ----------------------------------------------------------------------------- the policy term
# Each returns the per-token loss (to be minimised) of ratio (n, T) or (n, 1) and advantages (n, 1).


def clipped_term(ratio, adv, o, **_):
    """PPO's -min(rho A, clip(rho, 1 - epsilon, 1 + epsilon_high) A), with the Objective `o`'s epsilons. `delta`: the
    unclipped rho is also capped at delta (two-sided clipping, INTELLECT-2; TRL's `delta`), so a negative advantage
    cannot push a token whose ratio has run far above 1 without bound."""
    clipped = ratio.clamp(1 - o.epsilon, 1 + o.clip_high)
    unclipped = ratio if o.delta is None else ratio.clamp(max=o.delta)
    return -torch.min(unclipped * adv, clipped * adv)


def clipped_tokens(ratio, adv, o):
    """The tokens whose clipped side was taken, so that get no gradient: (below, above)."""
    return (ratio < 1 - o.epsilon) & (adv < 0), (ratio > 1 + o.clip_high) & (adv > 0)


def cispo_term(ratio, adv, o, logp, **_):
    """CISPO (MiniMax-M1): -sg(min(rho, epsilon_high)) A log pi. The ratio is clipped and detached, so every token
    keeps a gradient (A log pi, weighted); as in TRL the bound is epsilon_high itself, not 1 + epsilon_high."""
    return -ratio.clamp(max=o.clip_high).detach() * adv * logp


def cispo_capped(ratio, adv, o):
    """The tokens whose weight was capped (TRL's cispo clip ratio): (none below, above)."""
    high = (ratio > o.clip_high) & (adv > 0)
    return torch.zeros_like(high), high


def sapo_term(ratio, adv, o, **_):
    """SAPO: -(4 / tau) sigmoid(tau (rho - 1)) A, tau = sapo_temperature_pos where A > 0, else sapo_temperature_neg.
    A soft gate instead of a hard clip: at rho = 1 its gradient is that of rho A, and it fades as rho moves away."""
    tau = torch.where(adv > 0, o.sapo_temperature_pos, o.sapo_temperature_neg)
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


def vespo_objective_term(ratio, adv, o, logp, old_logp, mask, is_weight):
    """vespo_term with the Objective `o`'s settings: its own sequence ratio from the token log-ratios (not `ratio`),
    the importance weight inside it."""
    return vespo_term(logp, old_logp, adv, mask, k_pos=o.vespo_k_pos, lambda_pos=o.vespo_lambda_pos,
                      k_neg=o.vespo_k_neg, lambda_neg=o.vespo_lambda_neg, is_weight=is_weight)


def nothing_clipped(ratio, adv, o):
    """A soft gate (sapo) or a weight (vespo) clips nothing: (none below, none above)."""
    none = torch.zeros_like(adv, dtype=torch.bool)
    return none, none


# Each policy term: (its per-token loss, the tokens it clipped). The loss is called as
# loss(ratio, adv, o, logp=, old_logp=, mask=, is_weight=) and takes the keywords it needs.
TERMS = {"clip": (clipped_term, clipped_tokens), "cispo": (cispo_term, cispo_capped),
         "sapo": (sapo_term, nothing_clipped), "vespo": (vespo_objective_term, nothing_clipped)}


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


# Each aggregation: the micro-batch's share of the batch loss, of the per-token terms and the counted tokens (mask).
# The normalisers describe the whole batch (all micro-batches, accumulation steps and ranks), so summing over
# micro-batches gives the full-batch loss and gradient. Each is called as f(per_token, mask, num_sequences,
# num_tokens, max_completion_length) and reads the normalisers it needs.


def sequence_mean(per_token, mask, num_sequences, num_tokens, max_completion_length):
    """grpo, sapo: the mean over sequences of the per-sequence token mean (DeepSeekMath)."""
    return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / num_sequences


def token_mean(per_token, mask, num_sequences, num_tokens, max_completion_length):
    """dapo, bnpo, cispo, vespo: the sum over tokens / the tokens in the batch (DAPO's token-level loss)."""
    return (per_token * mask).sum() / num_tokens


def constant(per_token, mask, num_sequences, num_tokens, max_completion_length):
    """dr_grpo: the sum over tokens / (sequences * max_completion_length) (Dr. GRPO)."""
    return (per_token * mask).sum() / (num_sequences * max_completion_length)


def sequence_sum(per_token, mask, num_sequences, num_tokens, max_completion_length):
    """luspo: the mean over sequences of the per-sequence token sum (LUSPO)."""
    return (per_token * mask).sum() / num_sequences


AGGREGATIONS = {"sequence_mean": sequence_mean, "token_mean": token_mean, "constant": constant,
                "sequence_sum": sequence_sum}


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
    entropy_coef: float = 0.0             # minus this times the mean entropy of the counted tokens (sum over a
                                          # micro-batch's / num_tokens)
    # the k3 term multiplied by the ratio pi / pi_old, gradient included (TRL's `use_bias_correction_kl`, on by
    # default in TRL 1.16; from the DeepSeek-V3.2 report): the KL gradient is then that of KL(pi || ref) also when
    # the batch was sampled by an older policy. At ratio 1 the loss's value is unchanged, but its gradient is not.
    use_bias_correction_kl: bool = False
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

    logp (n, T) requires grad; old_logp is the detached log-prob of the policy that sampled (logp.detach() when each
    batch is used once, so the ratio is 1); ref_logp is None when beta == 0; advantages (n,); mask (n, T).
    objective: an `Objective`. Its loss_type is a policy term (POLICY_TERM, TERMS) and an aggregation
    (AGGREGATION, AGGREGATIONS); its importance_sampling_level the ratio per token or per sequence (`log_ratio`).
    num_sequences, num_tokens: the whole batch's (all micro-batches, accumulation steps and ranks).
    is_weight, keep: None, or what multiplies the policy term (`reweighted`). entropy (n, T): with entropy_coef,
    it must carry its gradient (completion_logprobs(entropy_grad=True)).
    Returns (loss, metrics) with metric means over this micro-batch's tokens, as 0-dim tensors on the loss's
    device: reading them (.item()) waits for the device, so callers sum them and read once per step."""
    o = objective
    if o.loss_type not in POLICY_TERM:
        raise ValueError(f"loss_type: unknown value {o.loss_type!r} (one of {', '.join(LOSS_TYPES)})")
    mask = mask.to(logp.dtype)
    ratio = torch.exp(log_ratio(logp, old_logp, mask, o.importance_sampling_level))  # (n, T) or (n, 1)
    adv = advantages[:, None].to(logp.dtype)  # (n, 1)
    term, clipped = TERMS[POLICY_TERM[o.loss_type]]
    per_token = term(ratio, adv, o, logp=logp, old_logp=old_logp, mask=mask, is_weight=is_weight)
    if keep is not None or is_weight is not None:
        per_token = reweighted(per_token, keep, is_weight, POLICY_TERM[o.loss_type])
    kl = None
    if o.beta != 0:
        kl = k3_kl(ref_logp, logp)
        per_token = per_token + o.beta * (kl * ratio if o.use_bias_correction_kl else kl)
    per_token = per_token.expand_as(logp)  # (n, 1) when sequence-level without KL
    loss = AGGREGATIONS[AGGREGATION[o.loss_type]](per_token, mask, num_sequences, num_tokens, o.max_completion_length)
    if o.entropy_coef != 0:  # the same meaning for every loss_type: a mean over tokens, as in TRL
        loss = loss - o.entropy_coef * (entropy * mask).sum() / num_tokens
    with torch.no_grad():
        count = mask.sum().clamp(min=1)
        low, high = clipped(ratio, adv, o)
        return loss, {"kl": (kl * mask).sum() / count if kl is not None else torch.zeros((), device=mask.device),
                      "clip_low": (low.to(mask.dtype) * mask).sum() / count,
                      "clip_high": (high.to(mask.dtype) * mask).sum() / count, "tokens": mask.sum()}


def reweighted(per_token, keep, is_weight, term):
    """The policy term times `keep`, then times `is_weight` (not the KL term, not the normalisers), as in TRL.
    is_weight: None, or `importance_weights` (n, T) or (n, 1), multiplying each token's policy term; vespo (`term`)
    takes it inside its own ratio instead. keep: None, or (n, T) / (n, 1) in {0, 1}, as TRL applies its entropy and
    off-policy masks (`high_entropy_mask`, `off_policy_mask`)."""
    if keep is not None:
        per_token = per_token * keep
    if is_weight is not None and term != "vespo":
        per_token = per_token * is_weight
    return per_token
