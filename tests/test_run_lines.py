"""What a run says of itself is true to its settings: a --tp_size it cannot take stops in one line naming what is
missing (before any weight is read, for a family the sampler cannot split), the banner names the reference and the
paths as the settings make them, and the step line shows where a long or uneven step's time went. Unit calls only:
no launch, no training."""

import types

import pytest
import torch

import architectures
import config
import model_loading
from layers import transformer
import sharding
from runs import log as run_log
from runs import setup
from runs.cli import ConfigError

ONE = sharding.Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def _code(cfg, world):
    with pytest.raises(ConfigError) as e:
        config.validate(cfg, world)
    return e.value.code


def test_tp_size_on_one_process_says_it_needs_torchrun():
    assert _code(config.Config(tp_size=2), 1) == ("config error: --tp_size: a group of 2 needs torchrun with a "
                                                  "multiple of 2 processes; this is one process")


def test_tp_size_that_does_not_divide_the_processes_names_those_that_do():
    assert _code(config.Config(tp_size=3), 4) == ("config error: --tp_size: groups of 3 need a multiple of 3 "
                                                  "processes, and there are 4 (1, 2 or 4 divides them)")


def test_streaming_settings_that_would_do_nothing_stop_in_one_line():
    """Under streaming the rows decoding at once are the stream's places: --generation_batch_size would be ignored,
    places past the rows a process ever holds would be KV cache no row uses, and checkpoints at every step drain
    the stream before any row decodes ahead. Each stops naming the setting, what it meets and what to use; the
    largest number of places that has a use passes."""
    rows = dict(prompts_per_step=8, num_generations=8)  # 64 rows a step; 32 on each of 2 processes
    assert _code(config.Config(**rows, generation_batch_size=8, rollouts_in_flight=4), 1) == (
        "config error: --generation_batch_size: has no effect with --rollouts_in_flight: a stream's rows decode in "
        "its places, not in batches; --rollouts_in_flight=8 bounds the rows decoding at once")
    assert _code(config.Config(**rows, generation_batch_size=8, max_staleness=1), 1).startswith(
        "config error: --generation_batch_size: has no effect with --max_staleness")
    assert _code(config.Config(**rows, rollouts_in_flight=1000), 2) == (
        "config error: --rollouts_in_flight: 1000 places for the 32 rows each process decodes at most at once (32 a "
        "step): the rest would hold KV cache no row uses; at most 32")
    assert "(32 a step x 3 steps)" in _code(config.Config(**rows, rollouts_in_flight=97, max_staleness=2), 2)
    config.validate(config.Config(**rows, rollouts_in_flight=96, max_staleness=2), 2)
    config.validate(config.Config(**rows, rollouts_in_flight=32), 2)
    assert _code(config.Config(max_staleness=1, save_every=1, max_steps=5), 1).startswith(
        "config error: --max_staleness: has no effect with --save_every=1")
    config.validate(config.Config(max_staleness=1, save_every=2, max_steps=5), 1)


def _folder(tmp_path, family):
    """A model folder of the tests' `family` whose weights file is garbage: reading it would fail."""
    tok = model_loading.build_byte_tokenizer()
    architectures.config(family, tok).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a weights file")
    return str(tmp_path)


def test_a_family_tensor_parallel_decoding_does_not_cover_stops_before_loading(tmp_path, capsys):
    """OLMo 3 at --tp_size=2: one line naming the family and the reason and that --tp_size=1 runs it, before the
    loading line and any weight (the weights file here cannot be read); no blame of the architecture."""
    cfg = config.Config(model=_folder(tmp_path, "olmo3"), tp_size=2, out_dir=str(tmp_path / "out"))
    with pytest.raises(ConfigError) as e:
        setup.load_models(cfg, ONE, "cpu")
    assert e.value.code == ("config error: --tp_size: tensor-parallel decoding does not run Olmo3ForCausalLM at "
                            "--tp_size=2 (Olmo3DecoderLayer: q and k norms over the whole projection, which a rank "
                            "holding some heads cannot compute); --tp_size=1 runs it")
    assert "loading" not in capsys.readouterr().out


def test_a_family_it_covers_passes_the_check(tmp_path):
    setup.check_tp_size(config.Config(tp_size=2), _folder(tmp_path, "qwen3"))


@pytest.fixture(scope="module")
def moe():
    model, _ = architectures.tiny("qwen3_moe")
    return model


def _banner(model, **settings):
    run = types.SimpleNamespace(
        cfg=config.Config(**settings), d=ONE, policy=types.SimpleNamespace(lm=model), weights=[1.0],
        task=types.SimpleNamespace(rows=None, reward_funcs=[run_log.count]), paths=transformer.decide(model).banner())
    return run_log.banner(run, {"path": None}).splitlines()


def test_a_moe_banner_names_routing_replay_only_when_it_is_on(moe):
    paths = next(line for line in _banner(moe) if line.startswith("paths: "))
    assert paths == ("paths: sampler on written-out layers, training on the model's own forward (MoE blocks, which "
                     "train on the model's own expert kernels and routers)"), paths
    paths = next(line for line in _banner(moe, routing_replay=True) if line.startswith("paths: "))
    assert paths.endswith("expert kernels and routers) | routing replay"), paths


