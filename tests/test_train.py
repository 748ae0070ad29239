"""The loop: config errors, micro-batching, the reference model, a short run that learns, the export."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import grpo

import logprobs
import sampling
import model_loading
import rewards
import tasks
from tasks import next_letter
from runs import setup as run_setup
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("arg, key", [
    ("--no_such_key=1", "no_such_key"), ("--num_generations=abc", "num_generations"),
    ("--num_generations=1", "num_generations"), ("--beta=-1", "beta"), ("--loss_type=ppo", "loss_type"),
    ("--model_init_kwargs=[1]", "model_init_kwargs"), ("--mask_truncated_completions=maybe", "mask_truncated_completions"),
    ("--top_p=0", "top_p"), ("--scale_rewards=std", "scale_rewards"), ("max_steps=3", "max_steps"),
    ("--lr=inf", "lr"), ("--beta=nan", "beta"), ("--max_grad_norm=-1", "max_grad_norm"),
    ("--adam_beta2=1.5", "adam_beta2"), ("--weight_decay=-1", "weight_decay"), ("--reward_weights=1,nan", "reward_weights"),
    ("--importance_sampling=tis", "importance_sampling"), ("--importance_sampling_max=0", "importance_sampling_max"),
    ("--micro_batch_tokens=-1", "micro_batch_tokens"), ("--importance_sampling_min=-1", "importance_sampling_min"),
    ("--importance_sampling_level=seq", "importance_sampling_level"), ("--delta=0.9", "delta"),
    ("--sapo_temperature_neg=0", "sapo_temperature_neg"), ("--top_entropy_quantile=1.5", "top_entropy_quantile"),
    ("--off_policy_mask_threshold=-1", "off_policy_mask_threshold"),
    ("--multi_objective_aggregation=gdpo", "multi_objective_aggregation"),
    ("--soft_punish_cache=9", "soft_punish_cache"), ("--steps_per_generation=0", "steps_per_generation"),
    ("--ref_model_mixup_alpha=1.5", "ref_model_mixup_alpha"), ("--ref_model_sync_steps=0", "ref_model_sync_steps"),
])
def test_bad_config_names_the_key(arg, key):
    with pytest.raises(SystemExit) as e:
        train.parse_config([arg])
    assert f"--{key}" in str(e.value.code)


def test_bad_config_exits_nonzero_from_the_command_line():
    p = subprocess.run([sys.executable, "train.py", "--num_generations=abc"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode != 0 and "--num_generations" in p.stderr


def test_config_casts_every_type():
    cfg = train.parse_config(["--lr=2e-4", "--num_generations=4", "--mask_truncated_completions=true",
                              '--model_init_kwargs={"dtype": "bfloat16"}', "--reward_weights=1,0.5",
                              "--epsilon_high=0.28", "--wandb_run_name=none"])
    assert cfg.lr == 2e-4 and cfg.num_generations == 4 and cfg.mask_truncated_completions is True
    assert cfg.model_init_kwargs == {"dtype": "bfloat16"} and cfg.reward_weights == [1.0, 0.5]
    assert cfg.epsilon_high == 0.28 and cfg.wandb_run_name is None


def test_fused_adamw_steps_like_the_per_tensor_loop():
    cfg = train.Config(lr=1e-2, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95)
    torch.manual_seed(0)
    start = [torch.randn(7, 5), torch.randn(5)]
    fast = [p.clone().requires_grad_() for p in start]
    slow = [p.clone().requires_grad_() for p in start]
    opt_fast = run_setup.make_optimizer(fast, cfg)
    assert opt_fast.defaults["fused"]  # CPU has the fused kernel
    opt_slow = torch.optim.AdamW(slow, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1, foreach=False)
    for step in range(5):
        grads = [torch.randn_like(p) * (step + 1) for p in start]
        for params, opt in ((fast, opt_fast), (slow, opt_slow)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    for a, b, s in zip(fast, slow, start):
        assert not torch.equal(a, s)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_batch_must_split_over_processes():
    cfg = train.parse_config(["--prompts_per_step=3", "--num_generations=3"])
    with pytest.raises(SystemExit, match="--prompts_per_step"):
        train.validate(cfg, world_size=2)


def assert_grad_close(actual, expected, scale=None):
    """Gradients equal to float32 rounding. The rounding of a sum is relative to the terms summed, and a
    gradient entry near zero is still a sum of terms on the scale of the gradient's largest entries: an
    absolute tolerance fixed in advance fails on such an entry as soon as the gradient is a few times larger
    (or a CPU orders its sums differently). So the absolute part is 1e-5 of that scale (the largest entry of
    `scale`, `expected` by default): about 80 float32 ulps, some ten times the largest difference these tests
    show, and far below what a wrong row, token or normaliser moves; the relative part holds the large
    entries to 1e-4 of themselves."""
    scale = (expected if scale is None else scale).abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5 * scale)


def rollout_batch(model, tokenizer, n_prompts=2, g=4, seed=0):
    prompts = [p for p in ["a>", "hello there>"][:n_prompts] for _ in range(g)]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    r = sampling.sample(model, enc.input_ids, enc.attention_mask, max_new_tokens=6, eos_ids=[tokenizer.eos_token_id],
                    pad_id=tokenizer.pad_token_id, seeds=torch.arange(len(prompts)) + seed)
    ids = torch.cat([enc.input_ids, r.completion_ids], 1)
    mask = torch.cat([enc.attention_mask, torch.ones_like(r.completion_ids)], 1)
    scores = torch.tensor([float(i % 3) for i in range(len(prompts))])
    adv, _ = grpo.group_advantages(scores, g)
    return ids, mask, r, adv


def accumulated_grad(model, ref_logp, ids, mask, r, adv, micro, loss_type):
    model.zero_grad()
    n, t = ids.shape[0], r.completion_ids.shape[1]
    cmask = r.completion_mask.float()
    for s in range(0, n, micro):
        sl = slice(s, s + micro)
        logp, _ = logprobs.completion_logprobs(model, ids[sl], mask[sl], t, chunk_tokens=5)
        loss, _ = grpo.grpo_loss(logp, logp.detach(), ref_logp[sl], adv[sl], cmask[sl], grpo.Objective(
            beta=0.1, epsilon=0.2, loss_type=loss_type, max_completion_length=6), num_sequences=n,
            num_tokens=cmask.sum())
        loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def naive_full_batch_grad(model, ref_logp, ids, mask, r, adv, loss_type, counted=None, temperature=1.0):
    """One forward over everything, full logits, log_softmax + gather, the loss written out.

    counted: the completion tokens the loss counts (N, T); the completion mask by default.
    """
    model.zero_grad()
    t = r.completion_ids.shape[1]
    pos = logprobs.position_ids_from_mask(mask)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -t - 1:-1].float() / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, -t:, None])[..., 0]
    d = ref_logp - logp
    ratio, a = torch.exp(logp - logp.detach()), adv[:, None]  # on-policy: ratio 1, nothing clipped
    if loss_type == "cispo":  # the weight min(ratio, epsilon_high = 0.2), detached
        policy_term = -0.2 * a * logp
    elif loss_type == "vespo":  # the gamma weight of the ratio 1 is 1
        policy_term = -a * logp
    elif loss_type == "sapo":
        tau = torch.where(a > 0, 1.0, 1.05)
        policy_term = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * a
    else:
        policy_term = -a * ratio
    per_token = policy_term + 0.1 * (torch.exp(d) - d - 1)
    m = r.completion_mask.float() if counted is None else counted
    if loss_type in ("grpo", "sapo"):
        loss = ((per_token * m).sum(1) / m.sum(1).clamp(min=1)).mean()  # a row with nothing counted adds 0
    elif loss_type in ("dapo", "bnpo", "cispo", "vespo"):
        loss = (per_token * m).sum() / m.sum()
    elif loss_type == "luspo":
        loss = (per_token * m).sum() / ids.shape[0]
    else:
        loss = (per_token * m).sum() / (ids.shape[0] * 6)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_micro_batch_split_gives_the_same_gradient(model, tokenizer, loss_type):
    ids, mask, r, adv = rollout_batch(model, tokenizer)
    with torch.no_grad():
        ref_logp = logprobs.completion_logprobs(model, ids, mask, r.completion_ids.shape[1])[0] + 0.05
    whole = accumulated_grad(model, ref_logp, ids, mask, r, adv, 8, loss_type)
    split = accumulated_grad(model, ref_logp, ids, mask, r, adv, 2, loss_type)
    naive = naive_full_batch_grad(model, ref_logp, ids, mask, r, adv, loss_type)
    assert whole.abs().max() > 0
    assert_grad_close(split, whole)
    assert_grad_close(naive, whole)


# Rows 0-3 have a short left-padded prompt (2 tokens), rows 4-7 a long one (12: the prompt columns); row 5
# counts no token (as a masked truncated completion), so it sorts last and needs no prompt column. Columns
# needed, prompt + counted completion: rows 0-7 need 8 3 5 8 | 14 0 17 16. A micro-batch keeps the columns
# of its longest prompt and longest completion; its forward runs its longest row's need less 1 (width).
MICRO_BATCH_CASES = {
    # 3 rows each, longest first (stable)
    "rows": (dict(size=3), [[6, 7, 4], [0, 3, 2], [1, 5]], [5, 6, 1], [(0, 17), (10, 18), (10, 13)], [16, 7, 2]),
    # at most 40 positions (rows x width) each: 2 x 16, 3 x 13, 3 x 4
    "tokens": (dict(size=3, max_tokens=40), [[6, 7], [4, 0, 3], [2, 1, 5]], [5, 6, 3], [(0, 17), (0, 18), (10, 15)],
               [16, 13, 4]),
    # 26 positions: row 0 joins row 4 (2 x 13) only because the width counts, not prompt 12 + completion 6
    "tokens 26": (dict(size=3, max_tokens=26), [[6], [7], [4, 0], [3, 2, 1], [5]], [5, 4, 6, 6, 1],
                  [(0, 17), (0, 16), (0, 18), (10, 18), (11, 13)], [16, 15, 13, 7, 1]),
    # then split to 5 micro-batches (as under several processes): the largest halved, columns and width kept
    "tokens, split": (dict(size=3, max_tokens=40, split=5), [[6, 7], [4], [0, 3], [2], [1, 5]], [5, 6, 6, 3, 3],
                      [(0, 17), (0, 18), (0, 18), (10, 15), (10, 15)], [16, 13, 13, 4, 4]),
    # a budget below every row's length: one row each
    "tiny budget": (dict(size=3, max_tokens=3), [[6], [7], [4], [0], [3], [2], [1], [5]], [5, 4, 2, 6, 6, 3, 1, 1],
                    [(0, 17), (0, 16), (0, 14), (10, 18), (10, 18), (10, 15), (10, 13), (11, 13)],
                    [16, 15, 13, 7, 7, 4, 2, 1]),
}


@pytest.mark.parametrize("case", MICRO_BATCH_CASES)
@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_length_sorted_trimmed_micro_batches_give_the_same_gradient(model, tokenizer, loss_type, case):
    """The trainer's micro-batches (rows sorted by length, padding columns dropped; by row count or by
    token budget) against one naive pass."""
    ids, mask, r, adv = rollout_batch(model, tokenizer)
    n, t = ids.shape[0], r.completion_ids.shape[1]
    lengths = torch.tensor([6, 1, 3, 6, 2, 0, 5, 4])  # counted completion tokens per row
    counted = (torch.arange(t)[None] < lengths[:, None]).float()
    temperature = 0.7
    with torch.no_grad():
        ref_logp = logprobs.completion_logprobs(model, ids, mask, t, temperature)[0] + 0.05
    kwargs, rows, ts, cols, widths = MICRO_BATCH_CASES[case]
    kwargs = dict(kwargs)
    split = kwargs.pop("split", None)
    micro = logprobs.micro_batches(mask, counted, t, **kwargs)
    if split:
        micro = logprobs.split_micro_batches(micro, split)
    assert sorted(torch.cat([m.rows for m in micro]).tolist()) == list(range(n))  # every row exactly once
    assert [m.rows.tolist() for m in micro] == rows
    assert [m.t for m in micro] == ts
    assert [(m.cols.start, m.cols.stop) for m in micro] == cols
    assert [m.width for m in micro] == widths
    model.zero_grad()
    for m in micro:
        logp, _ = logprobs.completion_logprobs(model, *m.take(ids, mask), m.t, temperature, chunk_tokens=5, width=m.width)
        loss, _ = grpo.grpo_loss(logp, logp.detach(), ref_logp[m.rows, :m.t], adv[m.rows], counted[m.rows, :m.t],
                                 grpo.Objective(beta=0.1, epsilon=0.2, loss_type=loss_type, max_completion_length=6),
                                 num_sequences=n, num_tokens=counted.sum())
        loss.backward()
    trimmed = torch.cat([p.grad.flatten() for p in model.parameters()])
    naive = naive_full_batch_grad(model, ref_logp, ids, mask, r, adv, loss_type, counted, temperature)
    assert trimmed.abs().max() > 0
    assert_grad_close(trimmed, naive)


@pytest.mark.parametrize("rows", [slice(0, 8), slice(4, 8)], ids=["left-padded", "unpadded"])
def test_chunked_logprobs_equal_full_log_softmax(model, tokenizer, rows):
    ids, mask, r, _ = rollout_batch(model, tokenizer)
    ids, mask = ids[rows], mask[rows]
    assert bool(mask.all()) == (rows.start == 4)  # rows 4..7 hold the longest prompt: no padding
    t = r.completion_ids.shape[1]
    for temperature in (1.0, 0.6):
        logits = model(input_ids=ids, attention_mask=mask,
                       position_ids=logprobs.position_ids_from_mask(mask)).logits[:, -t - 1:-1].float() / temperature
        full = torch.log_softmax(logits, -1)
        expected = full.gather(-1, ids[:, -t:, None])[..., 0]
        entropy = -(full.exp() * full).sum(-1)
        for chunk in (1, 7, 1000):
            logp, ent = logprobs.completion_logprobs(model, ids, mask, t, temperature, chunk_tokens=chunk)
            torch.testing.assert_close(logp, expected, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ent, entropy, atol=1e-5, rtol=1e-5)


def run_train(tmp_path, monkeypatch, *args):
    """train.main in-process; returns (metrics rows, {'policy': ..., 'ref': ..., 'ref_init': ...})."""
    seen = {}
    load, build_ref = model_loading.load_model, model_loading.build_reference_model

    def load_spy(*a, **k):
        seen["policy"] = load(*a, **k)
        seen["init"] = {k: v.clone() for k, v in seen["policy"].state_dict().items()}
        return seen["policy"]

    def ref_spy(policy, beta):
        seen["ref"] = build_ref(policy, beta)
        return seen["ref"]
    monkeypatch.setattr(model_loading, "load_model", load_spy)
    monkeypatch.setattr(model_loading, "build_reference_model", ref_spy)
    out = str(tmp_path / "run")
    train.main([f"--out_dir={out}", "--print_completions_every=0", *args])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return rows, seen, out


def test_reference_model_is_frozen_and_beta_zero_builds_none(tmp_path, monkeypatch):
    rows, seen, _ = run_train(tmp_path, monkeypatch, "--max_steps=3", "--lr=1e-2")
    ref, policy = seen["ref"], seen["policy"]
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())
    assert next(ref.parameters()).device == next(policy.parameters()).device
    for k, v in ref.state_dict().items():
        assert torch.equal(v, seen["init"][k]), k  # unchanged by the optimizer steps
    assert any(not torch.equal(v, seen["init"][k]) for k, v in policy.state_dict().items())
    assert rows[-1]["kl"] > 0

    rows, seen, _ = run_train(tmp_path / "b0", monkeypatch, "--max_steps=1", "--beta=0")
    assert seen["ref"] is None and rows[0]["kl"] == 0


def test_rerunning_a_finished_run_says_so(tmp_path, monkeypatch, capsys):
    run_train(tmp_path, monkeypatch, "--max_steps=2", "--save_every=1")
    assert "done: steps 1-2 in" in capsys.readouterr().out
    rows, _, out = run_train(tmp_path, monkeypatch, "--max_steps=2", "--save_every=1")  # the same command again
    printed = capsys.readouterr().out
    assert f"done: {out} already holds step 2 of 2; no step left to run" in printed and "reward first" not in printed
    assert [r["step"] for r in rows] == [1, 2]
    rows, _, _ = run_train(tmp_path, monkeypatch, "--max_steps=3", "--save_every=1")  # one more step
    assert "done: steps 3-3 in" in capsys.readouterr().out and [r["step"] for r in rows] == [1, 2, 3]


def test_group_of_64_with_micro_batches_of_4(tmp_path, monkeypatch):
    def odd_length(prompts, completions, **_):  # a reward with spread at initialisation
        return [float(len(c.encode()) % 2) for c in completions]
    monkeypatch.setattr(tasks, "get_task", lambda name, **_: tasks.Task(next_letter.prompts, [odd_length], name=name))
    rows, _, _ = run_train(tmp_path, monkeypatch, "--max_steps=1", "--num_generations=64", "--prompts_per_step=1",
                           "--micro_batch_size=4", "--loss_type=dapo")
    assert rows[0]["step"] == 1 and rows[0]["grad_norm"] > 0 and 0 < rows[0]["reward"] < 1


def test_short_default_run_learns_and_exports(tmp_path, monkeypatch):
    rows, seen, out = run_train(tmp_path, monkeypatch, "--max_steps=100")
    expected = {"step", "reward", "reward/next_letter_reward", "reward_std", "frac_reward_zero_std", "loss", "kl",
                "clip_low", "clip_high", "entropy", "completion_length", "completion_length_min",
                "completion_length_max", "truncated_frac", "grad_norm", "lr", "step_time", "tokens_per_s",
                "sampler_logprob_diff_mean", "sampler_logprob_diff_max"}
    assert all(expected <= set(r) for r in rows) and [r["step"] for r in rows] == list(range(1, 101))
    if seen["policy"].device.type == "cpu":  # float32: the sampler and the training forward agree to rounding
        assert all(0 <= r["sampler_logprob_diff_mean"] <= r["sampler_logprob_diff_max"] < 1e-4 for r in rows)
    first = sum(r["reward"] for r in rows[:10]) / 10
    last = sum(r["reward"] for r in rows[-10:]) / 10
    assert first < 0.05 and last > 0.2, (first, last)

    policy = seen["policy"].eval()  # on CUDA where there is one: the default device is auto
    exported = AutoModelForCausalLM.from_pretrained(os.path.join(out, "model")).eval()  # on CPU
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        same_device = policy.device.type == "cpu"
        torch.testing.assert_close(exported(ids).logits, policy(ids.to(policy.device)).logits.cpu(),
                                   **({} if same_device else dict(atol=1e-3, rtol=1e-3)))


@pytest.mark.parametrize("importance_sampling,compiled", [("none", False), ("token_truncate", False),
                                                          ("sequence_mask", True)])
def test_update_matches_a_naive_multi_iteration_update(tmp_path, request, importance_sampling, compiled):
    """train.update with mu = 2, token-budget micro-batches, importance weights and the bias-corrected KL,
    against the objective written out on full logits: the gradient each optimizer step applies, with the old
    log-probs from a separate forward at the sampling weights, and the sampler/trainer difference it reports.
    One case with compile_layers (traced, see conftest.traced_layers)."""
    traced = request.getfixturevalue("traced_layers") if compiled else None
    import copy
    import sharding
    cfg = train.Config(device="cpu", out_dir=str(tmp_path), prompts_per_step=2, num_generations=4,
                       max_completion_length=5, micro_batch_size=3, micro_batch_tokens=30, num_iterations=2,
                       beta=0.1, temperature=0.7, use_bias_correction_kl=True, importance_sampling=importance_sampling,
                       importance_sampling_min=0.7, importance_sampling_max=1.3, save_every=0, compile_layers=compiled)
    run = train.setup(cfg, sharding.Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    batch = run.rollout(run, 1)
    r = batch.rollout
    sampled = r.logprobs.clone()
    noise = torch.randn(sampled.shape, generator=torch.Generator().manual_seed(0)) * 0.3 * r.completion_mask
    r.logprobs = sampled + noise  # a sampler that disagrees with the trainer: some weights clip
    adv = torch.randn(8, generator=torch.Generator().manual_seed(1))
    lm = run.policy.lm
    init = copy.deepcopy(lm)
    steps = []  # (weights, gradient) at each optimizer step
    real_step = run.optimizer.step

    def recording_step(*a, **k):
        steps.append(([p.detach().clone() for p in lm.parameters()], [p.grad.clone() for p in lm.parameters()]))
        return real_step(*a, **k)
    run.optimizer.step = recording_step
    sums, *_ = train.update(run, batch, adv, 1)
    lp_diff_max = sums["max/lp_diff"]
    assert len(steps) == 2
    assert traced is None or len(traced) >= 1  # the compiled layer ran

    ids = torch.cat([batch.prompt_ids, r.completion_ids], 1)
    mask = torch.cat([batch.prompt_mask, torch.ones_like(r.completion_ids)], 1)
    t = r.completion_ids.shape[1]

    def naive_logp(model):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=logprobs.position_ids_from_mask(mask)).logits
        return torch.log_softmax(logits[:, -t - 1:-1].float() / 0.7, -1).gather(-1, ids[:, -t:, None])[..., 0]
    loss_mask = r.completion_mask.float()
    with torch.no_grad():
        old = naive_logp(init)
        ref = naive_logp(init)
    if importance_sampling == "none":
        w = torch.ones(8, 1)
    else:
        from test_objective import naive_importance_weights
        w = naive_importance_weights(old, r.logprobs, loss_mask, importance_sampling, 0.7, 1.3)
        assert ((w > 0.7) & (w < 1.3)).any() and ((w <= 0.7) | (w >= 1.3)).any()
    from test_objective import naive_loss
    model = copy.deepcopy(init)
    for weights, applied in steps:
        with torch.no_grad():
            for p, v in zip(model.parameters(), weights):
                p.copy_(v)
        model.zero_grad()
        logp = naive_logp(model)
        naive_loss(logp, old, ref, adv, loss_mask, 0.1, 0.2, 0.2, "grpo", 5, is_weight=w,
                   bias_correction_kl=True).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        # the whole gradient's scale: a small tensor's entries are still sums of terms of that size
        scale = torch.cat([p.grad.flatten() for p in model.parameters()])
        for p, g in zip(model.parameters(), applied):
            assert_grad_close(g, p.grad, scale)
    assert any(g.abs().max() > 0 for g in steps[1][1])
    # the reported sampler/trainer difference is the noise added to the sampler's log-probs
    counted = r.completion_mask.bool()
    gap = (old - sampled).abs()[counted]
    assert gap.max() < 1e-4  # float32: the sampler's own log-probs agree with the training forward
    torch.testing.assert_close(sums["lp_diff_sum"] / sums["lp_diff_tokens"], noise.abs()[counted].mean(), atol=1e-4,
                               rtol=1e-3)
    torch.testing.assert_close(lp_diff_max, noise.abs().max(), atol=1e-4, rtol=1e-3)
    if importance_sampling != "none":  # the weights' extremes over the counted tokens, against the naive weights'
        counted_w = w.expand_as(loss_mask)[loss_mask.bool()]
        torch.testing.assert_close(-sums["max/-is_weight"], counted_w.min(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sums["max/is_weight"], counted_w.max(), atol=1e-5, rtol=1e-5)
    else:
        assert "max/is_weight" not in sums


def test_rewards_see_the_trajectory_ids_and_step_and_a_gdpo_step_runs(tmp_path):
    """train.score hands each reward function the completions' token ids (no padding) and the step; with
    normalize_then_sum a step runs (its advantages: tests/test_objective.py)."""
    import sharding
    cfg = train.Config(device="cpu", out_dir=str(tmp_path), prompts_per_step=2, num_generations=4,
                       max_completion_length=4, soft_punish_cache=2, multi_objective_aggregation="normalize_then_sum",
                       save_every=0, max_steps=1)
    run = train.setup(cfg, sharding.Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    seen = {}

    def recorder(prompts, completions, completion_ids, step, **_):
        seen.update(ids=completion_ids, step=step)
        return [float(len(c)) for c in completions]
    run.task.reward_funcs[:] = [recorder, rewards.soft_overlong_punishment]
    run.weights[:] = [1.0, 0.5]
    batch = run.rollout(run, 3)
    total, parts, _ = train.score(run, batch, 3)
    r = batch.rollout
    assert seen["step"] == 3
    assert seen["ids"] == [r.completion_ids[i, :int(r.completion_mask[i].sum())].tolist() for i in range(8)]
    lengths = r.completion_mask.sum(1).tolist()
    assert parts["soft_overlong_punishment"].tolist() == [0.0 if n <= 2 else (2 - n) / 2 for n in lengths]
    metrics, _ = train.train_step(run, 1)
    assert math.isfinite(metrics["loss"])


@pytest.mark.parametrize("settings", [
    dict(loss_type="sapo", importance_sampling_level="sequence"),
    dict(loss_type="cispo", epsilon_high=1.5, top_entropy_quantile=0.5),
    dict(loss_type="luspo", importance_sampling_level="sequence", off_policy_mask_threshold=0.05, delta=1.5),
    dict(loss_type="dapo", entropy_coef=0.1),
])
def test_update_with_other_objectives_matches_one_full_batch_loss(tmp_path, settings):
    """train.update's micro-batched gradient (three micro-batches) equals grpo_loss on the whole batch at once,
    for the other policy terms, levels, token selections (the entropy quantile over the whole batch) and the
    entropy bonus."""
    import copy
    import sharding
    cfg = train.Config(device="cpu", out_dir=str(tmp_path), prompts_per_step=2, num_generations=4,
                       max_completion_length=5, micro_batch_size=3, beta=0.1, save_every=0, **settings)
    run = train.setup(cfg, sharding.Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    batch = run.rollout(run, 1)
    r = batch.rollout
    r.logprobs = r.logprobs + torch.randn(r.logprobs.shape, generator=torch.Generator().manual_seed(0)) * 0.3 \
        * r.completion_mask  # a sampler that disagrees: the off-policy mask drops some sequences
    adv = torch.randn(8, generator=torch.Generator().manual_seed(1))
    init = copy.deepcopy(run.policy.lm)
    grads = []
    real_step = run.optimizer.step

    def recording_step(*a, **k):
        grads.append([p.grad.clone() for p in run.policy.lm.parameters()])
        return real_step(*a, **k)
    run.optimizer.step = recording_step
    sums, *_ = train.update(run, batch, adv, 1)
    ids = torch.cat([batch.prompt_ids, r.completion_ids], 1)
    mask = torch.cat([batch.prompt_mask, torch.ones_like(r.completion_ids)], 1)
    t = r.completion_ids.shape[1]
    logp, entropy = logprobs.completion_logprobs(init, ids, mask, t, 1.0, entropy_grad=cfg.entropy_coef != 0)
    with torch.no_grad():
        ref = logprobs.completion_logprobs(init, ids, mask, t, 1.0)[0]
    loss_mask = r.policy_mask.float()
    keep = None
    if cfg.top_entropy_quantile < 1:  # the quantile over the whole batch's counted tokens
        keep = grpo.high_entropy_mask(entropy.detach(), loss_mask, cfg.top_entropy_quantile)
    if cfg.off_policy_mask_threshold is not None:
        keep = grpo.off_policy_mask(adv[:, None], logp, r.logprobs, loss_mask, cfg.off_policy_mask_threshold)
        assert 0 < keep.sum() < keep.numel()
    loss, _ = grpo.grpo_loss(logp, logp.detach(), ref, adv, loss_mask, grpo.Objective(
        beta=0.1, epsilon=0.2, epsilon_high=cfg.epsilon_high or 0.2, loss_type=cfg.loss_type, max_completion_length=5,
        importance_sampling_level=cfg.importance_sampling_level, delta=cfg.delta, entropy_coef=cfg.entropy_coef),
        num_sequences=8, num_tokens=loss_mask.sum(), keep=keep, entropy=entropy)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(init.parameters(), 1.0)
    scale = torch.cat([p.grad.flatten() for p in init.parameters()])
    for p, g in zip(init.parameters(), grads[0]):
        assert_grad_close(g, p.grad, scale)
    if keep is not None:  # the kept tokens the selection counted (features/token_selection.py: kept_frac)
        assert sum(run.select_tokens.__self__.kept.values()) == (keep * loss_mask).sum()


def test_entropy_threshold_is_the_quantile_over_every_ranks_counted_tokens(monkeypatch):
    """Two ranks simulated: this one's counted tokens (two micro-batches) and another rank's, of another count,
    gathered NaN-padded; the threshold is the quantile over all of them."""
    import types
    import sharding
    g = torch.Generator().manual_seed(3)
    entropy = torch.rand(4, 3, generator=g)  # this rank's (n, T)
    loss_mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]]).float()
    others = torch.rand(9, generator=g)  # the other rank's counted tokens: more than this rank's 6

    def fake_gather(x, d):
        if x.numel() == 1:
            return torch.cat([x, torch.tensor([others.numel()])])
        return torch.cat([x, others])  # the other rank: already `most` long, no padding
    monkeypatch.setattr(sharding, "all_gather_rows", fake_gather)
    micro = [logprobs.MicroBatch(torch.tensor([2, 0]), slice(0, 3), 3, 3), logprobs.MicroBatch(torch.tensor([1, 3]),
                                                                                        slice(0, 3), 3, 3)]
    run = types.SimpleNamespace(cfg=train.Config(top_entropy_quantile=0.3),
                                d=types.SimpleNamespace(world_size=2, device=torch.device("cpu")))
    from features import token_selection
    threshold = token_selection.entropy_threshold(run, [entropy[mb.rows] for mb in micro], micro, loss_mask)
    counted = torch.cat([entropy[loss_mask > 0], others])
    torch.testing.assert_close(threshold, torch.quantile(counted, 0.7))
