"""Several processes (torchrun, gloo on CPU): FSDP2 sharding, sharded loading, exact resume, and one and two
processes training alike. (Checkpoint files on their own, in one process: test_out_dir.py; launching and reading
runs: launches.py.)

One concern in one file (past 650 lines on purpose): what several processes do. The runs are launched once per
module (each launch costs seconds, and a launch serves several tests), and the tests read what they left:
metrics.jsonl, the sampled tokens recorded by tests/run_train.py, checkpoints and exports.
"""

import concurrent.futures
import glob
import json
import os
import pathlib
import shutil
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launches import (launch, launch_failing, launch_nodes, launch_runs, metrics, start_agents,  # noqa: E402
                      tokens)
import model_loading  # noqa: E402

FLAGS = ["--log_every=1", "--keep_checkpoints=2", "--print_completions_every=0"]
# the only metrics allowed to differ between runs (reward_time/<function> too)
TIMING = {"step_time", "generation_time", "update_time", "reward_time", "tokens_per_s", "generation_wait_s"}


def train_flags(out_dir, max_steps, save_every=2):
    return [f"--out_dir={out_dir}", f"--max_steps={max_steps}", f"--save_every={save_every}", *FLAGS]


# The runs of the module's checks, in two launches of each world size: first the fresh runs, then the resumed
# ones (a resumed run starts in a process of its own, as a user's would). Each check below names its runs.
UNEVEN_DATA = [{"prompt": "x" * (1 if i % 2 else 60) + f" {chr(97 + i % 26)}>", "answer": chr(98 + i % 25)}
               for i in range(64)]
UNEVEN_REWARD = ("def uneven(prompts, completions, seed, **_):\n"
                 "    return [1.0 if s % 2 else float(len(c) % 3) for s, c in zip(seed, completions)]\n")
LOPSIDED_REWARD = ("import torch.distributed as dist\n"
                   "def lopsided(prompts, completions, **_):\n"
                   "    return [1.0 if dist.get_rank() == 0 else float(len(c) % 3) for c in completions]\n")


def checks(t):
    """{name: train.py flags} of the checks that compare 1 and 2 processes on fresh runs (run by both)."""
    return {
        # prompts of 2 and 61 characters: a token budget would run different numbers of micro-batches per rank
        "budget": ["--max_steps=2", "--save_every=0", f"--dataset={t / 'uneven.jsonl'}", "--micro_batch_tokens=200",
                   "--gradient_checkpointing=true"],
        "objectives": ["--max_steps=2", "--save_every=0", "--loss_type=luspo", "--importance_sampling_level=sequence",
                       "--importance_sampling=token_truncate",
                       "--top_entropy_quantile=0.3", "--entropy_coef=0.01", "--use_adaptive_entropy=true",
                       "--entropy_target=10", "--multi_objective_aggregation=normalize_then_sum",
                       "--num_iterations=2",
                       "--reward_funcs=rewards:next_letter_reward,rewards:soft_overlong_punishment",
                       "--soft_punish_cache=2", "--reward_weights=1,0.5"],
        # the tiny reward model (sharded too) scores every row differently, so a missing gather or trim shows; the
        # step's rows stream through 2 places, and the reward model scores them at the take, every rank together
        "eval": ["--max_steps=1", "--eval_every=1", "--eval_prompts=3", "--prompts_per_step=4", "--num_generations=2",
                 "--max_completion_length=8", "--save_every=0", "--reward_model=tiny", "--rollouts_in_flight=2"],
        "turns": ["--max_steps=2", "--save_every=0", "--task=vault", "--max_turns=3", "--max_completion_length=48",
                  "--pause_often"],
        # with the sampler a step ahead: a step's rounds join its stream, the next step's rows decoding beside them
        "dynamic": ["--max_steps=2", "--save_every=0", "--task=vault", "--max_turns=3", "--max_completion_length=24",
                    "--pause_often", "--prompts_per_step=4", "--dynamic_sampling", "--max_generation_rounds=3",
                    f"--reward_funcs={t / 'uneven.py'}:uneven", "--max_staleness=1"],
        # a folder with safetensors weights: 2 processes each read their own shards (1 loads it whole)
        "weights": ["--max_steps=2", "--save_every=0", f"--model={t / 'saved'}"],
        # the same folder with LoRA's adapters (added on meta before sharding) and no reference model
        "lora_weights": ["--max_steps=2", "--save_every=0", f"--model={t / 'saved'}", "--lora_rank=8"],
        # a Qwen3-MoE folder (a matrix per expert in the files) whose policy and reference record and replay routing,
        # the sampler a step ahead (2 processes sample on the model's own forward, 1 on the written-out decoder)
        "replay_weights": ["--max_steps=2", "--save_every=0", f"--model={t / 'moe'}", "--routing_replay",
                           "--max_staleness=1"],
        # the sampler works a step ahead, rows in flight across the optimizer steps; prompts of 2 and 61 characters
        # and completions cut at 1 to 12 tokens by the stop rule below (STALE_STOPS)
        # each group's prompt computed once, in the prefill and in training, under a token budget
        "shared": ["--max_steps=2", "--save_every=0", f"--dataset={t / 'uneven.jsonl'}", "--micro_batch_tokens=200",
                   "--gradient_checkpointing=true", "--shared_prompts"],
        "stale": ["--max_steps=50", "--save_every=0", "--max_staleness=1", f"--dataset={t / 'uneven.jsonl'}",
                  "--prompts_per_step=4", "--num_generations=4", "--max_completion_length=12", "--stop_often"],
    }


# --cp_size=2 runs (2 processes) and the 1-process run each trains as (sequence_parallel_runs)
SEQUENCE_PARALLEL = ("cpA", "cp_lora", "cp_budget", "cp_qwen3", "cp_llama", "cp_moe", "cp_moe_checkpointed",
                     "cp_replay")


def sequence_parallel_runs(t, p):
    """{name: (the 1-process run it trains as, train.py flags)}: the default run; LoRA on a folder; token-budget
    micro-batches with activation checkpointing; Qwen3 with 1 K/V head (repeated for 2 ranks) and Llama (2 K/V
    heads, 1 a rank), whose 1-process runs are "<name>1"; Qwen3-MoE on its own forward, the exchange as its attention
    modules' attention, with activation checkpointing (each layer's recompute switches the exchange on again) and
    with routing replay (its records split with their positions)."""
    return {"cpA": ("A1", ["--max_steps=4", "--save_every=0"]),
            "cp_lora": ("lora_weights1", checks(t)["lora_weights"]),
            "cp_budget": ("budget1", checks(t)["budget"]),
            "cp_qwen3": ("cp_qwen31", ["--max_steps=2", "--save_every=0", f"--model={t / 'qwen3'}"]),
            "cp_llama": ("cp_llama1", ["--max_steps=2", "--save_every=0", f"--model={t / 'llama'}"]),
            "cp_moe": ("cp_moe1", ["--max_steps=2", "--save_every=0", f"--model={t / 'moe'}"]),
            "cp_moe_checkpointed": ("cp_moe1", ["--max_steps=2", "--save_every=0", f"--model={t / 'moe'}",
                                                "--gradient_checkpointing=true"]),
            "cp_replay": ("replay_weights1", checks(t)["replay_weights"])}


