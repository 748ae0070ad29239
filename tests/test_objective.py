"""Advantages, the k3 KL estimator, the clipped surrogate and its normalisations, against naive versions."""

import math
import statistics

import pytest
import torch
import torch.nn.functional as F

import grpo

import logprobs


def naive_advantages(rewards, g, scale, eps=1e-4):
    """Plain Python floats (double precision), one group at a time."""
    out = []
    valid_all = [r for r in rewards if r is not None]
    batch_std = statistics.stdev(valid_all) if len(valid_all) > 1 else 0.0
    for i in range(0, len(rewards), g):
        group = rewards[i:i + g]
        valid = [r for r in group if r is not None]
        if len(valid) < 2 or len(set(valid)) == 1:
            out += [0.0] * g
            continue
        mean = math.fsum(valid) / len(valid)
        std = math.sqrt(math.fsum((r - mean) ** 2 for r in valid) / (len(valid) - 1))
        denom = {"group": std + eps, "batch": batch_std + eps, "none": 1.0}[scale]
        out += [0.0 if r is None else (r - mean) / denom for r in group]
    return out


def as_tensor(rewards):
    return torch.tensor([float("nan") if r is None else r for r in rewards])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_match_naive(scale):
    rewards = [1.0, 0.0, 0.5, None, 0.2, 0.2, 0.2, 0.2, 3.0, -1.0, None, None, 0.0, 1.0, 1.0, 0.0]
    adv, _ = grpo.group_advantages(as_tensor(rewards), 4, scale)
    torch.testing.assert_close(adv, torch.tensor(naive_advantages(rewards, 4, scale)), atol=1e-5, rtol=1e-5)


def test_equal_rewards_give_exactly_zero():
    # 0.1 has no exact binary form: a mean computed in float is not exactly 0.1
    rewards = torch.tensor([0.1] * 7 + [1 / 3] * 7)
    adv, std = grpo.group_advantages(rewards, 7)
    assert (adv == 0).all() and not torch.isnan(adv).any()


def test_group_of_two():
    adv, _ = grpo.group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, float("nan"), 2.0]), 2)
    expected = 0.5 / (math.sqrt(0.5) + 1e-4)
    torch.testing.assert_close(adv, torch.tensor([expected, -expected, 0.0, 0.0, 0.0, 0.0]))


def test_none_rewards_left_out():
    adv, _ = grpo.group_advantages(as_tensor([None, None, None, None, 1.0, None, 0.0, None]), 4)
    assert not torch.isnan(adv).any()
    assert adv[:4].eq(0).all() and adv[5] == 0 and adv[7] == 0
    assert adv[4] > 0 and adv[6] < 0 and torch.isclose(adv[4], -adv[6])


def test_kl_zero_when_equal_and_nonnegative():
    torch.manual_seed(0)
    logp = torch.randn(1000) * 3
    assert grpo.k3_kl(logp, logp).abs().max() == 0
    ref = torch.randn(1000) * 3
    kl = grpo.k3_kl(ref, logp)
    assert (kl >= 0).all()
    d = (ref - logp).double()
    torch.testing.assert_close(kl.double(), d.exp() - d - 1, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kl_finite_at_extremes(dtype):
    big = torch.tensor([-1e4, -100.0, 0.0, 100.0, 1e4, -3e38 if dtype == torch.float32 else -3e38], dtype=dtype)
    ref, logp = big[:, None].expand(6, 6).reshape(-1), big[None, :].expand(6, 6).reshape(-1)
    kl = grpo.k3_kl(ref, logp)
    assert torch.isfinite(kl).all() and (kl >= 0).all()
    logp = logp.clone().float().requires_grad_()
    grpo.k3_kl(ref, logp).sum().backward()
    assert torch.isfinite(logp.grad).all()


def loss_kwargs(num_sequences=4, num_tokens=None, **over):
    """grpo_loss's keywords: the objective (these tests' defaults, then `over`) and the batch's normalisers."""
    settings = dict(beta=0.1, epsilon=0.2, epsilon_high=0.3, loss_type="grpo", max_completion_length=6)
    settings.update(over)
    return dict(objective=grpo.Objective(**settings), num_sequences=num_sequences, num_tokens=num_tokens)


def make_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(4, 6, generator=g) * 3
    ref = logp + torch.randn(4, 6, generator=g) * 0.3
    adv = torch.tensor([1.5, -0.5, 0.0, -1.0])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0]]).float()
    return logp, ref, adv, mask


