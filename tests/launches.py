"""Launching the trainer for the multi-process tests, and reading what a run left (used by test_distributed.py
and test_vision.py): several train.py runs to a launch of tests/run_train.py (`launch_runs`), 1 process or 2
under torchrun with gloo, or several torchrun agents on this machine as several nodes would run them
(`launch_nodes`); metrics.jsonl, the tokens each rank sampled, and whether an exported folder holds the trained
weights."""

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_TRAIN = os.path.join(ROOT, "tests", "run_train.py")


def launch(script, args, nproc, timeout=240):
    """Run a script with 1 process (plain python) or `nproc` (torchrun); return its output, fail with it."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on CPU also on a GPU machine (two ranks cannot share one GPU under NCCL)
    if nproc == 1:
        cmd = [sys.executable, script, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               script, *args]
    for marker in glob.glob(os.path.join(out_dir_of(args) or "/nonexistent", "finished_rank*")):
        os.remove(marker)  # left by an earlier launch into the same folder
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = r.stdout + r.stderr
    assert r.returncode == 0 or exited_after_finishing(out, args, nproc), f"{' '.join(cmd)} failed:\n{out[-6000:]}"
    return out


def clean_env():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_command(script_args, nnodes, nproc, port, join_timeout=120):
    """One node's torchrun, as the README gives it for several nodes: c10d rendezvous at 127.0.0.1:port."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc_per_node={nproc}",
            "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=nodes",
            f"--rdzv_conf=join_timeout={join_timeout}", *script_args]


def start_agents(script_args, nnodes, nproc, started=None, join_timeout=120):
    """Popen of `started` (all by default) of the `nnodes` agents of one run on this machine, each in a session of
    its own (so that a test can kill one with its workers)."""
    port = free_port()
    return [subprocess.Popen(agent_command(script_args, nnodes, nproc, port, join_timeout), cwd=ROOT, env=clean_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
            for _ in range(nnodes if started is None else started)]


def launch_nodes(runs, folder, name, nnodes=2, nproc=2, kill_when_paused=None, timeout=600):
    """Several runs of run_train.py (as `launch_runs`) in one run of `nnodes` torchrun agents of `nproc` processes.

    kill_when_paused: the out_dir of a run given --pause_after_step; once every rank waits there, each agent is
    sent SIGTERM (a scheduler's kill: the agent passes it on to its workers and exits), and the launch's output is
    returned as it is. Otherwise every run must finish; {out_dir: its output}."""
    path = os.path.join(folder, f"{name}.json")
    with open(path, "w") as f:
        json.dump(runs, f)
    for marker in glob.glob(os.path.join(out_dir_of(runs[-1]), "finished_rank*")):
        os.remove(marker)
    agents, deadline = start_agents([RUN_TRAIN, f"--runs={path}"], nnodes, nproc), time.time() + timeout
    world = nnodes * nproc
    if kill_when_paused:
        paused = [os.path.join(kill_when_paused, f"paused_rank{r}") for r in range(world)]
        while not all(map(os.path.exists, paused)) and all(a.poll() is None for a in agents):
            assert time.time() < deadline, "the run never paused"
            time.sleep(0.2)
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGTERM)
    outs = [a.communicate(timeout=max(1, deadline - time.time()))[0] for a in agents]
    out = "".join(outs)
    if kill_when_paused:
        assert all(map(os.path.exists, paused)), out[-6000:]
        return out
    finished = all(os.path.exists(os.path.join(out_dir_of(runs[-1]), f"finished_rank{r}")) for r in range(world))
    assert all(a.returncode == 0 for a in agents) or (
        finished and "terminate called without an active exception" in out), out[-6000:]
    return split_runs(out, runs)


def split_runs(out, runs):
    """{out_dir: its part of the output} of a launch of several runs (run_train.py prints `=== run OUT_DIR`)."""
    said = {}
    for part in out.split("=== run ")[1:]:
        where, _, text = part.partition("\n")
        said[where] = text
    assert list(said) == [out_dir_of(r) for r in runs], out[-6000:]
    return said


def launch_failing(script_args, nproc, timeout=240):
    """Run a script under torchrun (one node, `nproc` processes) that must fail; its output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *script_args]
    r = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=timeout)
    assert r.returncode != 0, r.stdout + r.stderr
    return r.stdout + r.stderr


def launch_runs(runs, nproc, folder, name, timeout=600):
    """Several runs of run_train.py, one after another in one launch ({out_dir: its output}): a tiny run takes
    less than starting the processes and their group. Each run leaves what a launch of its own would."""
    path = os.path.join(folder, f"{name}.json")
    with open(path, "w") as f:
        json.dump(runs, f)
    return split_runs(launch(RUN_TRAIN, [f"--runs={path}"], nproc, timeout), runs)


def out_dir_of(args):
    for a in args:
        if a.startswith("--runs="):  # several runs: the last one's, whose end is the launch's
            with open(a.split("=", 1)[1]) as f:
                return out_dir_of(json.load(f)[-1])
    return next((a.split("=", 1)[1] for a in args if a.startswith("--out_dir=")), None)


def exited_after_finishing(out, args, nproc):
    """A gloo worker that aborts while the process group is torn down or the interpreter exits.

    Seen in about one 2-process launch in fifty on 2 CPU cores, with the loop of before and after the step
    functions alike: a C++ thread still joinable at the end ("terminate called without an active
    exception"). When every rank had finished its work (each writes finished_rank<r> just before the
    teardown), the run's results stand; an abort anywhere earlier still fails the test.
    """
    out_dir = out_dir_of(args)
    return (nproc > 1 and out_dir is not None and "terminate called without an active exception" in out
            and all(os.path.exists(os.path.join(out_dir, f"finished_rank{r}")) for r in range(nproc)))


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def tokens(out_dir):
    """The sampled completion ids of every step, all ranks' rows concatenated in rank order."""
    per_rank = []
    for path in sorted(glob.glob(os.path.join(out_dir, "tokens_rank*.jsonl"))):
        with open(path) as f:
            per_rank.append([json.loads(line) for line in f])
    return [sum(step_rows, []) for step_rows in zip(*per_rank)]


def export_differs(folder, want):
    """What keeps the Hugging Face folder `folder` from being exactly the weights `want` (the model's names, LoRA
    merged) when `from_pretrained` loads it, or None: every tensor equal, dtype too, nothing missing or extra, tied
    embeddings stored once and tied again, the index naming every tensor of several files."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig

    import model_loading
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    stored = {}
    for f in files:
        with safe_open(os.path.join(folder, f), "pt") as handle:
            stored.update(dict.fromkeys(handle.keys(), f))
    if len(files) > 1:
        with open(os.path.join(folder, "model.safetensors.index.json")) as f:
            if json.load(f)["weight_map"] != stored:
                return "the index does not name each tensor's file"
    model_class = model_loading.causal_lm_class(AutoConfig.from_pretrained(folder))  # a vision-language one too
    model, info = model_class.from_pretrained(folder, output_loading_info=True)
    if info["missing_keys"] or info["unexpected_keys"]:
        return f"loading info {info}"
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if tied == ("lm_head.weight" in stored):
        return "tied embeddings not stored once and tied again on loading"
    got = model.state_dict()
    if got.keys() != want.keys():
        return f"names differ: {sorted(got.keys() ^ want.keys())[:4]}"
    for k, v in want.items():
        if got[k].dtype != v.dtype or not torch.equal(got[k], v):
            return f"{k} differs"
    return None
