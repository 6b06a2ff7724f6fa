"""The torch side of ``headwise_lowrank(backend="cuda")`` (kfused::headwise_lowrank_cuda_fwd /
_bwd) on the CPU, with a stand-in for the extension built from float64 formulas. The contract
checked: the forward saves U (16-bit, 1 <= r <= 64) only when a backward can follow, in the
(T, H, uw) layout whose ones column makes dB's product yield dbias too; the backward gets that
very U (no recompute) or None; the fake's shapes are the extension's; every output and gradient
against the float64 reference. The kernels themselves are tested on a GPU
(tests/test_cuda_ext.py)."""

import importlib
import pathlib
import re
import types

import pytest
import torch

from kfused.reference.headwise import headwise_lowrank_ref

F64 = torch.float64
hl = importlib.import_module("kfused.ops.headwise_lowrank")
CSRC = pathlib.Path(__file__).resolve().parents[1] / "csrc" / "headwise" / "headwise_lowrank.cu"


def _u_width(r):
    return (r + 1 + 7) // 8 * 8


class StandIn:
    """headwise_lowrank_fwd / _bwd as csrc/kfused.h defines them, in float64."""

    def __init__(self):
        self.calls = []
        self.saved_u = None

    @staticmethod
    def _u(basis, A):
        b = basis.double()
        eq = "thk,hrk->thr" if basis.dim() == 3 else "tk,hrk->thr"
        return torch.einsum(eq, b, A.double()).to(basis.dtype)      # U rounded to the dtype

    def headwise_lowrank_fwd(self, basis, A, B, bias=None, save_u=False):
        T, (H, r, _), p = basis.shape[0], A.shape, B.shape[1]
        u = self._u(basis, A)
        out = torch.einsum("thr,hpr->thp", u.double(), B.double())
        if bias is not None:
            out = out + bias.double()
        U = basis.new_empty(0)
        if save_u and basis.dtype != torch.float32 and 1 <= r <= 64:
            U = torch.zeros(T, H, _u_width(r), dtype=basis.dtype)
            U[..., :r] = u
            U[..., r] = 1
        self.calls.append(("fwd", save_u, tuple(U.shape)))
        self.saved_u = U
        return out.to(basis.dtype), U

    def headwise_lowrank_bwd(self, g, basis, A, B, has_bias, U=None):
        r = A.shape[1]
        self.calls.append(("bwd", has_bias, U is not None))
        if U is not None:
            assert U is self.saved_u, "the backward must get the forward's own U"
            assert U.shape == (basis.shape[0], A.shape[0], _u_width(r))
            assert torch.all(U[..., r] == 1)
            u = U[..., :r].double()
        else:
            u = self._u(basis, A).double()
        g64, B64, A64 = g.double(), B.double(), A.double()
        dU = torch.einsum("thp,hpr->thr", g64, B64).to(g.dtype).double()
        dA = torch.einsum("thr,thk->hrk" if basis.dim() == 3 else "thr,tk->hrk", dU,
                          basis.double())
        dbasis = torch.einsum("thr,hrk->thk", dU, A64)
        if basis.dim() == 2:
            dbasis = dbasis.sum(1)
        dB = torch.einsum("thp,thr->hpr", g64, u)
        dbias = g64.sum(0) if has_bias else g.new_empty(0)
        return (dbasis.to(basis.dtype), dA.to(A.dtype), dB.to(B.dtype),
                dbias.to(g.dtype) if has_bias else dbias)


@pytest.fixture
def ext(monkeypatch):
    s = StandIn()
    monkeypatch.setattr(hl, "cuda", types.SimpleNamespace(require=lambda name: s))
    return s


