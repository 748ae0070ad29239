"""The sandbox for model-written code (sandbox/executor.py), the unit-test reward and its judge (rewards.py,
sandbox/code_harness.py), the code task and the python tool.

Hostile programs run through the real sandbox and each one's containment is checked from outside: this process
survives, nothing outside the sandbox changes, no secret is printed, the run ends within its timeout + 1 s and no
process is left. Each hostile program is itself bounded (a few thousand forks, a few GB written, only 127.0.0.1
addressed), so a sandbox that fails makes a test fail, not the machine.
"""

import inspect
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sandbox import executor  # noqa: E402
import rewards  # noqa: E402
import tasks.code  # noqa: E402
import tasks  # noqa: E402
from tasks import code as code_task  # noqa: E402
import train  # noqa: E402

REAL_PROBE = executor._probe
SECRETS = {"netrc": "machine api.wandb.ai login u password netrc-secret-7f3a9c",
           "hf_token": "hf_token_secret_91c2d4", "out_dir": "outdir-secret-5d8e11", "env": "env-secret-2b6f70"}


@pytest.fixture
def world(monkeypatch):
    """What a program must not reach, made reachable by uid 65534 through permissions alone (mode 0755 folders,
    0644 and 0666 files, a 0777 folder), so that only the sandbox stands in the way: a fake HOME with ~/.netrc and a
    Hugging Face token, an out_dir with a secret, a file to delete, a place for a daemon's marker, a secret in the
    environment, a listener on 127.0.0.1 and a canary process running as the sandbox's own uid outside."""
    root = tempfile.mkdtemp(prefix="grpo-exec-test-")  # not pytest's tmp_path: its folders are 0700
    home, out = os.path.join(root, "home"), os.path.join(root, "out")
    os.makedirs(os.path.join(home, ".cache", "huggingface"))
    os.makedirs(out)
    files = {os.path.join(home, ".netrc"): SECRETS["netrc"],
             os.path.join(home, ".cache", "huggingface", "token"): SECRETS["hf_token"],
             os.path.join(out, "secret.txt"): SECRETS["out_dir"]}
    for path, text in files.items():
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o644)
    for folder, _, _ in os.walk(root):
        os.chmod(folder, 0o755)
    shared = os.path.join(root, "shared")
    os.makedirs(shared)
    os.chmod(shared, 0o777)  # anyone may delete from here, and write the marker
    victim = os.path.join(shared, "victim.txt")
    with open(victim, "w") as f:
        f.write("keep me")
    os.chmod(victim, 0o666)
    monkeypatch.setenv("HOME", home)
    monkeypatch.setenv("GRPO_TEST_SECRET", SECRETS["env"])
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    outside_uid = executor.SANDBOX_UID if os.geteuid() == 0 else os.geteuid()
    canary = subprocess.Popen(["sleep", "120"], user=outside_uid if os.geteuid() == 0 else None)
    w = dict(root=root, home=home, out=out, files=list(files), victim=victim, marker=os.path.join(shared, "marker"),
             listener=listener, port=listener.getsockname()[1], test_pid=os.getpid(), canary=canary.pid,
             canary_process=canary, uid=outside_uid)
    w["before"], w["children"] = _processes(outside_uid), _children()
    yield w
    canary.kill()
    canary.wait()
    listener.close()
    shutil.rmtree(root, ignore_errors=True)


def _processes(uid):
    """Pids of the processes whose real uid is `uid`."""
    found = set()
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/status") as f:
                status = f.read()
        except (OSError, ValueError):
            continue
        if name.isdigit() and int(status.split("Uid:")[1].split()[0]) == uid:
            found.add(int(name))
    return found


def _children():
    found = set()
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid():
            found.add(int(name))
    return found


