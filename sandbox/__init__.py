"""Running model-written code: one program at a time or a pool, each in a fresh process, isolated and bounded.

    executor.py      the trainer's side: run(), run_many(), the `python` tool, the modes and their limits
    launcher.py      the sandbox's side, a fresh `python -I -S` per program: namespaces, root, limits, filter
    cgroups.py       one control group per program: memory, CPU time and processes for all its processes together
    seccomp.py       the system-call filter, a BPF program assembled here
    code_harness.py  the unit-test judge of the code task, run inside the sandbox as the program (never imported)

Imports: the standard library and one another; nothing else of the project. This file imports nothing, so the
launcher's fresh interpreter reads no more than it needs. docs/sandbox.md says what is isolated and bounded.
"""
