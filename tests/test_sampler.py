"""The hand-written sampler against model.generate and the training forward."""

import torch


import logprobs
import sampling


def encode(tokenizer, prompts):
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc.input_ids, enc.attention_mask


PROMPTS = ["a>", "the quick brown fox>", "é~7"]


def test_greedy_matches_generate(model, tokenizer):
    ids, mask = encode(tokenizer, PROMPTS)
    ours = sampling.sample(model, ids, mask, max_new_tokens=12, eos_ids=[-1], pad_id=tokenizer.pad_token_id,
                       draw=sampling.Draw(temperature=0))
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=None)[:, ids.shape[1]:]
    assert ref.unique().numel() > 3  # the model is not degenerate: the comparison means something
    assert torch.equal(ours.completion_ids, ref)


def test_left_padded_row_samples_as_alone(model, tokenizer):
    ids, mask = encode(tokenizer, PROMPTS)
    seeds = torch.tensor([11, 22, 33])
    batch = sampling.sample(model, ids, mask, max_new_tokens=10, eos_ids=[-1], pad_id=0, seeds=seeds)
    for i, p in enumerate(PROMPTS):
        one_ids, one_mask = encode(tokenizer, [p])
        alone = sampling.sample(model, one_ids, one_mask, max_new_tokens=10, eos_ids=[-1], pad_id=0, seeds=seeds[i:i + 1])
        assert torch.equal(batch.completion_ids[i], alone.completion_ids[0])
        torch.testing.assert_close(batch.logprobs[i], alone.logprobs[0], atol=1e-5, rtol=0)
    assert mask[0].sum() < mask.shape[1]  # row 0 really was padded


def _training_logprobs(model, ids, mask, rollout, temperature):
    full = torch.cat([ids, rollout.completion_ids], 1)
    full_mask = torch.cat([mask, torch.ones_like(rollout.completion_ids)], 1)
    with torch.no_grad():
        logp, _ = logprobs.completion_logprobs(model, full, full_mask, rollout.completion_ids.shape[1], temperature)
    return logp * rollout.completion_mask


def test_sampler_logprobs_equal_training_forward(model, tokenizer):
    ids, mask = encode(tokenizer, PROMPTS)
    for temperature in (1.0, 0.7):
        r = sampling.sample(model, ids, mask, max_new_tokens=16, eos_ids=[tokenizer.eos_token_id],
                        pad_id=tokenizer.pad_token_id, draw=sampling.Draw(temperature))
        train_logp = _training_logprobs(model, ids, mask, r, temperature)
        assert (train_logp - r.logprobs).abs().max() < 1e-5


def test_top_k_top_p_filter_matches_naive():
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    for k, p in [(5, 1.0), (0, 0.8), (10, 0.5), (0, 1.0)]:
        out = sampling.filter_logits(logits, k, p)
        for row, orow in zip(logits, out):
            order = row.argsort(descending=True).tolist()
            keep = set(order[:k] if k else order)
            probs = row.masked_fill(~torch.isin(torch.arange(50), torch.tensor(list(keep))), float("-inf")).softmax(-1)
            mass, nucleus = 0.0, set()
            for j in order:  # smallest set of top tokens whose (top-k renormalised) mass reaches p
                if mass >= p:
                    break
                nucleus.add(j)
                mass += probs[j].item()
            expected = keep & nucleus if p < 1 else keep
            assert set(torch.isfinite(orow).nonzero().flatten().tolist()) == expected


