"""Unit tests of a model-written program, judged inside the sandbox; rewards.py sends this file through sandbox/executor.py
as the program to run, with the completion's code beside it as solution.py. The trainer never imports it.

    python -I -S main.py            the judge: reads {"nonce", "tests", "timeout"} on stdin and prints one line,
                                    "<nonce> [true, false, ...]", a verdict per test
    python -I -S main.py serve R W  the program's side: loads solution.py, answers the judge's calls on fds R and W

Why two processes. Whatever runs in the program's process belongs to the program: it can exit early with status 0,
print "passed", rebind builtins or AssertionError, return an object whose __eq__ is always true, rewrite this file.
So the judge runs no line of the program. It alone holds the tests (read from stdin, never written to a file) and
evaluates each assert itself; a call to one of the program's functions goes, with its arguments as plain data, to
the server, a process that loaded solution.py and never held the tests (forked before the judge read them; after a
timeout, a fresh interpreter), and the answer comes back as plain data (None, bool, int, float, complex, str,
bytes, and lists, tuples, sets, frozensets, dicts and ranges of them; an iterator as the items it yields), rebuilt
as new objects of the judge's own before the test compares them. Builtins
and standard-library modules named in a test are always the judge's, never the program's (a program that defines
`set` cannot make `set(f(x)) == set([1, 2])` true). The verdict goes to the judge's stdout, which no process of the
program holds, and the trainer counts it only after the nonce it sent. The judge is not dumpable, so the program
cannot ptrace it or read its memory, and it imports every module it needs before the program starts.

What a program can still do: stop its own tests from being judged (kill the judge, hang, crash): that scores 0. A
test comparing two of the program's own values (`assert f(1) == g(2)`) is only as strong as the program is honest.
A test that needs an object of the program's own class fails: only plain data crosses.

Input/output tests ({"input": ..., "output": ...}) run the program as a script, a fresh interpreter per test, with
the input on stdin; the judge compares what it printed with the expected output, which the program never sees
(trailing whitespace of each line and trailing blank lines ignored); a program that times out fails.
"""

import builtins
import json
import os
import select
import sys
import time

MAX_ANSWER = 1 << 20  # bytes of one answer from the program's side
MAX_OUTPUT = 1 << 20  # bytes kept of a stdin/stdout program's output
MAX_DEPTH = 100       # nesting of a value
MAX_ITEMS = 100_000   # items read out of an iterator
SOLUTION = "solution.py"


class Lost(Exception):
    """The program's side broke the protocol, died or overran the test's time: it is not asked again."""


class ProgramError(Exception):
    """The program's function raised, or answered something that is not plain data."""


# ----------------------------------------------------------------------------- plain data, both ways


def encode(value, depth=0):
    """A value as JSON-ready plain data: scalars as they are, containers as [tag, items]; TypeError for others."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if depth > MAX_DEPTH:
        raise TypeError("nested too deeply")
    for kind in (int, float, str):
        if isinstance(value, kind):  # a subclass (an IntEnum, a str subclass): its plain value
            return kind(value)
    if isinstance(value, (list, tuple, set, frozenset)):
        tag = next(t for t in (list, tuple, frozenset, set) if isinstance(value, t)).__name__
        return [tag, [encode(v, depth + 1) for v in value]]
    if isinstance(value, dict):  # OrderedDict, Counter, defaultdict compare as dicts
        return ["dict", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
    if isinstance(value, (bytes, bytearray)):
        return ["bytes", bytes(value).hex()]
    if isinstance(value, complex):
        return ["complex", [value.real, value.imag]]
    if isinstance(value, range):
        return ["range", [value.start, value.stop, value.step]]
    if hasattr(value, "__next__"):  # a generator, map, zip, ...: what it yields
        items = []
        for item in value:
            if len(items) == MAX_ITEMS:
                raise TypeError(f"an iterator of more than {MAX_ITEMS} items")
            items.append(encode(item, depth + 1))
        return ["iter", items]
    raise TypeError(f"a {type(value).__name__} is not plain data")


def decode(data, depth=0):
    """encode()'s output back into new plain objects; ValueError for anything else (the other side is untrusted)."""
    if data is None or type(data) in (bool, int, float, str):
        return data
    if depth > MAX_DEPTH or type(data) is not list or len(data) != 2 or type(data[0]) is not str:
        raise ValueError("not plain data")
    tag, items = data
    if tag in ("list", "tuple", "set", "frozenset", "iter", "dict") and type(items) is not list:
        raise ValueError("not plain data")
    if tag == "dict":
        if not all(type(kv) is list and len(kv) == 2 for kv in items):
            raise ValueError("not plain data")
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in items}
    kinds = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset, "iter": lambda xs: iter(list(xs))}
    if tag in kinds:
        return kinds[tag](decode(v, depth + 1) for v in items)
    if tag == "bytes" and type(items) is str:
        return bytes.fromhex(items)
    if tag == "complex" and type(items) is list and len(items) == 2:
        return complex(float(items[0]), float(items[1]))
    if tag == "range" and type(items) is list and len(items) == 3 and all(type(i) is int for i in items):
        return range(*items)
    raise ValueError("not plain data")