def test_the_banner_says_a_bf16_reference_is_one(moe):
    said = next(line for line in _banner(moe, ref_bf16=True) if line.startswith("model "))
    assert said.endswith("reference: frozen copy in bfloat16 (--ref_bf16)"), said
    said = next(line for line in _banner(moe) if line.startswith("model "))
    assert said.endswith("reference: frozen copy"), said


def test_a_long_uneven_step_shows_where_its_time_went():
    """The slow reward's step: 256-token completions, some stopping early, 46% cut at the limit; the default
    run's short, even steps keep their line within 120 columns (most completions cut is said once, in a note
    under the line: `test_most_completions_cut_is_said_once`). A streaming step adds its wait, busy places and
    the tokens' mean age."""
    long = dict(step_time=12.4, generation_time=7.9, reward_time=2.1, update_time=2.3, truncated_frac=0.46,
                completion_length=180.0, completion_length_max=256.0)
    assert run_log.step_time(long) == ["12.40s (generation 7.90s, rewards 2.10s, update 2.30s)", "truncated 46%"]
    uneven = dict(long, step_time=1.2)
    assert run_log.step_time(uneven)[1] == "truncated 46%"
    default = dict(step_time=0.08, generation_time=0.02, reward_time=0.001, update_time=0.06, truncated_frac=0.99,
                   completion_length=3.98, completion_length_max=4.0)
    assert run_log.step_time(default) == ["0.08s"]
    streamed = dict(default, generation_wait_s=0.031, slots_busy=0.734, staleness_mean=0.42)
    assert run_log.step_time(streamed) == ["0.08s", "wait 0.03s", "busy 73%", "stale 0.42"]


def test_most_completions_cut_is_said_once(tmp_path):
    """A short, even step 59% cut at the limit: a note under its line says so, the first time only (the masked
    variant's note says it instead where mask_truncated_completions is on); 40% cut says nothing."""
    logger = run_log.Logger(config.Config(out_dir=str(tmp_path / "a")), master=False)
    logger.mask_truncated, logger.said = False, set()
    assert logger.notes(dict(truncated_frac=0.4)) == []
    said = logger.notes(dict(truncated_frac=0.59))
    assert len(said) == 1 and said[0].startswith("59% of completions were cut at max_completion_length")
    assert logger.notes(dict(truncated_frac=0.9)) == []
    logger.mask_truncated, logger.said = True, set()
    said = logger.notes(dict(truncated_frac=0.59))
    assert len(said) == 1 and "mask_truncated_completions" in said[0]


def test_a_reward_function_named_as_a_total_keeps_its_own_dashboard_key():
    """A reward function named `reward` or `reward_std` (its metric reward/reward, reward/reward_std) would land on
    the totals' wandb keys: it gets one of its own, and every key stays distinct."""
    keys = ["reward", "reward_std", "reward/reward", "reward/reward_std", "reward/next_letter_reward",
            "reward_std/reward", "kl", "step_time"]
    mapped = [run_log.wandb_key(k) for k in keys]
    assert len(set(mapped)) == len(keys), mapped
    assert mapped[:2] == ["reward/reward", "reward/reward_std"]
    assert mapped[4] == "reward/next_letter_reward" and mapped[5] == "reward/std/reward"


def test_a_settings_first_word_is_pointed_to_its_setting():
    from runs import cli
    assert cli.unknown_key("wandb", config.Config.__dataclass_fields__).startswith(
        "unknown key; did you mean --wandb_mode or --wandb_project or --wandb_run_name?")


