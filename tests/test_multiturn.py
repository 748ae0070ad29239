"""Multi-turn rollouts: rows that pause, take an environment's answer into their KV cache, and resume; the loss
over the policy's tokens only; tools and environments (environments/__init__.py) as TRL defines them."""

import copy
import json
import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import environments  # noqa: E402
import grpo  # noqa: E402
import logprobs  # noqa: E402
import model_loading  # noqa: E402
import rollouts  # noqa: E402
import sampling  # noqa: E402
from features import sampler_options  # noqa: E402
import sharding  # noqa: E402
from layers import engine, transformer  # noqa: E402
import tasks  # noqa: E402
from tasks import vault  # noqa: E402
import train  # noqa: E402
from test_fast_paths import prompts, tiny_model  # noqa: E402
from test_sampler import Scripted  # noqa: E402

STOP_IDS = list(range(97, 105))  # a..h: rows pause at scattered positions


def answering(length_of, turns_log=None):
    """A respond that answers row r's k-th pause with `length_of(r, k)` tokens 40 + r, 41 + r, ... (None: end)."""
    seen = {}

    def respond(turns):
        out = []
        for t in turns:
            k = seen[t.row] = seen.get(t.row, 0) + 1
            n = length_of(t.row, k)
            if turns_log is not None:
                turns_log.append((t.row, list(t.ids), t.start))
            out.append(None if n is None else [40 + t.row + j for j in range(n)])
        return out
    return respond


def multi_turn(model, tok, enc, static_cache=True, max_new=40, **kw):
    args = dict(max_new_tokens=max_new, eos_ids=STOP_IDS, pad_id=tok.pad_token_id, temperature=1.0,
                seeds=torch.arange(enc.input_ids.shape[0]) * 7 + 3, max_turns=3, check_every=4,
                respond=answering(lambda r, k: (r % 3) + 2 * k), static_cache=static_cache)
    args.update(kw)
    return sampler_options.sample(model, enc.input_ids, enc.attention_mask, **args)


def training_logprobs(model, enc, r):
    ids = torch.cat([enc.input_ids, r.completion_ids], 1)
    mask = torch.cat([enc.attention_mask, torch.ones_like(r.completion_ids)], 1)
    with torch.no_grad():
        logp, _ = logprobs.completion_logprobs(model, ids, mask, r.completion_ids.shape[1], 1.0)
    return logp


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_multi_turn_rollout_reads_what_one_forward_reads(arch):
    """The log-probs the sampler gave the policy's tokens, with answers appended into the cache between turns,
    equal those of one plain forward over the whole trajectory; the fast decoder and the fallback agree."""
    model, tok = tiny_model(arch)
    enc = prompts(tok)
    fast, slow = multi_turn(model, tok, enc), multi_turn(model, tok, enc, static_cache=False)
    for r in (fast, slow):
        env = (r.completion_mask - r.policy_mask).bool()
        assert env.any() and (r.turns > 1).any() and r.turns.unique().numel() > 1  # rows took different turns
        want = training_logprobs(model, enc, r)
        pol = r.policy_mask.bool()
        assert (want[pol] - r.logprobs[pol]).abs().max() < 1e-5
        assert (r.logprobs[~pol] == 0).all()
    assert torch.equal(fast.completion_ids, slow.completion_ids)
    assert torch.equal(fast.policy_mask, slow.policy_mask) and torch.equal(fast.turns, slow.turns)
    torch.testing.assert_close(fast.logprobs, slow.logprobs, atol=1e-5, rtol=0)


def test_answers_are_prefilled_once():
    """Each answer goes through the decoder once (with at most the token that ended the turn): all but its last
    token as a block on the rows that paused alone, then its last token in step with the other rows' one token
    each, so the batch never computes an answer's width for rows that feed one token; the prompt is prefilled
    once and never again."""
    model, tok = tiny_model()
    enc = prompts(tok)
    calls = {"prefill": 0, "extend": []}
    real_prefill, real_extend = engine.StaticDecoder.prefill, engine.StaticDecoder.extend

    def prefill(self, *a, **k):
        calls["prefill"] += 1
        return real_prefill(self, *a, **k)

    def extend(self, ids, valid, start, top, batch_rows=None):
        calls["extend"].append((valid.sum(1).tolist(), batch_rows is not None))
        return real_extend(self, ids, valid, start, top, batch_rows)
    engine.StaticDecoder.prefill, engine.StaticDecoder.extend = prefill, extend
    try:
        log = []
        r = multi_turn(model, tok, enc, respond=answering(lambda r, k: (r % 3) + 2 * k, log))
    finally:
        engine.StaticDecoder.prefill, engine.StaticDecoder.extend = real_prefill, real_extend
    answered = int((r.turns - 1).sum())
    assert calls["prefill"] == 1 and answered >= 3
    heads = [n for fed, alone in calls["extend"] if alone for n in fed]  # the answers but their last tokens
    assert len(heads) == answered and all(n >= 1 for n in heads)
    assert all(max(fed) == 1 for fed, alone in calls["extend"] if not alone)  # then one token per row
    answer_tokens = int((r.completion_mask - r.policy_mask).sum())
    assert answer_tokens <= sum(heads) + answered <= answer_tokens + answered
    # respond saw each row's completion so far, and where its latest turn began
    for row, ids, start in log:
        assert ids == r.completion_ids[row, :len(ids)].tolist() and 0 <= start < len(ids)


