"""The repository's shape: the design card's files at the top, each subsystem a folder that says what it holds and
what it may import, and no circle among the project's imports (read from the code, function-level imports
included). `python tests/test_layout.py` prints the import graph, folder by folder."""

import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEFT_OUT = {"tests", "docs", "recipes", ".git", ".ci", "out", "__pycache__"}
TOP_LEVEL_LIMIT = 10


def project_files(root=ROOT):
    """Every Python file of the project but the tests, as paths relative to root."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in LEFT_OUT and not d.startswith("."))
        found += [os.path.relpath(os.path.join(folder, f), root) for f in sorted(files) if f.endswith(".py")]
    return found


def _module_file(dotted, files):
    """The project file a dotted module name is, or None (a library)."""
    base = dotted.replace(".", "/")
    for path in (base + ".py", base + "/__init__.py"):
        if path in files:
            return path
    return None


def imports(path, files, root=ROOT):
    """The project files `path` imports, anywhere in it (a function's own imports too), packages' __init__.py
    included: importing a.b runs a/__init__.py first."""
    tree = ast.parse(open(os.path.join(root, path)).read(), path)
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]  # a submodule, where it is one
    found = set()
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            target = _module_file(".".join(parts[:i]), files)
            if target and target != path:
                found.add(target)
    return found


def graph(root=ROOT):
    files = set(project_files(root))
    return {f: imports(f, files, root) for f in sorted(files)}


def circles(edges):
    """Each strongly connected set of two or more files (Tarjan's algorithm), sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def test_the_top_level_is_the_design_cards_files_and_a_few_more():
    top = [f for f in project_files() if "/" not in f]
    assert {"grpo.py", "model_loading.py", "rewards.py", "sharding.py", "train.py"} <= set(top)
    assert len(top) <= TOP_LEVEL_LIMIT, f"{len(top)} Python files at the top level: {top}"


def test_every_folder_opens_with_what_it_holds_and_what_it_may_import():
    folders = sorted({os.path.dirname(f) for f in project_files() if "/" in f})
    assert {"layers", "sandbox", "environments", "runs", "bench", "tasks"} <= set(folders)
    for folder in folders:
        init = os.path.join(ROOT, folder, "__init__.py")
        assert os.path.exists(init), f"{folder}/ has no __init__.py saying what it holds"
        doc = ast.get_docstring(ast.parse(open(init).read())) or ""
        assert len(doc) > 100 and "Imports" in doc, f"{folder}/__init__.py does not say what it holds and imports"
        for name in os.listdir(os.path.join(ROOT, folder)):
            assert not name.startswith(os.path.basename(folder) + "_"), f"{folder}/{name} repeats its folder's name"


def test_no_two_files_import_each_other_directly_or_through_others():
    assert circles(graph()) == []


def test_the_circle_finder_finds_a_circle(tmp_path):
    """A circle of three files through a function's own import and a package's submodule is found."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text('"""pkg"""\n')
    (tmp_path / "a.py").write_text("from pkg import b\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    import c\n")
    (tmp_path / "c.py").write_text("import a\n")
    (tmp_path / "d.py").write_text("import a, torch\n")
    assert circles(graph(str(tmp_path))) == [["a.py", "c.py", "pkg/b.py"]]


def test_layers_and_sandbox_import_nothing_of_the_project_outside_their_folder():
    for f, targets in graph().items():
        folder = f.partition("/")[0]
        if folder in ("layers", "sandbox") and "/" in f:
            outside = sorted(t for t in targets if not t.startswith(folder + "/"))
            assert not outside, f"{f} imports {outside}"


def test_tensor_parallelism_is_applied_from_three_places_at_most():
    """Tensor parallelism is applied from outside the layers it cuts: its groups made at setup (runs/setup.py),
    its refusals asked when the paths are decided and its sums put after a sliced layer's blocks
    (layers/transformer.py), the plan's decoder on the meta device
    (runs/plan.py). A weight-copy site that imports it to cut a weight makes a fourth, and this fails: the decoder
    reads every weight through the reader it was given (layers/engine.py's Whole, or a Slice)."""
    users = sorted(f for f, targets in graph().items() if "layers/tensor_parallel.py" in targets)
    assert len(users) <= 3, f"layers/tensor_parallel.py is imported by {users}"


if __name__ == "__main__":
    edges = graph()
    by_folder = {}
    for f, targets in edges.items():
        here = f.partition("/")[0] + "/" if "/" in f else f
        for t in targets:
            there = t.partition("/")[0] + "/" if "/" in t else t
            if there != here:
                by_folder.setdefault(here, set()).add(there)
    for here in sorted(set(by_folder) | {(f.partition("/")[0] + "/" if "/" in f else f) for f in edges}):
        print(f"{here:20s} -> {', '.join(sorted(by_folder.get(here, ()))) or '(nothing of the project)'}")
    print("circles of files:", circles(edges) or "none")
    sys.exit(1 if circles(edges) else 0)
