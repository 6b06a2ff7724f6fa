"""Issue 13: every op's Triton path is deterministic — the same inputs give bitwise-identical
outputs and gradients across runs (and every value is finite: output buffers are NaN-poisoned
before each launch, so an element a kernel forgets to write would show up here)."""

import pytest
import torch

from kfused import (HeadFactors, headwise_lowrank, headwise_oproj, headwise_projection,
                    headwise_qkv, inducer_attention, inducer_output_projection, kron_matvec,
                    krona_linear)

from conftest import DEVICE, DTYPES


def _r(g, *shape, dtype):
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(DEVICE, dtype)


def _hf(g, H, p, d, dtype):
    return dict(shared_A=_r(g, 2, d, dtype=dtype), shared_B=_r(g, H * p, 2, dtype=dtype),
                wise_A=_r(g, H, 3, d, dtype=dtype), wise_B=_r(g, H, p, 3, dtype=dtype),
                wise_c=_r(g, H, p, dtype=dtype), lite_A=_r(g, H, 2, p, dtype=dtype),
                lite_B=_r(g, H, p, 2, dtype=dtype))


def _case(name, dtype, g):
    """(function of the float inputs, inputs) for one op."""
    r = lambda *s: _r(g, *s, dtype=dtype)  # noqa: E731
    if name == "kron_matvec":
        return (lambda x, A, B: kron_matvec(x, A, B, backend="triton"),
                dict(x=r(3, 7, 12), A=r(5, 3), B=r(2, 4)))
    if name == "krona_linear":
        return (lambda x, W, b, A, B: krona_linear(x, W, b, A, B, 0.7, backend="triton"),
                dict(x=r(9, 12), W=r(12, 10).t(), b=r(10), A=r(5, 3), B=r(2, 4)))
    if name == "headwise_lowrank":
        return (lambda basis, A, B, c: headwise_lowrank(basis, A, B, c, per_head=True,
                                                        backend="triton"),
                dict(basis=r(2, 11, 3, 9), A=r(3, 2, 9), B=r(3, 5, 2), c=r(3, 5)))
    if name == "headwise_qkv":
        H, Hkv, p, d = 4, 2, 3, 10
        q, v = _hf(g, H, p, d, dtype), _hf(g, Hkv, p, d, dtype)

        def fn(x, wq, wk, wv, bq, bk, bv, *fac):
            qf = HeadFactors(scale=0.5, **dict(zip(q, fac[:len(q)])))
            vf = HeadFactors(scale=1.5, **dict(zip(v, fac[len(q):])))
            return headwise_qkv(x, wq, wk, wv, bq, bk, bv, n_heads=H, n_kv_heads=Hkv, q=qf,
                                v=vf, backend="triton")
        inputs = dict(x=r(13, d), wq=r(H * p, d), wk=r(Hkv * p, d), wv=r(Hkv * p, d),
                      bq=r(H * p), bk=r(Hkv * p), bv=r(Hkv * p),
                      **{f"q_{k}": t for k, t in q.items()}, **{f"v_{k}": t for k, t in v.items()})
        return (lambda **kw: fn(*kw.values())), inputs
    if name == "headwise_projection":
        H, Hk, p, d = 4, 2, 3, 10
        f = _hf(g, H, p, d, dtype)

        def fn(x, W, b, wk, bk, *fac):
            return headwise_projection(x, W, b, n_heads=H, w_k=wk, b_k=bk,
                                       factors=HeadFactors(scale=0.5, **dict(zip(f, fac))),
                                       backend="triton")
        inputs = dict(x=r(13, d), W=r(H * p, d), b=r(H * p), wk=r(Hk * p, d), bk=r(Hk * p),
                      **{f"f_{k}": t for k, t in f.items()})
        return (lambda **kw: fn(*kw.values())), inputs
    if name == "headwise_oproj":
        H, p, d = 3, 4, 7
        return (lambda o, W, b, wA, wB, wc, sA, sB: headwise_oproj(
                    o, W, b, n_heads=H, wise_A=wA, wise_B=wB, wise_c=wc, shared_A=sA,
                    shared_B=sB, scale=0.5, backend="triton"),
                dict(o=r(2, 9, H * p), W=r(d, H * p), b=r(d), wA=r(H, 2, p), wB=r(d, H * 2),
                     wc=r(d), sA=r(3, H * p), sB=r(d, 3)))
    if name.startswith("inducer_attention"):
        comp = name.split("-")[1]
        B, H, n, p, L, rr = 2, 2, 19, 32, 3, 4
        mask = (torch.rand(B, n, generator=g) > 0.3).to(DEVICE)   # on q's device
        mask[1] = False  # a fully padded batch element
        extra = dict(W2=r(H, rr, p), b2=r(H, p)) if comp == "gate" else {}

        def fn(q, k, v, Ak, ak, Bk, ck, W1, b1, pk, pv, W2=None, b2=None):
            out, u = inducer_attention(q, k, v, Ak, ak, Bk, ck, W1, b1, W2, b2,
                                       composition=comp, causal=True, key_padding_mask=mask,
                                       prefix_k=pk, prefix_v=pv, backend="triton")
            return out if u is None else (out, u)
        return fn, dict(q=r(B, n, H, p).transpose(1, 2), k=r(B, H, n, p), v=r(B, H, n, p),
                        Ak=r(H, p, L), ak=r(H, L), Bk=r(H, L, p), ck=r(H, p), W1=r(H, p, rr),
                        b1=r(H, rr), pk=r(H, 2, p), pv=r(H, 2, p), **extra)
    if name == "inducer_output_projection":
        return (inducer_output_projection,
                dict(f=r(2, 3, 5, 4), u=r(2, 3, 5, 2), W_o=r(6, 12), b_o=r(6), W2=r(3, 2, 6),
                     b2=r(6)))
    raise AssertionError(name)


OPS = ["kron_matvec", "krona_linear", "headwise_lowrank", "headwise_qkv", "headwise_projection",
       "headwise_oproj", "inducer_attention-add", "inducer_attention-gate",
       "inducer_output_projection"]


def _run(fn, inputs, grad_seed):
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inputs.items()}
    outs = fn(**leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator().manual_seed(grad_seed)
    gouts = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device, o.dtype)
             for o in outs]
    grads = torch.autograd.grad(outs, list(leaves.values()), gouts, allow_unused=True)
    return [o.detach() for o in outs], dict(zip(leaves, grads))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("op", OPS)
def test_bitwise_deterministic(op, dtype, seed):
    fn, inputs = _case(op, dtype, torch.Generator().manual_seed(seed))
    outs1, grads1 = _run(fn, inputs, seed)
    outs2, grads2 = _run(fn, inputs, seed)
    for i, (a, b) in enumerate(zip(outs1, outs2)):
        assert torch.isfinite(a).all(), f"{op}: output {i} has non-finite values"
        assert torch.equal(a, b), f"{op}: output {i} differs between two identical runs"
    for k in grads1:
        a, b = grads1[k], grads2[k]
        assert (a is None) == (b is None), k
        if a is None:
            continue
        assert torch.isfinite(a).all(), f"{op}: gradient of {k} has non-finite values"
        assert torch.equal(a, b), f"{op}: gradient of {k} differs between two identical runs"
