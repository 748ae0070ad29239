"""Tasks: where prompts come from and which reward functions score them.

A task is generated in code (next_letter, countdown), read from a local file
(.jsonl / .parquet; code reads tests/data/code_tiny.jsonl by default) or a hub
dataset (gsm8k, tldr, any `--dataset` with a `prompt` column), and may hold
back prompts for evaluation. Prompts for a step are a pure function of
(seed, step), so a resumed run sees the same ones.
The reward functions themselves live in rewards.py.
"""

import ast
import builtins
import inspect
import json
import os
import random
import sys
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable

import rewards
import shapes

def countdown_problem(rng, min_numbers=3, max_numbers=4, max_value=99, max_target=1000):
    """Numbers and a target reachable with them: combine the numbers in a random order with random operations."""
    while True:
        nums = [rng.randint(1, max_value) for _ in range(rng.randint(min_numbers, max_numbers))]
        order = nums[:]
        rng.shuffle(order)
        value = Fraction(order[0])
        for n in order[1:]:
            ops = ["+", "*"] + (["-"] if value - n > 0 else []) + (["/"] if value % n == 0 else [])
            op = rng.choice(ops)
            value = {"+": value + n, "-": value - n, "*": value * n, "/": value / n}[op]
        if value.denominator == 1 and 1 <= value <= max_target:
            return nums, int(value)


def countdown_prompt_text(nums, target):
    # wording after TinyZero's countdown prompt (Jiayi Pan et al., 2025)
    return (f"Using the numbers {list(nums)}, create an equation that equals {target}. You can use +, -, * and /, "
            f"parentheses, and each number at most once. Show your reasoning in <think> </think> tags, then give "
            f"only the equation in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>.")


def _countdown_prompts(rng, n):
    rows = []
    for _ in range(n):
        nums, target = countdown_problem(rng)
        rows.append({"nums": nums, "target": target})
    return rows


# ----------------------------------------------------------------------------- code: problems with unit tests

CODE_SAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "data", "code_tiny.jsonl")


def code_tests(row):
    """A row's unit tests: its `tests`, MBPP's `test_list`, or the asserts of HumanEval's `check(candidate)` (its
    `test` and `entry_point` columns). Each is one assert statement, or {"input": ..., "output": ...} text for a
    program that reads stdin; ValueError naming the first that is neither (parsed, never run)."""
    if "tests" in row:
        tests = row["tests"]
    elif "test_list" in row:
        tests = row["test_list"]
    elif "test" in row and "entry_point" in row:
        tests = _humaneval_asserts(row["test"], row["entry_point"])
    else:
        raise KeyError("tests")
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"tests: expected a non-empty list, got {tests!r:.80}")
    for i, test in enumerate(tests):
        if isinstance(test, dict):
            if set(test) != {"input", "output"} or not all(isinstance(v, str) for v in test.values()):
                raise ValueError(f"test {i}: expected {{\"input\": text, \"output\": text}}, got {test!r:.80}")
        elif isinstance(test, str):
            try:
                body = ast.parse(test).body
            except SyntaxError as e:
                raise ValueError(f"test {i} is not Python ({e.msg}): {test!r:.80}") from None
            if len(body) != 1 or not isinstance(body[0], ast.Assert):
                raise ValueError(f"test {i} is not one assert statement: {test!r:.80}")
        else:
            raise ValueError(f"test {i}: expected an assert statement or an input/output pair, got {test!r:.80}")
    if len({type(t) for t in tests}) > 1:
        raise ValueError("tests: either all assert statements or all input/output pairs")
    return list(tests)