def assert_contained(result, timeout, w):
    assert not result.sandbox_failed, result.sandbox_error
    assert result.wall_time <= timeout + 1, result
    text = result.stdout + result.stderr
    for secret in SECRETS.values():
        assert secret not in text
    try:
        with open("/etc/shadow") as f:
            shadow = [line.strip() for line in f if line.strip()]
    except OSError:
        shadow = []
    assert not any(line in text for line in shadow)
    with open(w["victim"]) as f:
        assert f.read() == "keep me"
    for path in w["files"]:
        assert os.path.exists(path)
    assert not os.path.exists(w["marker"])
    with pytest.raises(BlockingIOError):  # nobody connected to the test's listener
        w["listener"].accept()
    assert w["canary_process"].poll() is None  # alive
    spares = {proc.pid for proc, _, _ in executor._spares}  # launchers started ahead, waiting for a program
    assert _children() - w["children"] - spares <= {w["canary"]}  # no launcher left that ran one
    assert _processes(w["uid"]) - w["before"] - {w["canary"]} == set()  # nothing of the sandbox left


# ----------------------------------------------------------------------------- hostile programs

HOSTILE = {
    "infinite loop": ("while True:\n    pass\n", dict(timeout=1.0)),
    "fork bomb": ("""
import os, time
n = 0
for _ in range(3000):  # bounded: a few thousand processes if nothing stops it
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(2)
        os._exit(0)
    n += 1
print("forked", n, flush=True)
""", dict(timeout=5.0)),
    "memory": ("""
chunks = []
try:
    for _ in range(32):  # 2 GiB at most
        chunks.append(bytearray(64 << 20))
    print("allocated", len(chunks))
except MemoryError:
    print("memory-error", len(chunks))
""", dict(timeout=5.0, memory=256 << 20)),
    "huge file": ("""
written = 0
try:
    with open("big", "wb") as f:
        for _ in range(2048):  # 2 GiB at most
            f.write(b"x" * (1 << 20))
            f.flush()
            written += 1
    print("wrote", written)
except OSError as e:
    print("stopped", written, e.errno)
""", dict(timeout=10.0, file_size=8 << 20)),
    "read secrets": ("""
import os, glob
paths = ["/etc/shadow", os.path.expanduser("~/.netrc")] + {files!r} + glob.glob({root!r} + "/**", recursive=True)
for path in paths:
    try:
        print(path, open(path).read())
    except OSError as e:
        print(path, "refused:", e.strerror)
""", dict(timeout=5.0)),
    "environment": ("""
import os
print(dict(os.environ))
for path in ("/proc/self/environ", "/proc/1/environ", f"/proc/{{os.getppid()}}/environ"):
    try:
        print(open(path, "rb").read())
    except OSError as e:
        print(path, "refused:", e.strerror)
""", dict(timeout=5.0)),
    "network": ("""
import socket
for host in ("127.0.0.1", "localhost"):
    try:
        s = socket.create_connection((host, {port}), timeout=1)
        s.sendall(b"pwned")
        print("connected to", host)
    except OSError as e:
        print("no connection to", host, e)
""", dict(timeout=5.0)),
    "signals": ("""
import os
for pid in ({test_pid}, {canary}, os.getppid()):  # its parent is outside its namespace: getppid() is 0
    try:
        os.kill(pid, 9)
        print("killed", pid)
    except OSError as e:
        print("cannot kill", pid, e.strerror)
""", dict(timeout=5.0)),
    "setuid": ("""
import os
for name, call in (("setuid", lambda: os.setuid(0)), ("setgid", lambda: os.setgid(0)),
                   ("seteuid", lambda: os.seteuid(0))):
    try:
        call()
        print(name, "became root")
    except OSError as e:
        print(name, "refused", e.strerror)
print("uid", os.getuid(), os.geteuid())
""", dict(timeout=5.0)),
    "ctypes": ("""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print("kill", libc.kill({test_pid}, 9), libc.kill({canary}, 9))
print("setuid", libc.setuid(0))
print("mount", libc.mount(b"none", b"/usr", b"tmpfs", 0, None))
print("ptrace", libc.ptrace(16, {test_pid}, 0, 0))  # PTRACE_ATTACH
print("chroot", libc.chroot(b"/tmp"))
print("unshare", libc.unshare(0x10000000))  # a user namespace of its own: root inside it, and nothing more
print("delete", libc.unlink({victim!r}.encode()), flush=True)
ctypes.string_at(0)  # and a segfault
""", dict(timeout=5.0)),
    "delete outside": ("""
import os, shutil
for attempt in (lambda: os.remove({victim!r}), lambda: open({victim!r}, "w").write("pwned"),
                lambda: shutil.rmtree({root!r}), lambda: os.remove("/usr/bin/env")):
    try:
        attempt()
        print("done")
    except OSError as e:
        print("refused", e.strerror)
""", dict(timeout=5.0)),
    "daemon": ("""
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:  # double fork: a daemon, reparented away from the program
        time.sleep(1.0)
        with open({marker!r}, "w") as f:
            f.write("still alive")
        os._exit(0)
    os._exit(0)
print("the program ends; its daemon sleeps")
""", dict(timeout=5.0)),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_program_is_contained(name, strict, world):
    code, options = HOSTILE[name]
    result = executor.run(code.format(**world), **options)
    if name == "daemon":
        assert result.wall_time < 1.0 and not result.timed_out  # nothing kept its output open: the daemon is gone
        time.sleep(1.3)  # past the moment the daemon would have written its marker
    assert_contained(result, options["timeout"], world)
    out = result.stdout
    if name == "infinite loop":
        assert result.timed_out and result.exit_code is None
    elif name == "fork bomb":
        assert int(out.split()[1]) < executor.DEFAULT_PROCESSES
    elif name == "memory":
        assert out.startswith("memory-error") and int(out.split()[1]) < 4
    elif name == "huge file":
        assert out.split()[:2] == ["stopped", "8"]
    elif name == "read secrets":
        assert out.count("refused") >= 5  # /etc/shadow, ~/.netrc and the three files: not there
    elif name == "network":
        assert out.count("no connection") == 2
    elif name == "signals":
        assert f"cannot kill {world['test_pid']}" in out and f"cannot kill {world['canary']}" in out
    elif name == "setuid":
        assert out.count("refused") == 3 and "uid 65534 65534" in out
    elif name == "ctypes":
        for call in ("kill -1 -1", "setuid -1", "mount -1", "ptrace -1", "chroot -1", "delete -1"):
            assert call in out, out
        assert result.exit_code == -11  # its own segfault ended it
    elif name == "delete outside":
        assert out.count("refused") == 4


def test_limits_output_and_stdin(strict):
    r = executor.run("import sys; sys.stdout.write('x' * 1_000_000); sys.stderr.write('e' * 10)", max_output=1000)
    assert r.stdout == "x" * 1000 and r.stderr == "e" * 10 and r.truncated and r.exit_code == 0
    data = "line\n" * 200_000  # 1 MB: more than a pipe holds
    r = executor.run("import sys; print(len(sys.stdin.read()))", stdin=data)
    assert r.stdout == f"{len(data)}\n"
    r = executor.run("print('ignores its stdin')", stdin=data, timeout=5)
    assert r.stdout == "ignores its stdin\n" and not r.timed_out
    r = executor.run("import os; print(sorted(os.listdir('.')), os.getcwd(), open('data.txt').read())",
                     files={"data.txt": "given"})
    assert r.stdout == "['data.txt', 'main.py'] /tmp given\n"
    r = executor.run("raise ValueError('boom')")
    assert r.exit_code == 1 and "ValueError: boom" in r.stderr and not r.sandbox_failed


def test_pool_runs_programs_at_once_and_a_slow_one_costs_only_itself(strict):
    executor.take_stats()
    t = time.monotonic()
    results = executor.run_many([{"code": "while True: pass", "timeout": 1.0}]
                                + [f"import time; time.sleep(0.5); print({i})" for i in range(4)], workers=5)
    wall = time.monotonic() - t
    assert results[0].timed_out and [r.stdout for r in results[1:]] == ["0\n", "1\n", "2\n", "3\n"]
    assert all(r.wall_time < 1.0 for r in results[1:])  # none waited for the slow one
    assert wall < 2.0  # 4 x 0.5 s of sleep plus a 1 s timeout ran side by side
    stats = executor.take_stats()
    assert stats["programs"] == 5 and stats["timeouts"] == 1 and stats["sandbox_failures"] == 0
    assert stats["wait_seconds"] >= 1.0 and executor.take_stats()["programs"] == 0


def test_unsafe_mode_keeps_limits_and_cleans_up(monkeypatch):
    assert "UNSAFE" in executor.UNSAFE_BANNER
    r = executor.run("import os; print(os.getcwd(), sorted(os.listdir('.')), dict(os.environ).get('HOME'))",
                     sandbox="unsafe")
    folder, listing, home = r.stdout.split(" ", 2)
    assert listing == "['main.py']" and home.strip() == "None" and not os.path.exists(folder)
    r = executor.run("while True: pass", sandbox="unsafe", timeout=1.0)
    assert r.timed_out and r.wall_time < 2.0
    r = executor.run("bytearray(1 << 30)", sandbox="unsafe", memory=256 << 20)
    assert "MemoryError" in r.stderr


def test_strict_refuses_naming_what_is_missing(monkeypatch, tmp_path):
    """Where the machine cannot build the sandbox (simulated), strict and auto refuse with one line naming what is
    missing, and so does the trainer at start-up; unsafe, asked for, still runs."""
    monkeypatch.delenv("GRPO_SANDBOX", raising=False)
    monkeypatch.setattr(executor, "_probe_result", None)
    monkeypatch.setattr(executor, "_probe", lambda: "network namespaces (unshare: Operation not permitted)")
    for mode in ("strict", "auto", None):
        with pytest.raises(executor.ExecutorUnavailable) as e:
            executor.run("print(1)", sandbox=mode)
        assert "\n" not in str(e.value) and "network namespaces (unshare: Operation not permitted)" in str(e.value)
    assert executor.python("print(1)").startswith("error: strict sandbox unavailable here: network namespaces")
    with pytest.raises(SystemExit) as e:
        train.main([f"--out_dir={tmp_path / 'run'}", "--task=code", "--max_steps=1"])
    assert "--sandbox" in str(e.value) and "network namespaces" in str(e.value) and "\n" not in str(e.value)
    assert executor.run("print(1)", sandbox="unsafe").stdout == "1\n"
    # the real probe: a launcher that cannot build the root reports the step on its status pipe
    monkeypatch.setattr(executor, "_probe", REAL_PROBE)
    monkeypatch.setattr(executor, "_probe_result", None)
    monkeypatch.setattr(executor, "_paths", (executor._sandbox_paths()[0], None))  # no folder to mount a root on
    with pytest.raises(executor.ExecutorUnavailable, match="no host folder to build the sandbox's root on"):
        executor.check("strict")



def test_sandbox_setting_is_validated():
    with pytest.raises(SystemExit, match="--sandbox"):
        train.parse_config(["--sandbox=bogus"])
    assert train.parse_config(["--sandbox=unsafe"]).sandbox == "unsafe"


def test_python_tool(strict):
    sig = inspect.signature(executor.python)
    assert sig.parameters["code"].annotation is str and sig.return_annotation is str
    doc = inspect.getdoc(executor.python)
    assert "Args:" in doc and "code:" in doc and "Returns:" in doc
    assert executor.python("print(2 ** 10)") == "1024\n"
    assert "ZeroDivisionError" in executor.python("1 / 0") and "[exit code 1]" in executor.python("1 / 0")
    long = executor.python("print('a' * 10_000)")
    assert len(long) < executor.TOOL_MAX_CHARS + 100 and "characters cut" in long
    assert rewards.load_reward_funcs("sandbox/executor.py:python")[0] is executor.python  # the same module, not a copy


# ----------------------------------------------------------------------------- the unit-test reward

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(5, 5) == 10", "assert add(-1, 1) == 0"]

FORGERIES = {
    "early sys.exit(0)": "import sys\nsys.exit(0)\ndef add(a, b):\n    return a + b\n",
    "os._exit(0)": "import os\nos._exit(0)\n",
    "exit inside the function": "def add(a, b):\n    raise SystemExit(0)\n",
    "os._exit inside the function": "def add(a, b):\n    import os\n    os._exit(0)\n",
    "prints pass markers": ("print('passed'); print('OK'); print('[true, true, true]')\n"
                            "import sys; sys.stderr.write('3/3 tests passed')\ndef add(a, b):\n    return 42\n"),
    "patches builtins and assert": """
import builtins
builtins.AssertionError = type("NotAnError", (Exception,), {})
builtins.__import__ = lambda *a, **k: None
class Equal:
    def __eq__(self, other):
        return True
    __hash__ = object.__hash__
def add(a, b):
    return Equal()
""",
    "rewrites the harness and json": """
import json, sys
json.dumps = lambda *a, **k: "[true, true, true]"
json.loads = lambda *a, **k: {"value": 3}
with open("main.py", "w") as f:
    f.write("print('hacked')")
sys.stdout.write("[true, true, true]\\n")
def add(a, b):
    return None
""",
    "scrapes the tests from memory": """
import gc, re
def add(a, b):
    for obj in gc.get_objects():
        items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
        for item in list(items):
            if isinstance(item, str):
                m = re.search(r"add\\((-?\\d+), (-?\\d+)\\) == (-?\\d+)", item)
                if m and (int(m[1]), int(m[2])) == (a, b):
                    return int(m[3])
    return None
""",
    "kills its judge": "import os\nos.kill(os.getppid(), 9)\nos.kill(1, 9)\ndef add(a, b):\n    return 42\n",
}


def test_forged_successes_score_zero_honest_code_scores_its_fraction(strict):
    programs = {"honest": "```python\ndef add(a, b):\n    return a + b\n```",
                "partly right": "Here:\n```python\ndef add(a, b):\n    return a + b if a > 0 else 99\n```",
                **{name: f"```python\n{code}```" for name, code in FORGERIES.items()}}
    scores = dict(zip(programs, tasks.code.code_tests_reward(None, list(programs.values()), [ADD_TESTS] * len(programs))))
    assert scores.pop("honest") == 1.0
    assert scores.pop("partly right") == pytest.approx(2 / 3)
    assert scores == {name: 0.0 for name in FORGERIES}


def test_judge_compares_plain_data_of_its_own():
    """Builtins and modules in a test are the judge's: a program defining `set` or `math` cannot answer for them."""
    tests = ["assert set(pair(1, 2)) == set([1, 2])", "assert math.isclose(half(1), 0.5)",
             "assert list(gen(3)) == [0, 1, 2]", "assert pair(1, 2) == (1, 2)"]
    honest = ("def pair(a, b):\n    return (a, b)\ndef half(x):\n    return x / 2\n"
              "def gen(n):\n    return (i for i in range(n))\n")
    cheat = ("class E:\n    def __eq__(self, o):\n        return True\n    __hash__ = object.__hash__\n"
             "def set(*a):\n    return E()\nclass math:\n    isclose = staticmethod(lambda *a, **k: True)\n"
             "def pair(a, b):\n    return [b, a, 0]\ndef half(x):\n    return 7\ndef gen(n):\n    return E()\n")
    assert tasks.code.code_tests_reward(None, [honest, cheat], [tests, tests]) == [1.0, 0.0]


def test_a_test_that_hangs_costs_only_itself(strict):
    hangs_once = "def add(a, b):\n    while a == 1:\n        pass\n    return a + b\n"
    assert tasks.code.code_tests_reward(None, [hangs_once], [ADD_TESTS]) == [pytest.approx(2 / 3)]


def test_stdin_stdout_tests():
    tests = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10"}]
    programs = ["a, b = map(int, input().split())\nprint(a + b)", "print(3)",
                "import sys\nprint(3)\nsys.exit(0)", "while True:\n    pass"]
    assert tasks.code.code_tests_reward(None, programs, [tests] * 4) == [1.0, 0.5, 0.5, 0.0]


def test_only_the_judges_line_counts():
    fake = executor.Result(stdout="[true, true]\npassed\nabc [true, true]\n", exit_code=0)
    assert code_task._passed_fraction(fake, "0123", 2) == 0.0
    assert code_task._passed_fraction(executor.Result(stdout="0123 [true, false]\n"), "0123", 2) == 0.5
    assert code_task._passed_fraction(executor.Result(sandbox_error="mount: ..."), "0123", 2) is None


def test_extract_code():
    assert tasks.code.extract_code("text\n```python\na = 1\n```\nmore\n```py\nb = 2\n```\nend") == "b = 2\n"
    assert tasks.code.extract_code("```python\nunclosed = 1\n") == "unclosed = 1\n"
    assert tasks.code.extract_code("def f(): pass") == "def f(): pass"
    assert tasks.code.extract_code("```\nplain fence\n```") == "```\nplain fence\n```"


# ----------------------------------------------------------------------------- the code task


def test_code_task_rows(tmp_path):
    task = tasks.get_task("code")
    assert len(task.rows) == 12 and task.accuracy_reward == "code_tests_reward"
    row = task.prompts_for_step(0, 1, 1)[0]
    assert row["tests"] and "```python" in row["prompt"] and row["prompt_text"] in row["prompt"]
    mbpp = {"text": "Write add.", "test_list": ["assert add(1, 1) == 2"]}
    humaneval = {"prompt": "def add(a, b):\n", "entry_point": "add", "test": (
        "METADATA = {}\n\ndef check(candidate):\n    assert candidate(1, 1) == 2\n    for x in range(3):\n"
        "        assert candidate(x, 0) == x\n    assert abs(candidate(0.5, 0.25) - 0.75) < 1e-6\n")}
    assert code_task.code_tests(mbpp) == ["assert add(1, 1) == 2"]
    assert code_task.code_tests(humaneval) == ["assert add(1, 1) == 2", "assert abs(add(0.5, 0.25) - 0.75) < 1e-06"]
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "p", "tests": ["assert f() == 1"]}) + "\n"
                    + json.dumps({"prompt": "p", "tests": ["print('not an assert')"]}) + "\n")
    with pytest.raises(ValueError, match="row 1.*not one assert statement"):
        tasks.get_task("code", dataset=str(path))


