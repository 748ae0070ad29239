"""Models and tokenizers, loaded the deferred way.

The config's `model_init_kwargs` (dtype, attention implementation, ...) are
forwarded to `from_pretrained` here, and this module decides where the weights
live: one explicit device per process, never `device_map="auto"`.

Also here: the tiny byte-level model the default run and the tests use, the
reference model (built from the policy, never re-read from disk), and export
of the trained policy to a Hugging Face folder.
"""

import json
import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

TINY = "tiny"  # the model name that means "build the tiny byte-level model"
TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]


def resolve_dtype(value):
    """'bfloat16' / 'float32' / torch.dtype / 'auto' -> what from_pretrained accepts."""
    if value is None or isinstance(value, torch.dtype) or value == "auto":
        return value
    dtype = getattr(torch, str(value), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"model_init_kwargs.dtype: unknown dtype {value!r} (try 'bfloat16' or 'float32')")
    return dtype


# ----------------------------------------------------------------------------- the tiny model

def build_byte_tokenizer():
    """A tokenizer that encodes any text: one token per UTF-8 byte, plus a few special tokens.

    Built with the `tokenizers` library (byte-level BPE with no merges), so it
    needs no download and round-trips every string exactly.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(TINY_SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")


def tiny_config(tokenizer, **overrides):
    """A 2-layer Qwen2-shaped config sized for CPU: trains a step in milliseconds."""
    from transformers import Qwen2Config

    cfg = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    cfg.update(overrides)
    return Qwen2Config(**cfg)


def write_tiny_model(path, **config_overrides):
    """Write config + tokenizer (no weights) to `path`; loading it gives a randomly initialised model."""
    os.makedirs(path, exist_ok=True)
    tokenizer = build_byte_tokenizer()
    tokenizer.save_pretrained(path)
    tiny_config(tokenizer, **config_overrides).save_pretrained(path)
    return path


# ----------------------------------------------------------------------------- loading

def _has_weights(path):
    return os.path.isdir(path) and any(
        f.endswith((".safetensors", ".bin")) or f.endswith(".safetensors.index.json") for f in os.listdir(path)
    )


def load_tokenizer(name_or_path):
    """The tokenizer, padding on the left (prompts end where generation starts) and with a pad token."""
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        # pad == eos is fine: completion masks are cut at the first EOS, so the
        # first EOS is trained on and the padding after it is not.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def eos_token_ids(model, tokenizer):
    """Every id that ends a completion: the generation config's EOS ids and the tokenizer's."""
    ids = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("the model and tokenizer define no EOS token: completions could never end")
    return sorted(ids)


def load_model(name_or_path, model_init_kwargs=None, device="cpu", seed=0, gradient_checkpointing=False):
    """Instantiate the policy from a directory or hub id with `model_init_kwargs`, on `device`.

    A directory with a config and no weights gives a randomly initialised model
    (seeded), which is what the default run and the tests use.
    Without a dtype in `model_init_kwargs`: bfloat16 on CUDA (half the bytes and
    the tensor-core rate), float32 on CPU (where bfloat16 matmuls are slow).
    gradient_checkpointing: keep only each layer's input in the forward and
    recompute the layer in the backward (activation memory for ~1/3 more compute).
    """
    kwargs = dict(model_init_kwargs or {})
    if "dtype" not in kwargs and "torch_dtype" not in kwargs:
        kwargs["dtype"] = "bfloat16" if torch.device(device).type == "cuda" else "float32"
    if kwargs.get("device_map") not in (None, ):
        raise ValueError("model_init_kwargs.device_map: device placement is decided by the trainer (one device per process); remove it")
    kwargs.pop("device_map", None)
    if "torch_dtype" in kwargs:  # older spelling
        kwargs["dtype"] = kwargs.pop("torch_dtype")
    if "dtype" in kwargs:
        kwargs["dtype"] = resolve_dtype(kwargs["dtype"])
    if os.path.isdir(name_or_path) and not _has_weights(name_or_path):
        config = AutoConfig.from_pretrained(name_or_path)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    if gradient_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ValueError(f"gradient_checkpointing: {type(model).__name__} does not support it; set it to false")
        # non-reentrant: works with inputs that need no grad and composes with FSDP2
        if hasattr(model, "activation_checkpointing_enable"):  # the newer name; the older one is deprecated
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.to(device)


def build_reference_model(policy, beta):
    """A frozen copy of the policy for the KL penalty, or None when beta == 0 (nothing is built).

    Built from the policy's own config and weights, so it is exactly the
    starting policy even when that came from a folder without weights.
    """
    if beta == 0:
        return None
    ref = AutoModelForCausalLM.from_config(policy.config, dtype=next(policy.parameters()).dtype,
                                           attn_implementation=policy.config._attn_implementation)
    ref.load_state_dict(policy.state_dict())
    ref.to(next(policy.parameters()).device)
    ref.eval()
    ref.requires_grad_(False)
    return ref


# ----------------------------------------------------------------------------- export

def export_model(model, tokenizer, path, state_dict=None):
    """Save a Hugging Face folder (config, tokenizer, safetensors) that `from_pretrained` loads.

    `state_dict` lets a sharded run pass full tensors gathered elsewhere.
    """
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
