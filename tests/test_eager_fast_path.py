"""The eager fast path of kfused's custom ops (kfused.ops._common.run_op): in plain eager mode
an op runs its implementation directly (through a light autograd.Function when a gradient is
wanted) instead of torch's custom-op dispatch, which cost the H100 run of 2026-11-27 most of
its host time. Same kernels, so the same bits; same errors; the custom op everywhere else."""

import pytest
import torch

from kfused.ops import _common, headwise_qkv, kron_matvec, krona_linear
from kfused.reference.headwise import HeadFactors

from conftest import DEVICE


def _both(fn):
    """fn() with the fast path on, then off (torch.ops dispatch): (on, off)."""
    _common.FAST_PATH["on"] = True
    try:
        on = fn()
        _common.FAST_PATH["on"] = False
        off = fn()
    finally:
        _common.FAST_PATH["on"] = True
    return on, off


def _grads(f, *inputs):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = f(*leaves)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out)
    return (out.detach(),) + torch.autograd.grad(out, leaves, g)


@pytest.mark.parametrize("exact", [True, False])
def test_krona_linear_same_bits_either_way(exact):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 20, generator=gen).half().to(DEVICE)
    W = (torch.randn(12, 20, generator=gen) / 5).half().to(DEVICE)
    b = torch.randn(12, generator=gen).half().to(DEVICE)
    A = torch.randn(3, 4, generator=gen).half().to(DEVICE)
    B = torch.randn(4, 5, generator=gen).half().to(DEVICE)
    f = lambda x, A, B: krona_linear(x, W, b, A, B, 0.5, backend="triton",  # noqa: E731
                                     exact=exact)
    on, off = _both(lambda: _grads(f, x, A, B))
    for a, c in zip(on, off):
        assert torch.equal(a, c)


def test_kron_matvec_same_bits_and_calls_no_custom_op(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    x, A, B = (torch.randn(*s, generator=gen).to(DEVICE) for s in ((9, 12), (2, 3), (5, 4)))
    f = lambda x, A, B: kron_matvec(x, A, B, backend="triton")  # noqa: E731
    on, off = _both(lambda: _grads(f, x, A, B))
    for a, c in zip(on, off):
        assert torch.equal(a, c)
    # the fast path really skips the dispatch: the custom op object is never called
    entry = _common._OPS["kron_matvec_triton_fwd"]
    called = []
    monkeypatch.setattr(entry, "op", lambda *a: called.append(a))
    _grads(f, x, A, B)
    assert called == []


def test_double_backward_still_refused_on_the_fast_path():
    gen = torch.Generator().manual_seed(2)
    x, A, B = (torch.randn(*s, generator=gen).to(DEVICE).requires_grad_()
               for s in ((6, 12), (2, 3), (5, 4)))
    y = kron_matvec(x, A, B, backend="triton")
    (gA,) = torch.autograd.grad(y.square().sum(), (A,), create_graph=True)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        gA.sum().backward()


def test_headwise_qkv_same_bits_either_way():
    gen = torch.Generator().manual_seed(4)
    T, d, H, p, r = 11, 32, 4, 8, 2
    x = torch.randn(T, d, generator=gen).to(DEVICE)
    w = {n: (torch.randn(H * p, d, generator=gen) / 6).to(DEVICE) for n in "qkv"}
    A = torch.randn(H, r, d, generator=gen).to(DEVICE) * 0.1
    B = torch.randn(H, p, r, generator=gen).to(DEVICE) * 0.1

    def f(x, A, B):
        q, k, v = headwise_qkv(x, w["q"], w["k"], w["v"], n_heads=H,
                               q=HeadFactors(wise_A=A, wise_B=B), backend="triton")
        return torch.cat([q, k, v], -1)
    on, off = _both(lambda: _grads(f, x, A, B))
    for a, c in zip(on, off):
        assert torch.equal(a, c)


def test_compile_and_fake_tensors_take_the_custom_op():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(5, 12)
        assert not _common._plain_eager((x,))
    assert _common._plain_eager((torch.empty(2),))
    assert not _common._plain_eager((torch.empty(2, device="meta"),))


def test_every_op_is_a_kops_attribute_from_import():
    """torch.compile of the lite modules failed (Dynamo RecursionError) in a process where
    the section backward op had not run eagerly yet: Dynamo traced kops' first lookup of it
    through __getattr__. Every registered op is now an attribute from registration on (the
    test file passed only when an earlier test had run the op)."""
    import kfused.ops  # noqa: F401  (registers every op)
    from kfused.ops import _common

    assert set(_common._OPS) <= set(vars(_common.kops))
