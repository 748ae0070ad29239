"""Reward functions, and how completions are scored.

A reward function is `f(prompts, completions, **fields) -> list[float | None]`,
called with keywords only (`f(prompts=..., completions=..., answer=...)`, as
TRL calls them), so `def f(completions, **kwargs)` works too: one score per
completion, `None` where it cannot score one (that completion then gets
advantage 0 instead of a made-up score). A score is any real number (bool,
int, float, numpy scalar) that stays finite as float32. `fields` are the
task's per-prompt data (the gold answer, ...) repeated for each completion,
and the trainer's: the token ids, and each completion's parts (its final
content, reasoning and tool calls: responses.reward_parts).

Here: what every task shares. Scoring (score_completions), the general-purpose
rewards (length, format, DAPO's overlong punishment), the final number of a
math answer (extract_final_number), reward-model scoring, and loading your own
functions (--reward_funcs). Each task's own reward functions are in its file in
tasks/, which imports this module; this module imports no task (a spec written
as `rewards:NAME` for a task's function is found by tasks.load_reward_funcs).
"""

import importlib.util
import math
import os
import re
import sys
import time
from fractions import Fraction
from numbers import Real

import torch


# ----------------------------------------------------------------------------- scoring


class RewardFunctionError(RuntimeError):
    pass


def reward_name(fn):
    return getattr(fn, "__name__", type(fn).__name__)


REWARD_DTYPE = torch.float32  # scores and totals are stored in it, and grpo.py's advantages are float32 too


def _call_reward(fn, prompts, completions, fields, context, rows=None):
    """`fn`'s scores as a (N,) REWARD_DTYPE tensor, NaN for None; RewardFunctionError naming `fn` otherwise.
    fields hold one value per completion; context's values are the run's (the step, ...), passed as they are.
    rows: each completion's number in the batch, where these are some of its rows (errors name it)."""
    try:
        scores = fn(prompts=prompts, completions=completions, **fields, **context)
    except Exception as batch_error:
        _raise_failure(fn, batch_error, prompts, completions, fields, context, rows)
    if type(scores) is not list or len(scores) != len(completions):  # another iterable, or a wrong answer
        scores = _score_list(fn, scores, len(completions))
    out = torch.tensor([_value(s) for s in scores], dtype=REWARD_DTYPE)
    if torch.isinf(out).any():  # not a finite number, or finite but too large once stored: training would go NaN
        _raise_bad_score(fn, scores, torch.isinf(out).nonzero()[0].item(), completions, rows)
    return out


def _number(rows, i):
    """Completion i's number in the batch (`rows`: the numbers of these completions, None: i itself)."""
    return i if rows is None else rows[i]


def _raise_failure(fn, batch_error, prompts, completions, fields, context, rows):
    """`fn` raised `batch_error` on the batch: RewardFunctionError naming the completion it fails on, found by
    calling it on each alone, so the message can show it."""
    name = reward_name(fn)
    if getattr(fn, "collective", False):
        # a sharded model: calling it again on one rank alone would desynchronise the ranks' collectives
        raise RewardFunctionError(f"reward function '{name}' raised {type(batch_error).__name__}: "
                                  f"{batch_error}") from batch_error
    for i, completion in enumerate(completions):
        one = {k: v[i:i + 1] for k, v in fields.items()}
        try:
            fn(prompts=prompts[i:i + 1], completions=completions[i:i + 1], **one, **context)
        except Exception as e:
            raise RewardFunctionError(
                f"reward function '{name}' raised {type(e).__name__}: {e}\n"
                f"  on completion {_number(rows, i)}: {completion[:500]!r}\n  of prompt: {prompts[i][:300]!r}") from e
    raise RewardFunctionError(f"reward function '{name}' raised {type(batch_error).__name__}: {batch_error} "
                              f"on the batch, though on no completion alone") from batch_error


