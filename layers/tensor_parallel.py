"""Tensor parallelism for the fast decoder: which slice of each weight a rank holds, and the sum that joins them.

A tensor-parallel group of T ranks decodes the same rows, each rank holding 1/T of every layer (Megatron-LM's
split, Shoeybi et al. 2019; gpt-fast's `tp.py` for decoding): the projections into heads or into the MLP's
intermediate dimension are cut by their outputs (q/k/v by heads, gate/up by intermediate columns: a "column"
slice), the projections back to the hidden size by their inputs (o, down: a "row" slice). Each rank then computes
its heads and its intermediate columns whole, and its output projection gives a partial sum of the layer's output:
one all-reduce after the attention and one after the MLP joins them. A bias of a row-sliced projection is added by
rank 0 alone. The vocabulary is cut the same way: each rank holds rows of the embedding and of the head.

`Slice` is what the decoder's files read: the rank, the group's size, `span`/`part` for the slice of a dimension,
and `reduce` for the sum (PyTorch's functional collectives). With size 1 every slice is the whole tensor and
`reduce` is the identity. It imports nothing of the project.
"""

import dataclasses

import torch


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

    def first(self, t):
        """t on rank 0, None on the others: the bias of a row-sliced projection, added once to the sum."""
        return t if self.rank == 0 else None

    def reduce(self, x):
        """The sum of x over the group (an all-reduce); x itself with one rank."""
        if self.size == 1:
            return x
        import torch.distributed._functional_collectives as funcol
        return funcol.all_reduce(x, "sum", self.group)

    def gather_rows(self, x):
        """x (n, ...) of every rank of the group, concatenated in rank order along dim 0 (same n on every rank)."""
        if self.size == 1:
            return x
        import torch.distributed._functional_collectives as funcol
        gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # the name before torch 2.13
        return gather(x.contiguous(), 0, self.group)


WHOLE = Slice()  # one rank: every weight whole