def naive_loss(logp, old, ref, adv, mask, beta, epsilon, epsilon_high, loss_type, max_len, is_weight=None,
               bias_correction_kl=False):
    """TRL's per-token loss written out: the surrogate (times the importance weight, (n, T) or (n, 1)) plus beta
    times k3 (times the ratio when bias-corrected), token by token."""
    per_seq_sums, per_seq_lens, total = [], [], 0.0
    for i in range(logp.shape[0]):
        s = 0.0
        for t in range(logp.shape[1]):
            if mask[i, t] == 0:
                continue
            ratio = torch.exp(logp[i, t] - old[i, t])
            term = -torch.min(ratio * adv[i], ratio.clamp(1 - epsilon, 1 + epsilon_high) * adv[i])
            if is_weight is not None:
                term = term * is_weight[i, t if is_weight.shape[1] > 1 else 0]
            d = ref[i, t] - logp[i, t]
            kl = torch.exp(d) - d - 1
            term = term + beta * (kl * ratio if bias_correction_kl else kl)
            s = s + term
        per_seq_sums.append(s)
        per_seq_lens.append(mask[i].sum())
        total = total + s
    n = logp.shape[0]
    if loss_type == "grpo":
        return sum(s / l for s, l in zip(per_seq_sums, per_seq_lens)) / n
    if loss_type == "dapo":
        return total / mask.sum()
    return total / (n * max_len)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])  # the others: test_each_loss_type_and_level_...
def test_loss_matches_naive_with_gradients(loss_type):
    logp0, ref, adv, mask = make_batch()
    old = logp0 + torch.randn(4, 6, generator=torch.Generator().manual_seed(1)) * 0.4  # some ratios clip
    a = logp0.clone().requires_grad_()
    loss, m = grpo.grpo_loss(a, old, ref, adv, mask, **loss_kwargs(loss_type=loss_type, num_tokens=mask.sum()))
    loss.backward()
    b = logp0.clone().requires_grad_()
    ref_loss = naive_loss(b, old, ref, adv, mask, 0.1, 0.2, 0.3, loss_type, 6)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(a.grad, b.grad)
    assert 0 < m["clip_low"] + m["clip_high"] < 1 and m["kl"] > 0


def test_first_iteration_ratio_is_one_gradient_is_advantage():
    logp0, _, adv, mask = make_batch()
    logp = logp0.clone().requires_grad_()
    loss, m = grpo.grpo_loss(logp, logp.detach(), None, adv, mask,
                             **loss_kwargs(beta=0.0, loss_type="dapo", num_tokens=mask.sum()))
    loss.backward()
    # ratio == 1 everywhere: nothing clipped, and d loss / d logp = -A / num_tokens on every unmasked token
    assert m["clip_low"] == 0 and m["clip_high"] == 0
    torch.testing.assert_close(logp.grad, -adv[:, None].expand(4, 6) * mask / mask.sum())


def test_clipped_tokens_get_no_gradient():
    logp0 = torch.zeros(2, 3)
    old = torch.tensor([[0.0, -0.5, 0.5], [0.0, 0.5, -0.5]])  # ratios [1, e^0.5 > 1.3, e^-0.5 < 0.8], [1, e^-0.5, e^0.5]
    adv = torch.tensor([1.0, -1.0])
    logp = logp0.clone().requires_grad_()
    loss, m = grpo.grpo_loss(logp, old, None, adv, torch.ones(2, 3),
                             **loss_kwargs(beta=0.0, loss_type="dapo", num_tokens=6))
    loss.backward()
    # positive advantage above 1 + epsilon_high and negative advantage below 1 - epsilon: clipped, zero gradient
    assert logp.grad[0, 1] == 0 and logp.grad[1, 1] == 0
    # the other side of the clip range is not clipped for that sign of advantage
    assert logp.grad[0, 0] != 0 and logp.grad[0, 2] != 0 and logp.grad[1, 0] != 0 and logp.grad[1, 2] != 0
    assert m["clip_high"].item() == pytest.approx(1 / 6) and m["clip_low"].item() == pytest.approx(1 / 6)


