"""Sampling completions on the (sharded) policy: the sampler call behind each training step's rollout, and the
evaluation on held-out prompts built on it. The decode loop itself is grpo.sample."""

import torch

import grpo
import rewards
import sharding


def encode_prompts(tokenizer, prompts, cfg, device):
    """Left-padded prompt ids and mask; prompts longer than max_prompt_length keep their end."""
    return tokenizer(prompts, return_tensors="pt", padding=True, truncation=True, max_length=cfg.max_prompt_length,
                     add_special_tokens=False).to(device)


def generate(policy, tokenizer, prompt_ids, prompt_mask, seeds, temperature, cfg, d, eos_ids):
    """Sample one completion per row on the gathered weights; return the rollout and the completions' text.

    Rows are decoded `cfg.generation_batch_size` at a time (all at once when 0): the KV cache holds that
    many rows. A row draws the same random numbers whatever batch it is in (its own seed), so the setting
    changes memory and speed, not the completions (up to rounding, where bf16 logits depend on the batch
    size). Every rank has as many rows, so as many batches.
    """
    n = prompt_ids.shape[0]
    size = cfg.generation_batch_size or n
    parts = []
    with sharding.gathered(policy):  # full weights once for the whole decode loop
        for s in range(0, n, size):
            rows = slice(s, s + size)
            parts.append(policy(grpo.sample, prompt_ids[rows], prompt_mask[rows],
                                max_new_tokens=cfg.max_completion_length, eos_ids=eos_ids,
                                pad_id=tokenizer.pad_token_id, temperature=temperature, top_k=cfg.top_k,
                                top_p=cfg.top_p, seeds=seeds[rows], all_done=sharding.all_done_fn(d),
                                # the next batch reuses the weight copies and the cache
                                keep_decoder=s + size < n, attention_kernel=cfg.decode_attention_kernel))
    rollout = grpo.cat_rollouts(parts, tokenizer.pad_token_id)
    text = tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)  # padded after the first EOS
    return rollout, text


def evaluate(policy, tokenizer, task, weights, cfg, d, eos_ids):
    """Held-out prompts: greedy accuracy and reward (one completion each), then the mean over G samples each.

    The rows are split over the processes (the last rank's share padded with
    copies of the last row, dropped again), and the scores gathered: every rank
    samples the same number of rows, so all of them make the same collectives.
    """
    device = d.device
    rows = task.eval_rows
    if not rows:
        return {}
    was_training = policy.training
    policy.eval()
    results = {}
    for label, G, temperature in (("greedy", 1, 0.0), ("sampled", cfg.num_generations, cfg.temperature)):
        totals, correct = [], []
        comp = {}
        for start in range(0, len(rows), cfg.prompts_per_step):
            chunk = rows[start:start + cfg.prompts_per_step]
            count = len(chunk) * G
            per_rank = -(-count // d.world_size)
            # row i is prompt i // G; the padding rows copy the last row, seed included, so they sample alike
            index = list(range(count)) + [count - 1] * (per_rank * d.world_size - count)
            prompts = [chunk[i // G]["prompt"] for i in index]
            enc = encode_prompts(tokenizer, prompts, cfg, device)  # all rows: the same padding on every rank
            mine = slice(d.rank * per_rank, (d.rank + 1) * per_rank)
            fields = {k: [chunk[i // G][k] for i in index[mine]] for k in chunk[0] if k != "prompt"}
            # the same seeds at every evaluation: successive evaluations differ by the policy, not by luck
            seeds = torch.tensor(index[mine], device=device) + start * G + (cfg.seed + 7) * 1_000_003
            rollout, completions = generate(policy, tokenizer, enc.input_ids[mine], enc.attention_mask[mine], seeds,
                                            temperature, cfg, d, eos_ids)
            total, parts = rewards.score_completions(task.reward_funcs, weights, prompts[mine], completions, fields)
            totals.append(sharding.all_gather_rows(total, d)[:count])
            for k, v in parts.items():
                comp.setdefault(k, []).append(sharding.all_gather_rows(v, d)[:count])
            if task.accuracy_reward is not None:
                correct.append(comp[task.accuracy_reward][-1] >= 1.0)
        total = torch.cat(totals)
        suffix = "" if label == "sampled" else "_greedy"
        results[f"eval/reward{suffix}"] = total.nanmean().item()
        if correct:
            results[f"eval/accuracy{suffix}"] = torch.cat(correct).float().mean().item()
        if label == "sampled":
            results.update({f"eval/reward/{k}": torch.cat(v).nanmean().item() for k, v in comp.items()})
    policy.train(was_training)
    return results
