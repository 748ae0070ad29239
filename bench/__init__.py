"""Speed and memory against the baselines people use, measured side by side in one run: `python -m bench`
(from the repository's root; `python -m bench --help`). __main__.py holds the rows' list and the command line.

    decode.py  the sampler's rows: decode and each family against model.generate, multi-turn rollouts
    step.py    the training rows: a GRPO step against TRL's GRPOTrainer, long completions, log-prob memory,
               the training forward per family
    hostmem.py a whole run's peak host memory per process at 1, 2 and 4 processes (tensor-parallel decoding)
    common.py  the model shapes, timing that waits for the device, medians
    results/   recorded runs (--json), cited by docs/performance.md

Imports: anything of the project, and tests/architectures.py's family table; nothing imports the bench.
"""
