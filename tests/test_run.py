"""A run as a user drives it: --help, --key value, config.json and resume, own reward functions, the step line,
non-finite steps, Ctrl-C, wandb settings."""

import json
import math
import os
import re
import subprocess
import sys
import typing

import pytest
import torch

from runs import cli
import grpo
import model_loading
import rewards
from runs import log as run_log
import sharding
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = ["--max_steps=2", "--num_generations=2", "--prompts_per_step=2", "--print_completions_every=0"]


def rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_help_lists_every_field_with_type_default_and_comment():
    p = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    hints = typing.get_type_hints(train.Config)
    for name in hints:
        assert f"--{name} (" in p.stdout, name
    # a comment continued on a second line is kept, under its own field
    block = p.stdout.split("--reward_funcs (")[1].split("\n    --")[0]
    assert "instead of the task's" in block and "file.py:name" in block
    assert "--max_steps (int, default 300)" in p.stdout and "--epsilon_high (float or none, default none)" in p.stdout


def test_space_separated_values_and_bare_bool_flags():
    cfg = train.parse_config(["--lr", "1e-6", "--max_steps", "7", "--mask_truncated_completions",
                              "--wandb_run_name=x", "--reward_weights", "1,0.5"])
    assert cfg.lr == 1e-6 and cfg.max_steps == 7 and cfg.mask_truncated_completions is True
    assert cfg.wandb_run_name == "x" and cfg.reward_weights == [1.0, 0.5]
    for argv, key in ((["--max_steps"], "max_steps"), (["--no_such", "3"], "no_such"), (["max_steps", "3"], "max_steps"),
                      (["--lr", "--max_steps=3"], "lr")):
        with pytest.raises(SystemExit, match=f"--{key}"):
            train.parse_config(argv)
    # a preset first, whatever its place: the other settings win over it
    cfg = train.parse_config(["--lr", "3e-6", "--preset", "gsm8k-qwen2.5-0.5b"])
    assert cfg.lr == 3e-6 and cfg.task == "gsm8k"


def test_cast_agrees_with_the_field_types():
    assert cli.cast("k", "none", typing.Optional[float]) is None
    assert cli.cast("k", "0.28", typing.Optional[float]) == 0.28
    with pytest.raises(SystemExit, match="--k: expected float"):
        cli.cast("k", "inf", float)


