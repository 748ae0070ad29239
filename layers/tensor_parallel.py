"""Tensor parallelism for the fast decoder: which slice of each weight a rank holds, and the sum that joins them.

A tensor-parallel group of T ranks decodes the same rows, each rank holding 1/T of every layer (Megatron-LM's
split, Shoeybi et al. 2019; gpt-fast's `tp.py` for decoding): the projections into heads or into the MLP's
intermediate dimension are cut by their outputs (q/k/v by heads, gate/up by intermediate columns: a "column"
slice), the projections back to the hidden size by their inputs (o, down: a "row" slice). Each rank then computes
its heads and its intermediate columns whole, and its output projection gives a partial sum of the layer's output:
one all-reduce after the attention and one after the MLP joins them. A bias of a row-sliced projection is added by
rank 0 alone. The vocabulary is cut the same way: each rank holds rows of the embedding and of the head.

Everything of tensor parallelism is here: `summed`, the sum after each of a layer's two blocks (`p.reduce`, which
transformer.layer_params applies for a sliced decoder); `CUTS` and `Slice.cut`, how each kind of a layer's weight is
cut (transformer.layer_params names the kind of each), with `Slice.experts` for the MoE experts (whose copies
layers/static_moe.py holds; layers/static_recurrent.py names a Gated DeltaNet rank's heads itself,
`delta_net_spans`, from a Slice's rank and size); `refusal`, what a model's sizes cannot be cut into
(transformer.decide asks it); `Slice.reduce`, the sum (PyTorch's functional collectives); the vocabulary
(`Slice.embed`, and `best_of_slices` / `gather_vocab` behind sampling.Draw.sliced); and the group's rows and answers
(`group_rows`, `group_respond`), which sampling gathers before decoding and takes back after; the groups themselves
(`groups`). With size 1 every slice is the whole tensor and `reduce` is the identity. Of the project it imports only
layers/shards.py (what a shard is).

Slices from FSDP2's shards. Every cut is a list of spans along one dimension, a function of the rank's Slice
(`pieces`, `Slice.take`), so that any rank can say what any other rank takes. A weight that is an FSDP2 shard (a
DTensor split by rows over the processes) is then cut without being gathered: each rank sends every other rank the
rows (or row-pieces) of its shard that the other's spans cover, in one all-to-all (`_fetch`), and holds only its own
slice, never the whole tensor, let alone the whole layer. Small tensors (norms, routers, an adapter's factor on the
side a cut leaves whole) are gathered whole, one at a time (`Slice.whole`).
"""

import dataclasses
import math

import torch

from layers.shards import dim0_mesh, is_shard


# How each kind of weight is cut: transformer.layer_params names the kind of each of a layer's weights, and
# `Slice.cut` cuts it. kind -> (the dimension cut, what it is, for an error). Besides these, "kv_heads" (the K/V
# projections, by outputs, in shares of the K/V heads: `Slice.kv_share`) and "vocabulary" (the embedding's and the
# head's rows, in ceil-sized shares, the last one shorter). MoE experts are cut along their intermediate dimension
# (`Slice.experts`), Gated DeltaNet layers by key and value heads (static_recurrent.delta_net_spans);
# layers/static_moe.py and layers/static_recurrent.py hold those copies.
CUTS = {
    "heads": (0, "a projection into the query heads"),     # by outputs: q, the query's gate, a sink per head
    "kv_heads": (0, "the K/V projections"),
    "columns": (0, "a projection into the MLP"),          # by outputs: gate, up
    "inputs": (-1, "a projection's inputs"),              # back to the hidden size: o, down; bias on rank 0
}


