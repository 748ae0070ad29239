"""Deferred model loading, the tokenizer, the reference model, and reward scoring."""

import pytest
import torch
from transformers import PreTrainedTokenizerFast

import model_loading
import rewards
import tasks.next_letter
import tasks
from tasks import next_letter


def test_model_init_kwargs_are_forwarded(tiny_dir, tmp_path):
    m = model_loading.load_model(tiny_dir, {"dtype": "bfloat16", "attn_implementation": "eager"})
    assert next(m.parameters()).dtype == torch.bfloat16 and m.config._attn_implementation == "eager"
    # same path with weights on disk goes through from_pretrained and keeps the kwargs
    m.save_pretrained(tmp_path / "w")
    m2 = model_loading.load_model(str(tmp_path / "w"), {"torch_dtype": "float32", "attn_implementation": "sdpa"})
    assert next(m2.parameters()).dtype == torch.float32 and m2.config._attn_implementation == "sdpa"
    torch.testing.assert_close(m2.model.embed_tokens.weight, m.model.embed_tokens.weight.float())


def _family_dir(path, family):
    """A folder with a tiny `family` config and the byte tokenizer, no weights (tests/architectures.py)."""
    import architectures
    tok = model_loading.build_byte_tokenizer()
    tok.save_pretrained(path)
    architectures.config(family, tok).save_pretrained(path)
    return str(path)


def test_attention_is_chosen_per_model_and_a_bad_choice_is_one_line(tmp_path):
    """No attn_implementation: sdpa where the class supports it, else eager (gpt-oss, whose sinks sdpa lacks)."""
    gpt_oss = _family_dir(tmp_path / "gpt_oss", "gpt_oss")
    assert model_loading.load_model(gpt_oss, {}).config._attn_implementation == "eager"
    assert model_loading.load_model(_family_dir(tmp_path / "qwen3", "qwen3"), {}).config._attn_implementation == "sdpa"
    assert model_loading.load_model(gpt_oss, {"attn_implementation": "eager"}).config._attn_implementation == "eager"
    model_loading.load_model(gpt_oss, {}).save_pretrained(tmp_path / "weights")  # from_pretrained's path too
    assert model_loading.load_model(str(tmp_path / "weights"), {}).config._attn_implementation == "eager"
    for folder in (gpt_oss, str(tmp_path / "weights")):
        with pytest.raises(model_loading.InitKwargsError) as e:
            model_loading.load_model(folder, {"attn_implementation": "sdpa"})
        assert str(e.value) == 'model_init_kwargs: gpt_oss does not support attn_implementation=sdpa; use "eager"'


def test_train_starts_on_gpt_oss_with_the_default_settings(tmp_path):
    import train
    gpt_oss = _family_dir(tmp_path / "gpt_oss", "gpt_oss")
    args = [f"--model={gpt_oss}", "--max_steps=1", "--num_generations=2", "--prompts_per_step=2",
            "--print_completions_every=0", "--save_every=0"]
    train.main([*args, f"--out_dir={tmp_path / 'out'}"])
    assert (tmp_path / "out" / "model" / "model.safetensors").exists()
    with pytest.raises(SystemExit) as e:
        train.main([*args, f"--out_dir={tmp_path / 'bad'}", '--model_init_kwargs={"attn_implementation": "sdpa"}'])
    assert str(e.value) == ('config error: --model_init_kwargs: gpt_oss does not support attn_implementation=sdpa; '
                            'use "eager"')


def test_no_weights_gives_seeded_random_init(tiny_dir):
    a = model_loading.load_model(tiny_dir, {}, seed=1)
    b = model_loading.load_model(tiny_dir, {}, seed=1)
    c = model_loading.load_model(tiny_dir, {}, seed=2)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight) and not torch.equal(a.lm_head.weight, c.lm_head.weight)


@pytest.mark.parametrize("bad", [{"device_map": "auto"}, {"dtype": "float33"}])
def test_bad_init_kwargs_are_named(tiny_dir, bad):
    with pytest.raises(ValueError, match="device_map|dtype"):
        model_loading.load_model(tiny_dir, bad)


def test_tokenizer_pads_left_and_always_has_pad(tiny_dir, tmp_path):
    tok = model_loading.load_tokenizer(tiny_dir)
    enc = tok(["a", "abc"], padding=True)
    assert tok.padding_side == "left" and enc["input_ids"][0][0] == tok.pad_token_id
    bare = PreTrainedTokenizerFast(tokenizer_object=model_loading.build_byte_tokenizer().backend_tokenizer,
                                   eos_token="<|endoftext|>")
    bare.save_pretrained(tmp_path / "nopad")
    tok2 = model_loading.load_tokenizer(str(tmp_path / "nopad"))
    assert tok2.pad_token_id == tok2.eos_token_id


def test_byte_tokenizer_encodes_any_text():
    tok = model_loading.build_byte_tokenizer()
    for text in ["plain", "ünïcödé ✓ 数学 🙂", "\x00\t\n  trailing  ", "#### 1,000 \\boxed{8{,}000}"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text.encode()) and tok.decode(ids) == text


