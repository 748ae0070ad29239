"""Starting a run: the settings are checked before torch is imported (seconds), Ctrl-C while importing is one
line, a config error under torchrun is said once, and the CPU threads a run uses are set and shown."""

import dataclasses
import os
import subprocess
import sys
import textwrap
import typing

import pytest
import torch

from runs import cli
import config
import grpo
from runs import log as run_log
import tasks
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# train.py run as `python train.py ARGS`, with an import hook that does `ACTION` when torch is first imported
HOOKED = textwrap.dedent("""
    import runpy, sys
    class Hook:
        def find_spec(self, name, path=None, target=None):
            if name == "torch":
                ACTION
            return None
    sys.meta_path.insert(0, Hook())
    sys.argv = ["train.py", *sys.argv[1:]]
    runpy.run_path("train.py", run_name="__main__")
""")


def run_hooked(action, *args):
    return subprocess.run([sys.executable, "-c", HOOKED.replace("ACTION", action), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_a_config_error_comes_before_torch_is_imported():
    p = run_hooked('raise ImportError("torch imported before the settings were checked")', "--lr=-1")
    assert p.returncode == 1 and p.stderr == "config error: --lr: must be > 0, got -1.0\n", p.stderr
    for args, key in ((["--loss_type=ppo"], "loss_type"), (["--task=math"], "task"), (["--threads=-2"], "threads"),
                      (["--importance_sampling=token"], "importance_sampling"), (["--no_such=1"], "no_such")):
        p = run_hooked('raise ImportError("torch imported before the settings were checked")', *args)
        assert p.returncode == 1 and p.stderr.startswith(f"config error: --{key}: "), p.stderr
    # with good settings the same hook is met: the check above is not an accident of the hook
    p = run_hooked('raise ImportError("torch imported before the settings were checked")', "--lr=0.1")
    assert "torch imported before the settings were checked" in p.stderr


def test_settings_checked_early_are_those_checked_later():
    """The choices config.py declares (checked before the imports) are what grpo.py and tasks/ accept."""
    assert config.LOSS_TYPES == grpo.LOSS_TYPES
    assert config.IMPORTANCE_SAMPLING == grpo.IMPORTANCE_SAMPLING
    assert config.IMPORTANCE_SAMPLING_LEVELS == grpo.IMPORTANCE_SAMPLING_LEVELS


def test_every_objective_setting_defines_the_run():
    """Each Config field of the objective section (between `# objective` and `# sampling`), and each setting the
    loss reads (grpo.Objective), is declared run=True, so that resuming with another objective stops."""
    source = open(os.path.join(ROOT, "config.py")).read()
    section = source.split("    # objective\n", 1)[1].split("    # sampling\n", 1)[0]
    names = [line.split(":", 1)[0].strip() for line in section.splitlines()
             if line.startswith("    ") and not line.startswith("     ") and ":" in line]
    assert len(names) >= 15 and "loss_type" in names and "multi_objective_aggregation" in names
    fields = {f.name for f in dataclasses.fields(train.Config)}
    assert set(names) <= fields
    assert [n for n in names if n not in train.RUN_KEYS] == []
    assert [f.name for f in dataclasses.fields(grpo.Objective) if f.name not in train.RUN_KEYS] == []
    assert config.TASKS == tasks.TASKS


def test_a_setting_must_say_whether_it_defines_the_run():
    """A field declared without cli.setting(..., run=...) stops the import of its module, naming the field; one
    declared with it is in RUN_KEYS exactly when run=True."""
    @dataclasses.dataclass
    class Settings:
        kept: int = cli.setting(1, run=True)
        free: int = cli.setting(2, run=False)
        forgotten: float = 0.5
    with pytest.raises(TypeError, match="forgotten"):
        cli.run_keys(Settings)
    with pytest.raises(TypeError, match="run"):
        cli.setting(3)
    assert cli.run_keys(train.Config) == train.RUN_KEYS
    assert "seed" in train.RUN_KEYS and "max_steps" not in train.RUN_KEYS and "lr" not in train.RUN_KEYS


def test_a_setting_accepts_what_its_declaration_says():
    @dataclasses.dataclass
    class Settings:
        mode: str = cli.setting("a", run=False, choices=("a", "b"))
        rate: float = cli.setting(0.5, run=False, above=0, at_most=1)
        count: int = cli.setting(1, run=False, at_least=1)
        cap: typing.Optional[float] = cli.setting(None, run=False, above=1)
    cli.check(Settings())
    for key, value, said in (("mode", "c", "one of a, b, got 'c'"), ("rate", 0.0, "must be in (0, 1], got 0.0"),
                             ("rate", 1.5, "must be in (0, 1], got 1.5"), ("count", 0, "must be >= 1, got 0"),
                             ("cap", 1.0, "must be > 1, got 1.0")):
        with pytest.raises(cli.ConfigError) as e:
            cli.check(dataclasses.replace(Settings(), **{key: value}))
        assert e.value.code == f"config error: --{key}: {said}"
    cli.check(dataclasses.replace(Settings(), rate=1.0, cap=1.01))


def test_ctrl_c_while_importing_is_one_line():
    p = run_hooked("raise KeyboardInterrupt", "--max_steps=1")
    assert p.returncode == 130 and p.stderr.strip() == "interrupted while importing torch and transformers", p.stderr


def test_a_config_error_under_torchrun_is_said_once(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "train.py", "--lr=-1", f"--out_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                       env={**env, "OMP_NUM_THREADS": "1"}, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    said = [line for line in out.splitlines() if line.startswith("config error:")]
    assert said == ["config error: --lr: must be > 0, got -1.0"], out
    # torchrun's summary names rank 0's error instead of a link to its documentation
    assert "traceback : config error: --lr: must be > 0, got -1.0" in out, out
    assert "rank      : 1" not in out or "SIGTERM" in out, out  # rank 1 exited quietly (unless torchrun was faster)


def test_an_out_dir_refusal_under_torchrun_is_said_once(tmp_path):
    """out_dir holds a run with other settings: every rank is told, rank 0 says it, the others leave quietly."""
    train.main([f"--out_dir={tmp_path}", "--max_steps=1", "--num_generations=2", "--prompts_per_step=2"])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "train.py", "--max_steps=1", "--num_generations=2", "--prompts_per_step=2", "--seed=5",
                        f"--out_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                       env={**env, "OMP_NUM_THREADS": "1"}, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    said = [line for line in out.splitlines() if line.startswith(f"out_dir {tmp_path} holds a run")]
    assert said == [f"out_dir {tmp_path} holds a run with other settings:"], out
    assert f"traceback : out_dir {tmp_path} holds a run" in out, out  # torchrun's summary quotes rank 0's
    assert "rank      : 1" not in out or "SIGTERM" in out, out  # rank 1 left quietly (unless torchrun was faster)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_setting_is_used_and_shown(tmp_path, threads, capsys, monkeypatch):
    monkeypatch.setattr(run_log, "busy_cpu", lambda threads: None)
    train.main([f"--out_dir={tmp_path}", "--threads=1", "--max_steps=1", "--num_generations=2",
                "--prompts_per_step=2"])
    assert torch.get_num_threads() == 1
    banner = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("device "))
    assert "1 process(es), 1 CPU thread(s) each" in banner


def test_several_processes_share_the_cores_out(monkeypatch, threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")
    train.set_threads(0)  # more processes than cores: one thread each
    assert torch.get_num_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # set (as torchrun does): torch's default, which follows it
    torch.set_num_threads(2)
    train.set_threads(0)
    assert torch.get_num_threads() == 2


def test_a_busy_cpu_is_named(monkeypatch):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    monkeypatch.setattr(os, "getloadavg", lambda: (cores + 1.0, 0.0, 0.0))
    assert run_log.busy_cpu(2) == f"the CPU is busy (load {cores + 1.0:.1f} on {cores} cores)"
    assert run_log.busy_cpu(1) is None  # one thread waits for no other
    monkeypatch.setattr(os, "getloadavg", lambda: (1.0, 0.0, 0.0))  # this run alone
    assert run_log.busy_cpu(cores) is None


def test_memory_settings_refuse_what_cannot_work():
    """ref_bf16 needs a reference model; cpu_offload needs FSDP2's shards (torchrun): each refused in one line
    naming its key, before anything loads."""
    for argv, key in ((["--ref_bf16", "--beta=0"], "ref_bf16"), (["--ref_bf16", "--lora_rank=4"], "ref_bf16"),
                      (["--cpu_offload", "--device=cpu"], "cpu_offload")):
        with pytest.raises(cli.ConfigError) as e:
            train.parse_config(argv)
        assert e.value.code.startswith(f"config error: --{key}: needs "), e.value.code
    train.parse_config(["--ref_bf16", "--cpu_offload"])  # a reference, and (as far as the settings tell) torchrun
    config.validate(dataclasses.replace(config.Config(), cpu_offload=True, device="cpu"), world_size=2)