def naive_importance_weights(old, sampler, mask, mode, low, high):
    """Row by row, token by token in Python floats: exp(old - sampler), per token or summed over a sequence."""
    out = []
    for i in range(old.shape[0]):
        diffs = [float(old[i, t] - sampler[i, t]) if mask[i, t] else 0.0 for t in range(old.shape[1])]
        ratios = [math.exp(sum(diffs))] if mode.startswith("sequence") else [math.exp(d) for d in diffs]
        if mode.endswith("truncate"):
            out.append([min(max(r, low), high) for r in ratios])
        else:
            out.append([r if low <= r <= high else 0.0 for r in ratios])
    return torch.tensor(out)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_importance_weights_match_naive(mode):
    logp, _, _, mask = make_batch()
    sampler = logp + torch.randn(4, 6, generator=torch.Generator().manual_seed(2)) * 0.3
    low, high = (0.6, 1.4) if mode.startswith("token") else (0.3, 2.0)
    w = grpo.importance_weights(logp, sampler, mask, mode, low, high)
    expected = naive_importance_weights(logp, sampler, mask, mode, low, high)
    torch.testing.assert_close(w, expected)
    inside = (expected > low) & (expected < high)
    assert inside.any() and (~inside).any()  # the case exercises both sides of the bounds


def test_importance_weights_finite_for_any_gap():
    old = torch.tensor([[0.0, -50.0, 0.0], [-1e4, 0.0, 0.0]])
    sampler = torch.tensor([[-100.0, 0.0, 0.0], [0.0, -1e4, 0.0]])
    mask = torch.ones(2, 3)
    for mode in ("token_truncate", "sequence_truncate", "token_mask", "sequence_mask"):
        w = grpo.importance_weights(old, sampler, mask, mode, 0.0, 3.0)
        assert torch.isfinite(w).all() and (w >= 0).all() and (w <= 3.0).all()


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
@pytest.mark.parametrize("bias_correction_kl", [False, True])
def test_weighted_and_bias_corrected_loss_matches_naive(mode, bias_correction_kl):
    logp0, ref, adv, mask = make_batch()
    g = torch.Generator().manual_seed(3)
    old = logp0 + torch.randn(4, 6, generator=g) * 0.2
    sampler = old + torch.randn(4, 6, generator=g) * 0.3
    w = grpo.importance_weights(old, sampler, mask, mode, 0.5, 2.0)
    a = logp0.clone().requires_grad_()
    loss, _ = grpo.grpo_loss(a, old, ref, adv, mask, is_weight=w,
                             **loss_kwargs(num_tokens=mask.sum(), use_bias_correction_kl=bias_correction_kl))
    loss.backward()
    b = logp0.clone().requires_grad_()
    expected = naive_loss(b, old, ref, adv, mask, 0.1, 0.2, 0.3, "grpo", 6, is_weight=w,
                          bias_correction_kl=bias_correction_kl)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(a.grad, b.grad)


def test_bias_corrected_kl_changes_the_gradient_not_the_value_at_ratio_one():
    logp0, ref, adv, mask = make_batch()
    grads, values = [], []
    for corrected in (False, True):
        logp = logp0.clone().requires_grad_()
        loss, _ = grpo.grpo_loss(logp, logp.detach(), ref, adv, mask,
                                 **loss_kwargs(num_tokens=mask.sum(), use_bias_correction_kl=corrected))
        loss.backward()
        grads.append(logp.grad)
        values.append(loss.detach())
    torch.testing.assert_close(values[0], values[1])
    # d/dlogp of k3 * ratio at ratio 1 adds k3 itself: the difference is beta * k3 / sequence length / N
    d = ref - logp0
    extra = 0.1 * (d.exp() - d - 1) * mask / mask.sum(1, keepdim=True) / 4
    torch.testing.assert_close(grads[1] - grads[0], extra)


# ----------------------------------------------------------------------------- the objective's axes


