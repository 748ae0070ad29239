"""The default task: the prompt names a letter, the answer is the letter that follows it in the alphabet.

The right answer depends on the prompt, so a rising reward means the model reads it rather than learning one
constant reply. Small enough for the tiny model to learn on a CPU in a minute.
"""

from tasks import Task


LETTERS = "abcdefgh"


def prompts(rng, n):
    rows = []
    for _ in range(n):
        i = rng.randrange(len(LETTERS))
        text = f"{LETTERS[i]}>"  # no chat template: the prompt is the raw text
        rows.append({"prompt": text, "prompt_text": text, "answer": LETTERS[(i + 1) % len(LETTERS)]})
    return rows


def next_letter_reward(prompts, completions, answer, **_):
    """Fraction of the completion's characters (up to its first 4) that are the answer letter."""
    out = []
    for c, a in zip(completions, answer):
        head = c[:4]
        out.append(sum(ch == a for ch in head) / 4)
    return out


def make(ctx):
    return Task(prompts, [next_letter_reward], accuracy_reward="next_letter_reward")
