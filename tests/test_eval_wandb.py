"""Reward-model scoring, evaluation on held-out prompts, and what reaches wandb (offline)."""

import dataclasses
import glob
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import model_loading  # noqa: E402
import rewards  # noqa: E402
from runs import log as run_log  # noqa: E402
import sampling  # noqa: E402
import tasks  # noqa: E402
import sharding  # noqa: E402
import train  # noqa: E402
from conftest import finished  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K = os.path.join(ROOT, "tests", "data", "gsm8k_tiny.jsonl")
F32 = {"dtype": "float32", "attn_implementation": "sdpa"}

PROMPTS = ["Summarise: the cat sat on the mat all day.", "Hi", "A much longer post about bread that never rises, "
           "with details about flour, water, yeast and an oven that runs cold.", "Why?"]
COMPLETIONS = ["Cat sits.", "Hello there, how are you doing today?", "Bread fails.", "Because."]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    path = model_loading.write_tiny_reward_model(str(tmp_path_factory.mktemp("rm") / "rm"))
    return model_loading.load_reward_model(path, F32, "cpu", seed=3)


def test_reward_model_is_frozen_and_templated(reward_model):
    model, tok = reward_model
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert tok.chat_template is not None


def test_reward_model_scores_do_not_depend_on_padding(reward_model):
    model, tok = reward_model
    left = rewards.reward_model_scores(model, tok, PROMPTS, COMPLETIONS, padding_side="left")
    right = rewards.reward_model_scores(model, tok, PROMPTS, COMPLETIONS, padding_side="right")
    alone = [rewards.reward_model_scores(model, tok, [p], [c])[0] for p, c in zip(PROMPTS, COMPLETIONS)]
    assert torch.allclose(torch.tensor(left), torch.tensor(alone), atol=1e-5)
    assert torch.allclose(torch.tensor(right), torch.tensor(alone), atol=1e-5)
    assert len(set(round(s, 4) for s in alone)) == len(alone)  # a real score per pair, not a constant


def test_reward_model_score_is_the_head_at_the_last_real_token(reward_model):
    """Slow reference: one unpadded forward through the full classification model, its score at the last token."""
    model, tok = reward_model
    for p, c in zip(PROMPTS, COMPLETIONS):
        text = tok.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                                       tokenize=False)
        ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
        hidden = model.base_model(input_ids=ids).last_hidden_state
        expected = model.score(hidden[0, -1]).item()
        assert rewards.reward_model_scores(model, tok, [p], [c])[0] == pytest.approx(expected, abs=1e-5)


def test_reward_model_reward_uses_untemplated_prompt(reward_model):
    model, tok = reward_model
    fn = rewards.make_reward_model_reward(model, tok)
    templated = ["<|im_start|>user\n" + p for p in PROMPTS]
    assert fn(templated, COMPLETIONS, prompt_text=PROMPTS) == pytest.approx(
        rewards.reward_model_scores(model, tok, PROMPTS, COMPLETIONS), abs=1e-6)


def _greedy_reference(model, tok, prompt, steps, eos_ids):
    """Greedy decoding by the obvious loop: the full sequence forwarded each step, argmax, no cache."""
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    out = []
    for _ in range(steps):
        with torch.no_grad():
            nxt = model(input_ids=ids).logits[0, -1].argmax().item()
        out.append(nxt)
        if nxt in eos_ids:
            break
        ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    return tok.decode(out, skip_special_tokens=True)