STALENESS = ("rows_carried", "staleness_mean", "staleness_max")  # --max_staleness's metrics
STALE_FLAGS = ["--max_staleness=1", "--max_completion_length=12", "--stop_often"]
MINI_FLAGS = ["--save_every=2", "--steps_per_generation=2", "--num_iterations=2", "--micro_batch_tokens=60",
              "--top_entropy_quantile=0.5", "--sync_ref_model=true", "--ref_model_sync_steps=3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    t = tmp_path_factory.mktemp("dist")
    with open(t / "uneven.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in UNEVEN_DATA)
    (t / "uneven.py").write_text(UNEVEN_REWARD)
    (t / "lopsided.py").write_text(LOPSIDED_REWARD)
    save_weights(t / "saved")
    save_moe_weights(t / "moe")
    save_family_weights(t / "qwen3", "qwen3", num_key_value_heads=1)  # fewer K/V heads than --cp_size
    save_family_weights(t / "llama", "llama")
    p = {k: str(t / k) for k in ("A1", "A2", "B1", "B2", "C", "D", "mini1", "mini2", "lopsided", "offload", "tp",
                                 "staleA", "staleB", "stale_tp", "dynamic_tp", *SEQUENCE_PARALLEL)}
    for name in checks(t):
        p.update({f"{name}{w}": str(t / f"{name}{w}") for w in (1, 2)})
    first = {1: [train_flags(p["A1"], 4),                  # straight to step 4
                 train_flags(p["B1"], 2, save_every=1),    # 2 steps, checkpoints at 1 and 2 (2 is damaged below)
                 [f"--out_dir={p['mini1']}", "--max_steps=3", *MINI_FLAGS, *FLAGS],
                 train_flags(p["staleA"], 4) + STALE_FLAGS, train_flags(p["staleB"], 2) + STALE_FLAGS],
             2: [train_flags(p["A2"], 4), train_flags(p["B2"], 2),
                 [f"--out_dir={p['mini2']}", "--max_steps=2", *MINI_FLAGS, *FLAGS],  # stopped, resumed below
                 [f"--out_dir={p['lopsided']}", "--max_steps=2", "--save_every=0", "--prompts_per_step=4",
                  "--dynamic_sampling", "--max_generation_rounds=3", f"--reward_funcs={t / 'lopsided.py'}:lopsided",
                  *FLAGS],
                 [f"--out_dir={p['offload']}", *checks(t)["weights"], "--cpu_offload", *FLAGS],
                 # the two decode their rows together on halves of the layers (layers/tensor_parallel.py)
                 [f"--out_dir={p['tp']}", *checks(t)["weights"], "--tp_size=2", *FLAGS],
                 # and so with the sampler a step ahead, for the first 10 of the staleness check's 50 steps
                 [f"--out_dir={p['stale_tp']}", *checks(t)["stale"], "--max_steps=10", "--tp_size=2", *FLAGS],
                 # and an agent's rows and further rounds in that group's stream
                 [f"--out_dir={p['dynamic_tp']}", *checks(t)["dynamic"], "--tp_size=2", *FLAGS]]}
    for name, (_, flags) in sequence_parallel_runs(t, p).items():  # each row's positions split over the two
        first[2].append([f"--out_dir={p[name]}", *flags, "--cp_size=2", *FLAGS])
    for name, flags in checks(t).items():
        for w in (1, 2):
            first[w].append([f"--out_dir={p[name + str(w)]}", *flags, *FLAGS])
    for name in ("cp_qwen3", "cp_llama", "cp_moe"):
        p[name + "1"] = str(t / (name + "1"))
        first[1].append([f"--out_dir={p[name + '1']}", *sequence_parallel_runs(t, p)[name][1], *FLAGS])
    out = {}

    def both(runs_of, phase):  # a one-process launch leaves a core idle: the two side by side
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            jobs = [pool.submit(launch_runs, runs_of[w], w, str(t), f"{phase}{w}") for w in (1, 2)]
            for job in jobs:
                out.update(job.result())

    both(first, "first")
    shutil.copytree(p["B2"], p["C"])
    shutil.copytree(p["B1"], p["D"])
    # the newest checkpoint of B1 (step 2) is damaged (its model shard loses its tail): the same command must
    # fall back to step 1 and still reproduce the straight run
    shard_file = os.path.join(p["B1"], "checkpoints", "step_00000002", "__0_0.distcp")
    with open(shard_file, "r+b") as f:
        f.truncate(os.path.getsize(shard_file) // 2)
    then = {1: [train_flags(p["B1"], 4),
                train_flags(p["C"], 3),     # saved by 2 processes, resumed by 1
                train_flags(p["staleB"], 4) + STALE_FLAGS],
            2: [train_flags(p["B2"], 4),    # the same command to step 4
                train_flags(p["D"], 3),     # saved by 1 process, resumed by 2
                [f"--out_dir={p['mini2']}", "--max_steps=3", *MINI_FLAGS, *FLAGS]]}
    both(then, "then")  # a folder run in both launches keeps the output of its second, its resumed part
    names = {v: k for k, v in p.items()}
    return p, {names[k]: v for k, v in out.items()}


def assert_same_metrics(a, b, steps=None):
    a = {m["step"]: m for m in a if steps is None or m["step"] in steps}
    b = {m["step"]: m for m in b if steps is None or m["step"] in steps}
    assert sorted(a) == sorted(b)
    for step in a:
        for k in a[step]:
            if k.split("/")[0] not in TIMING:
                assert a[step][k] == b[step][k] or (a[step][k] != a[step][k] and b[step][k] != b[step][k]), \
                    f"step {step}: {k} {a[step][k]} != {b[step][k]}"


def exported_weights(out_dir):
    from safetensors.torch import load_file
    files = glob.glob(os.path.join(out_dir, "model", "*.safetensors"))
    assert files, f"no safetensors in {out_dir}/model"
    weights = {}
    for f in files:
        weights.update(load_file(f))
    return weights


# ----------------------------------------------------------------------------- resume


@pytest.mark.parametrize("world", [1, 2])
def test_resume_is_exact(runs, world):
    """4 steps straight == 2 steps, stop, the same command again: every metric and every sampled token.

    With one process the newest checkpoint (step 2) is damaged: the run falls back to step 1.
    """
    p, out = runs
    a, b = p[f"A{world}"], p[f"B{world}"]
    resumed_from = out[f"B{world}"].split("resuming from")[1].splitlines()[0]
    assert ("step_00000002" if world == 2 else "step_00000001") in resumed_from
    if world == 1:
        assert "skipping checkpoint" in out["B1"] and "step_00000002" in out["B1"].split("skipping checkpoint")[1]
    assert [m["step"] for m in metrics(b)] == [1, 2, 3, 4]  # redone steps are not logged twice
    assert_same_metrics(metrics(a), metrics(b))
    assert len(tokens(a)) == 4
    if world == 2:
        assert tokens(a) == tokens(b)
    else:  # step 2 was sampled twice (before and after the fallback), the same both times
        assert tokens(b) == [tokens(a)[0], tokens(a)[1], tokens(a)[1], tokens(a)[2], tokens(a)[3]]
    wa, wb = exported_weights(a), exported_weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    if world == 2:  # the resumed run saved step 4 under the wandb run id the first run saved at step 2
        saved = [torch.load(os.path.join(b, "checkpoints", f"step_0000000{s}", "trainer.pt"), weights_only=False)
                 for s in (2, 4)]
        assert saved[0]["wandb_id"] == saved[1]["wandb_id"]
        assert [x["data"]["next_step"] for x in saved] == [3, 5]


def test_one_and_two_processes_train_alike(runs):
    """Same global batches (same sampled tokens), same rewards, the same parameters within 1e-5."""
    p, _ = runs
    assert tokens(p["A1"]) == tokens(p["A2"])
    m1, m2 = metrics(p["A1"]), metrics(p["A2"])
    assert [m["reward"] for m in m1] == [m["reward"] for m in m2]
    for x, y in zip(m1, m2):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4, abs=1e-8)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-4)
    w1, w2 = exported_weights(p["A1"]), exported_weights(p["A2"])
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=0, atol=1e-5, msg=k)
    initial_dir = os.path.join(p["A2"], "tiny_model_init")
    assert os.path.exists(os.path.join(initial_dir, "config.json"))


