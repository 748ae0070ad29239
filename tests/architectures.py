"""The family table of the tests: one row per architecture researchers train, built from configs (no download).

A row is the config class's name in transformers and the few settings that make it small but keep what is
particular to it (sliding windows short enough for a few dozen tokens to cross them, linear-attention layers beside
full ones, experts, sinks, softcapped logits), with weights large enough that attention is sharp and every feature
moves the log-probs (initializer_range, caps that bite); which of our paths it takes; and its `features`: the
departures from Llama its `Family` row in layers/transformer.py declares, each switched off in turn by
test_static_families.py's knockout test (`KNOCKOUTS` says how). Every list of families the tests run derives from
this table. `tiny(name)` builds the model in float32 with its norms, biases and other one-dimensional parameters
randomised, so that a path that forgets one of them (a norm's offset, a bias, a sink, the decay of a recurrent
layer) shows.

Adding a family: a `Family` row in layers/transformer.py's `FAMILIES` and a row here (docs/architectures.md).
"""

import dataclasses

import torch

import model_loading

# initializer_range 0.1, five times transformers' default: attention sharp enough that what it computes shows (with
# 0.02 it is nearly uniform, and a 25% wrong scale moves log-probs by less than 1e-4)
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, tie_word_embeddings=False, head_dim=16, initializer_range=0.1)


@dataclasses.dataclass(frozen=True)
class Row:
    """One family in the tests: its tiny model's config, the paths it takes, the features it declares."""
    config: str                 # the config class in transformers
    settings: dict              # over COMMON
    layers: str = "dense"       # "dense", "moe" (MoE blocks) or "hybrid" (recurrent layers beside attention): the
                                # written-out sampler reads all three; MoE and hybrid layers train on the model's own
                                # forward (its expert and recurrent kernels)
    written_out: bool = True    # the sampler (and, dense, the training forward) on layers/transformer.py's layers
    features: tuple = ()        # the Family's declared differences, keys of KNOCKOUTS
                                # (test_static_families.py's test_each_declared_feature_matters)
    attention: str = "sdpa"     # attn_implementation of the model's own forward (eager where sdpa lacks a feature)
    lora: bool = False          # tested with LoRA adapters on every linear layer (tests/test_lora_families.py)
    adapted: tuple = ()         # the family's particular modules of layer 0 LoRA's default targets must reach
    tp: dict = None             # in the tensor-parallel launch (tests/tp_decode.py): settings over `settings` at which
                                # its sizes divide by 4; None: not there (a launch of 4 processes costs its time)
    tp_kv_copies: bool = False  # there also with fewer K/V heads than ranks (each copied over ranks)


def _spec_knockout(edit):
    """A knockout that changes what transformer._spec reads from the model: edit(read, model) -> the Spec, where
    read(model, fam=None) is the unchanged reading."""
    def knock(monkeypatch):
        from layers import transformer
        read = transformer._spec
        monkeypatch.setattr(transformer, "_spec", lambda model, fam=None: edit(read, model))
    return knock


def _family(**off):
    """Fields of the model's `Family` row set to Llama's values: the model read as if its row did not declare them."""
    return _family_as(lambda fam: dataclasses.replace(fam, **off))


def _family_as(change):
    return _spec_knockout(lambda read, model: read(model, change(read(model).fam)))


def _layers(**off):
    """Settings of every attention layer (transformer.Spec.layers) set to Llama's values (or a function of them)."""
    def edit(read, model):
        spec = read(model)
        spec.layers = [dataclasses.replace(s, **{k: v(s) if callable(v) else v for k, v in off.items()}) if s.heads
                       else s for s in spec.layers]
        return spec
    return _spec_knockout(edit)


def _model(**off):
    """Fields of the model's Spec (its embedding's scale, its logits' transform) set to Llama's values."""
    return _spec_knockout(lambda read, model: dataclasses.replace(read(model), **off))


def _final_softcap(monkeypatch):
    """Neither the sampler's logits nor the training head's capped."""
    import logprobs
    _model(head=None)(monkeypatch)
    monkeypatch.setattr(logprobs, "head_of", lambda model: None)


