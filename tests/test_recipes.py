"""Recipes (files of settings) and the names a user types: every shipped recipe loads, validates and runs; a
file's errors name the file and line; another trainer's names and typos point at ours; --eval_only."""

import dataclasses
import json
import os
import sys
import tomllib

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from runs import cli  # noqa: E402
import config  # noqa: E402
import train  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = {"gsm8k": "gsm8k_tiny.jsonl", "tldr": "tldr_tiny.jsonl"}  # offline stand-ins for the hub datasets
RECIPES = cli.recipe_names(config.RECIPES)
SMALL = ["--num_generations=2", "--prompts_per_step=2", "--micro_batch_size=4", "--max_prompt_length=48",
         "--max_steps=2", "--print_completions_every=0", "--completions_table_every=0", "--eval_every=0",
         "--save_every=0"]


def _file(name):
    with open(os.path.join(config.RECIPES, name + ".toml"), "rb") as f:
        return tomllib.load(f)


def test_the_papers_and_full_recipes_are_shipped():
    papers = {"grpo", "dapo", "dr_grpo", "gspo", "cispo", "sapo", "gdpo", "vespo"}
    assert papers <= set(RECIPES)
    assert any(_file(r).get("model", "").startswith("Qwen/Qwen3") for r in RECIPES)  # a Qwen3 recipe
    assert "vault" in RECIPES  # the tool task


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_loads_validates_and_states_its_task_and_result(name):
    cfg = train.parse_config([f"--preset={name}"])
    train.validate(cfg, world_size=8 if "8gpu" in name else 1)
    for key, value in _file(name).items():  # the file's own reading, key by key
        assert getattr(cfg, key) == value, key
    text = open(os.path.join(config.RECIPES, name + ".toml")).read()
    assert "task" in _file(name)  # each recipe names the task it is meant for
    header = "".join(l for l in text.splitlines() if l.startswith("#")).lower()
    assert "measured" in header or "not yet run" in header  # ... and what it reaches there, or that it is unknown
    assert "MEASURE_" not in text


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_runs_two_steps_on_the_tiny_model(name, tmp_path):
    cfg = train.parse_config([f"--preset={name}"])
    args = [f"--preset={name}", f"--out_dir={tmp_path / 'out'}", *SMALL, "--model=tiny", "--model_init_kwargs={}",
            f"--max_completion_length={min(cfg.max_completion_length, 8)}"]
    if cfg.task in DATA:
        args.append(f"--dataset={os.path.join(ROOT, 'tests', 'data', DATA[cfg.task])}")
    if cfg.reward_model:
        args.append("--reward_model=tiny")
    train.main(args)
    lines = [json.loads(l) for l in open(tmp_path / "out" / "metrics.jsonl")]
    assert [m["step"] for m in lines] == [1, 2]
    saved = json.load(open(tmp_path / "out" / "config.json"))
    for key, value in _file(name).items():  # config.json records the recipe's settings where not overridden
        if f"--{key}" not in " ".join(a.split("=")[0] for a in args):
            assert saved[key] == value, key


