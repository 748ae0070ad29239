"""Rewards a model could game, rewards that overflow, and how reward functions are called."""

import signal
from fractions import Fraction

import numpy as np
import pytest
import torch

import grpo
import rewards
import tasks.gsm8k
from test_objective import naive_advantages


def correctness(gold, completion):
    return tasks.gsm8k.gsm8k_correctness_reward(None, [completion], answer=[gold])[0]


# ----------------------------------------------------------------------------- answer extraction


@pytest.mark.parametrize("spaces", range(50, 70))
@pytest.mark.parametrize("marker", ["#### ", "The answer is ", "answer:", "So the answer is the "])
def test_a_number_cut_by_a_window_is_not_read_shorter(marker, spaces):
    completion = marker + " " * spaces + "7234"
    assert correctness("72", completion) == 0.0
    assert correctness("7", completion) == 0.0
    assert correctness("7234", completion) == 1.0
    # the marker's number wins over a later one, however far the spaces push it
    assert correctness("7234", completion + " and then 5 more") == 1.0


@pytest.mark.parametrize("k", range(12))
def test_answer_marker_after_characters_that_lowercase_longer(k):
    completion = "\u0130" * k + "The answer is 72."  # 'İ'.lower() is two code points
    assert correctness("72", completion) == 1.0
    assert correctness("2", completion) == 0.0
    assert correctness("72", "\u0130" * k + "So the ANSWER: 1234 and later 5") == 0.0


@pytest.mark.parametrize("completion, gold", [
    (r"\boxed{\frac{5}{0}}", "0"),
    (r"\boxed{\frac{5}{0}}", "5"),
    (r"So it is 0. \boxed{\frac{5}{0}}", "0"),
    (r"\boxed{\dfrac{5}{0}} #### 0", "0"),
    (r"\boxed{\frac{5}{0.0}}", "0"),
    (r"\boxed{\frac{x}{0}}", "0"),
    (r"\boxed{\frac12}", "12"),           # shorthand for 1/2, not twelve
    (r"\boxed{5/0}", "0"),
    (r"\boxed{5 \div 0}", "0"),
    (r"\boxed{x/2}", "2"),
    (r"It is 72. \boxed{\text{seventy-two}}", "72"),
])
def test_unreadable_boxed_answer_does_not_fall_back(completion, gold):
    assert correctness(gold, completion) == 0.0
    assert tasks.gsm8k.gsm8k_format_reward(None, [completion]) == [0.0]


@pytest.mark.parametrize("completion, gold", [
    (r"\boxed{\frac{9}{2}}", "9/2"),
    (r"\boxed{9/2}", "9/2"),
    (r"\boxed{-\frac{1}{2}}", "-1/2"),
    (r"\boxed{\tfrac{3}{4}}", "3/4"),
    (r"\boxed{12 / 3 = 4}", "4"),
    (r"\boxed{\$20/\text{hour}}", "20"),
    (r"Put it in \boxed{}: #### 72", "72"),  # an empty box is no box
])
def test_readable_boxed_answers(completion, gold):
    assert correctness(gold, completion) == 1.0


GOOD = "<think>because</think>\n<answer>4</answer>"


@pytest.mark.parametrize("junk", [" " * 30_000 + "junk", "x" * 30_000, "\n" * 25_000, " " * 201],
                         ids=["spaces-then-junk", "letters", "newlines", "201-spaces"])
def test_format_reward_sees_the_whole_completion(junk):
    assert rewards.format_reward(None, [GOOD + junk]) == [0.0]


def test_format_reward_accepts_the_longest_well_formed_completion():
    longest = (" " * 200 + "<think>" + "a" * 20_000 + "</think>" + " " * 200 + "<answer>" + "4" * 2000
               + "</answer>" + " " * 200)
    assert rewards.format_reward(None, [GOOD, "\n" + GOOD + "\n\n", longest]) == [1.0, 1.0, 1.0]
    assert rewards.format_reward(None, [longest + " ", longest.replace("a", "aa", 1)]) == [0.0, 0.0]


