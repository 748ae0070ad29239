"""TL;DR: Reddit posts ending in "TL;DR:", scored by a reward model (TRL's GRPO documentation example).

Prompts from the hub's trl-lib/tldr (or --dataset with a `prompt` column), plain text as in the dataset.
"""

from tasks import Task


# the reward model the task uses when --reward_model is not given (the pairing of TRL's documentation example)
REWARD_MODEL = "weqweasdas/RM-Gemma-2B"


def make(ctx):
    if ctx.reward_model is None and not ctx.reward_funcs:
        raise ValueError("task tldr: needs a reward model (--reward_model=PATH or hub id) or --reward_funcs")

    def to_row(row):
        return {"prompt": row["prompt"], "prompt_text": row["prompt"]}
    return Task(None, [], to_row=to_row, hub=("trl-lib/tldr", None, "train", "validation"))
