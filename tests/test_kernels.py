"""decode_attention (layers/kernels.py) against the plain math and against SDPA.

Three ways in: the Triton kernel under the interpreter on CPU tensors (when triton is installed),
the kernel on CUDA (when there is a GPU), and the PyTorch reference that is the CPU fallback
(always). Inputs are laid out like StaticDecoder's decode step: queries viewed out of a fused qkv
row, K and V strided views of a larger (layers, batch, kv_heads, slots, head_dim) cache, and a
left-padding key mask viewed out of a larger buffer.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from layers import kernels

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # atol = rtol, per input dtype
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_triton = pytest.mark.skipif(kernels.triton is None, reason="triton is not installed")


def _case(B, nkv, rep, hd, L, dtype, pads=None, device="cpu", seed=0):
    """q (B, nkv, rep, hd), k, v (B, nkv, L, hd), key_mask (B, L) or None, all strided views.

    pads: row b's first pads[b] keys are masked (left padding), cycled over the rows."""
    g = torch.Generator(device).manual_seed(seed)
    nh = nkv * rep
    qkv = torch.randn(B, nh + 2 * nkv, hd, generator=g, device=device).to(dtype)  # a fused projection's output
    q = qkv[:, :nh].view(B, nkv, rep, hd)
    cache = torch.randn(2, 2, B + 2, nkv, L + 7, hd, generator=g, device=device).to(dtype)  # K/V, layer, batch, ..
    k, v = cache[0, 1, :B, :, :L], cache[1, 1, :B, :, :L]
    key_mask = None
    if pads is not None:
        buf = torch.ones(B + 2, L + 7, dtype=torch.bool)
        for b in range(B):
            buf[b, :pads[b % len(pads)]] = False
        key_mask = buf.to(device)[:B, :L]
    return q, k, v, key_mask


def _sdpa(q, k, v, key_mask, scale=None):
    """F.scaled_dot_product_attention in float32: the independent reference."""
    mask = None if key_mask is None else key_mask[:, None, None, :]
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale)


def _check(out, q, k, v, key_mask, scale=None):
    tol = TOL[q.dtype]
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), kernels.decode_attention_reference(q, k, v, key_mask, scale).float(),
                               atol=tol, rtol=tol)
    torch.testing.assert_close(out.float(), _sdpa(q, k, v, key_mask, scale), atol=tol, rtol=tol)


# ---- the CPU fallback: always runs ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rep,hd,L", [(7, 64, 37), (1, 128, 1), (8, 128, 300)])
def test_reference_matches_sdpa(rep, hd, L, dtype):
    q, k, v, key_mask = _case(3, 2, rep, hd, L, dtype, pads=[0, 5, 200])
    for m in (key_mask, None):
        out = kernels.decode_attention_reference(q, k, v, m, scale=0.3)
        _check(out, q, k, v, m, scale=0.3)


def test_reference_row_without_keys_is_zero():
    q, k, v, key_mask = _case(2, 2, 7, 64, 37, torch.float32, pads=[37, 3])  # row 0: every key masked
    out = kernels.decode_attention_reference(q, k, v, key_mask)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out[1:], _sdpa(q, k, v, key_mask)[1:])


def test_cpu_tensors_take_the_reference():
    if kernels._INTERPRET:
        pytest.skip("TRITON_INTERPRET=1 is set for this process: CPU tensors go to the kernel")
    q, k, v, key_mask = _case(2, 2, 7, 64, 37, torch.bfloat16, pads=[0, 4])
    assert torch.equal(kernels.decode_attention(q, k, v, key_mask, 0.125),
                       kernels.decode_attention_reference(q, k, v, key_mask, 0.125))


def test_split_plan():
    """Splits depend on shapes only, cover L with non-empty whole-block chunks, and give small batches
    more programs."""
    for pairs in (1, 8, 64, 264, 1024):
        for L in (1, 37, 64, 300, 576, 4096):
            splits, chunk = kernels._plan(pairs, L, 132)
            assert chunk % 64 == 0 and (splits - 1) * chunk < L <= splits * chunk
            assert splits == 1 or pairs * splits <= 4 * 132 + pairs  # no more programs than needed
    assert kernels._plan(1024, 576, 132) == (1, 576)  # Qwen 0.5B at 512 rows: one pass
    assert kernels._plan(2, 576, 132) == (9, 64)  # a single row: a split per block of keys
    assert kernels._plan(8, 300, 132, num_splits=3) == (3, 128)


