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
    run's short, even steps keep their line."""
    long = dict(step_time=12.4, generation_time=7.9, reward_time=2.1, update_time=2.3, truncated_frac=0.46,
                completion_length=180.0, completion_length_max=256.0)
    assert run_log.step_time(long) == ["12.40s (generation 7.90s, rewards 2.10s, update 2.30s)", "truncated 46%"]
    uneven = dict(long, step_time=1.2)
    assert run_log.step_time(uneven)[1] == "truncated 46%"
    default = dict(step_time=0.08, generation_time=0.02, reward_time=0.001, update_time=0.06, truncated_frac=0.99,
                   completion_length=3.98, completion_length_max=4.0)
    assert run_log.step_time(default) == ["0.08s"]
