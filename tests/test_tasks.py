"""Tasks: answer extraction, countdown checking, hostile completions, prompt sources, each task end to end."""

import json
import os
import re
import signal
import sys
from fractions import Fraction

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import model_loading  # noqa: E402
import rewards  # noqa: E402
import test_layout  # noqa: E402
import tasks.countdown  # noqa: E402
import tasks.gsm8k  # noqa: E402
import tasks.next_letter  # noqa: E402
import tasks  # noqa: E402
from tasks import countdown  # noqa: E402
import train  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K = os.path.join(ROOT, "tests", "data", "gsm8k_tiny.jsonl")
TLDR = os.path.join(ROOT, "tests", "data", "tldr_tiny.jsonl")
TINY_RUN = ["--num_generations=2", "--prompts_per_step=2", "--micro_batch_size=4", "--max_completion_length=4",
            "--max_prompt_length=48", "--max_steps=2", "--print_completions_every=0"]


@pytest.mark.parametrize("text, expected", [
    ("#### 1,000", 1000),
    ("so the total is\n#### 1,000", 1000),
    (r"The final answer is \boxed{8{,}000}.", 8000),
    (r"\boxed{8,000}", 8000),
    (r"\boxed{ 18 \text{ dollars}}", 18),
    (r"\boxed{\$42}", 42),
    (r"\boxed{\frac{3}{4}}", Fraction(3, 4)),
    ("The temperature is now -5 degrees.", -5),
    ("The answer is \u22125", -5),
    ("The answer is 5.00", 5),
    ("The answer is 5.00.", 5),
    ("#### 72\n\nI hope this helps! Let me know if you need 3 more examples.", 72),
    (r"\boxed{12} because 3 * 4 = 12, and 99 is wrong", 12),
    ("Answer: $1,234.50", Fraction(123450, 100)),
    ("First 3 apples, then 7 more, so 10 apples", 10),
    ("It ranges over 3-5 days", 5),     # a subtraction sign, not a negative number
    ("no number here", None),
    ("", None),
    (r"\boxed{}", None),
    ("1,2,3", None),                    # not a thousands-grouped number
    ("9" * 100, None),                  # too many digits to be an answer
])
def test_extract_final_number(text, expected):
    value = rewards.extract_final_number(text)
    assert value == (None if expected is None else Fraction(expected))


def test_gsm8k_correctness_and_format_rewards():
    completions = [r"... so \boxed{1000}", "#### 1,000", "it is 999", r"\boxed{one thousand}"]
    gold = ["1000"] * 4
    assert tasks.gsm8k.gsm8k_correctness_reward(None, completions, answer=gold) == [1.0, 1.0, 0.0, 0.0]
    assert tasks.gsm8k.gsm8k_format_reward(None, completions) == [1.0, 0.0, 0.0, 0.0]