@dataclasses.dataclass(frozen=True)
class Slice:
    """This rank's place in its tensor-parallel group: rank in [0, size), the process group (None: size 1). to:
    (device, dtype) of the slices cut from FSDP2's shards, as FSDP2's gather would give them (the decoder's); it
    names no place in the group, so two Slices that differ in it alone are equal."""
    rank: int = 0
    size: int = 1
    group: object = None
    to: tuple = dataclasses.field(default=None, compare=False)

    def span(self, n, what="a dimension", even=True):
        """(start, stop) of this rank's share of n. even: n must split into `size` equal shares (heads,
        intermediate columns); else the shares are ceil(n / size) long, the last one shorter (the vocabulary)."""
        if even:
            if n % self.size:
                raise ValueError(f"tensor parallelism over {self.size} ranks: {what} ({n}) does not divide by "
                                 f"{self.size}")
            step = n // self.size
        else:
            step = -(-n // self.size)
        return min(n, self.rank * step), min(n, (self.rank + 1) * step)

    def pieces(self, n, what="a dimension", groups=1):
        """This rank's spans [(start, stop)] of a dimension of n that holds `groups` pieces one after another (gate
        then up, as torch.chunk splits them), each cut apart: its share of each piece, in order."""
        step = max(1, -(-n // groups))
        return [tuple(lo + x for x in self.span(min(step, n - lo), what)) for lo in range(0, n, step)]

    def take(self, t, dim, spans, copy=False):
        """This rank's spans of t along dim, concatenated in order, where spans(Slice) -> [(start, stop)] says what
        any rank of the group takes (a function of that rank's Slice). t whole: narrowed here (a view where there is
        one span, unless `copy`). t an FSDP2 shard: a collective over its mesh, whose ranks take the same tensors in
        the same order (`_fetch`): this rank receives its spans, cast and moved as `to` says, and None where it
        takes nothing."""
        if not is_shard(t):
            parts = [t.narrow(dim, a, b - a) for a, b in spans(self)]
            return torch.cat(parts, dim) if len(parts) > 1 else parts[0].clone() if copy else parts[0]
        mesh = dim0_mesh(t)  # the ranks cutting dim 0: the whole mesh, or under HSDP this rank's replica
        if mesh is None:  # another layout: gathered whole, this tensor alone
            return self.take(self.whole(t), dim, spans, copy)
        me = mesh.get_local_rank()
        if me % self.size != self.rank:
            raise ValueError(f"rank {me} of the mesh is not rank {self.rank} of its tensor-parallel group: groups "
                             f"must be consecutive ranks of the FSDP2 mesh (`groups`)")
        # the groups are consecutive ranks of the mesh: its rank m is rank m % size of its group
        wants = [spans(dataclasses.replace(self, rank=m % self.size)) for m in range(mesh.size())]
        device, dtype = self.to or (None, None)
        return _fetch(t, dim % t.dim(), wants, me, mesh.get_group(), device, dtype)

    def whole(self, t):
        """t whole: a small tensor (a norm, a router, an adapter's factor), gathered from its shards where it is an
        FSDP2 shard (a collective), cast and moved as `to` says; t itself where it is whole."""
        if not is_shard(t):
            return t
        device, dtype = self.to or (None, None)
        mesh = dim0_mesh(t)
        if mesh is not None:  # every rank takes every row
            return _fetch(t, 0, [[(0, t.shape[0])]] * mesh.size(), mesh.get_local_rank(), mesh.get_group(), device,
                          dtype)
        return t.to(device=device or t.device, dtype=dtype or t.dtype).full_tensor()

    def part(self, t, dim=0, what="a dimension", groups=1):
        """This rank's share of t along dim, a new contiguous tensor. groups: dim holds that many equal pieces
        one after another (gate then up, q then its gate), each cut apart and the shares concatenated."""
        if t is None:
            return None
        n = t.shape[dim]
        return self.take(t, dim, lambda s: s.pieces(n, what, groups), copy=True)

    def cut(self, t, kind, kv_heads=None):
        """This rank's share of the weight t, cut as `kind` says (`CUTS`; None: whole); kv_heads: the model's K/V
        heads, for a "kv_heads" cut."""
        if self.size == 1 or t is None or kind is None:
            return t
        if kind == "vocabulary":
            n = t.shape[0]
            return self.take(t, 0, lambda s: [s.span(n, even=False)])
        dim, what = CUTS[kind]
        n = t.shape[dim]
        if kind == "kv_heads":
            return self.take(t, dim, lambda s: s.kv_share(kv_heads).pieces(n, what), copy=True)
        return self.take(t, dim, lambda s: s.pieces(n, what), copy=True)

    def weight(self, module, kind, kv_heads=None):
        """This rank's share of the weight the linear layer `module` applies now (engine.Whole.weight, cut). A layer
        that applies another weight than its own cuts it itself (a LoRA adapter's: its delta merged in, from a
        shard's cut where the layer is sharded, the factor on the cut's side cut alike: `applied_share`)."""
        part = lambda t: self.cut(t, kind, kv_heads)  # noqa: E731
        share = getattr(module, "applied_share", None)
        return share(part, kind == "inputs", self.whole) if share is not None else part(module.weight.detach())

    def bias(self, t, kind, kv_heads=None):
        """This rank's share of the bias of a weight cut as `kind` says: an "inputs" cut's bias is whole, added by
        rank 0 alone; the others' are cut as their weights' outputs."""
        return self.first(t) if kind == "inputs" else self.cut(t, kind, kv_heads)

    def experts(self, t, dim, interleaved, what="the experts' intermediate size"):
        """This rank's share of a fused gate-and-up weight (or bias) of the experts along its output dimension
        `dim`: with `interleaved` gate and up alternate (g0, u0, g1, u1, ...: gpt-oss), and whole (gate, up) pairs
        are cut, so the gate function finds this rank's gates and ups at the even and odd places it reads; else I
        gate outputs come before I up outputs, each cut apart, this rank's gates then its ups."""
        n = t.shape[dim]
        if interleaved:
            return self.take(t, dim, lambda s: [(2 * a, 2 * b) for a, b in s.pieces(n // 2, what)], copy=True)
        return self.part(t, dim, what, groups=2)

    def kv_share(self, kv_heads):
        """The share of the K/V heads this rank holds, as a Slice over them: with fewer K/V heads than ranks, each
        rank holds the one its query heads read (a copy per size / kv_heads ranks, as Megatron-LM and vLLM
        replicate them)."""
        if kv_heads >= self.size:
            return self
        return Slice(self.rank // (self.size // kv_heads), kv_heads, self.group)

    def embed(self, ids, rows, start):
        """The embedding of ids from this rank's rows of the table, those of ids start, start + 1, ... (a
        "vocabulary" cut): the other ranks' ids embed as zeros here, and the sum over the group is exact."""
        end = start + rows.shape[0]
        mine = (ids >= start) & (ids < end)
        x = torch.nn.functional.embedding((ids - start).clamp(0, max(end - start - 1, 0)), rows) * mine[..., None]
        return self.reduce(x)

    def first(self, t):
        """t on rank 0, None on the others: the bias of a row-sliced projection, added once to the sum (an FSDP2
        shard: sent whole to the groups' ranks 0, a collective)."""
        if t is None or not is_shard(t):
            return t if self.rank == 0 else None
        n = t.shape[0]
        return self.take(t, 0, lambda s: [(0, n)] if s.rank == 0 else [])

    def reduce(self, x):
        """The sum of x over the group (an all-reduce); x itself with one rank."""
        if self.size == 1:
            return x
        import torch.distributed._functional_collectives as funcol
        return funcol.all_reduce(x, "sum", self.group)

    def best_of_slices(self, score, z, start):
        """The token and its log-prob per row, each rank holding the scores (n, V_r) and tempered logits z of the
        vocabulary ids start, start + 1, ...: each rank's best score with its id, its logit and the slice's
        log-sum-exp are gathered (4 numbers a row; ids as float32, exact below 2^24), and the first rank holding the
        maximum wins, as argmax over the whole vocabulary would pick it."""
        best, index = score.max(-1)  # the first maximum of the slice
        mine = torch.stack([best, (index + start).float(), z.gather(-1, index[:, None])[:, 0], torch.logsumexp(z, -1)])
        every = self.gather_rows(mine[None])  # (ranks, 4, n)
        winner = every[:, 0].argmax(0)  # (n,): the first slice holding the maximum
        pick = every.gather(0, winner[None, None].expand(1, 4, -1))[0]  # (4, n)
        return pick[1].long(), pick[2] - torch.logsumexp(every[:, 3], 0)

    def gather_vocab(self, logits, vocab):
        """The logits (n, vocab) from each rank's slice (n, V_r): the slices padded to the first's width, gathered."""
        width = -(-vocab // self.size)  # every slice's but the last's (`span`)
        every = self.gather_rows(torch.nn.functional.pad(logits, (0, width - logits.shape[-1]))[None])  # (ranks, n, w)
        return every.permute(1, 0, 2).flatten(1)[:, :vocab]

    def group_rows(self, ids, mask, seeds, pad_id):
        """The group's rows from each rank's (rank r's n rows at r * n ...): left-padded prompt ids and masks, padded
        to the group's widest prompt, and their seeds; and the padding this rank's prompts took."""
        width = int(self.gather_rows(torch.tensor([ids.shape[1]], device=ids.device)).max())
        pad = width - ids.shape[1]
        ids = self.gather_rows(torch.nn.functional.pad(ids, (pad, 0), value=pad_id))
        mask = self.gather_rows(torch.nn.functional.pad(mask.long(), (pad, 0)))
        return ids, mask, self.gather_rows(seeds), pad

    def group_respond(self, respond, n):
        """An environment's `respond` over the group's rows (`group_rows`) from this rank's own `respond` over its n
        rows: it answers the turns of its rows, and the answers are shared over the group in one collective per
        pause (every rank of a group meets the same pauses)."""
        import torch.distributed as dist

        def group(turns):
            mine = [t._replace(row=t.row - self.rank * n) for t in turns if t.row // n == self.rank]
            answers = dict(zip((t.row + self.rank * n for t in mine), respond(mine) if mine else []))
            every = [None] * self.size
            dist.all_gather_object(every, answers, group=self.group)
            joined = {k: v for part in every for k, v in part.items()}
            return [joined[t.row] for t in turns]
        return group

    def gather_rows(self, x):
        """x (n, ...) of every rank of the group, concatenated in rank order along dim 0 (same n on every rank)."""
        if self.size == 1:
            return x
        import torch.distributed._functional_collectives as funcol
        gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # the name before torch 2.13
        return gather(x.contiguous(), 0, self.group)


def _fetch(t, dim, wants, me, group, device=None, dtype=None):
    """Mesh rank me's spans wants[me] of the DTensor t along dim, concatenated in order, None where it wants none;
    wants[m]: the spans [(start, stop)] of every rank m of t's mesh (each rank passes the same list).

    t is split by rows as FSDP2 splits it (torch.chunk's shares: ceil(n / ranks) rows each, the last ones shorter or
    empty). What rank m holds of a span is the rows of its shard the span covers (dim 0), or its shard's columns of
    the span (another dim); each rank sends each other rank those pieces of its shard, cast to `dtype` (as FSDP2
    casts before its gather), in one all_to_all_single over the mesh's group (gloo and NCCL both take uneven
    splits). A rank holds its shard, the pieces it sends (for a slice, about one slice: W / T ranks take each) and
    those it receives (its spans): never t whole, unless its spans are all of t (`Slice.whole`)."""
    local = t.to_local()
    device, dtype = device or local.device, dtype or local.dtype
    n, ranks = t.shape[0], len(wants)
    step = -(-n // ranks)
    held = [(min(n, m * step), min(n, (m + 1) * step)) for m in range(ranks)]
    if local.shape[0] != held[me][1] - held[me][0]:
        raise ValueError(f"a shard of {local.shape[0]} rows where FSDP2's split of {n} rows over {ranks} ranks gives "
                         f"{held[me][1] - held[me][0]}")

    def piece(m, span):
        """(rows of t, columns along dim or None) of what rank m holds of span; its shape."""
        (a, b), (r0, r1) = span, held[m]
        rows, cols = ((max(a, r0), max(a, r0, min(b, r1))), None) if dim == 0 else ((r0, r1), (a, b))
        shape = [rows[1] - rows[0], *t.shape[1:]]
        if cols:
            shape[dim] = b - a
        return rows, cols, shape

    sends = [[piece(me, s) for s in wants[m]] for m in range(ranks)]  # to each rank, in its spans' order
    recvs = [[piece(m, s) for s in wants[me]] for m in range(ranks)]  # from each rank, in this rank's spans' order
    size = lambda pieces: sum(math.prod(shape) for _, _, shape in pieces)  # noqa: E731
    send = torch.empty(sum(map(size, sends)), device=device, dtype=dtype)
    at = 0
    for rows, cols, shape in (p for pieces in sends for p in pieces if math.prod(p[2])):
        src = local.narrow(0, rows[0] - held[me][0], rows[1] - rows[0])
        src = src if cols is None else src.narrow(dim, cols[0], cols[1] - cols[0])
        send[at:at + src.numel()].view(shape).copy_(src)
        at += src.numel()
    recv = torch.empty(sum(map(size, recvs)), device=device, dtype=dtype)
    import torch.distributed as dist
    dist.all_to_all_single(recv, send, [size(p) for p in recvs], [size(p) for p in sends], group=group)
    del send
    mine = wants[me]
    if not mine:
        return None
    shape = list(t.shape)
    shape[dim] = sum(b - a for a, b in mine)
    if len(mine) == 1:  # the ranks' pieces of one span, in rank order, are its rows one after another
        return recv.view(shape)
    out, at = torch.empty(shape, device=device, dtype=dtype), 0
    for m in range(ranks):
        offset = 0  # where each span begins along dim
        for (a, b), (rows, cols, piece_shape) in zip(mine, recvs[m]):
            k = math.prod(piece_shape)
            if not k:
                offset += b - a
                continue
            into = out.narrow(dim, offset + (rows[0] - a if dim == 0 else 0), piece_shape[dim])
            into = into if dim == 0 else into.narrow(0, rows[0], rows[1] - rows[0])
            into.copy_(recv[at:at + k].view(piece_shape))
            at, offset = at + k, offset + b - a
    return out


def summed(block):
    """A decoder layer's block (its attention or its MLP, transformer.layer's `p.mix` or `p.mlp`) followed by the
    group's sum of its output: a rank's heads, or its intermediate columns, give a partial sum of the block's
    output (the row-sliced o and down projections), which `p.reduce` (`Slice.reduce`) joins before the layer's
    post-norm and residual add."""
    def block_then_sum(h, p, *rest):
        return p.reduce(block(h, p, *rest))
    return block_then_sum


def refusal(config, vocab, size, whole_projection_norms=False):
    """Why a model of this config (and `vocab` output rows) cannot be cut over `size` ranks, None where it can:
    every dimension a slice cuts must divide by `size` (K/V heads may instead divide `size`: each rank then
    holds the one its query heads read), and q/k norms over the whole projection (OLMo 2/3's) need every head."""
    if whole_projection_norms:
        return "q and k norms over the whole projection, which a rank holding some heads cannot compute"
    # what the attention, the MLPs, the experts and the recurrent layers are cut along
    for what in ("num_attention_heads", "intermediate_size", "moe_intermediate_size",
                 "shared_expert_intermediate_size", "linear_num_key_heads", "linear_num_value_heads"):
        n = getattr(config, what, None)
        if isinstance(n, int) and n % size:
            return f"{what} = {n} does not divide over {size} tensor-parallel ranks"
    if -(-vocab // size) * (size - 1) >= vocab:
        return f"a vocabulary of {vocab} leaves the last of {size} tensor-parallel ranks no rows"
    kv = config.num_key_value_heads
    if kv % size and size % kv:
        return f"num_key_value_heads = {kv} neither divides over {size} tensor-parallel ranks nor divides {size}"
    return None


WHOLE = Slice()  # one rank: every weight whole


def groups(d, size):
    """Split the processes into groups of `size` consecutive ranks (0..size-1, size..2*size-1, ...), each of which
    decodes its ranks' rows together, every rank holding 1/size of each layer; d.tp becomes this rank's Slice. Every
    rank makes every group, in the same order, as torch.distributed asks. Under HSDP a group lies inside one replica
    (its size divides a replica's processes), so its cuts come from that replica's shards."""
    import torch.distributed as dist
    if size == 1:
        d.tp = Slice()
        return d.tp
    if d.world_size % size:
        raise ValueError(f"tp_size={size} does not divide the {d.world_size} processes")
    mine = None
    for start in range(0, d.world_size, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= d.rank < start + size:
            mine = group
    d.tp = Slice(d.rank % size, size, mine)
    return d.tp
