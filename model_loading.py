"""Models and tokenizers, loaded the deferred way.

The config's `model_init_kwargs` (dtype, attention implementation, ...) are
forwarded to `from_pretrained` here, and this module decides where the weights
live: one explicit device per process, never `device_map="auto"`.

Also here: the tiny byte-level model the default run and the tests use, the
reference model (one process, or a model without weight files: a copy of the policy) and reward
models. The export of the trained policy: runs/export.py.

Several processes and a folder of weights (safetensors or `.bin`; a hub id's folder in the Hugging Face cache;
gpt-oss's MXFP4 experts): each process builds the model with its parameters on the meta device (`empty_model`),
the trainer shards it, and `fill_shards` reads only this process's slices of each weight from the files
(runs/weights.py reads the formats; docs/memory.md, "Loading").
"""

import contextlib
import os
import re

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                          PreTrainedTokenizerFast)
from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

from layers import lora
from runs import weights

TINY = "tiny"  # the model name that means "build the tiny byte-level model"
TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
# a ChatML-style template for tiny models that should have one (tests of chat-formatted prompts, reward models)
TINY_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def resolve_dtype(value):
    """'bfloat16' / 'float32' / torch.dtype / 'auto' -> what from_pretrained accepts."""
    if value is None or isinstance(value, torch.dtype) or value == "auto":
        return value
    dtype = getattr(torch, str(value), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"model_init_kwargs.dtype: unknown dtype {value!r} (try 'bfloat16' or 'float32')")
    return dtype


# ----------------------------------------------------------------------------- the tiny model

def build_byte_tokenizer(extra_tokens=()):
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
    if extra_tokens:  # whole-word tokens that stay in decoded text (a task's markup)
        from tokenizers import AddedToken
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra_tokens])
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


def write_tiny_model(path, chat_template=None, extra_tokens=(), **config_overrides):
    """Write config + tokenizer (no weights) to `path`; loading it gives a randomly initialised model."""
    os.makedirs(path, exist_ok=True)
    tokenizer = build_byte_tokenizer(extra_tokens)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    tiny_config(tokenizer, **config_overrides).save_pretrained(path)
    return path


# ----------------------------------------------------------------------------- loading

class DamagedWeightsError(ValueError):
    """A weights file that exists but cannot be read (cut short by a failed copy or download, or corrupted)."""


