"""Split-KV attention for one decode step: a Triton kernel and its plain PyTorch reference.

One decode step asks, for every row b and KV head h, that the `rep` query heads sharing that
KV head attend over the row's L cached keys. The arithmetic is tiny (rep x L x hd per pair) and
the time goes into reading K and V, so the kernel's job is to read each cached key and value
exactly once, with enough programs in flight to keep the memory system busy.

The algorithm is the split-KV scheme of Dao, Haziza, Massa and Sizov, "Flash-Decoding for
long-context inference" (2023):

1. Programs form a grid (B * nkv, num_splits). A program loads the rep queries of one (b, h)
   pair as the rows of a tile (padded to 16 rows, the fewest `tl.dot` takes), then walks its
   own contiguous chunk of the L keys in blocks of BLOCK_N. Per block it computes the scores
   with one matmul, and updates, per query row, the running maximum m, the running sum
   l = sum exp(s - m) and the unnormalised output acc = sum exp(s - m) v (the online softmax of
   FlashAttention), rescaling the old l and acc when m grows. Everything is float32; scores are
   kept in base 2 (scale * log2 e folded in) so exp2 does the exponentials.
2. With one split, that program divides acc by l and writes the output directly. With several,
   each writes its (m, l, acc) to a float32 scratch buffer, and a second kernel, one program per
   (b, h), merges the splits with the same rescaling and divides once.

Splitting L is what gives small batches enough programs: `_plan` picks the number of splits from
the shapes alone (about four programs per SM), so the call never reads a tensor on the host and
can be captured in a CUDA graph. (The first call per shape compiles the kernel: warm it up before
capture.)

Masked keys get score -inf and weight 0. The running maximum starts at -1e30 rather than -inf,
so a block, split or whole row with no key to attend never computes -inf - (-inf): such a row
ends with l = 0, and the final division uses 1 in place of 0, giving zeros. The reference gives
zeros for that row too (softmax over all -inf is NaN there; it zeroes the masked weights after), as
does SDPA on CPU in torch 2.13. StaticDecoder's rows always have at least one real key.
"""

import functools
import math

import torch

from layers import transformer

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference is the whole story
    triton = None


# The plain math, and the kernel's CPU fallback: the decoder's own grouped attention (a CPU decodes with it)
decode_attention_reference = transformer.grouped_attention


def triton_supports(head_dim, rep):
    """Shapes the kernel takes: a power-of-two head_dim from 16 to 256 (tl.dot and tl.arange need
    powers of two, at least 16) and any rep up to 64 (the query tile is rep rows padded)."""
    return triton is not None and 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0 and 1 <= rep <= 64


def decode_attention(q, k, v, key_mask=None, scale=None, num_splits=None):
    """Attention of one query step over a KV cache, by the split-KV kernel on CUDA tensors (or under
    TRITON_INTERPRET=1), by `decode_attention_reference` otherwise.

    q (B, nkv, rep, hd): the rep query heads that share each KV head. k, v (B, nkv, L, hd): may be
    strided views of a larger cache, last dim contiguous. key_mask (B, L) bool, True = attend, or None.
    num_splits: override the split count (tests); the default depends only on the shapes.
    Returns (B, nkv, rep, hd) in q's dtype.
    """
    if triton is None or not (q.is_cuda or _INTERPRET):
        return decode_attention_reference(q, k, v, key_mask, scale)
    B, nkv, rep, hd = q.shape
    L = k.shape[2]
    assert triton_supports(hd, rep), \
        f"decode_attention: head_dim {hd} (power of two, 16..256) or rep {rep} (1..64) unsupported: use the reference"
    assert k.shape == v.shape == (B, nkv, L, hd) and L >= 1, \
        f"decode_attention: k {tuple(k.shape)}, v {tuple(v.shape)} do not fit q {tuple(q.shape)}"
    assert q.dtype == k.dtype == v.dtype in (torch.float32, torch.bfloat16, torch.float16), \
        f"decode_attention: dtypes {q.dtype}, {k.dtype}, {v.dtype}: want one of float32, bfloat16, float16"
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "decode_attention: the head dim must be contiguous"
    if key_mask is not None:
        assert key_mask.shape == (B, L) and key_mask.dtype == torch.bool, \
            f"decode_attention: key_mask {tuple(key_mask.shape)} {key_mask.dtype}, want ({B}, {L}) bool"
        mask = key_mask.view(torch.uint8)  # the same bytes, as a pointer type every Triton version loads
    scale = hd ** -0.5 if scale is None else scale
    splits, chunk = _plan(B * nkv, L, _sm_count(q.device), num_splits)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    # scratch for the splits' partial results, float32: acc (pair, split, row, dim), then m and l (pair, split, 2, row)
    part_o = q.new_empty((B * nkv, splits, rep, hd) if splits > 1 else (1,), dtype=torch.float32)
    part_ml = q.new_empty((B * nkv, splits, 2, rep) if splits > 1 else (1,), dtype=torch.float32)
    tile = dict(REP=rep, HD=hd, BLOCK_M=max(16, triton.next_power_of_2(rep)), num_warps=4)
    _attend_chunk[(B * nkv, splits)](
        q, k, v, mask if key_mask is not None else q, out, part_o, part_ml,  # q: a pointer never read
        L, chunk, scale * math.log2(math.e),
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *(mask.stride() if key_mask is not None else (0, 0)),
        NKV=nkv, BLOCK_N=_BLOCK_N, HAS_MASK=key_mask is not None, SPLIT=splits > 1,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # float32 inputs: no rounding to tf32
        num_stages=2, **tile)
    if splits > 1:
        _combine_splits[(B * nkv,)](part_o, part_ml, out, splits, **tile)
    return out


