"""Every family researchers train, against the model's own forward.

For each tiny random model of tests/architectures.py (float32, norms and biases randomised): greedy tokens equal
`model.generate`'s; the sampler's log-probs (one turn, and several turns with answers of different lengths
appended, tokens sampled past a stop forgotten) and the training forward's equal one plain forward of the model
over each row's trajectory alone; each family takes the path docs/architectures.md's table claims for it. The sliding windows
(6 tokens) are short enough for these trajectories to cross them.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import architectures  # noqa: E402
import grpo  # noqa: E402
import logprobs  # noqa: E402
from layers import hf_decoder  # noqa: E402
import sampling  # noqa: E402
from features import sampler_options  # noqa: E402
from layers import transformer  # noqa: E402
from test_multiturn import answering  # noqa: E402

# the families the written-out layers (layers/transformer.py) serve in the sampler; the others run the model's own
# forward. MoE and hybrid families train on the model's own forward (its experts and recurrent kernels, routing
# replay's routers). Read off tests/architectures.py's table
FAST = set(architectures.WRITTEN_OUT)
FAST_TRAINING = set(architectures.TRAINED_WRITTEN_OUT)
STOPS = list(range(97, 105))  # a..h: rows pause at scattered positions
TEXT = ["a>", "hello world>", "xyz", "b>" * 7, "q", "the quick brown fox>"]


def plain_logprobs(model, enc, rollout):
    """Each policy token's log-prob from one forward of the model over its row's real tokens alone."""
    return sampling._plain_logprobs(model, enc.input_ids, enc.attention_mask, rollout)


def training_logprobs(model, enc, rollout, grad=False):
    ids = torch.cat([enc.input_ids, rollout.completion_ids], 1)
    mask = torch.cat([enc.attention_mask, rollout.completion_mask], 1)
    with torch.set_grad_enabled(grad):
        return logprobs.completion_logprobs(model, ids, mask, rollout.completion_ids.shape[1], 1.0)[0]


@pytest.fixture(scope="module", params=list(architectures.FAMILIES))
def family(request):
    model, tok = architectures.tiny(request.param)
    return request.param, model, tok, tok(TEXT, return_tensors="pt", padding=True, add_special_tokens=False)


def test_takes_the_path_claimed(family):
    name, model, _, _ = family
    assert transformer.decide(model).samples_written_out() == (name in FAST)
    assert transformer.decide(model).trains_written_out(model) == (name in FAST_TRAINING)
    assert hf_decoder.unsupported(model) is None


def test_greedy_tokens_equal_generate(family):
    _, model, tok, enc = family
    ours = sampler_options.sample(model, enc.input_ids, enc.attention_mask, max_new_tokens=12, eos_ids=[],
                           pad_id=tok.pad_token_id, temperature=0)
    with torch.no_grad():
        ref = model.generate(**enc, max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=tok.pad_token_id)[:, enc.input_ids.shape[1]:]
    assert torch.equal(ours.completion_ids, ref)


def test_one_turn_logprobs_equal_the_model_forward(family):
    _, model, tok, enc = family
    r = sampler_options.sample(model, enc.input_ids, enc.attention_mask, max_new_tokens=20, eos_ids=STOPS,
                        pad_id=tok.pad_token_id, seeds=torch.arange(6) * 7 + 3)
    pol = r.policy_mask.bool()
    assert r.completion_mask.sum(1).unique().numel() > 1  # rows stopped at different lengths
    want = plain_logprobs(model, enc, r)
    assert (r.logprobs - want)[pol].abs().max() < 1e-4
    assert (training_logprobs(model, enc, r) - want)[pol].abs().max() < 1e-4


def test_several_turns_equal_one_forward_over_the_trajectory(family):
    """Rows pause at a stop, forget what they sampled past it, take answers of different lengths and resume."""
    _, model, tok, enc = family
    r = sampler_options.sample(model, enc.input_ids, enc.attention_mask, max_new_tokens=40, eos_ids=STOPS,
                        pad_id=tok.pad_token_id, seeds=torch.arange(6) * 7 + 3, max_turns=3, check_every=4,
                        respond=answering(lambda row, k: (row % 3) + 2 * k))
    pol = r.policy_mask.bool()
    assert (r.turns > 1).any() and r.turns.unique().numel() > 1 and (r.completion_mask.sum(1) > 12).any()
    want = plain_logprobs(model, enc, r)
    assert (r.logprobs - want)[pol].abs().max() < 1e-4
    assert (training_logprobs(model, enc, r) - want)[pol].abs().max() < 1e-4


def test_start_up_check_passes(family):
    _, model, _, _ = family
    assert sampling.check_exact(model) is None


def test_softcapped_head_gradient_equals_autograd():
    """Gemma 2's final-logit softcap in the chunked head: values and gradients equal autograd through the
    model's own logits, over several chunks and at a temperature."""
    model, tok = architectures.tiny("gemma2")
    assert logprobs.head_of(model).softcap
    enc = tok(TEXT, return_tensors="pt", padding=True, add_special_tokens=False)
    comp = torch.randint(0, 256, (6, 7), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([enc.input_ids, comp], 1)
    mask = torch.cat([enc.attention_mask, torch.ones_like(comp)], 1)
    weights = torch.randn(6, 7, generator=torch.Generator().manual_seed(1))
    params = [p for p in model.parameters()]

    logp, _ = logprobs.completion_logprobs(model, ids, mask, 7, temperature=0.7, chunk_tokens=5)
    ours = torch.autograd.grad((logp * weights).sum(), params)
    logits = model(input_ids=ids, attention_mask=mask,
                   position_ids=logprobs.position_ids_from_mask(mask)).logits[:, -8:-1].float() / 0.7
    ref_logp = torch.log_softmax(logits, -1).gather(-1, comp[..., None])[..., 0]
    ref = torch.autograd.grad((ref_logp * weights).sum(), params)
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-5 * (1 + b.abs().max().item()), rtol=1e-4)


