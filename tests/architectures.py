"""Tiny random models of the architectures researchers train, built from configs (no download).

One entry per family: the config class's name in transformers and the few settings that make it small
but keep what is particular to it (sliding windows short enough for a few dozen tokens to cross them,
linear-attention layers beside full ones, experts, sinks, softcapped logits). `tiny(name)` builds the
model in float32 with its norms, biases and other one-dimensional parameters randomised, so that a path
that forgets one of them (a norm's offset, a bias, a sink, the decay of a recurrent layer) shows.
"""

import torch

import model_loading

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, tie_word_embeddings=False, head_dim=16)

# family -> (config class, settings over COMMON)
FAMILIES = {
    "llama": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "mistral_window": ("MistralConfig", dict(sliding_window=6)),  # a window on every layer
    "qwen3": ("Qwen3Config", dict()),
    "qwen3_moe": ("Qwen3MoeConfig", dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                         norm_topk_prob=True, decoder_sparse_step=1)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
                                         num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1)),
    "qwen3_5": ("Qwen3_5TextConfig", dict(num_hidden_layers=4, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                                          linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                          layer_types=["linear_attention"] * 3 + ["full_attention"])),
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                                     layer_types=["sliding_attention", "full_attention"], intermediate_size=32)),
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=3, sliding_window=6, query_pre_attn_scalar=16,
                                        layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    "gemma2": ("Gemma2Config", dict(sliding_window=6, query_pre_attn_scalar=16, final_logit_softcapping=0.5,
                                    attn_logit_softcapping=5.0)),
    "olmo2": ("Olmo2Config", dict()),
    "olmo3": ("Olmo3Config", dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"])),
    "smollm3": ("SmolLM3Config", dict(no_rope_layers=[1, 0])),
}


def config(name, tok, **overrides):
    import transformers

    cls_name, settings = FAMILIES[name]
    kw = {**COMMON, **settings, **overrides}
    kw.update(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    return getattr(transformers, cls_name)(**kw)


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
    impl = attn_implementation or ("eager" if name in ("gpt_oss", "gemma2") else "sdpa")
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=torch.float32)
    return randomise(model).eval(), tok