def test_checkpoint_resumes_in_another_world_size(runs):
    """Saved by 2 processes, resumed by 1 (C); saved by 1, resumed by 2 (D): step 3 as the straight runs."""
    p, out = runs
    assert "saved by 2 process(es), now 1" in out["C"]
    assert "saved by 1 process(es), now 2" in out["D"]
    for resumed, straight in (("C", "A2"), ("D", "A1")):
        got, want = metrics(p[resumed]), metrics(p[straight])
        assert [m["step"] for m in got] == [1, 2, 3]
        assert got[2]["reward"] == want[2]["reward"]
        assert got[2]["loss"] == pytest.approx(want[2]["loss"], rel=1e-4, abs=1e-8)
        assert got[2]["kl"] == pytest.approx(want[2]["kl"], rel=1e-4, abs=1e-8)  # the reference is rebuilt alike


# ----------------------------------------------------------------------------- models


@pytest.mark.parametrize("world", [1, 2])
def test_reference_model_frozen_on_policy_device(runs, world):
    p, out = runs
    reports = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(p[f"A{world}"], "after_rank*.json")))]
    assert len(reports) == world
    assert reports[0]["ref_unchanged"] and reports[0]["policy_changed"]
    for r in reports:
        assert r["ref_eval"] and r["ref_no_grad"] and r["same_placement"]
        assert r["ref_devices"] == r["policy_devices"]
        assert r["sharded"] == (world > 1)
        assert r["written_out_layer_calls"] > 0  # the training forward ran written out, also sharded
        assert r["written_out_prefills"] > 0  # and the sampler on the written-out decoder
    # as the banner says, with one process and with two
    said = [line for line in out[f"A{world}"].splitlines() if line.startswith("paths: ")]
    assert said == ["paths: sampler on written-out layers, training on written-out layers"], said


def test_export_loads_and_reproduces_logits(runs):
    from transformers import AutoModelForCausalLM
    from run_train import LOGITS_INPUT

    p, _ = runs
    # every export, 1 process or 2 (reading their own shards, offloaded, decoding together): the trained weights
    for name in ("A1", "A2", "B2", "weights1", "weights2", "offload", "tp"):
        with open(os.path.join(p[name], "after_rank0.json")) as f:
            assert json.load(f)["export_differs"] is None, name
    for name in ("A2", "B2"):
        weights = exported_weights(p[name])
        assert not any(k.startswith(("lm.", "_fsdp", "module.")) for k in weights)
        assert "lm_head.weight" not in weights  # tied: one tensor, re-tied on load
        model, info = AutoModelForCausalLM.from_pretrained(os.path.join(p[name], "model"), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"]
        assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
        for k, v in weights.items():
            assert v.shape == model.state_dict()[k].shape, k  # full tensors, not shards
        with torch.no_grad():
            logits = model(input_ids=LOGITS_INPUT).logits
        torch.testing.assert_close(logits, torch.load(os.path.join(p[name], "logits.pt")), rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- generation


def test_ranks_finishing_at_different_lengths_do_not_hang(runs):
    p, _ = runs
    r0, r1 = (json.load(open(os.path.join(p["A2"], f"sample_rank{r}.json"))) for r in (0, 1))
    assert all(r0["done"]) and not any(r1["done"])  # rank 0 finished at once, rank 1 never did
    assert r0["done_static"] == r0["done"] and r1["done_static"] == r1["done"]
    assert r0["lengths"] == [[1, 1, 1]] * 3 and r1["lengths"] == [[10, 10, 10]] * 3
    # the same forwards on both ranks: with a gather per forward, as many all-gathers
    assert r0["all_gathers_per_forward"] == r1["all_gathers_per_forward"]
    for r in (r0, r1):
        assert r["static_supported"]  # sharded blocks gather themselves for StaticDecoder's copy
        assert r["same_tokens"]  # StaticDecoder on FSDP2 = the Hugging Face forward, gathered or not
        # gathered once: one all-gather per FSDP group for the whole loop, not one per token
        assert r["all_gathers_static"] == r["all_gathers_gathered"] == r["fsdp_groups"]
        assert r["all_gathers_per_forward"] > 5 * r["fsdp_groups"]


def test_token_budget_micro_batches_agree_across_ranks(runs):
    """Prompts of 2 and 61 characters: with a token budget the ranks would run different numbers of
    micro-batches (8 against 10 at step 1 with this data), each a collective under FSDP; split to the same
    count, 2 processes finish and train as 1 does. With activation checkpointing, which recomputes each
    sharded layer (gathered again by FSDP) in backward."""
    p, _ = runs
    one, two = metrics(p["budget1"]), metrics(p["budget2"])
    assert [m["step"] for m in two] == [1, 2]
    for a, b in zip(one, two):
        assert a["reward"] == b["reward"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-8)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_other_objectives_agree_across_ranks(runs):
    """GSPO's sequence ratio with luspo's aggregation, the step's entropy quantile (gathered over ranks), the
    entropy bonus under adaptive control, GDPO's per-function normalisation and the sampler's tokens reweighted
    (their weights' extremes the largest over ranks), over two passes: 2 processes train as 1 does."""
    p, _ = runs
    one, two = metrics(p["objectives1"]), metrics(p["objectives2"])
    assert [m["step"] for m in two] == [1, 2]
    for a, b in zip(one, two):
        assert a["reward"] == b["reward"] and a["kept_frac"] == b["kept_frac"]
        assert 0 < a["kept_frac"] < 1
        assert a["entropy_coef"] == b["entropy_coef"]  # the controller reads every rank's tokens
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-8)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["is_weight_min"] <= a["is_weight"] <= a["is_weight_max"]
        for k in ("is_weight", "is_weight_min", "is_weight_max"):  # weights near 1: a sum over ranks would be 2
            assert a[k] == pytest.approx(b[k], rel=1e-5), k


def test_mini_batches_and_a_synced_reference_agree_across_ranks(runs):
    """steps_per_generation=2 with num_iterations=2 (4 optimizer steps a step), token-budget micro-batches in each
    mini-batch, each mini-batch's entropy quantile gathered over ranks, and the reference synced every 3 optimizer
    steps on each rank's shards: 2 processes, stopped after step 2 and resumed (the checkpoint holds the synced
    reference, which step 3's KL reads), train as 1 process does straight, and end with the same reference."""
    p, out = runs
    dirs = {1: p["mini1"], 2: p["mini2"]}
    assert "step_00000002" in out["mini2"].split("resuming from")[1].splitlines()[0]
    one, two = metrics(dirs[1]), metrics(dirs[2])
    assert [m["step"] for m in two] == [1, 2, 3] and [m["ref_syncs"] for m in two] == [1, 2, 4]
    for a, b in zip(one, two):
        assert a["reward"] == b["reward"] and a["kept_frac"] == b["kept_frac"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-8)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-4, abs=1e-9)
    assert two[2]["kl"] > 0
    refs = {w: torch.load(os.path.join(dirs[w], "ref.pt")) for w in (1, 2)}
    for k in refs[1]:
        torch.testing.assert_close(refs[2][k], refs[1][k], rtol=0, atol=1e-5, msg=k)
    assert not json.load(open(os.path.join(dirs[2], "after_rank0.json")))["ref_unchanged"]


