"""The tool task: the answer is a code the model cannot know from its prompt.

Its environment draws one for each rollout and shows it only through a tool, so the reward rises only once the
policy learns to call the tool and copy what it returns. Small enough for the tiny model on a CPU: a call is two
tokens of its own chat format (<tool_call></tool_call>, the only tool, no arguments), the code one digit.
"""

import functools
import random

from environments import responses
from tasks import Task


class Vault:
    """The vault task's environment, written as TRL documents environments: reset, and one tool."""

    def reset(self, seed, **_):
        self.code = str(random.Random(f"vault-{seed}").randrange(10))
        return None  # nothing added to the prompt: the code is only in the tool

    def read_code(self) -> str:
        """Read the code of the vault.

        Returns:
            The code, one digit.
        """
        return self.code


def prompts(rng, n):
    return [{"prompt": "", "prompt_text": "code?", "seed": rng.randrange(1 << 30)} for _ in range(n)]


# the tiny model's chat template for the vault task: ChatML-like turns, and tool results written into the
# assistant's turn after <tool_response>, the turn going on right after the result (tool-integrated reasoning
# formats write results into the turn too): the answer is then the token after the code
TINY_TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% set after_tool = loop.index0 > 0 and messages[loop.index0 - 1]['role'] == 'tool' %}"
    "{% set before_tool = not loop.last and messages[loop.index0 + 1]['role'] == 'tool' %}"
    "{% if m['role'] == 'tool' %}<tool_response>{{ m['content'] }}"
    "{% else %}{% if not (m['role'] == 'assistant' and after_tool) %}<|im_start|>{{ m['role'] }}\n{% endif %}"
    "{{ m['content'] }}{% if not (m['role'] == 'assistant' and before_tool) %}<|im_end|>\n{% endif %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt and messages[-1]['role'] != 'tool' %}<|im_start|>assistant\n{% endif %}")


TINY_TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>"]
# the tiny model this task brings when --model=tiny: model_loading.write_tiny_model's keywords
TINY_MODEL = dict(chat_template=TINY_TOOL_TEMPLATE, extra_tokens=TINY_TOOL_TOKENS)


def vault_reward(completions, messages, environments, **_):
    """1 when the policy's last turn starts with the code its environment drew, else 0."""
    scores = []
    for conversation, env in zip(messages, environments):
        last = next((m["content"] for m in reversed(conversation) if m["role"] == "assistant"), "")
        scores.append(1.0 if last[:1] == env.code else 0.0)
    return scores


def tool_format_reward(completions, messages, call_opening=None, **_):
    """The vault task's format, step by step: 1 for a call that ran and then an answer that is one digit, 0.75 for
    a call that ran, 0.5 for a call opened in the policy's own format (also one the tool could not run), else 0.
    `call_opening`: the text a call opens with in the policy's family's format, found anywhere in the completion
    (make() reads it from the chat template: environments/responses.call_opening); without one, Hermes's
    `<tool_call>` as the first token. Like format_reward, it rewards the form and not the content: it lets a model that starts from
    random weights find the call and the kind of answer, after which vault_reward teaches it to answer with
    what the tool returned."""
    scores = []
    for c, conversation in zip(completions, messages):
        results = [m["content"] for m in conversation if m["role"] == "tool"]
        if any(not r.startswith("error: ") for r in results):  # a call that ran (a failed one is answered so)
            last = conversation[-1]["content"] if conversation[-1]["role"] == "assistant" else ""
            scores.append(1.0 if last[:1].isdigit() else 0.75)
        else:
            opened = call_opening in c if call_opening is not None else c.startswith("<tool_call>")
            scores.append(0.5 if opened or results else 0.0)
    return scores


def make(ctx):
    chat = ctx.chat()

    def to_row(row):  # the prompt is rendered with the tools by environments.Agent; here without, for the record
        return {**row, "prompt": chat(row["prompt_text"])}
    # a call opened as the policy's family writes one (Hermes without a known family)
    opening = responses.call_opening(ctx.tokenizer, ctx.chat_template_kwargs)
    own_format = functools.partial(tool_format_reward, call_opening=opening)
    own_format.__name__ = tool_format_reward.__name__  # logged and named as the function itself
    return Task(prompts, [vault_reward, own_format], weights=[1.0, 0.2], to_row=to_row,
                accuracy_reward="vault_reward", environment=Vault)