def describe(error):
    return f"{type(error).__name__}: {error}"[:500]


# ----------------------------------------------------------------------------- pipes with deadlines


def read_line(fd, buffer, deadline):
    """One line from `fd` (bytes, without the newline) before `deadline`; Lost on end of file, overrun or timeout."""
    while b"\n" not in buffer:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            raise Lost("timed out")
        chunk = os.read(fd, 65536)
        if not chunk:
            raise Lost("the program's side ended")
        buffer += chunk
        if len(buffer) > MAX_ANSWER:
            raise Lost("an answer too long")
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return line


def write_all(fd, data, deadline):
    view = memoryview(data)
    while view:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([], [fd], [], remaining)[1]:
            raise Lost("timed out")
        try:
            view = view[os.write(fd, view[:65536]):]
        except OSError as e:  # the program's side is gone
            raise Lost(describe(e)) from None


def kill(pid):
    """A child started in a session of its own, its process group, and the child reaped."""
    for send in (os.killpg, os.kill):  # the group, and the child itself should it not have its session yet
        try:
            send(pid, 9)
        except OSError:
            pass
    os.waitpid(pid, 0)


def spawn(args, actions):
    """A child in a session of its own (so that its whole group can be killed), with an empty environment."""
    return os.posix_spawn(sys.executable, [sys.executable, "-I", "-S", *args], {}, file_actions=actions, setsid=True)


# ----------------------------------------------------------------------------- the judge