def test_space_separated_run_from_the_command_line(tmp_path):
    out = str(tmp_path / "o")
    p = subprocess.run([sys.executable, "train.py", "--max_steps", "2", "--out_dir", out, "--print_completions_every",
                        "0"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert [r["step"] for r in rows(out)] == [1, 2]
    lines = p.stdout.splitlines()
    assert any(line.startswith("step 1/2 |") and "eta" in line for line in lines)
    # paths aside, and a long step's time split (runs/log.py lets it pass the width: a loaded machine's step)
    assert all(len(line) <= 120 for line in lines if out not in line and "(generation" not in line), \
        max(lines, key=len)
    assert any(line.startswith("device cpu") for line in lines)  # the banner
    assert any(line.startswith("saved ") for line in lines) and any(line.startswith("exported ") for line in lines)


def test_config_json_and_resume_only_with_the_same_settings(tmp_path, capsys):
    out = str(tmp_path / "o")
    train.main([f"--out_dir={out}", *QUICK, "--save_every=1"])
    with open(os.path.join(out, "config.json")) as f:
        saved = json.load(f)
    assert set(saved) == set(train.Config.__dataclass_fields__) and saved["max_steps"] == 2
    before = rows(out)

    with pytest.raises(SystemExit) as e:
        train.main([f"--out_dir={out}", *QUICK, "--task=countdown", "--seed=3"])
    message = str(e.value.code)
    assert "--task: 'next_letter' there, 'countdown' now" in message and "--seed: 0 there, 3 now" in message
    assert "--resume=force" in message
    assert rows(out) == before  # nothing written

    with pytest.raises(SystemExit, match="--resume=never"):
        train.main([f"--out_dir={out}", *QUICK, "--resume=never"])

    # the same command, with more steps, goes on from the checkpoint
    train.main([f"--out_dir={out}", *QUICK[1:], "--max_steps=3", "--save_every=1"])
    assert [r["step"] for r in rows(out)] == [1, 2, 3] and rows(out)[:2] == before
    assert "resuming from" in capsys.readouterr().out

    # on purpose: a changed setting with --resume=force continues, and config.json says what runs now
    train.main([f"--out_dir={out}", *QUICK[1:], "--max_steps=4", "--temperature=0.7", "--resume=force"])
    assert [r["step"] for r in rows(out)] == [1, 2, 3, 4]
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["temperature"] == 0.7


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_a_gpu_is_a_config_error():
    with pytest.raises(SystemExit, match="--device: cuda"):
        train.parse_config(["--device=cuda"])


REWARDS_FILE = '''
def brevity(completions, **kwargs):
    return [-len(c) / 10 for c in completions]

def knows(prompts, completions, answer, prompt_text, **kwargs):
    assert all(p.endswith(">") for p in prompt_text) and len(answer) == len(completions)
    return [1.0 if c[:1] == a else 0.0 for c, a in zip(completions, answer)]

not_callable = 3
'''


def test_reward_funcs_from_a_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS_FILE)
    out = str(tmp_path / "o")
    p = subprocess.run([sys.executable, "train.py", f"--reward_funcs={path}:brevity,{path}:knows",
                        "--reward_weights=0.5,1", f"--out_dir={out}", *QUICK], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    for r in rows(out):
        assert set(r) >= {"reward/brevity", "reward/knows"} and "reward/next_letter_reward" not in r
        assert r["reward/brevity"] <= 0
    # bad specs, in this process (the command line's one-line form of such errors: the test below)
    for spec, named in ((f"{tmp_path}/nope.py:f", "nope.py"), (f"{path}:missing", "missing"),
                        (f"{path}:not_callable", "not_callable"), ("no_such_module_xyz:f", "no_such_module_xyz"),
                        (f"{path}", str(path))):
        with pytest.raises(SystemExit) as e:
            train.main([f"--reward_funcs={spec}", f"--out_dir={tmp_path / 'bad'}", *QUICK])
        said = str(e.value)
        assert "--reward_funcs" in said and named in said and len(said.splitlines()) == 1, said


def test_non_finite_loss_skips_the_step_and_a_run_of_them_stops(tmp_path, monkeypatch):
    """From step 2 on the loss is NaN: steps 2, 3 and 4 are skipped with the weights untouched and logged, the
    third bad optimizer step in a row stops the run, and no checkpoint after step 3 is written."""
    real_loss, calls = grpo.grpo_loss, {"step": 0}
    real_step = train.train_step

    def counting_step(run, step):
        calls["step"] = step
        return real_step(run, step)

    def poisoned(*a, **k):
        loss, m = real_loss(*a, **k)
        return (loss * float("nan") if calls["step"] >= 2 else loss), m
    weights = {}
    real_update = train.update

    def spying_update(run, batch, adv, step):
        weights[step] = [p.detach().clone() for p in run.policy.parameters()]
        out = real_update(run, batch, adv, step)
        weights[step + 0.5] = [p.detach().clone() for p in run.policy.parameters()]
        return out
    monkeypatch.setattr(grpo, "grpo_loss", poisoned)
    monkeypatch.setattr(train, "train_step", counting_step)
    monkeypatch.setattr(train, "update", spying_update)
    out = str(tmp_path / "o")
    with pytest.raises(SystemExit, match="step 4: the last 3 optimizer steps had a non-finite"):
        train.main([f"--out_dir={out}", *QUICK[1:], "--max_steps=10", "--save_every=1", "--max_bad_steps=3",
                    "--weight_decay=0.1"])  # an applied step moves the weights, whatever its gradient
    got = rows(out)
    assert [r["skipped_steps"] for r in got] == [0, 1, 1, 1]
    assert math.isfinite(got[0]["loss"]) and got[1]["loss"] is None  # strict JSON: NaN is written as null
    assert any(not torch.equal(a, b) for a, b in zip(weights[1], weights[1.5]))  # a good step moves the weights
    for step in (2, 3, 4):
        assert all(torch.equal(a, b) for a, b in zip(weights[step], weights[step + 0.5])), step
    assert [os.path.basename(p) for p in sharding.checkpoint_dirs(out)] == ["step_00000003", "step_00000002"]


def test_resume_takes_the_learning_rate_and_adamw_settings_given_now(tmp_path):
    """The schedule is a function of the step and of the settings the run is started with, not of the saved ones."""
    out = str(tmp_path / "o")
    args = [f"--out_dir={out}", *QUICK[1:], "--lr_schedule=linear", "--save_every=1"]
    train.main([*args, "--max_steps=2"])
    train.main([*args, "--max_steps=4", "--lr=1e-4", "--weight_decay=0.1"])
    lrs = [r["lr"] for r in rows(out)]
    assert lrs[:2] == pytest.approx([1e-3 * 1.0, 1e-3 * 0.5])  # linear to 0 over 2 steps
    assert lrs[2:] == pytest.approx([1e-4 * 0.5, 1e-4 * 0.25])  # linear to 0 over 4 steps, from 1e-4


def test_a_reward_function_needing_a_missing_column_stops_before_training(tmp_path):
    path = tmp_path / "needs.py"
    path.write_text("def needs_nums(completions, nums, **kw):\n    return [0.0] * len(completions)\n")
    p = subprocess.run([sys.executable, "train.py", f"--reward_funcs={path}:needs_nums", f"--out_dir={tmp_path / 'o'}",
                        *QUICK], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode != 0 and "'needs_nums' needs a column 'nums'" in p.stderr, p.stderr
    assert "step 1" not in p.stdout and not os.path.exists(tmp_path / "o" / "metrics.jsonl")


def test_keyboard_interrupt_names_the_last_checkpoint(tmp_path, monkeypatch, capsys):
    real_step = train.train_step

    def interrupted(run, step):
        if step == 3:
            raise KeyboardInterrupt
        return real_step(run, step)
    monkeypatch.setattr(train, "train_step", interrupted)
    out = str(tmp_path / "o")
    with pytest.raises(SystemExit) as e:
        train.main([f"--out_dir={out}", *QUICK[1:], "--max_steps=5", "--save_every=2"])
    assert e.value.code == 130
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "interrupted during step 3" in last and "step_00000002" in last and "same command" in last


def test_metrics_rewrite_is_atomic(tmp_path, monkeypatch):
    """A kill while metrics.jsonl is rewritten on resume (here: the rename never happens) leaves it whole."""
    out = tmp_path / "o"
    out.mkdir()
    original = "".join(json.dumps({"step": s, "reward": 0.5}) + "\n" for s in range(1, 1001))
    (out / "metrics.jsonl").write_text(original)

    def killed(*a):
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "replace", killed)
    cfg = train.Config(out_dir=str(out))
    with pytest.raises(KeyboardInterrupt):
        run_log.Logger(cfg, True, resume_step=10)
    assert (out / "metrics.jsonl").read_text() == original
    monkeypatch.undo()
    run_log.Logger(cfg, True, resume_step=10).close()
    assert [r["step"] for r in rows(out)] == list(range(1, 11))


def test_wandb_settings_from_the_environment_and_no_prompt_online(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_NAME", "named")
    cfg = train.Config()
    assert (cfg.wandb_project, cfg.wandb_mode, cfg.wandb_run_name) == ("from-env", "offline", "named")
    assert train.parse_config(["--wandb_mode=disabled"]).wandb_mode == "disabled"  # the command line wins
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no credentials anywhere
    p = subprocess.run([sys.executable, "train.py", "--wandb_mode=online", f"--out_dir={tmp_path / 'o'}", *QUICK],
                       cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120,
                       env={**os.environ, "HOME": str(tmp_path)})
    assert p.returncode != 0 and "wandb login" in p.stderr and "offline" in p.stderr
    assert "Traceback" not in p.stderr


EXPLODING = '''
def explode(completions, **kwargs):
    return [1e39 if i == 3 else 0.5 for i in range(len(completions))]
'''


def test_an_exploding_reward_stops_the_run_naming_function_and_completion(tmp_path):
    """1e39 is a finite Python float but inf in float32: the run stops at step 1 and nothing is saved or exported."""
    path = tmp_path / "boom.py"
    path.write_text(EXPLODING)
    out = tmp_path / "o"
    p = subprocess.run([sys.executable, "train.py", f"--reward_funcs={path}:explode", f"--out_dir={out}", *QUICK,
                        "--save_every=1"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "step 1:" in p.stderr and "'explode'" in p.stderr and "completion 3" in p.stderr, p.stderr
    assert not os.path.exists(out / "checkpoints") or not os.listdir(out / "checkpoints")
    assert not os.path.exists(out / "model")


def test_a_second_run_on_a_busy_out_dir_stops_naming_the_holder(tmp_path):
    out = str(tmp_path / "o")
    one = sharding.Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    with sharding.lock_out_dir(out, one):
        p = subprocess.run([sys.executable, "train.py", f"--out_dir={out}", *QUICK], cwd=ROOT, capture_output=True,
                           text=True)
    assert p.returncode != 0 and f"pid {os.getpid()}" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not os.path.exists(os.path.join(out, "metrics.jsonl"))
    # released: the same command runs now
    p = subprocess.run([sys.executable, "train.py", f"--out_dir={out}", *QUICK], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("args, named, debug", [
    (["--model=./no/such/mdoel"], "no/such/mdoel", True),
    (["--task=gsm8k", "--dataset=BAD"], "row 0", False),
    (["--lora_rank=2", "--lora_target_modules=q_proj,v_prj"], "'v_prj'", True),
    (["--out_dir=FILE"], "--out_dir", False),
    (['--model_init_kwargs={"bogus_kw": 1}'], "bogus_kw", False),
])
def test_bad_input_is_one_line_and_a_debug_setting_adds_the_traceback(tmp_path, args, named, debug):
    """One line on stderr, no traceback; GRPO_DEBUG=1 adds it (checked on two of the cases: one handler serves all)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": ["two", "strings"], "answer": "#### 1"}) + "\n")
    (tmp_path / "a_file").write_text("")
    args = [a.replace("BAD", str(bad)).replace("FILE", str(tmp_path / "a_file")) for a in args]
    cmd = [sys.executable, "train.py", f"--out_dir={tmp_path / 'o'}", *QUICK, *args]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert p.returncode != 0 and named in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    if debug:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "GRPO_DEBUG": "1"})
        assert "Traceback" in p.stderr and named in p.stderr


def test_resume_refuses_another_hold_out_of_the_dataset(tmp_path):
    """With --dataset and evaluation on, eval_prompts decides which rows train: changing it on resume stops."""
    one = sharding.Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    first = train.Config(out_dir=str(tmp_path), task="gsm8k", dataset="d.jsonl", eval_every=5, eval_prompts=2)
    run_log.write_config(first)
    same = train.Config(out_dir=str(tmp_path), task="gsm8k", dataset="d.jsonl", eval_every=10, eval_prompts=2)
    assert run_log.start_problem(same, one, train.RUN_KEYS) is None  # how often it evaluates may change
    for other in (train.Config(out_dir=str(tmp_path), task="gsm8k", dataset="d.jsonl", eval_every=5, eval_prompts=3),
                  train.Config(out_dir=str(tmp_path), task="gsm8k", dataset="d.jsonl", eval_every=0, eval_prompts=2)):
        problem = run_log.start_problem(other, one, train.RUN_KEYS)
        assert "--eval_prompts: '2 rows held out' there" in problem


@pytest.mark.parametrize("returned", [1.0, {0: 1.0, 1: 0.0}, "10"])
def test_a_reward_function_must_return_a_list(returned):
    def odd(completions, **kwargs):
        return returned
    with pytest.raises(rewards.RewardFunctionError, match="'odd' returned a .*expected a list of 2 scores"):
        rewards.score_completions([odd], [1.0], ["p", "p"], ["a", "b"], {})


def test_ctrl_c_inside_a_checkpoint_write_ends_like_any_ctrl_c(tmp_path, monkeypatch, capsys):
    """torch.distributed.checkpoint turns a KeyboardInterrupt in its writer into a CheckpointException."""
    import torch.distributed.checkpoint.filesystem as fs
    real_write = fs._write_item
    out = str(tmp_path / "o")

    def write_item(*a, **k):
        if os.path.exists(os.path.join(out, "checkpoints", "step_00000001")):  # the second save
            raise KeyboardInterrupt
        return real_write(*a, **k)
    monkeypatch.setattr(fs, "_write_item", write_item)
    with pytest.raises(SystemExit) as e:
        train.main([f"--out_dir={out}", *QUICK[1:], "--max_steps=5", "--save_every=1"])
    assert e.value.code == 130
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "interrupted during step 2" in last and "the last checkpoint is" in last and "step_00000001" in last


SLOW_REWARDS = """
import time

def slow(completions, **kwargs):
    time.sleep(0.3)
    return [0.0 for _ in completions]

def quick(completions, **kwargs):
    return [1.0 for _ in completions]
"""


def test_a_slow_reward_function_shows_in_reward_time_and_the_eta(tmp_path, capsys):
    path = tmp_path / "my_rewards.py"
    path.write_text(SLOW_REWARDS)
    out = str(tmp_path / "o")
    train.main([f"--out_dir={out}", *QUICK[1:], "--max_steps=3", f"--reward_funcs={path}:slow,{path}:quick"])
    logged = rows(out)
    for r in logged:
        assert r["step_time"] >= r["reward_time"] >= r["reward_time/slow"] >= 0.3 > r["reward_time/quick"], r
    capsys_out = capsys.readouterr().out.splitlines()
    lines = [line for line in capsys_out if line.startswith("step ")]
    # what a loaded machine cannot change: the printed scoring time is at least the sleep, the logged one to 0.01
    # (alone, "(rewards 0.31s)"; in a long step's split, "rewards 0.31s" beside the generation and the update)
    # (a step that a loaded machine made longer than 5 times the sleep shows it only in a long step's split)
    shown = [(re.search(r"\brewards (\d+\.\d+)s", line), r) for line, r in zip(lines, logged)]
    assert all(m is not None for m, r in shown if r["reward_time"] >= 0.2 * r["step_time"]), lines
    printed = [(float(m.group(1)), r) for m, r in shown if m is not None]
    assert printed and all(p >= 0.3 and abs(p - r["reward_time"]) <= 0.006 for p, r in printed), (printed, lines)
    # the ETA counts the scoring: after step 1, 2 steps left, each at least as long as step 1's scoring
    minutes, seconds = re.search(r"eta (\d+):(\d\d)$", lines[0]).groups()
    assert 60 * int(minutes) + int(seconds) >= max(1, round(2 * logged[0]["reward_time"])), lines[0]
    # every group's rewards are equal (1.0): said once, under the first step line
    notes = [line for line in capsys_out if line.startswith("  note:")]
    flat = [n for n in notes if "groups have equal rewards" in n]
    assert len(flat) == 1 and capsys_out.index(flat[0]) - 1 - notes.index(flat[0]) == capsys_out.index(lines[0])
    # and the 4-token completions, all cut at the limit, once too
    assert len(notes) == 2 and "were cut at max_completion_length" in notes[0]
    # one function: only the total
    train.main([f"--out_dir={tmp_path / 'one'}", *QUICK, f"--reward_funcs={path}:quick"])
    assert [k for k in rows(str(tmp_path / "one"))[0] if k.startswith("reward_time")] == ["reward_time"]


def test_the_banner_warns_of_the_cpu_only_for_a_model_too_large_for_it(tmp_path, capsys, monkeypatch):
    """The vault recipe is the CPU's tool task: no warning on a small checkpoint of one's own. A model past the
    size the banner allows on a CPU (lowered here, so that the tiny one is past it) gets one, recipe or not."""
    from tasks import vault
    own = model_loading.write_tiny_model(str(tmp_path / "own"), **vault.TINY_MODEL)
    train.main([f"--out_dir={tmp_path / 'vault'}", "--task=vault", f"--model={own}", "--max_steps=1",
                "--print_completions_every=0"])
    assert "very slow" not in capsys.readouterr().out
    monkeypatch.setattr(run_log, "CPU_PARAMETERS", 1000)
    train.main([f"--out_dir={tmp_path / 'big'}", *QUICK[1:], "--max_steps=1"])
    warned = [line for line in capsys.readouterr().out.splitlines() if "very slow" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: tiny has ") and "parameters" in warned[0], warned