def test_ordinary_correct_completions_still_score_one():
    cases = [
        ("72", "Natalia sold 48 + 24 = 72 clips.\n#### 72"),
        ("72", r"She sold 48 in April and 24 in May, so \boxed{72}."),
        ("1000", "The answer is 1,000."),
        ("1000", "Answer: $1,000"),
        ("-5", "So the temperature is -5"),
        ("9/2", "The answer is 4.5"),
        ("8000", r"The final answer is \boxed{8{,}000}."),
        ("18", r"\boxed{ 18 \text{ dollars}}"),
        ("3/4", r"\boxed{\frac{3}{4}}"),
        ("5", "the ANSWER IS: 5.00"),
    ]
    assert tasks.gsm8k.gsm8k_correctness_reward(None, [c for _, c in cases], answer=[g for g, _ in cases]) == [1.0] * 10


def test_new_hostile_inputs_stay_bounded():
    hostile = ["answer" + " is" * 100_000 + " 5", "answer" * 40_000, "#### " + " " * 200_000 + "1",
               "1" + ",0" * 100_000, r"\boxed{" + "1/" * 140 + "}" + "1/" * 100_000,
               "<think>" + "</think>" * 3000 + "\n" * 20_000]
    signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(TimeoutError("a reward hangs")))
    signal.alarm(60)  # a hang guard: a catastrophic regex would never return
    try:
        for fn in (tasks.gsm8k.gsm8k_correctness_reward, tasks.gsm8k.gsm8k_format_reward, rewards.format_reward):
            assert fn(None, hostile, answer=["2"] * len(hostile)) == [0.0] * len(hostile)
    finally:
        signal.alarm(0)


# ----------------------------------------------------------------------------- non-finite rewards


@pytest.mark.parametrize("bad", [1e39, -1e39, 10 ** 400, Fraction(10 ** 400), float("nan")],
                         ids=["1e39", "-1e39", "int-1e400", "fraction-1e400", "nan"])
def test_reward_that_is_not_finite_as_float32_is_named(bad):
    def huge(prompts, completions, **_):
        return [0.0, bad]

    with pytest.raises(rewards.RewardFunctionError, match="expected a finite number") as e:
        rewards.score_completions([huge], [1.0], ["p", "q"], ["fine", "the overflowing one"], {})
    assert "'huge'" in str(e.value) and "'the overflowing one'" in str(e.value) and "completion 1" in str(e.value)


@pytest.mark.parametrize("scores, weights", [([[3e38, 3e38], [3e38, 3e38]], [1.0, 1.0]),
                                             ([[1.0, 1e30], [1.0, 1.0]], [1.0, 1e10])])
def test_weighted_total_that_overflows_is_named(scores, weights):
    def first(prompts, completions, **_):
        return [s[0] for s in scores]

    def second(prompts, completions, **_):
        return [s[1] for s in scores]

    with pytest.raises(rewards.RewardFunctionError, match="overflows") as e:
        rewards.score_completions([first, second], weights, ["p", "q"], ["too much", "b"], {})
    msg = str(e.value)
    assert "'first'" in msg and "'second'" in msg and "'too much'" in msg and "completion 0" in msg


def test_largest_rewards_that_fit_are_kept():
    big = float(torch.finfo(torch.float32).max)

    def edge(prompts, completions, **_):
        return [big, -big, None]

    total, parts = rewards.score_completions([edge], [1.0], ["p"] * 3, ["a", "b", "c"], {})
    assert total[0] == big and total[1] == -big and torch.isnan(total[2]) and parts["edge"].dtype == torch.float32


def as_tensor(values):
    return torch.tensor([float("nan") if v is None else v for v in values], dtype=torch.float32)