LAYOUT_WORKER = r"""
import sys
sys.path.insert(0, sys.argv[1])
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM
import model_loading, sharding
from layers import transformer
dist.init_process_group("gloo")
for nested in (False, True):
    lm = AutoModelForCausalLM.from_config(model_loading.tiny_config(model_loading.build_byte_tokenizer()))
    root = sharding.Root(lm)
    for layer in lm.model.layers:
        if nested:
            fully_shard(layer.mlp)  # a group inside the layer's group: one gather would not bring every weight
        fully_shard(layer)
    fully_shard(root)
    before = transformer.decide(lm).trains_written_out(lm)  # outside the root's forward: the embeddings are shards
    inside = root(lambda lm: transformer.decide(lm).trains_written_out(lm))
    if dist.get_rank() == 0:
        print(f"nested={nested} before={before} inside={inside}", flush=True)
# forwards only, as the reference model runs: FSDP's per-forward records must not pile up
import logprobs
ids = torch.arange(3, 23).view(2, 10)
records = []
for _ in range(3):
    with torch.no_grad():
        root(logprobs.completion_logprobs, ids, torch.ones_like(ids), 4)
    sharding.free_gathered(root)
    records.append(len(lm.model.layers[0]._get_fsdp_state()._comm_ctx.post_forward_order))
if dist.get_rank() == 0:
    print(f"records after each forward and free_gathered={records}", flush=True)
out_dir = sys.argv[2].split("=", 1)[1]  # --out_dir=...: this rank's work is done (see exited_after_finishing)
open(f"{out_dir}/finished_rank{dist.get_rank()}", "w").close()
dist.destroy_process_group()
"""


def test_written_out_forward_layouts_and_forward_only_records(tmp_path):
    """Sharded as sharding.shard does (each layer one group, the root gathered around the call): the written-
    out forward applies inside the root's forward, not before it (the embeddings are shards there), and
    not where a layer holds another group. A model that only runs forwards (the reference) keeps no growing
    record of them."""
    script = tmp_path / "layout.py"
    script.write_text(LAYOUT_WORKER)
    out = launch(str(script), [ROOT, f"--out_dir={tmp_path}"], 2, timeout=120)
    assert "nested=False before=False inside=True" in out
    assert "nested=True before=False inside=False" in out
    # free_gathered forgets them (without it: 6, 11, 16 here)
    records = json.loads(out.split("records after each forward and free_gathered=")[1].splitlines()[0])
    assert records == [0, 0, 0], records


def test_evaluation_splits_rows_over_processes(runs):
    """Each of 2 ranks samples half the held-out rows (the odd one padded); the gathered scores equal 1 process's.

    One training step, its rows streaming through 2 places and scored by the reward model at the take, then an
    evaluation of 3 prompts: greedy (3 rows: 2 per rank, one a padding copy) and sampled (3 x 2 rows: 3 per rank).
    """
    p, _ = runs
    dirs = {w: p[f"eval{w}"] for w in (1, 2)}
    # recorded sample calls per rank: the training step, the greedy evaluation, the sampled one
    per_rank = []
    for r in (0, 1):
        with open(os.path.join(dirs[2], f"tokens_rank{r}.jsonl")) as f:
            per_rank.append([json.loads(line) for line in f])
    assert [[len(rows) for rows in calls] for calls in per_rank] == [[4, 2, 3], [4, 2, 3]]
    one, two = tokens(dirs[1]), tokens(dirs[2])
    assert [len(rows) for rows in one] == [8, 3, 6]
    assert two[1][2] == two[1][3]  # the padding row samples what the row it copies does
    assert two[0] == one[0] and two[1][:3] == one[1] and two[2] == one[2]
    (m1,), (m2,) = metrics(dirs[1]), metrics(dirs[2])
    evals = {k for k in m1 if k.startswith("eval/")}
    assert {"eval/reward", "eval/reward_greedy"} <= evals and evals == {k for k in m2 if k.startswith("eval/")}
    assert m1["eval/reward"] != 0 and m1["eval/reward_greedy"] != 0
    assert m1["reward"] == pytest.approx(m2["reward"], rel=1e-5) and m1["reward"] != 0
    for k in evals:
        assert m1[k] == pytest.approx(m2[k], rel=1e-5, abs=1e-7), k


SHARDED_LOAD_WORKER = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[1] + "/tests")
import torch
from transformers import AutoModelForCausalLM
import logprobs, model_loading, sharding, train
from layers import lora
from runs import export as run_export, setup as run_setup, weights
d = sharding.setup("cpu")
filled = []  # what each model held when fill_shards was given it: were all its parameters still on meta?
original_fill = model_loading.fill_shards
def recording_fill(root, path, device):
    filled.append(all(p.device.type == "meta" for p in root.parameters()))
    return original_fill(root, path, device)