def naive_objective(logp, old, ref, adv, mask, loss_type, level="token", beta=0.1, epsilon=0.2, epsilon_high=0.3,
                    delta=None, temperature_pos=1.0, temperature_neg=1.05, keep=None, max_len=6):
    """Each paper's formula, token by token: the ratio (per token, or exp of the sequence's mean log-ratio), the
    policy term (PPO clip with the optional delta cap, CISPO, SAPO), the kept tokens, plus beta * k3, then the
    aggregation over the whole batch."""
    seqs = []
    for i in range(logp.shape[0]):
        tokens = [t for t in range(logp.shape[1]) if mask[i, t]]
        seq_log_ratio = sum(logp[i, t] - old[i, t] for t in tokens) / max(len(tokens), 1)
        terms = []
        for t in tokens:
            r = torch.exp(seq_log_ratio if level == "sequence" else logp[i, t] - old[i, t])
            a = adv[i]
            if loss_type == "cispo":
                term = -torch.clamp(r.detach(), max=epsilon_high) * a * logp[i, t]
            elif loss_type == "vespo":  # the gamma weight of the sequence's ratio w = prod_t pi / pi_old, a constant
                log_w = min(max(sum(min(max((logp[i, u] - old[i, u]).item(), -20), 20) for u in tokens),
                                math.log(1e-8)), 20)
                k, lam = (2.0, 3.0) if a >= 0 else (3.0, 2.0)
                term = -math.exp(lam + k * log_w - lam * math.exp(log_w)) * a * logp[i, t]
            elif loss_type == "sapo":
                tau = temperature_pos if a > 0 else temperature_neg
                term = -torch.sigmoid(tau * (r - 1)) * 4 / tau * a
            else:
                unclipped = torch.clamp(r, max=delta) if delta is not None else r
                term = -torch.min(unclipped * a, torch.clamp(r, 1 - epsilon, 1 + epsilon_high) * a)
            if keep is not None:
                term = term * keep[i, t if keep.shape[1] > 1 else 0]
            d = ref[i, t] - logp[i, t]
            terms.append(term + beta * (torch.exp(d) - d - 1))
        seqs.append(terms)
    n, total = len(seqs), sum(sum(terms) for terms in seqs)
    if loss_type in ("grpo", "sapo"):
        return sum(sum(terms) / len(terms) for terms in seqs if terms) / n
    if loss_type in ("dapo", "bnpo", "cispo", "vespo"):
        return total / mask.sum()
    if loss_type == "dr_grpo":
        return total / (n * max_len)
    assert loss_type == "luspo"
    return total / n