def _humaneval_asserts(test_code, entry_point):
    """The asserts at the top of HumanEval's `def check(candidate)`, `candidate` renamed to the function's name; an
    assert that uses a variable of check() (a loop's) is left out, as it cannot stand alone."""
    check = next((n for n in ast.parse(test_code).body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    if check is None or not check.args.args:
        raise ValueError("test: no check(candidate) function")
    candidate, out = check.args.args[0].arg, []
    for node in check.body:
        if not isinstance(node, ast.Assert):
            continue
        names = [n for n in ast.walk(node) if isinstance(n, ast.Name)]
        if all(n.id == candidate or hasattr(builtins, n.id) or n.id in sys.stdlib_module_names for n in names):
            for n in names:
                n.id = entry_point if n.id == candidate else n.id
            out.append(ast.unparse(node))
    return out


def code_prompt_text(problem, tests):
    """The problem, its first test as an example, and how to answer."""
    if isinstance(tests[0], dict):
        example = (f"The program reads standard input and writes standard output. For example, for the input\n"
                   f"{tests[0]['input'].rstrip()}\nit prints\n{tests[0]['output'].rstrip()}\n")
    else:
        example = f"Your code should pass this test:\n{tests[0]}\n"
    return f"{problem.strip()}\n{example}Write the whole solution in one ```python code block."


# ----------------------------------------------------------------------------- data


def load_rows(source, split="train", config_name=None):
    """A list of dicts from a local .jsonl / .parquet file, or a hub dataset through `datasets`."""
    if source.endswith(".jsonl"):
        rows = []
        with open(source, "rb") as f:  # decoded line by line, so that a byte that is not UTF-8 has a line number
            for line_no, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{source}:{line_no}: not UTF-8 text (byte {raw[e.start]:#04x} at column "
                                     f"{e.start + 1}); a .jsonl file holds one JSON object per line. A binary "
                                     f"file?") from None
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{source}:{line_no}: not valid JSON ({e})") from e
                    if not isinstance(row, dict):
                        raise ValueError(f"{source}:{line_no}: expected a JSON object, got {type(row).__name__}")
                    rows.append(row)
        return rows
    if source.endswith(".parquet"):
        import pyarrow.parquet as pq
        return pq.read_table(source).to_pylist()
    if os.path.exists(source):
        raise ValueError(f"dataset: {source!r} is neither .jsonl nor .parquet")
    import datasets
    return list(datasets.load_dataset(source, config_name, split=split))


def _holdout(rows, n_eval, seed, source):
    """Split one local file into (train, eval): a seeded choice of `n_eval` rows is held out."""
    if n_eval <= 0:
        return rows, []
    if len(rows) <= n_eval:
        raise ValueError(f"dataset {source}: {len(rows)} rows cannot spare eval_prompts={n_eval} held-out rows")
    order = list(range(len(rows)))
    random.Random(f"holdout-{seed}").shuffle(order)
    held = set(order[:n_eval])
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in sorted(held)]


def _required_fields(fn):
    """Keyword parameters a reward function needs from the data (no default, not prompts/completions)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    given = ("prompts", "completions", "messages", "environments",  # these two: with tools or an environment
             "completion_ids", "step", "max_completion_length", "soft_punish_cache",  # from the trainer
             "completion_messages", "completion_content", "reasoning_content", "tool_calls")  # responses.py
    return [p.name for p in params if p.default is inspect.Parameter.empty and p.name not in given
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


# ----------------------------------------------------------------------------- tasks


@dataclass
class Task:
    name: str
    make_prompts: Callable = None  # procedural prompts: (rng, n) -> rows; None when rows come from a dataset
    reward_funcs: list = field(default_factory=list)
    weights: list = None           # default reward weights (None = all 1); --reward_weights overrides
    rows: list = None              # dataset rows, raw; formatted by to_row when drawn
    to_row: Callable = None        # raw row -> {"prompt": text, other fields}; None = rows are ready
    eval_rows: list = field(default_factory=list)  # held-out rows, formatted
    accuracy_reward: str = None    # name of the reward function that is 1 exactly when an answer is correct
    environment: type = None       # the task's own environment class (one instance per rollout), or None
    system_prompt: str = None      # the system message of the task's chat prompts, if any
    formats_prompt_column: bool = False  # to_row also formats rows that bring a `prompt` column (else used as is)

    def _format(self, row):
        return self.to_row(row) if self.to_row is not None else row

    def prompts_for_step(self, seed, step, n, round=0):
        """The `n` rows of step `step` (1-based): a pure function of (seed, step), so a resumed run sees the same.

        Datasets are walked in a seeded permutation per epoch, every row once per epoch. `round` > 0: the step's
        further draws of dynamic sampling, a pure function of (seed, step, round) too: generated prompts from
        their own stream; dataset rows drawn at random from the whole set, apart from the epoch's walk.
        """
        if round:
            rng = random.Random(f"round-{seed}-{step}-{round}")
            if self.rows is None:
                return [self._format(r) for r in self.make_prompts(rng, n)]
            return [self._format(self.rows[rng.randrange(len(self.rows))]) for _ in range(n)]
        if self.rows is None:
            return [self._format(r) for r in self.make_prompts(random.Random(seed * 1_000_003 + step), n)]
        out, total = [], len(self.rows)
        for i in range((step - 1) * n, step * n):
            epoch, j = divmod(i, total)
            out.append(self._format(self.rows[self._permutation(seed, epoch)[j]]))
        return out

    def _permutation(self, seed, epoch):
        cache = self.__dict__.setdefault("_perm_cache", {})
        if (seed, epoch) not in cache:
            order = list(range(len(self.rows)))
            random.Random(f"epoch-{seed}-{epoch}").shuffle(order)
            cache.clear()  # one epoch at a time is enough
            cache[(seed, epoch)] = order
        return cache[(seed, epoch)]


# The default task: the prompt names a letter, the answer is the letter that
# follows it in the alphabet. The right answer depends on the prompt, so a
# rising reward means the model reads it rather than learning one constant reply.
LETTERS = "abcdefgh"


def _letter_prompts(rng, n):
    rows = []
    for _ in range(n):
        i = rng.randrange(len(LETTERS))
        text = f"{LETTERS[i]}>"  # no chat template: the prompt is the raw text
        rows.append({"prompt": text, "prompt_text": text, "answer": LETTERS[(i + 1) % len(LETTERS)]})
    return rows


# The tool task: the answer is a code the model cannot know from its prompt. Its environment draws one for
# each rollout and shows it only through a tool, so the reward rises only once the policy learns to call the
# tool and copy what it returns. Small enough for the tiny model on a CPU: a call is two tokens of its own
# chat format (<tool_call></tool_call>, the only tool, no arguments), the code one digit.


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


def _vault_prompts(rng, n):
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
# the tiny model a task brings when --model=tiny: write_tiny_model's keywords
TINY_TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>"]
TINY_MODELS = {"vault": dict(chat_template=TINY_TOOL_TEMPLATE, extra_tokens=TINY_TOOL_TOKENS)}
TINY_WRITERS = {"shapes": shapes.write_tiny_model}  # tasks whose tiny model is another model: its writer (path)

TASKS = ("next_letter", "gsm8k", "countdown", "tldr", "vault", "code", "shapes")
# the reward model a task uses when --reward_model is not given (TRL's GRPO documentation example for tl;dr)
TASK_REWARD_MODELS = {"tldr": "weqweasdas/RM-Gemma-2B"}


def _chat_formatter(tokenizer, system_prompt=None, chat_template_kwargs=None):
    """User text (or a list of messages) -> the prompt the policy sees.

    Through the tokenizer's chat template when it has one (given `chat_template_kwargs`, e.g. enable_thinking),
    ending where the assistant's turn begins; else the plain text, with a newline to answer after.
    """
    templated = tokenizer is not None and getattr(tokenizer, "chat_template", None)

    def fmt(content):
        messages = content if isinstance(content, list) else [{"role": "user", "content": content}]
        if system_prompt:
            messages = [{"role": "system", "content": system_prompt}] + messages
        if templated:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                 **(chat_template_kwargs or {}))
        return "\n\n".join(m["content"] for m in messages) + "\n"
    return fmt


def get_task(name, *, tokenizer=None, dataset="", seed=0, eval_prompts=0, reward_model=None, reward_funcs=None,
             chat_template_kwargs=None):
    """Build a task: prompt source, reward functions, held-out evaluation rows.

    tokenizer: the policy's, for chat templates. dataset: a local .jsonl/.parquet
    (or hub id) replacing the task's own prompt source; rows with a `prompt`
    column are used as they are, their other columns passed to the reward
    functions by name. eval_prompts: held-out rows to keep for evaluation (0 =
    none). reward_model: (model, tokenizer) of a sequence-classification model
    whose score is added as a reward ('tldr' requires one, or reward_funcs).
    reward_funcs: functions that replace the task's own (the reward model's score
    is still added); the task's default weights then no longer apply. chat_template_kwargs: given to every
    chat-template rendering, the prompts' and the reward model's (TRL's setting of that name).
    """
    if name not in TASKS:
        raise ValueError(f"task: unknown task {name!r} (available: {', '.join(TASKS)})")
    chat = _chat_formatter(tokenizer, chat_template_kwargs=chat_template_kwargs)

    if name == "next_letter":
        task = Task(name, _letter_prompts, [rewards.next_letter_reward], accuracy_reward="next_letter_reward")
        task.eval_rows = _letter_prompts(random.Random(f"eval-{seed}"), eval_prompts)
        hub = None
    elif name == "shapes":  # a picture in each prompt (shapes.py): for a vision-language model
        task = Task(name, shapes.prompts, [shapes.square_colour_reward], accuracy_reward="square_colour_reward")
        task.eval_rows = shapes.prompts(random.Random(f"eval-{seed}"), eval_prompts)
        hub = None
    elif name == "gsm8k":
        math_chat = _chat_formatter(tokenizer, rewards.GSM8K_SYSTEM_PROMPT, chat_template_kwargs)

        def to_row(row):
            question = row["question"]
            return {"prompt": math_chat(question), "prompt_text": question, "answer": row["answer"]}
        task = Task(name, None, [rewards.gsm8k_correctness_reward, rewards.gsm8k_format_reward], weights=[1.0, 0.1],
                    to_row=to_row, accuracy_reward="gsm8k_correctness_reward", system_prompt=rewards.GSM8K_SYSTEM_PROMPT)
        hub = ("openai/gsm8k", "main", "train", "test")
    elif name == "vault":
        def to_row(row):  # the prompt is rendered with the tools by agents.Agent; here without, for the record
            return {**row, "prompt": chat(row["prompt_text"])}
        task = Task(name, _vault_prompts, [rewards.vault_reward, rewards.tool_format_reward], weights=[1.0, 0.2],
                    to_row=to_row, accuracy_reward="vault_reward", environment=Vault)
        task.eval_rows = [to_row(r) for r in _vault_prompts(random.Random(f"eval-{seed}"), eval_prompts)]
        hub = None
    elif name == "countdown":
        def to_row(row):
            text = countdown_prompt_text(row["nums"], row["target"])
            return {"prompt": chat(text), "prompt_text": text, "nums": list(row["nums"]), "target": int(row["target"])}
        task = Task(name, _countdown_prompts, [rewards.countdown_reward, rewards.format_reward], weights=[1.0, 0.1], to_row=to_row,
                    accuracy_reward="countdown_reward")
        task.eval_rows = [to_row(r) for r in _countdown_prompts(random.Random(f"eval-{seed}"), eval_prompts)]
        hub = None
    elif name == "code":  # problems with unit tests; the code runs in executor.py's sandbox (rewards.code_tests_reward)
        def to_row(row):
            tests = code_tests(row)
            problem = row["prompt"] if isinstance(row.get("prompt"), str) else row["text"]  # MBPP's column: text
            text = code_prompt_text(problem, tests)
            return {"prompt": chat(text), "prompt_text": text, "tests": tests}
        task = Task(name, None, [rewards.code_tests_reward], to_row=to_row, accuracy_reward="code_tests_reward",
                    formats_prompt_column=True)
        dataset = dataset or CODE_SAMPLE  # a dozen MBPP-style rows; --dataset for MBPP or HumanEval-style files
        hub = None
    else:  # tldr: Reddit posts ending in "TL;DR:", plain text as in the dataset (TRL's example does the same)
        if reward_model is None and not reward_funcs:
            raise ValueError("task tldr: needs a reward model (--reward_model=PATH or hub id) or --reward_funcs")

        def to_row(row):
            return {"prompt": row["prompt"], "prompt_text": row["prompt"]}
        task = Task(name, None, [], to_row=to_row)
        hub = ("trl-lib/tldr", None, "train", "validation")

    if reward_funcs:
        task.reward_funcs, task.weights = list(reward_funcs), None
        if task.accuracy_reward not in {rewards.reward_name(f) for f in task.reward_funcs}:
            task.accuracy_reward = None  # evaluation reads accuracy from that function's scores
    if reward_model is not None:
        task.reward_funcs.append(rewards.make_reward_model_reward(*reward_model,
                                                                  chat_template_kwargs=chat_template_kwargs))
        if task.weights is not None:
            task.weights = task.weights + [1.0]

    if dataset:
        rows, eval_rows = load_rows(dataset), []
        source = dataset
    elif hub is not None:
        rows, eval_rows = load_rows(hub[0], hub[2], hub[1]), load_rows(hub[0], hub[3], hub[1])
        random.Random(f"eval-{seed}").shuffle(eval_rows)
        eval_rows = eval_rows[:eval_prompts]
        source = hub[0]
    else:  # generated prompts: check one row for what the reward functions need, before any training starts
        _check_rows(task, task.make_prompts(random.Random(seed), 1), f"task {name}", "generated row")
        return task
    if not rows:
        raise ValueError(f"dataset {source}: no rows")
    if "prompt" in rows[0] and not task.formats_prompt_column:
        # one list of messages anywhere gives every row `prompt_messages`: a step's rows must share their keys
        messages = any(isinstance(r.get("prompt"), list) for r in rows + eval_rows)
        task.to_row = _prompt_column_row(chat, messages)
    task.rows = rows
    # a local file is checked before the hold-out split, so row numbers are the file's
    _check_rows(task, rows, f"dataset {source}", "row")
    _check_rows(task, eval_rows, f"dataset {source}", "held-out row")
    if dataset:
        task.rows, eval_rows = _holdout(rows, eval_prompts, seed, dataset)
    task.eval_rows = [task._format(r) for r in eval_rows]
    return task


def _prompt_column_row(chat, messages=False):
    """Rows that bring their own prompt: text is used as it is, a list of messages goes through the chat template.

    Every row gets `prompt_text` (the last user message's text), and with `messages`
    also `prompt_messages` (a text prompt as one user message).
    """
    def to_row(row):
        row = dict(row)
        prompt = row["prompt"]
        if isinstance(prompt, list):
            prompt = with_image_parts(prompt, len(_row_images(row)))
            row.setdefault("prompt_text", next((_text_of(m["content"]) for m in reversed(prompt)
                                                if m["role"] == "user"), ""))
            row["prompt"] = chat(prompt)
        row.setdefault("prompt_text", row["prompt"])
        if messages:
            row.setdefault("prompt_messages", [dict(m) for m in prompt] if isinstance(prompt, list)
                           else [{"role": "user", "content": prompt}])
        return row
    return to_row


def _row_images(row):
    """A row's images (its `images` column, or `image` as one), [] without."""
    images = row.get("images") if row.get("images") is not None else row.get("image")
    return [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]


def _text_of(content):
    """A message's text: its content, or the text parts of a content list (text and image parts)."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if p.get("type") == "text")


def with_image_parts(messages, count):
    """Messages whose image parts stand for a row's `count` images: as they are when they hold image parts, else
    (TRL's convention for an `image`/`images` column beside text messages) that many image parts put before the
    text of the first user message. The chat template renders each as the model's image placeholder."""
    has = any(isinstance(m["content"], list) and any(p.get("type") == "image" for p in m["content"])
              for m in messages)
    if not count or has:
        return messages
    out, done = [], False
    for m in messages:
        if m["role"] == "user" and not done:
            text = m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
            m = {**m, "content": [{"type": "image"} for _ in range(count)] + text}
            done = True
        out.append(m)
    return out


def _prompt_problem(prompt):
    """What is wrong with a row's own `prompt` (None if nothing): it must be text or a list of messages."""
    if isinstance(prompt, str):
        return None
    if not isinstance(prompt, list):
        return f"got {type(prompt).__name__} {prompt!r:.80}"
    if not prompt:
        return "got an empty list"
    if all(isinstance(m, str) for m in prompt):
        return (f"got a list of {len(prompt)} strings {prompt!r:.80}; write each as "
                f"{{\"role\": \"user\", \"content\": ...}}, or join them into one string")
    for j, m in enumerate(prompt):
        if not isinstance(m, dict):
            return f"item {j} is {type(m).__name__} {m!r:.60}, not a message"
        missing = [k for k in ("role", "content") if k not in m]
        if missing:
            return f"message {j} has no {' or '.join(repr(k) for k in missing)} (keys: {sorted(m)})"
        parts = m["content"] if isinstance(m["content"], list) else None
        if parts is not None and all(isinstance(p, dict) and p.get("type") in ("text", "image") for p in parts):
            continue  # content as parts: text and images (a vision-language model's prompt)
        if not isinstance(m["role"], str) or not isinstance(m["content"], str):
            return (f"message {j}: 'role' must be text and 'content' text or a list of "
                    f"{{\"type\": \"text\"|\"image\"}} parts, got {m!r:.80}")
    return None


# columns that usually hold the prompt in others' datasets, most telling first
PROMPT_LIKE = ("messages", "question", "problem", "query", "instruction", "input", "text")


def _column_hint(missing, row):
    """'; ...' suggesting which of the row's columns could be the one `missing`, or ''."""
    if missing == "prompt" and "messages" in row:
        return ("; the 'messages' column looks like it: rename it to 'prompt' (a list of {\"role\", \"content\"} "
                "messages goes through the chat template; leave out a final assistant message, the answer)")
    if missing == "prompt" and "question" in row:
        return "; the 'question' column looks like it: rename it to 'prompt', or use --task=gsm8k, which reads it"
    if missing in ("prompt", "question"):  # gsm8k's 'question' is text: not a list of messages
        like = next((c for c in ("prompt",) + PROMPT_LIKE[1:] if c in row and c != missing), None)
        if like is not None:
            return f"; the '{like}' column looks like it: rename it to '{missing}'"
    return ""


def _check_rows(task, rows, source, kind):
    """Every row carries what the reward functions need, and gold answers parse, before any training starts.

    source and kind name a row in messages: "dataset PATH" / "task NAME", "row" / "held-out row" / ...
    """
    needed = {f: rewards.reward_name(fn) for fn in task.reward_funcs for f in _required_fields(fn)}
    columns = set(rows[0]) if rows else set()
    keys = None
    for i, row in enumerate(rows):
        if set(row) != columns:  # a step's fields are read from its first row: all rows must agree
            raise ValueError(f"{source}, {kind} {i}: columns {sorted(row)} differ from the first row's "
                             f"{sorted(columns)}")
        problem = _prompt_problem(row["prompt"]) if "prompt" in row else None
        if problem:
            raise ValueError(f"{source}, {kind} {i}: 'prompt' must be text or a list of "
                             f"{{\"role\", \"content\"}} messages; {problem}")
        try:
            formatted = task._format(row)
        except KeyError as e:
            raise ValueError(f"{source}, {kind} {i}: missing column {e} (columns: {sorted(row)})"
                             f"{_column_hint(e.args[0], row)}") from None
        except Exception as e:  # a column of the wrong type (nums not a list), messages a chat template refuses
            reason = next(iter(str(e).splitlines()), "")[:200]
            raise ValueError(f"{source}, {kind} {i}: cannot be read ({type(e).__name__}: {reason}); "
                             f"columns: {sorted(row)}") from e
        if "prompt" not in formatted:  # rows used as they are must bring their prompt
            raise ValueError(f"{source}, {kind} {i}: missing column 'prompt' (columns: {sorted(row)})"
                             f"{_column_hint('prompt', row)}")
        if not isinstance(formatted.get("prompt"), str):
            raise ValueError(f"{source}, {kind} {i}: 'prompt' must be text, got {formatted.get('prompt')!r:.80}")
        keys = set(formatted) if keys is None else keys
        if set(formatted) != keys:
            raise ValueError(f"{source}, {kind} {i}: fields {sorted(formatted)} differ from the first row's "
                             f"{sorted(keys)}")
        for f, fn in needed.items():
            if f not in formatted and f not in row:
                raise ValueError(f"{source}, {kind} {i}: reward function '{fn}' needs a column '{f}' "
                                 f"(columns: {sorted(row)})")
        if "answer" in row and any(rewards.reward_name(fn) == "gsm8k_correctness_reward" for fn in task.reward_funcs):
            row["answer"] = rewards.parse_gold_answer(row["answer"], f"{source}, {kind} {i}")
