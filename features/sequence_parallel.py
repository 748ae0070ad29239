"""--cp_size=C: sequence parallelism for the training forward (Ulysses; Jacobs et al. 2023, DeepSpeed-Ulysses), so
that a row longer than one process's activations trains over C processes.

Groups of C consecutive ranks train their rows together. The sampler, the rewards and the loss keep each rank's
own rows, as without it; only the forward is shared (`Forward`, the innermost variant of `run.forward`):
  1. the group's laid-out rows are gathered, so that every rank of the group holds all of them, padded to one
     width that C divides;
  2. rank c runs the layers over positions [c w / C, (c + 1) w / C) of every row: its embeddings, norms,
     projections and MLP, and so its activations, are 1/C of the rows';
  3. in each attention an all-to-all trades positions for heads: rank c gets every position of heads
     [c h / C, (c + 1) h / C) and attends over the whole rows, then a second all-to-all trades back (`Attention`).
     K/V heads split the same way, keeping each query head with its K/V head; a model with fewer K/V heads than
     C (or a count C does not divide) repeats them to one per query head first, as verl and prime-rl do;
  4. the final hidden states go back to the rank that owns each row (a third all-to-all), whose head computes
     its rows' log-probs as it always does: the head's positions are 1/C of the group's as well.
Every all-to-all is differentiable (its backward is the reverse exchange), so each rank's loss on its own rows
sends its gradient back to the ranks that computed those positions, and the gradient is one process's: the
loss's token counts and sums are the core's own, unchanged. FSDP2 shards the model over every rank, the group's
together with the others (torchtitan's dp_shard x cp). The group's forwards take turns (`in_turn`, the wrapper of
`run.micro_batches`): each carries one rank's micro-batch, so that a forward's positions are one rank's rows.

A model that trains on its own forward (the MoE families) runs it over its positions the same way, with the
exchange as its attention modules' attention: registered with transformers' AttentionInterface under `ATTENTION` and
switched on in the model's config for the forward's length alone and for each checkpointed layer's recompute
(`_own_forward`); the sampler's forwards never see it.

What it refuses, at start in one line (`refusal`): layers that carry a state along the sequence (Gated DeltaNet's
recurrence: a rank's positions would need the state of the positions before them), a vision-language model (its
images' positions) and --shared_prompts (a tree's branches cross the position split). Routing replay's records
are split with their positions (`_split_replay`).
"""

import contextlib
import dataclasses
import functools

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import logprobs
import sharding
from layers import routing, transformer, vision

ATTENTION = "grpo_sequence_parallel"  # the name a model's own attention modules find the exchange under
_running = []  # the layout of the split forward running on a model's own forward now (`_own_forward`)


def apply(run):
    """The innermost variant of the training forward; the run stops here, in one line, where `refusal` says so."""
    from runs.cli import ConfigError
    why = refusal(run.policy.lm, run.cfg.cp_size)
    if why is not None:
        raise ConfigError("cp_size", why)
    group = groups(run.d, run.cfg.cp_size)
    run.forward = Forward(run.forward, group)
    run.paths = f"{run.paths}, each row's positions split over {run.cfg.cp_size} ranks (--cp_size)"  # the banner's
    inner = run.micro_batches
    run.micro_batches = lambda run, *rest: in_turn(inner(run, *rest), run.d, *group)


def in_turn(micro, d, rank, group):
    """This rank's micro-batches taking turns with the group's: the group's forward k carries the rows of rank
    k % C alone (its micro-batch k // C), the others' micro-batch there empty, so that a forward's positions are
    one rank's rows split C ways (C rows of one rank each would be a whole row's positions again). First every
    rank's micro-batches are made as many as the most any rank has (a token budget gives each its own number):
    the core's own evening-out (train.mini_batches) then finds them even."""
    most = int(sharding.all_gather_rows(torch.tensor([len(micro)], device=d.device), d).max())
    micro = logprobs.split_micro_batches(micro, most)
    out = []
    for mb in micro:
        empty = logprobs.MicroBatch(mb.rows[:0], mb.cols, mb.t, 1)  # no rows, no columns to pad the others to
        out += [mb if r == rank else empty for r in range(dist.get_world_size(group))]
    return out


