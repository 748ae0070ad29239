"""One run per out_dir (a lock the OS drops when its holder dies) and checkpoints that refuse to go wrong quietly.

Run as a script, this file is the other process the tests need:
    python tests/test_out_dir.py hold DIR          take the lock, print "locked", wait to be killed
    python tests/test_out_dir.py leftover DIR      hold only the workers' shared lock, as a worker whose
                                                   launcher and rank 0 died
    torchrun ... tests/test_out_dir.py take DIR    every rank tries the lock and prints what happened
"""

import fcntl
import os
import signal
import subprocess
import sys
import time

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