def _full_width_rotary(monkeypatch):
    """Rotary over the whole head instead of its first dims: the tables (rd wide) padded to the head, cos 1 and sin
    0 past each half's rd / 2 frequencies, so rotate_half pairs dim i with i + head_dim / 2 instead of i + rd / 2."""
    from layers import transformer
    rotary = transformer._rotary

    def full(rotary_emb, fam, x, positions, key):
        cos, sin = rotary(rotary_emb, fam, x, positions, key)
        half, pad = cos.shape[-1] // 2, rotary_emb.config.head_dim // 2 - cos.shape[-1] // 2
        one, zero = torch.ones(*cos.shape[:-1], pad, dtype=cos.dtype), torch.zeros(*cos.shape[:-1], pad, dtype=sin.dtype)
        return (torch.cat([cos[..., :half], one, cos[..., half:], one], -1),
                torch.cat([sin[..., :half], zero, sin[..., half:], zero], -1))
    monkeypatch.setattr(transformer, "_rotary", full)


# how each declared difference is switched off: a function of pytest's monkeypatch that makes the written-out layers
# compute the model as if the family did not have it (the norms' float32 scaling, `upcast`, is left out: in float32
# it changes nothing; test_norms_round_as_the_family_does checks it bit for bit in bf16. So are gpt-oss's half-width
# rotary tables: without them the shapes do not fit)
KNOCKOUTS = {
    "attention scale": _layers(scaling=lambda s: 1.25 * s.scaling),  # not switched off: 25% wrong
    "attention softcap": _layers(softcap=None),
    "window": _layers(window=None),
    "full layers unwindowed": _family(window=None),              # every layer's module's sliding_window applied
    "qk norm": _family(qk_norm=None),
    "norm offset": _family(unit_offset=False),                   # weight, not 1 + weight
    "post norms": _family_as(lambda fam: dataclasses.replace(fam, norms=(fam.norms[0], None, fam.norms[2], None))),
    "embedding scale": _model(embed_scale=None),
    "final softcap": _final_softcap,
    "rotary per type": _layers(rope=lambda s: s.rope and "full_attention"),  # one table for every layer
    "layers without rotary": _family(rotary_on=None),            # rotary on every layer
    "partial rotary": _full_width_rotary,
    "sinks": _family(sinks=False),
    "gated query": _layers(gated=False),
}

_SCALE = "attention scale"
# family -> its row
FAMILIES = {
    "llama": Row("LlamaConfig", dict(attention_bias=True, mlp_bias=True), features=(_SCALE,), lora=True, tp={}),
    "qwen2": Row("Qwen2Config", dict(tie_word_embeddings=True), features=(_SCALE,)),
    "qwen2_window": Row("Qwen2Config", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1),
                        features=(_SCALE, "window")),  # a window on one of two layers
    "mistral": Row("MistralConfig", dict(sliding_window=None), features=(_SCALE,)),
    "mistral_window": Row("MistralConfig", dict(sliding_window=6), features=(_SCALE, "window")),  # every layer
    "qwen3": Row("Qwen3Config", dict(), features=(_SCALE, "qk norm"), lora=True, tp={}),
    "qwen3_moe": Row("Qwen3MoeConfig", dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                            norm_topk_prob=True, decoder_sparse_step=1),
                     layers="moe", features=(_SCALE, "qk norm"), lora=True,
                     adapted=("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "self_attn.q_proj"), tp={}),
    "qwen3_moe_dense_layer": Row("Qwen3MoeConfig", dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                                        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1]),
                                 layers="moe", features=(_SCALE, "qk norm")),  # a dense MLP beside a MoE block
    # Qwen2's attention (biased q/k/v), a shared expert beside the routed ones
    "qwen2_moe": Row("Qwen2MoeConfig", dict(moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                                            decoder_sparse_step=1), layers="moe", features=(_SCALE,), lora=True),
    # three Gated DeltaNet layers (layers/static_recurrent.py) and one gated attention layer with partial rotary
    "qwen3_5": Row("Qwen3_5TextConfig", dict(num_hidden_layers=4, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                                             linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                             layer_types=["linear_attention"] * 3 + ["full_attention"]),
                   layers="hybrid", features=(_SCALE, "qk norm", "norm offset", "partial rotary", "gated query"),
                   lora=True, adapted=("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_a",
                                       "linear_attn.in_proj_b", "linear_attn.out_proj", "mlp.down_proj"),
                   tp=dict(linear_num_key_heads=4, linear_num_value_heads=8), tp_kv_copies=True),
    # sliding window 6 on one of two layers, sinks, biased q/k/v/o, yarn rotary, a biased router, clamped SwiGLU
    "gpt_oss": Row("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                                        layer_types=["sliding_attention", "full_attention"], intermediate_size=32),
                   layers="moe", features=(_SCALE, "window", "sinks"), attention="eager", lora=True,
                   adapted=("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "self_attn.o_proj"), tp={}),
    # sliding window 6 on two of its three layers, another rotary base there
    "gemma3": Row("Gemma3TextConfig", dict(num_hidden_layers=3, sliding_window=6, query_pre_attn_scalar=16,
                                           layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
                  features=(_SCALE, "window", "qk norm", "norm offset", "post norms", "embedding scale",
                            "rotary per type"), lora=True),
    # Gemma 3's layer without head norms, alternating windows, and softcaps on the attention scores and the final
    # logits small enough to bite (eager: sdpa has no softcap)
    "gemma2": Row("Gemma2Config", dict(sliding_window=6, query_pre_attn_scalar=16, final_logit_softcapping=3.0,
                                       attn_logit_softcapping=2.0),
                  features=(_SCALE, "attention softcap", "final softcap", "window", "norm offset", "post norms",
                            "embedding scale"), attention="eager", lora=True),
    "olmo2": Row("Olmo2Config", dict(), features=(_SCALE, "qk norm", "post norms")),
    # OLMo 2's layer, sliding window 6 on one of its two layers, a rotary per layer type (two bases, so that it shows)
    "olmo3": Row("Olmo3Config", dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                                     rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=1e4),
                                                      "full_attention": dict(rope_type="default", rope_theta=5e5)}),
                 features=(_SCALE, "qk norm", "post norms", "window", "rotary per type")),
    # OLMo 2's post-norms and Qwen3's head norms; with windows configured, every attention module carries one but
    # only the sliding layers apply it, and only they take rotary
    "exaone4": Row("Exaone4Config", dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
                   features=(_SCALE, "qk norm", "post norms", "window", "full layers unwindowed",
                             "layers without rotary"), lora=True),
    # without windows (EXAONE 4.0 1.2B): rotary on every layer
    "exaone4_full": Row("Exaone4Config", dict(sliding_window=None, layer_types=["full_attention"] * 2),
                        features=(_SCALE, "qk norm", "post norms")),
    "smollm3": Row("SmolLM3Config", dict(no_rope_layers=[1, 0]), features=(_SCALE, "layers without rotary")),
}
assert all(f in KNOCKOUTS for row in FAMILIES.values() for f in row.features)