model_loading.fill_shards = recording_fill
import safetensors, test_weight_files
reads = []  # (name, bytes) of every tensor read from a weights file (test_weight_files.Reads, without pytest)
real_open = safetensors.safe_open
safetensors.safe_open = lambda *a, **k: test_weight_files._Handle(real_open(*a, **k), reads)
report = {}
for name in sys.argv[3:]:
    path = f"{sys.argv[2]}/{name}"
    whole_model = AutoModelForCausalLM.from_pretrained(path)  # the one-process load, to compare with
    whole = whole_model.state_dict()
    runs = {}
    for bf16 in (False, True):
        cfg = train.parse_config([f"--model={path}", f"--out_dir={sys.argv[2]}/out", f"--ref_bf16={bf16}"])
        _, policy, ref = run_setup.load_models(cfg, d, "cpu")
        runs[bf16] = (policy, ref)
    # with LoRA: its adapters added on meta; each rank's shards are its chunks of one process's model and adapters
    # (add_lora from the same seed), read from at most its share of the files plus one tensor
    whole_lora = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(0)
    lora.add_lora(whole_lora, 4, 8.0, "all")
    cfg = train.parse_config([f"--model={path}", f"--out_dir={sys.argv[2]}/out", "--lora_rank=4", "--lora_alpha=8"])
    torch.manual_seed(0)
    reads.clear()
    _, lora_policy, lora_ref = run_setup.load_models(cfg, d, "cpu")
    r = {}
    want = dict(whole_lora.named_parameters())
    mine = dict(lora_policy.lm.named_parameters())
    stored = weights.tensors(path)
    r["lora"] = {"ref": lora_ref is not None, "names": sorted(mine) == sorted(want),
                 "adapters": sum(n.endswith("lora_A") for n in mine),
                 "exact": all(torch.equal(p.to_local(), torch.chunk(want[n].detach(), d.world_size)[d.rank])
                              for n, p in mine.items()),
                 "read": sum(b for _, b in reads), "stored": sum(torch.Size(s).numel() * t.itemsize for s, t, _ in stored.values()),
                 "largest": max(torch.Size(s).numel() * t.itemsize for s, t, _ in stored.values())}
    del lora_policy
    r.update({"meta_before_fill": filled[:], "tied": policy.lm.lm_head.weight is policy.lm.model.embed_tokens.weight})
    filled.clear()
    policy, ref = runs[False]
    # each rank's own shard of each weight is exactly its chunk (dim 0) of the weight in the files
    for label, root in (("policy", policy), ("ref", ref), ("ref_bf16", runs[True][1])):
        exact, local, total = True, 0, 0
        for n, p in root.lm.named_parameters():
            mine = p.to_local()
            want = torch.chunk(whole[n], d.world_size, dim=0)[d.rank].to(mine.dtype)
            exact &= torch.equal(mine, want)
            local += mine.numel() * mine.element_size()
            total += p.numel() * p.element_size()
        buffers = dict(whole_model.named_buffers())  # rotary inv_freq: computed in __init__, never saved
        exact &= all(torch.equal(b, buffers[n]) for n, b in root.lm.named_buffers()) and len(buffers) > 0
        r[label] = {"exact": exact, "fraction": local / total,
                    "dtypes": sorted({str(p.to_local().dtype) for p in root.parameters()})}
        sharding.free_gathered(root)
        full = {k: sharding.full_host_tensor(v) for k, v in root.lm.state_dict().items()}  # on rank 0
        if d.master:
            r[label]["full_exact"] = sorted(full) == sorted(whole) and all(
                torch.equal(full[k], whole[k].to(full[k].dtype)) for k in whole)
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lp32 = ref(logprobs.completion_logprobs, ids, torch.ones_like(ids), 6)[0]
        lp16 = runs[True][1](logprobs.completion_logprobs, ids, torch.ones_like(ids), 6)[0]
    r["ref_bf16_logprob_diff"] = float((lp32 - lp16).abs().max())
    sharding.free_gathered(policy)
    export = f"{sys.argv[2]}/export_{name}"
    run_export.export_model(policy.lm, model_loading.load_tokenizer(path), export, master=d.master,
                            max_shard_bytes=20_000)  # every rank: a gather per tensor
    if d.master:
        from launches import export_differs
        r["export_differs"] = export_differs(export, whole)
    report[name] = r
with open(f"{sys.argv[2]}/report_rank{d.rank}.json", "w") as f:
    json.dump(report, f)
open(f"{sys.argv[2]}/finished_rank{d.rank}", "w").close()
sharding.teardown()
"""


def save_weights(path, **config_overrides):
    """A tiny model folder with its weights written out (safetensors), as a real model's is."""
    from transformers import AutoModelForCausalLM
    import model_loading
    torch.manual_seed(0)
    tokenizer = model_loading.build_byte_tokenizer()
    model = AutoModelForCausalLM.from_config(model_loading.tiny_config(tokenizer, **config_overrides))
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def save_family_weights(path, family, **overrides):
    """A tiny folder of one of tests/architectures.py's families, its weights written out."""
    from transformers import AutoModelForCausalLM
    import architectures
    torch.manual_seed(0)
    tokenizer = model_loading.build_byte_tokenizer()
    model = AutoModelForCausalLM.from_config(architectures.config(family, tokenizer, **overrides))
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def save_moe_weights(path):
    """A tiny Qwen3-MoE folder: its checkpoint stores a matrix per expert, the model one fused tensor for all."""
    from transformers import AutoModelForCausalLM
    import architectures
    import model_loading
    torch.manual_seed(0)
    tokenizer = model_loading.build_byte_tokenizer()
    model = AutoModelForCausalLM.from_config(architectures.config("qwen3_moe", tokenizer))
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def test_sharded_loading_reads_each_ranks_own_shards(tmp_path):
    """Two processes load a folder with safetensors weights (tied embeddings, untied, and a MoE model whose
    checkpoint holds a matrix per expert where the model holds one tensor for all): the policy and the
    reference, each built from the files on the meta device, hold on each rank exactly its chunk of every
    weight as one process loads it (and gathered, the whole model) and the same buffers, about half of the
    model's bytes, and no rank had the model's parameters before its shards were read. With ref_bf16 the
    reference's shards are bfloat16 and its log-probs are the float32 reference's within bfloat16's rounding.
    The policy exported from its shards in several files loads as exactly those weights (the MoE model's experts
    written back as a matrix per expert)."""
    from runs import weights
    save_weights(tmp_path / "tied")
    save_weights(tmp_path / "untied", tie_word_embeddings=False)
    save_moe_weights(tmp_path / "moe")
    stored = weights.tensors(str(tmp_path / "moe"))
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in stored  # the per-expert form is what is read
    assert "model.layers.0.mlp.experts.gate_up_proj" not in stored
    script = tmp_path / "load.py"
    script.write_text(SHARDED_LOAD_WORKER)
    out = launch(str(script), [ROOT, str(tmp_path), "tied", "untied", "moe"], 2, timeout=240)
    assert out.count("loaded in ") == 9 and "the whole model in each process" not in out, out[-3000:]
    reports = [json.load(open(tmp_path / f"report_rank{r}.json")) for r in (0, 1)]
    for rank, report in enumerate(reports):
        for name, r in report.items():
            assert r["tied"] == (name == "tied")
            assert r["meta_before_fill"] == [True] * 5, name  # policy and reference, twice; the LoRA policy
            lo = r["lora"]
            assert lo["names"] and lo["exact"] and not lo["ref"] and lo["adapters"] > 0, (name, rank, lo)
            assert 0 < lo["read"] <= lo["stored"] / 2 + lo["largest"], (name, rank, lo)
            for label in ("policy", "ref", "ref_bf16"):
                assert r[label]["exact"], (name, label, rank)
                assert r[label]["fraction"] == pytest.approx(0.5, abs=0.02), (name, label)
                if rank == 0:
                    assert r[label]["full_exact"], (name, label)
            if rank == 0:  # exported from the shards, in files of 20 kB: exactly the weights in the files
                assert r["export_differs"] is None, (name, r["export_differs"])
            assert r["policy"]["dtypes"] == r["ref"]["dtypes"] == ["torch.float32"]
            assert r["ref_bf16"]["dtypes"] == ["torch.bfloat16"]
            # bfloat16 keeps 8 bits: ~4e-3 of log-probs near 5; more for MoE, where it moves a token's experts
            assert 0 < r["ref_bf16_logprob_diff"] < (0.2 if name == "moe" else 1e-2), r


