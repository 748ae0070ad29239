"""GSM8K (Cobbe et al. 2021): grade-school math word problems, the final answer a number.

Prompts from the hub's openai/gsm8k (or --dataset with `question` / `answer` columns) under a system prompt that
asks for the answer in \\boxed{}; rewards: the final number right (1) and written boxed (0.1). Reading a final
number out of free text is rewards.extract_final_number's work, shared with other math tasks.
"""

from fractions import Fraction

from rewards import (MAX_SCAN_CHARS, _boxed_content, _normalise, _number_in_boxed, extract_final_number,
                     parse_number)
from tasks import Task


GSM8K_SYSTEM_PROMPT = ("Solve the math problem. Reason step by step, then give the final answer as a single "
                       "number in \\boxed{}.")


def parse_gold_answer(answer, where):
    """A dataset's gold answer ('... #### 72' or '72') -> its canonical string ('72', '-1/2').

    Fails loudly naming `where` (the row) instead of letting an unreadable gold
    answer turn into a free or impossible reward later.
    """
    text = str(answer)
    if "####" in text:
        text = text[text.rfind("####") + 4:]
    value = parse_number(text)
    if value is None:
        raise ValueError(f"{where}: cannot read a number from the gold answer {str(answer)[-200:]!r} "
                         f"(expected '... #### <number>' or a plain number)")
    return str(value)


def gsm8k_correctness_reward(prompts, completions, answer, completion_content=None, **_):
    """1 when the completion's final number equals the gold answer, else 0. The final answer is read from
    `completion_content` when given (the content without the reasoning, where the chat template's family
    separates them: a number written while thinking does not count)."""
    out = []
    for completion, gold in zip(completion_content if completion_content is not None else completions, answer):
        value = extract_final_number(completion)
        out.append(1.0 if value is not None and value == Fraction(gold) else 0.0)
    return out


def gsm8k_format_reward(prompts, completions, **_):
    """1 when the final answer is a number inside \\boxed{...}, as the system prompt asks."""
    out = []
    for completion in completions:
        boxed = _boxed_content(_normalise(completion[-MAX_SCAN_CHARS:]))
        out.append(1.0 if boxed is not None and _number_in_boxed(boxed) is not None else 0.0)
    return out


# the gold answers are parsed as the rows are loaded: a row whose answer cannot be read is named before training
gsm8k_correctness_reward.column_parsers = {"answer": parse_gold_answer}


def make(ctx):
    math_chat = ctx.chat(GSM8K_SYSTEM_PROMPT)

    def to_row(row):
        question = row["question"]
        return {"prompt": math_chat(question), "prompt_text": question, "answer": row["answer"]}
    return Task(None, [gsm8k_correctness_reward, gsm8k_format_reward], weights=[1.0, 0.1], to_row=to_row,
                accuracy_reward="gsm8k_correctness_reward", system_prompt=GSM8K_SYSTEM_PROMPT,
                hub=("openai/gsm8k", "main", "train", "test"))
