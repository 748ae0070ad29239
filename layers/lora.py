"""LoRA: low-rank adapters on a model's weight matrices, trained while the weights stay frozen.

`add_lora` wraps the targeted linear layers (LoRALinear) and, for MoE layers whose experts transformers keeps as
fused 3-D parameters, each expert's matrices (LoRAExperts, a parametrization, as PEFT's `target_parameters`);
`--lora_target_modules=all` (the default) finds every weight matrix of the decoder layers but MoE routing. The
reference model is the policy with its adapters off (`adapters_disabled`); the export merges them
(`merge_lora_state_dict`).
"""

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.parametrize as parametrize

from layers.shards import dim0_mesh, is_shard


ALL_TARGETS = "all"  # lora_target_modules' default: every weight matrix of the decoder layers but MoE routing


class LoRALinear(nn.Module):
    """A linear layer plus a trainable low-rank update: y = x W^T + b + (alpha / r) * x A^T B^T (Hu et al., 2021).

    It replaces an nn.Linear in place and keeps its `weight` and `bias` under the
    same names, so checkpoints and FSDP2's fully_shard see ordinary parameters;
    the base weights are frozen. B starts at zero: the adapted model starts as
    the base model. `enabled = False` gives the base model back (the reference).
    """

    def __init__(self, base, rank, alpha):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = nn.Parameter(base.weight.detach(), requires_grad=False)
        self.bias = nn.Parameter(base.bias.detach(), requires_grad=False) if base.bias is not None else None
        # same dtype as the base weight: FSDP2 flattens a block's parameters together and wants one dtype
        kw = dict(dtype=base.weight.dtype, device=base.weight.device)
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **kw))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, **kw))
        self.init_a(self.lora_A)
        self.scaling = alpha / rank
        self.enabled = True
        self.order = 0  # its place among add_lora's adapters: the order they draw their A in (init_adapters)

    @staticmethod
    def init_a(a):
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # nn.Linear's default init, as PEFT does

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        if self.enabled:
            y = y + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling
        return y

    def delta(self, a, b):
        """What merging adds to the weight, from `a` and `b` (this module's, or full copies of sharded ones)."""
        return self.scaling * (b @ a)

    def linear_params(self):
        """What the written-out training forward applies (transformer.Live.linear): (weight, bias), and while the
        adapter is on (A, B, scaling) after them, whose low-rank term transformer._linear adds apart from the weight,
        as `forward` does (the frozen weight then needs no gradient of its own)."""
        if self.enabled:
            return self.weight, self.bias, self.lora_A, self.lora_B, self.scaling
        return self.weight, self.bias

    def applied_weight(self):
        """The weight this layer applies now, as the decoder copies it (engine.Whole.weight): `applied_weight`."""
        return applied_weight(self)

    def applied_share(self, part, inputs=False, whole=lambda t: t):
        """A tensor-parallel rank's share of it (tensor_parallel.Slice.weight): `applied_share`."""
        return applied_share(self, part, inputs, whole)

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features}, rank={self.lora_A.shape[0]}, scaling={self.scaling:g}"


def linear_like(module):
    """True for an nn.Linear or a LoRALinear: a layer the fast decoder reads through `applied_weight`."""
    return type(module) is nn.Linear or type(module) is LoRALinear


def applied_weight(module):
    """The weight a linear layer applies now, detached: its own, plus its adapter's delta where one is on (the
    merged form x (W + s B A)^T of x W^T + s x A^T B^T; equal up to rounding)."""
    w = module.weight.detach()
    if type(module) is LoRALinear and module.enabled:
        w = w + module.delta(module.lora_A.detach(), module.lora_B.detach()).to(w.dtype)
    return w