def test_evaluation_reports_greedy_accuracy_and_sampled_reward(tmp_path):
    path = model_loading.write_tiny_model(str(tmp_path / "tiny"))
    tok = model_loading.load_tokenizer(path)
    model = model_loading.load_model(path, F32, "cpu", seed=0)
    eos = model_loading.eos_token_ids(model, tok)
    cfg = train.Config(num_generations=4, prompts_per_step=2, max_completion_length=5)
    prompts = ["a>", "bb>", "hello>", "c>", "xyz>"]
    greedy = [_greedy_reference(model, tok, p, 5, eos) for p in prompts]
    # the "right answer" is the model's own greedy completion for three prompts, something else for two
    expected = greedy[:3] + ["\x00never", "\x00never"]

    def matches(prompts, completions, expected, **_):
        return [1.0 if c == e else 0.0 for c, e in zip(completions, expected)]

    def length(prompts, completions, **_):
        return [float(len(c)) for c in completions]

    task = tasks.Task(None, [matches, length], accuracy_reward="matches", name="probe",
                      eval_rows=[{"prompt": p, "expected": e} for p, e in zip(prompts, expected)])
    policy = sharding.Root(model).train()  # what train.py passes: the model behind its (here unsharded) root
    m = sampling.evaluate(policy, tok, task, [1.0, 0.0], cfg, sharding.setup("cpu"), eos)
    assert model.training  # put back as it was
    assert m["eval/accuracy_greedy"] == pytest.approx(3 / 5)
    assert m["eval/reward_greedy"] == pytest.approx(3 / 5)  # weights: matches counts, length does not
    # sampled: mean over G samples of every prompt, per component as well
    assert 0 <= m["eval/accuracy"] <= 3 / 5 and m["eval/reward"] == pytest.approx(m["eval/reward/matches"])
    assert m["eval/reward/length"] > 0
    assert set(m) == {"eval/accuracy_greedy", "eval/reward_greedy", "eval/accuracy", "eval/reward",
                      "eval/reward/matches", "eval/reward/length"}


def test_wandb_offline_logs_namespaced_metrics_eval_and_completions_table(tmp_path, monkeypatch, capfd):
    wandb = pytest.importorskip("wandb")
    logged = []
    real_log = wandb.Run.log
    monkeypatch.setattr(wandb.Run, "log", lambda self, data, *a, **k: (logged.append((k.get("step"), dict(data))),
                                                                       real_log(self, data, *a, **k))[1])
    monkeypatch.delenv("WANDB_MODE", raising=False)
    out = tmp_path / "out"
    train.main([f"--out_dir={out}", "--task=gsm8k", f"--dataset={GSM8K}", "--wandb_mode=offline",
                "--num_generations=2", "--prompts_per_step=2", "--micro_batch_size=4", "--max_completion_length=4",
                "--max_prompt_length=48", "--max_steps=2", "--eval_every=2", "--eval_prompts=2",
                "--completions_table_every=1", "--print_completions_every=0"])
    # wandb suggests another product of theirs (Weave) when a module named like an agent library is loaded: none of
    # ours is (the tools and environments live in environments/__init__.py)
    said = capfd.readouterr()
    assert "weave" not in (said.out + said.err).lower()
    metrics = [(s, d) for s, d in logged if "completions" not in d]
    tables = [(s, d["completions"]) for s, d in logged if "completions" in d]
    assert [s for s, _ in metrics] == [1, 2] and [s for s, _ in tables] == [1, 2]
    for _, d in metrics:
        assert all(k.split("/")[0] in ("train", "reward", "eval", "perf") for k in d), sorted(d)
    assert {"train/loss", "reward/reward", "reward/gsm8k_correctness_reward", "perf/step_time"} <= set(metrics[0][1])
    assert not any(k.startswith("eval/") for k in metrics[0][1])  # evaluation every 2 steps
    assert {"eval/accuracy_greedy", "eval/reward_greedy", "eval/accuracy", "eval/reward"} <= set(metrics[1][1])
    # the table: prompt, completion, each reward component, the total, the advantage; one row per completion
    table = tables[0][1]
    assert table.columns == ["prompt", "completion", "gsm8k_correctness_reward", "gsm8k_format_reward", "reward",
                             "advantage"]
    assert len(table.data) == 4
    first = [json.loads(l) for l in open(out / "metrics.jsonl")][0]
    for row in table.data:
        assert row[4] == pytest.approx(row[2] * 1.0 + row[3] * 0.1)
    assert sum(r[5] for r in table.data) == pytest.approx(0.0, abs=1e-5)  # advantages centred per group
    assert first["reward"] == pytest.approx(sum(r[4] for r in table.data) / 4)
    # and on disk, in the offline run folder
    files = glob.glob(str(out / "wandb" / "offline-run-*" / "files" / "media" / "table" / "completions_*.table.json"))
    assert len(files) == 2
    on_disk = json.load(open(sorted(files)[0]))
    assert on_disk["columns"] == table.columns and len(on_disk["data"]) == 4


