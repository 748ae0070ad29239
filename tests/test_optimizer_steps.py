"""Several optimizer steps per generated batch (steps_per_generation's mini-batches), a reference that follows
the policy (sync_ref_model) and adaptive entropy control: each against its rule written out, and resumed exactly."""

import copy
import os

import pytest
import torch

import grpo

import logprobs
import sharding
import train
from test_train import run_train


@pytest.mark.parametrize("args, world, key", [
    (["--prompts_per_step=3", "--num_generations=2", "--steps_per_generation=4"], 1, "steps_per_generation"),
    (["--prompts_per_step=3", "--num_generations=2", "--steps_per_generation=2"], 2, "steps_per_generation"),
    (["--sync_ref_model=true", "--beta=0"], 1, "sync_ref_model"),
    (["--sync_ref_model=true", "--lora_rank=4"], 1, "sync_ref_model"),
])
def test_mini_batches_and_reference_sync_check_what_they_need(args, world, key):
    """6 completions: not 4 mini-batches, nor 2 on each of 2 processes; a reference to sync needs one of its own."""
    with pytest.raises(SystemExit) as e:
        train.validate(train.parse_config(args), world_size=world)
    assert str(e.value.code).startswith(f"config error: --{key}: ") and "\n" not in str(e.value.code)
    train.validate(train.parse_config(["--prompts_per_step=3", "--num_generations=2", "--steps_per_generation=3"]),
                   world_size=2)  # 6 = 2 processes x 3 mini-batches x 1 row


