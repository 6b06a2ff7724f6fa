"""Inducer attention over packed variable-length batches (``inducer_attention_varlen``):
kernel vs the float64 reference (docs/math.md §4), agreement with the padded batched op,
op registration and bad inputs."""

import math

import pytest
import torch

from tests.conftest import DEVICE, DTYPES
from tests.test_inducer import _params, _proj_params
from kfused.backends import BackendError
from kfused.ops import inducer_attention, inducer_attention_varlen, inducer_output_projection
from kfused.ops.inducer_attention import _triton_bwd, _triton_fwd
from kfused.reference.inducer import inducer_attention_varlen_ref
from kfused.testing import assert_against_reference

f64 = torch.float64


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _packed(lens_q, lens_k, H, H_kv, p):
    tq, tk = sum(lens_q), sum(lens_k)
    return {"q": torch.randn(tq, H, p, dtype=f64), "k": torch.randn(tk, H_kv, p, dtype=f64),
            "v": torch.randn(tk, H_kv, p, dtype=f64)}


def _fns(composition, causal, with_proj):
    def make(backend):
        def fn(q, k, v, cu_seqlens_q, cu_seqlens_k=None, W_o=None, b_o=None, W2o=None,
               b2o=None, **params):
            out, u = inducer_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **params,
                                              composition=composition, causal=causal,
                                              backend=backend)
            if u is None:
                return out
            if not with_proj:
                return out, u
            # the output projection takes (B, H, n, ·): one "batch" of every packed token
            f4, u4 = out.transpose(0, 1).unsqueeze(0), u.transpose(0, 1).unsqueeze(0)
            return out, u, inducer_output_projection(f4, u4, W_o, b_o, W2o, b2o)
        return fn
    return make("triton"), make("reference")


