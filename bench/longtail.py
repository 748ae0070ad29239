"""The bench's longtail row: rows that end at long-tailed lengths, decoded by the same number of places in batches
one after another (the sampler's batches: each drains while its longest row runs on) and streaming through them
(`--rollouts_in_flight`: a place whose row ended takes the next row), against those places decoding full rows.
Then whole steps of train.py on such rows with a reward that takes 20 ms a completion, in four modes: (a) today's
synchronous step, (b) rows streaming through a quarter as many places, scored as their groups land, (c) and (d)
the same with the sampler working 1 and 2 steps ahead (--max_staleness)."""

import dataclasses
import heapq
import math
import random
import time

import torch

import model_loading
import rollouts
import sampling
from features import sampler_options
import sharding
import train
from bench.common import letter_prompts, load, medians


def long_tailed_lengths(n, limit, median, sigma, seed=0):
    """n completion lengths, log-normal with this median and sigma, between 1 and `limit`.

    Reasoning completions are long-tailed: most are short and a few run on for many times the median. The
    defaults (median 46, sigma 1.0, limit 512) give the shape this sampler was measured on before on CPU (mean 81,
    median 46, longest 432 of 512, over 64 rows); the bench's 64 rows (seed 0) have mean 85, median 44 and one row
    at the limit. A synthetic shape, not a published run's lengths.
    """
    rng = random.Random(seed)
    return [min(limit, max(1, round(median * math.exp(rng.gauss(0.0, sigma))))) for _ in range(n)]


@dataclasses.dataclass(frozen=True)
class EndAt(sampling.Draw):
    """A draw that ends each row at a length of its own: at a row's key for its last position (`ends`) the token is
    `stop`, which the draw never picks anywhere else. Keys are a row's own (row_keys(seed, position)), so a row ends
    at the same length in any batch or place."""
    ends: object = None
    stop: int = 0

    def whole(self, logits, keys):
        tok, logp = super().whole(logits, keys)
        tok = torch.where(tok == self.stop, (self.stop + 1) % logits.shape[-1], tok)
        return torch.where(torch.isin(keys, self.ends), self.stop, tok), logp