def test_mini_batch_rows_do_not_depend_on_the_number_of_processes():
    """Mini-batch j is the global rows i % 4 == j whether 1, 2 or 4 processes hold the 16 rows, each rank holding
    as many rows of each."""
    for world in (1, 2, 4):
        n = 16 // world
        per_rank = [logprobs.mini_batch_rows(n, rank * n, 4) for rank in range(world)]
        assert all(len(rows) == n // 4 for mine in per_rank for rows in mine)
        for j in range(4):
            assert torch.cat([rank * n + mine[j] for rank, mine in enumerate(per_rank)]).tolist() == list(range(j, 16, 4))


@pytest.mark.parametrize("settings", [dict(loss_type="grpo", importance_sampling="token_truncate"),
                                      dict(loss_type="dapo", top_entropy_quantile=0.6)])
def test_mini_batches_match_sequential_optimizer_steps_on_their_rows_alone(tmp_path, settings):
    """steps_per_generation=2 with num_iterations=2: train.update's four optimizer steps against a naive loop
    over mini-batches (rows 0, 2, 4, 6, then 1, 3, 5, 7, twice), each loss written out on full logits over its
    rows alone (its own normalisers and entropy quantile), pi_old and the importance weights from the weights
    that sampled, and the linear learning-rate schedule counting optimizer steps. The weights after each step
    agree (each gradient at the trainer's weights before its step), and the sampler/trainer difference is the one
    measured before the update."""
    import copy
    import sharding
    from test_objective import naive_importance_weights, naive_loss
    cfg = train.Config(device="cpu", out_dir=str(tmp_path), prompts_per_step=2, num_generations=4,
                       max_completion_length=5, micro_batch_size=3, num_iterations=2, steps_per_generation=2,
                       beta=0.1, temperature=0.7, lr=1e-2, lr_schedule="linear", max_steps=1, save_every=0,
                       importance_sampling_min=0.7, importance_sampling_max=1.3, **settings)
    run = train.setup(cfg, sharding.Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    batch = run.rollout(run, 1)
    r = batch.rollout
    noise = torch.randn(r.logprobs.shape, generator=torch.Generator().manual_seed(0)) * 0.3 * r.completion_mask
    r.logprobs = r.logprobs + noise  # a sampler that disagrees with the trainer: some weights clip
    adv = torch.randn(8, generator=torch.Generator().manual_seed(1))
    lm = run.policy.lm
    init = copy.deepcopy(lm)
    grads, after = [], []  # the gradient each optimizer step applies, the weights after it
    real_step = run.optimizer.step

    def recording_step(*a, **k):
        grads.append([p.grad.clone() for p in lm.parameters()])
        out = real_step(*a, **k)
        after.append([p.detach().clone() for p in lm.parameters()])
        return out
    run.optimizer.step = recording_step
    sums, _, lr, skipped = train.update(run, batch, adv, 1)
    lp_diff_max = sums["max/lp_diff"]
    assert len(after) == 4 and skipped == 0 and lr == pytest.approx(1e-2 * 0.25)  # the last of 4 steps, linear to 0

    ids = torch.cat([batch.prompt_ids, r.completion_ids], 1)
    mask = torch.cat([batch.prompt_mask, torch.ones_like(r.completion_ids)], 1)
    t = r.completion_ids.shape[1]

    def naive_logp(model):  # and the entropy, from full logits
        logits = model(input_ids=ids, attention_mask=mask, position_ids=logprobs.position_ids_from_mask(mask)).logits
        logp_all = torch.log_softmax(logits[:, -t - 1:-1].float() / 0.7, -1)
        return logp_all.gather(-1, ids[:, -t:, None])[..., 0], -(logp_all.exp() * logp_all).sum(-1)
    loss_mask = r.completion_mask.float()
    with torch.no_grad():
        old, old_entropy = naive_logp(init)  # the weights that sampled
    ref = old
    w = torch.ones(8, t)
    if cfg.importance_sampling != "none":
        w = naive_importance_weights(old, r.logprobs, loss_mask, cfg.importance_sampling, 0.7, 1.3)
        assert ((w > 0.7) & (w < 1.3)).any() and ((w <= 0.7) | (w >= 1.3)).any()
    model = copy.deepcopy(init)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0)
    for k in range(4):  # pass k // 2, mini-batch k % 2: the rows i % 2 == k % 2
        rows = torch.arange(k % 2, 8, 2)
        m = loss_mask[rows]
        for group in opt.param_groups:
            group["lr"] = 1e-2 * (1 - k / 4)
        with torch.no_grad():  # from the trainer's weights before this step: rounding does not add up over steps
            for p, v in zip(model.parameters(), after[k - 1] if k else init.parameters()):
                p.copy_(v)
        model.zero_grad()
        logp, entropy = naive_logp(model)
        keep = torch.ones_like(m)
        if cfg.top_entropy_quantile < 1:  # over this mini-batch's counted tokens, at the weights that sampled
            threshold = torch.quantile(old_entropy[rows][m > 0], 1 - cfg.top_entropy_quantile)
            keep = (entropy[rows].detach() >= threshold).float()
            if k == 0:  # later, at other weights, all may fall below it
                whole = torch.quantile(old_entropy[loss_mask > 0], 1 - cfg.top_entropy_quantile)
                assert 0 < (keep * m).sum() < m.sum()
                assert ((old_entropy[rows] >= whole) * m).sum() != (keep * m).sum()  # the whole batch's would differ
        naive_loss(logp[rows], old[rows], ref[rows], adv[rows], m, 0.1, 0.2, 0.2, cfg.loss_type, 5,
                   is_weight=w[rows] * keep).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for p, g in zip(model.parameters(), grads[k]):
            torch.testing.assert_close(g, p.grad, atol=1e-6, rtol=1e-4)
        opt.step()
        # Adam divides each gradient by its running size: a component near 0 can move by up to lr on rounding
        # alone, so the weights agree to a tenth of the learning rate (the gradients above, tightly)
        for p, q in zip(model.parameters(), after[k]):
            torch.testing.assert_close(q, p.detach(), atol=1e-3, rtol=0)
    assert all((a - b).abs().max() > 1e-3 for a, b in zip(after[3], init.parameters()))  # every tensor moved
    counted = r.completion_mask.bool()
    torch.testing.assert_close(sums["lp_diff_sum"] / sums["lp_diff_tokens"], noise.abs()[counted].mean(), atol=1e-4,
                               rtol=1e-3)
    torch.testing.assert_close(lp_diff_max, noise.abs().max(), atol=1e-4, rtol=1e-3)
    assert sums["tokens"] == loss_mask.sum()  # the last pass counted every token once


def test_one_mini_batch_takes_the_old_log_probs_from_its_first_pass(tmp_path, monkeypatch):
    """steps_per_generation=1 runs no forward beyond the passes' (the first is pi_old); 2 runs one without
    gradient for every micro-batch before the first optimizer step."""
    import sharding
    forwards = {"grad": 0, "no_grad": 0}
    real = logprobs.completion_logprobs

    def counting(*a, **k):
        forwards["grad" if torch.is_grad_enabled() else "no_grad"] += 1
        return real(*a, **k)
    monkeypatch.setattr(logprobs, "completion_logprobs", counting)
    for mini, expected in ((1, {"grad": 2 * 3, "no_grad": 0}), (2, {"grad": 2 * 4, "no_grad": 4})):
        cfg = train.Config(device="cpu", out_dir=str(tmp_path / str(mini)), prompts_per_step=2, num_generations=4,
                           micro_batch_size=3, num_iterations=2, steps_per_generation=mini, beta=0, save_every=0)
        run = train.setup(cfg, sharding.Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
        batch = run.rollout(run, 1)
        forwards.update(grad=0, no_grad=0)
        train.update(run, batch, torch.randn(8, generator=torch.Generator().manual_seed(1)), 1)
        assert forwards == expected, mini  # micro-batches of 3 rows: 3 of the 8 rows, 2 of each 4-row mini-batch


def test_sync_ref_model_mixes_the_policy_into_the_reference(tmp_path):
    """Two optimizer steps per step, a sync every 3 counted over the run: none in step 1; in step 2, after its
    first optimizer step (the run's third), reference = alpha * that policy + (1 - alpha) * the initial weights;
    in step 3, after its second (the sixth), alpha * policy + (1 - alpha) * the previous reference."""
    import sharding
    alpha = 0.3
    cfg = train.Config(device="cpu", out_dir=str(tmp_path), prompts_per_step=2, num_generations=4,
                       max_completion_length=4, steps_per_generation=2, sync_ref_model=True, ref_model_sync_steps=3,
                       ref_model_mixup_alpha=alpha, lr=1e-2, save_every=0, max_steps=3)
    run = train.setup(cfg, sharding.Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))

    def weights(model):
        return {k: v.detach().clone() for k, v in model.named_parameters()}
    init = weights(run.ref)
    assert init.keys() == weights(run.policy).keys()
    policy_after = []  # the policy's weights after each optimizer step
    real_step = run.optimizer.step

    def recording_step(*a, **k):
        out = real_step(*a, **k)
        policy_after.append(weights(run.policy))
        return out
    run.optimizer.step = recording_step
    m1, _ = train.train_step(run, 1)
    assert all(torch.equal(v, init[k]) for k, v in weights(run.ref).items())
    m2, _ = train.train_step(run, 2)
    expected = {k: alpha * policy_after[2][k] + (1 - alpha) * init[k] for k in init}
    for k, v in weights(run.ref).items():
        torch.testing.assert_close(v, expected[k], atol=1e-7, rtol=1e-6, msg=k)
        assert not torch.equal(policy_after[2][k], policy_after[3][k])  # the third step's policy, not the fourth's
    m3, _ = train.train_step(run, 3)
    expected = {k: alpha * policy_after[5][k] + (1 - alpha) * expected[k] for k in init}
    for k, v in weights(run.ref).items():
        torch.testing.assert_close(v, expected[k], atol=1e-7, rtol=1e-6, msg=k)
    assert not run.ref.training and not any(p.requires_grad for p in run.ref.parameters())
    assert [m["ref_syncs"] for m in (m1, m2, m3)] == [0, 1, 2]


def test_resume_with_a_synced_reference_is_exact(tmp_path, monkeypatch):
    """The reference's weights are state once they are synced: 4 steps straight give the metrics and weights
    of 2 steps, a stop and the same command again (the checkpoint of step 2 holds a synced reference, which
    step 3's KL reads). A checkpoint without a reference does not resume a run that syncs one."""
    flags = ["--steps_per_generation=2", "--sync_ref_model=true", "--ref_model_sync_steps=3", "--lr=1e-2",
             "--save_every=2", "--prompts_per_step=4"]
    straight, _, a = run_train(tmp_path / "a", monkeypatch, "--max_steps=4", *flags)
    run_train(tmp_path / "b", monkeypatch, "--max_steps=2", *flags)
    resumed, _, b = run_train(tmp_path / "b", monkeypatch, "--max_steps=4", *flags)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4] and resumed[-1]["ref_syncs"] == 2
    timing = {"step_time", "generation_time", "update_time", "reward_time", "tokens_per_s"}
    for x, y in zip(straight, resumed):
        assert {k: v for k, v in x.items() if k not in timing} == {k: v for k, v in y.items() if k not in timing}
    from safetensors.torch import load_file
    wa, wb = (load_file(os.path.join(d, "model", "model.safetensors")) for d in (a, b))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)

    run_train(tmp_path / "c", monkeypatch, "--max_steps=2", *flags[:1], *flags[3:])  # saved without sync_ref_model
    with pytest.raises(SystemExit) as e:
        run_train(tmp_path / "c", monkeypatch, "--max_steps=4", *flags, "--resume=force")
    assert "no reference model in it (saved by a run without sync_ref_model)" in str(e.value.code)