def test_sharded_loading_trains_as_one_process(runs):
    """A folder with safetensors weights: 2 processes, each reading only its own shards of the policy and of the
    reference, train as 1 process that loads it whole; with cpu_offload (on a CPU-only machine the shards are
    host memory already, so nothing moves) as without it."""
    p, out = runs
    assert "loaded in " in out["weights2"] and "each process read its own shards" in out["weights2"]
    assert "the whole model in each process" in out["weights1"]
    assert "each process read its own shards" in out["offload"]
    one, two, offload = metrics(p["weights1"]), metrics(p["weights2"]), metrics(p["offload"])
    assert [m["step"] for m in two] == [m["step"] for m in offload] == [1, 2]
    assert tokens(p["weights1"]) == tokens(p["weights2"]) == tokens(p["offload"])
    for a, b, c in zip(one, two, offload):
        assert a["reward"] == b["reward"] == c["reward"]
        for x in (b, c):
            assert x["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-8)
            assert x["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
            assert x["kl"] == pytest.approx(a["kl"], rel=1e-4, abs=1e-9)
    assert two[1]["kl"] > 0
    reports = [json.load(open(os.path.join(p["weights2"], f"after_rank{r}.json"))) for r in (0, 1)]
    assert reports[0]["ref_unchanged"] and reports[0]["policy_changed"]  # the reference: the files' weights
    assert all(r["sharded"] and r["same_placement"] for r in reports)


def test_tensor_parallel_decode_trains_as_one_process(runs):
    """2 processes reading their own shards and decoding together at --tp_size=2 (each holding half of every
    layer, cut from its FSDP2 shards) train as 1 process on the whole model: the same tokens and rewards, the
    loss, gradient and KL within float32 noise."""
    p, out = runs
    assert "sliced over 2 tensor-parallel ranks" in out["tp"] and "each process read its own shards" in out["tp"]
    one, tp = metrics(p["weights1"]), metrics(p["tp"])
    assert tokens(p["weights1"]) == tokens(p["tp"])
    assert [m["step"] for m in tp] == [1, 2]
    for a, b in zip(one, tp):
        assert a["reward"] == b["reward"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-8)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["kl"] == pytest.approx(a["kl"], rel=1e-4, abs=1e-9)


def test_multi_turn_rollouts_agree_across_ranks(runs):
    """The vault task's tool turns (every turn a call, see run_train.pause_often): 2 processes sample the
    same trajectories, rewards and gradient as 1, while rows take different numbers of turns on each rank."""
    p, _ = runs
    one, two = p["turns1"], p["turns2"]
    assert tokens(one) == tokens(two)
    for a, b in zip(metrics(one), metrics(two)):
        for k in ("reward", "reward/vault_reward", "turns", "turns_max", "tool_calls", "completion_length",
                  "completion_policy_length"):
            assert a[k] == b[k], k
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-7)  # a sum of terms near 0, in another order
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    # rows finished after different numbers of turns (within a rank and across the two)
    assert all(1 < x["turns"] < x["turns_max"] and x["tool_calls"] > 0.5 for x in metrics(two))


def test_rows_in_flight_across_steps_train_as_one_process(runs):
    """--max_staleness=1 for 50 steps: the sampler decodes the next step's rows while a step's last rows run on,
    and keeps them in flight through the optimizer step. Rows end at different lengths on the two ranks (prompts
    of 2 and 61 characters, completions of 1 to 12 tokens), every rank stops decoding at the same check, and 2
    processes sample the same tokens, with the same rewards and losses, as 1."""
    p, _ = runs
    one, two = p["stale1"], p["stale2"]
    assert len(tokens(one)) == 50 and tokens(one) == tokens(two)
    pad = model_loading.build_byte_tokenizer().pad_token_id
    lengths = [len([t for t in row if t != pad]) for step in tokens(two) for row in step]
    assert min(lengths) < 4 and max(lengths) == 12, (min(lengths), max(lengths))
    assert_trains_alike(one, two, also=STALENESS)
    assert all(m["staleness_max"] == 1 and m["rows_carried"] > 0 for m in metrics(two)[1:])  # all but the first


def test_shared_prompts_train_as_one_process(runs):
    """--shared_prompts (one prefill per distinct prompt, each group's prompt once in training) with a token budget:
    2 processes sample and train as 1, and as the padded path does (the budget check's run, same settings)."""
    p, _ = runs
    one, two = p["shared1"], p["shared2"]
    assert tokens(one) == tokens(two) == tokens(p["budget1"])[:2]
    for a, b, padded in zip(metrics(one), metrics(two), metrics(p["budget1"])):
        assert a["reward"] == b["reward"] == padded["reward"]
        for x in (b, padded):
            assert a["loss"] == pytest.approx(x["loss"], rel=1e-4, abs=1e-7)
            assert a["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)


def test_rows_in_flight_in_a_tensor_parallel_group_train_as_one_process(runs):
    """--max_staleness=1 --tp_size=2: the group's two ranks hold all its rows in one stream and decode them on
    halves of the layers, each taking its own rows back; the first 10 steps sample, score and train as one process
    does (its 50-step run's first 10: rows of step s start during step s - 1 in both)."""
    p, _ = runs
    assert len(tokens(p["stale_tp"])) == 10
    assert_trains_alike(p["stale1"], p["stale_tp"], also=STALENESS)


def test_rows_in_flight_resume_exactly(runs):
    """--max_staleness=1 with checkpoints every 2 steps: the stream is drained at each checkpoint, so 2 steps,
    a stop, and the same command again give every metric and every token of 4 steps straight."""
    p, _ = runs
    assert [m["step"] for m in metrics(p["staleB"])] == [1, 2, 3, 4]
    assert_same_metrics(metrics(p["staleA"]), metrics(p["staleB"]))
    assert tokens(p["staleA"]) == tokens(p["staleB"])
    assert metrics(p["staleA"])[-1]["rows_carried"] > 0
    # the stream drained at step 2 and a new one began at 3: its tokens' versions count the run's steps
    assert [m["staleness_max"] for m in metrics(p["staleA"])] == [0, 1, 0, 1]


def test_dynamic_sampling_agrees_across_ranks(runs):
    """Dynamic sampling on the vault task (tool turns, each rank padding its own prompts), the sampler a step ahead
    (--max_staleness=1: an agent's rows and a step's further rounds in the stream): the groups kept lie on both
    ranks and are shared out again, conversations included; 2 processes draw, keep and train as 1 does.
    The reward (UNEVEN_REWARD) is constant on about half the prompts: their groups carry no signal. So does a
    tensor-parallel group of the two (one stream of the group's rows: each rank's tools answer its own rows' turns
    and the group shares the answers, tensor_parallel.group_respond)."""
    p, _ = runs
    one = p["dynamic1"]
    for two in (p["dynamic2"], p["dynamic_tp"]):
        assert tokens(one) == tokens(two)
        for a, b in zip(metrics(one), metrics(two)):
            for k in ("reward", "dynamic/rounds", "dynamic/groups_kept", "dynamic/groups_drawn",
                      "dynamic/reward_drawn", "frac_reward_zero_std", "turns", "tool_calls", "completion_length"):
                assert a[k] == b[k], k
            assert a["loss"] == pytest.approx(b["loss"], abs=1e-7)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert any(m["dynamic/rounds"] > 1 for m in metrics(two))


def test_dynamic_sampling_when_one_rank_holds_no_kept_group(runs):
    """Rank 0's groups never have a signal (LOPSIDED_REWARD is constant there), so every kept row comes from
    rank 1 and rank 0 sends nothing: both still train on groups with a signal, and finish."""
    p, _ = runs
    for m in metrics(p["lopsided"]):
        assert m["dynamic/groups_kept"] == 4 and m["dynamic/rounds"] >= 2 and m["frac_reward_zero_std"] == 0


def assert_trains_alike(one, two, also=()):
    """Run `two` sampled the tokens and rewards of run `one`'s first steps (as many as it has), with losses,
    gradient norms and KLs within a relative 1e-4 (the reductions' order; losses near 0 within 1e-7), and the
    metrics `also` within 1e-6."""
    assert tokens(two) == tokens(one)[:len(tokens(two))]
    for a, b in zip(metrics(one), metrics(two)):
        assert a["reward"] == b["reward"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-7)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["kl"] == pytest.approx(a["kl"], rel=1e-4, abs=1e-9)
        for k in also:
            assert b[k] == pytest.approx(a[k], abs=1e-6), k


def test_sharded_loading_with_lora_trains_as_one_process(runs):
    """--lora_rank=8 on a folder with safetensors weights: 2 processes add the adapters to the model on the meta
    device, shard it and read their own shards, their adapters the values one process's add_lora gives them;
    they train as 1 process that loads the model whole. No reference is built (the policy without adapters)."""
    p, out = runs
    assert "each process read its own shards" in out["lora_weights2"]
    assert "the whole model in each process" in out["lora_weights1"]
    assert "LoRA rank 8" in out["lora_weights2"] and "reference: the policy without adapters" in out["lora_weights2"]
    two = metrics(p["lora_weights2"])
    assert [m["step"] for m in two] == [1, 2]
    assert_trains_alike(p["lora_weights1"], p["lora_weights2"])
    assert two[1]["kl"] > 0  # the adapters moved the policy away from the base model, its reference
    reports = [json.load(open(os.path.join(p["lora_weights2"], f"after_rank{r}.json"))) for r in (0, 1)]
    assert all(r["sharded"] for r in reports)
    assert not reports[0]["policy_changed"]  # the base weights stay the files'


def test_sharded_loading_with_routing_replay_trains_as_one_process(runs):
    """--routing_replay on a Qwen3-MoE folder: 2 processes wrap the routers of the policy and of the reference on
    the meta device, shard both and read their own shards; each model records and replays for itself, and the
    run trains as 1 process that loads the model whole (the reference's routing differing from the sampled
    choice as often), with the sampler a step ahead (--max_staleness=1): 2 processes record on the model's own
    forward, 1 on the written-out decoder."""
    p, out = runs
    assert "each process read its own shards" in out["replay_weights2"]
    assert "the whole model in each process" in out["replay_weights1"]
    two = metrics(p["replay_weights2"])
    assert [m["step"] for m in two] == [1, 2]
    assert_trains_alike(p["replay_weights1"], p["replay_weights2"],
                        also=("routing_replay_differ", "routing_replay_differ_ref"))
    # step 2's rows were all sampled during step 1 by the first weights, which the reference still holds: it routes
    # them as the sampler did (near-ties aside), the policy a step on otherwise
    assert two[1]["kl"] > 0 and two[1]["staleness_mean"] == 1
    assert two[1]["routing_replay_differ_ref"] < 0.01 < two[1]["routing_replay_differ"]


# ----------------------------------------------------------------------------- several nodes (HSDP)
#
# Two torchrun agents on this machine, 2 processes each, form one run of 4 as two nodes would (c10d rendezvous on
# 127.0.0.1): with --replicas left at 0 the run holds one copy of the model per node, sharded over its 2
# processes (HSDP). The 1-process runs they are compared with are the module's own (A1, weights1, lora_weights1).

# each run on 2 x 2 (hO: the hW run with --cpu_offload) and the 1-process run it trains as
NODE_RUNS = {"hA": "A", "hW": "weights", "hL": "lora_weights", "hM": "mini", "hR": "replay_weights", "hO": "weights",
             "hT": "weights", "hC": "A"}  # hT: --tp_size=2, a node's group cut from its copy's shards; hC: the hA run
#                                         at --cp_size=4, each row's positions split over all 4 processes


@pytest.fixture(scope="module")
def nodes(runs, tmp_path_factory):
    p, _ = runs
    t = os.path.dirname(p["A1"])
    n = {k: str(tmp_path_factory.mktemp("nodes") / k) for k in (*NODE_RUNS, "hK", "hK1")}
    flags = {"hA": train_flags(n["hA"], 4), "hK": train_flags(n["hK"], 4),
             "hC": train_flags(n["hC"], 4) + ["--cp_size=4"],
             "hM": [f"--out_dir={n['hM']}", "--max_steps=3", *MINI_FLAGS, *FLAGS]}
    for name in ("hW", "hL", "hR", "hO", "hT"):
        flags[name] = [f"--out_dir={n[name]}", *checks(pathlib.Path(t))[NODE_RUNS[name]], *FLAGS]
    flags["hO"].append("--cpu_offload")
    flags["hT"].append("--tp_size=2")
    for f in flags.values():  # as the README's command for several nodes has it
        f.append("--nodes=2")
    out = launch_nodes([flags[k] for k in NODE_RUNS] + [flags["hK"] + ["--pause_after_step=3"]], t, "nodes1",
                       kill_when_paused=n["hK"])
    killed_at = [m["step"] for m in metrics(n["hK"])]
    shutil.copytree(n["hK"], n["hK1"])
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # the same command on both agents again; the copy resumed by one process (a flat mesh of another size)
        again = pool.submit(launch_nodes, [flags["hK"]], t, "nodes2")
        flat = pool.submit(launch_runs, [train_flags(n["hK1"], 4)], 1, t, "nodes_flat")
        resumed = {**again.result(), **flat.result()}
    return n, out, killed_at, resumed


def test_two_agents_form_one_run_of_a_replica_per_node(runs, nodes):
    """2 nodes of 2 processes (two agents) hold one copy of the model per node, sharded over its 2 processes; they
    train as one process does: the same completions and rewards, loss and gradient norm within 1e-4 relative,
    with the reference model, reading their own shards of a folder (with --cpu_offload too, and decoding in
    tensor-parallel groups of a node's 2 processes, their slices cut from their copy's shards), with LoRA, with
    routing replay on a MoE folder, with mini-batches and a synced reference, and with each row's positions split over
    the 4 (--cp_size=4); the export is the trained weights, gathered from the first copy's shards."""
    p, _ = runs
    n, out, _, _ = nodes
    assert "x 4 process(es) as 2 replicas x 2 shards, one replica per node" in out
    for two, check in NODE_RUNS.items():
        assert_trains_alike(p[f"{check}1"], n[two])
        assert [m["step"] for m in metrics(n[two])] == [m["step"] for m in metrics(p[f"{check}1"])]
        reports = [json.load(open(os.path.join(n[two], f"after_rank{r}.json"))) for r in range(4)]
        assert all(r["sharded"] for r in reports), two
        if check != "lora_weights":  # (the adapters are merged into the export: it is not the trained tensors)
            assert reports[0]["export_differs"] is None and reports[0]["policy_changed"]
    assert "each process read its own shards" in out.split(n["hW"])[1].split("=== run")[0]
    # mini-batches of several micro-batches: one exchange between the nodes per optimizer step (3 steps x 2
    # mini-batches x 2 iterations), for each of the 3 FSDP groups, not one per micro-batch
    report = json.load(open(os.path.join(n["hM"], "after_rank0.json")))
    assert report["all_reduces_across_replicas"] == 3 * 2 * 2 * report["fsdp_groups"], report
    refs = [torch.load(os.path.join(d, "ref.pt")) for d in (p["mini1"], n["hM"])]  # the synced reference alike
    for k in refs[0]:
        torch.testing.assert_close(refs[1][k], refs[0][k], rtol=0, atol=1e-5, msg=k)
    assert metrics(n["hA"])[-1]["kl"] > 0 and metrics(n["hL"])[-1]["kl"] > 0
    assert_trains_alike(p["replay_weights1"], n["hR"], also=("routing_replay_differ", "routing_replay_differ_ref"))


def test_killed_agents_resume_exactly_on_any_mesh(nodes):
    """Both agents killed after step 3 (checkpoint at step 2) and started again with the same command: steps 3 and 4
    redone exactly as the run that was never stopped (every metric, every token, the exported weights). The same
    checkpoint resumed by one process trains on as the straight run within 1e-4."""
    n, out, killed_at, resumed = nodes
    assert killed_at == [1, 2]  # step 3 was never logged
    assert "resuming from" in resumed[n["hK"]] and "step_00000002" in resumed[n["hK"]].split("resuming from")[1]
    assert "saved by 4 process(es), now 1" in resumed[n["hK1"]]
    assert [m["step"] for m in metrics(n["hK"])] == [1, 2, 3, 4]
    assert_same_metrics(metrics(n["hA"]), metrics(n["hK"]))
    a = tokens(n["hA"])  # step 3 sampled before the kill, then again after it: the same both times
    assert tokens(n["hK"]) == [a[0], a[1], a[2], a[2], a[3]]
    wa, wb = exported_weights(n["hA"]), exported_weights(n["hK"])
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert_trains_alike(n["hA"], n["hK1"])


def test_an_agent_alone_stops(tmp_path):
    """A node whose partner never starts: its agent stops after the stated join timeout, naming the rendezvous.
    A node that rendezvoused on its own (a world of 1 node) where --nodes says 2: every process refuses in one
    line naming both numbers, before any model loads."""
    start = time.time()
    lone, = start_agents([os.path.join(ROOT, "train.py"), f"--out_dir={tmp_path / 'lone'}"], 2, 1, started=1,
                         join_timeout=5)
    said = lone.communicate(timeout=120)[0]
    assert lone.returncode != 0 and time.time() - start < 60 and "RendezvousTimeoutError" in said, said[-3000:]
    alone = launch_failing([os.path.join(ROOT, "train.py"), f"--out_dir={tmp_path / 'alone'}", "--nodes=2"], 2)
    assert "--nodes: torchrun formed a run of 1 node (2 processes, 2 on each)" in alone, alone[-3000:]
    assert "--nodes=2 asks for 2" in alone and "loading" not in alone
    assert not os.path.exists(tmp_path / "alone")


# ----------------------------------------------------------------------------- sequence parallelism


def test_sequence_parallel_groups_train_as_one_process(runs):
    """--cp_size=2: the two processes train their rows together, each computing half of every row's positions
    through the layers, and train as one process does: the same completions and rewards, loss, gradient norm and KL
    within 1e-4 relative; with the reference model, LoRA, token-budget micro-batches and activation checkpointing,
    GQA with fewer K/V heads than the group (Qwen3) and Llama on the written-out layers, and Qwen3-MoE on its own
    forward."""
    p, out = runs
    t = os.path.dirname(p["A1"])
    for name, (one, _) in sequence_parallel_runs(pathlib.Path(t), p).items():
        assert [m["step"] for m in metrics(p[name])] == [m["step"] for m in metrics(p[one])][:len(metrics(p[name]))]
        assert_trains_alike(p[one], p[name], also=("routing_replay_differ", "routing_replay_differ_ref")
                            if name == "cp_replay" else ())
        report = json.load(open(os.path.join(p[name], "after_rank0.json")))
        assert (report["written_out_layer_calls"] > 0) == (not name.startswith(("cp_moe", "cp_replay"))), name
    assert metrics(p["cpA"])[-1]["kl"] > 0 and metrics(p["cp_lora"])[-1]["kl"] > 0
    assert "training on written-out layers, each row's positions split over 2 ranks (--cp_size)" in out["cpA"]