def test_support_check():
    assert not kernels.triton_supports(96, 7) and not kernels.triton_supports(64, 65)
    assert kernels.triton_supports(64, 7) == kernels.triton_supports(128, 16) == (kernels.triton is not None)


# ---- the kernel under the Triton interpreter, on CPU ----
# TRITON_INTERPRET=1 has to be set before triton is first imported (its own tl.zeros & co. are
# @triton.jit functions too), so one fresh process, this file run as a script, computes every case
# below and the tests compare its answers here.

INTERPRETED = {  # name: B, rep, hd, L, dtype, left padding per row (None: no mask), num_splits (None: the plan's)
    "rep1-L1": (3, 1, 64, 1, torch.float32, [0], None),
    "rep7-L37-nomask": (3, 7, 64, 37, torch.float32, None, 1),
    "rep6-hd128-bf16": (3, 6, 128, 37, torch.bfloat16, [0, 5, 36], None),
    "rep7-bf16-3splits": (3, 7, 64, 300, torch.bfloat16, [0, 5, 200], 3),  # row 2's split 0 (keys 0..127): padding
    "rep8-hd128-plan": (3, 8, 128, 300, torch.float32, [0, 5, 200], None),  # the plan: 5 splits of one block
    "rep8-bf16-5blocks": (3, 8, 64, 300, torch.bfloat16, None, 1),  # one split walks 5 blocks, the last partial
    "rep6-fp16-2splits": (3, 6, 64, 300, torch.float16, [3, 0, 150], 2),
    "rep16-bf16": (3, 16, 128, 100, torch.bfloat16, [0, 70], 2),  # rep fills the 16-row tile
    "rep7-hd128-L1-bf16": (3, 7, 128, 1, torch.bfloat16, None, None),
    "rep20-L37": (2, 20, 64, 37, torch.float32, [0, 9], None),  # a 32-row query tile
    "no-keys-1split": (3, 7, 64, 300, torch.float32, [300, 3, 130], 1),  # row 0: every key masked
    "no-keys-3splits": (3, 7, 64, 300, torch.float32, [300, 3, 130], 3),
    "hd96": (2, 7, 96, 37, torch.float32, None, None),  # unsupported: must refuse
}
SCALE = 0.11


def _widen_bf16_dot():
    """The interpreter keeps bfloat16 as its uint16 bits, and its tl.dot multiplies those bits
    (triton-lang/triton#11584; unsupported upstream). Widen bf16 operands to float32 first, which is
    exact, and what tensor cores compute too (bf16 products, float32 sums). Returns why not, or None."""
    try:
        from triton.runtime import interpreter
        import triton.language as tl
        builder, handle, create_dot = interpreter.InterpreterBuilder, interpreter.TensorHandle, \
            interpreter.InterpreterBuilder.create_dot
    except (ImportError, AttributeError) as e:
        return f"cannot work around the interpreter's bf16 tl.dot (triton-lang/triton#11584): {e!r}"

    def widen(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        return handle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)  # bf16 bits are fp32's top half

    builder.create_dot = lambda self, a, b, *rest: create_dot(self, widen(a), widen(b), *rest)
    return None


if kernels.triton is not None:
    @kernels.triton.jit
    def _count_to(Out, n):
        total = 0
        for _ in range(0, n):
            total += 1
        kernels.tl.store(Out, total)


def _interpreter_runs_loops():
    """Older Triton interpreters (3.6 with NumPy 2.4, for one) hand a kernel its scalar arguments as
    1-element arrays, which range() refuses: no kernel whose loop bound is an argument can run there,
    while the compiled kernel on a GPU is unaffected. Returns why not, or None."""
    out = torch.zeros(1, dtype=torch.int32)
    try:
        _count_to[(1,)](out, 3)
    except Exception as e:  # noqa: BLE001 - only the known failure skips; any other lets the cases fail
        if "only 0-dimensional arrays can be converted" not in str(e):
            return None
        return f"triton {kernels.triton.__version__}'s interpreter cannot run a loop to a run-time bound: {e!r}"
    return None