def _score_list(fn, scores, n):
    """`scores` as a list of `n`; RewardFunctionError where it is not an iterable of n scores."""
    name = reward_name(fn)
    if scores is not None and (isinstance(scores, (str, bytes, dict)) or not hasattr(scores, "__iter__")):
        raise RewardFunctionError(f"reward function '{name}' returned a {type(scores).__name__} ({scores!r:.80}); "
                                  f"expected a list of {n} scores, one per completion")
    scores = list(scores) if scores is not None else None
    if scores is None or len(scores) != n:
        got = "None" if scores is None else f"{len(scores)} scores"
        raise RewardFunctionError(f"reward function '{name}' returned {got} for {n} completions")
    return scores


def _value(s):
    """A score as a float, NaN for None; inf where it is not a real number that stays finite as a float."""
    try:  # float() of a huge int or Fraction raises OverflowError
        value = math.nan if s is None else float(s) if isinstance(s, Real) else math.inf
    except OverflowError:
        return math.inf
    return value if s is None or math.isfinite(value) else math.inf


def _raise_bad_score(fn, scores, i, completions, rows):
    """RewardFunctionError naming `fn` and completion i, whose score scores[i] is not a finite number, or overflows
    REWARD_DTYPE."""
    s, number, text = scores[i], _number(rows, i), completions[i][:500]
    if math.isinf(_value(s)):
        raise RewardFunctionError(f"reward function '{reward_name(fn)}' returned {s!r} (a {type(s).__name__}) for "
                                  f"completion {number}: {text!r}; expected a finite number or None")
    raise RewardFunctionError(f"reward function '{reward_name(fn)}' returned {s!r} for completion {number}: "
                              f"{text!r}; expected a finite number or None, and this one "
                              f"overflows {REWARD_DTYPE} (largest {torch.finfo(REWARD_DTYPE).max:.4g})")


def score_completions(reward_funcs, weights, prompts, completions, fields, seconds=None, context=None, rows=None):
    """Run every reward function; return (total (N,), {name: (N,)}) with NaN for None.

    Each function gets prompts, completions and every field (one value per completion) by keyword, and the
    run-level keywords in `context` (the trainer's: step, max_completion_length, soft_punish_cache).
    The total is the weighted sum over the functions that scored a completion, NaN when none did. A score or total
    that does not fit REWARD_DTYPE raises RewardFunctionError. `seconds`, a dict, receives each function's time:
    {name: s}. rows: each completion's number in the batch, where these are some of its rows (the groups that have
    landed: features/streaming.py's Landing)."""
    parts = reward_parts(reward_funcs, prompts, completions, fields, seconds, context, rows)
    return weighted_total(parts, weights, completions, rows), parts


def reward_parts(reward_funcs, prompts, completions, fields, seconds=None, context=None, rows=None):
    """{name: (N,) scores} of each function, as score_completions calls them, without the total."""
    parts = {}
    for fn in reward_funcs:
        t = time.perf_counter()
        parts[reward_name(fn)] = _call_reward(fn, prompts, completions, fields, context or {}, rows)
        if seconds is not None:
            seconds[reward_name(fn)] = time.perf_counter() - t
    return parts


def weighted_total(parts, weights, completions, rows=None):
    """The weighted sum of the functions' scores `parts` (in the functions' order, one weight each) per completion,
    over those that scored it: NaN where none did; RewardFunctionError where it overflows REWARD_DTYPE."""
    if not all(math.isfinite(w) for w in weights):
        raise ValueError(f"reward weights must be finite, got {list(weights)}")
    stacked = torch.stack(list(parts.values()), dim=1)  # (N, F)
    w = torch.tensor(weights, dtype=torch.float64)
    # summed in float64 so only a total that REWARD_DTYPE cannot hold fails, not an intermediate sum
    total = torch.nansum(stacked.double() * w, dim=1).to(REWARD_DTYPE)  # (N,)
    scored = ~torch.isnan(stacked)  # (N, F)
    overflow = (torch.isinf(total) & scored.any(1)).nonzero()
    if len(overflow):
        _raise_total_overflow(overflow[0].item(), parts, stacked, scored, weights, completions, rows)
    total[~scored.any(1)] = float("nan")
    return total