def applied_share(module, part, inputs=False, whole=lambda t: t):
    """part(applied_weight(module)): a whole weight merged and then cut (the merge's own bits); an FSDP2 shard's
    computed from parts (`applied_part`), never merged or held whole. part, inputs, whole: `applied_part`'s."""
    if is_shard(module.weight):
        return applied_part(module, part, inputs, whole)
    return part(applied_weight(module))


def applied_part(module, part, inputs=False, whole=lambda t: t):
    """part(applied_weight(module)), computed from parts: `part` cuts a tensor along the weight's outputs (its
    rows), or with `inputs` along its inputs (its columns). The weight's part plus the adapter's delta from the same
    part of B (by outputs) or of A (by inputs) and the other factor whole (`whole` of it: a factor gathered from
    its shards), so that the weight is never merged, or held, whole: for a weight that is an FSDP2 shard. The rows of
    B A are those of B times A (the columns, B times A's columns: `part_delta`), so the values are the whole merge's,
    cut."""
    w = part(module.weight.detach())
    if type(module) is LoRALinear and module.enabled:
        w = w + part_delta(module, module.lora_A.detach(), module.lora_B.detach(), part, inputs, whole).to(w.dtype)
    return w


def part_delta(adapter, a, b, part, inputs, whole):
    """part(adapter.delta(a, b)) from a part of one factor (`applied_part`; LoRAExperts' too). By inputs the product is
    taken transposed, (A' B'), each factor's last two dims swapped, and swapped back: its long side (the outputs) then
    stays where it is in the whole product. On a CPU a narrow B A[:, cols] can take another kernel than the whole
    B A and round otherwise (measured: 8 columns of 32 did), while the transposed product gives the whole's bits."""
    if inputs:
        return adapter.delta(whole(b).mT, part(a).mT).mT
    return adapter.delta(whole(a), part(b))


def stacked_low_rank(modules, read=lambda t: t.detach()):
    """The adapters of linear layers whose outputs are concatenated, as one low-rank pair: (A (R, in), B (sum of
    the outputs, R)), each adapter's scaling folded into its block of B, zeros where a layer has no adapter or its
    adapter is off; None when none is a LoRALinear. x A^T B^T is each layer's low-rank term, side by side. read: how a
    factor is read (gathered whole from its shards where they are FSDP2's)."""
    adapted = [m for m in modules if type(m) is LoRALinear]
    if not adapted:
        return None
    a = torch.cat([read(m.lora_A) for m in adapted])
    b = torch.zeros(sum(m.out_features for m in modules), a.shape[0], dtype=a.dtype, device=a.device)
    row = col = 0
    for m in modules:
        if type(m) is LoRALinear:
            r = m.lora_A.shape[0]
            if m.enabled:
                b[row:row + m.out_features, col:col + r] = read(m.lora_B) * m.scaling
            col += r
        row += m.out_features
    return a, b