def test_pause_resume_against_a_script():
    """A scripted model on the fallback path: stop sequences and EOS end turns, answers are spliced in, the
    masks say who wrote what, and what a row sampled past its stop before the check is dropped."""
    cfg = tiny_model()[0].config
    eos, stop = 9, (5, 6)
    script = [[1, 5, 6, 2, 3, 9, 9, 9, 9, 9, 9, 9, 9, 9],   # stop after 3 tokens, then EOS
              [1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9],   # EOS at its 5th token: respond ends it (max turns)
              [5, 1, 6, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]]   # no stop: the length limit
    ids = torch.full((3, 2), 40)
    answers = {0: [70, 71], 1: None}

    def respond(turns):
        return [answers.get(t.row) if len(t.ids) < 8 else None for t in turns]
    r = sampler_options.sample(Scripted(cfg, 2, script), ids, torch.ones_like(ids), max_new_tokens=10, eos_ids=[eos],
                        pad_id=0, temperature=0, stop_sequences=[stop], respond=respond, max_turns=2, check_every=4)
    # row 0: policy 1 5 6 | answer 70 71 | policy resumes at its own position 5: the script's 9 (EOS)
    assert r.completion_ids[0, :6].tolist() == [1, 5, 6, 70, 71, 9]
    assert r.policy_mask[0, :6].tolist() == [1, 1, 1, 0, 0, 1] and r.completion_mask[0].sum() == 6
    assert r.completion_ids[1].tolist()[:5] == [1, 2, 3, 4, 9] and r.completion_mask[1].sum() == 5
    assert r.completion_mask[2].sum() == 10 and r.truncated.tolist() == [False, False, True]
    assert r.turns.tolist() == [2, 1, 1]


def test_a_stop_sequence_ends_a_row_without_respond():
    cfg = tiny_model()[0].config
    ids = torch.full((2, 2), 40)
    script = [[1, 5, 6, 2, 2, 2, 2, 2], [5, 1, 1, 1, 1, 1, 1, 1]]
    r = sampler_options.sample(Scripted(cfg, 2, script), ids, torch.ones_like(ids), max_new_tokens=8, eos_ids=[9],
                        pad_id=0, temperature=0, stop_sequences=[[5, 6]])
    assert r.completion_mask.sum(1).tolist() == [3, 8] and r.truncated.tolist() == [False, True]


def test_answer_without_room_ends_the_row_truncated():
    cfg = tiny_model()[0].config
    ids = torch.full((1, 2), 40)
    r = sampler_options.sample(Scripted(cfg, 2, [[9] * 8]), ids, torch.ones_like(ids), max_new_tokens=6, eos_ids=[9],
                        pad_id=0, temperature=0, respond=lambda turns: [[70] * 5 for _ in turns], max_turns=3)
    assert r.completion_mask.sum().item() == 1 and r.truncated.tolist() == [True] and r.turns.tolist() == [1]


def test_gradient_counts_policy_tokens_only(tmp_path):
    """train.update on a multi-turn batch: the gradient of the naive loss over the policy's tokens, and not
    that of the loss that also counts the environment's."""
    from test_objective import naive_loss
    cfg = train.Config(device="cpu", out_dir=str(tmp_path), prompts_per_step=2, num_generations=4,
                       max_completion_length=30, micro_batch_size=3, beta=0.1, save_every=0)
    run = train.setup(cfg, sharding.Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    batch = run.rollout(run, 1)
    lm = run.policy.lm
    batch.rollout = sampler_options.sample(lm, batch.prompt_ids, batch.prompt_mask, max_new_tokens=30, eos_ids=STOP_IDS,
                                    pad_id=run.tokenizer.pad_token_id, seeds=torch.arange(8), max_turns=3,
                                    respond=answering(lambda r, k: 1 + (r % 4)))
    r = batch.rollout
    assert ((r.completion_mask - r.policy_mask).sum(1) > 0).sum() >= 2
    adv = torch.randn(8, generator=torch.Generator().manual_seed(1))
    init = copy.deepcopy(lm)
    grads = []
    real_step = run.optimizer.step

    def recording_step(*a, **k):
        grads.append([p.grad.clone() for p in lm.parameters()])
        return real_step(*a, **k)
    run.optimizer.step = recording_step
    train.update(run, batch, adv, 1)
    ids = torch.cat([batch.prompt_ids, r.completion_ids], 1)
    mask = torch.cat([batch.prompt_mask, torch.ones_like(r.completion_ids)], 1)
    t = r.completion_ids.shape[1]

    def naive_grad(loss_mask):
        model = copy.deepcopy(init)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=logprobs.position_ids_from_mask(mask)).logits
        logp = torch.log_softmax(logits[:, -t - 1:-1].float(), -1).gather(-1, ids[:, -t:, None])[..., 0]
        naive_loss(logp, logp.detach(), logp.detach(), adv, loss_mask.float(), 0.1, 0.2, 0.2, "grpo", 30).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        return [p.grad for p in model.parameters()]
    for got, want in zip(grads[0], naive_grad(r.policy_mask)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)
    wrong = naive_grad(r.completion_mask)
    assert max((g - w).abs().max().item() for g, w in zip(grads[0], wrong)) > 1e-4


