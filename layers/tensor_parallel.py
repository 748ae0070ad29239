"""Tensor parallelism for the fast decoder: which slice of each weight a rank holds, and the sum that joins them.

A tensor-parallel group of T ranks decodes the same rows, each rank holding 1/T of every layer (Megatron-LM's
split, Shoeybi et al. 2019; gpt-fast's `tp.py` for decoding): the projections into heads or into the MLP's
intermediate dimension are cut by their outputs (q/k/v by heads, gate/up by intermediate columns: a "column"
slice), the projections back to the hidden size by their inputs (o, down: a "row" slice). Each rank then computes
its heads and its intermediate columns whole, and its output projection gives a partial sum of the layer's output:
one all-reduce after the attention and one after the MLP joins them. A bias of a row-sliced projection is added by
rank 0 alone. The vocabulary is cut the same way: each rank holds rows of the embedding and of the head.

Everything of tensor parallelism is here but the two sums in transformer.layer (`p.reduce`): `CUTS` and
`Slice.cut`, how each kind of a layer's weight is cut (transformer.layer_params names the kind of each), with
`Slice.experts` and `Slice.delta_net_spans` for the MoE experts and the Gated DeltaNet heads (whose copies
layers/static_moe.py and layers/static_recurrent.py hold); `refusal`, what a model's sizes cannot be
cut into (transformer.decide asks it); `Slice.reduce`, the sum (PyTorch's functional collectives); the vocabulary
(`Slice.embed`, and `best_of_slices` / `gather_vocab` behind sampling.Draw.sliced); and the group's rows and
answers (`group_rows`, `group_respond`), which sampling gathers before decoding and takes back after. With size 1
every slice is the whole tensor and `reduce` is the identity. It imports nothing of the project.
"""

import dataclasses

import torch


# How each kind of weight is cut: transformer.layer_params names the kind of each of a layer's weights, and
# `Slice.cut` cuts it. kind -> (the dimension cut, what it is, for an error). Besides these, "kv_heads" (the K/V
# projections, by outputs, in shares of the K/V heads: `Slice.kv_share`) and "vocabulary" (the embedding's and the
# head's rows, in ceil-sized shares, the last one shorter). MoE experts are cut along their intermediate dimension
# (`Slice.experts`), Gated DeltaNet layers by key and value heads (`Slice.delta_net_spans`); layers/static_moe.py
# and layers/static_recurrent.py hold those copies.
CUTS = {
    "heads": (0, "a projection into the query heads"),     # by outputs: q, the query's gate, a sink per head
    "kv_heads": (0, "the K/V projections"),
    "columns": (0, "a projection into the MLP"),          # by outputs: gate, up
    "inputs": (-1, "a projection's inputs"),              # back to the hidden size: o, down; bias on rank 0
}


@dataclasses.dataclass(frozen=True)
class Slice:
    """This rank's place in its tensor-parallel group: rank in [0, size), the process group (None: size 1)."""
    rank: int = 0
    size: int = 1
    group: object = None

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

    def part(self, t, dim=0, what="a dimension", groups=1):
        """This rank's share of t along dim, a new contiguous tensor. groups: dim holds that many equal pieces
        one after another (gate then up, q then its gate), each cut apart and the shares concatenated."""
        if t is None:
            return None
        pieces = t.chunk(groups, dim) if groups > 1 else (t,)
        out = []
        for piece in pieces:
            a, b = self.span(piece.shape[dim], what)
            out.append(piece.narrow(dim, a, b - a))
        return torch.cat(out, dim) if len(out) > 1 else out[0].clone()

    def cut(self, t, kind, kv_heads=None):
        """This rank's share of the weight t, cut as `kind` says (`CUTS`; None: whole); kv_heads: the model's K/V
        heads, for a "kv_heads" cut."""
        if self.size == 1 or t is None or kind is None:
            return t
        if kind == "vocabulary":
            a, b = self.span(t.shape[0], even=False)
            return t[a:b]
        if kind == "kv_heads":
            return self.kv_share(kv_heads).part(t, 0, CUTS[kind][1])
        dim, what = CUTS[kind]
        return self.part(t, dim, what)

    def bias(self, t, kind, kv_heads=None):
        """This rank's share of the bias of a weight cut as `kind` says: an "inputs" cut's bias is whole, added by
        rank 0 alone; the others' are cut as their weights' outputs."""
        return self.first(t) if kind == "inputs" else self.cut(t, kind, kv_heads)

    def experts(self, t, dim, interleaved, what="the experts' intermediate size"):
        """This rank's share of a fused gate-and-up weight (or bias) of the experts along its output dimension
        `dim`: with `interleaved` gate and up alternate (g0, u0, g1, u1, ...: gpt-oss), and whole (gate, up) pairs
        are cut, so the gate function finds this rank's gates and ups at the even and odd places it reads; else I
        gate outputs come before I up outputs, each cut apart, this rank's gates then its ups."""
        if interleaved:
            return self.part(t.unflatten(dim, (-1, 2)), dim, what).flatten(dim, dim + 1)
        return self.part(t, dim, what, groups=2)

    def delta_net_spans(self, nk, nv, dk, dv):
        """This rank's rows of a Gated DeltaNet layer (nk key heads of dk, nv value heads of dv), in the model's
        coordinates, as lists of (start, stop): "qkv" its rows of in_proj_qkv (q, k and v each by heads), which are
        also its channels of the convolution; "values" its value heads' dv-wide rows of in_proj_z and columns of
        out_proj; "heads" its value heads (rows of in_proj_b and in_proj_a, A_log, dt_bias); "in" its rows of the
        four input projections stacked (an adapter's stacked B). Contiguous shares: key head i serves value heads
        [i nv/nk, (i + 1) nv/nk), so a rank's nk/T key heads serve exactly its nv/T value heads."""
        if nk % self.size or nv % self.size:
            raise ValueError(f"tensor parallelism over {self.size} ranks: the Gated DeltaNet's key heads ({nk}) and "
                             f"value heads ({nv}) must each divide by {self.size}")
        (k0, k1), (v0, v1) = self.span(nk, "key heads"), self.span(nv, "value heads")
        key, value = nk * dk, nv * dv
        qkv = [(k0 * dk, k1 * dk), (key + k0 * dk, key + k1 * dk), (2 * key + v0 * dv, 2 * key + v1 * dv)]
        c = 2 * key + value
        return {"qkv": qkv, "values": [(v0 * dv, v1 * dv)], "heads": [(v0, v1)],
                "in": qkv + [(c + v0 * dv, c + v1 * dv), (c + value + v0, c + value + v1),
                             (c + value + nv + v0, c + value + nv + v1)]}

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
        """t on rank 0, None on the others: the bias of a row-sliced projection, added once to the sum."""
        return t if self.rank == 0 else None

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