_BLOCK_N = 64  # keys per block: a 64 x 128 bf16 tile of K and one of V are 16 KiB each


@functools.lru_cache(maxsize=None)
def _sm_count(device):
    if device.type != "cuda":
        return 132  # the interpreter: plan as for an H100
    return torch.cuda.get_device_properties(device).multi_processor_count


def _plan(pairs, L, sms, num_splits=None, block_n=_BLOCK_N):
    """(splits, chunk): split each (b, h) pair's L keys into `splits` chunks of `chunk` keys, a multiple
    of block_n, none empty. By default enough splits for about 4 programs per SM (a first guess, not
    tuned on hardware; num_splits overrides it), never more than one per block of keys: large batches
    get one split and skip the combine kernel."""
    blocks = _cdiv(L, block_n)
    want = num_splits if num_splits is not None else _cdiv(4 * sms, pairs)
    chunk = _cdiv(blocks, max(1, min(want, blocks))) * block_n
    return _cdiv(L, chunk), chunk


def _cdiv(a, b):
    return -(-a // b)


if triton is not None:
    _NEG = tl.constexpr(-1e30)  # the running maximum's start: finite, below any real score

    @triton.jit
    def _attend_chunk(Q, K, V, Mask, Out, PartO, PartML, L, chunk, qk_scale,
                      sq_b, sq_h, sq_r, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sm_b, sm_n,
                      NKV: tl.constexpr, REP: tl.constexpr, HD: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, SPLIT: tl.constexpr,
                      PRECISION: tl.constexpr):
        """One (b, h) pair, one chunk of keys: online softmax over its blocks."""
        pair, split = tl.program_id(0), tl.program_id(1)
        b = (pair // NKV).to(tl.int64)  # int64: a whole cache can pass 2**31 elements
        h = pair % NKV
        rows, dims = tl.arange(0, BLOCK_M), tl.arange(0, HD)
        row_ok = rows < REP
        q = tl.load(Q + b * sq_b + h * sq_h + rows[:, None] * sq_r + dims[None, :], mask=row_ok[:, None], other=0.0)
        k_ptr, v_ptr = K + b * sk_b + h * sk_h, V + b * sv_b + h * sv_h
        m = tl.full([BLOCK_M], _NEG, tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HD], tl.float32)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, L)
        for start in range(lo, hi, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            ok = keys < hi
            k = tl.load(k_ptr + keys[:, None] * sk_n + dims[None, :], mask=ok[:, None], other=0.0)
            v = tl.load(v_ptr + keys[:, None] * sv_n + dims[None, :], mask=ok[:, None], other=0.0)
            if HAS_MASK:
                ok = ok & (tl.load(Mask + b * sm_b + keys * sm_n, mask=ok, other=0) != 0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), base 2
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        if SPLIT:  # partial results, merged by _combine_splits
            part = pair * tl.num_programs(1) + split
            tl.store(PartO + (part * REP + rows[:, None]) * HD + dims[None, :], acc, mask=row_ok[:, None])
            tl.store(PartML + (part * 2) * REP + rows, m, mask=row_ok)
            tl.store(PartML + (part * 2 + 1) * REP + rows, l, mask=row_ok)
        else:
            o = acc / tl.where(l > 0, l, 1.0)[:, None]  # l = 0: no key to attend, zeros
            tl.store(Out + (pair * REP + rows[:, None]) * HD + dims[None, :], o.to(Out.dtype.element_ty),
                     mask=row_ok[:, None])

    @triton.jit
    def _combine_splits(PartO, PartML, Out, splits, REP: tl.constexpr, HD: tl.constexpr, BLOCK_M: tl.constexpr):
        """One (b, h) pair: merge its splits' (m, l, acc) by the same rescaling, then normalise."""
        pair = tl.program_id(0)
        rows, dims = tl.arange(0, BLOCK_M), tl.arange(0, HD)
        row_ok = rows < REP
        m = tl.full([BLOCK_M], _NEG, tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HD], tl.float32)
        for split in range(0, splits):
            part = pair * splits + split
            m_s = tl.load(PartML + (part * 2) * REP + rows, mask=row_ok, other=_NEG)
            l_s = tl.load(PartML + (part * 2 + 1) * REP + rows, mask=row_ok, other=0.0)
            acc_s = tl.load(PartO + (part * REP + rows[:, None]) * HD + dims[None, :], mask=row_ok[:, None],
                            other=0.0)
            m_new = tl.maximum(m, m_s)
            alpha, beta = tl.exp2(m - m_new), tl.exp2(m_s - m_new)
            l = l * alpha + l_s * beta
            acc = acc * alpha[:, None] + acc_s * beta[:, None]
            m = m_new
        o = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(Out + (pair * REP + rows[:, None]) * HD + dims[None, :], o.to(Out.dtype.element_ty),
                 mask=row_ok[:, None])


# The interpreter (TRITON_INTERPRET=1) runs the kernels on CPU tensors with numpy. Triton reads the
# variable whenever @triton.jit decorates a function, its own helpers (tl.zeros, ...) included, so it
# must be set before triton is first imported. Ask the decorated kernel which it became, so the
# dispatch agrees with how the kernels were built.
_INTERPRET = triton is not None and type(_attend_chunk).__name__ == "InterpretedFunction"
