"""The bench's longtail row: rows that end at long-tailed lengths, decoded by the same number of places in batches
one after another (the sampler's batches: each drains while its longest row runs on) and streaming through them
(`--rollouts_in_flight`: a place whose row ended takes the next row), against those places decoding full rows."""

import dataclasses
import math
import random

import torch

import model_loading
import sampling
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

    def batches():  # the synchronous sampler's way: `places` rows at a time, each batch until its longest row ends
        return sampling.cat_rollouts([
            sampling.sample(model, enc.input_ids[a:a + places], enc.attention_mask[a:a + places],
                            seeds=seeds[a:a + places], **common) for a in range(0, n, places)], tokenizer.pad_token_id)

    def streaming():
        return sampling.sample(model, enc.input_ids, enc.attention_mask, seeds=seeds, in_flight=places, **common)

    full_length = max(1, round(sum(lengths) / places))  # as many tokens as the long-tailed rows, every place busy

    def full():
        return sampling.sample(model, enc.input_ids[:places], enc.attention_mask[:places], seeds=seeds[:places],
                               max_new_tokens=full_length, eos_ids=[], pad_id=tokenizer.pad_token_id)

    a, b = batches(), streaming()
    got = b.completion_mask.sum(1).tolist()
    assert got == lengths, "the rows did not end at their lengths"
    assert torch.equal(a.completion_ids, b.completion_ids), "streaming changed the completions"
    med = medians({"batches": batches, "streaming": streaming, "full": full}, s, device)
    tokens = sum(lengths)
    out = {"longtail_lengths": dict(rows=n, places=places, mean=tokens / n, median=sorted(lengths)[n // 2],
                                    longest=max(lengths), limit=limit),
           "longtail_full_tokens_per_s": places * full_length / med["full"]}
    for mode, rollout in (("batches", a), ("streaming", b)):
        out[f"longtail_{mode}_tokens_per_s"] = tokens / med[mode]
        out[f"longtail_{mode}_vs_full"] = out[f"longtail_{mode}_tokens_per_s"] / out["longtail_full_tokens_per_s"]
        out[f"longtail_{mode}_slots_busy"] = (rollout.policy_mask.sum() / rollout.held_steps.sum()).item()
    out["longtail_streaming_speedup_vs_batches"] = med["batches"] / med["streaming"]
    # the most any schedule of these rows can keep the places busy when the step waits for its last row: the
    # iterations of full rows over the iterations the longest row alone needs, where it is longer (only rows carried
    # over to a later step, which this row does not run, go past that)
    out["longtail_bound_vs_full"] = min(1.0, full_length / max(lengths))
    return out