def test_command_line_overrides_the_file_and_preset_comes_first(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text('lr = 0.01\nloss_type = "dapo"\nepsilon_high = 0.3\n')
    cfg = train.parse_config([f"--config={path}", "--lr=0.02", "--preset=grpo"])
    assert (cfg.lr, cfg.loss_type, cfg.epsilon_high) == (0.02, "dapo", 0.3)  # file over preset, line over file
    assert cfg.beta == _file("grpo")["beta"]


@pytest.mark.parametrize("text, line, message", [
    ('lr = 0.01\n\nnum_generation = 4\n', 3, "--num_generation: unknown key; did you mean --num_generations?"),
    ('lr = 0.01\nlearning_rate = 1e-6\n', 2, "--learning_rate: unknown key; use --lr"),
    ('# a comment\nlr = "fast"\n', 2, "--lr: expected float, got 'fast'"),
    ('num_generations = 2.5\n', 1, "--num_generations: expected int, got 2.5"),
    ('lr = -1\n', 1, "--lr: must be > 0, got -1"),
    ('loss_type = "ppo"\n', 1, "--loss_type: one of grpo"),
    ('beta = 0\nmask_truncated_completions = 1\n', 2, "--mask_truncated_completions: expected bool, got 1"),
    ('lr = 1e-3\n[model]\nname = "x"\n', 2, "--model: a recipe is flat"),
    ('preset = "grpo"\n', 1, "--preset: a recipe cannot name another recipe"),
])
def test_a_bad_line_in_a_recipe_is_named_with_file_and_line(tmp_path, text, line, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SystemExit) as e:
        train.parse_config([f"--config={path}"])
    assert f"{path}:{line}: {message}" in str(e.value.code)


def test_a_file_that_is_not_toml_or_not_there_is_named(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("lr = = 1\n")
    with pytest.raises(SystemExit, match=r"--config: .*bad.toml is not valid TOML: .*line 1"):
        train.parse_config([f"--config={path}"])
    with pytest.raises(SystemExit, match=r"--config: cannot read .*nope.toml"):
        train.parse_config([f"--config={tmp_path / 'nope.toml'}"])


def test_every_bad_line_of_a_recipe_is_named_at_once(tmp_path):
    path = tmp_path / "two.toml"
    path.write_text('# a recipe with two mistakes\nmax_steps = 3\nlearning_rate = 1e-6\nbeta = 0.0\nlr = -1\n'
                    'num_generations = "many"\n')
    with pytest.raises(SystemExit) as e:
        train.parse_config([f"--config={path}"])
    said = str(e.value.code).splitlines()
    assert [line.split(": --")[0] for line in said] == [f"config error: {path}:{n}" for n in (3, 5, 6)], said
    assert "use --lr" in said[0] and "must be > 0, got -1" in said[1] and "'many'" in said[2]
    path.write_text("max_steps = 3\nlr = -1\n")  # one bad line: the one line, as before
    with pytest.raises(SystemExit, match=rf"^config error: {path}:2: --lr: must be > 0, got -1(\.0)?$"):
        train.parse_config([f"--config={path}"])


def test_typed_values_and_strings_read_as_on_the_command_line(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text('lr = 1\nepsilon_high = "none"\nreward_weights = [1, 0.5]\n'
                    'model_init_kwargs = { dtype = "float32" }\nmax_steps = 7\n')
    cfg = train.parse_config([f"--config={path}"])
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float) and cfg.epsilon_high is None
    assert cfg.reward_weights == [1.0, 0.5] and cfg.model_init_kwargs == {"dtype": "float32"} and cfg.max_steps == 7


@pytest.mark.parametrize("arg, message", [
    ("--num_generation=4", "did you mean --num_generations?"),
    ("--learning_rate=1e-6", "use --lr"),
    ("--max_new_tokens=64", "use --max_completion_length"),
    ("--per_device_train_batch_size=8", "--prompts_per_step"),
    ("--report_to=wandb", "--wandb_mode=online"),
    ("--zzz=1", "unknown key (--help lists them all)"),
])
def test_names_a_user_types_point_at_ours(arg, message):
    with pytest.raises(SystemExit) as e:
        train.parse_config([arg])
    assert message in str(e.value.code) and str(e.value.code).startswith(f"config error: {arg.split('=')[0]}:")


def test_other_names_are_not_settings_here():
    assert not set(config.OTHER_NAMES) & set(config.Config.__dataclass_fields__)


def test_eval_only_evaluates_the_checkpoint_as_training_did(tmp_path):
    out = tmp_path / "out"
    common = [f"--out_dir={out}", "--num_generations=2", "--prompts_per_step=2", "--micro_batch_size=4",
              "--max_completion_length=4", "--max_steps=2", "--print_completions_every=0", "--eval_prompts=8"]
    train.main([*common, "--eval_every=2", "--save_every=2"])
    trained = [json.loads(l) for l in open(out / "metrics.jsonl")][-1]
    before = {os.path.join(dp, p): os.path.getmtime(os.path.join(dp, p))
              for dp, _, ps in os.walk(out) for p in ps
              if not p.startswith(".") and "tiny_model_init" not in dp}  # (lock files and the tiny model's start aside)
    train.main([*common, "--eval_only"])
    [line] = [json.loads(l) for l in open(out / "eval.jsonl")]
    assert line["step"] == 2 and os.path.basename(line["checkpoint"]) == "step_00000002"
    evals = {k: v for k, v in trained.items() if k.startswith("eval/")}
    assert evals and {k: line[k] for k in evals} == evals  # the same prompts, seeds and weights: the same numbers
    after = {p: os.path.getmtime(p) for p in before if os.path.exists(p)}
    assert after == before  # nothing trained, saved or exported: every file of the run untouched


def test_a_step_that_masks_most_completions_says_so_once(tmp_path, capsys):
    # 4 new tokens: the tiny untrained model almost never ends that soon, so nearly every completion is truncated
    train.main([f"--out_dir={tmp_path / 'out'}", *SMALL, "--max_steps=3", "--max_completion_length=4",
                "--mask_truncated_completions"])
    metrics = [json.loads(l) for l in open(tmp_path / "out" / "metrics.jsonl")]
    out = capsys.readouterr().out.splitlines()
    masked = [m["step"] for m in metrics if m["truncated_frac"] > 0.5]
    assert masked  # the premise: some step truncated most completions
    said = [out[i - 1].split("/")[0] for i, l in enumerate(out) if "mask_truncated_completions gives them no loss" in l]
    assert said == [f"step {masked[0]}"]  # once, under the first such step's line


def test_a_task_is_one_file_the_documented_example_trains(tmp_path):
    """docs/tasks.md's example task, dropped as one file into a fresh copy of the code, is listed by --help and
    trains, with no other file changed."""
    import re
    import shutil
    import subprocess
    text = open(os.path.join(ROOT, "docs", "tasks.md")).read()
    block = re.search(r"```python\n# tasks/(\w+)\.py\n(.*?)```", text, re.DOTALL)
    name, source = block.group(1), block.group(2)
    copy = tmp_path / "copy"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", "tests", "out*", "__pycache__", "results"))
    assert not (copy / "tasks" / f"{name}.py").exists()
    (copy / "tasks" / f"{name}.py").write_text(source)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    help_text = subprocess.run([sys.executable, "train.py", "--help"], cwd=copy, capture_output=True, text=True,
                               env=env).stdout
    task_help = help_text.split("--task ", 1)[1].split("\n    --", 1)[0]  # the --task entry of --help
    assert re.search(rf"\b{name}\b", task_help), task_help
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "train.py", f"--task={name}", f"--out_dir={out}", *SMALL,
                        "--max_completion_length=2"], cwd=copy, capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [json.loads(l) for l in open(out / "metrics.jsonl")]
    assert [m["step"] for m in lines] == [1, 2] and f"reward/{name}_reward" in lines[0]


@pytest.mark.parametrize("name", RECIPES)
def test_a_recipe_is_its_settings_given_as_flags(name):
    """--config=FILE gives the run the same settings as the file's lines typed as flags (config.json records
    every setting: only `config` itself, the file's name, differs)."""
    from_file = dataclasses.asdict(train.parse_config([f"--config={os.path.join(config.RECIPES, name + '.toml')}"]))
    flags = [f"--{k}={json.dumps(v) if isinstance(v, dict) else ','.join(map(str, v)) if isinstance(v, list) else v}"
             for k, v in _file(name).items()]
    from_flags = dataclasses.asdict(train.parse_config(flags))
    assert from_file.pop("config").endswith(name + ".toml") and not from_flags.pop("config")
    from_flags.pop("preset"), from_file.pop("preset")  # --task=vault as a flag starts from its recipe by name
    assert from_file == from_flags
