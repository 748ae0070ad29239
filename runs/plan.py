"""The memory plan: what each process and each GPU will hold in each phase of a run, before any weight is read.

One concern in one file (past 650 lines on purpose): the plan, and the advice and the docs' table, which are plans
made again with other settings; apart, the advice would import the plan and the plan's entry point the advice.

`python train.py --plan` (with the run's other settings) builds the model from its config on the meta device (no
weights: a folder with config.json, a hub id whose config is cached or reachable, or a config object in a test),
counts its tensors, and prints per GPU (or per process on a CPU run) and per host process the bytes of each phase
for W processes (`--plan_world_size`, else WORLD_SIZE): loading, generation and training. What is counted and what
is estimated:

- counted from the meta model: parameters, the FSDP2 shards of every tensor (dim 0 padded to a multiple of W, as
  fully_shard pads it), gradients and AdamW's two moments and step of the trained tensors (all of them, or the
  adapters with --lora_rank), the reference's shards, the groups gathered in training (the root, two blocks);
- counted from a `StaticDecoder` built on the meta device for this process's generation rows: its weight copies,
  KV cache, recurrent states and per-row tables (the sampler's own allocation, so windowed layers, Gated DeltaNet
  states and the 64-slot rounding are as the decoder makes them);
- estimated: activations per micro-batch (`activation_bytes`' formula), the log-prob head's buffers, the sampler's
  logits buffers, and the model's own forward where the sampler takes it (MoE blocks under FSDP2).

`SHAPES` holds the published shapes of the models in docs/memory.md's table; `python -m runs.plan` prints it.
Imports: torch, transformers, model_loading, layers/ (the decoder and LoRA), runs/export (the NaN check's chunk);
imported by train.py (--plan), runs/setup.py (the --tp_size check at the start of a run) and tests.
"""

import dataclasses
import math
import os

import torch

GiB = 1 << 30
GPUS_PER_NODE = 8


# ----------------------------------------------------------------------------- the model on the meta device


def model_config(cfg):
    """The model's config: the tiny default's, or `cfg.model`'s config.json (a folder, or a hub id: config only)."""
    import model_loading
    if cfg.model == model_loading.TINY:
        return model_loading.tiny_config(model_loading.build_byte_tokenizer())
    from transformers import AutoConfig
    path = model_loading.resolve_model_path(cfg.model)
    if os.path.isdir(path):
        return AutoConfig.from_pretrained(path)
    try:  # a hub id: its cached config.json first, so that an offline machine is not made to wait on retries
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except OSError:
        if not hub_reachable():
            raise OSError(f"{cfg.model!r} is not in the Hugging Face cache, and the hub cannot be reached from here "
                          f"(a folder holding its config.json plans offline)") from None
    return AutoConfig.from_pretrained(path)


def hub_reachable(timeout=3.0):
    """Whether the Hugging Face hub answers a connection within `timeout` seconds (HF_ENDPOINT's host; False
    offline, with HF_HUB_OFFLINE set, or where its name does not resolve)."""
    import socket
    from urllib.parse import urlparse
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
        return True
    except OSError:
        return False


_MODELS = {}  # (config, dtype, adapters) -> the last meta model built for them: advice re-plans many times


def meta_model(config, dtype=torch.float32, lora_rank=0, lora_alpha=32.0, lora_targets="all"):
    """The causal LM of `config` on the meta device in `dtype`, with adapters when lora_rank > 0: shapes, no memory."""
    import model_loading
    from layers import lora
    key = (id(config), dtype, lora_rank, lora_alpha, lora_targets)
    if key in _MODELS and _MODELS[key][0] is config:
        return _MODELS[key][1]
    with torch.device("meta"):
        model = model_loading.causal_lm_class(config).from_config(config, dtype=dtype)
        if lora_rank:
            lora.add_lora(model, lora_rank, lora_alpha, lora_targets)
    if len(_MODELS) > 8:
        _MODELS.clear()
    _MODELS[key] = (config, model)
    return model


def _unique(tensors):
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def shard_numel(t, world):
    """Elements of one rank's FSDP2 shard of `t`: dim 0 split in W chunks of ceil(dim0 / W) rows (padded)."""
    if world == 1 or t.dim() == 0:
        return t.numel()
    return -(-t.shape[0] // world) * (t.numel() // max(1, t.shape[0]))


def tensor_bytes(tensors, world=1, dtype=None):
    """Bytes of `tensors` (unique) on one of `world` ranks, each in its own dtype or in `dtype`."""
    return sum(shard_numel(t, world) * (dtype or t.dtype).itemsize for t in _unique(tensors))


def _blocks(model):
    import sharding
    return sharding.transformer_blocks(model)


# ----------------------------------------------------------------------------- the phases


@dataclasses.dataclass
class Phase:
    name: str
    parts: list          # (label, bytes) of this process's (GPU's) memory in this phase
    where: str = "gpu"   # "gpu" (the process's device) or "host"

    @property
    def total(self):
        return sum(b for _, b in self.parts)


@dataclasses.dataclass
class Plan:
    world: int
    device: str          # "cuda" or "cpu"
    params: int          # parameters of the model (tied counted once)
    trained: int         # parameters trained (the adapters with LoRA)
    phases: list
    gpu_bytes: int       # what one GPU holds (per-process limit on a CPU run: the host's share)
    host_bytes: int      # what one node's host memory holds
    notes: list
    advice: list = dataclasses.field(default_factory=list)
    fix: tuple = None    # (settings changed, world size) that make the plan fit, from `advise`; None if none do
    lengths: tuple = (0, 0)  # (prompt, completion) tokens every row is planned at: the longest each may be
    read: int = 0        # bytes each process reads from the checkpoint while loading (its own shards, as stored)
    headroom: int = 0    # bytes of each GPU left free for what the plan does not count (--plan_gpu_headroom)
    replicas: int = 1    # HSDP: the model's copies, each sharded over world / replicas processes (--replicas)

    def phase(self, name):
        return next(p for p in self.phases if p.name == name)

    def over(self):
        """The phases that do not fit: [(phase, bytes over)]."""
        out = []
        for p in self.phases:
            limit = self.host_bytes / min(self.world, GPUS_PER_NODE) if p.where == "host" else \
                self.gpu_bytes - self.headroom
            if p.total > limit:
                out.append((p, p.total - limit))
        return out


def _dtypes(cfg, device, world):
    """(parameter dtype, compute dtype, sharded) as the run would have them: FSDP2 under torchrun on a GPU or with
    several processes, or where a precision is named; bf16 compute there unless --mixed_precision says fp16 (2 bytes
    as well) or fp32."""
    import model_loading
    param = model_loading.resolve_dtype(cfg.model_init_kwargs.get("dtype", "float32"))
    if not isinstance(param, torch.dtype):
        param = torch.float32
    # a single process naming a precision runs as a world of one (sharding.setup)
    sharded = world > 1 or device == "cuda" or cfg.mixed_precision in ("bf16", "fp16")
    mp = cfg.mixed_precision if cfg.mixed_precision != "auto" else ("bf16" if device == "cuda" else "fp32")
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mp, param) if sharded else param
    return param, compute, sharded