@pytest.mark.parametrize("target, start, high, final", [(10.0, 0.01, 1.0, 0.05), (0.0, 0.012, 1.0, 0.0),
                                                        (10.0, 0.01, 0.022, 0.022)],
                         ids=["below-target", "above-target", "at-the-bound"])
def test_adaptive_entropy_control_follows_its_rule(tmp_path, target, start, high, final):
    """use_adaptive_entropy: the coefficient each optimizer step applies (seen by grpo_loss) and the one it ends
    with, against the controller written out over the entropies of the tokens each optimizer step counted."""
    import sharding
    cfg = train.Config(device="cpu", out_dir=str(tmp_path), prompts_per_step=2, num_generations=4,
                       max_completion_length=4, micro_batch_size=2, num_iterations=2, steps_per_generation=2,
                       entropy_coef=start, use_adaptive_entropy=True, entropy_target=target, entropy_coef_delta=0.005,
                       entropy_coef_max=high, save_every=0)
    run = train.setup(cfg, sharding.Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    steps = [[]]  # per optimizer step: (coefficient applied, entropy sum, tokens) of each micro-batch
    loss, opt_step = grpo.grpo_loss, run.optimizer.step

    def recording_loss(logp, old, ref, adv, mask, objective, **kw):
        steps[-1].append((objective.entropy_coef, (kw["entropy"] * mask).sum().item(), mask.sum().item()))
        return loss(logp, old, ref, adv, mask, objective, **kw)

    def recording_step(*a, **k):
        steps.append([])
        return opt_step(*a, **k)
    grpo.grpo_loss, run.optimizer.step = recording_loss, recording_step
    try:
        for step in (1, 2):
            metrics, _ = train.train_step(run, step)
    finally:
        grpo.grpo_loss = loss
    steps = steps[:-1]
    assert len(steps) == 8 and all(len(s) >= 2 for s in steps)
    coef, last = start, None
    for micro in steps:
        applied = coef if last is not None and last <= target else 0.0
        assert [c for c, _, _ in micro] == [applied] * len(micro)
        last = sum(e for _, e, _ in micro) / sum(t for _, _, t in micro)
        coef = min(max(coef + (0.005 if last <= target else -0.005), 0.0), high)
    assert run.entropy_coef == pytest.approx(coef) and metrics["entropy_coef"] == run.entropy_coef
    assert run.last_entropy == pytest.approx(last)
    assert coef == pytest.approx(final)


def test_resume_with_adaptive_entropy_is_exact(tmp_path, monkeypatch):
    """The controlled coefficient and the last entropy are state: saved with a checkpoint and taken up again."""
    flags = ["--use_adaptive_entropy=true", "--entropy_target=10", "--entropy_coef_delta=0.01", "--lr=1e-2",
             "--save_every=2", "--prompts_per_step=4"]
    straight, _, _ = run_train(tmp_path / "a", monkeypatch, "--max_steps=4", *flags)
    run_train(tmp_path / "b", monkeypatch, "--max_steps=2", *flags)
    resumed, _, _ = run_train(tmp_path / "b", monkeypatch, "--max_steps=4", *flags)
    assert [m["entropy_coef"] for m in resumed] == [m["entropy_coef"] for m in straight]
    assert straight[-1]["entropy_coef"] == pytest.approx(0.04)
    assert [m["loss"] for m in resumed] == [m["loss"] for m in straight]


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_the_learning_rate_warms_up_then_follows_its_schedule(schedule):
    """lr_factor against the formulas written out step by step: (s + 1) / warm-up during the warm-up, then 1, the
    line from 1 down to 0, or half a cosine period from 1 to 0 over the remaining optimizer steps."""
    import math
    from config import Config
    cfg, total = Config(lr_schedule=schedule, warmup_steps=3), 13
    for s in range(total + 2):
        if s < 3:
            want = (s + 1) / 3
        else:
            done = min(1.0, (s - 3) / 10)
            want = {"constant": 1.0, "linear": 1.0 - done, "cosine": (1.0 + math.cos(math.pi * done)) / 2}[schedule]
        assert train.lr_factor(cfg, s, total) == pytest.approx(max(0.0, want), abs=1e-12), (schedule, s)
