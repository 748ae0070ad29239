"""Routing replay (layers/routing.py): the training forward sends each token to the experts the sampler chose."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import architectures  # noqa: E402
import logprobs  # noqa: E402
from layers import routing  # noqa: E402
import rollouts  # noqa: E402
import sampling  # noqa: E402
from features import sampler_options  # noqa: E402
from features.stream_sampler import Stream  # noqa: E402
from features import routing_replay  # noqa: E402

REPLAYING = routing_replay.Forward(logprobs.Forward())  # the training forward with routing replay's variant
from layers import transformer  # noqa: E402
from test_multiturn import answering  # noqa: E402

TEXT = ["a>", "hello world>", "xyz", "b>" * 7]


def experts_seen(model):
    """Hooks that keep the expert indices each MoE layer's experts module is called with: [(tokens, k)] per layer."""
    seen = []
    mods = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    for layer, m in enumerate(mods):
        seen.append([])
        m.register_forward_pre_hook(lambda mod, args, layer=layer: seen[layer].append(args[1].clone()))
    return seen


def nudge_routers(model, scale=0.5):
    """Move the routers' weights, so that the live choice of many tokens is no longer the sampler's."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for r in routing.routers(model):
            for p in (r.weight, getattr(r, "bias", None)):
                if p is not None:
                    p.add_(torch.randn(p.shape, generator=g) * scale * p.std())


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_training_forward_routes_as_the_sampler_did(family):
    model, tok = architectures.tiny(family)
    enc = tok(TEXT, return_tensors="pt", padding=True, add_special_tokens=False)
    r = sampler_options.sample(model, enc.input_ids, enc.attention_mask, max_new_tokens=30, eos_ids=list(range(97, 105)),
                        pad_id=tok.pad_token_id, seeds=torch.arange(4) * 7 + 3, max_turns=3, check_every=4,
                        respond=answering(lambda row, k: (row % 3) + 2 * k), record_routing=True)
    layers = len(routing.routers(model))
    k = model.config.num_experts_per_tok
    assert r.routing.shape == (*r.completion_ids.shape, layers, k)
    assert r.prompt_routing.shape == (*enc.input_ids.shape, layers, k)
    ids = torch.cat([enc.input_ids, r.completion_ids], 1)
    real_mask = torch.cat([enc.attention_mask, r.completion_mask], 1)
    mask = torch.cat([enc.attention_mask, torch.ones_like(r.completion_ids)], 1)  # as train.update gives it
    route = torch.cat([r.prompt_routing, r.routing], 1)  # (N, S, layers, k)

    # what the sampler recorded is what the model itself routes to in one plain forward of each trajectory
    seen = experts_seen(model)
    with torch.no_grad():
        for i in range(len(TEXT)):
            model(input_ids=ids[i][real_mask[i].bool()][None])
    for layer in range(layers):
        for i in range(len(TEXT)):
            real = real_mask[i].bool()
            fed = (route[i, :, layer] >= 0).all(-1) & real  # a row's last token is never fed to the sampler
            plain = seen[layer][i][fed[real]]
            assert torch.equal(plain.sort(-1).values, route[i, fed, layer].long().sort(-1).values)

    # with the routers moved, the training forward still picks the sampler's experts, and the metric says how
    # many it would have changed
    as_sampled = {k: v.clone() for k, v in model.state_dict().items()}
    nudge_routers(model)
    seen = experts_seen(model)
    replay = routing.of(model)
    logp, _ = logprobs.completion_logprobs(model, ids, mask, r.completion_ids.shape[1], forward=REPLAYING,
                                           extras={"routing": route})
    differ, decisions = replay.counts()
    lead = (mask.cumsum(1) == 0).sum(1)
    cols = (torch.arange(ids.shape[1]) + lead[:, None]) % ids.shape[1]
    moved_route = route.gather(1, cols[:, :, None, None].expand_as(route))
    moved_real = real_mask.bool().gather(1, cols)
    for layer in range(layers):
        used = seen[layer][-1].view(len(TEXT), -1, k)  # (N, width, k): the forward ran the moved rows
        want = moved_route[:, :used.shape[1], layer].long()
        fed = (want >= 0).all(-1) & moved_real[:, :used.shape[1]]
        assert torch.equal(used[fed].sort(-1).values, want[fed].sort(-1).values)
    assert decisions > 0 and 0 < differ < decisions  # the nudge changed some choices (replayed anyway), not all

    # with the routers as they sampled, no replayed decision differs: past each row's end nothing is replayed
    model.load_state_dict(as_sampled)
    logprobs.completion_logprobs(model, ids, mask, r.completion_ids.shape[1], forward=REPLAYING,
                                           extras={"routing": route})
    differ, decisions = replay.counts()
    assert decisions > 0 and differ == 0


def _same_records(got, want, prompt_mask):
    """Rows' records equal at every real prompt position and every completion position but the last; at its last,
    which the written-out sampler does not feed once the row's place is taken or compacted away, equal or -1 in one
    (the live router's choice, which no loss reads: no position attends to it, and its logits predict nothing)."""
    real = prompt_mask.bool()
    assert torch.equal(got.prompt_routing[:, -real.shape[1]:][real], want.prompt_routing[real])
    t = want.routing.shape[1]
    last = torch.arange(t)[None, :] == want.completion_mask.sum(1, keepdim=True) - 1
    ours = got.routing[:, :t]
    assert torch.equal(ours[~last], want.routing[~last])
    theirs = want.routing[last]
    assert ((ours[last] == theirs) | (ours[last] == -1) | (theirs == -1)).all() and (want.routing >= 0).any()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "gpt_oss"])