def _raise_total_overflow(i, parts, stacked, scored, weights, completions, rows):
    """RewardFunctionError naming completion i, whose weighted total overflows REWARD_DTYPE, and its terms."""
    terms = ", ".join(f"'{n}' {stacked[i, f].item():.4g} x weight {weights[f]:g}"
                      for f, n in enumerate(parts) if scored[i, f])
    raise RewardFunctionError(f"reward functions' weighted total for completion {_number(rows, i)} "
                              f"overflows {REWARD_DTYPE} "
                              f"({terms}): {completions[i][:500]!r}; scale the rewards or their weights down")


# ----------------------------------------------------------------------------- general-purpose rewards


def length_reward(prompts, completions, target_chars=20, **_):
    """Reward completions close to `target_chars` characters: 0 at the target, -1 per character away / target.

    Like the toy example in TRL's GRPO documentation.
    """
    return [-abs(len(c) - target_chars) / target_chars for c in completions]


def get_soft_overlong_punishment(max_completion_len, soft_punish_cache):
    """DAPO's overlong reward shaping (Eq. 13; TRL's function of this name): 0 up to max_completion_len -
    soft_punish_cache tokens, then falling linearly to -1 at max_completion_len, -1 beyond. Counts the whole
    trajectory's tokens (`completion_ids`: the policy's and an environment's, as the length limit does)."""
    def soft_overlong_punishment(completion_ids, **_):
        free = max_completion_len - soft_punish_cache
        return [0.0 if len(ids) <= free else -1.0 if len(ids) > max_completion_len
                else (free - len(ids)) / soft_punish_cache for ids in completion_ids]
    return soft_overlong_punishment


def soft_overlong_punishment(completion_ids, max_completion_length, soft_punish_cache, **_):
    """The same, for --reward_funcs=rewards:soft_overlong_punishment: L_max is the run's max_completion_length and
    L_cache its --soft_punish_cache (0 = no soft zone: only a completion longer than the limit, which the sampler
    never writes, would get -1)."""
    return get_soft_overlong_punishment(max_completion_length, soft_punish_cache)(completion_ids)


_FORMAT_THINK, _FORMAT_ANSWER, _FORMAT_SPACE = 20_000, 2_000, 200
_FORMAT = re.compile(rf"\s{{0,{_FORMAT_SPACE}}}<think>.{{0,{_FORMAT_THINK}}}?</think>\s{{0,{_FORMAT_SPACE}}}"
                     rf"<answer>.{{0,{_FORMAT_ANSWER}}}?</answer>\s{{0,{_FORMAT_SPACE}}}\Z", re.DOTALL)
# the longest text _FORMAT can match: anything longer holds more than think and answer
_FORMAT_MAX_CHARS = 3 * _FORMAT_SPACE + _FORMAT_THINK + _FORMAT_ANSWER + len("<think></think><answer></answer>")


def format_reward(prompts, completions, **_):
    """1 when the completion is `<think>...</think><answer>...</answer>` and nothing else, else 0."""
    return [1.0 if len(c) <= _FORMAT_MAX_CHARS and _FORMAT.match(c) else 0.0 for c in completions]


# ----------------------------------------------------------------------------- final numbers (math answers)
#
# Model output is hostile input: every function below looks at a bounded window
# of the text, uses only regexes that run in linear time (no nested or adjacent
# overlapping quantifiers), and never evaluates anything it reads.