def test_gold_answers_are_parsed_at_load_time(tmp_path):
    path = tmp_path / "bad.jsonl"
    rows = [{"question": "1+1?", "answer": "#### 2"}, {"question": "?", "answer": "#### 3"},
            {"question": "2+2?", "answer": "It is four. #### four"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"row 2: cannot read a number from the gold answer"):
        tasks.get_task("gsm8k", dataset=str(path))
    task = tasks.get_task("gsm8k", dataset=GSM8K)
    golds = {r["answer"] for r in task.rows}
    assert {"1000", "-5", "9/2", "5500"} <= golds  # '#### 1,000', '#### -5', '#### 4.5', '#### 5,500'


@pytest.mark.parametrize("answer, nums, target, ok", [
    ("(1 + 2) * 3", [1, 2, 3], 9, True),
    ("3 * (1 + 2)", [3, 2, 1], 9, True),
    ("44 + 19 - 35", [44, 19, 35], 28, True),
    ("95 - 50 / 25", [50, 95, 25, 7], 93, True),       # not every number has to be used
    ("(10 - 4) / 3", [10, 4, 3], 2, True),
    ("10 / 4 * 2", [10, 4, 2], 5, True),               # exact fractions in between
    ("(1 + 2) * 3 = 9", [1, 2, 3], 9, True),           # the equation with its result
    ("1 + 2 + 4", [1, 2, 3], 7, False),                # 4 is not given
    ("3 + 3 + 1", [1, 2, 3], 7, False),                # 3 used twice
    ("(1 + 2) * 3", [1, 2, 3], 10, False),             # wrong value
    ("1.5 * 2", [1, 2, 3], 3, False),                  # decimals
    ("15 * 2 / 10", [15, 2, 10], 3, True),
    ("2 ** 3", [2, 3], 8, False),                      # exponent
    ("2 ^ 3", [2, 3], 8, False),
    ("pow(2, 3)", [2, 3], 8, False),
    ("-1 + 4", [1, 4], 3, False),                      # unary minus makes a number that was not given
    ("4 / (2 - 2)", [4, 2, 2], 1, False),              # division by zero
    ("__import__('os').system('echo hacked')", [1], 1, False),
    ("exec('x=1')", [1], 1, False),
    ("(lambda: 9)()", [9], 9, False),
    ("((((1))))", [1], 1, True),
    ("(" * 50 + "1" + ")" * 50, [1], 1, False),        # nested too deep
    ("1 +", [1], 1, False),
    ("", [1], 1, False),
    ("1 2", [1, 2], 12, False),
    ("999999 * 999999 * 999999", [999999, 999999, 999999], 1, False),
])
def test_countdown_cases(answer, nums, target, ok):
    completion = f"<think>trying</think>\n<answer>{answer}</answer>"
    assert tasks.countdown.countdown_reward(None, [completion], nums=[nums], target=[target]) == [1.0 if ok else 0.0]


def test_countdown_uses_the_last_answer_and_needs_tags():
    good = "<answer>1 + 1</answer> no wait <answer>(1 + 2) * 3</answer>"
    assert tasks.countdown.countdown_reward(None, [good, "(1 + 2) * 3"], nums=[[1, 2, 3]] * 2, target=[9, 9]) == [1.0, 0.0]


def test_countdown_problems_are_seeded_and_reachable():
    import random
    a = [countdown.countdown_problem(random.Random(s)) for s in range(50)]
    b = [countdown.countdown_problem(random.Random(s)) for s in range(50)]
    assert a == b
    for nums, target in a:
        assert 3 <= len(nums) <= 4 and all(1 <= n <= 99 for n in nums) and 1 <= target <= 1000
        assert _reachable(nums, target), (nums, target)


def _reachable(nums, target):
    """Brute force: can some subset of nums reach target with + - * / (any order, any bracketing)?"""
    values = [Fraction(n) for n in nums]
    if target in values:
        return True
    for i in range(len(values)):
        for j in range(len(values)):
            if i == j:
                continue
            rest = [values[k] for k in range(len(values)) if k not in (i, j)]
            a, b = values[i], values[j]
            for v in [a + b, a - b, a * b] + ([a / b] if b else []):
                if _reachable(rest + [v], target):
                    return True
    return False


HOSTILE = [
    "x" * 200_000,
    "<answer>" * 25_000,
    "<think>" + "a" * 199_000 + "</think><answer>1+1</answer>" * 100,
    "<answer>" + "(" * 200_000 + "</answer>",
    "<answer>" + "1+" * 100_000 + "1</answer>",
    "\\boxed{" * 28_000,
    "#### " + "9" * 200_000,
    "1," * 100_000,
    "answer is " + " " * 199_990,
    "<think>" + "</think><answer>" * 12_000 + "</answer>",
    "<answer>__import__('os').system('touch PWNED')</answer>" * 3000,
    "<answer>" + "9" * 199_990 + "</answer>",
]


@pytest.mark.parametrize("fn", [tasks.gsm8k.gsm8k_correctness_reward, tasks.gsm8k.gsm8k_format_reward,
                                tasks.countdown.countdown_reward, rewards.format_reward, tasks.next_letter.next_letter_reward,
                                rewards.length_reward])
def test_hostile_completions_score_zero_and_run_nothing(fn, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # a hang guard, not a speed check (bench/README report the time): a catastrophic regex would never return
    signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(TimeoutError(f"{fn.__name__} hangs")))
    signal.alarm(60)
    try:
        scores = fn([""] * len(HOSTILE), HOSTILE, answer=["2"] * len(HOSTILE), nums=[[1, 2]] * len(HOSTILE),
                    target=[3] * len(HOSTILE))
    finally:
        signal.alarm(0)
    assert len(scores) == len(HOSTILE)
    if fn is not rewards.length_reward:  # length_reward is negative for long text, by design
        assert all(s == 0.0 for s in scores), scores
    assert not os.path.exists(tmp_path / "PWNED")


def test_no_eval_or_exec_anywhere():
    """The trainer evaluates nothing it reads. The one exception is sandbox/code_harness.py, the unit-test judge of the code
    task: it runs only inside sandbox/executor.py's sandbox, as the program there, and nothing of the trainer imports it."""
    call = re.compile(r"(?<![\w.])(eval|exec|compile)\s*\(|literal_eval")
    for name in test_layout.project_files():
        src = open(os.path.join(ROOT, name)).read()
        assert not re.search(r"^\s*(import|from)\s+(sandbox\.)?code_harness\b", src, re.M), f"{name} imports it"
        assert not re.search(r"^\s*from\s+sandbox\s+import\s+.*\bcode_harness\b", src, re.M), f"{name} imports it"
        if name != "sandbox/code_harness.py":
            assert not call.search(src), f"{name}: {call.search(src).group()}"


def test_dataset_prompts_are_a_pure_function_of_seed_and_step():
    t1 = tasks.get_task("gsm8k", dataset=GSM8K)
    t2 = tasks.get_task("gsm8k", dataset=GSM8K)
    n, total = 4, len(t1.rows)
    for step in (1, 2, 3, 7):
        assert t1.prompts_for_step(0, step, n) == t2.prompts_for_step(0, step, n)
    # one epoch (total rows / n steps) visits every row exactly once
    epoch = [r["prompt"] for s in range(1, total // n + 1) for r in t1.prompts_for_step(0, s, n)]
    assert sorted(epoch) == sorted(t1._format(r)["prompt"] for r in t1.rows)
    assert t1.prompts_for_step(0, 1, n) != t1.prompts_for_step(1, 1, n)
    # asking out of order gives the same rows as asking in order (what a resumed run does)
    later = tasks.get_task("gsm8k", dataset=GSM8K).prompts_for_step(0, 5, n)
    assert later == t1.prompts_for_step(0, 5, n)
    # dynamic sampling's further rounds: a function of (seed, step, round) too, other rows than round 0's
    for task in (t1, tasks.get_task("next_letter")):
        again = tasks.get_task("gsm8k", dataset=GSM8K) if task is t1 else tasks.get_task("next_letter")
        rounds = [task.prompts_for_step(0, 3, n, r) for r in range(3)]
        assert rounds == [again.prompts_for_step(0, 3, n, r) for r in range(3)]
        assert rounds[0] == task.prompts_for_step(0, 3, n)
        assert rounds[1] != rounds[0] and rounds[2] != rounds[1] and rounds[1] != task.prompts_for_step(0, 4, n, 1)


def test_held_out_rows_are_not_trained_on():
    task = tasks.get_task("gsm8k", dataset=GSM8K, eval_prompts=3)
    assert len(task.eval_rows) == 3 and len(task.rows) == 9
    train_q = {r["question"] for r in task.rows}
    assert not train_q & {r["prompt_text"] for r in task.eval_rows}
    with pytest.raises(ValueError, match="eval_prompts=12"):
        tasks.get_task("gsm8k", dataset=GSM8K, eval_prompts=12)


def test_chat_template_formats_prompts(tmp_path):
    path = model_loading.write_tiny_model(str(tmp_path / "m"), chat_template=model_loading.TINY_CHAT_TEMPLATE)
    tok = model_loading.load_tokenizer(path)
    row = tasks.get_task("gsm8k", tokenizer=tok, dataset=GSM8K).prompts_for_step(0, 1, 1)[0]
    assert row["prompt"].startswith("<|im_start|>system\n" + tasks.gsm8k.GSM8K_SYSTEM_PROMPT)
    assert row["prompt"].endswith(row["prompt_text"] + "<|im_end|>\n<|im_start|>assistant\n")
    plain = tasks.get_task("gsm8k", tokenizer=model_loading.build_byte_tokenizer(), dataset=GSM8K)
    assert "<|im_start|>" not in plain.prompts_for_step(0, 1, 1)[0]["prompt"]


def test_prompt_column_dataset_passes_other_columns_by_name(tmp_path):
    path = tmp_path / "letters.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}>", "answer": b, "note": "x"}) + "\n"
                            for a, b in zip("abcdefg", "bcdefgh")))
    task = tasks.get_task("next_letter", dataset=str(path))
    rows = task.prompts_for_step(0, 1, 3)
    assert all(set(r) >= {"prompt", "answer", "note"} for r in rows)
    missing = tmp_path / "noanswer.jsonl"
    missing.write_text(json.dumps({"prompt": "a>"}) + "\n")
    with pytest.raises(ValueError, match="reward function 'next_letter_reward' needs a column 'answer'"):
        tasks.get_task("next_letter", dataset=str(missing))
    with pytest.raises(ValueError, match="neither .jsonl nor .parquet"):
        tasks.get_task("next_letter", dataset=__file__)