def _attention_dims(config):
    text = getattr(config, "text_config", None) or config
    heads, kv = text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    hd = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text, heads, kv, hd


def activation_bytes(config, tokens, dtype_bytes, checkpointing):
    """Activations autograd keeps for one micro-batch of `tokens` positions (rows x width), estimated: (kept
    through the forward, the extra of one layer recomputed in backward: 0 without checkpointing).

    Per token and layer, in the compute dtype (b bytes) plus float32 where the norms upcast:
      attention layer   b (3h + 2q + 2kv [+ 2q with a gated query]) + 4h      (norm in/out, q/k/v, attention out,
                                                                              o_proj out; the norm's float32 input)
      dense MLP         b (2h + 4i) + 4h                                       (norm in/out, gate, up, act, act*up)
      MoE block         b (2h + k (2h + 4 i_e)) + 8 E                          (each token's k experts; router logits)
      Gated DeltaNet    b (3h + 2c + 4 n_v d_v) + 4 (2c + 2 n_v d_v + 64 n_v)  (projections, convolution, gated norm;
                                                                              the chunked rule's float32 copies)
    with h hidden, q = heads x head_dim, kv = kv_heads x head_dim, i intermediate, E experts, k of them per token,
    i_e an expert's intermediate, c the convolution's channels. Plus 2 b h + 4 h + 8 head_dim per token for the
    final norm (its input, float32 and output) and the float32 rotary tables. With gradient checkpointing only each layer's input (b h per token and layer) is kept, plus one
    layer's full activations while it is recomputed in backward.
    """
    text, heads, kv, hd = _attention_dims(config)
    h, b = text.hidden_size, dtype_bytes
    q, kvd = heads * hd, kv * hd
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    layers = []
    for i, kind in enumerate(kinds):
        if kind == "linear_attention":
            nv, dv = text.linear_num_value_heads, text.linear_value_head_dim
            c = 2 * text.linear_num_key_heads * text.linear_key_head_dim + nv * dv
            mix = b * (3 * h + 2 * c + 4 * nv * dv) + 4 * (2 * c + 2 * nv * dv + 64 * nv)
        else:
            gated = 2 * q if getattr(text, "model_type", "").startswith("qwen3_5") else 0
            mix = b * (3 * h + 2 * q + 2 * kvd + gated) + 4 * h
        experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
        mlp_only = set(getattr(text, "mlp_only_layers", None) or [])
        if experts and i not in mlp_only:
            k = text.num_experts_per_tok
            ie = getattr(text, "moe_intermediate_size", None) or text.intermediate_size
            ffn = b * (2 * h + k * (2 * h + 4 * ie)) + 8 * experts
        else:
            ffn = b * (2 * h + 4 * text.intermediate_size) + 4 * h
        layers.append(mix + ffn)
    ends = 2 * b * h + 4 * h + 8 * hd  # the last layer's output, the final norm's float32 and output; rotary tables
    if checkpointing:  # (kept through the forward, one layer's recomputed in backward)
        return tokens * (len(layers) * b * h + ends), tokens * max(layers)
    return tokens * (sum(layers) + ends), 0


def exchange_bytes(config, positions, dtype_bytes, size, checkpointing):
    """What --cp_size's all-to-alls add to a layer's activations for `positions` a rank computes: the q, k and v it
    receives (every position of its heads: as many bytes as its positions' own, K/V repeated to one per query head
    where `size` does not divide their count) and the attention's output it sends back, b (2q + 2kv) per position
    and attention layer; with checkpointing, one layer's (recomputed in backward)."""
    text, heads, kv, hd = _attention_dims(config)
    kv = kv if kv % size == 0 else heads
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    per_layer = positions * dtype_bytes * (2 * heads * hd + 2 * kv * hd)
    return per_layer * (1 if checkpointing else sum(k != "linear_attention" for k in kinds))