def test_written_out_sampler_records_what_the_model_forward_records(family):
    """MoE families sample on the written-out layers (layers/transformer.py, layers/static_moe.py): over several turns
    (pauses, forgotten tokens, answers of different lengths) the sampler records, token by token, the experts the
    model's own forward (layers/hf_decoder.py, through the routers' top-k) records for the same rollout, and -1 at the
    same places (`_same_records`)."""
    model, tok = architectures.tiny(family)
    assert transformer.decide(model).samples_written_out()
    enc = tok(TEXT, return_tensors="pt", padding=True, add_special_tokens=False)
    out = {}
    for static in (True, False):
        out[static] = sampler_options.sample(model, enc.input_ids, enc.attention_mask, max_new_tokens=30,
                                      eos_ids=list(range(97, 105)), pad_id=tok.pad_token_id,
                                      seeds=torch.arange(4) * 7 + 3, max_turns=3, check_every=4,
                                      respond=answering(lambda row, k: (row % 3) + 2 * k), record_routing=True,
                                      static_cache=static)
    fast, hf = out[True], out[False]
    assert (fast.turns > 1).any() and torch.equal(fast.completion_ids, hf.completion_ids)
    _same_records(fast, hf, enc.attention_mask)
    assert (hf.routing < 0).any()  # forgotten tokens: -1 in both


def test_replayed_gates_come_from_the_live_router():
    """The gates of the replayed experts are the live router's: its weight gets a gradient, and replaying a
    model's own choice gives exactly its log-probs."""
    model, tok = architectures.tiny("qwen3_moe")
    enc = tok(TEXT, return_tensors="pt", padding=True, add_special_tokens=False)
    r = sampler_options.sample(model, enc.input_ids, enc.attention_mask, max_new_tokens=12, eos_ids=[],
                        pad_id=tok.pad_token_id, record_routing=True)
    ids = torch.cat([enc.input_ids, r.completion_ids], 1)
    mask = torch.cat([enc.attention_mask, r.completion_mask], 1)
    route = torch.cat([r.prompt_routing, r.routing], 1)
    plain, _ = logprobs.completion_logprobs(model, ids, mask, 12)
    replayed, _ = logprobs.completion_logprobs(model, ids, mask, 12, forward=REPLAYING, extras={"routing": route})
    torch.testing.assert_close(replayed, plain, atol=1e-6, rtol=0)
    replayed.sum().backward()
    assert all(rt.weight.grad is not None and rt.weight.grad.abs().sum() > 0 for rt in routing.routers(model))
    assert routing.of(model).counts()[0] == 0  # the same weights choose the same experts


def test_routing_rows_survive_cat_and_selection():
    """Rollouts of different prompt widths and lengths join with routing aligned: prompts padded on the left,
    completions on the right, -1 where nothing was recorded."""
    model, tok = architectures.tiny("qwen3_moe")
    parts = []
    for text, t in ((["a>", "hello world>"], 5), (["xyz"], 9)):
        enc = tok(text, return_tensors="pt", padding=True, add_special_tokens=False)
        parts.append(sampler_options.sample(model, enc.input_ids, enc.attention_mask, max_new_tokens=t, eos_ids=[],
                                     pad_id=tok.pad_token_id, record_routing=True))
    both = rollouts.cat_rollouts(parts, tok.pad_token_id)
    assert both.routing.shape[:2] == (3, 9) and both.prompt_routing.shape[:2] == (3, parts[0].prompt_routing.shape[1])
    assert torch.equal(both.routing[:2, :5], parts[0].routing) and (both.routing[:2, 5:] == -1).all()
    p = parts[1].prompt_routing.shape[1]
    assert torch.equal(both.prompt_routing[2, -p:], parts[1].prompt_routing[0])
    assert (both.prompt_routing[2, :-p] == -1).all()
    picked = rollouts.rollout_rows(both, [2, 0])
    assert torch.equal(picked.routing[1], both.routing[0])


