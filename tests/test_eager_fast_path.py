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


# ------------------------------------------------------------------------------------------
# The validation fast paths (the common case accepted first) accept nothing the detailed
# checks refuse: random valid factor sets and weights, each mutated in one way


def _mutations(t: torch.Tensor):
    """One-fault variants of a tensor: each dimension off by one, an extra or missing
    dimension, another dtype, an integer tensor, a non-tensor."""
    out = []
    for i in range(t.dim()):
        shape = list(t.shape)
        shape[i] += 1
        out.append(torch.zeros(shape, dtype=t.dtype))
        if shape[i] > 2:
            shape[i] -= 2
            out.append(torch.zeros(shape, dtype=t.dtype))
    out += [t[None], t.reshape(-1) if t.dim() > 1 else t[:, None], t.double(), t.half(),
            t.long(), t.tolist()]
    return out


def _factor_sets(gen, H, p, d):
    r, rs = 2, 3
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    yield HeadFactors(shared_A=rnd(rs, d), shared_B=rnd(H * p, rs), scale=0.5)
    yield HeadFactors(wise_A=rnd(H, r, d), wise_B=rnd(H, p, r), wise_c=rnd(H, p))
    yield HeadFactors(lite_A=rnd(H, r, p), lite_B=rnd(H, p, r), lite_c=rnd(H, p), scale=2)
    yield HeadFactors(shared_A=rnd(rs, d), shared_B=rnd(H * p, rs), wise_A=rnd(H, r, d),
                      wise_B=rnd(H, p, r), lite_A=rnd(H, 1, p), lite_B=rnd(H, p, 1))


def test_factor_fast_check_accepts_only_what_the_checks_accept(monkeypatch):
    import dataclasses
    import math

    from kfused.ops import _headwise_common as hc

    gen = torch.Generator().manual_seed(5)
    H, p, d = 3, 4, 10
    ref = torch.zeros(2, d)
    detailed = hc._check_factors

    def refused(f):
        with monkeypatch.context() as m:
            m.setattr(hc, "_factors_fit", lambda *a: False)
            try:
                detailed("q", f, H, p, d, ref)
            except (TypeError, ValueError):
                return True
        return False

    seen = fast_true = 0
    for f in _factor_sets(gen, H, p, d):
        assert hc._factors_fit(f, H, p, d, ref) and not refused(f)
        variants = [dataclasses.replace(f, scale=s) for s in
                    (math.nan, math.inf, True, "1", torch.tensor(0.5))]
        for part, ia, ib in (("shared", 0, 1), ("wise", 1, 2), ("lite", 1, 2)):
            a, b = getattr(f, part + "_A"), getattr(f, part + "_B")
            if a is not None:       # a rank-0 pair: consistent shapes, still refused
                variants.append(dataclasses.replace(f, **{part + "_A": a.narrow(ia, 0, 0),
                                                          part + "_B": b.narrow(ib, 0, 0)}))
        for field in dataclasses.fields(f):
            t = getattr(f, field.name)
            if isinstance(t, torch.Tensor):
                variants += [dataclasses.replace(f, **{field.name: m}) for m in _mutations(t)]
                variants.append(dataclasses.replace(f, **{field.name: None}))
                if t.dim() > 1:     # rank 0
                    i = 0 if field.name == "shared_A" else (1 if field.name.endswith("A")
                                                            else t.dim() - 1)
                    variants.append(dataclasses.replace(f, **{field.name: t.narrow(i, 0, 0)}))
            elif t is None and field.name != "scale":
                like = {"wise_c": (H, p), "lite_c": (H, p)}.get(field.name)
                if like:
                    variants.append(dataclasses.replace(f, **{field.name: torch.zeros(like)}))
        for v in variants:
            seen += 1
            if hc._factors_fit(v, H, p, d, ref):
                fast_true += 1
                assert not refused(v), v
    assert seen > 150 and fast_true < seen