def config(name, tok, **overrides):
    import transformers

    row = FAMILIES[name]
    kw = {**COMMON, **row.settings, **overrides}
    kw.update(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    return getattr(transformers, row.config)(**kw)


def randomise(model, seed=1, scale=0.2):
    """Every one-dimensional parameter (norm weights, biases, sinks, decays) moved off its initial value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def adapt(model, rank, targets, scale=0.1, seed=1):
    """LoRA of `rank` (alpha 2 * rank) on `targets`, each adapter's B drawn at random (`scale`) instead of zero, so
    that the adapters change the model; returns the model."""
    from layers import lora
    lora.add_lora(model, rank, 2 * rank, targets)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for a in lora.lora_modules(model).values():
            a.lora_B.copy_(torch.randn(a.lora_B.shape, generator=g).to(a.lora_B) * scale)
    return model


def tiny(name, attn_implementation=None, **overrides):
    """(model, tokenizer): a randomly initialised 2-4 layer model of family `name`, float32, eval mode."""
    from transformers import AutoModelForCausalLM

    tok = model_loading.build_byte_tokenizer()
    tok.padding_side = "left"
    torch.manual_seed(0)
    cfg = config(name, tok, **overrides)
    impl = attn_implementation or FAMILIES[name].attention
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=torch.float32)
    return randomise(model).eval(), tok


# the lists the tests run, all read off the table
WRITTEN_OUT = [n for n, r in FAMILIES.items() if r.written_out]              # the sampler on our layers
TRAINED_WRITTEN_OUT = [n for n in WRITTEN_OUT if FAMILIES[n].layers == "dense"]  # and the training forward
SAMPLER_ONLY = [n for n in WRITTEN_OUT if FAMILIES[n].layers != "dense"]
MOE = [n for n in WRITTEN_OUT if FAMILIES[n].layers == "moe"]
WINDOWED = [n for n, r in FAMILIES.items() if "window" in r.features]
WITH_LORA = [n for n, r in FAMILIES.items() if r.lora]


def force_model_forward(monkeypatch):
    """The sampler on the model's own forward (layers/hf_decoder.py) whatever the family: every decision says that the
    written-out decoder does not sample it."""
    from layers import transformer
    decide = transformer.decide
    monkeypatch.setattr(transformer, "decide", lambda model, tp_size=1: dataclasses.replace(
        decide(model, tp_size), sampler="forced onto the model's own forward"))