def test_parquet_dataset(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    rows = tasks.load_rows(GSM8K)
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "g.parquet"))
    task = tasks.get_task("gsm8k", dataset=str(tmp_path / "g.parquet"))
    assert task.prompts_for_step(3, 2, 4) == tasks.get_task("gsm8k", dataset=GSM8K).prompts_for_step(3, 2, 4)


def test_unknown_task_and_preset_are_named():
    with pytest.raises(SystemExit, match="--task"):
        train.parse_config(["--task=chess"])
    with pytest.raises(SystemExit, match="--preset: unknown preset 'nope'"):
        train.parse_config(["--preset=nope"])


def test_presets_apply_before_command_line():
    cfg = train.parse_config(["--preset=gsm8k-qwen2.5-0.5b", "--lr=3e-6"])
    assert cfg.task == "gsm8k" and cfg.model == "Qwen/Qwen2.5-0.5B-Instruct" and cfg.lr == 3e-6
    assert cfg.model_init_kwargs == {"attn_implementation": "sdpa"}  # no dtype: float32 weights for AdamW


def _run(tmp_path, *args):
    out = tmp_path / "out"
    train.main([f"--out_dir={out}", *TINY_RUN, *args])
    lines = [json.loads(l) for l in open(out / "metrics.jsonl")]
    assert [m["step"] for m in lines] == [1, 2]
    return lines