CASES = [
    # lens_q, lens_k (None: the same), H, H_kv, p, l, causal, composition, inducer
    ([5, 70, 1, 0, 33], None, 2, 2, 32, 0, False, "add", True),   # an empty sequence
    ([17, 3, 64], [20, 3, 80], 4, 2, 64, 2, True, "gate", True),  # cross lengths, GQA
    ([9, 130], None, 2, 1, 32, 1, True, "add", False),            # plain prefix attention
    ([1, 1, 1, 1, 1, 1], [40, 0, 7, 3, 12, 1], 2, 2, 128, 3, True, "add", True),  # decode-like
    ([66, 2], None, 1, 1, 80, 0, True, "add", True),              # no key at all: f = 0, λ = 1
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("lens_q,lens_k,H,H_kv,p,l,causal,composition,inducer", CASES,
                         ids=[f"{len(c[0])}seq-H{c[2]}/{c[3]}p{c[4]}l{c[5]}"
                              f"{'c' if c[6] else ''}-{c[7] if c[8] else 'plain'}"
                              for c in CASES])
def test_varlen_against_reference(lens_q, lens_k, H, H_kv, p, l, causal, composition, inducer,
                                  dtype):
    same = lens_k is None
    lens_k = lens_q if same else lens_k
    inputs = {**_packed(lens_q, lens_k, H, H_kv, p), "cu_seqlens_q": _cu(lens_q)}
    if not same:
        inputs["cu_seqlens_k"] = _cu(lens_k)
    P = _params(H, p, composition=composition, l=l)
    if not inducer:
        P = {k_: t for k_, t in P.items() if k_.startswith("prefix")}
    inputs.update(P)
    with_proj = inducer and composition == "add"
    if with_proj:
        inputs.update(_proj_params(H, p, P["W1"].shape[2]))
    kern, ref = _fns(composition, causal, with_proj)
    assert_against_reference(kern, ref, inputs, dtype, DEVICE)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_padded_batch(causal):
    """The packed call gives the padded batched op's real rows (left-aligned sequences,
    seq_lens masking the padding), outputs and gradients."""
    torch.manual_seed(3)
    lens, H, p, n = [7, 40, 1, 23], 2, 32, 40
    P = {k_: t.float().to(DEVICE) for k_, t in _params(H, p, l=2).items()}
    padded = torch.randn(3, len(lens), H, n, p, device=DEVICE)
    keep = torch.arange(n)[None, :] < torch.tensor(lens)[:, None]            # (B, n)
    packed = [padded[i].transpose(1, 2)[keep.to(DEVICE)] for i in range(3)]  # (total, H, p)
    go = torch.randn(sum(lens), H, p, device=DEVICE)
    gu = torch.randn(sum(lens), H, P["W1"].shape[2], device=DEVICE)

    def grads(fn, leaves):
        leaves = [t.detach().requires_grad_() for t in leaves]
        out, u = fn(*leaves)
        return (out, u, *torch.autograd.grad([out, u], leaves, [go, gu]))

    def batched(q, k, v):
        out, u = inducer_attention(q, k, v, **P, causal=causal, backend="triton",
                                   seq_lens=torch.tensor(lens, device=DEVICE))
        sel = keep.to(DEVICE)
        return out.transpose(1, 2)[sel], u.transpose(1, 2)[sel]

    def varlen(q, k, v):
        return inducer_attention_varlen(q, k, v, _cu(lens).to(DEVICE), **P, causal=causal,
                                        backend="triton")

    a = grads(varlen, packed)
    b = list(grads(batched, padded))
    b[2:] = [g.transpose(1, 2)[keep.to(DEVICE)] for g in b[2:]]
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def _op_args(dtype=torch.float32, save_lo=False):
    lens, H, H_kv, p, L, r = [5, 19, 0, 2], 2, 1, 32, 3, 5

    def leaf(*s, scale=1.0):
        return (torch.randn(*s, device=DEVICE) * scale).to(dtype).requires_grad_(True)

    T = sum(lens)
    q, k, v = leaf(T, H, p), leaf(T, H_kv, p), leaf(T, H_kv, p)
    mlp = [leaf(*s, scale=0.5) for s in ((H, p, L), (H, L), (H, L, p), (H, p), (H, p, r),
                                         (H, r))]
    cu = _cu(lens).to(DEVICE)
    return (q, k, v, *mlp, leaf(H, 2, p), leaf(H, 2, p), None, True, 0.2, False, save_lo,
            cu, cu, max(lens), max(lens))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_varlen_opcheck(dtype):
    args = _op_args(dtype, save_lo=True)
    torch.library.opcheck(_triton_fwd, args)
    with torch.no_grad():
        out, u, lse, lam, stats, out_lo = _triton_fwd(*args)
    assert u.shape == (2, args[0].shape[0], 5) and lam.shape == (2, 2, args[0].shape[0])
    q, k, v = (t.detach() for t in args[:3])
    det = [t.detach() for t in args[3:11]]
    bargs = (torch.randn_like(out), torch.randn_like(u), torch.randn_like(lam), None, q, k, v,
             out, lse, stats, lam, *det, None, True, 0.2, out_lo, *args[16:])
    torch.library.opcheck(_triton_bwd, bargs)


def test_varlen_reference_is_per_sequence():
    """The reference is the batched reference applied to each sequence on its own."""
    lens, H, p = [3, 6], 2, 16
    X = _packed(lens, lens, H, p=p, H_kv=H)
    P = _params(H, p, l=1)
    out, u = inducer_attention_varlen_ref(X["q"], X["k"], X["v"], _cu(lens), None, **P,
                                          causal=True)
    from kfused.reference.inducer import inducer_attention_ref
    o1, u1 = inducer_attention_ref(*(X[n][3:].transpose(0, 1)[None] for n in "qkv"), **P,
                                   causal=True)
    torch.testing.assert_close(out[3:], o1[0].transpose(0, 1))
    torch.testing.assert_close(u[3:], u1[0].transpose(0, 1))


def test_varlen_bad_inputs():
    H, p = 2, 32
    X = {k_: t.float() for k_, t in _packed([3, 5], [3, 5], H, H, p).items()}
    cu = _cu([3, 5])
    with pytest.raises(ValueError, match="must have 3 dimensions"):
        inducer_attention_varlen(X["q"][None], X["k"], X["v"], cu)
    with pytest.raises(TypeError, match="cu_seqlens_q must be an int32 or int64"):
        inducer_attention_varlen(**X, cu_seqlens_q=cu.float())
    with pytest.raises(TypeError, match="cu_seqlens_q must be a torch.Tensor"):
        inducer_attention_varlen(**X, cu_seqlens_q=[0, 3, 8])
    with pytest.raises(ValueError, match="cu_seqlens_q must be 1-D"):
        inducer_attention_varlen(**X, cu_seqlens_q=cu[None])
    with pytest.raises(ValueError, match="end at total_q = 8"):
        inducer_attention_varlen(**X, cu_seqlens_q=_cu([3, 4]))
    with pytest.raises(ValueError, match="never decrease"):
        inducer_attention_varlen(**X, cu_seqlens_q=torch.tensor([0, 5, 3, 8]))
    with pytest.raises(ValueError, match="start at 0"):
        inducer_attention_varlen(**X, cu_seqlens_q=torch.tensor([1, 3, 8]))
    with pytest.raises(ValueError, match="max_seqlen_q = 4 is shorter"):
        inducer_attention_varlen(**X, cu_seqlens_q=cu, max_seqlen_q=4)
    with pytest.raises(TypeError, match="max_seqlen_k must be an int"):
        inducer_attention_varlen(**X, cu_seqlens_q=cu, max_seqlen_k=5.0)
    with pytest.raises(ValueError, match="describes 2 sequences but cu_seqlens_k 1"):
        inducer_attention_varlen(**X, cu_seqlens_q=cu, cu_seqlens_k=_cu([8]))
    with pytest.raises(ValueError, match="pass cu_seqlens_k"):
        inducer_attention_varlen(X["q"], X["k"][:6], X["v"][:6], cu)
    with pytest.raises(ValueError, match="k has 8 tokens but v has 6"):
        inducer_attention_varlen(X["q"], X["k"], X["v"][:6], cu)
    with pytest.raises(ValueError, match="head counts"):
        inducer_attention_varlen(X["q"], torch.randn(8, 3, p), torch.randn(8, 3, p), cu)
    with pytest.raises(ValueError, match="head widths"):
        inducer_attention_varlen(X["q"], X["k"][..., :16], X["v"][..., :16], cu)
    P = {k_: t.float() for k_, t in _params(H, p).items()}
    with pytest.raises(ValueError, match="Bk has shape"):
        inducer_attention_varlen(**X, cu_seqlens_q=cu, **{**P, "Bk": P["Bk"][:, :, :5]})
    q = torch.randn(4, 1, 48, device=DEVICE)      # (Triton's own device: the width is refused)
    with pytest.raises(BackendError, match="head width 48"):
        inducer_attention_varlen(q, q, q, _cu([4]).to(DEVICE), backend="triton")
    with pytest.raises(BackendError, match="no cuda implementation"):
        inducer_attention_varlen(q, q, q, _cu([4]).to(DEVICE), backend="cuda")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_varlen_scale_and_causal_checked(backend):
    """scale: None or a finite positive real number; causal: a bool (a string read as True)."""
    X = {k_: t.float() for k_, t in _packed([3, 5], [3, 5], 2, 2, 32).items()}
    cu = _cu([3, 5])
    for bad in ("0.1", torch.tensor(0.1), True, [0.1]):
        with pytest.raises(TypeError, match="scale must be None or a real number"):
            inducer_attention_varlen(**X, cu_seqlens_q=cu, scale=bad, backend=backend)
    for bad in (float("nan"), float("inf"), -0.1, 0.0, 0):
        with pytest.raises(ValueError, match="scale must be a finite positive number"):
            inducer_attention_varlen(**X, cu_seqlens_q=cu, scale=bad, backend=backend)
    for bad in ("no", 1, None, torch.tensor(True)):
        with pytest.raises(TypeError, match="causal must be a bool"):
            inducer_attention_varlen(**X, cu_seqlens_q=cu, causal=bad, backend=backend)


def test_lengths_are_read_once_per_tensor():
    """Every layer of a packed forward passes the same cumulative lengths: one host copy,
    and a changed tensor (in place or a new one) is read again."""
    from kfused.ops.inducer_attention import host_values

    cu = _cu([3, 5])
    first = host_values(cu)
    assert first == [0, 3, 8] and host_values(cu) is first
    cu[1] = 2
    assert host_values(cu) == [0, 2, 8]
    assert host_values(_cu([1, 7])) == [0, 1, 8]


# ------------------------------------------------------------------------------------------
# the host-value cache and lengths that change behind its back


def test_memo_bypasses_inference_tensors_and_is_never_half_updated():
    """Inference tensors have no version counter: they are never remembered (computed on
    every call) and leave the memo as it was; a compute that raises leaves it too."""
    from kfused._memo import LastResult

    memo, calls = LastResult(), []

    def compute(value):
        def fn():
            calls.append(value)
            return value
        return fn

    a = torch.tensor([0, 3])
    assert memo((a,), compute("a")) == "a" and memo((a,), compute("again")) == "a"
    with torch.inference_mode():
        b = torch.tensor([0, 4])
    assert memo((b,), compute("b1")) == "b1" and memo((b,), compute("b2")) == "b2"
    assert memo((a,), compute("again")) == "a"              # the entry for a survived
    with pytest.raises(RuntimeError, match="boom"):
        memo((b, None), lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    assert memo((a,), compute("again")) == "a" and calls == ["a", "b1", "b2"]
    a.data = torch.tensor([0, 1, 3])                         # .data swap: same version
    assert memo((a,), compute("swapped")) == "swapped"


def test_memo_sees_data_swaps_that_land_on_the_remembered_address():
    """Two ``.data`` swaps between calls: the allocator may hand the second new storage the
    freed remembered block (same object, version, pointer, shape). The memo holds the
    remembered storage, so that cannot happen; before, the stale lengths came back within a
    few tries and the op sized its grid from them (rows of a longer sequence not computed)."""
    from kfused._memo import LastResult

    memo = LastResult()
    n = 1024
    for attempt in range(100):
        cu = torch.arange(n, dtype=torch.int64)
        assert memo((cu,), lambda: ("old", attempt)) == ("old", attempt)
        p0 = cu.data_ptr()
        cu.data = torch.zeros(n, dtype=torch.int64)           # frees the first storage...
        cu.data = torch.ones(n, dtype=torch.int64)            # ...which this one may take
        assert cu.data_ptr() != p0, "a new storage on the remembered address"
        assert memo((cu,), lambda: ("new", attempt)) == ("new", attempt)


def test_memo_sees_a_view_with_other_strides():
    """Same storage, pointer and shape, other strides (a ``.data`` swap to a strided view):
    other values, so not the remembered result."""
    from kfused._memo import LastResult

    memo = LastResult()
    base = torch.arange(8)
    t = base[:4].clone()
    t.data = base[:4]
    assert memo((t,), lambda: t.tolist()) == [0, 1, 2, 3]
    t.data = base.as_strided((4,), (2,))                       # same pointer and shape
    assert memo((t,), lambda: t.tolist()) == [0, 2, 4, 6]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_inference_mode_lengths_leave_later_calls_working(backend):
    """A packed call under torch.inference_mode (the lengths an inference tensor) works, and
    so does every later ordinary call in the process (the cache was left half-updated)."""
    q = torch.randn(12, 2, 32, device=DEVICE)

    def lengths(*vals):
        return torch.tensor(vals, dtype=torch.int32, device=DEVICE)

    with torch.inference_mode():
        cu = lengths(0, 5, 12)
        out, _ = inducer_attention_varlen(q, q, q, cu, backend=backend)
    ref, _ = inducer_attention_varlen(q, q, q, lengths(0, 5, 12), backend=backend)
    torch.testing.assert_close(out, ref)
    with torch.inference_mode():                               # a new split: read again
        cu.copy_(lengths(0, 7, 12))
        again, _ = inducer_attention_varlen(q, q, q, cu, backend=backend)
    fresh, _ = inducer_attention_varlen(q, q, q, lengths(0, 7, 12), backend=backend)
    torch.testing.assert_close(again, fresh)


_PAD = 4096                   # sentinel elements on each side of every guarded buffer


class _Guarded:
    """Tensors that are views into larger buffers with sentinels on both sides: outputs
    (``empty``, standing in for kfused._alloc.empty: zeros inside, -777 around) and inputs
    (``like``: the values inside, NaN around, so a read outside shows up as NaN)."""

    def __init__(self):
        self.bufs = []

    def _make(self, shape, dtype, inside, sentinel):
        n = math.prod(shape)
        buf = torch.full((n + 2 * _PAD,), sentinel, dtype=dtype, device=DEVICE)
        buf[_PAD:_PAD + n] = inside.reshape(-1) if isinstance(inside, torch.Tensor) else inside
        self.bufs.append((buf, n, sentinel))
        return buf[_PAD:_PAD + n].view(shape)

    def empty(self, *shape, dtype, device):
        return self._make(shape, dtype, 0.0, -777.0)

    def like(self, t):
        return self._make(tuple(t.shape), t.dtype, t.detach().to(DEVICE), float("nan"))

    def intact(self) -> bool:
        def same(x, s):
            return bool(x.isnan().all()) if math.isnan(s) else bool((x == s).all())
        return all(same(b[:_PAD], s) and same(b[_PAD + n:], s) for b, n, s in self.bufs)


@pytest.mark.parametrize("values,causal", [
    ([0, 15, 12], True),       # a span past the end (and decreasing)
    ([0, -5, 12], False),      # a negative start
    ([0, 5, 40], True),        # the last span far past the end
], ids=["past-end-causal", "negative-start", "far-past-end-causal"])
def test_lengths_changed_behind_the_cache_stay_in_bounds(monkeypatch, values, causal):
    """cu_seqlens written through ``.data`` after a first call (no version bump): the cache
    still holds the old, valid values (checks, grid), the kernels read the new ones. Forward
    and backward must not read or write outside q, k, v and their outputs (views into
    buffers with sentinels around them); the result is undefined (documented), not an
    out-of-bounds access."""
    import kfused._alloc

    H, p = 2, 32
    g = _Guarded()
    monkeypatch.setattr(kfused._alloc, "empty", g.empty)
    X = {n: g.like(t.float()).requires_grad_() for n, t in _packed([5, 7], [5, 7], H, H,
                                                                   p).items()}
    P = {n: t.float().to(DEVICE).requires_grad_() for n, t in _params(H, p, l=2).items()}
    cu = _cu([5, 7]).to(DEVICE)

    def run():
        out, u = inducer_attention_varlen(**X, cu_seqlens_q=cu, **P, causal=causal,
                                          backend="triton")
        leaves = [*X.values(), *P.values()]
        grads = torch.autograd.grad([out, u], leaves, [torch.ones_like(out),
                                                       torch.ones_like(u)])
        return [out, u, *grads]

    first = run()                                    # checked, lengths cached
    assert all(bool(t.isfinite().all()) for t in first) and g.intact()
    version = cu._version
    cu.data.copy_(torch.tensor(values, dtype=torch.int32, device=DEVICE))
    assert cu._version == version                    # invisible to the cache
    second = run()
    assert g.intact(), "a kernel wrote outside its tensors"
    assert all(bool(t.isfinite().all()) for t in second), "a kernel read outside its tensors"


@pytest.mark.parametrize("cu_q,cu_k,max_q,max_k", [
    ([0, 5, 12], [0, 2, 30], 5, 28),       # keys' span past the end, a long max
    ([0, 9, 3], [-7, 4, 12], 2, 2),        # decreasing queries, negative key start, short max
], ids=["keys-past-end", "decreasing-negative"])
def test_kernels_stay_in_bounds_whatever_the_lengths(monkeypatch, cu_q, cu_k, max_q, max_k):
    """The host functions with any cumulative lengths and longest lengths (queries and keys
    packed differently): no access outside q, k, v and the outputs, forward and backward."""
    import kfused._alloc
    from kfused.triton_kernels.inducer_attention import (inducer_attention_backward,
                                                         inducer_attention_forward)

    H, H_kv, p = 2, 1, 32
    g = _Guarded()
    monkeypatch.setattr(kfused._alloc, "empty", g.empty)
    X = {n: g.like(t.float()) for n, t in _packed([12], [12], H, H_kv, p).items()}
    P = _params(H, p, l=2)
    mlp = tuple(g.like(P[n].float()) for n in ("Ak", "ak", "Bk", "ck", "W1", "b1"))
    pk, pv = g.like(P["prefix_k"].float()), g.like(P["prefix_v"].float())
    varlen = (torch.tensor(cu_q, dtype=torch.int32, device=DEVICE),
              torch.tensor(cu_k, dtype=torch.int32, device=DEVICE), max_q, max_k)
    out, u, lse, lam, stats, _ = inducer_attention_forward(
        X["q"], X["k"], X["v"], mlp, pk, pv, None, True, varlen=varlen)
    grads = inducer_attention_backward(
        g.like(torch.randn_like(out)), g.like(torch.randn_like(u)), None, None, X["q"],
        X["k"], X["v"], out, lse, stats, lam, mlp, pk, pv, None, True, varlen=varlen)
    assert g.intact(), "a kernel wrote outside its tensors"
    for t in (out, u, lse, lam, stats, *grads[:3], *grads[3], *grads[4:]):
        assert bool(t.isfinite().all()), "a kernel read outside its tensors"