def test_reference_is_a_frozen_copy_of_the_policy(tiny_dir):
    policy = model_loading.load_model(tiny_dir, {"dtype": "float32"})
    assert model_loading.build_reference_model(policy, beta=0.0) is None
    ref = model_loading.build_reference_model(policy, beta=0.04)
    assert ref is not policy and not ref.training
    assert all(not p.requires_grad for p in ref.parameters())
    for (k, a), b in zip(policy.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), k
    assert ref.lm_head.weight.data_ptr() != policy.lm_head.weight.data_ptr()  # its own memory, not a view


def test_reward_function_error_names_function_and_completion():
    def picky(prompts, completions, **_):
        return [1.0 / (len(c) - 3) for c in completions]  # fails on the 3-character completion

    with pytest.raises(rewards.RewardFunctionError) as e:
        rewards.score_completions([picky], [1.0], ["p"] * 3, ["hello", "abc", "xy"], {})
    msg = str(e.value)
    assert "'picky'" in msg and "ZeroDivisionError" in msg and "'abc'" in msg and "completion 1" in msg


@pytest.mark.parametrize("returned, words", [([1.0], "returned 1 scores for 2"), (None, "returned None"),
                                             (["1", 2.0], "expected a finite number or None"),
                                             ([float("inf"), 1.0], "expected a finite number")])
def test_reward_function_bad_return_is_named(returned, words):
    def sloppy(prompts, completions, **_):
        return returned

    with pytest.raises(rewards.RewardFunctionError, match=words) as e:
        rewards.score_completions([sloppy], [1.0], ["p", "q"], ["a", "b"], {})
    assert "'sloppy'" in str(e.value)


def test_weighted_total_and_none():
    def f1(prompts, completions, **_):
        return [1.0, None, None, 0.5]

    def f2(prompts, completions, gold, **_):
        return [float(c == g) for c, g in zip(completions, gold)][:3] + [None]

    total, parts = rewards.score_completions([f1, f2], [2.0, 0.5], ["p"] * 4, ["a", "b", "x", "d"],
                                             {"gold": ["a", "b", "c", "z"]})
    assert set(parts) == {"f1", "f2"}
    assert total[0] == 2.5 and total[1] == 0.5 and total[2] == 0.0 and total[3] == 1.0
    total, _ = rewards.score_completions([f1], [1.0], ["p"] * 4, ["a"] * 4, {})
    assert torch.isnan(total[1]) and torch.isnan(total[2])


def test_builtin_rewards():
    assert rewards.length_reward(None, ["x" * 20, "x" * 10, "x" * 40]) == [0.0, -0.5, -1.0]
    good = "<think>because</think>\n<answer>4</answer>"
    assert rewards.format_reward(None, [good, "4", good + " extra", "<think><answer>4</answer>"]) == [1.0, 0, 0, 0]
    assert tasks.next_letter.next_letter_reward(None, ["bbbb", "bxbx", "", "Bbb"], answer=["b", "b", "b", "b"]) == [1, .5, 0, .5]
    task = tasks.get_task("next_letter")
    rows = task.make_prompts(__import__("random").Random(0), 50)
    for r in rows:  # the answer is the letter after the prompt's letter, so it depends on the prompt
        assert r["answer"] == next_letter.LETTERS[(next_letter.LETTERS.index(r["prompt"][0]) + 1) % len(next_letter.LETTERS)]
    assert len({r["answer"] for r in rows}) == len(next_letter.LETTERS)
    with pytest.raises(ValueError, match="task"):
        tasks.get_task("nope")


def naive_soft_overlong(length, max_len, cache):
    """DAPO's Eq. 13."""
    if length <= max_len - cache:
        return 0.0
    if length <= max_len:
        return ((max_len - cache) - length) / cache
    return -1.0


def test_soft_overlong_punishment_follows_dapo():
    ids = [[1] * n for n in (0, 70, 80, 81, 90, 100, 101)]
    expected = [naive_soft_overlong(len(x), 100, 20) for x in ids]
    assert rewards.get_soft_overlong_punishment(100, 20)(ids) == expected
    assert expected[4] == -0.5 and expected[-1] == -1.0  # TRL's documented example: 90 tokens of 100, cache 20
    assert rewards.soft_overlong_punishment(completion_ids=ids, max_completion_length=100, soft_punish_cache=20,
                                            prompts=None, completions=None) == expected
    assert rewards.soft_overlong_punishment(ids, 100, 0) == [0.0] * 6 + [-1.0]


def test_reward_functions_get_completion_ids_and_the_step():
    seen = {}

    def recorder(prompts, completions, completion_ids, step, **kwargs):
        seen.update(ids=completion_ids, step=step, cache=kwargs["soft_punish_cache"])
        return [float(len(x)) for x in completion_ids]
    ids = [[5, 6], [7], [8, 9, 10]]
    total, _ = rewards.score_completions([recorder, rewards.soft_overlong_punishment], [1.0, 1.0], ["p"] * 3,
                                         ["a", "b", "c"], {"completion_ids": ids},
                                         context={"step": 7, "max_completion_length": 3, "soft_punish_cache": 2})
    assert seen == {"ids": ids, "step": 7, "cache": 2}
    torch.testing.assert_close(total, torch.tensor([2 - 0.5, 1.0, 3 - 1.0], dtype=total.dtype))
    # neither needs a data column: both are given by the trainer
    assert tasks._required_fields(recorder) == [] and tasks._required_fields(rewards.soft_overlong_punishment) == []