def test_gsm8k_end_to_end(tmp_path):
    lines = _run(tmp_path, "--task=gsm8k", f"--dataset={GSM8K}")
    assert "reward/gsm8k_correctness_reward" in lines[-1] and "reward/gsm8k_format_reward" in lines[-1]


def test_countdown_end_to_end(tmp_path):
    lines = _run(tmp_path, "--task=countdown")
    assert "reward/countdown_reward" in lines[-1] and "reward/format_reward" in lines[-1]


def test_tldr_end_to_end_with_a_reward_model(tmp_path):
    rm = model_loading.write_tiny_reward_model(str(tmp_path / "rm"))
    lines = _run(tmp_path, "--task=tldr", f"--dataset={TLDR}", f"--reward_model={rm}")
    # a random reward model gives distinct real-valued scores: there is something to learn from
    assert lines[0]["reward_std"] > 0 and lines[0]["reward/reward_model"] == lines[0]["reward/reward_model"]


def test_tldr_without_a_reward_model_is_an_error():
    with pytest.raises(ValueError, match="task tldr: needs a reward model"):
        tasks.get_task("tldr", dataset=TLDR)


def test_prompt_column_dataset_end_to_end(tmp_path):
    path = tmp_path / "letters.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}>", "answer": b}) + "\n" for a, b in zip("abcdefg", "bcdefgh")))
    lines = _run(tmp_path, "--task=next_letter", f"--dataset={path}", "--reward_model=tiny")
    assert "reward/next_letter_reward" in lines[-1] and "reward/reward_model" in lines[-1]


def test_dataset_rows_with_different_columns_are_refused(tmp_path):
    path = tmp_path / "uneven.jsonl"
    path.write_text(json.dumps({"prompt": "a>", "answer": "b", "source": "x"}) + "\n" +
                    json.dumps({"prompt": "b>", "answer": "c"}) + "\n")
    with pytest.raises(ValueError, match=r"row 1: columns \['answer', 'prompt'\] differ"):
        tasks.get_task("next_letter", dataset=str(path))
