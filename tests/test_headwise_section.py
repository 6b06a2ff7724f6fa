"""The one-launch assembly of a Kernel-wise-lite section's kernel-level factors
(kfused.ops._headwise_common.LiteSection, kernels in kfused.triton_kernels.headwise_section)
against the same construction in float64 torch, forward and every gradient."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE
from kfused.ops._headwise_common import LiteSection

F64 = torch.float64


def _expected(wa, wb, la, lb, wk, bk, Hk, split):
    """down, zb, up in float64 from the factors (as float32 reads them), and the float32
    basis the hi/lo split rounds."""
    H, RL, P = la.shape
    G = H // Hk
    basis = torch.einsum("hrp,hpd->hrd", la.to(F64),
                         wk.to(F64).reshape(Hk, P, -1).repeat_interleave(G, 0))
    zl = (torch.einsum("hrp,hp->hr", la.to(F64), bk.to(F64).reshape(Hk, P)
                       .repeat_interleave(G, 0)) if bk is not None
          else basis.new_zeros(H, RL))
    downs, zbs, ups = [], [], []
    if wa is not None:
        downs.append(wa.to(F64))
        zbs.append(basis.new_zeros(H, wa.shape[1]))
        ups.append(wb.to(F64))
    downs.append(basis)
    zbs.append(zl)
    ups.append(lb.to(F64))
    if split is not None:
        downs.append(basis.new_zeros(basis.shape))     # lo: checked as hi + lo below
        zbs.append(basis.new_zeros(H, RL))
        ups.append(lb.to(F64))
    return torch.cat(downs, 1), torch.cat(zbs, 1), torch.cat(ups, 2)


CASES = [  # H, Hk, RW, RL, P, d, b_k, dtype (split when 16-bit), transposed w_k
    (3, 3, 2, 2, 5, 19, True, torch.float16, False),
    (4, 2, 0, 3, 8, 33, True, torch.float16, True),     # lite alone, GQA, Conv1D-style w_k
    (4, 1, 1, 1, 3, 7, False, torch.float16, False),    # MQA, no key bias
    (2, 2, 3, 2, 6, 40, True, torch.float32, False),    # float32: one basis row, no split
    (6, 3, 2, 5, 17, 70, True, torch.float32, True),
]


@pytest.mark.parametrize("H,Hk,RW,RL,P,d,has_bk,dtype,tr", CASES)
def test_lite_section_forward_and_gradients(H, Hk, RW, RL, P, d, has_bk, dtype, tr):
    split = dtype if dtype != torch.float32 else None
    r = lambda *s: (torch.randn(*s, device=DEVICE) * 0.5).to(dtype).requires_grad_()  # noqa
    wa, wb = (r(H, RW, d), r(H, P, RW)) if RW else (None, None)
    la, lb = r(H, RL, P), r(H, P, RL)
    wk = (r(d, Hk * P).detach().t().requires_grad_() if tr else r(Hk * P, d))
    bk = r(Hk * P) if has_bk else None
    down, zb, up = LiteSection.apply(wa, wb, la, lb, wk, bk, Hk, split)
    e_down, e_zb, e_up = _expected(wa, wb, la, lb, wk, bk, Hk, split)
    R = RW + RL * (2 if split is not None else 1)
    assert down.shape == (H, R, d) and zb.shape == (H, R) and up.shape == (H, P, R)
    assert down.dtype == zb.dtype == up.dtype == torch.float32
    # copies are exact; the basis is a float32 sum of P products of 16/32-bit numbers
    torch.testing.assert_close(down[:, :RW].to(F64), e_down[:, :RW], rtol=0, atol=0)
    torch.testing.assert_close(up.to(F64), e_up, rtol=0, atol=0)
    exact = e_down[:, RW:RW + RL]
    mag = torch.einsum("hrp,hpd->hrd", la.detach().abs().to(F64),
                       wk.detach().abs().to(F64).reshape(Hk, P, -1).repeat_interleave(H // Hk, 0))
    tol = 4 * P * 2.0 ** -24 * mag + 1e-30
    got = down[:, RW:RW + RL].to(F64)
    if split is not None:
        hi = got
        lo = down[:, RW + RL:].to(F64)
        assert torch.equal(hi.to(dtype).to(F64), hi), "hi must be a 16-bit number"
        # hi rounds the float32 basis; lo carries the rest to float32 accuracy
        assert ((hi - exact).abs() <= (exact.abs() * 2.0 ** -10 + tol) * 1.01).all()
        got = hi + lo
    assert ((got - exact).abs() <= tol).all(), (got - exact).abs().max()
    ztol = 4 * P * 2.0 ** -24 * (e_zb.abs() + 1) + 1e-30
    assert ((zb.to(F64) - e_zb).abs() <= ztol).all()

    # gradients: d(hi) carries nothing (a constant rounding of the basis), d(lo) = d(basis)
    gd, gz, gu = (torch.randn_like(t) for t in (down, zb, up))
    leaves = [t for t in (wa, wb, la, lb, wk, bk) if t is not None]
    grads = torch.autograd.grad((down, zb, up), leaves, (gd, gz, gu), allow_unused=True)
    got = dict(zip([id(t) for t in leaves], grads))
    gb = gd[:, RW + RL:] if split is not None else gd[:, RW:RW + RL]    # d(basis)
    gzl = gz[:, RW:RW + RL]
    G = H // Hk
    wk3 = wk.detach().to(F64).reshape(Hk, P, d).repeat_interleave(G, 0)
    bk2 = (bk.detach().to(F64).reshape(Hk, P).repeat_interleave(G, 0) if has_bk
           else torch.zeros(H, P, dtype=F64, device=DEVICE))
    A = lambda t: t.detach().abs().to(F64)  # noqa: E731
    la3 = la.detach().to(F64).reshape(Hk, G, RL, P)
    # (expected, Σ|terms|, number of float32 additions) per leaf
    exp = {id(la): (torch.einsum("hrd,hpd->hrp", gb.to(F64), wk3)
                    + gzl.to(F64)[:, :, None] * bk2[:, None, :],
                    torch.einsum("hrd,hpd->hrp", A(gb), wk3.abs())
                    + A(gzl)[:, :, None] * bk2.abs()[:, None, :], d + 1),
           id(lb): ((gu[:, :, RW:RW + RL] + (gu[:, :, RW + RL:] if split is not None else 0)
                     ).to(F64), A(gu[:, :, RW:RW + RL]) + (A(gu[:, :, RW + RL:])
                                                            if split is not None else 0), 1),
           id(wk): (torch.einsum("khrp,khrd->kpd", la3, gb.to(F64).reshape(Hk, G, RL, d))
                    .reshape(Hk * P, d),
                    torch.einsum("khrp,khrd->kpd", la3.abs(), A(gb).reshape(Hk, G, RL, d))
                    .reshape(Hk * P, d), G * RL)}
    if has_bk:
        exp[id(bk)] = (torch.einsum("khrp,khr->kp", la3, gzl.to(F64).reshape(Hk, G, RL))
                       .reshape(-1), torch.einsum("khrp,khr->kp", la3.abs(),
                                                  A(gzl).reshape(Hk, G, RL)).reshape(-1), G * RL)
    if RW:
        exp[id(wa)] = (gd[:, :RW].to(F64), A(gd[:, :RW]), 0)
        exp[id(wb)] = (gu[:, :, :RW].to(F64), A(gu[:, :, :RW]), 0)
    eps = torch.finfo(dtype).eps
    for t in leaves:
        g = got[id(t)]
        assert g is not None and g.dtype == t.dtype and g.shape == t.shape
        e, mag, n = exp[id(t)]
        # a float32 sum of n + 1 terms, rounded once to the factor's dtype (subnormal floor
        # for 16-bit)
        tol = eps * e.abs() + 2 * (n + 1) * 2.0 ** -24 * mag + torch.finfo(dtype).tiny
        err = (g.to(F64) - e).abs()
        assert (err <= tol).all(), (t.shape, (err - tol).max().item())


def test_lite_section_one_launch_each_way(launches):
    from kfused.triton_kernels import headwise_section as hs

    fwd = launches(hs, "_section_fwd_kernel")
    bwd = launches(hs, "_section_bwd_kernel")
    H, P, d = 4, 8, 24
    la = torch.randn(H, 2, P, device=DEVICE, dtype=torch.float16, requires_grad=True)
    lb = torch.randn(H, P, 2, device=DEVICE, dtype=torch.float16, requires_grad=True)
    wk = torch.randn(2 * P, d, device=DEVICE, dtype=torch.float16)
    outs = LiteSection.apply(None, None, la, lb, wk, None, 2, torch.float16)
    torch.autograd.grad(outs[0].sum() + outs[2].sum(), [la, lb])
    assert len(fwd) == 1 and len(bwd) == 1