def bench_longtail(path, s, device):
    tokenizer = model_loading.load_tokenizer(path)
    model = load(path, s, device).eval()
    places, n, limit = s["lt_places"], s["lt_places"] * s["lt_rows_per_place"], s["lt_max_new_tokens"]
    lengths = long_tailed_lengths(n, limit, s["lt_median"], s["lt_sigma"])
    enc = letter_prompts(tokenizer, n, s["decode_prompt_len"], device)
    seeds = torch.arange(n, device=device)
    stop = tokenizer.eos_token_id
    ends = sampling.row_keys(seeds, torch.tensor(lengths, device=device) - 1)
    draw = EndAt(ends=ends, stop=stop)
    common = dict(max_new_tokens=limit, eos_ids=[stop], pad_id=tokenizer.pad_token_id, draw=draw)

    def batches(**kw):  # the synchronous sampler's way: `places` rows at a time, each until its longest row ends
        return rollouts.cat_rollouts([
            sampler_options.sample(model, enc.input_ids[a:a + places], enc.attention_mask[a:a + places],
                            seeds=seeds[a:a + places], **common, **kw) for a in range(0, n, places)],
            tokenizer.pad_token_id)

    def streaming(**kw):
        return sampler_options.sample(model, enc.input_ids, enc.attention_mask, seeds=seeds, in_flight=places, **common, **kw)

    full_length = max(1, round(sum(lengths) / places))  # as many tokens as the long-tailed rows, every place busy

    def full():  # the same draw (its stop tokens end nothing here), so that both pay for it alike
        return sampler_options.sample(model, enc.input_ids[:places], enc.attention_mask[:places], seeds=seeds[:places],
                               max_new_tokens=full_length, eos_ids=[], pad_id=tokenizer.pad_token_id, draw=draw)

    # the same two on the model's own forward (hf_decoder.HFDecoder), the path of models not written out
    own = dict(batches_own_forward=lambda: batches(static_cache=False),
               streaming_own_forward=lambda: streaming(static_cache=False))
    a, b = batches(), streaming()
    got = b.completion_mask.sum(1).tolist()
    assert got == lengths, "the rows did not end at their lengths"
    assert torch.equal(a.completion_ids, b.completion_ids), "streaming changed the completions"
    assert torch.equal(own["streaming_own_forward"]().completion_ids, a.completion_ids), "own forward: other tokens"
    med = medians({"batches": batches, "streaming": streaming, "full": full, **own}, s, device)
    tokens = sum(lengths)
    out = {"longtail_lengths": dict(rows=n, places=places, mean=tokens / n, median=sorted(lengths)[n // 2],
                                    longest=max(lengths), limit=limit),
           "longtail_full_tokens_per_s": places * full_length / med["full"]}
    for mode, rollout in (("batches", a), ("streaming", b)):
        out[f"longtail_{mode}_tokens_per_s"] = tokens / med[mode]
        out[f"longtail_{mode}_vs_full"] = out[f"longtail_{mode}_tokens_per_s"] / out["longtail_full_tokens_per_s"]
        out[f"longtail_{mode}_slots_busy"] = (rollout.policy_mask.sum() / rollout.held_steps.sum()).item()
    out["longtail_streaming_speedup_vs_batches"] = med["batches"] / med["streaming"]
    out["longtail_own_forward_streaming_speedup_vs_batches"] = \
        med["batches_own_forward"] / med["streaming_own_forward"]
    # the most any schedule of these rows can keep the places busy when the step waits for its last row: the
    # iterations of full rows over the iterations the longest row alone needs, where it is longer (only rows carried
    # over to a later step, which this row does not run, go past that)
    out["longtail_bound_vs_full"] = min(1.0, full_length / max(lengths))
    # the most a schedule that takes the rows in their queue's order can: it does not know a row's length before
    # the row ends, and a place is given to the next row at a check (every 8 tokens, `sample`'s default)
    out["longtail_queue_bound_vs_full"] = full_length / queue_iterations(lengths, places, 8)
    return out


def queue_iterations(lengths, places, check_every):
    """The iterations `places` places need for rows of these lengths taken in order, each place given to the next
    row at the first check after its row ended (list scheduling)."""
    free, end = [0] * places, 0
    for n in lengths:
        start = heapq.heappop(free)
        heapq.heappush(free, start + -(-n // check_every) * check_every)
        end = max(end, start + n)
    return end


def slow_reward(prompts, completions, **_):
    """A reward that takes lt_reward_ms a completion (a sandboxed program, a judge): scored one group at a time as
    rows land, or the whole batch after the last row."""
    time.sleep(slow_reward.seconds * len(completions))
    return [float(len(c) % 3) for c in completions]


def step_modes(s):
    """{mode: train.py settings} of the four step modes, each against (a) in the same run."""
    rows = s["lt_step_prompts"] * s["lt_step_generations"]
    places = rows // s["lt_rows_per_place"]  # four times as many rows queued as places, by default
    return {"a_sync": dict(rollouts_in_flight=0), "b_stream": dict(rollouts_in_flight=places),
            "c_stale1": dict(rollouts_in_flight=places, max_staleness=1),
            "d_stale2": dict(rollouts_in_flight=places, max_staleness=2)}


class LongTailedStep:
    """train.train_step on the bench's model, every row ending at its own long-tailed length (EndAt, keyed on the
    run's own row seeds, so every mode's step s samples the same rows), scored by `slow_reward`."""

    def __init__(self, path, s, device, root, mode, settings, steps):
        cfg = train.Config(model=path, device=str(device), model_init_kwargs={"dtype": s["dtype"],
                           "attn_implementation": "sdpa"}, task="next_letter", out_dir=f"{root}/{mode}",
                           prompts_per_step=s["lt_step_prompts"], num_generations=s["lt_step_generations"],
                           max_completion_length=s["lt_max_new_tokens"], max_prompt_length=32, beta=s["beta"],
                           micro_batch_size=s["micro_batch"], lr=s["lr"], save_every=0, max_steps=steps,
                           print_completions_every=0, check_model=False, **settings)
        train.validate(cfg)
        self.run = run = train.setup(cfg, sharding.Dist(rank=0, local_rank=0, world_size=1, device=device))
        run.task.reward_funcs[:], run.weights[:] = [slow_reward], [1.0]
        n = cfg.prompts_per_step * cfg.num_generations
        seeds = torch.arange(n * steps, device=device) + (cfg.seed * 1_000_003 + 1) * n  # steps 1.. (train.rollout)
        lengths = long_tailed_lengths(len(seeds), cfg.max_completion_length, s["lt_median"], s["lt_sigma"], seed=1)
        self.ends = sampling.row_keys(seeds, torch.tensor(lengths, device=device) - 1)
        self.stop, self.step_no, self.times, self.metrics = run.eos_ids[0], 0, [], []

    def __call__(self):
        self.step_no += 1
        of = sampling.Draw.of
        sampling.Draw.of = classmethod(lambda cls, cfg, temperature=None: EndAt(ends=self.ends, stop=self.stop))
        try:
            t = time.perf_counter()
            metrics, _ = train.train_step(self.run, self.step_no)
            self.times.append(time.perf_counter() - t)
        finally:
            sampling.Draw.of = of
        self.metrics.append(metrics)


def bench_longtail_steps(path, s, device, root, full_tokens_per_s=None):
    """Steps/s, completion tokens/s and decode places busy of each mode, and each against (a)'s; the modes' steps
    alternate, so a machine's drift touches all alike. A stream's first steps fill it: the first lt_warmup_steps
    of each mode are not timed. With `full_tokens_per_s` (the decode row's places decoding full rows), each mode's
    completion tokens over the seconds its steps waited for the sampler, against it: how near full rows the
    long-tailed ones decode."""
    slow_reward.seconds = s["lt_reward_ms"] / 1000
    warm, reps = s["lt_warmup_steps"], s["lt_step_reps"]
    modes = {m: LongTailedStep(path, s, device, root, m, kw, warm + reps + 4) for m, kw in step_modes(s).items()}
    for i in range(warm + reps):
        for step in modes.values():
            step()
    out = {}
    for m, step in modes.items():
        timed = step.metrics[warm:]
        seconds = sum(step.times[warm:])
        tokens = sum(x["completion_length"] for x in timed) * s["lt_step_prompts"] * s["lt_step_generations"]
        out[f"longtail_{m}_steps_per_s"] = reps / seconds
        out[f"longtail_{m}_tokens_per_s"] = tokens / seconds
        out[f"longtail_{m}_slots_busy"] = sum(x.get("slots_busy", 0.0) for x in timed) / reps
        out[f"longtail_{m}_reward"] = sum(x["reward"] for x in timed) / reps
        wait = sum(x.get("generation_wait_s", x["generation_time"]) for x in timed)
        out[f"longtail_{m}_generation_wait_s"] = wait / reps
        if full_tokens_per_s:
            out[f"longtail_{m}_decode_vs_full"] = tokens / wait / full_tokens_per_s
    for m in modes:
        out[f"longtail_{m}_vs_a"] = out[f"longtail_{m}_steps_per_s"] / out["longtail_a_sync_steps_per_s"]
    return out