MAX_SCAN_CHARS = 20_000   # answers sit at the end; a longer completion is judged on its last 20k characters
MAX_NUMBER_DIGITS = 30    # longer digit strings are not answers (and would make big-int parsing slow)

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_NUMBER_CHARS = frozenset("0123456789,.")
_THOUSANDS = re.compile(r"\d{1,3}(?:,\d{3})+")
_FRAC = re.compile(r"(-\s*)?\\[dt]?frac\{(-?\d{1,15})\}\{(\d{1,15})\}")
_FRAC_WORD = re.compile(r"\\[dt]?frac")
_DIVIDED_BY = ("/", "\\div", "\u00f7")
_SPACES = re.compile(r"\s*")
_ANSWER_WORD = re.compile("answer", re.IGNORECASE | re.ASCII)  # no lowercased copy: that may change the length


def _normalise(text):
    return text.replace("{,}", ",").replace("\\!", "").replace("\u2212", "-").replace("\\$", "$")


def parse_number(token):
    """'1,000' / '-3.50' / '5.00' -> Fraction; None when it is not a plain decimal number."""
    if token is None:
        return None
    s = _normalise(token).strip().replace("$", "").replace(" ", "")
    m = _NUMBER.fullmatch(s) if len(s) <= 2 * MAX_NUMBER_DIGITS else None
    if m is None:
        return None
    sign = "-" if s.startswith("-") else ""
    int_part, _, frac_part = s.lstrip("-").partition(".")
    if "," in int_part:
        if not _THOUSANDS.fullmatch(int_part):
            return None  # "1,2" is a list, not a number
        int_part = int_part.replace(",", "")
    if len(int_part) + len(frac_part) > MAX_NUMBER_DIGITS:
        return None
    return Fraction(sign + int_part + ("." + frac_part if frac_part else ""))


def _number_matches(text, start=0, end=None):
    """(value, position) of each number that begins in text[start:end], read whole even past `end`.

    A window must never shorten a number ('#### 7234' seen through a window that
    ends after '72' is not 72), and the tail of a number that began before
    `start` is no number. A minus sign counts only when it does not follow a
    digit or letter inside the window.
    """
    end = len(text) if end is None else min(end, len(text))
    pos = start
    if 0 < pos < end and text[pos - 1] in _NUMBER_CHARS:
        while pos < end and text[pos] in _NUMBER_CHARS:
            pos += 1
    while (m := _NUMBER.search(text, pos, end)) is not None:
        m = _NUMBER.match(text, m.start())  # the whole number, also where it runs past `end`
        token = m.group().rstrip(",")
        if token.startswith("-") and m.start() > start and text[m.start() - 1].isalnum():
            token = token[1:]  # "3-5": a subtraction, not a negative five
        value = parse_number(token)
        if value is not None:
            yield value, m.start()
        pos = m.end()


def _numbers_in(text, start=0, end=None):
    return [value for value, _ in _number_matches(text, start, end)]


def _boxed_content(text):
    """Content of the last \\boxed{...} (braces matched, at most 300 characters), or None."""
    i = text.rfind("\\boxed")
    if i < 0:
        return None
    j = i + len("\\boxed")
    while j < len(text) and text[j] == " ":
        j += 1
    if j >= len(text) or text[j] != "{":
        return None
    depth, k = 0, j
    while k < len(text) and k - j <= 300:
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            depth -= 1
            if depth == 0:
                return text[j + 1:k]
        k += 1
    return None


def _number_in_boxed(content):
    """The number a boxed answer states, or None when it states none or one that cannot be read.

    The last number counts ('x = 5' is 5). A fraction, '\\frac{a}{b}' or 'a / b',
    is read as one; with a zero or unreadable part it is None, never its last digit.
    """
    content = _normalise(content)
    if _FRAC_WORD.search(content):
        frac = _FRAC.search(content)
        if frac is None or int(frac.group(3)) == 0:
            return None  # '\\frac{5}{0}', '\\frac{x}{2}', '\\frac12'
        return Fraction(int(frac.group(2)), int(frac.group(3))) * (-1 if frac.group(1) else 1)
    last = None
    for last in _number_matches(content):
        pass
    if last is None:
        return None
    value, at = last
    before = content[:at].rstrip()
    divisor = next((d for d in _DIVIDED_BY if before.endswith(d)), None)
    if divisor is None:
        return value
    before = before[:-len(divisor)].rstrip()
    j = len(before)
    while j > 0 and before[j - 1] in _NUMBER_CHARS:
        j -= 1
    if j > 0 and before[j - 1] == "-":
        j -= 1
    numerator = parse_number(before[j:]) if j < len(before) else None
    return None if numerator is None or value == 0 else numerator / value