class LoRAExperts(nn.Module):
    """A low-rank update of every expert in a fused (E, ., .) expert weight: W_e + (alpha / r) * B_e A_e.

    A MoE block in transformers 5 keeps its experts as one 3-D parameter per
    projection, which the experts' forward reads whole (a loop over experts, a
    grouped or a batched matmul, chosen by the config): there is no per-expert
    nn.Linear to replace. So this module is registered on that parameter with
    torch.nn.utils.parametrize, and every read of `experts.gate_up_proj` gets
    the base weight plus the delta, whoever reads it. The base weight stays a
    frozen parameter (at `experts.parametrizations.gate_up_proj.original`) and
    A and B are parameters of the same decoder layer, so fully_shard shards and
    gathers them with the layer and checkpoints hold them like any other.
    Per expert, A is (r, in) and B (out, r), as in LoRALinear; B starts at zero.
    """

    def __init__(self, weight, rank, alpha, transposed):
        super().__init__()
        experts, rows, cols = weight.shape
        # some families store (E, out, in) and read it with F.linear, others (E, in, out) read with a matmul
        # (transformers marks those experts `is_transposed`); A must meet the input side either way
        self.transposed = transposed
        self.in_features, self.out_features = (rows, cols) if transposed else (cols, rows)
        kw = dict(dtype=weight.dtype, device=weight.device)
        self.lora_A = nn.Parameter(torch.empty(experts, rank, self.in_features, **kw))
        self.lora_B = nn.Parameter(torch.zeros(experts, self.out_features, rank, **kw))
        self.init_a(self.lora_A)
        self.scaling = alpha / rank
        self.enabled = True
        self.order = 0  # its place among add_lora's adapters: the order they draw their A in (init_adapters)

    @staticmethod
    def init_a(a):
        bound = 1 / math.sqrt(a.shape[-1])  # LoRALinear's A init (kaiming uniform, a=sqrt(5)), expert by expert
        nn.init.uniform_(a, -bound, bound)

    def delta(self, a, b):
        """What merging adds to the weight, (E, ., .) in its layout, from `a` and `b` (this module's or copies)."""
        d = self.scaling * torch.bmm(b, a)  # (E, out, in)
        return d.transpose(1, 2) if self.transposed else d

    def forward(self, weight):
        if not self.enabled:
            return weight
        return weight + self.delta(self.lora_A, self.lora_B)

    def extra_repr(self):
        return (f"experts={self.lora_A.shape[0]}, in={self.in_features}, out={self.out_features}, "
                f"rank={self.lora_A.shape[1]}, scaling={self.scaling:g}")


def _merge_once_per_forward(experts):
    """Merge each adapted expert weight once per forward of `experts`, instead of at every read.

    The eager experts loop reads the whole fused weight once per expert it
    runs; each read would merge all E experts again. parametrize's cache keeps
    the merged tensor for the length of the forward. The merged copy is then
    held for the backward (a copy of the layer's adapted expert weights; with
    gradient_checkpointing only while a layer is recomputed).
    """
    open_caches = []

    def enter(module, args):
        cache = parametrize.cached()
        cache.__enter__()
        open_caches.append(cache)

    def leave(module, args, output):
        open_caches.pop().__exit__(None, None, None)

    experts.register_forward_pre_hook(enter)
    experts.register_forward_hook(leave, always_call=True)  # also when the forward raises: the cache is global


def _expert_weights(module):
    """The fused expert weights a module holds itself: 3-D, experts first (transformers 5's `*Experts` modules)."""
    n = getattr(module, "num_experts", None)
    if not isinstance(n, int):
        return []
    return [name for name, p in module.named_parameters(recurse=False) if p.dim() == 3 and p.shape[0] == n]


def _adaptable(model):
    """[(name, parent, attribute, is_expert_weight)]: every nn.Linear, and every fused expert weight."""
    found = []
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        found += [(prefix + child_name, module, child_name, False) for child_name, child in module.named_children()
                  if isinstance(child, nn.Linear)]
        found += [(prefix + name, module, name, True) for name in _expert_weights(module)]
    return found


def _short_name(name, is_expert):
    """q_proj for a linear layer, experts.gate_up_proj for an expert weight: what a list of targets may name."""
    return ".".join(name.split(".")[-2:]) if is_expert else name.rsplit(".", 1)[-1]


def _language_model(model):
    """The decoder a model's layers are in: a vision-language model's language model (not its vision tower)."""
    return getattr(model.base_model, "language_model", None) or model.base_model