def test_start_up_check_catches_a_wrong_path(monkeypatch):
    """A path that leaves out what the model does (here the softcap, or the sliding window) is caught."""
    architectures.force_model_forward(monkeypatch)  # the general path, whatever the family
    model, _ = architectures.tiny("gemma2")
    with monkeypatch.context() as m:
        m.setattr(logprobs, "head_of", lambda model: None)
        assert "training forward" in sampling.check_exact(model)
    model, _ = architectures.tiny("gemma3")
    assert sampling.check_exact(model) is None
    monkeypatch.setattr(hf_decoder.HFDecoder, "_masks", lambda self, v, p: {k: None for k in self.kinds})
    assert "sampler" in sampling.check_exact(model)


def test_what_the_general_path_cannot_express_is_refused(monkeypatch):
    architectures.force_model_forward(monkeypatch)
    model, _ = architectures.tiny("qwen3")
    model.config.__dict__["_attn_implementation_internal"] = "flash_attention_2"  # the setter would load kernels
    assert "attn_implementation=flash_attention_2" in sampling.check_exact(model)
    model, _ = architectures.tiny("qwen3")
    model.config.layer_types = ["chunked_attention"] * 2
    assert "chunked_attention" in sampling.check_exact(model)


def test_train_stops_at_start_naming_the_architecture(tmp_path, monkeypatch):
    """train.py runs the start-up check before any step: a model it refuses stops the run in one line that names
    the model's class and why, and --check_model=false lets the run go on."""
    import model_loading
    import train

    tok = model_loading.build_byte_tokenizer()
    architectures.config("gemma2", tok).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    architectures.force_model_forward(monkeypatch)  # the general path, which refuses
    monkeypatch.setattr(hf_decoder, "unsupported", lambda model: "layers of type 'made_up'")
    argv = [f"--model={tmp_path / 'model'}", "--max_steps=1", "--save_every=0", "--model_init_kwargs",
            '{"attn_implementation": "eager"}']
    with pytest.raises(SystemExit, match=r"model: Gemma2ForCausalLM: the sampler cannot reproduce layers of type "
                                         r"'made_up'\. This architecture cannot be trained exactly here"):
        train.main([*argv, f"--out_dir={tmp_path / 'a'}"])
    assert not (tmp_path / "a" / "metrics.jsonl").exists()
    train.main([*argv, f"--out_dir={tmp_path / 'b'}", "--check_model=false"])
    assert (tmp_path / "b" / "metrics.jsonl").exists()


def _saved(tmp_path, name, cfg_class, **settings):
    """A folder with a tiny config of `cfg_class` (no weights) and the byte tokenizer, as --model takes it."""
    import transformers

    import model_loading
    tok = model_loading.build_byte_tokenizer()
    path = tmp_path / name
    cfg = getattr(transformers, cfg_class)(vocab_size=len(tok), pad_token_id=tok.pad_token_id, **settings)
    cfg.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _one_line_exit(argv):
    import train

    with pytest.raises(SystemExit) as e:
        train.main(argv)
    assert isinstance(e.value.code, str) and "\n" not in e.value.code, e.value.code
    return e.value.code