def trl_formula(logp, old, ref, adv, mask, loss_type, level, beta, epsilon, epsilon_high, delta, temperature_pos,
                temperature_neg, max_len):
    """TRL 1.16's GRPOTrainer._compute_loss written out for one process, one micro-batch, no accumulation (where
    its normalisers are the whole batch's): the reference the settings' names promise."""
    advantages = adv[:, None]
    lr = logp - old
    if level == "sequence":
        lr = ((lr * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(lr)
    d = ref - logp
    kl = torch.exp(d) - d - 1
    if loss_type == "cispo":
        per_token = -torch.clamp(coef_1, max=epsilon_high).detach() * advantages * logp
    elif loss_type == "vespo":  # get_gamma_weights: from the token log-ratios whatever the level, in log space
        log_w = (torch.clamp(logp - old, -20.0, 20.0) * mask).sum(-1, keepdim=True).clamp(math.log(1e-8), 20.0)
        k = torch.where(advantages >= 0, 2.0, 3.0)
        lam = torch.where(advantages >= 0, 3.0, 2.0).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        per_token = -phi.detach() * advantages * logp
    elif loss_type == "sapo":
        temps = torch.where(advantages > 0, temperature_pos, temperature_neg)
        per_token = -torch.sigmoid(temps * (coef_1 - 1)) * 4 / temps * advantages
    else:
        coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + epsilon_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token = -torch.min(coef_1 * advantages, coef_2 * advantages)
    per_token = per_token + beta * kl
    if loss_type in ("grpo", "sapo"):
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * max_len)
    if loss_type in ("dapo", "cispo", "vespo"):
        return (per_token * mask).sum() / mask.sum()  # num_items_in_batch: the batch's tokens
    return (per_token * mask).sum(-1).mean()  # luspo


def objective_case(seed=1):
    logp0, ref, adv, mask = make_batch()
    old = logp0 + torch.randn(4, 6, generator=torch.Generator().manual_seed(seed)) * 0.4  # some ratios clip
    return logp0, old, ref, adv, mask


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
@pytest.mark.parametrize("level", grpo.IMPORTANCE_SAMPLING_LEVELS)
def test_each_loss_type_and_level_matches_the_formula_and_trl(loss_type, level):
    logp0, old, ref, adv, mask = objective_case()
    delta = 1.25 if loss_type == "dapo" else None  # the two-sided clip, on one of the clipped variants
    settings = dict(epsilon=0.2, epsilon_high=0.3 if loss_type != "cispo" else 1.1, delta=delta,
                    temperature_pos=1.0, temperature_neg=1.05)
    a = logp0.clone().requires_grad_()
    loss, m = grpo.grpo_loss(a, old, ref, adv, mask, grpo.Objective(
        beta=0.1, epsilon=0.2, epsilon_high=settings["epsilon_high"], loss_type=loss_type, max_completion_length=6,
        importance_sampling_level=level, delta=delta, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05),
        num_sequences=4, num_tokens=mask.sum())
    loss.backward()
    b = logp0.clone().requires_grad_()
    expected = naive_objective(b, old, ref, adv, mask, loss_type, level, beta=0.1, **settings)
    expected.backward()
    c = logp0.clone().requires_grad_()
    trl = trl_formula(c, old, ref, adv, mask, loss_type, level, 0.1, max_len=6, **settings)
    trl.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(a.grad, b.grad)
    torch.testing.assert_close(loss, trl)
    torch.testing.assert_close(a.grad, c.grad)
    assert torch.isfinite(torch.stack([m["kl"], m["clip_low"], m["clip_high"]])).all()


def test_delta_caps_the_unclipped_ratio_of_negative_advantages():
    logp = torch.zeros(1, 2, requires_grad=True)
    old = torch.tensor([[-1.0, -0.1]])  # ratios e (above delta 1.5) and e^0.1
    loss, _ = grpo.grpo_loss(logp, old, None, torch.tensor([-1.0]), torch.ones(1, 2), grpo.Objective(
        beta=0.0, epsilon=0.2, epsilon_high=0.2, loss_type="dapo", max_completion_length=2, delta=1.5),
        num_sequences=1, num_tokens=2)
    loss.backward()
    torch.testing.assert_close(loss, (1.5 + math.exp(0.1)) / 2 * torch.ones(()))
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] != 0  # capped: no gradient, as a clipped token


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
@pytest.mark.parametrize("level", grpo.IMPORTANCE_SAMPLING_LEVELS)
def test_any_split_into_micro_batches_gives_the_full_batch_gradient(loss_type, level):
    logp0, old, ref, adv, mask = objective_case(seed=4)
    kw = loss_kwargs(loss_type=loss_type, num_tokens=mask.sum(), importance_sampling_level=level)
    full = logp0.clone().requires_grad_()
    grpo.grpo_loss(full, old, ref, adv, mask, **kw)[0].backward()
    split = logp0.clone().requires_grad_()
    total = 0
    for rows in ([0], [1, 2], [3]):
        total = total + grpo.grpo_loss(split[rows], old[rows], ref[rows], adv[rows], mask[rows], **kw)[0]
    total.backward()
    torch.testing.assert_close(split.grad, full.grad)


def test_default_loss_is_bitwise_the_clipped_grpo_loss():
    """The defaults reproduce the clipped surrogate + k3 with the per-sequence mean exactly, bit for bit."""
    logp0, old, ref, adv, mask = objective_case()
    a = logp0.clone().requires_grad_()
    loss, _ = grpo.grpo_loss(a, old, ref, adv, mask, **loss_kwargs(num_tokens=mask.sum()))
    loss.backward()
    b = logp0.clone().requires_grad_()
    ratio = torch.exp(b - old)
    A = adv[:, None]
    per_token = -torch.min(ratio * A, ratio.clamp(1 - 0.2, 1 + 0.3) * A) + 0.1 * grpo.k3_kl(ref, b)
    expected = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / 4
    expected.backward()
    assert torch.equal(loss, expected) and torch.equal(a.grad, b.grad)