# what may stand between 'answer' and its number ("answer is", "Answer: $", "the answer is the \\(")
_ANSWER_GLUE = re.compile(r"(?:[\s:*=$\\(isIS]|the)*")  # 't' is not in the class: no backtracking


def extract_final_number(text):
    """The final numeric answer of a solution, as a Fraction, or None.

    In order of trust: the last \\boxed{...}, the number after the last '####',
    the number after the last 'answer is' / 'answer:', the last number in the text.
    A boxed answer that is there decides, also when it cannot be read
    ('\\boxed{\\frac{5}{0}}' is None, not a number picked from the text
    around it); an empty box is no box.
    Text after the answer is ignored, thousands separators ('1,000', '8{,}000')
    removed, and '5.00' equals '5'.
    """
    text = _normalise(text[-MAX_SCAN_CHARS:])
    boxed = _boxed_content(text)
    if boxed is not None and boxed.strip():
        return _number_in_boxed(boxed)
    i = text.rfind("####")
    if i >= 0:
        start = _SPACES.match(text, i + 4).end()
        numbers = _numbers_in(text, start, start + 60)
        if numbers:
            return numbers[0]
    answer = None
    for answer in _ANSWER_WORD.finditer(text):  # the last one: no lowercased copy to index into
        pass
    if answer is not None:
        start = _ANSWER_GLUE.match(text, answer.end()).end()
        if _NUMBER.match(text, start):
            numbers = _numbers_in(text, start, start + 54)
            if numbers:
                return numbers[0]
    numbers = _numbers_in(text, max(0, len(text) - 2000))
    return numbers[-1] if numbers else None


# ----------------------------------------------------------------------------- reward models


@torch.no_grad()
def _score_at(model, input_ids, attention_mask, position_ids, last):
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=position_ids).last_hidden_state
    return model.score(hidden[torch.arange(len(last), device=last.device), last])[:, 0]


def reward_model_scores(model, tokenizer, prompts, completions, batch_size=8, max_length=2048,
                        padding_side="right", chat_template_kwargs=None):
    """One scalar per (prompt, completion) from a sequence-classification reward model.

    The pair goes through the reward model's own chat template when it has one
    (user turn, assistant turn), else it is plain concatenated text. The score is
    read at each row's last real token, found from the attention mask, with
    position ids counted from the first real token: padding on either side then
    gives the same score (HF's pooling looks for pad ids, which breaks when the
    pad token is also the EOS that ends a chat turn).
    """
    # `model` may be the module itself or a sharding wrapper whose call `model(fn, *args)` runs `fn(module, *args)`
    # inside one forward of the sharded root (sharding.Root), so the sharded weights are gathered for it
    lm = getattr(model, "lm", model)
    run = model if lm is not model else (lambda fn, *args: fn(model, *args))
    head = getattr(lm, "score", None)
    if head is None:
        raise ValueError(f"reward model {type(lm).__name__}: expected a sequence-classification head named "
                         f"'score' (as in *ForSequenceClassification)")
    templated = getattr(tokenizer, "chat_template", None) is not None
    if templated:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                                               tokenize=False, **(chat_template_kwargs or {}))
                 for p, c in zip(prompts, completions)]
    else:
        texts = [p + c for p, c in zip(prompts, completions)]
    device = next(lm.parameters()).device
    old_sides = tokenizer.padding_side, tokenizer.truncation_side
    tokenizer.padding_side, tokenizer.truncation_side = padding_side, "left"  # keep the end: the completion
    scores = []
    try:
        for i in range(0, len(texts), batch_size):
            enc = tokenizer(texts[i:i + batch_size], return_tensors="pt", padding=True, truncation=True,
                            max_length=max_length, add_special_tokens=not templated).to(device)
            mask = enc.attention_mask.long()
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            last = (mask * torch.arange(mask.shape[1], device=device)).argmax(-1)  # (B,) index of the last real token
            scores.append(run(_score_at, enc.input_ids, mask, positions, last).float().cpu())
    finally:
        tokenizer.padding_side, tokenizer.truncation_side = old_sides
    return torch.cat(scores).tolist()