def test_an_encoder_is_refused_at_load_as_not_a_causal_language_model(tmp_path):
    """BERT loads with AutoModelForCausalLM but attends both ways unless its config says is_decoder: refused when
    it loads, with the start-up check or without, not by a log-prob difference. An encoder-decoder too."""
    import model_loading

    bert = _saved(tmp_path, "bert", "BertConfig", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=64, max_position_embeddings=64)
    for check in ("true", "false"):
        said = _one_line_exit([f"--model={bert}", f"--out_dir={tmp_path / check}", "--max_steps=1",
                               f"--check_model={check}"])
        assert said == (f"model: '{bert}': Bert is not a causal language model: an encoder's tokens attend to the "
                        f"tokens after them too (config.is_decoder is false)")
    t5 = _saved(tmp_path, "t5", "T5Config", d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16)
    with pytest.raises(ValueError, match=r"T5 is not a causal language model: an encoder-decoder model"):
        model_loading.load_model(t5)


def test_layers_without_a_mask_rule_stop_the_run_also_with_the_check_off(tmp_path):
    """Falcon-H1's 'hybrid' layers (attention and Mamba side by side) have no mask rule in layers/hf_decoder.py:
    with --check_model=false the run still stops at start in one line, and the sampler itself raises the same
    reason rather than the model's forward failing to find its mask."""
    import model_loading

    falcon = _saved(tmp_path, "falcon", "FalconH1Config", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16, mamba_d_ssm=32, mamba_n_heads=4,
                    mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16,
                    max_position_embeddings=64)
    said = _one_line_exit([f"--model={falcon}", f"--out_dir={tmp_path / 'out'}", "--max_steps=1",
                           "--check_model=false"])
    assert said.startswith("model: FalconH1ForCausalLM: the sampler cannot reproduce layers of type 'hybrid'")
    model = model_loading.load_model(falcon).eval()
    ids, mask = torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"^FalconH1ForCausalLM: the sampler cannot reproduce layers of type "
                                         r"'hybrid'$"):
        sampler_options.sample(model, ids, mask, max_new_tokens=2, eos_ids=[0], pad_id=0)


def test_tool_run_with_adapters_keeps_sampler_and_trainer_in_agreement(tmp_path, capsys, monkeypatch):
    """train.py --model=DIR on the vault task (tool calls, results appended mid-turn) with LoRA's default targets:
    the banner names the paths and what LoRA adapted, and on every step the sampler's log-probs (written-out
    layers, adapters merged in) equal the training forward's (the model's own, adapters apart) to float32 noise,
    on the hybrid family (recurrent states that must not absorb what a row forgot). A turn ends at any of the letters a-h and calls the tool, so that the
    random model's rows take several turns."""
    import json

    import environments
    import model_loading
    import train
    from tasks import vault

    agent_init = environments.Agent.__init__

    def pausing(self, *args, **kwargs):
        agent_init(self, *args, **kwargs)
        self.stop_sequences = [[t] for t in range(97, 105)]
    monkeypatch.setattr(environments.Agent, "__init__", pausing)
    monkeypatch.setattr(environments, "parse_calls", lambda text: [("", {})])

    tok = model_loading.build_byte_tokenizer(vault.TINY_TOOL_TOKENS)
    tok.chat_template = vault.TINY_TOOL_TEMPLATE
    architectures.config("qwen3_5", tok).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    out = tmp_path / "out"
    train.main([f"--model={tmp_path / 'model'}", "--task=vault", "--lora_rank=4", "--lr=1e-2", "--max_steps=2",
                "--save_every=0", "--print_completions_every=0", f"--out_dir={out}"])
    said = capsys.readouterr().out
    assert "paths: sampler on written-out layers, training on the model's own forward" in said
    assert "LoRA rank 4 on " in said and "in_proj_qkv x3" in said and "q_proj x1" in said
    steps = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [s["step"] for s in steps] == [1, 2] and max(s["turns_max"] for s in steps) > 1
    assert all(s["sampler_logprob_diff_max"] < 1e-4 for s in steps), [s["sampler_logprob_diff_max"] for s in steps]