def test_wandb_config_is_the_whole_config(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    seen = {}
    real_init = wandb.init

    def init(*a, **k):
        seen.update(k["config"])
        return real_init(*a, **k)
    monkeypatch.setattr(wandb, "init", init)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    train.main([f"--out_dir={tmp_path / 'o'}", "--wandb_mode=offline", "--max_steps=1", "--num_generations=2",
                "--prompts_per_step=2", "--print_completions_every=0", "--lora_rank=2"])
    assert set(seen) == set(train.Config.__dataclass_fields__) and seen["lora_rank"] == 2


def test_wandb_keys():
    assert run_log.wandb_key("loss") == "train/loss"
    assert run_log.wandb_key("reward") == "reward/reward"
    assert run_log.wandb_key("reward/countdown_reward") == "reward/countdown_reward"
    assert run_log.wandb_key("eval/accuracy") == "eval/accuracy"
    assert run_log.wandb_key("step_time") == "perf/step_time"


RM_WORKER = r'''
import sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import model_loading, rewards, sharding
d = sharding.setup("cpu")
model, tok = model_loading.load_reward_model(sys.argv[2], {"dtype": "float32"}, "cpu", seed=3)
root = sharding.shard(sharding.Root(model), d, "fp32").eval()
assert sharding.fsdp_modules(root), "the reward model should be sharded"
prompts, completions = sys.argv[4].split("|"), sys.argv[5].split("|")
mine = slice(d.rank * 2, d.rank * 2 + 2)  # each rank scores its own completions, in batches of one
scores = rewards.reward_model_scores(root, tok, prompts[mine], completions[mine], batch_size=1)
sharding.free_gathered(root)
everything = [None] * d.world_size
dist.all_gather_object(everything, scores)
if d.rank == 0:
    torch.save(sum(everything, []), sys.argv[3])
sharding.teardown()
'''


def test_sharded_reward_model_scores_as_unsharded(reward_model, tmp_path):
    """Two processes on CPU (gloo): the reward model sharded like the policy gives the unsharded scores."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = str(tmp_path / "rm")
    model, tok = reward_model
    model.save_pretrained(path)  # the fixture's weights, so both sides score with the same model
    tok.save_pretrained(path)
    (tmp_path / "worker.py").write_text(RM_WORKER)
    out = tmp_path / "scores.pt"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           "29533", str(tmp_path / "worker.py"), root, path, str(out), "|".join(PROMPTS),
                           "|".join(COMPLETIONS)], capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""))  # CPU on a GPU machine too
    assert finished(proc, out), proc.stdout[-3000:] + proc.stderr[-3000:]
    expected = rewards.reward_model_scores(model, tok, PROMPTS, COMPLETIONS)
    torch.testing.assert_close(torch.tensor(torch.load(out)), torch.tensor(expected), atol=1e-5, rtol=1e-5)


def test_a_resumed_run_refills_the_steps_the_dashboard_lost(tmp_path, monkeypatch):
    """Killed hard, a run's wandb history ends where wandb last sent it (step 2 here) while metrics.jsonl holds
    every step (1-6). Resumed from the checkpoint at 5, the steps from the server's end to the checkpoint (3-5) are
    logged again from metrics.jsonl, once, with the values the file holds; the lines past the checkpoint are
    dropped, to be redone."""
    wandb = pytest.importorskip("wandb")
    logged = []

    class Resumed:  # what wandb.init gives back for a run whose server history ends at step 2
        step = 3

        def log(self, data, step=None):
            logged.append((step, dict(data)))
    monkeypatch.setattr(wandb, "init", lambda **kwargs: Resumed())
    out = tmp_path / "out"
    out.mkdir()
    lines = [{"step": s, "loss": 0.1 * s, "reward": s / 10, "reward_std": float("nan") if s == 4 else 0.5}
             for s in range(1, 7)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(run_log.strict_json(m)) + "\n" for m in lines))
    cfg = train.Config(out_dir=str(out), wandb_mode="online")
    run_log.Logger(cfg, True, resume_step=5, run_id="abc123")
    assert [s for s, _ in logged] == [3, 4, 5]
    for (step, data), m in zip(logged, lines[2:5]):
        want = {run_log.wandb_key(k): v for k, v in m.items() if k != "step" and v == v}  # NaN: null on disk
        assert data == pytest.approx(want), step
    assert [json.loads(line)["step"] for line in open(out / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    logged.clear()
    run_log.Logger(dataclasses.replace(cfg, wandb_mode="offline"), True, resume_step=5, run_id="abc123")
    assert logged == []  # offline, wandb's own files are the history: nothing tells where it ends