MAX32 = float(torch.finfo(torch.float32).max)


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_group_statistics_do_not_overflow(scale):
    values = [MAX32, -MAX32, MAX32, None, 3e38, 3e38, 3e38, 3e38, -MAX32, -MAX32, 1.0, None]
    values = [None if v is None else float(np.float32(v)) for v in values]
    adv, std = grpo.group_advantages(as_tensor(values), 4, scale)
    assert adv.dtype == torch.float32 and torch.isfinite(adv).all() and torch.isfinite(std).all()
    torch.testing.assert_close(adv, torch.tensor(naive_advantages(values, 4, scale), dtype=torch.float32))
    assert (adv[4:8] == 0).all() and adv[3] == 0 and adv[11] == 0


def test_unscaled_advantages_that_cannot_be_stored_raise():
    fits = as_tensor([MAX32, -MAX32, 3e38, -3e38])
    adv, _ = grpo.group_advantages(fits, 2, "none")
    assert torch.isfinite(adv).all()
    with pytest.raises(ValueError, match="do not fit float32.*scale_rewards='none'"):
        grpo.group_advantages(as_tensor([MAX32, -MAX32, -MAX32]), 3, "none")
    with pytest.raises(ValueError, match="infinite"):
        grpo.group_advantages(torch.tensor([1.0, float("inf")]), 2)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_ordinary_advantages_unchanged(scale):
    values = [1.0, 0.0, 0.5, None, 0.2, 0.2, 0.2, 0.2, 3.0, -1.0, None, None, 0.0, 1.0, 1.0, 0.0, 0.1, None, None,
              None]
    values = [None if v is None else float(np.float32(v)) for v in values]
    adv, _ = grpo.group_advantages(as_tensor(values), 4, scale)
    assert adv.dtype == torch.float32 and not torch.isnan(adv).any()
    torch.testing.assert_close(adv, torch.tensor(naive_advantages(values, 4, scale), dtype=torch.float32),
                               atol=1e-6, rtol=1e-6)
    assert (adv[4:8] == 0).all() and (adv[16:] == 0).all()


# ----------------------------------------------------------------------------- calling reward functions


def test_reward_functions_are_called_with_keywords():
    seen = {}

    def trl_style(completions, **kwargs):
        seen.update(kwargs)
        return [float(len(c)) for c in completions]

    def ours(prompts, completions, answer, **kw):
        return [float(c == a) for c, a in zip(completions, answer)]

    total, parts = rewards.score_completions([trl_style, ours], [1.0, 10.0], ["p1", "p2"], ["ab", "x"],
                                             {"answer": ["ab", "y"], "note": ["n1", "n2"]})
    assert parts["trl_style"].tolist() == [2.0, 1.0] and parts["ours"].tolist() == [1.0, 0.0]
    assert total.tolist() == [12.0, 1.0]
    assert seen == {"prompts": ["p1", "p2"], "answer": ["ab", "y"], "note": ["n1", "n2"]}


def test_failing_keyword_style_function_is_retried_with_keywords():
    def trl_style(completions, **kwargs):
        return [1.0 / (len(c) - 3) for c in completions]

    with pytest.raises(rewards.RewardFunctionError) as e:
        rewards.score_completions([trl_style], [1.0], ["p"] * 3, ["hello", "abc", "xy"], {"answer": ["1"] * 3})
    msg = str(e.value)
    assert "'trl_style'" in msg and "ZeroDivisionError" in msg and "completion 1" in msg and "'abc'" in msg


def test_accepted_score_types():
    def mixed(prompts, completions, **_):
        return [True, 2, np.float32(0.5), np.float64(-1.5), np.int64(3), Fraction(1, 4), None]

    total, _ = rewards.score_completions([mixed], [1.0], ["p"] * 7, ["c"] * 7, {})
    assert total[:6].tolist() == [1.0, 2.0, 0.5, -1.5, 3.0, 0.25] and torch.isnan(total[6])
