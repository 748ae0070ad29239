"""What a weight is under FSDP2: a plain tensor, or a DTensor whose rows some ranks cut between them.

FSDP2 cuts a parameter's dim 0 into chunks of ceil(n / size) rows, the last ones short or empty. On a flat mesh
every rank holds a chunk (placement Shard(0)); under HSDP (sharding.setup's 2-D mesh, replicate x shard) the
ranks of each replica cut it so, and every replica holds the same chunks (Replicate(), Shard(0)). Whatever reads
or cuts a shard's rows (sharded loading, LoRA's adapters, tensor-parallel slices, the export) asks `dim0_mesh`
which ranks those are.
"""


def is_shard(t):
    """True for a DTensor: a weight of an FSDP2-sharded module outside a gather."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(t, DTensor)


def dim0_mesh(t):
    """The 1-D mesh whose ranks cut DTensor t's dim 0 into FSDP2's chunks: the whole mesh when it is flat, its
    "shard" dimension under HSDP. None for a plain tensor or any other layout."""
    if not is_shard(t):
        return None
    from torch.distributed.tensor import Replicate, Shard
    placements = tuple(t.placements)
    if placements == (Shard(0),):
        return t.device_mesh
    if placements == (Replicate(), Shard(0)):
        return t.device_mesh["shard"]
    return None