def _inputs(gen, T, H, r, d_b, p, per_head, bias, dtype, grad=True):
    def t(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=F64) * scale).to(dtype)

    basis = t(*((T, H, d_b) if per_head else (T, d_b)))
    A, B = t(H, r, d_b, scale=d_b ** -0.5), t(H, p, r, scale=r ** -0.5)
    c = t(H, p) if bias else None
    leaves = [basis, A, B] + ([c] if bias else [])
    for v in leaves:
        v.requires_grad_(grad)
    return basis, A, B, c, leaves


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("per_head", [True, False])
def test_cuda_glue_passes_the_forward_u_and_matches_the_reference(ext, dtype, bias, per_head):
    gen = torch.Generator().manual_seed(11)
    T, H, r, d_b, p = 9, 3, 5, 12, 7
    basis, A, B, c, leaves = _inputs(gen, T, H, r, d_b, p, per_head, bias, dtype)
    out, U = torch.ops.kfused.headwise_lowrank_cuda_fwd(basis, A, B, c, True)
    gy = torch.randn(T, H, p, generator=gen, dtype=F64).to(dtype)
    grads = torch.autograd.grad(out, leaves, gy)
    saved = dtype != torch.float32
    assert U.shape == ((T, H, _u_width(r)) if saved else (0,))
    assert ext.calls == [("fwd", True, tuple(U.shape)), ("bwd", bias, saved)]

    r64 = [v.detach().double().requires_grad_() for v in leaves]
    want = headwise_lowrank_ref(r64[0], r64[1], r64[2], r64[3] if bias else None,
                                per_head=per_head)
    wgrads = torch.autograd.grad(want, r64, gy.double())
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.float16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), want, **tol)
    for got, w in zip(grads, wgrads):
        torch.testing.assert_close(got.double(), w, **tol)


def test_u_is_saved_only_when_a_backward_can_follow(ext, monkeypatch):
    monkeypatch.setattr(hl, "select_backend", lambda *a, **k: "cuda")
    gen = torch.Generator().manual_seed(3)
    basis, A, B, c, _ = _inputs(gen, 6, 2, 3, 8, 4, False, True, torch.float16, grad=False)
    hl.headwise_lowrank(basis, A, B, c, backend="cuda")
    A.requires_grad_()
    with torch.no_grad():
        hl.headwise_lowrank(basis, A, B, c, backend="cuda")
    y = hl.headwise_lowrank(basis, A, B, c, backend="cuda")
    y.sum().backward()
    assert [call[:2] for call in ext.calls] == [("fwd", False), ("fwd", False), ("fwd", True),
                                                ("bwd", True)]
    assert ext.calls[-1] == ("bwd", True, True) and A.grad is not None


@pytest.mark.parametrize("dtype,r,bias", [(torch.float16, 8, True), (torch.bfloat16, 8, False),
                                          (torch.float16, 64, True), (torch.float16, 65, True),
                                          (torch.float32, 4, True), (torch.float16, 3, False)])
def test_fake_shapes_are_the_extensions(ext, dtype, r, bias):
    from torch._subclasses.fake_tensor import FakeTensorMode

    gen = torch.Generator().manual_seed(2)
    basis, A, B, c, _ = _inputs(gen, 5, 2, r, 8, 4, False, bias, dtype, grad=False)
    real = torch.ops.kfused.headwise_lowrank_cuda_fwd(basis, A, B, c, True)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = torch.ops.kfused.headwise_lowrank_cuda_fwd(basis, A, B, c, True)
        none = torch.ops.kfused.headwise_lowrank_cuda_fwd(basis, A, B, c, False)
    assert [tuple(t.shape) for t in fake] == [tuple(t.shape) for t in real]
    assert tuple(none[1].shape) == (0,)


def test_u_layout_follows_the_csrc():
    """The Python side's U rule is csrc's: the same largest rank, the same row length."""
    src = CSRC.read_text()
    assert int(re.search(r"kHwMaxN = (\d+)", src).group(1)) == hl.CUDA_HW_MAX_RANK
    assert "inline int u_width(int r) { return (r + 1 + 7) / 8 * 8; }" in src
    for r in (1, 7, 8, 9, 64):
        assert hl.cuda_u_width(r) == _u_width(r)
    assert hl.cuda_u_width(7) == 8 and hl.cuda_u_width(8) == 16 and hl.cuda_u_width(64) == 72