def groups(d, size):
    """(this rank's place in its group, the group): groups of `size` consecutive ranks, every rank making every
    group in the same order, as torch.distributed asks."""
    mine = None
    for start in range(0, d.world_size, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= d.rank < start + size:
            mine = group
    return d.rank % size, mine


def refusal(model, size):
    """Why `model`'s training forward cannot be split over `size` ranks' positions, None where it can (the settings
    it cannot take with: config.validate)."""
    name = type(model).__name__
    if vision.is_vision_model(model):
        return f"{name} sees images, whose positions in a row the split does not follow"
    for layer in model.model.layers:
        if not transformer._attends(layer):
            mixer = getattr(layer, "linear_attn", None) or layer
            return (f"{type(mixer).__name__} carries a recurrent state along the sequence: a rank's positions would "
                    f"need the state of all the positions before them")
    heads = model.config.num_attention_heads
    if heads % size:
        return f"{name}'s {heads} attention heads do not divide into {size} groups"
    return None


class Forward(logprobs.Around):
    """The training forward around `inner` (the plain `logprobs.Forward`), its layers split by positions over the
    group `group` = (this rank's place, the process group) of C ranks; C = 1 runs `inner` as it is."""

    def __init__(self, inner, group):
        super().__init__(inner)
        self.rank, self.group = group
        self.size = dist.get_world_size(self.group) if self.group is not None else 1

    def hidden(self, model, rows, extras):
        if self.size == 1:
            return self.inner.hidden(model, rows, extras)
        c, size, group = self.rank, self.size, self.group
        n, w = rows.ids.shape
        told = _gather(torch.tensor([[n, w, rows.mask is not None]], device=rows.ids.device), group).tolist()
        counts = [(cn, cw) for cn, cw, _ in told]
        # the rows of the ranks that hold any (in turns: one), padded to a width C divides
        width = -(-max((cw for cn, cw in counts if cn), default=1) // size) * size
        chunk = width // size
        ids = _rows_of_group(rows.ids, counts, width, group, 0)
        positions = _rows_of_group(rows.positions, counts, width, group, 0)
        # the rows' real tokens where a rank's layout keeps a mask (every rank attends over every row); None: plain
        # causal, each row's padding moved to its end
        keys = _rows_of_group(rows.real.long(), counts, width, group, 0).bool() if any(m for *_, m in told) else None
        mine = slice(c * chunk, (c + 1) * chunk)
        _split_replay(model, counts, width, group, mine)
        if self.inner.written_out(model):  # sliding windows count positions, as transformer._masks does
            layout = Attention(group, size, c, keys, positions, mine)
            hidden = transformer.hidden_states(model, ids[:, mine], layout, positions[:, mine])  # (rows, chunk, H)
        else:  # the model's own masks count columns
            columns = torch.arange(width, device=ids.device).expand(ids.shape)
            layout = Attention(group, size, c, keys, columns, mine)
            hidden = _own_forward(model, ids[:, mine], positions[:, mine], layout)
        # back to the rows' owners: rank r takes its rows' chunk from every rank, chunk c from rank c
        sizes = [cn for cn, _ in counts]
        got = _all_to_all(hidden, [n] * size, sizes, group)  # (C * n, chunk, H), chunk by chunk
        h = hidden.shape[-1]
        return got.view(size, n, chunk, h).transpose(0, 1).reshape(n, width, h)[:, :w]


class Attention:
    """The layout `transformer.hidden_states` takes for a rank's positions of the group's rows (`attend(window)`):
    each layer's attention trades positions for heads, attends over whole rows and trades back. keys (rows, width)
    bool: the rows' real tokens where the layout keeps a mask (None: plain causal); positions (rows, width): what a
    sliding window counts."""

    def __init__(self, group, size, rank, keys, positions, mine):
        self.group, self.size, self.rank = group, size, rank
        self.keys, self.positions, self.mine = keys, positions, mine
        self.masks = {}  # by window: built once a forward (a model's own layers ask for it layer by layer)

    def attend(self, window):
        if window not in self.masks:
            masks = transformer._masks({window}, self.keys, self.positions, self.positions.device)
            self.masks[window] = _Exchange(self, masks[window])
        return self.masks[window]


class _Exchange:
    """One layer kind's attention under the exchange: a callable (q, k, v, p), as `transformer._laid_out_layer`
    takes a mask that attends itself."""

    def __init__(self, layout, mask):
        self.layout, self.mask = layout, mask

    def __call__(self, q, k, v, p):
        size, group, c = self.layout.size, self.layout.group, self.layout.rank
        heads, kv = q.shape[2], k.shape[2]
        if kv % size:  # fewer K/V heads than ranks (or not a multiple): one per query head, then split alike
            k, v = k.repeat_interleave(heads // kv, 2), v.repeat_interleave(heads // kv, 2)
        q, k, v = (_heads_for_positions(x, size, group) for x in (q, k, v))
        if p.sinks is not None:  # a learned logit per head: this rank's heads'
            share = p.sinks.shape[0] // size
            p = dataclasses.replace(p, sinks=p.sinks[c * share:(c + 1) * share])
        o = transformer._self_attention(q, k, v, self.mask, p)  # (rows, width, heads / C, hd)
        return _positions_for_heads(o, size, group)


@dataclasses.dataclass
class _Scores:
    """What `transformer.attention` reads of a layer's settings, for a model's own attention module."""
    scaling: float
    softcap: float = None
    sinks: torch.Tensor = None


def _own_forward(model, ids, positions, layout):
    """The model's own forward over this rank's positions, its attention modules attending through the exchange;
    with activation checkpointing, each layer's recompute in backward switches the exchange on again (torch's
    checkpoint `context_fn`), for the same layout. The exchange is registered with transformers under ATTENTION below."""
    checkpointed = [layer for layer in model.model.layers if getattr(layer, "gradient_checkpointing", False)]
    kept = [layer._gradient_checkpointing_func for layer in checkpointed]
    for layer, checkpoint in zip(checkpointed, kept):
        layer._gradient_checkpointing_func = functools.partial(
            checkpoint, context_fn=lambda: (contextlib.nullcontext(), _exchanging(model, layout)))
    try:
        with _exchanging(model, layout):
            return model.base_model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
    finally:
        for layer, checkpoint in zip(checkpointed, kept):
            layer._gradient_checkpointing_func = checkpoint


@contextlib.contextmanager
def _exchanging(model, layout):
    """The model's attention modules attend through the exchange over `layout` inside the `with`."""
    config = model.config
    before, config._attn_implementation = config._attn_implementation, ATTENTION
    _running.append(layout)
    try:
        yield
    finally:
        config._attn_implementation = before
        _running.pop()


def _own_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                   s_aux=None, **_):
    """A model's own attention module's attention (transformers' AttentionInterface): query (B, heads, S, hd), key
    and value (B, kv heads, S, hd) of this rank's positions -> (B, S, heads, hd) and no weights. The mask the module
    passes is for its positions alone; the layout's masks cover the whole rows."""
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    return _running[-1].attend(sliding_window)(q, k, v, _Scores(scaling, None, s_aux)), None


def _heads_for_positions(x, size, group):
    """x (rows, chunk, heads, hd), this rank's positions of every head -> (rows, C * chunk, heads / C, hd), every
    position of this rank's heads (head group c from rank c' arrives as positions chunk c')."""
    n, chunk, heads, hd = x.shape
    out = _all_to_all(x.reshape(n, chunk, size, heads // size, hd).permute(2, 0, 1, 3, 4).contiguous(), None, None,
                      group)
    return out.permute(1, 0, 2, 3, 4).reshape(n, size * chunk, heads // size, hd)


def _positions_for_heads(x, size, group):
    """The inverse of `_heads_for_positions`: (rows, C * chunk, heads / C, hd) -> (rows, chunk, heads, hd)."""
    n, width, h, hd = x.shape
    chunk = width // size
    out = _all_to_all(x.reshape(n, size, chunk, h, hd).transpose(0, 1).contiguous(), None, None, group)
    return out.permute(1, 2, 0, 3, 4).reshape(n, chunk, size * h, hd)


def _all_to_all(x, output_sizes, input_sizes, group):
    """Differentiable all_to_all_single along dim 0 (None: equal splits); its backward is the reverse exchange."""
    out = funcol.all_to_all_single_autograd(x.contiguous(), output_sizes, input_sizes, group)
    return out.wait() if hasattr(out, "wait") else out


def _gather(x, group):
    """Every rank's x (same shape), concatenated along dim 0 in rank order (no gradient)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)


def _rows_of_group(x, counts, width, group, fill):
    """Every rank's rows of x (n_r, w_r, ...), in rank order, each padded at its end to `width` with `fill`."""
    most = max(n for n, _ in counts)
    padded = x.new_full((most, width, *x.shape[2:]), fill)
    padded[:x.shape[0], :x.shape[1]] = x[:, :width]
    parts = _gather(padded, group).view(len(counts), most, width, *x.shape[2:])
    return torch.cat([parts[r, :n] for r, (n, _) in enumerate(counts)])


def _split_replay(model, counts, width, group, mine):
    """Routing replay's records, which its variant of the forward set for this rank's rows (features/routing_replay.py),
    replaced by the group's rows' records at this rank's positions."""
    replay = routing.attached(model)
    if replay is None or replay.mode != "replay":
        return
    records, real = replay.replayed  # (n, w, layers, k), (n, w)
    records = _rows_of_group(records.long(), counts, width, group, 0).to(records.dtype)  # (gloo: no small ints)
    real = _rows_of_group(real.long(), counts, width, group, 0).bool()
    replay.replay(records[:, mine], real[:, mine])


# the exchange as the attention and mask implementations named ATTENTION (the layout holds the masks), which a model's
# own attention modules use only while `_exchanging` names it in their config
AttentionInterface.register(ATTENTION, _own_attention)
AttentionMaskInterface.register(ATTENTION, lambda *args, **kwargs: None)
