"""Rows streaming through fewer decode places than there are rows (`sampler_options.sample(in_flight=...)`, the run's
`--rollouts_in_flight`): when a row ends, its place takes the next row, whose prompt enters that place's cache
while the other rows keep theirs. Each row must sample what it samples with every row in one batch (its own
seed), one turn and several, on each kind of layer a place is emptied and refilled for: attention over a KV
cache (with sliding windows), MoE blocks, Gated DeltaNet states."""

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import architectures  # noqa: E402
import features.streaming  # noqa: E402
from features.stream_sampler import Stream  # noqa: E402
from test_multiturn import STOP_IDS, answering, multi_turn  # noqa: E402


def _one_of_each_kind():
    """The first written-out family of the tests' table for each kind of layer, and the first with windows."""
    chosen = {}
    for name, row in architectures.FAMILIES.items():
        if row.written_out:
            chosen.setdefault(row.layers, name)
            if "window" in row.features:
                chosen.setdefault("window", name)
    return sorted(set(chosen.values()))


@pytest.mark.parametrize("family", _one_of_each_kind())
@pytest.mark.parametrize("turns", [1, 3])
def test_streamed_rows_sample_what_one_batch_samples(family, turns):
    model, tok = architectures.tiny(family)
    text = ["a>", "hello world>", "xyz", "b>" * 7, "q", "the quick brown fox>"] * 2
    enc = tok(text, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():  # stops likely, not certain: rows end at varied lengths, some at the limit
        model.get_output_embeddings().weight[STOP_IDS] *= 2

    def run(**kw):
        respond = answering(lambda r, k: (r % 3) + 2 * k) if turns > 1 else None
        return multi_turn(model, tok, enc, max_turns=turns, respond=respond, **kw)
    whole = run()
    streamed = run(in_flight=4, keep_decoder=True)
    admitted = model.__dict__.pop("_static_decoder").admissions
    assert admitted == len(text) - 4  # every row past the first four took the place of one that ended
    lengths = whole.completion_mask.sum(1)
    assert lengths.unique().numel() > 1, lengths  # rows ended at different steps: places freed at different times
    if turns > 1:
        assert (whole.turns > 1).any()
    for k in ("completion_ids", "completion_mask", "policy_mask", "truncated", "turns"):
        assert torch.equal(getattr(streamed, k), getattr(whole, k)), k
    torch.testing.assert_close(streamed.logprobs, whole.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", [n for n in _one_of_each_kind()
                                    if architectures.FAMILIES[n].layers == "hybrid"
                                    or "window" in architectures.FAMILIES[n].features])
def test_rows_stream_on_the_models_own_forward(family, monkeypatch):
    """The same on the model's own forward (layers/hf_decoder.py), which every model the written-out decoder does
    not sample takes: a place takes its new row by forgetting its own (its columns holes, its recurrent states
    zero), a prompt's head runs on its row's cache alone, and ended rows and columns no row holds are dropped.
    Several turns, through `sample`'s places and through a Stream, on sliding windows and Gated DeltaNet states."""
    from layers import hf_decoder
    admitted, dropped, admit, drop = [0], [0], hf_decoder.HFDecoder.admit, hf_decoder.HFDecoder.pack

    def dropping(self):
        width = self.valid.shape[1]
        drop(self)
        dropped[0] += width - self.valid.shape[1]
    monkeypatch.setattr(hf_decoder.HFDecoder, "admit", lambda self, rows: (
        admitted.__setitem__(0, admitted[0] + len(rows)), admit(self, rows))[1])
    monkeypatch.setattr(hf_decoder.HFDecoder, "pack", dropping)
    model, tok = architectures.tiny(family)
    enc = tok(["a>", "hello world>", "xyz", "b>" * 7, "q", "the quick brown fox>"] * 2, return_tensors="pt",
              padding=True, add_special_tokens=False)
    with torch.no_grad():
        model.get_output_embeddings().weight[STOP_IDS] *= 2
    whole = multi_turn(model, tok, enc, static_cache=False)  # 3 turns, each call its own environment
    streamed = multi_turn(model, tok, enc, static_cache=False, in_flight=4)
    assert admitted[0] == len(enc.input_ids) - 4 and dropped[0] > 0
    assert (whole.turns > 1).any() and whole.completion_mask.sum(1).unique().numel() > 1
    for k in ("completion_ids", "completion_mask", "policy_mask", "truncated", "turns"):
        assert torch.equal(getattr(streamed, k), getattr(whole, k)), k
    torch.testing.assert_close(streamed.logprobs, whole.logprobs, atol=1e-5, rtol=0)
    stream_against_one_batch(family, torch.device("cpu"), turns=3, static_cache=False)


