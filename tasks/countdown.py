"""Countdown (as in TinyZero, Jiayi Pan et al. 2025): reach a target with the given numbers and + - * /.

Problems are generated in code: 3 or 4 numbers, combined in a random order by random operations into a target.
The answer is an arithmetic expression in <answer> tags; rewards: the expression right (1), and the
<think>/<answer> format (rewards.format_reward, 0.1).
"""

from collections import Counter
from fractions import Fraction

from rewards import format_reward
from tasks import Task


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


def prompts(rng, n):
    rows = []
    for _ in range(n):
        nums, target = countdown_problem(rng)
        rows.append({"nums": nums, "target": target})
    return rows


#
# The answer is an arithmetic expression. It is tokenized and parsed here by a
# small recursive-descent parser and evaluated over exact fractions; nothing the
# model writes is ever handed to Python's eval, exec or ast.

MAX_EXPRESSION_CHARS = 200
MAX_NESTING = 20
MAX_MAGNITUDE = 10 ** 12  # any intermediate numerator or denominator beyond this scores 0


class ExpressionError(ValueError):
    pass


def _tokenize_expression(text):
    tokens, i = [], 0
    while i < len(text):
        ch = text[i]
        if ch in " \t\n":
            i += 1
        elif ch.isdigit() and ch.isascii():
            j = i
            while j < len(text) and text[j].isdigit() and text[j].isascii():
                j += 1
            if j - i > 6:
                raise ExpressionError("number too long")
            tokens.append(int(text[i:j]))
            i = j
        elif ch in "+-*/()":
            tokens.append(ch)
            i += 1
        else:
            raise ExpressionError(f"character {ch!r} is not allowed")  # '.', '^', letters, '_', ...
    return tokens


def parse_expression(text):
    """Text -> tree: an int leaf, or (op, left, right). Only integers, + - * / and parentheses.

    Grammar: expr = term {(+|-) term}; term = factor {(*|/) factor}; factor = INT | ( expr ).
    No unary minus: every number must be one of the given ones. '**' fails (a
    factor cannot start with '*').
    """
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ExpressionError("expression too long")
    tokens = _tokenize_expression(text)
    pos = 0

    def peek():
        return tokens[pos] if pos < len(tokens) else None

    def left_assoc(ops, operand):  # one grammar level: operand {op operand}, folded to the left
        def level(depth):
            nonlocal pos
            node = operand(depth)
            while peek() in ops:
                op = tokens[pos]
                pos += 1
                node = (op, node, operand(depth))
            return node
        return level

    def factor(depth):
        nonlocal pos
        tok = peek()
        if isinstance(tok, int):
            pos += 1
            return tok
        if tok == "(":
            if depth >= MAX_NESTING:
                raise ExpressionError("too deeply nested")
            pos += 1
            node = expr(depth + 1)
            if peek() != ")":
                raise ExpressionError("missing ')'")
            pos += 1
            return node
        raise ExpressionError(f"expected a number or '(' at token {pos}, got {tok!r}")

    term = left_assoc(("*", "/"), factor)
    expr = left_assoc(("+", "-"), term)  # factor's parentheses reach it by name, once it exists
    tree = expr(0)
    if pos != len(tokens):
        raise ExpressionError(f"unexpected {tokens[pos]!r} at token {pos}")
    return tree


def expression_leaves(tree):
    if isinstance(tree, int):
        return [tree]
    return expression_leaves(tree[1]) + expression_leaves(tree[2])


def evaluate_expression(tree):
    """Exact value of a parsed tree as a Fraction; ExpressionError on division by zero or huge values."""
    if isinstance(tree, int):
        return Fraction(tree)
    op, left, right = tree
    a, b = evaluate_expression(left), evaluate_expression(right)
    if op == "+":
        value = a + b
    elif op == "-":
        value = a - b
    elif op == "*":
        value = a * b
    else:
        if b == 0:
            raise ExpressionError("division by zero")
        value = a / b
    if abs(value.numerator) > MAX_MAGNITUDE or value.denominator > MAX_MAGNITUDE:
        raise ExpressionError("intermediate value too large")
    return value


def _last_tagged(text, tag):
    """Content of the last <tag>...</tag> (plain string search: linear time), or None."""
    start = text.rfind(f"<{tag}>")
    if start < 0:
        return None
    start += len(tag) + 2
    end = text.find(f"</{tag}>", start)
    return text[start:end] if end >= 0 else None


def check_countdown(expression, nums, target):
    """True when `expression` uses only the given numbers (each at most once) and equals `target`."""
    try:
        tree = parse_expression(expression.strip())
    except ExpressionError:
        return False
    available = Counter(int(n) for n in nums)
    if Counter(expression_leaves(tree)) - available:  # a number not given, or used too often
        return False
    try:
        return evaluate_expression(tree) == Fraction(int(target))
    except ExpressionError:
        return False


def countdown_reward(prompts, completions, nums, target, completion_content=None, **_):
    """1 when the last <answer>...</answer> is an equation over the given numbers reaching the target (in the
    content without the reasoning, when `completion_content` gives it)."""
    out = []
    for completion, ns, t in zip(completion_content if completion_content is not None else completions, nums, target):
        expression = _last_tagged(completion, "answer")
        if expression is not None and "=" in expression:
            expression = expression.split("=")[0]  # "<answer> 3 * 4 = 12 </answer>": the left side is the equation
        out.append(1.0 if expression is not None and check_countdown(expression, ns, t) else 0.0)
    return out


def make(ctx):
    chat = ctx.chat()

    def to_row(row):
        text = countdown_prompt_text(row["nums"], row["target"])
        return {"prompt": chat(text), "prompt_text": text, "nums": list(row["nums"]), "target": int(row["target"])}
    return Task(prompts, [countdown_reward, format_reward], weights=[1.0, 0.1], to_row=to_row,
                accuracy_reward="countdown_reward")