def test_a_run_with_routing_replay_logs_how_often_routing_differs(tmp_path):
    """train.py on a tiny Qwen3-MoE with --routing_replay: sampler and trainer log-probs agree to float32 noise,
    and each step logs the share of routing decisions the trainer's router would have made otherwise."""
    import json

    import model_loading
    import train

    tok = model_loading.build_byte_tokenizer()
    architectures.config("qwen3_moe", tok).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    out = tmp_path / "out"
    # an evaluation after each step samples with the routers live again
    train.main([f"--model={tmp_path / 'model'}", "--routing_replay", "--max_steps=2", f"--out_dir={out}",
                "--save_every=0", "--eval_every=1", "--eval_prompts=4"])
    steps = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [m["step"] for m in steps if "routing_replay_differ" in m] == [1, 2]
    for m in steps:
        if "routing_replay_differ" in m:  # float32: the weights that sampled route alike but for near-ties
            assert 0 <= m["routing_replay_differ"] < 0.05 and m["sampler_logprob_diff_max"] < 1e-4


def test_with_lora_the_reference_routing_is_counted_apart(tmp_path):
    """With LoRA the reference is the policy with its adapters off, replaying the sampled experts through the same
    routers: as the adapters grow, it would route otherwise (routing_replay_differ_ref > 0), and none of that is
    the policy's disagreement, which stays 0 while sampler and trainer route alike."""
    import json

    import model_loading
    import train

    tok = model_loading.build_byte_tokenizer()
    architectures.config("qwen3_moe", tok).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    out = tmp_path / "out"
    train.main([f"--model={tmp_path / 'model'}", "--routing_replay", "--lora_rank=4", "--max_steps=4",
                f"--out_dir={out}", "--save_every=0"])
    steps = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert all(m["sampler_logprob_diff_max"] < 1e-4 for m in steps)
    assert [m["routing_replay_differ"] for m in steps] == [0.0] * 4
    assert steps[0]["routing_replay_differ_ref"] == 0.0  # the adapters start at zero: the same model
    assert max(m["routing_replay_differ_ref"] for m in steps) > 0.05


def test_routing_replay_needs_experts(tmp_path):
    import model_loading
    import train

    tok = model_loading.build_byte_tokenizer()
    architectures.config("qwen3", tok).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    with pytest.raises(SystemExit, match="routing_replay: Qwen3ForCausalLM has no expert router"):
        train.main([f"--model={tmp_path / 'model'}", "--routing_replay", "--max_steps=1",
                    f"--out_dir={tmp_path / 'out'}"])


def test_no_decoder_outlives_a_recorded_rollout():
    """The sampler drops its decoder after a rollout, and with routing recorded too nothing keeps it: its weight
    copies and KV cache do not stay into the training phase. The collector is off, so only references count: a
    decoder that kept its routing recorder, which holds the decoder, would be a cycle that Python frees only at its
    next full collection (which a training phase, making few Python objects, may not reach)."""
    import gc

    from layers.engine import StaticDecoder
    model, tok = architectures.tiny("qwen3_moe")
    enc = tok(TEXT, return_tensors="pt", padding=True, add_special_tokens=False)
    gc.collect()
    gc.disable()
    try:
        r = sampler_options.sample(model, enc.input_ids, enc.attention_mask, max_new_tokens=8, eos_ids=[],
                            pad_id=tok.pad_token_id, record_routing=True)
        alive = [o for o in gc.get_objects() if type(o) is StaticDecoder]
    finally:
        gc.enable()
    assert r.routing is not None and (r.routing >= 0).any()  # recorded: the decoder held a recorder
    assert not alive