def test_groups_are_scored_as_they_land_while_decoding_goes_on(tmp_path, monkeypatch):
    """With rows streaming, each group's rewards are computed in a worker thread as soon as its last row ends, and
    equal one call over the whole batch; a failing reward names the completion's row in the batch."""
    import dataclasses
    import threading

    import sharding
    import train
    from layers import engine
    cfg = train.Config(device="cpu", out_dir=str(tmp_path), prompts_per_step=3, num_generations=4,
                       max_completion_length=12, rollouts_in_flight=2, save_every=0, max_steps=1,
                       check_model=False)
    run = train.setup(cfg, sharding.Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    calls, steps = [], [0]

    def sized(prompts, completions, **_):  # per completion, as reward functions are
        calls.append((len(completions), threading.current_thread().name))
        return [float(len(c) % 3) for c in completions]
    run.task.reward_funcs[:] = [sized, *run.task.reward_funcs]
    run.weights[:] = [0.5, *run.weights]
    decode = engine.StaticDecoder.decode
    monkeypatch.setattr(engine.StaticDecoder, "decode", lambda self, *a, **k: (steps.__setitem__(0, steps[0] + 1),
                                                                             decode(self, *a, **k))[1])
    landed = features.streaming.Landing.__call__
    submitted = []  # the decode steps done when each group was handed over
    monkeypatch.setattr(features.streaming.Landing, "__call__", lambda self, rows, ids: (submitted.append(steps[0]),
                                                                            landed(self, rows, ids))[1])
    batch = run.rollout(run, 3)
    assert batch.landing is not None and submitted and submitted[0] < steps[0]  # decoding went on after
    total, parts, _ = train.score(run, batch, 3)
    assert sorted(n for n, _ in calls) == [4, 4, 4] and all(name.startswith("rewards") for _, name in calls)
    want_total, want_parts, _ = train.score(run, dataclasses.replace(batch, landing=None), 3)
    assert torch.equal(total, want_total) and parts.keys() == want_parts.keys()
    assert all(torch.equal(parts[k], want_parts[k]) for k in parts)

    texts = batch.completions  # the same step draws the same completions again
    k = next(i for i in range(4, 12) if texts.count(texts[i]) == 1)  # a row past the first group

    def failing(prompts, completions, **_):
        if texts[k] in completions:
            raise ValueError("no score for this one")
        return [0.0] * len(completions)
    run.task.reward_funcs[:] = [failing]
    run.weights[:] = [1.0]
    with pytest.raises(SystemExit, match=f"on completion {k}: "):
        train.score(run, run.rollout(run, 3), 3)

    # a collective function (a reward model: every rank calls its forward together) scores the whole batch at the
    # step's take, in the step's own thread, the others as their groups land; it is called even where another
    # function failed on this rank, since the other ranks call it
    def judge(prompts, completions, **_):
        calls.append((len(completions), threading.current_thread().name))
        return [float(len(c)) for c in completions]
    judge.collective = True
    del calls[:]
    run.task.reward_funcs[:] = [sized, judge]
    run.weights[:] = [0.5, 2.0]
    batch = run.rollout(run, 3)
    total, parts, _ = train.score(run, batch, 3)
    assert sorted(calls) == [(4, "rewards_0")] * 3 + [(12, "MainThread")]
    want_total, want_parts, _ = train.score(run, dataclasses.replace(batch, landing=None), 3)
    assert torch.equal(total, want_total) and list(parts) == list(want_parts) == ["sized", "judge"]
    assert all(torch.equal(parts[k], want_parts[k]) for k in parts)
    del calls[:]
    run.task.reward_funcs[:] = [failing, judge]
    with pytest.raises(SystemExit, match=f"on completion {k}: "):
        train.score(run, run.rollout(run, 3), 3)
    assert calls == [(12, "MainThread")]


@pytest.mark.parametrize("static_cache", [True, False], ids=["written_out", "own_forward"])
def test_rows_stream_in_the_iterations_their_queue_order_needs(static_cache):
    """Streaming loses no iteration: rows of known lengths through 4 places take exactly the iterations of list
    scheduling in queue order, each place given to the next row at the first check after its row ended (the
    bench's bound, bench.longtail.queue_iterations), counted by the draws; one batch after another takes more."""
    import sampling
    from features import sampler_options
    from bench.longtail import EndAt, queue_iterations
    model, tok = architectures.tiny("qwen3")
    lengths = [5, 30, 9, 17, 2, 26, 12, 8, 21, 3, 14, 11]
    enc = _letters(tok)
    seeds, stop = torch.arange(len(lengths)), tok.eos_token_id
    draws = []

    class Counted(EndAt):
        def whole(self, logits, keys):
            draws.append(len(keys))
            return super().whole(logits, keys)
    draw = Counted(ends=sampling.row_keys(seeds, torch.tensor(lengths) - 1), stop=stop)

    def run(rows, **kw):
        return sampler_options.sample(model, enc.input_ids[rows], enc.attention_mask[rows], seeds=seeds[rows],
                               max_new_tokens=32, eos_ids=[stop], pad_id=tok.pad_token_id, draw=draw,
                               static_cache=static_cache, **kw)
    r = run(slice(0, len(lengths)), in_flight=4)
    assert r.completion_mask.sum(1).tolist() == lengths and max(draws) == 4
    assert len(draws) == -(-queue_iterations(lengths, 4, 8) // 8) * 8 == 56
    del draws[:]
    for a in range(0, len(lengths), 4):  # each batch until its longest row is found ended
        run(slice(a, a + 4))
    assert len(draws) == sum(-(-max(lengths[a:a + 4]) // 8) * 8 for a in range(0, len(lengths), 4)) == 88


# ----------------------------------------------------------------------------- rows in flight across steps


def _letters(tok):
    return tok(["a>", "hello world>", "xyz", "b>" * 7, "q", "the quick brown fox>"] * 3, return_tensors="pt",
               padding=True, add_special_tokens=False)


@pytest.mark.parametrize("family", _one_of_each_kind())
@pytest.mark.parametrize("turns", [1, 3])
def test_a_stream_samples_what_one_batch_samples(family, turns):
    """A Stream (--max_staleness's sampler) with rows added between runs, each run stopping when the rows asked
    for have ended while others are in the middle of theirs: at unchanged weights every row samples what `sample`
    samples for it in one batch, one turn or several (an environment answering rows' pauses, as an agent's tools
    do). The places are fewer than the rows, prompts are left-padded wider than the batch's, and rows are taken
    out of the order they were added in."""
    stream_against_one_batch(family, torch.device("cpu"), turns)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", _one_of_each_kind())
def test_a_stream_on_cuda_graphs_samples_what_one_batch_samples(family):
    """The same on CUDA, float32 with TF32 off, the stream's decode steps replayed as CUDA graphs (their spans
    start at slot 0 whatever the stream's first slot) against the one batch's."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        stream_against_one_batch(family, torch.device("cuda"))
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def stream_against_one_batch(family, device, turns=1, static_cache=True):
    import rollouts
    import sampling
    from features import sampler_options
    model, tok = architectures.tiny(family)
    model.to(device)
    enc = _letters(tok).to(device)
    with torch.no_grad():
        model.get_output_embeddings().weight[STOP_IDS] *= 2
    n, pad = enc.input_ids.shape[0], tok.pad_token_id
    seeds = torch.arange(n, device=device) * 7 + 3
    # several turns: row r's k-th pause is answered with (r % 3) + 2k tokens (each call its own record of pauses)
    asked = {"whole": [], "stream": []}
    respond = (lambda name: answering(lambda r, k: (r % 3) + 2 * k, asked[name])) if turns > 1 else (lambda _: None)
    longest = 24 * turns  # room for the answers
    whole = sampler_options.sample(model, enc.input_ids, enc.attention_mask, max_new_tokens=longest, eos_ids=STOP_IDS,
                            pad_id=pad, seeds=seeds, respond=respond("whole"), max_turns=turns,
                            static_cache=static_cache)
    ended = []
    stream = Stream(5, 24, enc.input_ids.shape[1] + 7, longest, STOP_IDS, pad, sampling.Draw(), device,
                             on_end=lambda tags, ids: ended.extend(zip(tags, ids)), respond=respond("stream"),
                             max_turns=turns, static_cache=static_cache)
    half = n // 2
    stream.add(enc.input_ids[:half], enc.attention_mask[:half], seeds[:half], list(range(half)))
    parts = []
    for version, (need, add) in enumerate([(range(0, 4), range(half, n)), (range(4, half), ()),
                                           (range(n - 1, half - 1, -1), ())]):
        if add:
            stream.add(enc.input_ids[list(add)], enc.attention_mask[list(add)], seeds[list(add)], list(add))
        stream.run(model, list(need), version)
        parts.append((list(need), stream.take(list(need))))
        assert (stream.rows.active[[stream.slot[t] for t in stream.in_flight()]]).any() or version == 2
    assert not stream.in_flight()
    order = [r for need, _ in parts for r in need]
    got = rollouts.cat_rollouts([r for _, r in parts], pad)
    want = rollouts.rollout_rows(whole, order)
    lengths = want.completion_mask.sum(1)
    assert lengths.unique().numel() > 3, lengths  # rows ended at many different steps
    assert torch.equal(got.truncated, want.truncated) and torch.equal(got.turns, want.turns)
    if turns > 1:  # the environment was asked the same turns, of the rows the stream's tags name
        assert (want.turns > 1).sum() > 3 and sorted(asked["stream"]) == sorted(asked["whole"])
    for k in ("completion_ids", "completion_mask", "policy_mask"):  # the parts padded as wide as the widest
        assert torch.equal(getattr(got, k)[:, :want.completion_ids.shape[1]], getattr(want, k)), k
    torch.testing.assert_close(got.logprobs[:, :want.logprobs.shape[1]], want.logprobs, atol=2e-5, rtol=0)
    # on_end: every row once, with its completion
    assert sorted(t for t, _ in ended) == list(range(n))
    assert all(ids == whole.completion_ids[t, :int(whole.completion_mask[t].sum())].tolist() for t, ids in ended)


@pytest.mark.parametrize("static_cache", [True, False], ids=["written_out", "own_forward"])
def test_a_row_decoding_through_a_weight_change_records_each_tokens_behaviour_logprob(static_cache):
    """A row in flight when the weights change goes on with its cache: the tokens after the change are drawn from
    the new weights attending to K/V the old weights computed. Each token's recorded log-prob and version are those
    of the weights that drew it: checked against a plain forward of the model's own, the prefix's cache computed
    under the first weights, the rest under the second. A forward under the second weights alone differs (the
    cache matters), so the check can fail. On the written-out decoder (its copies refreshed in place) and on the
    model's own forward (its live weights)."""
    import sampling
    from features import sampler_options
    from bench.longtail import EndAt
    from transformers import DynamicCache
    model, tok = architectures.tiny("qwen3")
    enc = tok(["hello world>", "xyz", "the quick brown fox>"], return_tensors="pt", padding=True,
              add_special_tokens=False)
    seeds, limit = torch.tensor([11, 12, 13]), 24
    ends = sampling.row_keys(seeds, torch.tensor([5, 6, 20]) - 1)  # rows 0 and 1 end early, row 2 runs on
    stop = tok.eos_token_id
    stream = Stream(3, 3, enc.input_ids.shape[1], limit, [stop], tok.pad_token_id, EndAt(ends=ends, stop=stop),
                             torch.device("cpu"), static_cache=static_cache)
    stream.add(enc.input_ids, enc.attention_mask, seeds, [0, 1, 2])
    stream.run(model, [0, 1], 0)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    paused_at = int(stream.rows.ptr[stream.slot[2]])
    assert 0 < paused_at < 19
    torch.manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    second = {k: v.clone() for k, v in model.state_dict().items()}
    stream.run(model, [2], 1)
    row = stream.take([2])
    length = int(row.completion_mask.sum())
    assert length == 20
    assert row.versions[0, :length].tolist() == [0] * paused_at + [1] * (length - paused_at)
    assert row.context_version.tolist() == [0]  # its prompt's K/V are the first weights': every token is carried
    assert torch.equal(features.streaming.carried(row, 1), row.policy_mask.bool())
    prompt = enc.input_ids[2][enc.attention_mask[2].bool()][None]
    ids = row.completion_ids[:, :length]
    # the token drawn at the stop was fed after it, on the second weights: the prefix cache is the prompt and the
    # tokens before it
    fed_first = torch.cat([prompt, ids[:, :paused_at - 1]], 1)
    with torch.no_grad():
        model.load_state_dict(first)
        cache = DynamicCache()
        logits_a = model(fed_first, cache=cache, use_cache=True).logits[:, prompt.shape[1] - 1:]
        model.load_state_dict(second)
        logits_b = model(ids[:, paused_at - 1:length - 1], cache=cache, use_cache=True).logits
        alone = model(torch.cat([prompt, ids[:, :length - 1]], 1)).logits[:, prompt.shape[1] - 1:]
    want = torch.cat([logits_a, logits_b], 1).log_softmax(-1).gather(-1, ids[..., None])[0, :, 0]
    alone = alone.log_softmax(-1).gather(-1, ids[..., None])[0, :, 0]
    got = row.logprobs[0, :length]
    # the last token is the stop EndAt puts in place of the drawn one: its log-prob is the drawn token's
    torch.testing.assert_close(got[:-1], want[:-1], atol=1e-5, rtol=0)
    assert (got[paused_at:-1] - alone[paused_at:-1]).abs().max() > 1e-3


def _train_rollouts(tmp_path, name, flags, spy=None):
    """The rollouts (and what `spy(run, batch, step)` returns for each) of a short in-process train.py run."""
    import contextlib
    import io

    import train
    seen, update = [], train.update

    def spying(run, batch, advantages, step):
        seen.append((batch.rollout, spy(run, batch, step) if spy else None))
        return update(run, batch, advantages, step)
    train.update = spying
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            train.main([f"--out_dir={tmp_path / name}", "--save_every=0", "--log_every=1",
                        "--max_completion_length=16", *flags])
    finally:
        train.update = update
    return seen


@pytest.mark.parametrize("path", ["written_out", "own_forward"])
def test_at_no_learning_rows_in_flight_sample_what_each_step_samples(tmp_path, monkeypatch, path):
    """With a learning rate too small to change a float32 weight, --max_staleness=1 samples every step's rows with
    the tokens and log-probs of --max_staleness=0, while half of each step's rows were decoded through the step
    before (their tokens carry older versions: from the second step on, each step's rows began a step early). On
    the written-out decoder and on the model's own forward (the path of every model the former does not sample)."""
    from layers import hf_decoder
    admitted, admit = [], hf_decoder.HFDecoder.admit
    monkeypatch.setattr(hf_decoder.HFDecoder, "admit", lambda self, rows: (admitted.append(len(rows)),
                                                                            admit(self, rows))[1])
    if path == "own_forward":
        architectures.force_model_forward(monkeypatch)
    flags = ["--max_steps=5", "--lr=1e-30"]
    now = _train_rollouts(tmp_path, "now", flags)
    ahead = _train_rollouts(tmp_path, "ahead", flags + ["--max_staleness=1"])
    assert bool(admitted) == (path == "own_forward")
    for step, ((a, _), (b, _)) in enumerate(zip(now, ahead), 1):
        assert torch.equal(a.completion_ids, b.completion_ids)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        older = ((b.versions < step - 1) & b.policy_mask.bool()).any(1)
        assert a.versions is None and (older.sum() > 0) == (step > 1), (step, older.sum())


COUNTER = '''class Counter:
    def reset(self, **kwargs):
        self.n = 0

    def bump(self, k: int) -> str:
        """Bump.

        Args:
            k: by how much
        """
        self.n += k
        return str(self.n)

    def get_reward(self):
        return float(self.n)
'''


def test_an_agents_rows_stream_through_steps(tmp_path, monkeypatch):
    """--max_staleness=1 with an environment's tools (each row an episode whose turns its tools answer): at no
    learning every step's rows have --max_staleness=0's tokens, turns and conversations, and the environment
    scores them alike, while rows of the next step decode during each step. A tiny random model writes no tool
    call: here a turn ends at any of 40 common bytes, and a row's first two turns call bump(k=1)."""
    import environments
    import model_loading
    from tasks import vault
    init, read = environments.Agent.__init__, environments.Agent.read_turn

    def pausing(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.stop_sequences = [[b] for b in range(97, 137)]

    def calling(self, ep, ids, before):
        message, calls = read(self, ep, ids, before)
        return message, calls or ([("bump", {"k": 1})] if ep.turns < 2 else [])
    monkeypatch.setattr(environments.Agent, "__init__", pausing)
    monkeypatch.setattr(environments.Agent, "read_turn", calling)
    env = tmp_path / "counter.py"
    env.write_text(COUNTER)
    model = model_loading.write_tiny_model(str(tmp_path / "m"), chat_template=vault.TINY_TOOL_TEMPLATE,
                                           extra_tokens=vault.TINY_TOOL_TOKENS)
    flags = [f"--model={model}", f"--environment={env}:Counter", "--max_steps=3", "--lr=1e-30",
             "--prompts_per_step=2", "--num_generations=4"]
    spy = lambda run, batch, step: [e.messages for e in batch.episodes]  # noqa: E731
    now = _train_rollouts(tmp_path, "now", flags, spy)
    ahead = _train_rollouts(tmp_path, "ahead", flags + ["--max_staleness=1"], spy)
    assert len(now) == len(ahead) == 3
    for step, ((a, chats_a), (b, chats_b)) in enumerate(zip(now, ahead), 1):
        for k in ("completion_ids", "completion_mask", "policy_mask", "turns"):
            assert torch.equal(getattr(a, k), getattr(b, k)), (step, k)
        assert chats_a == chats_b  # each conversation with its last turn written (Agent.finish) as the policy's
        assert [sum(m["role"] == "assistant" for m in chat) for chat in chats_b] == b.turns.tolist()
        assert bool(((b.versions < step - 1) & b.policy_mask.bool()).any()) == (step > 1)
    rewards = [[json.loads(line)["reward/Counter"] for line in open(tmp_path / name / "metrics.jsonl")]
               for name in ("now", "ahead")]
    assert rewards[0] == rewards[1]
    assert sum(int((r.turns > 1).sum()) for r, _ in ahead) > 6  # rows took turns the environment answered


def test_the_loss_takes_the_behaviour_logprob_of_every_token_of_a_carried_row(tmp_path, monkeypatch):
    """At staleness 1 with learning: in the first pass of each step the loss's old log-prob of every token of a row
    carried through a weight change is its sampler log-prob (the ratio is exp(train - behaviour)): the tokens an
    earlier version drew, and the ones the step's own weights drew attending to the K/V the earlier version
    computed, whose behaviour log-prob differs from the trainer's fresh forward. Any other token's is the
    trainer's own forward (ratio 1), as at staleness 0. The trainer-sampler comparison, left without the carried
    tokens, stays at float32 noise on every step; the carried tokens' own is reported apart."""
    import grpo
    import train
    calls, loss = [], grpo.grpo_loss

    def recording(logp, old_logp, *args, **kwargs):
        calls.append((logp.detach().clone(), old_logp.clone()))
        return loss(logp, old_logp, *args, **kwargs)
    monkeypatch.setattr(grpo, "grpo_loss", recording)
    micro, backward = [], train.backward_mini_batch

    def keeping(run, j, mbs, *args):
        micro.extend(mbs)
        return backward(run, j, mbs, *args)
    monkeypatch.setattr(train, "backward_mini_batch", keeping)
    seen = _train_rollouts(tmp_path, "stale", ["--max_steps=4", "--max_staleness=1", "--lr=3e-3"])
    assert len(calls) == len(micro)
    stale_tokens = late_tokens = 0
    late_gap = 0.0
    steps = iter(range(1, 5))
    k = 0
    for rollout, _ in seen:
        step, rows_done = next(steps), 0
        while rows_done < rollout.completion_ids.shape[0]:
            mb, (logp, old) = micro[k], calls[k]
            k += 1
            rows_done += len(mb.rows)
            mask = rollout.policy_mask[mb.rows, :mb.t].bool()
            stale = features.streaming.carried(rollout, step - 1)[mb.rows, :mb.t] & mask
            # drawn by this step's weights, on a cache older weights began
            late = stale & (rollout.versions[mb.rows, :mb.t] == step - 1)
            sampler = rollout.logprobs[mb.rows, :mb.t]
            assert torch.equal(old[stale], sampler[stale])
            assert torch.equal(old[mask & ~stale], logp[mask & ~stale])
            stale_tokens += int(stale.sum())
            late_tokens += int(late.sum())
            if stale.any():  # the weights moved: the behaviour log-probs are not the trainer's
                assert (logp[stale] - sampler[stale]).abs().max() > 1e-4
            if late.any():
                late_gap = max(late_gap, (logp[late] - sampler[late]).abs().max().item())
    assert stale_tokens > 0 and late_tokens > 0
    assert late_gap > 1e-4  # the old K/V moved their log-probs: marking older versions' tokens alone would miss it
    metrics = [json.loads(line) for line in open(tmp_path / "stale" / "metrics.jsonl")]
    assert len(metrics) == 4
    for m in metrics:
        assert m["sampler_logprob_diff_max"] < 1e-4, m
    assert max(m["sampler_logprob_diff_carried_mean"] for m in metrics) > 1e-4


# ----------------------------------------------------------------------------- a group's prompt prefilled once


@pytest.mark.parametrize("family", sorted(n for n, r in architectures.FAMILIES.items() if r.written_out))
def test_a_groups_prompt_prefilled_once_samples_what_each_rows_own_prefill_does(family, monkeypatch):
    """share_prompts: the prefill runs each distinct prompt once (4 of 12 rows here) and copies its K/V, recurrent
    states and window positions to the group's rows; every row then samples the tokens it samples with a prefill
    of its own, with its log-probs within float noise. A copy to the wrong row would change that row's tokens."""
    import sampling
    from features import sampler_options
    from layers import engine
    model, tok = architectures.tiny(family)
    text = [t for t in ["a>", "hello world>", "xyz", "the quick brown fox>"] for _ in range(3)]
    text[4], text[5] = text[5], text[4]  # a group need not be contiguous
    enc = tok(text, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        model.get_output_embeddings().weight[STOP_IDS] *= 2
    kw = dict(max_new_tokens=16, eos_ids=STOP_IDS, pad_id=tok.pad_token_id, seeds=torch.arange(len(text)) * 5 + 1)
    own = sampler_options.sample(model, enc.input_ids, enc.attention_mask, **kw)
    rows_run, embed = [], engine.StaticDecoder._embed
    monkeypatch.setattr(engine.StaticDecoder, "_embed", lambda self, ids: (rows_run.append(ids.shape), embed(self, ids))[1])
    shared = sampler_options.sample(model, enc.input_ids, enc.attention_mask, share_prompts=True, **kw)
    assert rows_run[0] == (4, enc.input_ids.shape[1])  # the prefill: one row per distinct prompt
    for k in ("completion_ids", "completion_mask", "truncated"):
        assert torch.equal(getattr(shared, k), getattr(own, k)), k
    torch.testing.assert_close(shared.logprobs, own.logprobs, atol=1e-5, rtol=0)
    assert own.completion_mask.sum(1).unique().numel() > 2  # rows of a group went their own ways


@pytest.mark.parametrize("family", _one_of_each_kind())
def test_a_groups_prompt_admitted_once_samples_what_each_rows_own_prefill_does(family, monkeypatch):
    """A Stream with share_prompts (--max_staleness with --shared_prompts): of the rows of one prompt admitted
    together, one runs it, on its place alone, and the others take a copy of its cache (K/V, recurrent states,
    routing records); without recurrent layers a row admitted later copies the prompt from a live row of its
    group. Every row then samples the tokens of one batch without sharing, log-probs within float noise. A copy
    to the wrong place, or a state not copied, would change the rows' tokens."""
    import sampling
    from features import sampler_options
    from layers import engine
    model, tok = architectures.tiny(family)
    text = ["a>", "hello world>", "xyz", "the quick brown fox>"] * 3  # the first 6 places: 2 prompts twice
    enc = tok(text, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        model.get_output_embeddings().weight[STOP_IDS] *= 2
    n, seeds = len(text), torch.arange(len(text)) * 5 + 1
    own = sampler_options.sample(model, enc.input_ids, enc.attention_mask, max_new_tokens=16, eos_ids=STOP_IDS,
                          pad_id=tok.pad_token_id, seeds=seeds)
    heads, copied, extend = [], [], engine.StaticDecoder.extend
    monkeypatch.setattr(engine.StaticDecoder, "extend", lambda self, ids, valid, start, top, batch_rows=None: (
        heads.append(0 if batch_rows is None else batch_rows.numel()), extend(self, ids, valid, start, top, batch_rows))[1])
    copy_rows = engine.StaticDecoder.copy_rows
    monkeypatch.setattr(engine.StaticDecoder, "copy_rows", lambda self, src, dst, lo, hi: (
        copied.append(dst.numel()), copy_rows(self, src, dst, lo, hi))[1])
    stream = Stream(6, n, enc.input_ids.shape[1] + 3, 16, STOP_IDS, tok.pad_token_id, sampling.Draw(),
                             torch.device("cpu"), share_prompts=True)
    stream.add(enc.input_ids, enc.attention_mask, seeds, list(range(n)))
    stream.run(model, list(range(n)))
    got = stream.take(list(range(n)))
    assert sum(heads) + sum(copied) == n  # every row admitted: run once, or copied
    recurrent = architectures.FAMILIES[family].layers == "hybrid"
    assert sum(copied) >= 2 and (recurrent or len(copied) > 1), copied  # later: from live rows (none recurrent)
    assert torch.equal(got.truncated, own.truncated)
    for k in ("completion_ids", "completion_mask"):
        assert torch.equal(getattr(got, k)[:, :own.completion_ids.shape[1]], getattr(own, k)), k
    # float noise: a prompt's K/V computed in a batch of other rows or of one (as stream_against_one_batch)
    torch.testing.assert_close(got.logprobs[:, :own.logprobs.shape[1]], own.logprobs, atol=2e-5, rtol=0)
    assert own.completion_mask.sum(1).unique().numel() > 2  # rows of a group went their own ways