def test_rollout_fields_survive_concatenation():
    a = rollouts.Rollout(*(torch.ones(2, 3, dtype=torch.long),) * 3, torch.zeros(2, dtype=torch.bool),
                         torch.ones(2, 3), torch.full((2,), 2))
    b = rollouts.Rollout(*(torch.ones(1, 5, dtype=torch.long),) * 3, torch.ones(1, dtype=torch.bool),
                         torch.ones(1, 5), torch.full((1,), 3))
    c = rollouts.cat_rollouts([a, b], pad_id=7)
    assert c.completion_ids[0].tolist() == [1, 1, 1, 7, 7] and c.policy_mask[0].tolist() == [1, 1, 1, 0, 0]
    assert c.turns.tolist() == [2, 2, 3] and c.truncated.tolist() == [False, False, True]


# ----------------------------------------------------------------------------- tools and environments


def tool_tokenizer():
    tok = model_loading.build_byte_tokenizer(vault.TINY_TOOL_TOKENS)
    tok.chat_template = vault.TINY_TOOL_TEMPLATE
    return tok


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a * b


def test_parse_calls_reads_json_and_never_evaluates():
    calls = environments.parse_calls('<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</tool_call> and '
                               '<tool_call>__import__("os").system("x")</tool_call><tool_call>[1]</tool_call>'
                               '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert calls[0] == ("multiply", {"a": 3, "b": 4}) and calls[1][0] is None and calls[2][0] is None
    assert calls[3] == ("f", {"x": 1})


def test_failing_tools_answer_with_an_error_and_the_run_goes_on():
    def raises() -> str:
        """Fail."""
        raise RuntimeError("broken")

    def not_text() -> str:
        """Return an object."""
        return object()

    def huge() -> str:
        """Return megabytes."""
        return "x" * 3_000_000

    def slow() -> str:
        """Sleep."""
        time.sleep(5)
        return "late"
    jobs = [(raises, {}), (not_text, {}), (huge, {}), (slow, {}), (multiply, {"a": 2, "b": 5}),
            (multiply, {"c": 1}), (None, "the tool call is not valid JSON")]
    t = time.monotonic()
    out = environments.run_calls(jobs, timeout=0.5, limit=4000)
    assert time.monotonic() - t < 2
    assert [failed for _, failed in out] == [True, True, True, True, False, True, True]
    assert "RuntimeError: broken" in out[0][0] and "not text" in out[1][0] and "3,000,000" in out[2][0]
    assert "0.5 s" in out[3][0] and out[4][0] == "10" and "TypeError" in out[5][0]
    assert all(len(text) < 400 for text, _ in out)


class TRLStyleEnv:
    """Written as TRL's documentation writes environments: reset, tools as methods, get_reward."""

    def reset(self, **kwargs):
        self.total = 0
        return " Add numbers."

    def add(self, x: int) -> str:
        """Add x to the running total.

        Args:
            x: The number to add.

        Returns:
            The new total.
        """
        self.total += x
        return str(self.total)

    def total_so_far(self) -> int:
        """The running total."""
        return self.total

    def get_reward(self) -> float:
        return float(self.total)


def test_environment_turns_through_the_agent():
    """An episode per row: reset's text joins the prompt, tools are the methods, a call's result is rendered by
    the chat template and tokenized as the answer; a turn without a call ends the rollout."""
    tok = tool_tokenizer()
    agent = environments.Agent(tok, [tok.eos_token_id], [multiply], TRLStyleEnv, max_turns=3)
    assert [s["function"]["name"] for s in agent.schemas] == ["multiply", "add", "total_so_far"]
    prompts_, eps = agent.start([{"prompt_text": "hi"}, {"prompt_text": "yo"}])
    assert "hi Add numbers." in prompts_[0] and "tools: multiply add total_so_far" in prompts_[0]
    respond = agent.responder(eps)
    enc = lambda s: tok(s, add_special_tokens=False).input_ids  # noqa: E731
    turn0 = enc('<tool_call>{"name": "add", "arguments": {"x": 5}}</tool_call>')
    turn1 = enc("done") + [tok.eos_token_id]
    answers = respond([sampling.Turn(0, turn0, 0), sampling.Turn(1, turn1, 0)])
    assert answers[1] is None and eps[0].env.total == 5 and eps[0].tool_calls == 1
    text = tok.decode(answers[0])
    assert text == "<tool_response>5"  # the tiny template writes results into the turn
    assert eps[0].messages[-1] == {"role": "tool", "name": "add", "content": "5"}
    assert agent.reward_funcs[0].__name__ == "TRLStyleEnv"
    assert agent.reward_funcs[0](environments=[e.env for e in eps]) == [5.0, 0.0]


def test_environment_runs_unchanged_through_train(tmp_path):
    """--environment=file.py:Class on a tiny model with a tool chat template: the run completes, the
    environment's get_reward is a reward logged under its class name, and the tool metrics are logged."""
    env_file = tmp_path / "my_env.py"
    env_file.write_text(
        "class Counter:\n"
        "    def reset(self, **kwargs):\n"
        "        self.n = 0\n"
        "    def bump(self, k: int) -> str:\n"
        "        '''Bump.\n\n        Args:\n            k: by how much\n        '''\n"
        "        self.n += k\n        return str(self.n)\n"
        "    def peek(self) -> str:\n"
        "        '''Peek.'''\n"
        "        return str(self.n)\n"
        "    def get_reward(self):\n"
        "        return float(self.n > 0)\n")
    model_dir = model_loading.write_tiny_model(str(tmp_path / "m"), chat_template=vault.TINY_TOOL_TEMPLATE,
                                               extra_tokens=vault.TINY_TOOL_TOKENS)
    out = tmp_path / "out"
    train.main([f"--model={model_dir}", f"--environment={env_file}:Counter", "--max_steps=2",
                "--max_completion_length=24", "--prompts_per_step=2", "--num_generations=4", f"--out_dir={out}",
                "--save_every=0"])
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(rows) == 2 and all("reward/Counter" in r and "tool_calls" in r and "turns_max" in r for r in rows)


def test_answer_text_with_a_chatml_tool_role():
    """A template where tools answer in a turn of their own (ChatML, as Qwen2.5's): the answer closes the
    policy's turn (unless the policy wrote the end of turn itself), holds the tool turn, opens the next."""
    tok = model_loading.build_byte_tokenizer(vault.TINY_TOOL_TOKENS)
    tok.chat_template = model_loading.TINY_CHAT_TEMPLATE
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    agent = environments.Agent(tok, [im_end], [multiply])
    msg = [{"role": "tool", "name": "multiply", "content": "12"}]
    tool_turn = "<|im_start|>tool\n12<|im_end|>\n<|im_start|>assistant\n"
    assert agent.answer_text(msg, ended_with_eos=False) == "<|im_end|>\n" + tool_turn
    assert agent.answer_text(msg, ended_with_eos=True) == "\n" + tool_turn
    _, eps = agent.start([{"prompt_text": "3*4?"}])
    call = tok('<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</tool_call>',
               add_special_tokens=False).input_ids
    answer = agent.responder(eps)([sampling.Turn(0, call + [im_end], 0)])[0]
    assert tok.decode(answer) == "\n" + tool_turn


def test_python_tool_runs_in_the_sandbox_through_the_agent():
    """--tools=sandbox/executor.py:python: the model's code runs in the sandbox and its output comes back as the result;
    code that fails comes back as its error, as text, and the rollout goes on."""
    tok = tool_tokenizer()
    agent = environments.Agent(tok, [tok.eos_token_id], environments.load_tools("sandbox/executor.py:python"), max_turns=3)
    _, eps = agent.start([{"prompt_text": "6*7?"}, {"prompt_text": "1/0?"}])
    enc = lambda code: tok('<tool_call>' + json.dumps({"name": "python", "arguments": {"code": code}}) +  # noqa
                           '</tool_call>', add_special_tokens=False).input_ids
    answers = agent.responder(eps)([sampling.Turn(0, enc("print(6*7)"), 0), sampling.Turn(1, enc("1/0"), 0)])
    assert tok.decode(answers[0]).startswith("<tool_response>42")
    assert "ZeroDivisionError" in tok.decode(answers[1]) and eps[1].tool_calls == 1