class Server:
    """The program's side: a fresh interpreter with solution.py loaded, answering calls by name."""

    def __init__(self, deadline, forked=None):
        if forked is None:  # a fresh interpreter
            to_r, self.to_w = os.pipe()
            self.from_r, from_w = os.pipe()
            for fd in (to_r, from_w):
                os.set_inheritable(fd, True)
            actions = [(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0), (os.POSIX_SPAWN_DUP2, 2, 1)]
            try:
                self.pid = spawn([os.path.abspath(__file__), "serve", str(to_r), str(from_w)], actions)
            except OSError as e:  # out of processes: the program's leftovers use them up
                for fd in (to_r, from_w, self.to_w, self.from_r):
                    os.close(fd)
                raise Lost(describe(e)) from None
            os.close(to_r)
            os.close(from_w)
        else:
            self.pid, self.to_w, self.from_r = forked
        self.buffer = bytearray()
        self.deadline = deadline
        try:
            write_all(self.to_w, b"load\n", self.deadline)
            answer = self.receive()
            if "error" in answer or type(answer.get("names")) is not dict:
                raise Lost(f"the program did not load: {str(answer.get('error', 'no names'))[:500]}")
        except Lost:
            self.close()
            raise
        self.names = answer["names"]

    @staticmethod
    def fork():
        """The first server, forked before the judge reads the tests, so its memory holds none of them; it saves
        an interpreter's start. Later ones (after a timeout, the tests in memory) are fresh interpreters."""
        to_r, to_w = os.pipe()
        from_r, from_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.setsid()
                null = os.open("/dev/null", os.O_RDONLY)
                os.dup2(null, 0)  # the judge's stdin, which the tests are about to come through
                os.dup2(2, 1)     # and never its stdout, where the verdict goes
                for fd in (null, to_w, from_r):
                    os.close(fd)
                serve(to_r, from_w)
            finally:
                os._exit(0)
        os.close(to_r)
        os.close(from_w)
        return pid, to_w, from_r

    def receive(self):
        try:
            answer = json.loads(read_line(self.from_r, self.buffer, self.deadline))
        except (ValueError, RecursionError) as e:
            raise Lost(f"not an answer: {describe(e)}") from None
        if type(answer) is not dict:
            raise Lost("not an answer")
        return answer

    def ask(self, request):
        write_all(self.to_w, json.dumps(request).encode() + b"\n", self.deadline)
        answer = self.receive()
        if "error" in answer:
            raise ProgramError(str(answer["error"])[:500])
        try:
            return decode(answer.get("value"))
        except (ValueError, TypeError, RecursionError) as e:  # unhashable items in a set, ...
            raise ProgramError(f"not plain data: {describe(e)}") from None

    def bind(self, name):
        """What a test sees for one of the program's names: a function that asks, or the value it holds."""
        if self.names[name] == "function":
            def call(*args, **kwargs):
                return self.ask({"call": name, "args": encode(list(args)), "kwargs": encode(kwargs)})
            call.__name__ = call.__qualname__ = name
            return call
        return self.ask({"get": name})

    def close(self):
        for fd in (self.to_w, self.from_r):
            os.close(fd)
        kill(self.pid)


