"""The reader's path: the code a researcher reads to follow one default step, measured.

`python -m bench --only reader` runs `python train.py`'s default for a few steps and traces one of them, from the
call of `train.train_step` to its return: every function of the project that runs in it (a function of torch,
transformers or the standard library is not the project's). The path is the union of those functions' lines, def
to end, the blank ones left out; docstrings and comments count, as a reader reads them. Reported:

  reader_lines        the path's lines                  reader_files       the files they lie in
  reader_functions    the functions that ran            reader_feature_files   feature files among them (FEATURES)
  reader_exec_frac    of the path's code lines (no docstring, comment or blank), the share that ran
  reader_longest      the longest function on the path, in lines, and its name
  reader_file_lines   each file's lines on the path

A statement that ran counts every line it spans (a call written over three lines ran three lines); a compound
statement (if, for, with, def ...) counts its header only, its body by what in it ran.
"""

import ast
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the files and folders of optional features: a default step should enter none of them
FEATURES = ("layers/tensor_parallel.py", "layers/lora.py", "layers/kernels.py", "layers/vision.py",
            "layers/routing.py", "layers/static_moe.py", "layers/static_recurrent.py", "layers/hf_decoder.py",
            "layers/shared_prefill.py", "layers/cuda_graphs.py", "sandbox/", "environments/", "features/")


def _is_feature(rel):
    return any(rel == f or (f.endswith("/") and rel.startswith(f)) for f in FEATURES)


class _Trace:
    """sys.settrace over the project's frames: which code objects ran and which of their lines."""

    def __init__(self):
        self.lines, self.codes = {}, set()  # file -> {line numbers that ran}; code objects that ran

    def __call__(self, frame, event, arg):
        path = os.path.normpath(frame.f_code.co_filename)  # a module imported through "tests/.." is the project's
        if event != "call" or not path.startswith(ROOT + os.sep) or "/tests/" in path or "/bench/" in path:
            return None
        self.codes.add(frame.f_code)
        seen = self.lines.setdefault(path, set())

        def local(frame, event, arg):
            if event == "line":
                seen.add(frame.f_lineno)
            return local
        return local


def _functions(tree):
    """Every def in the module's syntax tree, nested ones too: {first line (decorators included): node}."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            out[first] = node
    return out


def _docstring_lines(tree):
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) and \
                    isinstance(first.value.value, str):
                out.update(range(first.lineno, first.end_lineno + 1))
    return out


def _statement_lines(tree):
    """{line: the lines a statement starting there spans}: a simple statement all its lines, a compound one its
    header (up to its body's first line)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt):
            body = getattr(node, "body", None)
            end = (body[0].lineno - 1) if isinstance(body, list) and body and isinstance(body[0], ast.stmt) \
                else node.end_lineno
            out.setdefault(node.lineno, set()).update(range(node.lineno, max(node.lineno, end) + 1))
    return out


def measure(trace):
    """The figures of the module docstring, from a _Trace of one step."""
    files, names, total, code, ran, longest = {}, [], 0, 0, 0, (0, "")
    by_file = {}
    for c in trace.codes:
        if c.co_name == "<module>" or c.co_name.startswith("<"):  # lambdas and comprehensions lie in their def
            continue
        by_file.setdefault(os.path.normpath(c.co_filename), []).append(c)
    for path, codes in sorted(by_file.items()):
        text = open(path).read()
        lines = text.splitlines()
        tree = ast.parse(text)
        defs, docs, stmts = _functions(tree), _docstring_lines(tree), _statement_lines(tree)
        span = set()
        for c in codes:
            node = defs.get(c.co_firstlineno)
            if node is None:
                continue
            first = c.co_firstlineno
            own = {n for n in range(first, node.end_lineno + 1) if lines[n - 1].strip()}
            span |= own
            names.append(f"{os.path.relpath(path, ROOT)}:{c.co_qualname}")
            longest = max(longest, (len(own), names[-1]))
        if not span:
            continue
        files[os.path.relpath(path, ROOT)] = len(span)
        total += len(span)
        code_lines = {n for n in span if n not in docs and not lines[n - 1].strip().startswith("#")}
        executed = set()
        for n in trace.lines.get(path, ()):
            executed |= stmts.get(n, {n})
        code += len(code_lines)
        ran += len(code_lines & executed)
    return {"reader_lines": total, "reader_files": len(files), "reader_functions": len(names),
            "reader_feature_files": sorted(f for f in files if _is_feature(f)),
            "reader_exec_frac": ran / max(1, code), "reader_longest": longest[0], "reader_longest_name": longest[1],
            "reader_file_lines": dict(sorted(files.items(), key=lambda kv: -kv[1]))}


def trace_default_step(step=2, argv=()):
    """Run the default `python train.py` for `step` steps in this process and trace its step `step`."""
    sys.path.insert(0, ROOT)
    import train
    trace, real = _Trace(), train.train_step

    def traced(run, n):
        if n != step:
            return real(run, n)
        sys.settrace(trace)
        try:
            return real(run, n)
        finally:
            sys.settrace(None)
    train.train_step = traced
    try:
        with tempfile.TemporaryDirectory() as out:
            train.main([f"--out_dir={out}", f"--max_steps={step}", "--print_completions_every=0", *argv])
    finally:
        train.train_step = real
    return trace


def bench_reader():
    return measure(trace_default_step())


if __name__ == "__main__":
    import contextlib
    import io
    with contextlib.redirect_stdout(io.StringIO()):
        r = bench_reader()
    for k, v in r.items():
        print(f"{k}: {v}")