def test_the_step_metrics_each_functions_spread_ended_lengths_and_clip_region():
    """step_metrics against the batch written out: each reward function's std over the completions it scored (NaN
    for one it skipped), the lengths of the completions that ended on their own (the cut ones left out), and the
    share of tokens clipped on either side."""
    import rollouts
    lengths = [3, 5, 8, 8, 2, 8]
    truncated = torch.tensor([False, False, True, True, False, True])
    mask = (torch.arange(8)[None] < torch.tensor(lengths)[:, None]).long()
    rollout = rollouts.Rollout(completion_ids=mask * 7, completion_mask=mask, policy_mask=mask, truncated=truncated,
                               logprobs=torch.zeros(6, 8), turns=torch.ones(6, dtype=torch.long))
    batch = types.SimpleNamespace(prompt_mask=torch.ones(6, 2), rollout=rollout, episodes=None)
    run = types.SimpleNamespace(d=ONE, cfg=config.Config(num_generations=3), update_metrics=[])
    first, second = torch.tensor([1.0, 0.0, 0.5, 0.5, 1.0, 0.0]), torch.tensor([0.2, float("nan"), 0.4, 1.0, 0.0, 0.0])
    sums = {"loss": 1.0, "kl": 0.0, "clip_low": 3.0, "clip_high": 5.0, "entropy": 0.0, "tokens": 34.0,
            "is_weight": 0.0, "lp_diff_sum": 0.0, "lp_diff_tokens": 1.0, "max/lp_diff": 0.0}
    total = first + 0.1 * second.nan_to_num()
    m = run_log.step_metrics(run, batch, sums, total, {"first": first, "second": second}, total - 0.5,
                             torch.tensor([0.3, 0.1]))
    assert m["reward_std/first"] == pytest.approx(float(torch.tensor(first.tolist()).std()))
    assert m["reward_std/second"] == pytest.approx(float(torch.tensor([0.2, 0.4, 1.0, 0.0, 0.0]).std()))
    assert (m["completion_length_ended"], m["completion_length_ended_min"], m["completion_length_ended_max"]) == (
        pytest.approx(10 / 3), 2, 5)
    assert m["clip_region"] == pytest.approx(8 / 34)
    m = run_log.step_metrics(run, dataclass_replace(batch, truncated=torch.ones(6, dtype=torch.bool)), sums, total,
                             {"first": first}, total - 0.5, torch.tensor([0.3, 0.1]))
    assert "completion_length_ended" not in m  # every completion cut: no ended length to show
    # with importance sampling: the weights' mean over the counted tokens, their smallest (kept negated, as a
    # maximum) and largest, from the variant's own metrics; none of the "max/" keys is a metric
    import train
    sums.update({"is_weight": 37.4, "max/-is_weight": -0.5, "max/is_weight": 2.0, "max/lp_diff": 0.25})
    run.update_metrics = [train.WeightedOldLogprobs.metrics]
    m = run_log.step_metrics(run, batch, sums, total, {"first": first}, total - 0.5, torch.tensor([0.3, 0.1]))
    assert (m["is_weight"], m["is_weight_min"], m["is_weight_max"]) == (pytest.approx(1.1), 0.5, 2.0)
    assert m["sampler_logprob_diff_max"] == 0.25 and not any(k.startswith("max/") for k in m)


def dataclass_replace(batch, **fields):
    import dataclasses
    return types.SimpleNamespace(**{**vars(batch), "rollout": dataclasses.replace(batch.rollout, **fields)})


def test_the_mismatch_warning_reads_each_metric_on_its_own_side(tmp_path):
    """ess warns below its threshold, ppl_ratio where it lies farther than its threshold from 1 (either side), the
    others where their magnitude passes it; a step without the metric (no fresh token) warns of nothing."""
    cfg = config.Config(out_dir=str(tmp_path), mismatch_warn={"ess": 0.5, "ppl_ratio": 0.1, "log_ratio": 0.1})
    logger = run_log.Logger(cfg, master=False)
    quiet = {"mismatch/ess": 0.9, "mismatch/ppl_ratio": 0.95, "mismatch/log_ratio": -0.05}
    assert logger.mismatched(quiet) == [] and logger.mismatched({}) == []
    loud = {"mismatch/ess": 0.2, "mismatch/ppl_ratio": 0.8, "mismatch/log_ratio": -0.2}
    assert [k for k, _, _ in logger.mismatched(loud)] == ["ess", "ppl_ratio", "log_ratio"]
    assert [k for k, _, _ in logger.mismatched({"mismatch/ppl_ratio": 1.2})] == ["ppl_ratio"]


def test_a_mesh_the_processes_cannot_form_stops_in_one_line(monkeypatch):
    """Several nodes: a node that rendezvoused alone where --nodes says more refuses, naming both numbers and where
    it rendezvoused; a tensor-parallel group cannot span nodes or replicas; replicas must split the processes."""
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ConfigError) as e:
        config.validate(config.Config(nodes=4), 8, 8)
    assert e.value.code.startswith("config error: --nodes: torchrun formed a run of 1 node (8 processes, 8 on each) "
                                   "at 10.0.0.1:29500, and --nodes=4 asks for 4")
    with pytest.raises(ConfigError) as e:
        config.validate(config.Config(tp_size=16), 32, 8)
    assert "--tp_size: a group of 16 would span nodes: a node runs 8 processes" in e.value.code
    assert e.value.code.endswith("at most 8, and a size that divides it")
    with pytest.raises(ConfigError) as e:
        config.validate(config.Config(tp_size=4, prompts_per_step=12), 12, 6)  # divides the 12 processes, not 6
    assert "--tp_size: a group of 4 would span nodes: a node runs 6 processes" in e.value.code
    assert _code(config.Config(replicas=3), 8) == ("config error: --replicas: 3 copies of the model do not split the "
                                                   "8 processes evenly")
    assert "--tp_size: a group of 4 would span two of the 4 copies of 2 processes" in _code(
        config.Config(replicas=4, tp_size=4), 8)
    config.validate(config.Config(nodes=4, tp_size=8, replicas=4), 32, 8)  # a group a node, a copy a node


def test_the_banner_names_the_mesh():
    """Flat on one node says nothing more; several nodes or copies say how the processes hold the model."""
    def mesh(world, replicas, nodes):
        return sharding.Dist(0, 0, world, torch.device("cpu"), replicas=replicas, nodes=nodes).describe()
    assert mesh(32, 4, 4) == "4 replicas x 8 shards, one replica per node"
    assert mesh(32, 1, 4) == "32 shards over 4 nodes"
    assert mesh(8, 2, 1) == "2 replicas x 4 shards"