def test_qkv_weight_fast_check_refuses_faults_by_name():
    """headwise_qkv accepts well-formed weights and biases without its detailed checks; every
    one-fault variant still gets the detailed checks' error naming the argument."""
    gen = torch.Generator().manual_seed(6)
    H, p, d = 2, 3, 5
    x = torch.randn(4, d, generator=gen)
    args = dict(w_q=torch.randn(H * p, d, generator=gen), w_k=torch.randn(H * p, d, generator=gen),
                w_v=torch.randn(H * p, d, generator=gen), b_q=torch.randn(H * p, generator=gen),
                b_k=torch.randn(H * p, generator=gen), b_v=torch.randn(H * p, generator=gen))
    headwise_qkv(x, **args, n_heads=H, backend="reference")
    for name, t in args.items():
        for m in _mutations(t):
            bad = dict(args, **{name: m})
            with pytest.raises((TypeError, ValueError), match=name):
                headwise_qkv(x, **bad, n_heads=H, backend="reference")


def test_oproj_fast_check_accepts_only_what_the_checks_accept():
    import importlib

    ho = importlib.import_module("kfused.ops.headwise_oproj")

    gen = torch.Generator().manual_seed(7)
    H, p, r, rs, dout = 3, 4, 2, 3, 5
    o = torch.zeros(2, H * p)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    full = dict(w_o=rnd(dout, H * p), b_o=rnd(dout), wise_A=rnd(H, r, p),
                wise_B=rnd(dout, H * r), wise_c=rnd(dout), shared_A=rnd(rs, H * p),
                shared_B=rnd(dout, rs), scale=0.5)
    names = ("w_o", "b_o", "wise_A", "wise_B", "wise_c", "shared_A", "shared_B", "scale")

    def call(kw):
        args = [o] + [kw.get(n) for n in names] + [H, p]
        fast = ho._oproj_fits(*args)
        try:
            ho._check_oproj(*args, None)
            ok = True
        except (TypeError, ValueError):
            ok = False
        return fast, ok

    bases = [full, dict(full, wise_A=None, wise_B=None, wise_c=None),
             dict(full, shared_A=None, shared_B=None, b_o=None)]
    seen = 0
    for kw in bases:
        assert call(kw) == (True, True)
        variants = [dict(kw, scale=s) for s in (float("nan"), True, "2", torch.tensor(2.0))]
        variants += [dict(kw, wise_A=kw["wise_A"].narrow(1, 0, 0),
                          wise_B=kw["wise_B"].narrow(1, 0, 0))] if kw["wise_A"] is not None \
            else []
        for n in names[:-1]:
            t = kw[n]
            if isinstance(t, torch.Tensor):
                variants += [dict(kw, **{n: m}) for m in _mutations(t)]
                if n != "w_o":
                    variants.append(dict(kw, **{n: None}))
        for v in variants:
            seen += 1
            fast, ok = call(v)
            assert ok or not fast, {k: (tuple(t.shape) if isinstance(t, torch.Tensor) else t)
                                    for k, t in v.items()}
    assert seen > 100


def test_krona_fast_check_accepts_only_what_the_checks_accept(monkeypatch):
    import importlib

    kl = importlib.import_module("kfused.ops.krona_linear")
    gen = torch.Generator().manual_seed(8)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x = rnd(3, 12)
    base = dict(weight=rnd(10, 12), bias=rnd(10), A=rnd(2, 3), B=rnd(5, 4), scale=0.5)

    def refused(kw):
        with monkeypatch.context() as m:
            m.setattr(kl, "_krona_fits", lambda *a: False)
            try:
                kl.krona_linear(x, kw["weight"], kw["bias"], kw["A"], kw["B"], kw["scale"],
                                backend="reference")
            except (TypeError, ValueError):
                return True
        return False

    def fast(kw):
        return kl._krona_fits(x, kw["weight"], kw["bias"], kw["A"], kw["B"], kw["scale"])

    variants = [base, dict(base, bias=None)]
    variants += [dict(base, scale=s) for s in (float("nan"), True, "2", torch.tensor(2.0), 3)]
    variants += [dict(base, A=base["A"].narrow(0, 0, 0))]
    for n in ("weight", "bias", "A", "B"):
        variants += [dict(base, **{n: m}) for m in _mutations(base[n])]
    seen = accepted = 0
    for kw in variants:
        seen += 1
        if fast(kw):
            accepted += 1
            assert not refused(kw), {k: (tuple(t.shape) if isinstance(t, torch.Tensor) else t)
                                     for k, t in kw.items()}
    assert fast(base) and not refused(base) and seen > 40 and 2 <= accepted < seen