def _one_line(e, limit=200):
    """The first line of an exception's message: library errors often run to a paragraph of advice."""
    text = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _looks_local(name):
    """True for what can only be a path: a hub id is 'name' or 'owner/name', in a restricted alphabet."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name.startswith(("/", "./", "../", "~", ".")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name):
        return True
    try:
        validate_repo_id(name)
    except HFValidationError:
        return True
    return False


def _nearest_existing(path):
    parent = os.path.dirname(os.path.abspath(path))
    while parent and not os.path.isdir(parent):
        up = os.path.dirname(parent)
        if up == parent:
            break
        parent = up
    return parent


def resolve_model_path(name_or_path, need_config=True):
    """A local folder (with '~' expanded) or a hub id, checked before transformers turns a typo into a hub error.

    need_config: the folder must hold config.json (a model; a tokenizer alone needs none).
    """
    path = os.path.expanduser(name_or_path)
    if os.path.isdir(path):
        if need_config and not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"'{name_or_path}' has no config.json: not a Hugging Face model folder")
        return path
    if os.path.exists(path):
        raise ValueError(f"'{name_or_path}' is a file, not a model folder (give the folder that holds config.json)")
    if _looks_local(name_or_path):
        raise FileNotFoundError(f"no such folder '{name_or_path}' (nearest existing folder: "
                                f"'{_nearest_existing(path)}')")
    return name_or_path  # a hub id


def model_folder(name_or_path, model_init_kwargs=None):
    """Where a model's files are: a local folder, or a hub id's snapshot in the Hugging Face cache (at
    model_init_kwargs' revision and cache_dir) when it holds every file the model loads from, so that a hub id
    loads shard by shard like any folder; else the hub id, which from_pretrained downloads."""
    path = resolve_model_path(name_or_path)
    if os.path.isdir(path):
        return path
    kwargs = model_init_kwargs or {}
    return weights.cached_folder(path, kwargs.get("revision"), kwargs.get("cache_dir")) or path


def quantization(config):
    """"mxfp4" for a checkpoint whose experts are stored in MXFP4 (gpt-oss, as published), which loads dequantized;
    None for one that is not quantized (`config`: a config, or config.json's dict). Any other quantization stops
    here, named: its weights are not what the trainer would train and save."""
    q = config.get("quantization_config") if isinstance(config, dict) else getattr(config, "quantization_config", None)
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    method = getattr(method, "value", method)  # transformers' config classes hold an enum
    if str(method).lower() == "mxfp4":
        return "mxfp4"
    raise ValueError(f"quantization_config quant_method '{method}' is not supported (only gpt-oss's MXFP4 "
                     f"checkpoints load, dequantized); give an unquantized copy of the model")


def checkpoint_quantization(name_or_path, model_init_kwargs=None):
    """quantization() of the config.json a model loads from (read as a dict: no class built, no remote code)."""
    from transformers import PretrainedConfig
    located = {k: v for k, v in (model_init_kwargs or {}).items() if k in _CONFIG_LOCATION and k != "trust_remote_code"}
    return quantization(PretrainedConfig.get_config_dict(name_or_path, **located)[0])


def _damaged_file(path):
    """The first .safetensors file under `path` whose header does not parse, or None."""
    from safetensors import SafetensorError, safe_open

    if not os.path.isdir(path):
        return None, None
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            try:
                with safe_open(os.path.join(path, f), "pt"):
                    pass
            except (SafetensorError, OSError) as e:
                return os.path.join(path, f), e
    return None, None


def _from_pretrained(load, name_or_path, **kwargs):
    """`load(name_or_path, **kwargs)` with its failures as one line naming the folder, file or hub id."""
    from safetensors import SafetensorError

    try:
        return load(name_or_path, **kwargs)
    except SafetensorError as e:
        bad, reason = _damaged_file(name_or_path)
        where = bad or f"a weights file of '{name_or_path}'"
        raise DamagedWeightsError(f"{where} cannot be read (truncated or damaged: {_one_line(reason or e)}); "
                                  f"copy or download it again") from e
    except OSError as e:
        if os.path.isdir(name_or_path):
            kind = type(e) if type(e).__module__ == "builtins" else OSError  # library subclasses take other arguments
            raise kind(f"'{name_or_path}': {_one_line(e)}") from e
        raise OSError(f"'{name_or_path}' is neither a local folder nor loadable from the hub ({_one_line(e)})") from e
    except ValueError as e:
        if "\n" not in str(e):
            raise
        raise ValueError(f"'{name_or_path}': {_one_line(e)}") from e


def _has_weights(path):
    return os.path.isdir(path) and any(
        f.endswith((".safetensors", ".bin")) or f.endswith(".safetensors.index.json") for f in os.listdir(path)
    )


def load_tokenizer(name_or_path):
    """The tokenizer, padding on the left (prompts end where generation starts) and with a pad token."""
    tokenizer = _load_tokenizer(name_or_path)
    tokenizer.padding_side = "left"
    tokenizer.truncation_side = "left"  # a prompt cut to max_prompt_length keeps its end, where generation starts
    if tokenizer.pad_token is None:
        # pad == eos is fine: completion masks are cut at the first EOS, so the
        # first EOS is trained on and the padding after it is not.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _load_tokenizer(name_or_path):
    path = resolve_model_path(name_or_path, need_config=False)
    try:
        tokenizer = _from_pretrained(AutoTokenizer.from_pretrained, path)
    except ValueError as e:
        raise ValueError(f"'{name_or_path}': no usable tokenizer ({_one_line(e.__cause__ or e)})") from e
    # a folder with a config and no tokenizer files loads an empty tokenizer instead of failing
    if not tokenizer("a", add_special_tokens=False).input_ids:
        raise ValueError(f"'{name_or_path}': the tokenizer turns text into no tokens (are its tokenizer files missing?)")
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


def _init_kwargs(model_init_kwargs, device):
    kwargs = dict(model_init_kwargs or {})
    if "dtype" not in kwargs and "torch_dtype" not in kwargs:
        # float32 weights: AdamW updates at small learning rates vanish when rounded to bfloat16 weights.
        # Under torchrun, FSDP2 still computes in bfloat16 (sharding.mixed_precision_dtypes).
        kwargs["dtype"] = "float32"
    if kwargs.get("device_map") not in (None, ):
        raise ValueError("model_init_kwargs.device_map: device placement is decided by the trainer (one device per process); remove it")
    kwargs.pop("device_map", None)
    if "torch_dtype" in kwargs:  # older spelling
        kwargs["dtype"] = kwargs.pop("torch_dtype")
    if "dtype" in kwargs:
        kwargs["dtype"] = resolve_dtype(kwargs["dtype"])
    return kwargs


class InitKwargsError(ValueError):
    """A `model_init_kwargs` entry the model cannot take, named in one line that starts `model_init_kwargs: `."""


# the class attribute transformers reads to decide whether a model may use each attention implementation
_ATTENTION_FLAGS = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn"}


def _supports_attention(model_class, impl):
    """True / False from the class's own flag; None for a name transformers resolves itself (a hub kernel, ...)."""
    if impl == "eager":
        return True
    flag = "_supports_flash_attn" if impl.startswith("flash_attention_") else _ATTENTION_FLAGS.get(impl)
    return None if flag is None else bool(getattr(model_class, flag, False))


def _choose_attention(kwargs, auto_class, config):
    """Fill in attn_implementation when it is not set: sdpa where the model's class supports it, else eager.

    One default for every model cannot work: gpt-oss refuses sdpa at load (its sinks need eager, flex or flash).
    A named implementation the class does not support stops here, in one line that says what would work,
    instead of transformers' paragraph from inside from_pretrained.
    """
    try:  # the class from_config / from_pretrained will build (transformers keeps the table private)
        model_class = auto_class._model_mapping[type(config)]
    except (KeyError, ValueError):
        return  # code transformers does not ship (trust_remote_code): leave the choice to transformers
    usable = "sdpa" if _supports_attention(model_class, "sdpa") else "eager"
    impl = kwargs.get("attn_implementation")
    if impl is None:
        kwargs["attn_implementation"] = usable
    elif isinstance(impl, str) and _supports_attention(model_class, impl) is False:  # (a dict: per sub-model)
        raise InitKwargsError(f'model_init_kwargs: {config.model_type} does not support attn_implementation={impl}; '
                              f'use "{usable}"')


# the from_pretrained keywords that say where a config is; the others are for the model
_CONFIG_LOCATION = ("revision", "subfolder", "token", "cache_dir", "local_files_only", "trust_remote_code")


def causal_lm_class(config):
    """The auto class a policy of `config` loads with: a model with a vision tower as a vision-language model (its
    language model, vision tower and head; AutoModelForCausalLM would give some of them, Qwen3.5, text only)."""
    if getattr(config, "vision_config", None) is not None:
        from transformers import AutoModelForImageTextToText
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def not_causal(config):
    """Why a policy of `config` is not a causal language model, in a few words; None when its config says nothing
    against it. The sampler and the loss read each token given the tokens before it alone."""
    kind = config.model_type
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model (config.is_encoder_decoder is true) reads its input through an encoder"
    if kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        # BERT's family loads as a causal LM too, but attends both ways unless its config says is_decoder
        return "an encoder's tokens attend to the tokens after them too (config.is_decoder is false)"
    # the auto class's table holds the classes registered by a fork too; a hub model's own code says so in auto_map
    remote = "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if type(config) not in AutoModelForCausalLM._model_mapping and not remote:
        return "AutoModelForCausalLM has no class for it"
    return None


def _instantiate(auto_class, name_or_path, model_init_kwargs, seed, device):
    kwargs = _init_kwargs(model_init_kwargs, device)
    name_or_path = resolve_model_path(name_or_path)
    located = {k: kwargs[k] for k in _CONFIG_LOCATION if k in kwargs}
    config = _from_pretrained(AutoConfig.from_pretrained, name_or_path, **located)
    if auto_class is AutoModelForCausalLM:
        auto_class = causal_lm_class(config)
        why = not_causal(config) if auto_class is AutoModelForCausalLM else None  # a vision-language one: its own class
        if why:
            name = (config.architectures or [type(config).__name__.removesuffix("Config")])[0]
            raise ValueError(f"'{name_or_path}': {name} is not a causal language model: {why}")
    _choose_attention(kwargs, auto_class, config)
    try:
        quantized = quantization(config)
    except ValueError as e:
        raise ValueError(f"'{name_or_path}': {e}") from None
    if os.path.isdir(name_or_path) and not _has_weights(name_or_path):
        if kwargs.get("dtype") == "auto":  # "the checkpoint's dtype": there is no checkpoint, use the config's
            kwargs["dtype"] = resolve_dtype(str(getattr(config, "dtype", None) or "float32").replace("torch.", ""))
        if quantized:  # no weights to dequantize: a plain model (its config would claim MXFP4 weights on export)
            del config.quantization_config
        torch.manual_seed(seed)
        return auto_class.from_config(config, **kwargs)
    if quantized:  # dequantized at load, as the sharded path does: the model holds, trains and saves plain weights
        from transformers import Mxfp4Config
        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    return _from_pretrained(auto_class.from_pretrained, name_or_path, **kwargs)


def load_model(name_or_path, model_init_kwargs=None, device="cpu", seed=0, gradient_checkpointing=False):
    """Instantiate the policy from a directory or hub id with `model_init_kwargs`, on `device`.

    A directory with a config and no weights gives a randomly initialised model
    (seeded), which is what the default run and the tests use.
    Without a dtype in `model_init_kwargs`: float32, so that optimizer updates
    are not rounded away; under torchrun FSDP2 computes in bfloat16 over these
    float32 master weights (`--mixed_precision`).
    gradient_checkpointing: keep only each layer's input in the forward and
    recompute the layer in the backward (activation memory for ~1/3 more compute).
    """
    model = _instantiate(AutoModelForCausalLM, name_or_path, model_init_kwargs, seed, device)
    if gradient_checkpointing:
        enable_checkpointing(model)
    return model.to(device)


def enable_checkpointing(model):
    """Activation checkpointing on every layer of a Hugging Face model."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"gradient_checkpointing: {type(model).__name__} does not support it; set it to false")
    # non-reentrant: works with inputs that need no grad and composes with FSDP2
    if hasattr(model, "activation_checkpointing_enable"):  # the newer name; the older one is deprecated
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def write_tiny_reward_model(path, chat_template=TINY_CHAT_TEMPLATE, **config_overrides):
    """A tiny sequence-classification reward model folder (config + tokenizer with a chat template, no weights)."""
    write_tiny_model(path, chat_template=chat_template, num_labels=1, **config_overrides)
    return path


def load_reward_model(name_or_path, model_init_kwargs=None, device="cpu", seed=0):
    """(model, tokenizer) of a sequence-classification reward model, frozen and in eval mode on `device`.

    Loaded the same deferred way as the policy (same `model_init_kwargs`, our
    placement); its tokenizer and chat template are its own, not the policy's.
    train.py shards it like the reference model (sharding.Root + fully_shard).
    """
    tokenizer = _load_tokenizer(name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # scores are read at the last real token, so pad == eos is safe
    model = _instantiate(AutoModelForSequenceClassification, name_or_path, model_init_kwargs, seed, device)
    if model.config.num_labels != 1:
        raise ValueError(f"reward model {name_or_path}: expected one output (num_labels=1), "
                         f"got num_labels={model.config.num_labels}")
    model.to(device).eval().requires_grad_(False)
    return model, tokenizer


# ----------------------------------------------------------------------------- sharded loading

@contextlib.contextmanager
def parameters_on_meta():
    """Every parameter registered inside is moved to the meta device (a shape and a dtype, no storage); buffers
    stay real, so those computed in __init__ and never saved (rotary `inv_freq`) are right. As accelerate's
    `init_empty_weights(include_buffers=False)`: a layer's own __init__ still asks for its weight with
    torch.empty (memory never written, so never resident) and initialises it after it is on meta (no work)."""
    original = torch.nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            param = module._parameters[name]
            module._parameters[name] = type(param)(param.to("meta"), **{**param.__dict__,
                                                                         "requires_grad": param.requires_grad})
    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


_PARAMETRIZED = re.compile(r"\.parametrizations\.([^.]+)\.original$")  # a weight under torch's parametrize


def _stored_names(model, files):
    """({name in the files: parameter}, {parameter name: (parameter, source)}) for every parameter of `model`, or
    why the files cannot fill it. A tied parameter (lm_head sharing the embeddings) is one tensor under one of its
    names; a MoE block's fused experts may be stored a matrix per expert or in MXFP4 (runs/weights.py's sources).
    LoRA's adapters are not in the files (lora.init_adapters gives them their values); an expert weight they adapt
    is kept under `parametrizations.<name>.original`, stored under its plain name."""
    adapters = {id(p) for m in lora.lora_modules(model).values() for p in (m.lora_A, m.lora_B)}
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in adapters:
            names.setdefault(id(p), (p, []))[1].append(_PARAMETRIZED.sub(r".\1", name))
    renamed = _renamed_in_files(model, files)
    stored_as = lambda n: renamed.get(n, n)  # noqa: E731 (a name of the model -> its name in the files)
    files = {**files, **{n: files[k] for n, k in renamed.items()}}  # the files' tensors under the model's names too
    out, assembled = {}, {}
    for p, aliases in names.values():
        stored = next((n for n in aliases if n in files), None)
        if stored is None:
            source = weights.per_expert(aliases[0], tuple(p.shape), files) or \
                weights.mxfp4(aliases[0], tuple(p.shape), files)
            if source is not None:
                kind, *parts = source
                assembled[aliases[0]] = (p, (kind, [[stored_as(n) for n in e] for e in parts[0]]) if
                                         kind == "experts" else (kind, *map(stored_as, parts)))
                continue
            return f"{aliases[0]} is not in the files (transformers converts this family's weights)"
        if files[stored][0] != tuple(p.shape):
            return f"{stored_as(stored)} is {list(files[stored][0])} in the files, {list(p.shape)} in the model"
        out[stored_as(stored)] = p
    return out, assembled


def _renamed_in_files(model, files):
    """{a name of `model`: the name the files hold it under} where transformers renames a checkpoint's tensors as it
    loads them, by its own renaming rules for this model (names only, no conversion of values): a Qwen2.5-VL
    checkpoint's `model.layers.*` are the model's `model.language_model.layers.*`, its `visual.*` the model's
    `model.visual.*`. Names the files hold as the model does are not in it."""
    try:  # transformers' own rules (5.x); without them, names are taken as the files hold them
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:
        return {}
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    out = {}
    for k in files:
        name, _ = rename_source_key(k, renamings, [])
        if name != k and name not in files:
            out.setdefault(name, k)
    return out


def empty_model(name_or_path, model_init_kwargs=None, dtype=None, gradient_checkpointing=False, adapt=None):
    """(model with its parameters on meta and its buffers real, None), or (None, why not) where this folder's
    weights cannot be read shard by shard: no weight files (a hub id not in the cache: give model_folder's
    answer), `.bin` files in torch.save's old format, or names and shapes the model does not have. `dtype`
    overrides model_init_kwargs' (the reference in bfloat16); "auto" is the files' own. `adapt(model)` changes
    the model on meta before its names are matched with the files' (LoRA's adapters). A quantization other
    than MXFP4 raises ValueError."""
    kwargs = _init_kwargs(model_init_kwargs, "cpu")
    path = resolve_model_path(name_or_path)
    if not os.path.isdir(path):
        return None, (f"a hub id whose files are not all in the Hugging Face cache (`hf download {path}` puts them "
                      f"there once, for every process)")
    try:
        files = weights.tensors(path)
    except ValueError as e:  # .bin weights in the old format: whole loading reads them, and the line says why
        return None, str(e)
    if not files:
        return None, "no safetensors or .bin weights in the folder"
    located = {k: kwargs.pop(k) for k in _CONFIG_LOCATION if k in kwargs and k != "trust_remote_code"}
    config = _from_pretrained(AutoConfig.from_pretrained, path, trust_remote_code=kwargs.get("trust_remote_code"),
                              **located)
    try:
        quantized = quantization(config)
    except ValueError as e:
        raise ValueError(f"'{name_or_path}': {e}") from None
    if quantized:  # the experts are dequantized as they are read (fill_shards): the model holds plain weights
        del config.quantization_config
    auto_class = causal_lm_class(config)  # a vision-language model's: its language model, vision tower and head
    why = not_causal(config) if auto_class is AutoModelForCausalLM else None
    if why:
        return None, why  # load_model says it in full
    _choose_attention(kwargs, auto_class, config)
    if dtype is not None:
        kwargs["dtype"] = dtype
    if kwargs.get("dtype") == "auto":  # as from_pretrained: the config's, else the files' first floating tensor's
        saved = getattr(config, "dtype", None) or next(
            (t for _, t, _ in files.values() if t.is_floating_point), torch.float32)
        kwargs["dtype"] = resolve_dtype(str(saved).replace("torch.", ""))
    with parameters_on_meta():
        model = auto_class.from_config(config, **kwargs)
    if adapt is not None:
        adapt(model)
    problem = _stored_names(model, files)
    if isinstance(problem, str):
        return None, problem
    if gradient_checkpointing:
        enable_checkpointing(model)
    return model, None


def fill_shards(root, path, device):
    """Give a sharded root (parameters on meta, buffers real) this process's shards on `device`, read from the
    folder's weight files: each process reads only its own slice of each weight; the files' dtype is cast to the
    parameters'. Safetensors tensors stored as the model holds them go through torch.distributed.checkpoint's
    Hugging Face reader (safetensors' sliced reads); the rest (`.bin` files, experts stored a matrix per expert or
    in MXFP4) through runs/weights.py's `fill_rows`, which reads the same rows. LoRA's adapters, which are not in
    the files, then take the values add_lora gives them on a real model (lora.init_adapters: the global random
    generator's next numbers, the same on every process)."""
    import torch.distributed.checkpoint as dcp

    buffers = {n: b.detach().clone() for n, b in root.named_buffers()}  # to_empty would leave them uninitialised
    root.to_empty(device=device)
    with torch.no_grad():
        for n, b in root.named_buffers():
            b.copy_(buffers[n])
        files = weights.tensors(path)
        state, assembled = _stored_names(root.lm, files)
        if any(f.endswith(".safetensors") for _, _, f in files.values()):
            dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(path))
        else:
            assembled.update({n: (p, ("tensor", n)) for n, p in state.items()})
        weights.fill_rows(assembled, files, path)
    lora.init_adapters(root.lm)
    return root


def build_reference_model(policy, beta):
    """A frozen copy of the policy for the KL penalty, or None when beta == 0 (nothing is built).

    Built from the policy's own config and weights, so it is exactly the
    starting policy even when that came from a folder without weights.
    """
    if beta == 0:
        return None
    ref = causal_lm_class(policy.config).from_config(policy.config, dtype=next(policy.parameters()).dtype,
                                                     attn_implementation=policy.config._attn_implementation)
    ref.load_state_dict(policy.state_dict())
    ref.to(next(policy.parameters()).device)
    ref.eval()
    ref.requires_grad_(False)
    return ref
