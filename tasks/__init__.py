"""Tasks: where prompts come from and which reward functions score them, one file per task in this folder.

A task is a module `tasks/NAME.py` (NAME is then a --task value, listed by --help) with

    def make(ctx) -> Task      # ctx: the run's tokenizer and chat formatting (ctx.chat()), reward model, ...

and, in the same file, its prompts and its reward functions. Prompts are generated in code (a function
(rng, n) -> rows), read from a local file (.jsonl / .parquet) or a hub dataset, or brought by --dataset (rows
with a `prompt` column are used as they are, their other columns passed to the reward functions by name); some
are held back for evaluation. Prompts for a step are a pure function of (seed, step), so a resumed run sees the
same ones. A task module may also name its default reward model (REWARD_MODEL) and the tiny model it runs on with
--model=tiny (TINY_MODEL: write_tiny_model's keywords; or a write_tiny_model(path) of its own). What every task
shares (scoring, answer extraction, the reward model) is in rewards.py. docs/tasks.md shows a task written out.

Imports: a task imports rewards.py, this file and what it needs (sandbox/ for the code task); rewards.py imports
no task.
"""

import importlib
import inspect
import json
import os
import random
from dataclasses import dataclass, field
from typing import Callable

import rewards

FOLDER = os.path.dirname(os.path.abspath(__file__))


def task_names(folder=FOLDER):
    """The tasks: each NAME.py in this folder (not __init__ or a _private file), without importing any."""
    return tuple(sorted(f[:-3] for f in os.listdir(folder) if f.endswith(".py") and not f.startswith("_")))


TASKS = task_names()


def module(name):
    """The module of task `name` (imported on first use)."""
    return importlib.import_module(f"tasks.{name}")


def load_reward_funcs(spec):
    """`rewards.load_reward_funcs(spec)`, where `rewards:NAME` also finds a task's own reward function (written
    before each task held its own, as `tasks.gsm8k:gsm8k_correctness_reward` is now)."""
    return rewards.load_reward_funcs(",".join(_in_task(item.strip()) for item in spec.split(",")))


def _in_task(item):
    where, _, name = item.rpartition(":")
    if where == "rewards" and name and not hasattr(rewards, name):
        for task in TASKS:
            if hasattr(module(task), name):
                return f"tasks.{task}:{name}"
    return item


def default_reward_model(name):
    """The reward model task `name` uses when --reward_model is not given: its module's REWARD_MODEL, or ''."""
    return getattr(module(name), "REWARD_MODEL", "")