def code_names(code):
    """Every global or attribute name a compiled test uses, nested code (comprehensions, lambdas) included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= code_names(const)
    return names


def judge_asserts(tests, timeout, forked):
    """A verdict per assert statement. Every test is compiled and its modules imported before the program starts
    (`forked`: a server waiting to load it)."""
    judged = []
    for test in tests:
        code = compile(test, "<test>", "exec")
        names = code_names(code)
        own = {}
        for name in names:
            if name in sys.stdlib_module_names and not hasattr(builtins, name):
                try:
                    own[name] = __import__(name)
                except ImportError:
                    pass
        judged.append((code, names, own))
    verdicts, server, loads = [], None, True
    for code, names, own in judged:
        deadline = time.monotonic() + timeout
        if server is None and loads:
            first, forked = forked, None
            try:
                server = Server(deadline, first)
            except Lost as e:
                print(f"judge: {e}", file=sys.stderr)
                loads = first is None  # a failed first load would fail again; a reload is tried per test
            if first is not None:  # the first load has a test's time of its own; a reload counts in its test's
                deadline = time.monotonic() + timeout
        if server is None:
            verdicts.append(False)
            continue
        server.deadline = deadline
        scope = {"__builtins__": builtins, **own}
        ok = False
        try:
            for name in names:
                if name in server.names and name not in scope and not hasattr(builtins, name) \
                        and name not in sys.stdlib_module_names:
                    scope[name] = server.bind(name)
            exec(code, scope)
            ok = True
        except Lost as e:
            print(f"judge: {e}", file=sys.stderr)
            server.close()
            server = None
        except BaseException as e:  # noqa: B902 - an assert that fails, a call that raised: the test fails
            print(f"judge: {describe(e)}", file=sys.stderr)
        verdicts.append(ok)
    if server is not None:
        server.close()
    return verdicts


def run_script(stdin, timeout):
    """(what the program printed, whether it ended in time), run as a script on `stdin`."""
    deadline = time.monotonic() + timeout
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    pid = spawn([SOLUTION], [(os.POSIX_SPAWN_DUP2, in_r, 0), (os.POSIX_SPAWN_DUP2, out_w, 1)])
    os.close(in_r)
    os.close(out_w)
    os.set_blocking(in_w, False)
    exited = os.pidfd_open(pid)
    output, data, ended = bytearray(), memoryview(stdin.encode()), False
    writing, reading = [in_w], [out_r, exited]
    if not data:
        os.close(in_w)
        writing = []
    while reading and time.monotonic() < deadline:
        ready_r, ready_w, _ = select.select(reading, writing, [], max(deadline - time.monotonic(), 0))
        if ready_w:
            try:
                data = data[os.write(in_w, data[:65536]):]
            except BlockingIOError:
                pass
            except OSError:
                data = data[:0]
            if not data:
                os.close(in_w)
                writing = []
        for fd in ready_r:
            if fd == exited:
                ended = True
                reading.remove(fd)
                deadline = min(deadline, time.monotonic() + 0.2)  # what is left in the pipe, not a detached child
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                reading.remove(fd)
            output += chunk[:max(MAX_OUTPUT - len(output), 0)]
    for fd in writing + [out_r, exited]:
        os.close(fd)
    kill(pid)
    return output.decode(errors="replace"), ended


def same_output(printed, expected):
    def lines(text):
        out = [line.rstrip() for line in text.splitlines()]
        while out and not out[-1]:
            out.pop()
        return out
    return lines(printed) == lines(expected)


def judge():
    # not dumpable: the program's processes (same uid) cannot ptrace this one nor open its /proc files
    import ctypes
    if ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        sys.exit("judge: cannot make itself undumpable")
    forked = Server.fork()  # before the tests are read
    spec = json.loads(sys.stdin.buffer.read())
    nonce, tests, timeout = spec["nonce"], spec["tests"], float(spec["timeout"])
    if all(type(t) is dict for t in tests):
        os.close(forked[1])  # the server loads nothing: a stdin/stdout program runs as a script
        os.close(forked[2])
        kill(forked[0])
        verdicts = []
        for test in tests:
            try:
                printed, ended = run_script(test["input"], timeout)
            except OSError as e:  # out of processes: the program's leftovers use them up
                print(f"judge: {describe(e)}", file=sys.stderr)
                printed, ended = "", False
            verdicts.append(ended and same_output(printed, test["output"]))
    else:
        verdicts = judge_asserts(tests, timeout, forked)
    sys.stdout.write(f"{nonce} {json.dumps(verdicts)}\n")
    sys.stdout.flush()


# ----------------------------------------------------------------------------- the program's side


def serve(requests, answers):
    """Once asked to, load solution.py, say which names it defined, then answer each call (this process is the
    program's)."""
    requests, answers = os.fdopen(requests, "rb"), os.fdopen(answers, "wb")
    if requests.readline() != b"load\n":  # a forked server that is not needed (stdin/stdout tests)
        return

    def send(message):
        try:
            line = json.dumps(message)
        except (TypeError, ValueError) as e:
            line = json.dumps({"error": describe(e)})
        answers.write(line.encode() + b"\n")
        answers.flush()

    scope = {"__name__": "solution", "__builtins__": builtins}
    try:
        with open(SOLUTION, "rb") as f:
            exec(compile(f.read(), SOLUTION, "exec"), scope)
    except BaseException as e:  # noqa: B902 - an early sys.exit() is a program that did not load
        send({"error": describe(e)})
        return
    send({"names": {k: "function" if callable(v) else "value" for k, v in scope.items() if not k.startswith("__")}})
    for line in requests:
        try:
            request = json.loads(line)
            if "get" in request:
                value = scope[request["get"]]
            else:
                value = scope[request["call"]](*decode(request["args"]), **decode(request["kwargs"]))
            answer = {"value": encode(value)}
        except BaseException as e:  # noqa: B902 - SystemExit inside the function included
            answer = {"error": describe(e)}
        send(answer)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(int(sys.argv[2]), int(sys.argv[3]))
    else:
        judge()
