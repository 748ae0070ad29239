"""One run per out_dir (a lock the OS drops when its holder dies) and checkpoints that refuse to go wrong quietly.

Run as a script, this file is the other process the tests need:
    python tests/test_out_dir.py hold DIR          take the lock, print "locked", wait to be killed
    python tests/test_out_dir.py leftover DIR      hold only the workers' shared lock, as a worker whose
                                                   launcher and rank 0 died
    torchrun ... tests/test_out_dir.py take DIR    every rank tries the lock and prints what happened
"""

import fcntl
import os
import re
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import sharding  # noqa: E402

ONE = sharding.Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def _start(mode, out_dir):
    """Another process holding the lock in `mode`; returns once it holds it."""
    p = subprocess.Popen([sys.executable, __file__, mode, str(out_dir)], env=_env(), stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def _stop(p):
    p.kill()
    p.wait()


# ----------------------------------------------------------------------------- one run per out_dir


def test_second_run_fails_naming_the_holder(tmp_path):
    holder = _start("hold", tmp_path / "run")
    try:
        with pytest.raises(sharding.OutDirBusy) as e:
            sharding.lock_out_dir(str(tmp_path / "run"), ONE)
        message = str(e.value)
        assert f"pid {holder.pid} on host" in message and "since" in message and str(tmp_path / "run") in message
        assert "\n" not in message
    finally:
        _stop(holder)


def test_killed_holder_frees_the_lock_at_once(tmp_path):
    holder = _start("hold", tmp_path)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    lock = sharding.lock_out_dir(str(tmp_path), ONE)  # no waiting, no stale file to remove
    assert open(tmp_path / ".lock").read().startswith(f"pid {os.getpid()} on host")
    lock.release()
    sharding.lock_out_dir(str(tmp_path), ONE).release()  # released: free again


def test_leftover_workers_of_an_earlier_launch_keep_the_lock(tmp_path):
    """Rank 0 died with its launcher; a worker it left still runs: a new launch must not start."""
    first = sharding.lock_out_dir(str(tmp_path), ONE)
    first.release()  # rank 0 of the earlier launch is gone; its record stays in .lock
    leftover = _start("leftover", tmp_path)
    try:
        with pytest.raises(sharding.OutDirBusy, match=f"left from an earlier run whose rank 0 \\(pid {os.getpid()}"):
            sharding.lock_out_dir(str(tmp_path), ONE)
    finally:
        _stop(leftover)
    sharding.lock_out_dir(str(tmp_path), ONE).release()


def test_every_rank_of_a_launch_fails_together(tmp_path):
    """torchrun with 2 ranks while another run holds out_dir: both ranks raise OutDirBusy, none goes on."""
    holder = _start("hold", tmp_path)
    try:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
               "take", str(tmp_path)]
        r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    finally:
        _stop(holder)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    for rank in (0, 1):
        assert f"rank {rank} busy: out_dir {tmp_path} is in use by another run (pid {holder.pid}" in out, out
    assert "rank 0 locked" not in out and "rank 1 locked" not in out


# ----------------------------------------------------------------------------- checkpoints


def _tiny(hidden_size):
    from transformers import AutoModelForCausalLM
    import model_loading

    torch.manual_seed(0)
    config = model_loading.tiny_config(model_loading.build_byte_tokenizer(), hidden_size=hidden_size,
                                       intermediate_size=2 * hidden_size)
    model = sharding.Root(AutoModelForCausalLM.from_config(config))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


# torch.distributed.checkpoint warns that it runs without a process group, as asked
@pytest.mark.filterwarnings("ignore")
def test_checkpoint_of_another_model_says_what_does_not_fit(tmp_path):
    model, optimizer = _tiny(64)
    path = sharding.save_checkpoint(str(tmp_path), 1, model, optimizer, {}, ONE)
    other, other_opt = _tiny(32)
    with pytest.raises(SystemExit) as e:
        sharding.load_latest_checkpoint(str(tmp_path), other, other_opt, ONE)
    message = str(e.value.code)
    line = next(x for x in message.splitlines() if path in x)
    assert "CheckpointException" not in line
    assert "mismatch" in line.lower() and "embed_tokens" in line and "64" in line and "32" in line, message