def logprob_bytes(config, completion_tokens, dtype_bytes, device):
    """The chunked head's buffers for one micro-batch (logprobs.py), estimated: (kept for backward: the completion
    positions' hidden states, and a chunk's float32 softmax when one chunk holds them all; transient: the hidden
    states' gradient and a chunk of (rows, V) logits with its two float32 buffers)."""
    text = getattr(config, "text_config", None) or config
    vocab = text.vocab_size
    chunk = max(1, (1 << (27 if device == "cuda" else 24)) // vocab)  # logprobs.default_chunk_tokens
    rows = min(completion_tokens, chunk)
    hidden = completion_tokens * text.hidden_size * dtype_bytes
    kept = hidden + (completion_tokens * vocab * 4 if completion_tokens <= chunk else 0)
    return kept, hidden + rows * vocab * (8 + dtype_bytes)


def _tensors_in(values):
    """The tensors among `values`, and in the lists and tuples among them."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += _tensors_in(v)
    return out


def decoder_bytes(dec):
    """{part: bytes} of a engine.StaticDecoder's own tensors (it may be built on the meta device): its weight
    copies (the fused per-layer copies, embedding, final norm and head, tied ones once; a recurrent layer's own
    copies; under tensor parallelism this rank's slices, MoE experts included), KV cache, recurrent states and
    per-row tables. Without tensor parallelism MoE experts are read in place: no copy."""
    from layers import cuda_graphs
    rec = list(dec.recurrent.values())
    graphs = dec.graphs or cuda_graphs.Graphs(dec)  # its CUDA graphs' inputs, which a decoder on CUDA holds
    tables = [dec.key_mask, *dec.cos, *dec.sin, graphs.tok_in, graphs.slot_in, dec.row_index, dec.trues]
    tables += [] if dec.windows is None else [dec.windows.pos]
    return {"weight copies": dec.weight_bytes(), "KV cache": tensor_bytes([dec.k_cache, dec.v_cache]),
            "recurrent states": tensor_bytes([t for r in rec for t in (r.conv, r.rec)]),
            "per-row tables": tensor_bytes(tables)}


def tp_refusal(model, size):
    """Why the sampler cannot split `model` over tensor-parallel groups of `size` ranks, in a few words naming the
    layer class and the feature; None when it can. The one place that asks layers/ (the run's start, the plan and
    its advice all ask here), so that where the answer comes from can change in one line."""
    from layers import transformer, vision
    if size == 1:
        return None
    # a vision-language model first: its language model sits where the decoder's check would not find its layers
    return "a vision-language model" if vision.is_vision_model(model) else transformer.decide(model, size).sampler


def tp_verdict(model, size):
    """The one line that stops a run (or a plan) whose --tp_size the sampler cannot split `model` over, naming the
    family and the reason; None when it can."""
    why = tp_refusal(model, size)
    return why and (f"tensor-parallel decoding does not run {type(model).__name__} at --tp_size={size} ({why}); "
                    f"--tp_size=1 runs it")


def _decoder_on_meta(model, rows, length, tp_size=1):
    """A StaticDecoder for `rows` rows of `length` tokens built on the meta device (rank 0's slices of a
    tensor-parallel group of `tp_size`), or None where the model's layers are not written out."""
    from layers.engine import StaticDecoder
    from layers.transformer import decide
    from layers.tensor_parallel import Slice
    if decide(model, tp_size).sampler:
        return None
    dec = StaticDecoder(model, rows, -(-length // 64) * 64, tp=Slice(0, tp_size))  # as for_model rounds it
    dec.load(model)
    head, embed = model.lm_head.weight, model.model.embed_tokens.weight
    if head is not embed and dec.w[1]["lm_head"] is dec.w[1]["embed"]:  # meta tensors share data_ptr 0: untie
        dec.w[1]["lm_head"] = torch.empty_like(dec.w[1]["embed"])  # as many rows as the embedding's copy
    return dec


def _has_moe(model):
    from layers import transformer
    return any(transformer.is_moe(getattr(b, "mlp", None)) for b in _blocks(model))


def plan(cfg, config, world, device="cuda", gpu_gib=80.0, host_gib=2048.0, replicas=None):
    """The Plan of the run `cfg` (a config.Config) for the model of `config` on `world` processes, each on a GPU of
    `gpu_gib` GiB (device "cuda") or on the CPU (device "cpu"; per process, the host's share), nodes of
    GPUS_PER_NODE processes with `host_gib` GiB of host memory each. replicas: HSDP's copies of the model (None:
    --replicas, its 0 planned flat); a process holds 1 / (world / replicas) of the state, its copy's share, and
    1 / world of the step's rows."""
    param_dtype, compute, sharded = _dtypes(cfg, device, world)
    replicas = replicas or cfg.replicas or 1
    shards = world // replicas
    cb = compute.itemsize
    model = meta_model(config, param_dtype, cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_modules)
    refused = tp_verdict(model, cfg.tp_size) or (cfg.cp_size > 1 and cp_refusal(model, cfg.cp_size))
    if refused:  # never planned as a path the run would not take
        raise ValueError(refused)
    params = _unique(model.parameters())
    trained = [p for p in params if p.requires_grad]
    blocks = _blocks(model)
    block_params = [set(map(id, b.parameters())) for b in blocks]
    in_blocks = set().union(*block_params)
    root = [p for p in params if id(p) not in in_blocks]
    biggest = max(blocks, key=lambda b: tensor_bytes(list(b.parameters())))
    notes = []
    reference = cfg.beta > 0 and cfg.lora_rank == 0
    ref_dtype = torch.bfloat16 if cfg.ref_bf16 else None

    loading, read = _loading(cfg, config, model, world, device, sharded, param_dtype, notes, shards)
    export = _export(cfg, model, params, shards, device)

    # what stays through the run: the policy's shards, gradients and AdamW's moments and steps, the reference
    state = [("policy parameters", tensor_bytes(params, shards)),
             ("gradients", tensor_bytes(trained, shards)),
             ("AdamW moments", 2 * tensor_bytes(trained, shards)),
             ("AdamW steps", 4 * len(trained))]
    if reference:
        state.append(("reference parameters", tensor_bytes(params, shards, ref_dtype)))
    host = []
    if cfg.cpu_offload and sharded:  # FSDP2's CPUOffloadPolicy: the shards, gradients and AdamW's moments in host memory
        host, state = state, []
        notes.append("training state: on the host (--cpu_offload); each group's shards are copied to the GPU for "
                     "its all-gather")

    # generation: this process's rows of prompt + completion; under tensor parallelism its group's rows, on its
    # slices of the layers
    rows_total = cfg.prompts_per_step * cfg.num_generations // world
    rows, why = decode_rows(cfg, world)
    length = cfg.max_prompt_length + cfg.max_completion_length + 1
    tp = cfg.tp_size
    # sharded experts, or a vision-language model: the sampler takes the model's own forward on gathered blocks
    moe_hf = (sharded and world > 1 and _has_moe(model) and tp == 1) or \
        getattr(config, "vision_config", None) is not None
    dec = None if moe_hf else _decoder_on_meta(meta_model(config, compute, cfg.lora_rank, cfg.lora_alpha,
                                                          cfg.lora_target_modules) if compute != param_dtype
                                               else model, rows * tp, length, tp)
    gen = [part for part in state if part[0] != "gradients"]  # freed after each optimizer step (set_to_none)
    if replicas > 1:  # what a node's processes hold together: a whole copy where a replica is a node
        node, held = min(world, GPUS_PER_NODE), sum(b for _, b in state + host)
        notes.append(f"mesh: {replicas} replicas x {shards} shards (HSDP): a process holds 1/{shards} of the "
                     f"training state, {held / GiB:.1f} GiB; a node's {node} processes hold {node / shards:g} "
                     f"of the model's copies, {node * held / GiB:.1f} GiB together")
    if sharded and tp > 1:  # each tensor's slice cut from the shards, one tensor at a time (Slice.take): no whole
        # layer or root tensor; at most about three slices at once: sent, received, and an adapter's delta added
        slice_bytes = max(-(-p.numel() // tp) for p in params) * cb
        gen.append(("largest tensor's slice cut from the shards, x3", 3 * slice_bytes))
    elif sharded:
        gen.append(("root group gathered", tensor_bytes(root, dtype=compute)))
    if dec is not None:
        sampler = list(decoder_bytes(dec).items())
    else:
        text, heads, kv, hd = _attention_dims(config)
        kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
        attn_layers = sum(k != "linear_attention" for k in kinds)
        gen.append(("blocks gathered (model's own forward)", tensor_bytes([p for b in blocks for p in b.parameters()],
                                                                          dtype=compute)))
        sampler = [("KV cache", 2 * attn_layers * rows * length * kv * hd * cb)]
        notes.append("generation: the sampler runs the model's own forward (sharded MoE experts, or a vision-language "
                     "model) on whole gathered blocks; its KV cache is estimated as every attention layer's full "
                     "length, its recurrent states are not counted")
    gen += sampler
    text = getattr(config, "text_config", None) or config
    slots = -(-length // 64) * 64 if dec is not None else length  # the decoder rounds its cache to 64 slots
    kv_token = dict(sampler).get("KV cache", 0) / max(1, rows * tp * slots)
    group = f", {rows * tp} in each rank's decoder: its tensor-parallel group's rows" if tp > 1 else ""
    notes.append(f"generation: {rows} rows decode at once per process ({why}{group}); the KV cache takes "
                 f"{kv_token / 1024:,.0f} KiB per token of a row" + (" (this rank's heads)" if tp > 1 else ""))
    gen.append(("logits and sampling buffers", rows * tp * -(-text.vocab_size // tp) * (cb + 3 * 4) +
                rows * tp * length * 13))
    generation = Phase("generation", gen)

    training = _training(cfg, config, model, state, root, biggest, sampler, rows_total, compute, sharded, device)

    phases = [loading, generation, training] + ([Phase("training state on the host", host, where="host")]
                                                  if host else []) + [export]
    return Plan(world, device, sum(p.numel() for p in params), sum(p.numel() for p in trained), phases,
                int(gpu_gib * GiB), int(host_gib * GiB), notes,
                lengths=(cfg.max_prompt_length, cfg.max_completion_length), read=read,
                headroom=int(cfg.plan_gpu_headroom * GiB) if device == "cuda" else 0, replicas=replicas)


def decode_rows(cfg, world):
    """(the rows one process decodes at once, why): a stream's places (--rollouts_in_flight; with --max_staleness
    and none set, every row of the K + 1 steps it holds), else a batch of --generation_batch_size, else the step's
    rows on the process."""
    rows_total = cfg.prompts_per_step * cfg.num_generations // world
    if cfg.rollouts_in_flight:
        return min(cfg.rollouts_in_flight, rows_total * (cfg.max_staleness + 1)), "--rollouts_in_flight"
    if cfg.max_staleness:  # a stream's places: the next steps' rows decode beside the step's own
        return rows_total * (cfg.max_staleness + 1), f"every row of {cfg.max_staleness + 1} steps: --max_staleness " \
                                                     f"without --rollouts_in_flight"
    if cfg.generation_batch_size and cfg.generation_batch_size < rows_total:
        return cfg.generation_batch_size, "--generation_batch_size"
    return rows_total, "the step's rows on a process"


def _loading(cfg, config, model, world, device, sharded, param_dtype, notes, shards):
    """(the loading Phase, the bytes each process reads from the checkpoint); appends its notes to `notes`.

    With several processes each builds the model on the meta device, shards it and reads its own shards of the
    policy and the reference from the folder's files (runs/setup.py; a vision-language model's language model and
    vision tower alike, LoRA's adapters and routing replay's routers added on the meta model); with one, the whole
    model, and the reference as a copy (LoRA makes none: its reference is the policy without its adapters). What a
    process holds is its shards; the files' pages it maps while reading them are page cache (docs/memory.md)."""
    import model_loading
    reference = cfg.beta > 0 and cfg.lora_rank == 0
    params = _unique(model.parameters())
    whole = tensor_bytes(params)
    ref_dtype = torch.bfloat16 if cfg.ref_bf16 else None
    from layers import lora
    quantized = _mxfp4_experts(model) if model_loading.quantization(config) == "mxfp4" else set()
    adapters = {id(p) for m in lora.lora_modules(model).values() for p in (m.lora_A, m.lora_B)}
    stored = {id(p): None if id(p) in adapters else _stored_dtype(config, param_dtype) for p in params}
    if world > 1:
        parts = [("policy shards", tensor_bytes(params, shards))] + (
            [("reference shards", tensor_bytes(params, shards, ref_dtype))] if reference else [])
        read = sum(_read_bytes(t, shards, stored[id(t)], quantized) for t in params) * (2 if reference else 1)
        notes.append(f"loading: each process reads its own shards from a folder of safetensors or .bin weights (a hub "
                     f"id's, in the Hugging Face cache); a hub id not downloaded yet builds the whole model in each "
                     f"process instead ({whole / GiB:.1f} GiB, twice with a reference)")
    else:
        parts = [("whole model", whole)] + ([("reference copy", whole)] if reference else [])
        read = sum(_read_bytes(t, 1, stored[id(t)], quantized) for t in params)
        then = ", then the reference as a copy of it" if reference else \
            " (no reference copy: " + ("beta 0)" if cfg.beta == 0 else "LoRA's is the policy without its adapters)")
        notes.append(f"loading: the one process builds the model on its device{then}")
    if model_loading.quantization(config):
        if quantized:  # transformers' convert_moe_packed_tensors on one expert: its output, the 4-bit codes as int32
            n = max(t[0].numel() for t in params if id(t) in quantized)  # indices and their lookup, the transpose
            b = param_dtype.itemsize
            parts.append(("one expert dequantized at a time", max(int(1.5 * b * n) + 2 * n, 2 * b * n)))
        notes.append(f"loading: quantization_config mxfp4: the checkpoint's experts are MXFP4, dequantized as they are "
                     f"read (each process its own); counted here dequantized, in {str(param_dtype)[6:]}; each process "
                     f"reads {read / GiB:.1f} GiB of the checkpoint")
    return Phase("loading", parts, where="host" if sharded and world > 1 or device == "cpu" else "gpu"), read


def _stored_dtype(config, param_dtype):
    """The dtype a checkpoint of `config` stores its weights in: its config's dtype, else the parameters'."""
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(saved, str):
        saved = getattr(torch, saved.removeprefix("torch."), None)
    return saved if isinstance(saved, torch.dtype) else param_dtype


def _mxfp4_experts(model):
    """The ids of the parameters an MXFP4 checkpoint stores in blocks and scales: gpt-oss's fused expert tensors
    (E, in, out), in blocks of 32 values along `in` (runs/weights.py's mxfp4), LoRA-adapted ones too."""
    import re
    return {id(p) for n, p in model.named_parameters()
            if re.sub(r"\.parametrizations\.([^.]+)\.original$", r".\1", n).endswith(
                ("experts.gate_up_proj", "experts.down_proj")) and p.dim() == 3 and p.shape[1] % 32 == 0}


def _read_bytes(t, world, stored, quantized):
    """Bytes one of `world` processes reads of parameter `t` from the files: its rows as stored (LoRA's adapters are
    not in the files: `stored` is None for them), an MXFP4 expert tensor's as half a byte a value and a byte of scale
    for each 32."""
    if stored is None:
        return 0
    values = shard_numel(t, world)
    if id(t) in quantized:
        return values // 2 + values // 32
    return values * stored.itemsize


def _export(cfg, model, params, world, device):
    """What exporting the trained model adds on a host process (rank 0's, the largest; runs/export.py), at the tensor
    where it is most (`_export_peak`), and a LoRA-adapted weight's merge beside it: this rank's rows merged into a
    copy, 64 MiB of float32 rows at a time."""
    from layers import lora
    parts = _export_peak(model, params, world, device)
    adapted = [model.get_parameter(lora._weight_keys(name, m)[0]) for name, m in lora.lora_modules(model).items()]
    if adapted:
        parts.append(("LoRA merge: a weight's rows merged, float32 rows", max(tensor_bytes([w], world)
                                                                            for w in adapted) + (64 << 20)))
    return Phase("export", parts, where="host")


def _export_peak(model, params, world, device):
    """[(label, bytes)] of the tensor the export holds most for: the tensor gathered whole (one process on a CPU
    reads its own tensors in place), and beside it the most of what comes in turn: while it is gathered, pieces of
    sharding.GATHER_PIECE_BYTES from all ranks together; the NaN check's temporaries (export.check_bytes); its copy
    in the checkpoint's layout, where the family keeps another (transformers' reverse conversion run on the meta
    tensor: the storages it makes), run only for a tensor that could be the most."""
    import re

    import sharding
    from runs import export
    from transformers.core_model_loading import revert_weight_conversion
    gathered = world > 1 or device == "cuda"
    best, names = None, {id(p): n for n, p in model.named_parameters()}
    for p in sorted(params, key=lambda t: -tensor_bytes([t])):  # the largest first: few conversions run
        whole = tensor_bytes([p]) if gathered else 0
        check = min(p.numel(), export.CHECK_ELEMENTS) * export.check_bytes(p.dtype) // export.CHECK_ELEMENTS
        pieces = 0
        if world > 1 and p.dim():  # rank 0's piece and every rank's, a few rows of each shard (full_host_tensor)
            row = tensor_bytes([p]) // max(1, p.shape[0])
            n = min(max(1, sharding.GATHER_PIECE_BYTES // world // max(1, row)), -(-p.shape[0] // world))
            pieces = (world + 1) * n * row
        if best is not None and whole + max(pieces, check, tensor_bytes([p])) <= best[0]:
            continue  # a layout copy is at most the tensor: this one cannot be more, no conversion to run
        name = re.sub(r"\.parametrizations\.([^.]+)\.original$", r".\1", names.get(id(p), ""))
        meta = torch.empty(p.shape, dtype=p.dtype, device="meta")
        own = meta.untyped_storage()._cdata
        made = {v.untyped_storage()._cdata: v.untyped_storage().nbytes()
                for v in revert_weight_conversion(model, {name: meta}).values() if v.untyped_storage()._cdata != own}
        layout = sum(made.values())
        extra = max(("gather pieces in flight", pieces), ("NaN check, a chunk at a time", check),
                    ("its copy in the checkpoint's layout", layout), key=lambda kv: kv[1])
        if best is None or whole + extra[1] > best[0]:
            short = ".".join(name.split(".")[-2:])[:36] or "a tensor"
            best = (whole + extra[1], [(f"gathered whole: {short}", whole)] * gathered + [extra])
    return best[1] if best else []


def _training(cfg, config, model, state, root, biggest, sampler, rows_total, compute, sharded, device):
    """The training Phase: one micro-batch's forward and backward on top of the state that stays through the run
    (and with --max_staleness the `sampler`'s parts, (name, bytes): its decoder or cache and the rows in flight)."""
    cb = compute.itemsize
    rows_step = max(1, rows_total // cfg.steps_per_generation)
    width = cfg.max_prompt_length + cfg.max_completion_length
    mb_rows = max(1, cfg.micro_batch_tokens // width) if cfg.micro_batch_tokens else cfg.micro_batch_size
    mb_rows = min(mb_rows, rows_step)
    tr = list(state)
    if sharded:
        tr.append(("root group gathered", tensor_bytes(root, dtype=compute)))
        block = tensor_bytes(list(biggest.parameters()), dtype=compute)
        tr.append(("two blocks gathered, one's gradient", 2 * block + tensor_bytes(
            [p for p in biggest.parameters() if p.requires_grad], dtype=compute)))
    if cfg.max_staleness:  # the stream's decoder or cache and its rows in flight wait through the step
        tr += [(f"{name} (kept through the step: --max_staleness)", size) for name, size in sampler]
    positions, shape, tree = mb_rows * width, f"{mb_rows} rows x {width} positions", 0
    if cfg.shared_prompts and _shares_prompts(model):  # each group's prompt once, its rows' completions as branches
        positions, shape, tree = _trees(cfg, config, mb_rows, cb, device)
    exchange = 0
    if cfg.cp_size > 1:  # one rank's micro-batch a forward, its positions split over the group (sequence_parallel)
        positions, shape = -(-positions // cfg.cp_size), f"{shape}, 1/{cfg.cp_size} of them"
        exchange = exchange_bytes(config, positions, cb, cfg.cp_size, cfg.gradient_checkpointing)
    kept, recomputed = activation_bytes(config, positions, cb, cfg.gradient_checkpointing)
    if cfg.gradient_checkpointing:
        recomputed += tree
    else:
        kept += tree
    tr.append((f"activations ({shape}{', layer inputs: checkpointed' if cfg.gradient_checkpointing else ''})", kept))
    if recomputed:
        tr.append(("one layer recomputed in backward", recomputed))
    if exchange:
        tr.append(("all-to-all buffers (heads for positions, and back)", exchange))
        tr.append(("final hidden states back to the rows' rank", mb_rows * width * config.get_text_config().hidden_size
                   * cb))
    head_kept, head_transient = logprob_bytes(config, mb_rows * cfg.max_completion_length, cb, device)
    tr.append(("log-prob head: kept for backward", head_kept))
    tr.append(("log-prob head: a chunk's buffers, the gradient", head_transient))
    return Phase("training", tr)


def _trees(cfg, config, mb_rows, cb, device):
    """A micro-batch of `mb_rows` rows packed as trees (--shared_prompts): (positions computed, their description,
    the bytes the branches' attention keeps besides: on a CPU the probabilities SDPA's math kernel keeps under a
    mask, (rows, heads, C, P + C) per attention layer, one layer's with checkpointing). With the branches' copies
    of their prompt's keys not counted, within 15% of what autograd keeps (tests/test_plan.py)."""
    p, c = cfg.max_prompt_length, cfg.max_completion_length
    trees = -(-mb_rows // cfg.num_generations)
    text, heads, _, _ = _attention_dims(config)
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    layers = 1 if cfg.gradient_checkpointing else sum(k != "linear_attention" for k in kinds)
    probabilities = mb_rows * c * (p + c) * heads * cb * layers if device == "cpu" else 0
    return trees * p + mb_rows * c, f"{trees} prompt(s) of {p} + {mb_rows} x {c} positions", probabilities


def _shares_prompts(model):
    """Whether --shared_prompts packs this model's training rows as trees (logprobs.shares_prompts)."""
    import logprobs
    from layers import transformer
    return logprobs.shares_prompts(model, transformer.decide(model).trains_written_out(model))


# ----------------------------------------------------------------------------- what would make it fit


def _candidates(cfg, config, world, device):
    """(what to type, the changed settings) worth trying at `world` processes, cheapest to the run first."""
    out = []
    if not cfg.gradient_checkpointing:
        out.append(("--gradient_checkpointing=true", dict(gradient_checkpointing=True)))
    mb = cfg.micro_batch_size
    while mb > 1 and not cfg.micro_batch_tokens:
        mb //= 2
        out.append((f"--micro_batch_size={mb}", dict(micro_batch_size=mb)))
    g, _ = decode_rows(cfg, world)
    while g > 1:  # fewer rows decoding at once: a stream's places, else a batch (which a stream has none of)
        g //= 2
        key = "rollouts_in_flight" if cfg.rollouts_in_flight or cfg.max_staleness else "generation_batch_size"
        out.append((f"--{key}={g}", {key: g}))
    t = cfg.tp_size
    model = meta_model(config, _dtypes(cfg, device, world)[0], cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_modules)
    while t * 2 <= min(world, GPUS_PER_NODE) and world % (t * 2) == 0:  # groups within a node
        t *= 2
        if not tp_refusal(model, t):  # a size the sampler cannot split this model over is no advice
            out.append((f"--tp_size={t}", dict(tp_size=t)))
    c = cfg.cp_size
    while c * 2 <= min(world, GPUS_PER_NODE) and world % (c * 2) == 0 and not cfg.shared_prompts:  # within a node
        c *= 2
        if cp_refusal(model, c) is None:
            out.append((f"--cp_size={c}", dict(cp_size=c)))
    if world > 1 and not cfg.cpu_offload:
        out.append(("--cpu_offload", dict(cpu_offload=True)))
    if cfg.beta > 0 and cfg.lora_rank == 0 and not cfg.ref_bf16:
        out.append(("--ref_bf16", dict(ref_bf16=True)))
    if "dtype" not in cfg.model_init_kwargs:
        out.append(("--model_init_kwargs='{\"dtype\": \"bfloat16\"}'",
                    dict(model_init_kwargs={**cfg.model_init_kwargs, "dtype": "bfloat16"})))
    # last, and only where the settings above cannot fit the run (`_fit_at`): these change the experiment
    if cfg.lora_rank == 0:
        out.append(("--lora_rank=16", dict(lora_rank=16)))
    if cfg.beta > 0 and cfg.lora_rank == 0:
        out.append(("--beta=0 (no reference model)", dict(beta=0.0)))
    return out


EXPERIMENT = ("lora_rank", "beta")  # settings whose change trains another model or objective, advised last


def cp_refusal(model, size):
    """Why a model's training forward cannot split a row over `size` ranks (features/sequence_parallel.py)."""
    from features import sequence_parallel
    return sequence_parallel.refusal(model, size)


def _more_gpus(cfg, world, most=64):
    """The larger numbers of GPUs (doubling, up to `most`) the step's rows split over evenly."""
    out, w = [], world
    while w * 2 <= most:
        w *= 2
        if cfg.prompts_per_step * cfg.num_generations % w == 0:
            out.append(w)
    return out


def advise(cfg, config, p, more_gpus=True, **limits):
    """Fill p.advice and p.fix for a plan that does not fit: the settings that alone make the whole plan fit at its
    world size, else the fewest, chosen greedily, that do together; only where none do, more GPUs (with settings if
    need be; never on a CPU plan, whose processes share one machine's memory); else what is missing."""
    if not p.over():
        return p
    fit, chosen, left = _fit_at(cfg, config, p.world, p.device, limits)
    if fit is None and more_gpus and p.device == "cuda":
        for w in _more_gpus(cfg, p.world):
            more, _, _ = _fit_at(cfg, config, w, p.device, limits, bare=True)
            if more is not None:
                advice, change = more
                gpus = "one GPU" if p.world == 1 else f"{p.world} GPUs"
                p.advice = [f"no setting fits {gpus}; {w} GPUs do: --plan_world_size={w}" +
                            (f", with {advice.removeprefix('fits with ')}" if change else "")]
                p.fix = (change, w)
                return p
    if fit is not None:
        p.advice, p.fix = [fit[0]], (fit[1], p.world)
        return p
    more = "more memory per GPU or more GPUs" if p.device == "cuda" else "more memory"
    p.advice = [f"does not fit with the settings there are ({' '.join(chosen)} still leaves "
                f"{', '.join(f'{ph.name} over by {b / GiB:.1f} GiB' for ph, b in left.over())}); it would take "
                f"{more}"]
    return p


def replicas_at(cfg, config, world, device, limits, local=GPUS_PER_NODE):
    """The copies of the model (HSDP) `world` processes hold, `local` on each node: --replicas, else one per node where
    the plan at that mesh fits, else 1 (one flat mesh: a node's processes alone cannot hold the model's state)."""
    nodes = world // local if world % local == 0 else 1
    if cfg.replicas or nodes <= 1:
        return cfg.replicas or 1
    q = _plan_or_none(dataclasses.replace(cfg, replicas=nodes), config, world, device, limits)
    return nodes if q is not None and not q.over() else 1


def node_replicas(cfg, world, local):
    """replicas_at for the run starting here: this machine's device and memory, the model's config; 1 (flat) where
    the plan cannot be made (a config it cannot read), as a run without a plan would be."""
    cuda = torch.cuda.is_available() and cfg.device != "cpu"
    host, _ = host_memory(cfg, world, "cuda" if cuda else "cpu")
    gpu = torch.cuda.get_device_properties(0).total_memory / GiB if cuda else host / local
    try:
        return replicas_at(cfg, model_config(cfg), world, "cuda" if cuda else "cpu", dict(gpu_gib=gpu, host_gib=host),
                           local)
    except (OSError, ValueError):
        return 1


def _plan_or_none(cfg, config, world, device, limits):
    """The plan, or None where the settings are ones the run would refuse (a --tp_size, LoRA on a model)."""
    try:
        return plan(cfg, config, world, device, **limits)
    except ValueError:
        return None


def _fit_at(cfg, config, world, device, limits, bare=False):
    """What makes the run fit at `world` processes: ((advice, the settings changed), None, None), from the settings
    that do alone (or, `bare`, none at all), else the fewest that do together; else (None, the settings tried
    together, the plan they still leave)."""
    if bare:
        q = _plan_or_none(cfg, config, world, device, limits)
        if q is not None and not q.over():
            return (f"fits with --plan_world_size={world}", {}), None, None
    everything = _candidates(cfg, config, world, device)
    same = [(label, change) for label, change in everything if not set(change) & set(EXPERIMENT)]
    # the settings that keep the experiment first (memory and speed only); LoRA or no reference only if they cannot
    for tried in (same, everything) if len(same) < len(everything) else (everything,):
        alone = [(label, change) for label, change in tried
                 if (q := _plan_or_none(dataclasses.replace(cfg, **change), config, world, device, limits)) is not None
                 and not q.over()]
        if alone:
            return (f"fits with any one of: {', '.join(_first_of_each([a[0] for a in alone]))}", alone[0][1]), \
                None, None
        chosen, cur, q = _together(cfg, config, world, device, tried, limits)
        if q is not None and not q.over():
            change = {f.name: getattr(cur, f.name) for f in dataclasses.fields(cur)
                      if getattr(cur, f.name) != getattr(cfg, f.name)}
            return (f"fits with all of: {' '.join(chosen)}", change), None, None
    return None, chosen, q or plan(cfg, config, world, device, **limits)


def _together(cfg, config, world, device, tried, limits):
    """Greedily, the change that lowers the largest excess most (one value of each setting), until the plan fits or
    six are chosen; then the mildest value of each halved setting that still fits beside the others: (the labels
    chosen, the settings, the last plan)."""
    chosen, cur, q = [], cfg, None
    for _ in range(6):
        best = None
        for label, change in tried:
            if label.split("=")[0] in {c.split("=")[0] for c in chosen}:
                continue
            q2 = _plan_or_none(dataclasses.replace(cur, **change), config, world, device, limits)
            worst = math.inf if q2 is None else max((b for _, b in q2.over()), default=0)
            if best is None or worst < best[0]:
                best = (worst, label, change, q2)
        if best is None or best[3] is None:
            break
        _, label, change, q = best
        chosen.append(label)
        cur = dataclasses.replace(cur, **change)
        if not q.over():
            break
    if q is None or q.over():
        return chosen, cur, q
    for i, picked in enumerate(chosen):  # tried lists each setting's values mildest first
        key = picked.split("=")[0]
        for label2, change2 in tried:
            if label2 == picked:  # only milder values than the one picked
                break
            if label2.split("=")[0] != key:
                continue
            milder = _plan_or_none(dataclasses.replace(cur, **change2), config, world, device, limits)
            if milder is not None and not milder.over():
                chosen[i], cur = label2, dataclasses.replace(cur, **change2)
                break
    return chosen, cur, q


def _first_of_each(labels):
    """The mildest of each kind of change (the first --micro_batch_size that fits, not every smaller one)."""
    seen, out = set(), []
    for label in labels:
        key = label.split("=")[0]
        if key not in seen:
            seen.add(key)
            out.append(label)
    return out


# ----------------------------------------------------------------------------- printing


def report(p, host_from=""):
    """The plan as text: each phase's parts and total, what does not fit, the verdict with the lengths it assumed
    and the advice. host_from: which figure the host memory is (printed beside it)."""
    where = "GPU" if p.device == "cuda" else "process"
    mesh = f" as {p.replicas} replicas x {p.world // p.replicas} shards" if p.replicas > 1 else ""
    lines = [f"memory plan: {p.params / 1e6:,.1f} M parameters ({p.trained / 1e6:,.1f} M trained), {p.world} "
             f"process{'es' if p.world > 1 else ''}{mesh}; per {where}: {_size(p.gpu_bytes).strip()}"
             + (f" ({_size(p.headroom).strip()} of it left free: --plan_gpu_headroom)" if p.headroom else "")
             + ", host per node "
             f"({min(p.world, GPUS_PER_NODE)} processes): {_size(p.host_bytes).strip()}"
             + (f" ({host_from})" if host_from else "")]
    for ph in p.phases:
        on = "per host process" if ph.where == "host" else f"per {where}"
        lines.append(f"  {ph.name} ({on}): {_size(ph.total).strip()}")
        lines += [f"    {label:52s} {_size(b)}" for label, b in ph.parts]
    lines += [f"  note: {n}" for n in p.notes]
    for ph, b in p.over():
        lines.append(f"  does not fit: {ph.name}, {b / GiB:.1f} GiB over")
    # every row is planned at its longest: a task whose prompts are short fits more with a lower --max_prompt_length
    prompt, completion = p.lengths
    assumed = f" (rows planned at prompts of {prompt} tokens, --max_prompt_length, and completions of {completion})"
    lines += [f"  {a}{assumed}" for a in p.advice] or ([f"  fits{assumed}"] if not p.over() else [])
    return "\n".join(lines)


def _size(b):
    return f"{b / GiB:9.2f} GiB" if b >= GiB / 10 else f"{b / (1 << 20):9.2f} MiB"


def machine_host_gib():
    """This machine's memory in GiB (/proc/meminfo), 0 where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            return int(next(line for line in f if line.startswith("MemTotal")).split()[1]) / (1 << 20)
    except (OSError, StopIteration, ValueError):
        return 0.0


NODE_HOST_GIB = 2048.0  # a node of 8 x 80 GB GPUs (2 TiB of host memory): the figure docs/memory.md's table assumes


def host_memory(cfg, world, device):
    """(GiB of host memory per node, which figure that is): --plan_host_memory; else, planning GPUs for other than
    this machine's processes (a node from a laptop), a node's; else this machine's."""
    if cfg.plan_host_memory:
        return cfg.plan_host_memory, "--plan_host_memory"
    if device == "cuda" and world != int(os.environ.get("WORLD_SIZE", "1")):
        return NODE_HOST_GIB, "a node's by default, not this machine's: --plan_host_memory sets it"
    return machine_host_gib(), "this machine's: --plan_host_memory sets it"


def run(cfg):
    """`train.py --plan`: the plan of the run `cfg` as text, from the model's config alone. A --tp_size the sampler
    cannot split the model over is said first, in the line the run would stop with, then planned at --tp_size=1."""
    world = cfg.plan_world_size or int(os.environ.get("WORLD_SIZE", "1"))
    from config import validate
    validate(cfg, world)  # the rows must split over the processes planned for, as they must in the run
    device = "cpu" if cfg.device == "cpu" else "cuda"
    host, host_from = host_memory(cfg, world, device)
    try:
        config = model_config(cfg)
    except (OSError, ValueError) as e:
        raise SystemExit(f"model: {e} (the plan needs the model's config.json alone, never its weights)") from e
    import model_loading
    try:  # a quantization loading would refuse, refused here
        model_loading.quantization(config)
    except ValueError as e:
        raise SystemExit(f"model: {e}") from e
    limits = dict(gpu_gib=cfg.plan_gpu_memory if device == "cuda" else host / min(world, GPUS_PER_NODE),
                  host_gib=host)
    model = meta_model(config, _dtypes(cfg, device, world)[0], cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_modules)
    said = ""  # a size the run would refuse: said first, in the line the run would stop with, then planned at 1
    for key, why in (("tp_size", tp_verdict(model, cfg.tp_size)),
                     ("cp_size", cfg.cp_size > 1 and cp_refusal(model, cfg.cp_size))):
        if why:
            said += f"--{key}: {why}. The plan at --{key}=1:\n"
            cfg = dataclasses.replace(cfg, **{key: 1})
    cfg = dataclasses.replace(cfg, replicas=replicas_at(cfg, config, world, device, limits))  # as the run would
    p = plan(cfg, config, world, device, **limits)
    return said + report(advise(cfg, config, p, **limits), host_from)


# ----------------------------------------------------------------------------- the table of docs/memory.md

# Published configs, the fields that set memory (the rest are transformers' defaults). Qwen3.8-27B: the Qwen3.5
# hybrid architecture, dense; its shapes are Qwen3.5-27B's (3 Gated DeltaNet layers to 1 gated attention layer).
SHAPES = {
    "Qwen3-8B": ("Qwen3Config", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                     vocab_size=151936, tie_word_embeddings=False)),
    "Qwen3.8-27B": ("Qwen3_5TextConfig", dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                                              num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                                              linear_num_key_heads=16, linear_num_value_heads=48,
                                              linear_key_head_dim=128, linear_value_head_dim=128,
                                              linear_conv_kernel_dim=4, vocab_size=248320,
                                              tie_word_embeddings=False,
                                              layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16)),
    "Qwen3-30B-A3B": ("Qwen3MoeConfig", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                             num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                             head_dim=128, num_experts=128, num_experts_per_tok=8,
                                             norm_topk_prob=True, decoder_sparse_step=1, vocab_size=151936,
                                             tie_word_embeddings=False)),
    "gpt-oss-120b": ("GptOssConfig", dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
                                          num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                                          num_local_experts=128, num_experts_per_tok=4, sliding_window=128,
                                          layer_types=["sliding_attention", "full_attention"] * 18,
                                          vocab_size=201088, tie_word_embeddings=False, dtype="bfloat16",
                                          # as published: the experts in MXFP4, the rest in bfloat16
                                          quantization_config={"quant_method": "mxfp4"})),
}


def shape_config(name):
    import transformers
    cls, fields = SHAPES[name]
    return getattr(transformers, cls)(**fields)


def table(completion_lengths=(4096, 16384), world=8, gpu_gib=80.0, host_gib=2048.0, names=tuple(SHAPES),
          tp_sizes=(1, 8)):
    """docs/memory.md's table: each model of SHAPES on `world` GPUs at each completion length and tensor-parallel
    size, with the settings the table states (LoRA rank 16 for gpt-oss-120b), as markdown rows."""
    from config import Config
    rows = ["| model | completion | setting | params | loading, host per process | generation per GPU | "
            "training per GPU | fits today? |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in names:
        config = shape_config(name)
        for t, tp in [(t, tp) for t in completion_lengths for tp in tp_sizes]:
            cfg = Config(max_completion_length=t, max_prompt_length=512, prompts_per_step=32, num_generations=8,
                         micro_batch_size=1, gradient_checkpointing=True, tp_size=tp,
                         model_init_kwargs={"dtype": "bfloat16"} if name == "gpt-oss-120b" else {},
                         lora_rank=16 if name == "gpt-oss-120b" else 0)
            limits = dict(gpu_gib=gpu_gib, host_gib=host_gib)
            p = advise(cfg, config, plan(cfg, config, world, "cuda", **limits), more_gpus=False, **limits)
            setting = ("LoRA r16, bf16 weights" if cfg.lora_rank else "full, fp32 master") + \
                (f", --tp_size={tp}" if tp > 1 else "")
            g = {ph.name: ph.total / GiB for ph in p.phases}
            verdict = "yes" if not p.over() else "no: " + "; ".join(p.advice)
            # a quantized checkpoint: what each process reads of it beside the dequantized shards it holds
            read = f" (reads {p.read / GiB:.0f} GiB of its MXFP4 checkpoint)" if getattr(
                config, "quantization_config", None) else ""
            rows.append(f"| {name} | {t // 1024}k | {setting} | {p.params / 1e9:.1f} B | "
                        f"{g['loading']:.0f} GiB{read} | "
                        f"{g['generation']:.0f} GiB | {g['training']:.0f} GiB | {verdict} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