def tiny_model_writer(name, write_tiny_model):
    """The function that writes the tiny model task `name` runs on with --model=tiny: its module's own
    write_tiny_model, else `write_tiny_model` with its TINY_MODEL keywords (a chat template, extra tokens)."""
    m = module(name)
    if hasattr(m, "write_tiny_model"):
        return m.write_tiny_model
    return lambda path: write_tiny_model(path, **getattr(m, "TINY_MODEL", {}))


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
             "completion_messages", "completion_content", "reasoning_content", "tool_calls")  # environments/responses.py
    return [p.name for p in params if p.default is inspect.Parameter.empty and p.name not in given
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


# ----------------------------------------------------------------------------- tasks


@dataclass
class Task:
    """What a task module's make(ctx) returns: where its prompts come from and what scores them."""
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
    hub: tuple = None              # (hub id, config, train split, eval split) the rows come from without --dataset
    dataset: str = None            # a local file the rows come from without --dataset
    name: str = None               # set by get_task: the task's file name

    def _format(self, row):
        return self.to_row(row) if self.to_row is not None else row

    def prompts_for_step(self, seed, step, n, round=0):
        """The `n` rows of step `step` (1-based): a pure function of (seed, step), so a resumed run sees the same.
        Datasets are walked an epoch at a time (`_epoch_rows`); `round` > 0: the step's further draws of dynamic
        sampling (`_round_rows`)."""
        if round:
            return self._round_rows(seed, step, n, round)
        if self.rows is None:
            return [self._format(r) for r in self.make_prompts(random.Random(seed * 1_000_003 + step), n)]
        return self._epoch_rows(seed, step, n)

    def _epoch_rows(self, seed, step, n):
        """A dataset's rows of step `step`: the dataset walked in a seeded permutation per epoch, every row once per
        epoch."""
        out, total = [], len(self.rows)
        for i in range((step - 1) * n, step * n):
            epoch, j = divmod(i, total)
            out.append(self._format(self.rows[self._permutation(seed, epoch)[j]]))
        return out

    def _round_rows(self, seed, step, n, round):
        """Round `round` > 0 of dynamic sampling's further draws for step `step`, a pure function of (seed, step,
        round) too: generated prompts from their own stream; dataset rows drawn at random from the whole set, apart
        from the epoch's walk."""
        rng = random.Random(f"round-{seed}-{step}-{round}")
        if self.rows is None:
            return [self._format(r) for r in self.make_prompts(rng, n)]
        return [self._format(self.rows[rng.randrange(len(self.rows))]) for _ in range(n)]

    def _permutation(self, seed, epoch):
        cache = self.__dict__.setdefault("_perm_cache", {})
        if (seed, epoch) not in cache:
            order = list(range(len(self.rows)))
            random.Random(f"epoch-{seed}-{epoch}").shuffle(order)
            cache.clear()  # one epoch at a time is enough
            cache[(seed, epoch)] = order
        return cache[(seed, epoch)]


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


@dataclass
class Context:
    """What a task's make(ctx) may use: the policy's tokenizer and the run's chat-template options, through
    chat(); the reward model and the user's own reward functions, when the task depends on them."""
    tokenizer: object = None
    chat_template_kwargs: dict = None
    reward_model: tuple = None
    reward_funcs: list = None

    def chat(self, system_prompt=None):
        """User text (or messages) -> the prompt the policy sees (see _chat_formatter)."""
        return _chat_formatter(self.tokenizer, system_prompt, self.chat_template_kwargs)


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
    ctx = Context(tokenizer, chat_template_kwargs, reward_model, reward_funcs)
    task = module(name).make(ctx)
    task.name = name
    if task.make_prompts is not None:
        task.eval_rows = [task._format(r) for r in task.make_prompts(random.Random(f"eval-{seed}"), eval_prompts)]
    chat = ctx.chat()

    if reward_funcs:
        task.reward_funcs, task.weights = list(reward_funcs), None
        if task.accuracy_reward not in {rewards.reward_name(f) for f in task.reward_funcs}:
            task.accuracy_reward = None  # evaluation reads accuracy from that function's scores
    if reward_model is not None:
        task.reward_funcs.append(rewards.make_reward_model_reward(*reward_model,
                                                                  chat_template_kwargs=chat_template_kwargs))
        if task.weights is not None:
            task.weights = task.weights + [1.0]

    dataset, hub = dataset or task.dataset, task.hub
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
    folder = os.path.dirname(os.path.abspath(dataset)) if dataset and os.path.isfile(dataset) else None
    _open_images(rows, folder, f"dataset {source}", "row")
    _open_images(eval_rows, folder, f"dataset {source}", "held-out row")
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


def _open_images(rows, folder, source, kind):
    """Image paths in the rows' `image`/`images` columns made absolute against `folder` (the dataset file's, so
    that a dataset and its pictures move together; None: as given), and every image opened before any training
    starts, so that one that does not open stops the run naming its row and path, not the image processor at step
    1. A URL is left for the image processor to download; base64 text is decoded."""
    from PIL import Image
    from transformers.image_utils import load_image

    for i, row in enumerate(rows):
        for column in ("image", "images"):
            value = row.get(column)
            many = isinstance(value, (list, tuple))
            items = list(value) if many else [value]
            if not any(isinstance(x, str) for x in items):
                continue
            for j, given in enumerate(items):
                if not isinstance(given, str) or given.startswith(("http://", "https://")):
                    continue
                path = os.path.join(folder, os.path.expanduser(given)) if folder else given
                if os.path.isfile(path):
                    try:
                        with Image.open(path):  # reads the header alone: quick for a large dataset
                            items[j] = path
                        continue
                    except Exception as e:  # noqa: BLE001 (not an image, or one PIL cannot read)
                        reason = next(iter(str(e).splitlines()), type(e).__name__)[:200]
                else:
                    try:  # what the image processor also reads: base64 text, or a data: URI
                        load_image(given)
                        continue
                    except Exception:  # noqa: BLE001
                        reason = f"no such file {path}"
                raise ValueError(f"{source}, {kind} {i}: image {given!r:.200} does not open ({reason})")
            row[column] = items if many else items[0]


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
        for fn in task.reward_funcs:  # a reward function may parse its columns at load (gsm8k's gold answers)
            for column, parse in getattr(fn, "column_parsers", {}).items():
                if column in row:
                    row[column] = parse(row[column], f"{source}, {kind} {i}")
