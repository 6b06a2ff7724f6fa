"""GPU tests of the CUDA C++ extension (kfused._C) against float64 PyTorch formulas.

Every output and gradient is judged by the docs/math.md §4 rule (``kfused.testing.compare``): the
kernel's error against the float64 reference must stay within twice the error of the same
formula run by torch in the kernel's dtype, plus one epsilon. Skipped cleanly on a GPU machine
without the compiled extension.

Without a CUDA device the numeric tests run on the CPU against float64 stand-ins for the
extension (tests/_cuda_standin.py): that checks the tests themselves — their references,
shapes and dtypes — so that a GPU session spends its time on the kernels (the first such run
found the inducer tests' float16 reference overflowing at -1e30). Tests of the extension's
own behaviour (its error messages, streams, limits) need the GPU (``gpu_only``).
"""

from __future__ import annotations

import math

import pytest
import torch

import _cuda_standin
from kfused import cuda as kcuda
from kfused.testing import compare, no_tf32

STANDIN = not torch.cuda.is_available()
gpu_only = pytest.mark.skipif(STANDIN, reason="the extension itself needs a GPU (this CPU run "
                              "checks the tests against float64 stand-ins)")
if STANDIN:
    _C, DEV = _cuda_standin, "cpu"
else:
    pytestmark = pytest.mark.gpu
    _C, DEV = kcuda.extension(), "cuda"
    if _C is None:
        pytest.skip(f"CUDA extension not built: {kcuda.unavailable_reason()}",
                    allow_module_level=True)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _tokens(n: int) -> int:
    """``n`` tokens on the GPU; at most 300 in the stand-in run. The large counts exist so the
    CUDA kernels walk several token tiles; against a float64 stand-in they add nothing the
    harness could get wrong, only minutes of 16-bit CPU matmuls in the references (122 s of CI
    for the 1025-token KronA cases)."""
    return n if not STANDIN else min(n, 300)


def _sync():
    if not STANDIN:
        torch.cuda.synchronize()


def _ids(dt):
    return str(dt).replace("torch.", "")


def _poison_allocator():
    """Fill freed blocks of the caching allocator with NaN so that at::empty() inside the
    extension hands out NaN-filled memory: an element a kernel forgets to write shows up."""
    if STANDIN:
        return
    bufs = [torch.full((n,), float("nan"), device=DEV) for n in (1 << 24, 1 << 22, 1 << 20)]
    bufs += [torch.full((n,), float("nan"), device=DEV) for n in (1 << 16, 1 << 12, 256)
             for _ in range(8)]
    _sync()
    del bufs


def _rounded(dtype, *ts):
    """The float64 inputs rounded to the kernel's dtype first (kfused.testing's rule, as
    flash-attention's tests draw them in the kernel's dtype): ref64 is then the exact answer
    for the very inputs the kernel sees, and the docs/math.md §4 rule compares computation
    errors, not the input rounding the kernel and torch_t share — which on a small or
    cancelling output (dB of 1x1 factors in bfloat16: 300 products summing to -2.7) made it
    depend on the draw."""
    return [None if t is None else t.to(dtype).to(torch.float64) for t in ts]


def _check(results):
    bad = [r for r in results if not r.ok]
    assert not bad, "docs/math.md §4 rule failed:\n" + "\n".join(r.row() for r in results) + "\n" + \
        "\n".join(r.detail for r in bad)


def _grads(fn, inputs, names, gout):
    leaves = [inputs[n].detach().clone().requires_grad_(True) for n in names]
    args = dict(inputs)
    args.update(zip(names, leaves))
    out = fn(**args)
    gs = torch.autograd.grad(out, leaves, gout, allow_unused=True)
    return out.detach(), [g if g is not None else torch.zeros_like(l) for g, l in zip(gs, leaves)]


@gpu_only
def test_extension_uses_torch_stream():
    # A real build (CUDA torch) launches on torch's current stream, not the legacy fallback.
    assert _C.USES_TORCH_CURRENT_STREAM is True