def test_code_task_end_to_end(strict, tmp_path):
    out = tmp_path / "run"
    train.main([f"--out_dir={out}", "--task=code", "--num_generations=2", "--prompts_per_step=2",
                "--micro_batch_size=4", "--max_completion_length=16", "--max_steps=1", "--print_completions_every=0"])
    m = json.loads(open(out / "metrics.jsonl").readline())
    assert 0.0 <= m["reward/code_tests_reward"] <= 1.0
    assert m["exec_programs"] == 4 and m["exec_sandbox_failures"] == 0 and m["exec_time"] > 0
    assert "exec_timeouts" in m and m["exec_program_time"] > 0


def test_spare_launcher_ends_with_its_trainer(strict):
    """run() keeps one launcher started ahead for the next program; it ends when the process that started it does."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (f"import sys; sys.path.insert(0, {root!r}); from sandbox import executor\n"
            "assert executor.run('print(1)').stdout == '1\\n'\nprint(executor._spares[0][0].pid)")
    spare = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    for _ in range(50):
        if not os.path.exists(f"/proc/{spare}"):
            break
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{spare}")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and util-linux unshare")
def test_refuses_a_user_that_is_root_outside_its_namespace():
    """Non-root inside a user namespace that maps it onto the host's root (a container's setup): the kernel would not
    count the program's processes against RLIMIT_NPROC, so strict refuses instead of running without a limit."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (f"import sys; sys.path.insert(0, {root!r}); from sandbox import executor\n"
            "try:\n    executor.check('strict')\nexcept executor.ExecutorUnavailable as e:\n    print(e)")
    out = subprocess.run(["unshare", "--user", "--map-user=1000", "--map-group=1000", sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=60).stdout
    assert "process limit: uid 1000 is root outside this user namespace" in out
