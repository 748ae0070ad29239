"""Code: problems with unit tests; a completion's code runs in the sandbox (sandbox/executor.py), scored by the fraction of
tests it passes.

Rows from tests/data/code_tiny.jsonl (a dozen MBPP-style problems) or --dataset in MBPP's or HumanEval's columns.
"""

import ast
import builtins
import json
import os
import re
import sys

from sandbox import executor
from tasks import Task


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE_SAMPLE = os.path.join(ROOT, "tests", "data", "code_tiny.jsonl")


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


#
# The completion's code runs in sandbox/executor.py's sandbox beside sandbox/code_harness.py, which judges each test from a process
# the program cannot reach and prints its verdicts after a nonce the program never sees (its docstring says how).
# A program that exits early, prints "passed", rebinds builtins or returns an always-equal object passes nothing.

CODE_TEST_TIMEOUT = 1.0  # seconds for each test, and for loading the program
CODE_HARNESS = os.path.join(ROOT, "sandbox/code_harness.py")
_PYTHON_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\r?\n", re.IGNORECASE)


def extract_code(completion):
    """The code of the last ```python fenced block (one the completion ends inside runs to the end), else the
    whole text."""
    last = None
    for last in _PYTHON_FENCE.finditer(completion):
        pass
    if last is None:
        return completion
    end = completion.find("```", last.end())
    return completion[last.end():end if end >= 0 else len(completion)]


def code_tests_reward(prompts, completions, tests, **_):
    """Fraction of the row's unit tests that the completion's code passes; None where the sandbox could not run it.

    `tests`: assert statements (`assert f(2) == 4`), or {"input", "output"} pairs for a program that reads stdin.
    All completions run at once, a pool of sandboxes sized to the CPUs; each has (tests + 1) x CODE_TEST_TIMEOUT
    seconds plus 2, so a slow program costs its own row, not the step.
    """
    with open(CODE_HARNESS) as f:
        harness = f.read()
    jobs, nonces = [], []
    for completion, row_tests in zip(completions, tests):
        nonce = os.urandom(16).hex()  # os.urandom: leaves the seeded generators alone
        nonces.append(nonce)
        spec = {"nonce": nonce, "tests": list(row_tests), "timeout": CODE_TEST_TIMEOUT}
        jobs.append({"code": harness, "files": {"solution.py": extract_code(completion)}, "stdin": json.dumps(spec),
                     "timeout": (len(row_tests) + 1) * CODE_TEST_TIMEOUT + 2})
    results = executor.run_many(jobs)
    return [_passed_fraction(r, nonce, len(t)) for r, nonce, t in zip(results, nonces, tests)]


def _passed_fraction(result, nonce, n):
    """From the judge's line after the nonce (only the judge can write it); 0 when there is none (the program
    killed or hung its judge), None when the sandbox failed or there are no tests."""
    if result.sandbox_failed or n == 0:
        return None
    for line in result.stdout.splitlines():
        if line.startswith(nonce + " "):
            verdicts = json.loads(line[len(nonce) + 1:])
            if isinstance(verdicts, list) and len(verdicts) == n and all(isinstance(v, bool) for v in verdicts):
                return sum(verdicts) / n
    return 0.0


def make(ctx):
    chat = ctx.chat()

    def to_row(row):
        tests = code_tests(row)
        problem = row["prompt"] if isinstance(row.get("prompt"), str) else row["text"]  # MBPP's column: text
        text = code_prompt_text(problem, tests)
        return {"prompt": chat(text), "prompt_text": text, "tests": tests}
    return Task(None, [code_tests_reward], to_row=to_row, accuracy_reward="code_tests_reward",
                formats_prompt_column=True, dataset=CODE_SAMPLE)
