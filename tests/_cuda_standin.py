"""Float64 stand-ins for the CUDA extension's functions (kfused._C), with its call signatures,
output shapes, dtypes and (contiguous) layouts, for running GPU test code on the CPU.

The GPU tests of the extension (tests/test_cuda_ext.py) had never run before a GPU was lent:
a mistake in a test's own reference or plumbing (a float16 ``full_like(-1e30)`` overflow, a
dtype the kernel does not return) would only show on the GPU, at the cost of device time.
Without a GPU the file runs against these stand-ins instead, which checks everything but the
kernels themselves; tests/test_inducer_cuda_host.py uses the inducer one for the host glue.
"""

from __future__ import annotations

import torch

from kfused.reference.inducer import (inducer_attention_ref, inducer_key_logit,
                                      inducer_value_hidden)

F64 = torch.float64
FULLY_MASKED_LSE = -1e30     # csrc/inducer/inducer.cuh kFullyMaskedLse


def _d(t):
    return None if t is None else t.to(F64)


def _kron(x, A, B):
    X = x.reshape(x.shape[0], A.shape[1], B.shape[1])
    return torch.matmul(torch.matmul(A, X), B.transpose(0, 1)).reshape(x.shape[0], -1)


def kron_matvec_fwd(x, A, B):
    if x.shape[0] == 0:
        return x.new_empty(0, A.shape[0] * B.shape[0])
    return _kron(_d(x), _d(A), _d(B)).to(x.dtype)


def kron_matvec_bwd(g, x, A, B, need_dx=True, scale=1.0):
    """Closed-form gradients (no autograd: called inside a custom op's backward, below the
    autograd dispatch key): y[t] = s·A X[t] Bᵀ, so dX[t] = s·Aᵀ G[t] B, dA = s·Σ G[t] B X[t]ᵀ,
    dB = s·Σ G[t]ᵀ A X[t]."""
    T = x.shape[0]
    if T == 0:
        return (x.new_empty(x.shape) if need_dx else x.new_empty(0), torch.zeros_like(A),
                torch.zeros_like(B))
    Ad, Bd = _d(A), _d(B)
    X = _d(x).reshape(T, A.shape[1], B.shape[1])
    G = _d(g).reshape(T, A.shape[0], B.shape[0])
    dx = (scale * torch.einsum("ik,tij,jl->tkl", Ad, G, Bd)).reshape(T, -1)
    dA = scale * torch.einsum("tij,jl,tkl->ik", G, Bd, X)
    dB = scale * torch.einsum("tij,ik,tkl->jl", G, Ad, X)
    return tuple(t.contiguous() for t in ((dx.to(x.dtype) if need_dx else x.new_empty(0)),
                                          dA.to(A.dtype), dB.to(B.dtype)))


def krona_fold_fwd(W, A, B, scale):
    """The extension's formula: W + s·A⊗B in float32, rounded once."""
    return (W.float() + scale * torch.kron(A.float(), B.float())).to(W.dtype).contiguous()


def _headwise(basis, A, B):
    eq = "td,hrd->thr" if basis.dim() == 2 else "thd,hrd->thr"
    U = torch.einsum(eq, basis, A)
    return U, torch.einsum("thr,hpr->thp", U, B)


def headwise_lowrank_fwd(basis, A, B, bias=None, save_u=False):
    """(out, U): U (T, H, r + 1 rounded up to 8) on the 16-bit tensor-core path (r <= 64)
    when save_u — U, a ones column at r (dB's product then yields dbias), zeros after —
    else empty."""
    U, out = _headwise(_d(basis), _d(A), _d(B))
    if bias is not None:
        out = out + _d(bias)
    T, H, r = U.shape
    Us = basis.new_empty(0)
    if save_u and basis.dtype != torch.float32 and r <= 64:
        Us = torch.zeros(T, H, (r + 1 + 7) // 8 * 8, dtype=basis.dtype)
        Us[..., :r] = U.to(basis.dtype)
        Us[..., r] = 1
    return out.to(basis.dtype).contiguous(), Us


def headwise_lowrank_bwd(g, basis, A, B, has_bias, U=None):
    """Closed-form gradients (no autograd, as kron_matvec_bwd): out = U Bᵀ per head with
    U = basis Aᵀ, so dU = g B, dB = Σ_t gᵀ U, dA = Σ_t dUᵀ basis, dbasis = dU A (summed over
    the heads for a shared basis)."""
    bd, Ad, Bd, gd = _d(basis), _d(A), _d(B), _d(g)
    Uf, _ = _headwise(bd, Ad, Bd)
    dU = torch.einsum("thp,hpr->thr", gd, Bd)
    dB = torch.einsum("thp,thr->hpr", gd, Uf)
    if basis.dim() == 2:
        dA = torch.einsum("thr,td->hrd", dU, bd)
        dbasis = torch.einsum("thr,hrd->td", dU, Ad)
    else:
        dA = torch.einsum("thr,thd->hrd", dU, bd)
        dbasis = torch.einsum("thr,hrd->thd", dU, Ad)
    dbias = gd.sum(0).to(g.dtype) if has_bias else g.new_empty(0)
    return tuple(t.contiguous() for t in (dbasis.to(basis.dtype), dA.to(A.dtype),
                                          dB.to(B.dtype), dbias))


def inducer_attention_fwd(q, k, v, s0, pk=None, pv=None, lens=None, causal=False, Ak=None,
                          ak=None, Bk=None, ck=None, W1=None, b1=None, u_float=False):
    """(f, lse, lam, u) as inducer_attention_fwd returns them — f (ordinary prefix-attention,
    q's dtype), its LSE and λ = σ(s0 − LSE) (float32; a row with no visible key: f = 0,
    LSE = -1e30, λ = 1) and, given the MLP weights instead of s0 (16-bit only), s0 and
    u = λ tanh(q W1 + b1) computed as the kernel does — from the float64 reference. k, v may
    have fewer heads than q (grouped-query attention)."""
    mlp = W1 is not None
    # like the C++ (inducer_attention_fwd.cu): key_lengths int32 or int64
    assert lens is None or lens.dtype in (torch.int32, torch.int64), lens.dtype
    assert (s0 is None) == mlp, "the kernel takes s0 or the MLP weights, not both / neither"
    assert not mlp or q.dtype != torch.float32, "the in-kernel MLP is the 16-bit path"
    f, _, lse, _ = inducer_attention_ref(_d(q), _d(k), _d(v), causal=causal,
                                         seq_lens=None if lens is None else lens.cpu(),
                                         prefix_k=_d(pk), prefix_v=_d(pv), return_stats=True)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, FULLY_MASKED_LSE), lse)
    if mlp:
        s0 = inducer_key_logit(_d(q), _d(Ak), _d(ak), _d(Bk), _d(ck), q.shape[-1] ** -0.5)
    lam = torch.sigmoid(s0.to(F64) - lse)
    u = q.new_empty(0)
    if mlp:
        u = (lam[..., None] * inducer_value_hidden(_d(q), _d(W1), _d(b1))).to(
            torch.float32 if u_float else q.dtype)
    return tuple(t.contiguous() for t in (f.to(q.dtype), lse.float(), lam.float(), u))