@pytest.mark.parametrize("static_cache", [True, False], ids=["written_out", "own_forward"])
def test_rows_streaming_through_places_record_the_experts_one_batch_records(static_cache):
    """Routing replay with rows streaming through places (--rollouts_in_flight) and through a Stream across runs
    (--max_staleness): a place takes a new row only once the records of the row it held are kept, so each row's
    experts are those one batch records for it, several turns included (answers, forgotten tokens). On the
    written-out decoder (records by place and slot) and on the model's own forward (records by cache column, which
    admissions and packing move with the cache)."""
    from test_multiturn import STOP_IDS
    model, tok = architectures.tiny("qwen3_moe")
    text = ["a>", "hello world>", "xyz", "b>" * 7, "q", "the quick brown fox>"] * 2
    enc = tok(text, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():  # rows end at varied lengths
        model.get_output_embeddings().weight[STOP_IDS] *= 2
    n, pad = len(text), tok.pad_token_id
    seeds = torch.arange(n) * 7 + 3

    def run(**kw):
        return sampler_options.sample(model, enc.input_ids, enc.attention_mask, max_new_tokens=40, eos_ids=STOP_IDS,
                               pad_id=pad, seeds=seeds, max_turns=3, check_every=4, record_routing=True,
                               respond=answering(lambda r, k: (r % 3) + 2 * k), static_cache=static_cache, **kw)
    whole = run()
    streamed = run(in_flight=4, keep_decoder=True)
    if static_cache:
        assert model.__dict__.pop("_static_decoder").admissions == n - 4
    assert (whole.turns > 1).any() and streamed.held_steps.sum() < whole.held_steps.sum()  # places were reused
    assert torch.equal(streamed.completion_ids, whole.completion_ids)
    _same_records(streamed, whole, enc.attention_mask)

    stream = Stream(5, n, enc.input_ids.shape[1] + 3, 40, STOP_IDS, pad, sampling.Draw(), torch.device("cpu"),
                             check_every=4, respond=answering(lambda r, k: (r % 3) + 2 * k), max_turns=3,
                             record_routing=True, static_cache=static_cache)
    stream.add(enc.input_ids[:6], enc.attention_mask[:6], seeds[:6], list(range(6)))
    stream.run(model, [0, 1, 2])
    first = stream.take([0, 1, 2])
    stream.add(enc.input_ids[6:], enc.attention_mask[6:], seeds[6:], list(range(6, n)))  # into freed row indices
    stream.run(model, list(range(3, n)), 1)
    got = rollouts.cat_rollouts([first, stream.take(list(range(3, n)))], pad)
    assert torch.equal(got.completion_ids[:, :whole.completion_ids.shape[1]], whole.completion_ids)
    _same_records(got, whole, enc.attention_mask)

    # a take of every row the stream holds hands out the records, not a view that the next `add` resets
    small = Stream(2, 4, enc.input_ids.shape[1], 10, STOP_IDS, pad, sampling.Draw(), torch.device("cpu"),
                            record_routing=True, static_cache=static_cache)
    small.add(enc.input_ids[:4], enc.attention_mask[:4], seeds[:4], list(range(4)))
    small.run(model, list(range(4)))
    taken = small.take(list(range(4)))
    kept = taken.prompt_routing.clone()
    small.add(enc.input_ids[:4], enc.attention_mask[:4], seeds[:4], list(range(4, 8)))  # the same row indices
    assert (kept >= 0).any() and torch.equal(taken.prompt_routing, kept)


@pytest.mark.parametrize("path", ["written_out", "own_forward"])
def test_rows_ahead_of_the_step_replay_the_experts_that_sampled_them(tmp_path, monkeypatch, path):
    """--routing_replay with --max_staleness=1: at a learning rate too small to change a float32 weight, each step
    trains the tokens and the experts --max_staleness=0 records, its prompts' records as wide as its own prompts
    (the stream's are max_prompt_length wide), on the written-out decoder and on the model's own forward (whose
    routers record while the stream runs and replay in the training forward between)."""
    import model_loading
    from test_streaming import _train_rollouts
    if path == "own_forward":
        architectures.force_model_forward(monkeypatch)
    tok = model_loading.build_byte_tokenizer()
    architectures.config("qwen3_moe", tok).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    flags = [f"--model={tmp_path / 'model'}", "--routing_replay", "--max_steps=3", "--lr=1e-30", "--beta=0",
             "--prompts_per_step=2", "--num_generations=4", "--micro_batch_size=8", "--check_model=false"]
    prompt_mask = lambda run, batch, step: batch.prompt_mask  # noqa: E731
    now = _train_rollouts(tmp_path, "now", flags, prompt_mask)
    ahead = _train_rollouts(tmp_path, "ahead", flags + ["--max_staleness=1", "--rollouts_in_flight=3"], prompt_mask)
    assert len(now) == len(ahead) == 3
    older = 0  # tokens drawn by weights older than their step's: rows that began a step early
    for step, ((a, mask), (b, _)) in enumerate(zip(now, ahead), 1):
        assert torch.equal(a.completion_ids, b.completion_ids) and b.prompt_routing.shape == a.prompt_routing.shape
        _same_records(b, a, mask)
        older += int(((b.versions < step - 1) & b.policy_mask.bool()).sum())
    assert older > 0