def naive_quantile(values, q):
    """Linear interpolation between order statistics, as torch.quantile."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (pos - lo)


@pytest.mark.parametrize("quantile", [0.0, 0.2, 0.5, 1.0])
def test_high_entropy_mask_keeps_the_top_fraction_of_counted_tokens(quantile):
    _, _, _, mask = make_batch()
    entropy = torch.rand(4, 6, generator=torch.Generator().manual_seed(5)) * 2
    keep = grpo.high_entropy_mask(entropy, mask, quantile)
    counted = [float(entropy[i, t]) for i in range(4) for t in range(6) if mask[i, t]]
    threshold = naive_quantile(counted, 1 - quantile)
    expected = torch.tensor([[1.0 if mask[i, t] and entropy[i, t] >= threshold else 0.0 for t in range(6)]
                             for i in range(4)])
    torch.testing.assert_close(keep, expected)
    assert keep.sum() >= 1 and (keep <= mask).all()
    assert grpo.high_entropy_mask(entropy, torch.zeros(4, 6), quantile).sum() == 0


def test_off_policy_mask_drops_negative_advantage_sequences_far_from_the_sampler():
    logp, _, _, mask = make_batch()
    shift = torch.tensor([[0.5], [0.5], [0.05], [0.5]])  # mean sampler - policy log-prob per sequence
    sampler = logp + shift
    adv = torch.tensor([1.5, -0.5, -1.0, 0.0])
    keep = grpo.off_policy_mask(adv[:, None], logp, sampler, mask, 0.1)
    # kept: positive advantage (0), low divergence (2), zero advantage (3); dropped: negative and far (1)
    torch.testing.assert_close(keep, torch.tensor([[1.0], [0.0], [1.0], [1.0]]))


def test_kept_tokens_mask_the_policy_term_not_the_kl_or_normalisers():
    logp0, old, ref, adv, mask = objective_case()
    keep = (torch.rand(4, 6, generator=torch.Generator().manual_seed(6)) > 0.4).float()
    for loss_type in ("grpo", "dapo"):
        a = logp0.clone().requires_grad_()
        loss, _ = grpo.grpo_loss(a, old, ref, adv, mask, keep=keep, **loss_kwargs(loss_type=loss_type,
                                                                                    num_tokens=mask.sum()))
        loss.backward()
        b = logp0.clone().requires_grad_()
        expected = naive_objective(b, old, ref, adv, mask, loss_type, keep=keep)
        expected.backward()
        torch.testing.assert_close(loss, expected)
        torch.testing.assert_close(a.grad, b.grad)


def test_decoupled_rewards_match_trls_normalize_then_sum():
    g = torch.Generator().manual_seed(7)
    parts = torch.stack([torch.randint(0, 2, (12,), generator=g).double(), torch.rand(12, generator=g).double() * 5], 1)
    parts[4:8, 0] = 1.0  # one function flat in one group: it adds nothing there
    weights = [1.0, 0.3]
    summed = grpo.decoupled_rewards(parts, weights, 4)
    adv, _ = grpo.group_advantages(summed, 4, "batch")
    # TRL: (x - group mean) / (group std + 1e-4) per function, the weighted sum, then (s - mean) / (std + 1e-4)
    grouped = parts.view(3, 4, 2)
    per_func = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)
    s = (per_func.view(12, 2) * torch.tensor(weights, dtype=torch.float64)).sum(1)
    expected = (s - s.mean()) / (s.std() + 1e-4)
    torch.testing.assert_close(adv.double(), expected, atol=1e-5, rtol=1e-5)


def test_decoupled_rewards_keep_flat_groups_at_zero_and_unscored_as_nan():
    parts = torch.tensor([[1.0, 0.5]] * 4 + [[0.0, 1.0], [1.0, 0.0], [float("nan"), float("nan")], [1.0, 1.0]],
                         dtype=torch.float64)
    summed = grpo.decoupled_rewards(parts, [1.0, 1.0], 4)
    assert (summed[:4] == 0).all() and torch.isnan(summed[6]) and not torch.isnan(summed[[4, 5, 7]]).any()
    adv, _ = grpo.group_advantages(summed, 4, "batch")
    assert (adv[:4] == 0).all() and adv[6] == 0 and torch.isfinite(adv).all()


@pytest.mark.parametrize("chunk", [3, 64])  # several chunks (recomputed), and one
def test_entropy_gradient_matches_autograd_through_full_logits(chunk):
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(10, 16, generator=g)
    weight = torch.randn(40, 16, generator=g) * 0.5
    targets = torch.randint(0, 40, (10,), generator=g)
    gl, ge = torch.randn(10, generator=g), torch.randn(10, generator=g)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, entropy = logprobs._ChunkedTokenLogprobs.apply(h1, w1, targets, 0.7, chunk, True)
    ((logp * gl).sum() + (entropy * ge).sum()).backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lsm = torch.log_softmax(h2 @ w2.t() / 0.7, -1)
    naive_logp, naive_entropy = lsm.gather(-1, targets[:, None])[:, 0], -(lsm.exp() * lsm).sum(-1)
    ((naive_logp * gl).sum() + (naive_entropy * ge).sum()).backward()
    torch.testing.assert_close(entropy, naive_entropy.detach())
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-5, rtol=1e-4)


def test_entropy_bonus_is_minus_coef_times_the_batch_mean_entropy():
    logp0, old, ref, adv, mask = objective_case()
    entropy = (torch.rand(4, 6, generator=torch.Generator().manual_seed(9)) + 0.5).requires_grad_()
    logp = logp0.clone().requires_grad_()
    with_bonus, _ = grpo.grpo_loss(logp, old, ref, adv, mask, entropy=entropy,
                                   **loss_kwargs(num_tokens=mask.sum(), entropy_coef=0.05))
    without, _ = grpo.grpo_loss(logp0.clone(), old, ref, adv, mask, **loss_kwargs(num_tokens=mask.sum()))
    counted = [entropy[i, t] for i in range(4) for t in range(6) if mask[i, t]]
    torch.testing.assert_close(with_bonus, without - 0.05 * sum(counted) / len(counted))
    with_bonus.backward()
    torch.testing.assert_close(entropy.grad, -0.05 * mask / mask.sum())


@pytest.mark.parametrize("shape", ["token", "sequence"])
def test_vespo_puts_the_importance_weight_inside_its_sequence_ratio(shape):
    """An importance weight pi_old / pi_sampler is part of VESPO's w (as TRL folds vLLM's ratio into it), not a
    factor on the term: the loss equals the one whose pi_old is divided by the weight, token by token (or, for
    one weight per sequence, on one of its tokens)."""
    logp0, old, ref, adv, mask = objective_case(seed=2)
    g = torch.Generator().manual_seed(3)
    w = torch.rand(4, 6 if shape == "token" else 1, generator=g) + 0.5
    shifted = old - (w.log() * mask if shape == "token" else F.pad(w.log(), (0, 5)))
    kw = loss_kwargs(loss_type="vespo", beta=0.0, num_tokens=mask.sum())
    a = logp0.clone().requires_grad_()
    loss, _ = grpo.grpo_loss(a, old, None, adv, mask, is_weight=w, **kw)
    loss.backward()
    b = logp0.clone().requires_grad_()
    expected, _ = grpo.grpo_loss(b, shifted, None, adv, mask, **kw)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(a.grad, b.grad)
    plain, _ = grpo.grpo_loss(logp0, old, None, adv, mask, **kw)
    assert not torch.allclose(plain, loss)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask"])
def test_vespo_weight_equals_trls(mode):
    """VESPO's gamma weight against TRL 1.16's own (GRPOTrainer.get_gamma_weights), importance weights included
    (TRL's token modes); skipped where TRL is not installed (it is a bench-only dependency)."""
    trl = pytest.importorskip("trl")
    logp0, old, _, adv, mask = objective_case(seed=5)
    w = grpo.importance_weights(old, old + 0.3 * torch.randn(4, 6, generator=torch.Generator().manual_seed(6)), mask,
                                mode, 0.5, 1.5)
    logp = logp0.clone().requires_grad_()
    term = grpo.vespo_term(logp, old, adv[:, None], mask, k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0,
                           is_weight=w)
    phi = trl.GRPOTrainer.get_gamma_weights(adv[:, None], logp0 - old, mask, w, 2.0, 3.0, 3.0, 2.0)
    torch.testing.assert_close(term, -phi * adv[:, None] * logp0, rtol=0, atol=0)
