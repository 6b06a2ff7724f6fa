"""The torch side of ``krona_linear(backend="cuda")``'s folded path (kfused::krona_linear_cuda_
folded_fwd / _bwd) on the CPU, with a stand-in for the extension built from float64 formulas:
W' = W + s·A⊗B from its fold kernel, then F.linear; dx = dy W' (W' recomputed); dA, dB from its
kron_matvec backward asked for no dx and the scale s. Checks every formula and the call
contract without a GPU; the kernels themselves are tested on a GPU (tests/test_cuda_ext.py)."""

import importlib

import pytest
import torch

from kfused.backends import BackendError
from kfused.reference.krona import krona_linear_ref

F64 = torch.float64
# the module (kfused.ops re-exports the function under the same name)
kl = importlib.import_module("kfused.ops.krona_linear")


class StandIn:
    """krona_fold_fwd and kron_matvec_bwd as the extension defines them (csrc/kfused.h)."""

    def __init__(self):
        self.calls = []

    def krona_fold_fwd(self, W, A, B, scale=1.0):
        self.calls.append(("fold", scale))
        return (W.double() + scale * torch.kron(A.double(), B.double())).to(W.dtype)

    def kron_matvec_bwd(self, g, x, A, B, need_dx=True, scale=1.0):
        self.calls.append(("kron_bwd", need_dx, scale))
        # like the C++ (csrc/krona/kron_matvec.cu check_contiguous)
        assert g.is_contiguous() and x.is_contiguous(), "the extension needs contiguous g, x"
        assert A.is_contiguous() and B.is_contiguous()
        # y[t] = A X[t] Bᵀ: dX[t] = Aᵀ G[t] B, dA = Σ G[t] B X[t]ᵀ, dB = Σ G[t]ᵀ A X[t]
        A64, B64 = A.double(), B.double()
        G = g.double().view(-1, A.shape[0], B.shape[0]) * scale
        X = x.double().view(-1, A.shape[1], B.shape[1])
        dx = (A64.t() @ G @ B64).reshape(x.shape)
        dA = (G @ B64 @ X.transpose(1, 2)).sum(0)
        dB = (G.transpose(1, 2) @ A64 @ X).sum(0)
        return ((dx.to(x.dtype) if need_dx else x.new_empty(0)), dA.to(A.dtype), dB.to(B.dtype))


@pytest.fixture
def ext(monkeypatch):
    s = StandIn()
    monkeypatch.setattr(kl, "_ext", lambda: s)
    return s


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("factor_grads", [True, False])
def test_cuda_folded_glue_matches_the_reference(ext, bias, factor_grads):
    g = torch.Generator().manual_seed(5)
    T, (a_out, a_in), (b_out, b_in), s = 7, (3, 4), (5, 2), 0.7

    def t(*shape, grad=False):
        return torch.randn(*shape, generator=g).requires_grad_(grad)

    x = t(T, a_in * b_in, grad=True)
    W = t(a_out * b_out, a_in * b_in).t().contiguous().t()     # a transposed (Conv1D) view
    b = t(a_out * b_out) if bias else None
    A, B = t(a_out, a_in, grad=factor_grads), t(b_out, b_in, grad=factor_grads)
    gy = t(T, a_out * b_out)
    y = torch.ops.kfused.krona_linear_cuda_folded_fwd(x, W, b, A, B, s)[0]
    leaves = [x] + ([A, B] if factor_grads else [])
    grads = torch.autograd.grad(y, leaves, gy)

    r = [v.detach().double().requires_grad_(v.requires_grad) for v in (x, A, B)]
    want = krona_linear_ref(r[0], W.double(), None if b is None else b.double(), r[1], r[2], s)
    wgrads = torch.autograd.grad(want, [r[0]] + (r[1:] if factor_grads else []), gy.double())
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    for got, w in zip(grads, wgrads):
        torch.testing.assert_close(got.double(), w, rtol=1e-5, atol=1e-5)
    # the fold in the forward and again for dx; the factor gradients only when asked, from a
    # backward that forms no dx and scales by s
    assert ext.calls[:2] == [("fold", s), ("fold", s)]
    assert ext.calls[2:] == ([("kron_bwd", False, s)] if factor_grads else [])


def test_krona_linear_offers_cuda_and_auto_keeps_triton():
    """"cuda" is a backend of krona_linear now; on CPU tensors it is refused with the reason,
    and auto never picks it there."""
    x, W = torch.randn(4, 6), torch.randn(6, 6)
    A, B = torch.randn(3, 3), torch.randn(2, 2)
    with pytest.raises(BackendError, match="cuda"):
        kl.krona_linear(x, W, None, A, B, backend="cuda")
    y = kl.krona_linear(x, W, None, A, B, 0.5, backend="auto")      # CPU: the reference
    torch.testing.assert_close(y, krona_linear_ref(x, W, None, A, B, 0.5))


def test_partial_extension_is_refused_before_a_missing_kernel_is_called(monkeypatch):
    """An extension built from other sources (here: kron_matvec_fwd without kron_matvec_bwd)
    passed unavailable_reason, which looked for ``<op>_fwd`` only: the cuda backend was offered
    (``kfused info``: yes) and training failed in the backward with an AttributeError.
    Forward-only kernels (krona_fold, inducer_attention) need no ``_bwd``."""
    import types

    from kfused import available_backends, cuda as kcuda

    fn = lambda *a, **k: None  # noqa: E731
    partial = types.SimpleNamespace(kron_matvec_fwd=fn, krona_fold_fwd=fn,
                                    inducer_attention_fwd=fn)
    monkeypatch.setattr(kcuda, "_LOADED", [(partial, None)])
    for op in ("kron_matvec", "krona_linear"):
        assert "kron_matvec_bwd" in kcuda.unavailable_reason(op)
        with pytest.raises(RuntimeError, match="kron_matvec_bwd"):
            kcuda.require(op)
        assert "kron_matvec_bwd" in available_backends(op, "cuda", torch.float16)["cuda"]
    assert "headwise_lowrank_fwd" in kcuda.unavailable_reason("headwise_lowrank")
    assert kcuda.unavailable_reason("inducer_attention") is None
    assert kcuda.require("inducer_attention") is partial
    full = types.SimpleNamespace(kron_matvec_bwd=fn, headwise_lowrank_fwd=fn,
                                 headwise_lowrank_bwd=fn, **vars(partial))
    monkeypatch.setattr(kcuda, "_LOADED", [(full, None)])
    for op in ("kron_matvec", "krona_linear", "headwise_lowrank", "inducer_attention", ""):
        assert kcuda.unavailable_reason(op) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # as on a GPU machine
    assert available_backends("krona_linear", "cuda", torch.float16)["cuda"] is None