def _interpreter_worker(path):
    """Run in a process started with TRITON_INTERPRET=1: each case's output tensor, or its error as text."""
    assert kernels._INTERPRET, "TRITON_INTERPRET=1 did not reach triton"
    results = {"bf16 skip": _widen_bf16_dot(), "loops skip": _interpreter_runs_loops()}
    for name, (B, rep, hd, L, dtype, pads, splits) in INTERPRETED.items():
        if (dtype == torch.bfloat16 and results["bf16 skip"]) or (results["loops skip"] and name != "hd96"):
            continue
        q, k, v, key_mask = _case(B, 2, rep, hd, L, dtype, pads)
        try:
            results[name] = kernels.decode_attention(q, k, v, key_mask, SCALE, num_splits=splits)
        except Exception as e:  # noqa: BLE001 - reported to the test, which decides
            results[name] = f"{type(e).__name__}: {e}"
    torch.save(results, path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    if kernels.triton is None:
        pytest.skip("triton is not installed")
    path = tmp_path_factory.mktemp("interpreter") / "results.pt"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(path)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return torch.load(path)


@pytest.mark.parametrize("name", [n for n in INTERPRETED if not n.startswith(("no-keys", "hd96"))])
def test_kernel_interpreted(interpreted, name):
    B, rep, hd, L, dtype, pads, splits = INTERPRETED[name]
    if name not in interpreted:
        pytest.skip(interpreted["loops skip"] or interpreted["bf16 skip"])
    out = interpreted[name]
    assert torch.is_tensor(out), out
    q, k, v, key_mask = _case(B, 2, rep, hd, L, dtype, pads)
    assert not k.is_contiguous() and not q.is_contiguous()
    _check(out, q, k, v, key_mask, SCALE)


@pytest.mark.parametrize("name", ["no-keys-1split", "no-keys-3splits"])
def test_kernel_row_without_keys_is_zero(interpreted, name):
    B, rep, hd, L, dtype, pads, splits = INTERPRETED[name]
    if interpreted["loops skip"]:
        pytest.skip(interpreted["loops skip"])
    out = interpreted[name]
    assert torch.is_tensor(out), out
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    q, k, v, key_mask = _case(B, 2, rep, hd, L, dtype, pads)
    _check(out[1:], q[1:], k[1:], v[1:], key_mask[1:], SCALE)


def test_kernel_rejects_unsupported_head_dim(interpreted):
    assert "AssertionError: decode_attention: head_dim 96" in str(interpreted["hd96"])


# ---- the kernel on CUDA ----

REAL = [  # B, rep, hd (nkv = 2): Qwen2.5 0.5B, 1.5B, 3B at 512 rows, and a small batch that splits
    (512, 7, 64), (512, 6, 128), (512, 8, 128), (4, 7, 64),
]


@cuda
@needs_triton
@pytest.mark.parametrize("B,rep,hd", REAL)
def test_kernel_cuda(B, rep, hd):
    q, k, v, key_mask = _case(B, 2, rep, hd, 576, torch.bfloat16, pads=[0, 3, 40, 575], device="cuda")
    _check(kernels.decode_attention(q, k, v, key_mask), q, k, v, key_mask)
    _check(kernels.decode_attention(q, k, v, None), q, k, v, None)


@cuda
@needs_triton
def test_kernel_cuda_float32():
    q, k, v, key_mask = _case(4, 2, 7, 64, 300, torch.float32, pads=[0, 5, 200], device="cuda")
    for splits in (1, 3):
        _check(kernels.decode_attention(q, k, v, key_mask, num_splits=splits), q, k, v, key_mask)


@cuda
@needs_triton
@pytest.mark.parametrize("B", [512, 4])
def test_kernel_cuda_graph(B):
    """Captured once, replayed on new cache contents and a new mask: the graph computes the new answer."""
    q, k, v, key_mask = _case(B, 2, 7, 64, 576, torch.bfloat16, pads=[0, 3, 40], device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compiles the kernels before capture
            kernels.decode_attention(q, k, v, key_mask)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.decode_attention(q, k, v, key_mask)
    q2, k2, v2, mask2 = _case(B, 2, 7, 64, 576, torch.bfloat16, pads=[9, 0, 300], device="cuda", seed=1)
    for dst, src in ((q, q2), (k, k2), (v, v2), (key_mask, mask2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    _check(out, q2, k2, v2, mask2)


if __name__ == "__main__":  # the interpreter's process: see interpreted()
    _interpreter_worker(sys.argv[1])
