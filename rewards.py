"""Reward functions and tasks.

A reward function is `f(prompts, completions, **fields) -> list[float | None]`:
one score per completion, `None` where it cannot score one (that completion
then gets advantage 0 instead of a made-up score). `fields` are the task's
per-prompt data (the gold answer, ...) repeated for each completion.

A task says where prompts come from and which reward functions score them.
"""

import random
import re
from dataclasses import dataclass, field
from typing import Callable

import torch

# ----------------------------------------------------------------------------- scoring


class RewardFunctionError(RuntimeError):
    pass


def _name(fn):
    return getattr(fn, "__name__", type(fn).__name__)


def _call_reward(fn, prompts, completions, fields):
    name = _name(fn)
    try:
        scores = fn(prompts, completions, **fields)
    except Exception as batch_error:
        # find the completion it fails on, so the message can show it
        for i, completion in enumerate(completions):
            one = {k: v[i:i + 1] for k, v in fields.items()}
            try:
                fn(prompts[i:i + 1], completions[i:i + 1], **one)
            except Exception as e:
                raise RewardFunctionError(
                    f"reward function '{name}' raised {type(e).__name__}: {e}\n"
                    f"  on completion {i}: {completion[:500]!r}\n  of prompt: {prompts[i][:300]!r}") from e
        raise RewardFunctionError(f"reward function '{name}' raised {type(batch_error).__name__}: {batch_error} "
                                  f"on the batch, though on no completion alone") from batch_error
    scores = list(scores) if scores is not None else None
    if scores is None or len(scores) != len(completions):
        got = "None" if scores is None else f"{len(scores)} scores"
        raise RewardFunctionError(f"reward function '{name}' returned {got} for {len(completions)} completions")
    for i, s in enumerate(scores):
        if s is not None and not isinstance(s, (int, float)):
            raise RewardFunctionError(f"reward function '{name}' returned {s!r} (a {type(s).__name__}) for "
                                      f"completion {i}: {completions[i][:500]!r}; expected a number or None")
    return scores


def score_completions(reward_funcs, weights, prompts, completions, fields):
    """Run every reward function; return (total (N,), {name: (N,)}) with NaN for None.

    The total is the weighted sum over the functions that scored a completion,
    NaN when none did.
    """
    parts = {}
    for fn in reward_funcs:
        scores = _call_reward(fn, prompts, completions, fields)
        parts[_name(fn)] = torch.tensor([float("nan") if s is None else float(s) for s in scores])
    stacked = torch.stack(list(parts.values()), dim=1)  # (N, F)
    w = torch.tensor(weights, dtype=stacked.dtype)
    total = torch.nansum(stacked * w, dim=1)
    total[torch.isnan(stacked).all(dim=1)] = float("nan")
    return total, parts


# ----------------------------------------------------------------------------- general-purpose rewards


def length_reward(prompts, completions, target_chars=20, **_):
    """Reward completions close to `target_chars` characters: 0 at the target, -1 per character away / target.

    Like the toy example in TRL's GRPO documentation.
    """
    return [-abs(len(c) - target_chars) / target_chars for c in completions]


_FORMAT = re.compile(r"^\s*<think>.{0,20000}?</think>\s*<answer>.{0,2000}?</answer>\s*$", re.DOTALL)


def format_reward(prompts, completions, **_):
    """1 when the completion is `<think>...</think><answer>...</answer>` and nothing else, else 0."""
    return [1.0 if _FORMAT.match(c[:25000]) else 0.0 for c in completions]


# ----------------------------------------------------------------------------- tasks


@dataclass
class Task:
    name: str
    make_prompts: Callable  # (rng: random.Random, n) -> list of dicts with "prompt" and other fields
    reward_funcs: list = field(default_factory=list)


# The default task: the prompt names a letter, the answer is the letter that
# follows it in the alphabet. The right answer depends on the prompt, so a
# rising reward means the model reads it rather than learning one constant reply.
LETTERS = "abcdefgh"


def _letter_prompts(rng, n):
    rows = []
    for _ in range(n):
        i = rng.randrange(len(LETTERS))
        rows.append({"prompt": f"{LETTERS[i]}>", "answer": LETTERS[(i + 1) % len(LETTERS)]})
    return rows


def next_letter_reward(prompts, completions, answer, **_):
    """Fraction of the completion's characters (up to its first 4) that are the answer letter."""
    out = []
    for c, a in zip(completions, answer):
        head = c[:4]
        out.append(sum(ch == a for ch in head) / 4)
    return out


def get_task(name):
    if name == "next_letter":
        return Task("next_letter", _letter_prompts, [next_letter_reward])
    raise ValueError(f"task: unknown task {name!r} (available: next_letter)")