@gpu_only
def test_runs_on_current_stream():
    side = torch.cuda.Stream()
    x0 = torch.randn(2049, 768, device=DEV)
    A = torch.randn(24, 24, device=DEV)
    B = torch.randn(32, 32, device=DEV)
    ref = kron_ref(x0, A, B)
    _sync()
    with torch.cuda.stream(side):
        x = x0 * 2.0  # produced on the side stream
        y = _C.kron_matvec_fwd(x, A, B)
        y2 = y * 0.5
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(y2, ref, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------
# kron_matvec (docs/math.md §1)
# ------------------------------------------------------------------------------------------

def kron_ref(x, A, B):
    X = x.reshape(-1, A.shape[1], B.shape[1])
    return torch.matmul(torch.matmul(A, X), B.transpose(0, 1)).reshape(x.shape[0], -1)


KRON_SHAPES = [  # a_out, a_in, b_out, b_in
    (24, 24, 32, 32),   # 768, default factorisation
    (2, 384, 384, 2),   # paper GLUE choice
    (32, 24, 24, 32),   # paper GLUE choice
    (3, 5, 7, 11),      # odd everything
    (48, 48, 64, 64),   # 3072
    (1, 1, 1, 1),
    (20, 10, 10, 20),   # d = 200
    # two small factor sides: kron_narrow_kernel (a block per token), each tier and both
    # orientations; rows that are not 16-byte multiples take its scalar staging
    (384, 2, 2, 384),   # the paper's pair the other way round (transposed tokens)
    (8, 384, 384, 2),   # the paper's 768 -> 3072 choice: 8 x 2 intermediates
    (5, 40, 30, 2),     # odd sides; d_out = 150: scalar staging
    (2, 3, 7, 8),       # n = 8 (tier 2x8)
    (30, 2, 2, 40),     # odd, transposed
    (2, 600, 300, 2),   # K = 600 > 512: the wide tier
]


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("shape", KRON_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("T", [1, 97, _tokens(1025)])
def test_kron_matvec(shape, T, dtype):
    a_out, a_in, b_out, b_in = shape
    x = torch.randn(T, a_in * b_in, dtype=torch.float64)
    A = torch.randn(a_out, a_in, dtype=torch.float64) / math.sqrt(a_in)
    B = torch.randn(b_out, b_in, dtype=torch.float64) / math.sqrt(b_in)
    g = torch.randn(T, a_out * b_out, dtype=torch.float64)
    x, A, B, g = _rounded(dtype, x, A, B, g)
    inputs = {"x": x, "A": A, "B": B}
    with no_tf32():
        y64, (dx64, dA64, dB64) = _grads(kron_ref, inputs, ["x", "A", "B"], g)
        dev_in = {k: v.to(DEV, dtype) for k, v in inputs.items()}
        yt, (dxt, dAt, dBt) = _grads(kron_ref, dev_in, ["x", "A", "B"], g.to(DEV, dtype))
    _poison_allocator()
    y = _C.kron_matvec_fwd(dev_in["x"], dev_in["A"], dev_in["B"])
    _poison_allocator()
    dx, dA, dB = _C.kron_matvec_bwd(g.to(DEV, dtype), dev_in["x"], dev_in["A"], dev_in["B"])
    _sync()
    assert y.dtype == dx.dtype == dA.dtype == dB.dtype == dtype
    _check([compare("y", y, y64, yt, dtype), compare("dx", dx, dx64, dxt, dtype),
            compare("dA", dA, dA64, dAt, dtype), compare("dB", dB, dB64, dBt, dtype)])


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("shape", KRON_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kron_matvec_bwd_scaled_without_dx(shape, dtype):
    """The folded KronA path's backward: dA, dB of scale · kron(x), no dx formed."""
    a_out, a_in, b_out, b_in = shape
    T, s = 300, 0.37
    x = torch.randn(T, a_in * b_in, dtype=torch.float64)
    A = torch.randn(a_out, a_in, dtype=torch.float64) / math.sqrt(a_in)
    B = torch.randn(b_out, b_in, dtype=torch.float64) / math.sqrt(b_in)
    g = torch.randn(T, a_out * b_out, dtype=torch.float64)
    x, A, B, g = _rounded(dtype, x, A, B, g)
    inputs = {"x": x, "A": A, "B": B}
    scaled = lambda x, A, B: s * kron_ref(x, A, B)  # noqa: E731
    with no_tf32():
        _, (_, dA64, dB64) = _grads(scaled, inputs, ["x", "A", "B"], g)
        dev_in = {k: v.to(DEV, dtype) for k, v in inputs.items()}
        _, (_, dAt, dBt) = _grads(scaled, dev_in, ["x", "A", "B"], g.to(DEV, dtype))
    _poison_allocator()
    dx, dA, dB = _C.kron_matvec_bwd(g.to(DEV, dtype), dev_in["x"], dev_in["A"], dev_in["B"],
                                    need_dx=False, scale=s)
    _sync()
    assert dx.numel() == 0 and dA.dtype == dB.dtype == dtype
    _check([compare("dA", dA, dA64, dAt, dtype), compare("dB", dB, dB64, dBt, dtype)])


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("shape", KRON_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_krona_fold(shape, dtype, layout):
    """W' = W + s·A⊗B, each element formed in float32 and rounded once (the Triton fold's
    formula), for contiguous W (vector path when d_in % 8 == 0) and a transposed view."""
    a_out, a_in, b_out, b_in = shape
    s = 0.61
    W = torch.randn(a_out * b_out, a_in * b_in, dtype=torch.float64)
    A = torch.randn(a_out, a_in, dtype=torch.float64)
    B = torch.randn(b_out, b_in, dtype=torch.float64)
    W, A, B = _rounded(dtype, W, A, B)
    want = W + s * torch.kron(A, B)
    Wd = W.to(DEV, dtype)
    if layout == "transposed":
        Wd = Wd.t().contiguous().t()
    Ad, Bd = A.to(DEV, dtype), B.to(DEV, dtype)
    with no_tf32():
        same = Wd + s * torch.kron(Ad, Bd)
    _poison_allocator()
    got = _C.krona_fold_fwd(Wd, Ad, Bd, s)
    _sync()
    assert got.dtype == dtype and got.is_contiguous() and got.shape == W.shape
    _check([compare("W'", got, want, same, dtype)])
    # exactly the float32 formula rounded once
    exact = (Wd.float() + s * (torch.kron(Ad.float(), Bd.float()))).to(dtype)
    assert (got.float() - exact.float()).abs().max() <= torch.finfo(dtype).eps * \
        exact.float().abs().max()


@gpu_only
def test_krona_fold_errors():
    W = torch.randn(6, 6, device=DEV, dtype=torch.float16)
    A = torch.randn(3, 3, device=DEV, dtype=torch.float16)
    B = torch.randn(2, 2, device=DEV, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="W .* must be \\(a_out\\*b_out, a_in\\*b_in\\)"):
        _C.krona_fold_fwd(W[:5], A, B, 1.0)
    with pytest.raises(RuntimeError, match="dtype"):
        _C.krona_fold_fwd(W, A.float(), B, 1.0)


@gpu_only
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("exact", [False, True])
def test_krona_linear_cuda_backend(dtype, exact):
    """krona_linear(backend="cuda"): the extension's fold + cuBLAS (16-bit, exact=False) or
    F.linear + its kron_matvec, output and every gradient against the float64 reference."""
    import kfused
    from kfused.reference.krona import krona_linear_ref
    from kfused.testing import assert_against_reference

    T, (a_out, a_in), (b_out, b_in) = 333, (24, 24), (32, 32)
    inputs = {"x": torch.randn(T, a_in * b_in, dtype=torch.float64),
              "weight": torch.randn(a_out * b_out, a_in * b_in, dtype=torch.float64) / 28,
              "bias": torch.randn(a_out * b_out, dtype=torch.float64),
              "A": torch.randn(a_out, a_in, dtype=torch.float64) / 5,
              "B": torch.randn(b_out, b_in, dtype=torch.float64) / 6}
    fn = lambda x, weight, bias, A, B: kfused.krona_linear(  # noqa: E731
        x, weight, bias, A, B, 0.8, backend="cuda", exact=exact)
    ref = lambda x, weight, bias, A, B: krona_linear_ref(x, weight, bias, A, B, 0.8)  # noqa: E731
    assert_against_reference(fn, ref, inputs, dtype, DEV, grad_names=("x", "A", "B"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=_ids)
def test_kron_matvec_empty_and_strided(dtype):
    x = torch.randn(0, 12, device=DEV, dtype=dtype)
    A = torch.randn(3, 4, device=DEV, dtype=dtype)
    B = torch.randn(5, 3, device=DEV, dtype=dtype)
    y = _C.kron_matvec_fwd(x, A, B)
    assert y.shape == (0, 15)
    dx, dA, dB = _C.kron_matvec_bwd(torch.randn(0, 15, device=DEV, dtype=dtype), x, A, B)
    assert dx.shape == (0, 12) and torch.all(dA == 0) and torch.all(dB == 0)
    # Transposed (non-contiguous) factors are read through their strides.
    x = torch.randn(33, 12, device=DEV, dtype=dtype)
    At = torch.randn(4, 3, device=DEV, dtype=dtype).t()
    Bt = torch.randn(3, 5, device=DEV, dtype=dtype).t()
    ref64 = kron_ref(x.double().cpu(), At.double().cpu(), Bt.double().cpu())
    ref_t = kron_ref(x, At.contiguous(), Bt.contiguous())
    _check([compare("y", _C.kron_matvec_fwd(x, At, Bt), ref64, ref_t, dtype)])


@gpu_only
def test_kron_matvec_large_factors():
    # 128x128 factors: the forward no longer stages them in shared memory (global path); the
    # backward's per-token working set exceeds shared memory and must raise, not crash.
    dtype = torch.float16
    x = torch.randn(5, 128 * 128, device=DEV, dtype=dtype)
    A = torch.randn(128, 128, device=DEV, dtype=dtype) / 11
    B = torch.randn(128, 128, device=DEV, dtype=dtype) / 11
    y = _C.kron_matvec_fwd(x, A, B)
    ref64 = kron_ref(x.double().cpu(), A.double().cpu(), B.double().cpu())
    _check([compare("y", y, ref64, kron_ref(x, A, B), dtype)])
    with pytest.raises(RuntimeError, match="shared memory"):
        _C.kron_matvec_bwd(torch.randn_like(y), x, A, B)


def _unaligned(t):
    """A contiguous copy of t whose data pointer is 2 bytes past a 16-byte boundary: the
    tensor-core kernels must take their scalar (non cp.async) load path."""
    flat = torch.empty(t.numel() + 8, device=t.device, dtype=t.dtype)
    out = flat[1:1 + t.numel()].view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 16 != 0 and out.is_contiguous()
    return out


def _kron_case(shape, T, dtype, unaligned=False):
    a_out, a_in, b_out, b_in = shape
    x = torch.randn(T, a_in * b_in, dtype=torch.float64)
    A = torch.randn(a_out, a_in, dtype=torch.float64) / math.sqrt(a_in)
    B = torch.randn(b_out, b_in, dtype=torch.float64) / math.sqrt(b_in)
    g = torch.randn(T, a_out * b_out, dtype=torch.float64)
    x, A, B, g = _rounded(dtype, x, A, B, g)
    inputs = {"x": x, "A": A, "B": B}
    with no_tf32():
        y64, (dx64, dA64, dB64) = _grads(kron_ref, inputs, ["x", "A", "B"], g)
        dev_in = {k: v.to(DEV, dtype) for k, v in inputs.items()}
        yt, (dxt, dAt, dBt) = _grads(kron_ref, dev_in, ["x", "A", "B"], g.to(DEV, dtype))
    xk, gk = dev_in["x"], g.to(DEV, dtype)
    if unaligned:
        xk, gk = _unaligned(xk), _unaligned(gk)
    _poison_allocator()
    y = _C.kron_matvec_fwd(xk, dev_in["A"], dev_in["B"])
    _poison_allocator()
    dx, dA, dB = _C.kron_matvec_bwd(gk, xk, dev_in["A"], dev_in["B"])
    _sync()
    _check([compare("y", y, y64, yt, dtype), compare("dx", dx, dx64, dxt, dtype),
            compare("dA", dA, dA64, dAt, dtype), compare("dB", dB, dB64, dBt, dtype)])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_ids)
@pytest.mark.parametrize("shape", [(24, 24, 32, 32), (3, 5, 7, 11), (17, 33, 9, 40)],
                         ids=lambda s: "x".join(map(str, s)))
def test_kron_matvec_many_tiles(shape, dtype):
    # Enough tokens that every block of the persistent tensor-core kernels walks several
    # token tiles: the cp.async double buffer is refilled while the other half is consumed.
    _kron_case(shape, _tokens(16411), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_ids)
@pytest.mark.parametrize("shape", [(24, 24, 32, 32), (8, 16, 16, 8)],
                         ids=lambda s: "x".join(map(str, s)))
def test_kron_matvec_unaligned(shape, dtype):
    _kron_case(shape, 301, dtype, unaligned=True)


def test_kron_matvec_deterministic():
    x = torch.randn(4099, 768, device=DEV, dtype=torch.float16)
    A = torch.randn(24, 24, device=DEV, dtype=torch.float16)
    B = torch.randn(32, 32, device=DEV, dtype=torch.float16)
    g = torch.randn(4099, 768, device=DEV, dtype=torch.float16)
    r1 = _C.kron_matvec_bwd(g, x, A, B)
    r2 = _C.kron_matvec_bwd(g, x, A, B)
    for a, b in zip(r1, r2):
        assert torch.equal(a, b)


@gpu_only
def test_kron_matvec_errors():
    x = torch.randn(4, 6, device=DEV)
    A = torch.randn(2, 3, device=DEV)
    B = torch.randn(2, 2, device=DEV)
    with pytest.raises(RuntimeError, match="x must be a CUDA tensor"):
        _C.kron_matvec_fwd(x.cpu(), A, B)
    with pytest.raises(RuntimeError, match="A .*dtype"):
        _C.kron_matvec_fwd(x, A.half(), B)
    with pytest.raises(RuntimeError, match="a_in\\*b_in"):
        _C.kron_matvec_fwd(torch.randn(4, 7, device=DEV), A, B)
    with pytest.raises(RuntimeError, match="contiguous"):
        _C.kron_matvec_fwd(torch.randn(6, 4, device=DEV).t(), A, B)
    with pytest.raises(RuntimeError, match="g"):
        _C.kron_matvec_bwd(torch.randn(4, 5, device=DEV), x, A, B)
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        _C.kron_matvec_fwd(x.double(), A.double(), B.double())


# ------------------------------------------------------------------------------------------
# headwise_lowrank (docs/math.md §2)
# ------------------------------------------------------------------------------------------

def headwise_ref(basis, A, B, bias=None):
    if basis.dim() == 2:
        U = torch.einsum("td,hrd->thr", basis, A)
    else:
        U = torch.einsum("thd,hrd->thr", basis, A)
    out = torch.einsum("thr,hpr->thp", U, B)
    return out + bias if bias is not None else out


HEADWISE_CASES = [  # T, H, r, d_b, p, shared basis, bias
    (97, 12, 8, 768, 64, True, True),     # Kernel-wise on q, basis X
    (97, 12, 4, 64, 64, False, True),     # Kernel-wise-lite, basis K^h
    (33, 3, 1, 200, 80, True, False),
    (1025, 2, 12, 96, 32, False, False),  # r > 8: two rank chunks
    (5, 4, 17, 40, 24, True, True),
    (1, 1, 2, 7, 3, False, True),
    (300, 40, 2, 64, 64, True, True),      # tensor-core path: 8 heads per block, 5 groups
    (130, 3, 64, 96, 128, False, True),    # r = 64: the largest rank of the tensor-core path
    (70, 2, 65, 48, 16, True, False),      # r = 65: CUDA-core fallback
    (4099, 12, 8, 768, 64, True, True),    # Kernel-wise size, many token blocks / K splits
    (257, 5, 3, 36, 10, False, False),     # d_b % 8 != 0: scalar loads
]


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("case", HEADWISE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_headwise_lowrank(case, dtype):
    T, H, r, d_b, p, shared, has_bias = case
    basis = torch.randn(*((T, d_b) if shared else (T, H, d_b)), dtype=torch.float64)
    A = torch.randn(H, r, d_b, dtype=torch.float64) / math.sqrt(d_b)
    B = torch.randn(H, p, r, dtype=torch.float64) / math.sqrt(r)
    bias = torch.randn(H, p, dtype=torch.float64) if has_bias else None
    g = torch.randn(T, H, p, dtype=torch.float64)
    basis, A, B, bias, g = _rounded(dtype, basis, A, B, bias, g)
    inputs = {"basis": basis, "A": A, "B": B, "bias": bias}
    names = ["basis", "A", "B"] + (["bias"] if has_bias else [])
    with no_tf32():
        out64, g64 = _grads(headwise_ref, inputs, names, g)
        dev_in = {k: (v.to(DEV, dtype) if v is not None else None) for k, v in inputs.items()}
        outt, gt = _grads(headwise_ref, dev_in, names, g.to(DEV, dtype))
    _poison_allocator()
    out, U = _C.headwise_lowrank_fwd(dev_in["basis"], dev_in["A"], dev_in["B"], dev_in["bias"],
                                     save_u=True)
    out_plain, U_none = _C.headwise_lowrank_fwd(dev_in["basis"], dev_in["A"], dev_in["B"],
                                                dev_in["bias"])
    tc = dtype != torch.float32 and r <= 64
    uw = (r + 1 + 7) // 8 * 8
    assert U.shape == ((T, H, uw) if tc else (0,)) and U_none.shape == (0,)
    assert torch.equal(out, out_plain)
    if tc:     # the ones column that makes dB's product yield dbias, zeros after
        assert torch.all(U[..., r] == 1) and torch.all(U[..., r + 1:] == 0)
    _poison_allocator()
    gd = g.to(DEV, dtype)
    grads = _C.headwise_lowrank_bwd(gd, dev_in["basis"], dev_in["A"], dev_in["B"], has_bias,
                                    U=U if U.numel() else None)
    # the forward's U and a recomputed one give the same bits
    again = _C.headwise_lowrank_bwd(gd, dev_in["basis"], dev_in["A"], dev_in["B"], has_bias)
    _sync()
    for a, b in zip(grads, again):
        assert torch.equal(a, b)
    res = [compare("out", out, out64, outt, dtype)]
    for n, k, r64, rt in zip(names, grads, g64, gt):
        res.append(compare("d" + n, k, r64, rt, dtype))
    if not has_bias:
        assert grads[3].numel() == 0
    _check(res)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_ids)
@pytest.mark.parametrize("shared", [True, False])
def test_headwise_lowrank_unaligned(shared, dtype):
    T, H, r, d_b, p = 203, 4, 8, 64, 32
    basis = torch.randn(*((T, d_b) if shared else (T, H, d_b)), dtype=torch.float64)
    A = torch.randn(H, r, d_b, dtype=torch.float64) / math.sqrt(d_b)
    B = torch.randn(H, p, r, dtype=torch.float64) / math.sqrt(r)
    g = torch.randn(T, H, p, dtype=torch.float64)
    basis, A, B, g = _rounded(dtype, basis, A, B, g)
    inputs = {"basis": basis, "A": A, "B": B}
    names = ["basis", "A", "B"]
    with no_tf32():
        out64, g64 = _grads(headwise_ref, inputs, names, g)
        dev_in = {k: v.to(DEV, dtype) for k, v in inputs.items()}
        outt, gt = _grads(headwise_ref, dev_in, names, g.to(DEV, dtype))
    bu, Au = _unaligned(dev_in["basis"]), _unaligned(dev_in["A"])
    out, U = _C.headwise_lowrank_fwd(bu, Au, dev_in["B"], None, save_u=True)
    grads = _C.headwise_lowrank_bwd(_unaligned(g.to(DEV, dtype)), bu, Au, dev_in["B"], False,
                                    U=U)
    _sync()
    res = [compare("out", out, out64, outt, dtype)]
    for n, k, r64, rt in zip(names, grads, g64, gt):
        res.append(compare("d" + n, k, r64, rt, dtype))
    _check(res)


def test_headwise_lowrank_deterministic():
    T, H, r, d_b, p = 4099, 12, 8, 768, 64
    basis = torch.randn(T, d_b, device=DEV, dtype=torch.bfloat16)
    A = torch.randn(H, r, d_b, device=DEV, dtype=torch.bfloat16) / 28
    B = torch.randn(H, p, r, device=DEV, dtype=torch.bfloat16) / 3
    g = torch.randn(T, H, p, device=DEV, dtype=torch.bfloat16)
    r1 = _C.headwise_lowrank_bwd(g, basis, A, B, True)
    r2 = _C.headwise_lowrank_bwd(g, basis, A, B, True)
    for a, b in zip(r1, r2):
        assert torch.equal(a, b)


def test_headwise_lowrank_empty():
    basis = torch.randn(0, 16, device=DEV)
    A = torch.randn(2, 3, 16, device=DEV)
    B = torch.randn(2, 8, 3, device=DEV)
    assert _C.headwise_lowrank_fwd(basis, A, B, None)[0].shape == (0, 2, 8)
    db, dA, dB, dbias = _C.headwise_lowrank_bwd(torch.randn(0, 2, 8, device=DEV), basis, A, B,
                                                True)
    assert db.shape == (0, 16) and torch.all(dA == 0) and torch.all(dB == 0)
    assert dbias.shape == (2, 8) and torch.all(dbias == 0)


@gpu_only
def test_headwise_lowrank_errors():
    A = torch.randn(2, 3, 16, device=DEV)
    B = torch.randn(2, 8, 3, device=DEV)
    with pytest.raises(RuntimeError, match="basis"):
        _C.headwise_lowrank_fwd(torch.randn(4, 15, device=DEV), A, B, None)
    with pytest.raises(RuntimeError, match="B "):
        _C.headwise_lowrank_fwd(torch.randn(4, 16, device=DEV), A, torch.randn(2, 8, 4, device=DEV),
                                None)
    with pytest.raises(RuntimeError, match="bias"):
        _C.headwise_lowrank_fwd(torch.randn(4, 16, device=DEV), A, B, torch.randn(2, 7, device=DEV))
    h = dict(device=DEV, dtype=torch.bfloat16)
    basis, A16, B16 = torch.randn(4, 16, **h), A.to(torch.bfloat16), B.to(torch.bfloat16)
    g = torch.randn(4, 2, 8, **h)
    _, U = _C.headwise_lowrank_fwd(basis, A16, B16, None, save_u=True)
    assert U.shape == (4, 2, 8)          # r = 3: 3 values, the ones column, zeros to 8
    with pytest.raises(RuntimeError, match="U "):
        _C.headwise_lowrank_bwd(g, basis, A16, B16, False, U=U[:3])
    with pytest.raises(RuntimeError, match="U "):
        _C.headwise_lowrank_bwd(g, basis, A16, B16, True, U=U[..., :4].contiguous())
    with pytest.raises(RuntimeError, match="U "):   # float32 takes no U
        _C.headwise_lowrank_bwd(g.float(), basis.float(), A16.float(), B16.float(), True,
                                U=U.float())


# ------------------------------------------------------------------------------------------
# inducer attention forward (docs/math.md §3)
# ------------------------------------------------------------------------------------------

def inducer_ref(q, k, v, s0, pk=None, pv=None, lens=None, causal=False):
    """Float formula: (f, lse, lam); fully masked rows -> f = 0, lse = -1e30, lam = 1.
    k, v may have fewer heads than q (grouped-query: query head h reads kv head h // G)."""
    Bn, H, n_q, p = q.shape
    n_k = k.shape[2]
    if k.shape[1] != H:
        k = k.repeat_interleave(H // k.shape[1], dim=1)
        v = v.repeat_interleave(H // v.shape[1], dim=1)
    l = 0 if pk is None else pk.shape[1]
    if l:
        k = torch.cat([pk.unsqueeze(0).expand(Bn, -1, -1, -1), k], dim=2)
        v = torch.cat([pv.unsqueeze(0).expand(Bn, -1, -1, -1), v], dim=2)
    S = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(p)
    j = torch.arange(n_k, device=q.device)
    visible = torch.ones(Bn, 1, n_q, n_k, dtype=torch.bool, device=q.device)
    if lens is not None:
        visible = visible & (j.view(1, 1, 1, -1) < lens.view(-1, 1, 1, 1).to(q.device))
    if causal:
        i = torch.arange(n_q, device=q.device)
        visible = visible & (j.view(1, 1, 1, -1) <= (n_k - n_q + i).view(1, 1, -1, 1))
    if l:
        visible = torch.cat([torch.ones(Bn, 1, n_q, l, dtype=torch.bool, device=q.device),
                             visible], dim=-1)
    S = S.masked_fill(~visible, float("-inf"))
    any_vis = visible.any(-1)  # (B, 1, n_q)
    lse = torch.logsumexp(S, dim=-1)
    P = torch.softmax(S, dim=-1).nan_to_num(0.0)
    f = torch.matmul(P, v)
    # the kernel's lse is float32 (-1e30 overflows float16): at least float32 here too
    up = torch.promote_types(lse.dtype, torch.float32)
    lse = torch.where(any_vis, lse.to(up), torch.full_like(lse, -1e30, dtype=up))
    lam = torch.sigmoid(s0 - lse)
    return f, lse, lam


INDUCER_CASES = [  # B, H, n_q, n_k, p, l, causal, lens
    (2, 3, 97, 97, 64, 0, True, None),            # prefill, few blocks -> key-split schedule
    (4, 8, 97, 97, 64, 0, True, None),            # prefill, row schedule
    (2, 2, 1, 1025, 128, 0, True, None),          # decode
    (3, 2, 1, 300, 80, 5, False, [300, 17, 1]),   # decode, padding + prefix
    (1, 4, 33, 33, 96, 3, True, [33]),
    (1, 2, 5, 40, 32, 0, True, None),             # chunked prefill on a KV cache
    (2, 16, 64, 200, 128, 4, True, [200, 150]),
    (1, 3, 16, 300, 64, 0, True, None),           # n_q = 16: largest decode schedule
    (1, 3, 17, 300, 64, 2, True, None),           # n_q = 17: prefill schedule, one row tile
    (2, 1, 1, 5000, 64, 0, True, [5000, 4097]),   # long decode: many key splits
    (1, 2, 70, 90, 40, 0, False, None),           # p = 40 (padded to 64)
    (2, 2, 9, 50, 17, 3, True, [50, 20]),         # p % 8 != 0: scalar loads
    (1, 1, 130, 130, 128, 0, True, None),         # 3 row tiles, few blocks: key splits in prefill
    # p <= 64: 128-row prefill blocks (two 16-row tiles per warp), stages with and without masks
    (8, 16, 200, 260, 64, 0, True, None),         # 2 row tiles x 128 blocks: no key split
    (1, 3, 300, 300, 32, 2, True, [300]),         # D = 32, prefix, few blocks: key splits
    (2, 2, 129, 700, 64, 0, False, [700, 333]),   # a full tile and one row; kend mid-stage
]


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("case", INDUCER_CASES, ids=lambda c: "-".join(map(str, c)))
def test_inducer_attention_fwd(case, dtype):
    Bn, H, n_q, n_k, p, l, causal, lens = case
    q = torch.randn(Bn, H, n_q, p, dtype=torch.float64)
    k = torch.randn(Bn, H, n_k, p, dtype=torch.float64)
    v = torch.randn(Bn, H, n_k, p, dtype=torch.float64)
    s0 = torch.randn(Bn, H, n_q, dtype=torch.float64) * 3
    pk = torch.randn(H, l, p, dtype=torch.float64) if l else None
    pv = torch.randn(H, l, p, dtype=torch.float64) if l else None
    q, k, v, s0, pk, pv = _rounded(dtype, q, k, v, s0, pk, pv)
    lens_t = torch.tensor(lens) if lens is not None else None
    f64, lse64, lam64 = inducer_ref(q, k, v, s0, pk, pv, lens_t, causal)
    cast = lambda t: None if t is None else t.to(DEV, dtype)  # noqa: E731
    # KV cache view: the sequence dim of k and v is a slice of a longer buffer.
    kc = torch.zeros(Bn, H, n_k + 7, p, device=DEV, dtype=dtype)
    vc = torch.zeros_like(kc)
    kc[:, :, :n_k] = cast(k)
    vc[:, :, :n_k] = cast(v)
    kd, vd = kc[:, :, :n_k], vc[:, :, :n_k]
    with no_tf32():
        ft, lset, lamt = inducer_ref(cast(q), cast(k), cast(v), cast(s0), cast(pk), cast(pv),
                                     lens_t, causal)
    _poison_allocator()
    f, lse, lam, _ = _C.inducer_attention_fwd(
        cast(q), kd, vd, cast(s0), cast(pk), cast(pv),
        lens_t.to(DEV) if lens_t is not None else None, causal)
    _sync()
    assert f.dtype == dtype and lse.dtype == torch.float32 and lam.dtype == torch.float32
    assert not torch.isnan(f).any() and not torch.isnan(lse).any() and not torch.isnan(lam).any()
    _check([compare("f", f, f64, ft, dtype), compare("lse", lse, lse64, lset, dtype),
            compare("lam", lam, lam64, lamt, dtype)])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_ids)
@pytest.mark.parametrize("n_q", [1, 40])
def test_inducer_attention_unaligned(n_q, dtype):
    # q / k / v views whose rows are not 16-byte aligned: the tensor-core kernel's scalar path.
    Bn, H, n_k, p, l = 2, 3, 77, 64, 2
    q = torch.randn(Bn, H, n_q, p, dtype=torch.float64)
    k = torch.randn(Bn, H, n_k, p, dtype=torch.float64)
    v = torch.randn(Bn, H, n_k, p, dtype=torch.float64)
    s0 = torch.randn(Bn, H, n_q, dtype=torch.float64)
    pk = torch.randn(H, l, p, dtype=torch.float64)
    pv = torch.randn(H, l, p, dtype=torch.float64)
    q, k, v, s0, pk, pv = _rounded(dtype, q, k, v, s0, pk, pv)
    f64, lse64, lam64 = inducer_ref(q, k, v, s0, pk, pv, None, True)
    cast = lambda t: t.to(DEV, dtype)  # noqa: E731
    with no_tf32():
        ft, lset, lamt = inducer_ref(cast(q), cast(k), cast(v), cast(s0), cast(pk), cast(pv),
                                     None, True)
    f, lse, lam, _ = _C.inducer_attention_fwd(_unaligned(cast(q)), _unaligned(cast(k)),
                                           _unaligned(cast(v)), cast(s0), cast(pk), cast(pv),
                                           None, True)
    _sync()
    _check([compare("f", f, f64, ft, dtype), compare("lse", lse, lse64, lset, dtype),
            compare("lam", lam, lam64, lamt, dtype)])


@pytest.mark.parametrize("p", [32, 64, 80, 96, 128])
def test_inducer_attention_fully_masked_rows(p):
    dtype = torch.float16
    q = torch.randn(2, 2, 16, p, device=DEV, dtype=dtype)
    k = torch.randn(2, 2, 50, p, device=DEV, dtype=dtype)
    v = torch.randn(2, 2, 50, p, device=DEV, dtype=dtype)
    s0 = torch.randn(2, 2, 16, device=DEV)
    lens = torch.tensor([50, 0], device=DEV)
    f, lse, lam, _ = _C.inducer_attention_fwd(q, k, v, s0, None, None, lens, False)
    assert torch.all(f[1] == 0) and torch.all(lse[1] == -1e30) and torch.all(lam[1] == 1)
    assert torch.isfinite(f).all() and torch.isfinite(lse).all() and torch.isfinite(lam).all()
    # causal with more queries than keys: the first rows see nothing
    f, lse, lam, _ = _C.inducer_attention_fwd(q, k[:, :, :3], v[:, :, :3], s0, None, None, None, True)
    assert torch.all(f[:, :, :13] == 0) and torch.all(lam[:, :, :13] == 1)
    assert torch.isfinite(f).all()


def _mlp_weights(H, p, L, r, gen_scale=0.5):
    """float64 inducer MLP weights (Ak, ak, Bk, ck, W1, b1)."""
    return [torch.randn(*s, dtype=torch.float64) * gen_scale
            for s in ((H, p, L), (H, L), (H, L, p), (H, p), (H, p, r), (H, r))]


def mlp_ref(q, Ak, ak, Bk, ck, W1, b1):
    """s0 = tau <q, q + tanh(q Ak + ak) Bk + ck> and tanh(q W1 + b1) (docs/math.md §3)."""
    tau = q.shape[-1] ** -0.5
    pk = q + torch.matmul(torch.tanh(torch.matmul(q, Ak) + ak[:, None, :]), Bk) + ck[:, None, :]
    return tau * (q * pk).sum(-1), torch.tanh(torch.matmul(q, W1) + b1[:, None, :])


@pytest.mark.parametrize("u_float", [False, True], ids=["u16", "u32"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_ids)
@pytest.mark.parametrize("case", INDUCER_CASES, ids=lambda c: "-".join(map(str, c)))
def test_inducer_attention_fwd_mlp_in_kernel(case, dtype, u_float):
    """The 16-bit kernel computing the inducer MLP itself: s0 from its q tile (prologue), λ and
    u = λ tanh(q W1 + b1) in its epilogue (or, split over keys, in the merge kernel)."""
    Bn, H, n_q, n_k, p, l, causal, lens = case
    L, r = 4, 9 if p % 2 else 8
    q = torch.randn(Bn, H, n_q, p, dtype=torch.float64)
    k = torch.randn(Bn, H, n_k, p, dtype=torch.float64)
    v = torch.randn(Bn, H, n_k, p, dtype=torch.float64)
    W = _mlp_weights(H, p, L, r, gen_scale=p ** -0.5)
    pk = torch.randn(H, l, p, dtype=torch.float64) if l else None
    pv = torch.randn(H, l, p, dtype=torch.float64) if l else None
    q, k, v, pk, pv, *W = _rounded(dtype, q, k, v, pk, pv, *W)
    lens_t = torch.tensor(lens) if lens is not None else None
    cast = lambda t: None if t is None else t.to(DEV, dtype)  # noqa: E731

    def formula(q, k, v, pk, pv, W):
        s0, hid = mlp_ref(q, *W)
        f, lse, lam = inducer_ref(q, k, v, s0, pk, pv, lens_t, causal)
        # u in the kernel's u dtype (float32 λ times the rounded hidden row)
        u = lam[..., None] * hid
        return f, lse, lam, u.to(q.dtype if q.dtype == torch.float64 or not u_float
                                 else torch.float32)

    want = formula(q, k, v, pk, pv, W)
    with no_tf32():
        same = formula(cast(q), cast(k), cast(v), cast(pk), cast(pv), [cast(w) for w in W])
    _poison_allocator()
    got = _C.inducer_attention_fwd(cast(q), cast(k), cast(v), None, cast(pk), cast(pv),
                                   lens_t.to(DEV) if lens_t is not None else None, causal,
                                   *[cast(w) for w in W], u_float)
    _sync()
    f, lse, lam, u = got
    assert u.shape == (Bn, H, n_q, r) and u.dtype == (torch.float32 if u_float else dtype)
    assert all(not torch.isnan(t).any() for t in got)
    _check([compare(n, x, w, t, dtype) for n, x, w, t in zip(("f", "lse", "lam", "u"), got,
                                                             want, same)])


GQA_CASES = [  # B, H, H_kv, n_q, n_k, p, l, causal, lens
    (2, 8, 2, 1, 1025, 128, 0, True, None),         # decode: 4 query heads packed per block
    (3, 8, 2, 4, 300, 64, 0, True, [300, 17, 1]),   # 4 heads x 4 queries = 16 packed rows
    (2, 6, 3, 3, 77, 40, 0, True, [77, 2]),         # 2 x 3 rows, p = 40 (padded), lengths
    (1, 8, 1, 3, 200, 64, 0, True, None),           # 8 x 3 = 24 rows: 4 heads per block
    (2, 6, 2, 6, 100, 64, 0, True, [100, 9]),       # 3 x 6 = 18 rows, 3 prime: one head
    (2, 6, 3, 1, 90, 80, 2, False, [90, 5]),        # a prefix (per query head): no packing
    (2, 4, 2, 70, 120, 64, 0, True, None),          # prefill
    (1, 12, 4, 2, 5000, 32, 0, False, None),        # packed, many key splits
    (2, 4, 4, 1, 50, 17, 0, True, None),            # H_kv = H, p % 8 != 0 (scalar loads)
]


@pytest.mark.parametrize("mlp", [False, True], ids=["s0", "mlp"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("case", GQA_CASES, ids=lambda c: "-".join(map(str, c)))
def test_inducer_attention_grouped_query(case, dtype, mlp):
    """k/v with H_kv heads dividing q's H (query head h reads kv head h // (H / H_kv)): the
    16-bit decode blocks that pack a kv head's query heads (each row its own head's q, causal
    limit, in-kernel MLP weights and output row) and the unpacked schedules, against the
    float64 formula with the kv heads repeated."""
    Bn, H, Hkv, n_q, n_k, p, l, causal, lens = case
    if mlp and dtype == torch.float32:
        pytest.skip("the in-kernel inducer MLP is the 16-bit path (float32 takes s0)")
    L, r = 4, 8
    q = torch.randn(Bn, H, n_q, p, dtype=torch.float64)
    k = torch.randn(Bn, Hkv, n_k, p, dtype=torch.float64)
    v = torch.randn(Bn, Hkv, n_k, p, dtype=torch.float64)
    s0 = torch.randn(Bn, H, n_q, dtype=torch.float64) * 3
    W = _mlp_weights(H, p, L, r, gen_scale=p ** -0.5)
    pk = torch.randn(H, l, p, dtype=torch.float64) if l else None
    pv = torch.randn(H, l, p, dtype=torch.float64) if l else None
    q, k, v, s0, pk, pv, *W = _rounded(dtype, q, k, v, s0, pk, pv, *W)
    lens_t = torch.tensor(lens) if lens is not None else None
    cast = lambda t: None if t is None else t.to(DEV, dtype)  # noqa: E731

    def formula(q, k, v, s0, pk, pv, W):
        if not mlp:
            return inducer_ref(q, k, v, s0, pk, pv, lens_t, causal)
        s0, hid = mlp_ref(q, *W)
        f, lse, lam = inducer_ref(q, k, v, s0, pk, pv, lens_t, causal)
        return f, lse, lam, (lam[..., None] * hid).to(q.dtype)   # u in q's dtype

    want = formula(q, k, v, s0, pk, pv, W)
    with no_tf32():
        same = formula(cast(q), cast(k), cast(v), cast(s0), cast(pk), cast(pv),
                       [cast(w) for w in W])
    _poison_allocator()
    extra = ([cast(w) for w in W] + [False]) if mlp else []
    got = _C.inducer_attention_fwd(cast(q), cast(k), cast(v), None if mlp else cast(s0),
                                   cast(pk), cast(pv),
                                   lens_t.to(DEV) if lens_t is not None else None, causal,
                                   *extra)
    _sync()
    got = got if mlp else got[:3]
    assert got[0].shape == (Bn, H, n_q, p)
    assert all(not torch.isnan(t).any() for t in got)
    _check([compare(n, x, w, t, dtype) for n, x, w, t in zip(("f", "lse", "lam", "u"), got,
                                                             want, same)])


@gpu_only
def test_inducer_attention_grouped_query_errors():
    q = torch.randn(1, 6, 3, 32, device=DEV, dtype=torch.float16)
    s0 = torch.randn(1, 6, 3, device=DEV)
    k = torch.randn(1, 4, 5, 32, device=DEV, dtype=torch.float16)   # 4 does not divide 6
    with pytest.raises(RuntimeError, match="H_kv dividing"):
        _C.inducer_attention_fwd(q, k, k, s0, None, None, None, False)
    k3 = torch.randn(1, 3, 5, 32, device=DEV, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="v "):
        _C.inducer_attention_fwd(q, k3, k, s0, None, None, None, False)


@gpu_only
def test_inducer_attention_mlp_errors():
    q = torch.randn(1, 2, 3, 32, device=DEV, dtype=torch.float16)
    k = torch.randn(1, 2, 5, 32, device=DEV, dtype=torch.float16)
    s0 = torch.randn(1, 2, 3, device=DEV)
    W = [w.to(DEV, torch.float16) for w in _mlp_weights(2, 32, 4, 8)]
    with pytest.raises(RuntimeError, match="either s0 or the inducer MLP"):
        _C.inducer_attention_fwd(q, k, k, s0, None, None, None, False, *W, False)
    with pytest.raises(RuntimeError, match="either s0 or the inducer MLP"):
        _C.inducer_attention_fwd(q, k, k, None, None, None, None, False)
    with pytest.raises(RuntimeError, match="all of Ak, ak, Bk, ck, W1, b1"):
        _C.inducer_attention_fwd(q, k, k, None, None, None, None, False, *W[:5], None, False)
    with pytest.raises(RuntimeError, match="float32 q"):
        _C.inducer_attention_fwd(q.float(), k.float(), k.float(), None, None, None, None, False,
                                 *[w.float() for w in W], False)
    with pytest.raises(RuntimeError, match="Bk"):
        _C.inducer_attention_fwd(q, k, k, None, None, None, None, False, *W[:2],
                                 W[2].transpose(1, 2).contiguous(), *W[3:], False)
    big = [w.to(DEV, torch.float16) for w in _mlp_weights(2, 32, 20, 30)]
    with pytest.raises(RuntimeError, match="2 L \\+ r \\+ 1 <= 64"):
        _C.inducer_attention_fwd(q, k, k, None, None, None, None, False, *big, False)


@gpu_only
def test_inducer_attention_errors():
    q = torch.randn(1, 2, 3, 32, device=DEV)
    k = torch.randn(1, 2, 5, 32, device=DEV)
    s0 = torch.randn(1, 2, 3, device=DEV)
    with pytest.raises(RuntimeError, match="head width"):
        _C.inducer_attention_fwd(torch.randn(1, 2, 3, 160, device=DEV),
                                 torch.randn(1, 2, 5, 160, device=DEV),
                                 torch.randn(1, 2, 5, 160, device=DEV), s0, None, None, None,
                                 False)
    with pytest.raises(RuntimeError, match="v "):
        _C.inducer_attention_fwd(q, k, k[:, :, :4], s0, None, None, None, False)
    with pytest.raises(RuntimeError, match="prefix_k and prefix_v"):
        _C.inducer_attention_fwd(q, k, k, s0, torch.randn(2, 1, 32, device=DEV), None, None,
                                 False)
    with pytest.raises(RuntimeError, match="key_lengths"):
        _C.inducer_attention_fwd(q, k, k, s0, None, None, torch.tensor([1, 2], device=DEV), False)
    e = _C.inducer_attention_fwd(q[:, :, :0], k, k, s0[:, :, :0], None, None, None, True)
    assert e[0].shape == (1, 2, 0, 32)