def make_reward_model_reward(model, tokenizer, batch_size=8, chat_template_kwargs=None):
    """A reward function scoring with `model`; it sees the untemplated prompt text when the task provides it.
    chat_template_kwargs: the run's, for the reward model's own chat template (as TRL passes them)."""
    def reward_model(prompts, completions, prompt_text=None, **_):
        return reward_model_scores(model, tokenizer, prompt_text or prompts, completions, batch_size,
                                   chat_template_kwargs=chat_template_kwargs)
    reward_model.collective = True  # may run a sharded model: every rank must make the same calls
    return reward_model


# ----------------------------------------------------------------------------- your own reward functions


_LOADED = {}  # path -> module: the files loaded for reward functions, tools and environments


def _load_module(where):
    """A module from a file path ('x/my_rewards.py') or an importable name ('my_pkg.rewards')."""
    if where.endswith(".py"):
        path = os.path.abspath(os.path.expanduser(where))
        if not os.path.isfile(path):
            raise ValueError(f"no such file {path}")
        loaded = _LOADED.get(path) or next((m for m in list(sys.modules.values())
                                            if os.path.abspath(getattr(m, "__file__", None) or "") == path), None)
        if loaded is not None:
            return loaded  # a file already loaded or imported (sandbox/executor.py): the same module, run once
        spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _LOADED[path] = module
        return module
    if os.getcwd() not in sys.path:  # `python train.py` searches train.py's folder, not the one it runs in
        sys.path.append(os.getcwd())
    return importlib.import_module(where)


def resolve(item):
    """'file.py:name' or 'package.module:name' -> that object; ValueError naming the entry where there is no
    such file or module, loading it fails, or it has no such name. (Reward functions, tools, environments.)"""
    where, _, name = item.rpartition(":")
    if not where or not name:
        raise ValueError(f"{item!r}: expected file.py:name or package.module:name")
    try:
        module = _load_module(where)  # a file named twice runs once
    except Exception as e:  # whatever loading the user's code raises, named with the entry
        raise ValueError(f"{item!r}: {e if isinstance(e, ValueError) else f'{type(e).__name__}: {e}'}") from e
    if not hasattr(module, name):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ValueError(f"{item!r}: {where} has no {name!r} (its functions: {', '.join(found) or 'none'})")
    return getattr(module, name)


def load_reward_funcs(spec):
    """'file.py:name,package.module:name' -> the named functions, in order.

    ValueError naming the entry that does not resolve: no such file or module, an error while loading it,
    no such name, not callable, or a name given twice (each function is logged under its name).
    """
    funcs = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        fn = resolve(item)
        if not callable(fn):
            raise ValueError(f"{item!r}: {item.rpartition(':')[2]} is a {type(fn).__name__}, not a function")
        if reward_name(fn) in {reward_name(f) for f in funcs}:
            raise ValueError(f"{item!r}: a reward function named {reward_name(fn)!r} is already given")
        funcs.append(fn)
    if not funcs:
        raise ValueError(f"{spec!r} names no function")
    return funcs