def _all_targets(model, found):
    """The names "all" adapts: every nn.Linear in the decoder layers except MoE routing, and every expert weight there.

    Routing (a router, a gate, a shared expert's gate) is a linear layer beside
    the experts, in the block that holds them; its weights are not adapted, as
    in PEFT's defaults. Embeddings and lm_head lie outside the layers.
    """
    layers = getattr(_language_model(model), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return []
    paths = {id(m): n for n, m in model.named_modules()}
    inside = tuple(paths[id(layer)] + "." for layer in layers)

    def routes(parent):
        return any(_expert_weights(child) for child in parent.children())
    return [name for name, parent, _, is_expert in found
            if name.startswith(inside) and (is_expert or not routes(parent))]


def add_lora(model, rank, alpha, target_modules):
    """Adapt the layers `target_modules` names with rank-`rank` adapters; freeze everything else.

    "all": every nn.Linear inside the decoder layers (attention, linear
    attention, MLP) except MoE routers and gates, plus every fused expert
    weight there (LoRAExperts). Otherwise each entry is a short name ("q_proj",
    "gate_up_proj") or a dotted tail ("self_attn.q_proj", "experts.down_proj")
    of an nn.Linear or an expert weight anywhere in the model; "all" may be one
    of them. An entry that matches nothing is an error. Returns the names
    adapted. Call it before sharding, so fully_shard wraps the adapted blocks.
    On a model whose parameters are on the meta device (sharded loading), the
    adapters are on meta too: `init_adapters` gives them their values once
    the model has storage, the values they would have had here.
    A vision-language model's adapters go on its language model only: its
    vision tower (whose MLPs share the names) stays as it is.
    """
    if rank < 1:
        raise ValueError(f"lora_rank: must be >= 1, got {rank}")
    entries = target_modules.split(",") if isinstance(target_modules, str) else target_modules
    targets = [t.strip() for t in entries if t.strip()]
    found = _adaptable(model)
    if _language_model(model) is not model.base_model:  # the language model of a vision-language model alone
        inside = {n for n, m in model.named_modules() if m is _language_model(model)}.pop() + "."
        found = [f for f in found if f[0].startswith(inside)]
    have = ", ".join(sorted({_short_name(n, e) for n, _, _, e in found}))
    kinds = "linear layer or expert weight" if any(e for *_, e in found) else "linear layer"

    def matches(name, target):  # a short name ("q_proj") or a dotted tail ("self_attn.q_proj")
        return name == target or name.endswith("." + target)

    if not targets:
        raise ValueError(f"lora_target_modules: empty; say {ALL_TARGETS} or name the layers to adapt "
                         f"(the model has: {have})")
    chosen = set(_all_targets(model, found)) if ALL_TARGETS in targets else set()
    if ALL_TARGETS in targets and not chosen:
        raise ValueError(f"lora_target_modules: {ALL_TARGETS} finds no decoder layers in {type(model).__name__}; "
                         f"name the layers to adapt (the model has: {have})")
    # every entry must match: a typo in one of several would otherwise train fewer adapters than asked for
    named = [t for t in targets if t != ALL_TARGETS]
    unmatched = [t for t in named if not any(matches(n, t) for n, *_ in found)]
    if unmatched:
        names = ", ".join(repr(t) for t in unmatched)
        raise ValueError(f"lora_target_modules: {names} {'matches' if len(unmatched) == 1 else 'match'} no "
                         f"{kinds} (the model has: {have})")
    chosen |= {n for n, *_ in found if any(matches(n, t) for t in named)}
    model.requires_grad_(False)
    adapted, cached = [], set()
    for name, parent, attribute, is_expert in found:
        if name not in chosen:
            continue
        if is_expert:
            weight = getattr(parent, attribute)
            adapter = LoRAExperts(weight, rank, alpha, transposed=getattr(parent, "is_transposed", False))
            parametrize.register_parametrization(parent, attribute, adapter)
            adapter.order = len(adapted)
            if id(parent) not in cached:
                _merge_once_per_forward(parent)
                cached.add(id(parent))
        else:
            adapter = LoRALinear(getattr(parent, attribute), rank, alpha)
            adapter.order = len(adapted)
            setattr(parent, attribute, adapter)
        adapted.append(name)
    return adapted


def init_adapters(model):
    """Give the adapters of a model built on the meta device and sharded (or whole) the values add_lora gives them
    on a real model at this point of the random stream: each A drawn whole on the CPU from the global generator,
    in the order add_lora made them, of which this process keeps its own rows (FSDP2 shards dim 0 in chunks of
    ceil(n / W) rows); each B zero. Every process draws every A (the adapters are small beside the weights), so
    each holds its chunk of exactly the tensor one process would hold whole."""
    with torch.no_grad():
        for adapter in sorted(lora_modules(model).values(), key=lambda m: m.order):
            a = adapter.lora_A
            whole = torch.empty(a.shape, dtype=a.dtype)
            adapter.init_a(whole)
            _local(a).copy_(_own_rows(whole, a))
            _local(adapter.lora_B).zero_()


def _local(p):
    """This process's shard of a parameter (a DTensor's local tensor), or the parameter itself."""
    return p.to_local() if hasattr(p, "to_local") else p


def _own_rows(whole, p):
    """The rows of `whole` that this process's shard of `p` holds: FSDP2's dim-0 chunk of its rank."""
    mesh = dim0_mesh(p)
    if mesh is None or whole.dim() == 0:
        return whole
    rows = -(-whole.shape[0] // mesh.size())
    first = mesh.get_local_rank() * rows
    return whole[first:first + rows]


def lora_modules(model):
    """{name: adapter}: every LoRALinear and LoRAExperts, the modules holding lora_A and lora_B."""
    return {name: m for name, m in model.named_modules() if isinstance(m, (LoRALinear, LoRAExperts))}


def _weight_keys(name, adapter):
    """(the adapted weight's key in the adapted model's state dict, its key in a plain model's)."""
    if isinstance(adapter, LoRALinear):
        return f"{name}.weight", f"{name}.weight"
    owner, rest = name.rsplit(".parametrizations.", 1)  # name: <experts>.parametrizations.<weight>.<index>
    attribute = rest.split(".")[0]
    return f"{owner}.parametrizations.{attribute}.original", f"{owner}.{attribute}"


def lora_summary(model):
    """'LoRA rank 8 on q_proj x2, ..., experts.gate_up_proj x2: 39,424 parameters', or None without adapters."""
    adapters = lora_modules(model)
    if not adapters:
        return None
    kinds = {}
    for name, adapter in adapters.items():
        short = _short_name(_weight_keys(name, adapter)[1].removesuffix(".weight"), isinstance(adapter, LoRAExperts))
        kinds[short] = kinds.get(short, 0) + 1
    rank = next(iter(adapters.values())).lora_A.shape[-2]
    count = sum(a.lora_A.numel() + a.lora_B.numel() for a in adapters.values())
    return f"LoRA rank {rank} on {', '.join(f'{k} x{n}' for k, n in kinds.items())}: {count:,} parameters"


@contextlib.contextmanager
def adapters_disabled(model):
    """The base model inside the block: the LoRA reference without a second copy of the weights (no-op without LoRA)."""
    modules = list(lora_modules(model).values())
    before = [m.enabled for m in modules]
    for m in modules:
        m.enabled = False
    try:
        yield model
    finally:
        for m, on in zip(modules, before):
            m.enabled = on


def merge_lora_state_dict(model, state_dict=None):
    """Plain Hugging Face weights: W + scaling * B A for each adapter, under the plain model's names, no lora keys.

    `state_dict` may be full tensors gathered from a sharded model (same names);
    the scalings and layouts are read from `model`'s adapter modules.
    """
    sd = dict(state_dict if state_dict is not None else model.state_dict())
    renamed = {}
    for name, adapter in lora_modules(model).items():
        a, b = sd.pop(f"{name}.lora_A"), sd.pop(f"{name}.lora_B")
        key, plain = _weight_keys(name, adapter)
        w = sd[key]
        sd[key] = (w.float() + adapter.delta(a.float(), b.float())).to(w.dtype)
        renamed[key] = plain
    return {renamed.get(k, k): v for k, v in sd.items()}