def test_sampled_tokens_follow_the_distribution():
    """Gumbel-max sampling with the counter-based noise reproduces the probabilities, tempered and filtered."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    logits = probs.clamp(min=1e-30).log().expand(40000, 5)
    keys = sampling.row_keys(torch.arange(40000), step=3)
    tok, _ = sampling.Draw(1.0, 0, 1.0).whole(logits, keys)
    freq = torch.bincount(tok, minlength=5).float() / 40000
    torch.testing.assert_close(freq, probs, atol=0.01, rtol=0)
    assert freq[4] == 0  # a zero-probability token is never drawn
    tok_k, _ = sampling.Draw(1.0, 2, 1.0).whole(logits, keys)  # top-2: only tokens 0 and 1, renormalised
    assert set(tok_k.tolist()) == {0, 1} and abs((tok_k == 0).float().mean() - 2 / 3) < 0.01
    tok_t, _ = sampling.Draw(0.5, 0, 1.0).whole(logits, keys)  # temperature 0.5: probabilities squared, renormalised
    tempered = probs ** 2 / (probs ** 2).sum()
    torch.testing.assert_close(torch.bincount(tok_t, minlength=5).float() / 40000, tempered, atol=0.01, rtol=0)


def test_rows_stop_at_first_eos_and_masks(model, tokenizer):
    eos = tokenizer.eos_token_id
    with torch.no_grad():  # make EOS likely, but not certain, so rows end at different times
        model.get_output_embeddings().weight[eos] *= 6
    ids, mask = encode(tokenizer, PROMPTS * 4)
    r = sampling.sample(model, ids, mask, max_new_tokens=12, eos_ids=[eos], pad_id=tokenizer.pad_token_id,
                    seeds=torch.arange(12))
    lengths = r.completion_mask.sum(1)
    assert lengths.unique().numel() > 1
    for row, m, trunc, lp in zip(r.completion_ids, r.completion_mask, r.truncated, r.logprobs):
        hits = (row == eos).nonzero().flatten().tolist()
        if hits:
            first = hits[0]
            assert m[:first + 1].all() and not m[first + 1:].any()
            assert (row[first + 1:] == tokenizer.pad_token_id).all()
            assert not trunc
        else:
            assert m.all() and trunc and len(row) == 12
        assert (lp[m == 0] == 0).all()


class Scripted(torch.nn.Module):
    """A stand-in causal LM that writes a fixed script: after the token at completion position j, row i's next
    token is script[i][j + 1] (the first, script[i][0], after the prompt), read from the position ids, so
    it follows each row's own position whatever the batch does. Prompts must be unpadded (position P = the
    first completion token)."""

    def __init__(self, config, prompt_len, script):
        super().__init__()
        self.config, self.prompt_len, self.script = config, prompt_len, torch.tensor(script)
        self.inputs = []  # (input_ids, position_ids) of every forward after the prefill

    def forward(self, input_ids, attention_mask, position_ids, past_key_values, use_cache, logits_to_keep=0):
        if input_ids.shape[1] != self.prompt_len or self.inputs:
            self.inputs.append((input_ids.clone(), position_ids.clone()))
        nxt = (position_ids - self.prompt_len + 1).clamp(0, self.script.shape[1] - 1)  # (N, K)
        want = self.script.gather(1, nxt)
        logits = torch.full((*input_ids.shape, self.config.vocab_size), -30.0)
        logits.scatter_(2, want[..., None], 30.0)
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return type("Out", (), {"logits": logits})


def test_mask_when_pad_is_eos(model, tokenizer):
    """The mask covers each completion up to and including its first EOS, also when the pad id is an EOS id."""
    eos = 5
    script = [[1, 2, 5, 5, 5], [5, 5, 5, 5, 5], [1, 2, 3, 4, 6]]
    ids = torch.full((3, 2), 40)
    r = sampling.sample(Scripted(model.config, 2, script), ids, torch.ones_like(ids), max_new_tokens=5,
                        eos_ids=[eos, 6], pad_id=eos, draw=sampling.Draw(temperature=0))  # two EOS ids
    assert r.completion_mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert r.completion_ids.tolist() == [[1, 2, 5, 5, 5], [5, 5, 5, 5, 5], [1, 2, 3, 4, 6]]
    assert torch.equal(r.policy_mask, r.completion_mask) and not r.truncated.any()


class EndsAt(torch.nn.Module):
    """A stand-in model whose row i emits EOS as its completion token number ends_at[i], else token 1."""

    def __init__(self, config, prompt_len, ends_at, eos):
        super().__init__()
        self.config, self.prompt_len, self.ends_at, self.eos = config, prompt_len, torch.tensor(ends_at), eos
        self.calls = 0

    def forward(self, input_ids, attention_mask, position_ids, past_key_values, use_cache, logits_to_keep=0):
        self.calls += 1
        generated = self.calls - 1  # tokens already sampled: one per decode step after the prefill
        logits = torch.zeros(input_ids.shape[0], 1, self.config.vocab_size)
        logits[:, :, 1] = 30.0
        logits[generated == self.ends_at, :, self.eos] = 60.0
        return type("Out", (), {"logits": logits})


def test_sampler_stops_once_every_row_is_done(model, tokenizer):
    ids, mask = encode(tokenizer, PROMPTS)
    eos = tokenizer.eos_token_id
    fake = EndsAt(model.config, ids.shape[1], [0, 5, 2], eos)
    r = sampling.sample(fake, ids, mask, max_new_tokens=64, eos_ids=[eos], pad_id=tokenizer.pad_token_id, check_every=4)
    # the last row ends at token 5; the loop notices at the next check (after token 8) and stops there: a
    # prefill and 7 decode steps; what rows sampled past their EOS is dropped (the longest row has 6 tokens)
    assert fake.calls == 8 and r.completion_ids.shape[1] == 6
    assert r.completion_mask.sum(1).tolist() == [1, 6, 3]
    assert not r.truncated.any()
    seen, fake.calls = [], 0  # a stop decision shared with other ranks keeps the loop going while any rank is busy
    r = sampling.sample(fake, ids, mask, max_new_tokens=20, eos_ids=[eos], pad_id=tokenizer.pad_token_id, check_every=4,
                    all_done=lambda done: seen.append(bool(done.all())) or False)
    assert fake.calls == 20 and seen == [False, True, True, True]
    assert r.completion_mask.sum(1).tolist() == [1, 6, 3]


def test_generation_batches_sample_what_one_batch_samples(model, tokenizer):
    """features/sampler_options.py's `generate` a few rows at a time: the same completions (own seeds) as the core's
    sampler of every row at once (sampling.sample_rows), padded to the longest batch; and with the run's
    shared_prompts (the 3 copies of each prompt prefilled once) too."""
    import types

    from features import sampler_options
    import rollouts
    import sampling
    import sharding
    prompts = PROMPTS * 3
    ids, mask = encode(tokenizer, prompts)
    seeds = torch.arange(len(prompts)) * 13 + 5
    d = sharding.Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    policy = sharding.Root(model)
    eos = [tokenizer.eos_token_id]
    with torch.no_grad():  # EOS likely, not certain: rows stop at varied lengths, batches after varied steps
        model.get_output_embeddings().weight[eos[0]] *= 5
    out = {}
    # (4, 0): batches of 4; (0, 4): rows streaming through 4 places; "shared": one prefill per distinct prompt
    for size, places, shared in ((0, 0, False), (4, 0, False), (0, 4, False), (0, 0, True)):
        cfg = types.SimpleNamespace(max_completion_length=9, top_k=0, top_p=1.0, generation_batch_size=size,
                                    rollouts_in_flight=places, decode_attention_kernel=False, shared_prompts=shared)
        if (size, places, shared) == (0, 0, False):  # the core's sampler: every row at once
            rows = rollouts.Rows(prompts, {}, slice(None), ids, mask, seeds)
            batch = sampling.sample_rows(policy, tokenizer, rows, sampling.Draw(), cfg, d, eos)
            out[size, places, shared] = batch.rollout, batch.completions
        else:
            out[size, places, shared] = sampler_options.generate(policy, tokenizer, ids, mask, seeds, sampling.Draw(),
                                                                 cfg, d, eos)
    whole, batched = out[0, 0, False][0], out[4, 0, False][0]
    for other in (out[0, 4, False], out[0, 0, True]):
        assert other[1] == out[0, 0, False][1]
        for k in ("completion_ids", "completion_mask", "policy_mask", "truncated", "turns"):
            assert torch.equal(getattr(other[0], k), getattr(whole, k)), k
        torch.testing.assert_close(other[0].logprobs, whole.logprobs, atol=1e-5, rtol=0)
    out = {size: out[size, 0, False] for size in (0, 4)}
    assert out[0][1] == out[4][1]  # the text
    lengths = whole.completion_mask.sum(1)
    assert lengths.unique().numel() > 2 and whole.truncated.any() != whole.truncated.all()
    t = whole.completion_ids.shape[1]
    assert batched.completion_ids.shape[1] == t  # padded to the longest batch, which holds the longest row
    # some batch of 4 stopped at the first check (all its rows ended within 8 tokens): it was padded
    assert any(not whole.truncated[s:s + 4].any() and lengths[s:s + 4].max() <= 8 for s in (0, 4, 8)), lengths
    assert torch.equal(batched.completion_ids, whole.completion_ids)
    assert torch.equal(batched.completion_mask, whole.completion_mask)
    assert torch.equal(batched.truncated, whole.truncated)
    torch.testing.assert_close(batched.logprobs, whole.logprobs, atol=1e-5, rtol=0)
    assert not hasattr(model, "_static_decoder") or "_static_decoder" not in model.__dict__  # freed at the end