@pytest.mark.filterwarnings("ignore")
def test_non_finite_weights_are_never_saved(tmp_path):
    model, optimizer = _tiny(32)
    sharding.save_checkpoint(str(tmp_path), 1, model, optimizer, {}, ONE)
    before = {f: os.path.getmtime(os.path.join(dirpath, f)) for dirpath, _, files in os.walk(tmp_path) for f in files}
    with torch.no_grad():
        model.lm.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    with pytest.raises(RuntimeError, match=r"model\.layers\.1\.mlp\.up_proj\.weight holds NaN or inf on rank 0 "
                                           r"at step 2; nothing saved"):
        sharding.save_checkpoint(str(tmp_path), 2, model, optimizer, {}, ONE, keep=1)
    after = {f: os.path.getmtime(os.path.join(dirpath, f)) for dirpath, _, files in os.walk(tmp_path) for f in files}
    assert after == before and sorted(os.listdir(tmp_path / "checkpoints")) == ["step_00000001"]
    assert sharding.first_non_finite(model) == "lm.model.layers.1.mlp.up_proj.weight"


def _small():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _train_step(model, optimizer):
    model(torch.randn(5, 4)).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_checkpoint_files_incomplete_damaged_and_kept(tmp_path, capsys):
    d = sharding.Dist(0, 0, 1, torch.device("cpu"))
    model, optimizer = _small()
    saved = {}
    warnings.simplefilter("ignore")  # torch.distributed.checkpoint warns that it runs without a process group
    for step in (1, 2, 3):
        _train_step(model, optimizer)
        sharding.save_checkpoint(str(tmp_path), step, model, optimizer, {"note": step}, d, keep=2)
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    dirs = sorted(os.listdir(tmp_path / "checkpoints"))
    assert dirs == ["step_00000002", "step_00000003"]  # the newest 2 kept

    # a half-written folder left by a killed save is never a candidate
    os.makedirs(tmp_path / "checkpoints" / ".tmp_step_00000009")
    # step 3 damaged without changing any size: its metadata no longer unpickles
    meta = tmp_path / "checkpoints" / "step_00000003" / ".metadata"
    meta.write_bytes(b"\0" * meta.stat().st_size)
    fresh, fresh_opt = _small()
    capsys.readouterr()
    state = sharding.load_latest_checkpoint(str(tmp_path), fresh, fresh_opt, d)
    # one line of the trainer's own, not Python's `file.py:line: UserWarning:` format
    said = capsys.readouterr().out.splitlines()
    assert [line for line in said if "step_00000003" in line] == [line for line in said if "skipping" in line]
    assert len(said) == 1 and said[0].startswith("warning: skipping checkpoint ") and "UserWarning" not in said[0]
    assert state["step"] == 2 and state["note"] == 2
    assert all(torch.equal(fresh.state_dict()[k], saved[2][k]) for k in saved[2])
    assert fresh_opt.state_dict()["state"], "optimizer state restored"

    # nothing loadable: the run stops (starting over would overwrite the run), naming every checkpoint it
    # tried, and the model and optimizer are untouched (never half-loaded)
    os.remove(tmp_path / "checkpoints" / "step_00000002" / "manifest.json")
    untouched, untouched_opt = _small()
    before = {k: v.clone() for k, v in untouched.state_dict().items()}
    with pytest.raises(SystemExit) as e:
        sharding.load_latest_checkpoint(str(tmp_path), untouched, untouched_opt, d)
    assert re.search(r"^warning: skipping checkpoint \S*step_00000002: no manifest.json \(incomplete\)$",
                     capsys.readouterr().out, re.MULTILINE)
    assert "step_00000003" in str(e.value.code) and "step_00000002" in str(e.value.code)
    assert all(torch.equal(untouched.state_dict()[k], before[k]) for k in before)
    assert not untouched_opt.state  # no AdamW state invented by the failed attempt

    # an empty out_dir, or one with only stray folders, is a fresh start
    os.makedirs(tmp_path / "fresh" / "checkpoints" / "step_notes")
    assert sharding.load_latest_checkpoint(str(tmp_path / "fresh"), untouched, untouched_opt, d) is None


# ----------------------------------------------------------------------------- the other processes


if __name__ == "__main__":
    mode, out_dir = sys.argv[1], sys.argv[2]
    if mode == "take":
        d = sharding.setup("cpu")
        try:
            lock = sharding.lock_out_dir(out_dir, d)
            print(f"rank {d.rank} locked", flush=True)
        except sharding.OutDirBusy as e:
            print(f"rank {d.rank} busy: {e}", flush=True)
            sharding.teardown()
            sys.exit(3)
        sharding.teardown()
    else:
        if mode == "hold":
            lock = sharding.lock_out_dir(out_dir, ONE)
        else:  # leftover: what a surviving worker holds
            lock = open(os.path.join(out_dir, sharding.WORKERS_LOCK), "a")
            fcntl.flock(lock, fcntl.LOCK_SH)
        print("locked", flush=True)
        time.sleep(600)  # until killed
