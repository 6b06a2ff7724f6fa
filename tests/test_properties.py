"""Property-based tests (hypothesis) of every public op against the float64 reference under
docs/math.md §4: random shapes, strides (column slices of wider tensors, expands, transposes), dtypes
and masks; and bad-input properties (wrong ranks, shapes, dtypes, devices, types raise
ValueError/TypeError naming the argument). Issue 13.

Budget: a fixed number of examples per property, drawn from the test's seed (KFUSED_TEST_SEED,
printed on failure): the same seed replays the same examples. Shrinking is off (each example
runs Triton kernels in the CPU interpreter); a failure prints every drawn value.
"""

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from hypothesis import seed as hseed

from kfused import (HeadFactors, headwise_lowrank, headwise_oproj, headwise_projection,
                    headwise_qkv, inducer_attention, inducer_attention_varlen,
                    inducer_output_projection, kron_matvec, krona_linear)
from kfused.reference.inducer import inducer_output_projection_ref, key_allowed
from kfused.reference.krona import kron_matvec_ref, krona_linear_ref
from kfused.testing import assert_against_reference, min_extent

from conftest import DEVICE, DTYPES

F64 = torch.float64
FACTOR_KEYS = ("shared_A", "shared_B", "wise_A", "wise_B", "wise_c", "lite_A", "lite_B",
               "lite_c")


def run_property(seed, body, max_examples):
    """Run ``body(data)`` for ``max_examples`` hypothesis examples derived from ``seed``."""

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=False,
              phases=(Phase.explicit, Phase.generate), print_blob=False,
              suppress_health_check=list(HealthCheck))
    @hseed(seed)
    @given(st.data())
    def prop(data):
        body(data)

    prop()


@contextlib.contextmanager
def rank_space(data):
    """The headwise backward on a drawn rank-space layout (per tile occurrence, or compact;
    see kfused.triton_kernels._headwise_common.compact_pays), whatever the shapes."""
    from kfused.triton_kernels import _headwise_common as hc

    old = hc.FORCE_COMPACT
    hc.FORCE_COMPACT = data.draw(st.booleans(), label="compact rank space")
    try:
        yield
    finally:
        hc.FORCE_COMPACT = old


def draw_dtype(data):
    return data.draw(st.sampled_from(DTYPES), label="dtype")


def rnd(g, *shape):
    return torch.randn(*shape, generator=g, dtype=F64)


def gen(data):
    return torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="data seed"))


LAYOUTS = ("contiguous", "slice", "expand", "transpose")


def strided(data, g, name, shape, layouts=LAYOUTS):
    """(storage, view) such that ``view(storage)`` has ``shape`` with the drawn layout:
    a column slice of a wider tensor, an expand of a size-1 first dim, or a transpose of the
    first and last dims. The gradient is taken with respect to the storage."""
    layout = data.draw(st.sampled_from(layouts), label=f"{name} layout")
    shape = tuple(shape)
    if layout == "slice":
        extra = data.draw(st.integers(1, 5), label=f"{name} extra columns")
        off = data.draw(st.integers(0, extra), label=f"{name} column offset")
        return rnd(g, *shape[:-1], shape[-1] + extra), lambda s: s[..., off:off + shape[-1]]
    if layout == "expand" and len(shape) >= 2:
        return rnd(g, 1, *shape[1:]), lambda s: s.expand(*shape)
    if layout == "transpose" and len(shape) >= 2:
        return (rnd(g, shape[-1], *shape[1:-1], shape[0]),
                lambda s: s.transpose(0, len(shape) - 1))
    return rnd(g, *shape), lambda s: s


def layouts_for(dtype, layouts=LAYOUTS):
    """The drawn input layouts: a 16-bit case takes no stride-0 layout, whose repeated rows
    leave a gradient of few independent elements (docs/math.md §4)."""
    if dtype == torch.float32:
        return layouts
    return tuple(lay for lay in layouts if lay != "expand")


def extent(data, label, lo, width):
    """An integer in ``[lo, lo + width]`` (``lo`` from :func:`kfused.testing.min_extent`)."""
    return data.draw(st.integers(lo, lo + width), label=label)


def draw_scale(data, label="scale"):
    """An adapter scale: either sign, magnitude 1/8 to 2 (not subnormal: docs/math.md §4 compares
    finite normal values; float32 flushes 1e-46 to zero like the GPU does)."""
    mag = data.draw(st.floats(0.125, 2.0), label=label)
    return mag if data.draw(st.booleans(), label=f"{label} positive") else -mag


def check(kernel, ref, inputs, dtype, grad_names=None):
    assert_against_reference(kernel, ref, inputs, dtype, DEVICE, grad_names=grad_names)


# ------------------------------------------------------------------------------------------
# KronA


def test_kron_matvec_expanded_x_grad():
    g = torch.Generator().manual_seed(1)
    x0 = rnd(g, 1, 20)
    A, B = rnd(g, 4, 4), rnd(g, 3, 5)
    check(lambda x0, A, B: kron_matvec(x0.expand(6, 20), A, B, backend="triton"),
          lambda x0, A, B: kron_matvec_ref(x0.expand(6, 20), A, B),
          {"x0": x0, "A": A, "B": B}, torch.float32)


def _kron_dims(data, dtype):
    """Factor shapes; a 16-bit case has >= 16 elements in A, B and d_out (docs/math.md §4)."""
    a_out = data.draw(st.integers(1, 5), label="a_out")
    a_in = extent(data, "a_in", min_extent(dtype, a_out), 4)
    b_out = extent(data, "b_out", min_extent(dtype, a_out), 4)
    b_in = extent(data, "b_in", min_extent(dtype, b_out), 4)
    lead = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=2), label="lead")
    return a_out, a_in, b_out, b_in, lead


def test_kron_matvec_property(seed):
    def body(data):
        dtype = draw_dtype(data)
        a_out, a_in, b_out, b_in, lead = _kron_dims(data, dtype)
        g = gen(data)
        xs, xv = strided(data, g, "x", (*lead, a_in * b_in), layouts_for(dtype))
        As, Av = strided(data, g, "A", (a_out, a_in), ("contiguous", "transpose"))
        Bs, Bv = strided(data, g, "B", (b_out, b_in), ("contiguous", "transpose", "slice"))
        check(lambda x, A, B: kron_matvec(xv(x), Av(A), Bv(B), backend="triton"),
              lambda x, A, B: kron_matvec_ref(xv(x), Av(A), Bv(B)),
              {"x": xs, "A": As, "B": Bs}, dtype)

    run_property(seed, body, 10)


def test_krona_linear_property(seed):
    def body(data):
        dtype = draw_dtype(data)
        a_out, a_in, b_out, b_in, lead = _kron_dims(data, dtype)
        d_in, d_out = a_in * b_in, a_out * b_out
        g = gen(data)
        xs, xv = strided(data, g, "x", (*lead, d_in), layouts_for(dtype))
        Ws, Wv = strided(data, g, "weight", (d_out, d_in), ("contiguous", "transpose", "slice"))
        inputs = {"x": xs, "weight": Ws, "A": rnd(g, a_out, a_in), "B": rnd(g, b_out, b_in)}
        if data.draw(st.booleans(), label="bias"):
            inputs["bias"] = rnd(g, d_out)
        scale = draw_scale(data)

        def kern(x, weight, A, B, bias=None):
            return krona_linear(xv(x), Wv(weight), bias, A, B, scale, backend="triton")

        def ref(x, weight, A, B, bias=None):
            return krona_linear_ref(xv(x), Wv(weight), bias, A, B, scale)

        check(kern, ref, inputs, dtype)

    run_property(seed, body, 10)


# ------------------------------------------------------------------------------------------
# headwise


def test_headwise_lowrank_property(seed):
    def body(data):
        dtype = draw_dtype(data)
        H, r = (data.draw(st.integers(1, 4), label=k) for k in ("H", "r"))
        p = extent(data, "p", min_extent(dtype, H), 5)
        db = extent(data, "d_b", min_extent(dtype), 11)
        per_head = data.draw(st.booleans(), label="per_head")
        lead = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=2), label="lead")
        g = gen(data)
        shape = (*lead, H, db) if per_head else (*lead, db)
        bs, bv = strided(data, g, "basis", shape, layouts_for(dtype))
        inputs = {"basis": bs, "A": rnd(g, H, r, db), "B": rnd(g, H, p, r)}
        if data.draw(st.booleans(), label="bias"):
            inputs["bias"] = rnd(g, H, p)

        def run(backend):
            def fn(basis, A, B, bias=None):
                return headwise_lowrank(bv(basis), A, B, bias, per_head=per_head,
                                        backend=backend)
            return fn

        check(run("triton"), run("reference"), inputs, dtype)

    run_property(seed, body, 10)


def _lite_comparable(dtype, lead, d) -> bool:
    """Whether a 16-bit run may draw Kernel-wise-lite parts. Lite is computed as
    X (W_k A_hᵀ) + b_k A_hᵀ where torch computes K A_hᵀ with K rounded (docs/math.md §2): the
    two 16-bit errors have the same distribution but are different numbers, so on a dx of a
    handful of elements (T·d < 40) "max err <= 2 x torch's + eps" is a lottery that torch
    sometimes wins (KFUSED_TEST_SEED=11 sweep, stop 23: dx of 1 element, T = d = 1, 8.5
    ulps against torch's lucky 2.5; the same example fails with the pre-stop-23 torch-built
    basis). test_qkv_kernel keeps its lite shapes at >= ~40 elements for the same reason;
    float32 and the non-lite parts keep the tiny shapes."""
    tokens = 1
    for n in lead:
        tokens *= n
    return dtype == torch.float32 or tokens * d >= 40


def draw_factors(data, g, name, H, p, d, *, lite=True):
    """A random subset of the shared / Kernel-wise / Kernel-wise-lite parts (maybe none)."""
    kw = {}
    if data.draw(st.booleans(), label=f"{name} shared"):
        rs = data.draw(st.integers(1, 3), label=f"{name} r_s")
        kw.update(shared_A=rnd(g, rs, d), shared_B=rnd(g, H * p, rs))
    if data.draw(st.booleans(), label=f"{name} wise"):
        r = data.draw(st.integers(1, 3), label=f"{name} r")
        kw.update(wise_A=rnd(g, H, r, d), wise_B=rnd(g, H, p, r))
        if data.draw(st.booleans(), label=f"{name} wise_c"):
            kw["wise_c"] = rnd(g, H, p)
    if lite and data.draw(st.booleans(), label=f"{name} lite"):
        r = data.draw(st.integers(1, 3), label=f"{name} lite r")
        kw.update(lite_A=rnd(g, H, r, p), lite_B=rnd(g, H, p, r))
        if data.draw(st.booleans(), label=f"{name} lite_c"):
            kw["lite_c"] = rnd(g, H, p)
    scale = draw_scale(data, f"{name} scale")
    return {f"{name}_{k}": v for k, v in kw.items()}, scale


def gather(name, kw, scale):
    parts = {k[len(name) + 1:]: v for k, v in kw.items() if k.startswith(name + "_")
             and k[len(name) + 1:] in FACTOR_KEYS}
    return HeadFactors(scale=scale, **parts) if parts else None


def test_headwise_qkv_property(seed):
    def body(data):
        dtype = draw_dtype(data)
        Hkv = data.draw(st.integers(1, 3), label="H_kv")
        H = Hkv * data.draw(st.integers(1, 2), label="group")
        p = extent(data, "p", min_extent(dtype, Hkv), 4)
        d = extent(data, "d", min_extent(dtype), 11)
        lead = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=2), label="lead")
        g = gen(data)
        xs, xv = strided(data, g, "x", (*lead, d), layouts_for(dtype))
        views = {"x": xv}
        inputs = {"x": xs}
        for w, rows in (("w_q", H * p), ("w_k", Hkv * p), ("w_v", Hkv * p)):
            inputs[w], views[w] = strided(data, g, w, (rows, d), ("contiguous", "transpose",
                                                                   "slice"))
            if data.draw(st.booleans(), label=f"b_{w[-1]}"):
                inputs[f"b_{w[-1]}"] = rnd(g, rows)
        lite = _lite_comparable(dtype, lead, d)
        qf, qs = draw_factors(data, g, "q", H, p, d, lite=lite)
        vf, vs = draw_factors(data, g, "v", Hkv, p, d, lite=lite)
        inputs.update(qf)
        inputs.update(vf)
        fused = data.draw(st.booleans(), label="fused_output")
        frozen_grads = data.draw(st.booleans(), label="frozen weight grads")

        def run(backend):
            def fn(x, w_q, w_k, w_v, b_q=None, b_k=None, b_v=None, **kw):
                return headwise_qkv(views["x"](x), views["w_q"](w_q), views["w_k"](w_k),
                                    views["w_v"](w_v), b_q, b_k, b_v, n_heads=H, n_kv_heads=Hkv,
                                    q=gather("q", kw, qs), v=gather("v", kw, vs),
                                    backend=backend, fused_output=fused)
            return fn

        names = [k for k in inputs if frozen_grads or not k.startswith("w_")]
        with rank_space(data):
            check(run("triton"), run("reference"), inputs, dtype, grad_names=names)

    run_property(seed, body, 12)


def test_headwise_projection_property(seed):
    def body(data):
        dtype = draw_dtype(data)
        Hk = data.draw(st.integers(1, 3), label="H_k")
        H = Hk * data.draw(st.integers(1, 2), label="group")
        p = extent(data, "p", min_extent(dtype, Hk), 4)
        d = extent(data, "d", min_extent(dtype), 11)
        lead = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=2), label="lead")
        g = gen(data)
        xs, xv = strided(data, g, "x", (*lead, d), layouts_for(dtype))
        Ws, Wv = strided(data, g, "weight", (H * p, d), ("contiguous", "transpose", "slice"))
        inputs = {"x": xs, "weight": Ws}
        if data.draw(st.booleans(), label="bias"):
            inputs["bias"] = rnd(g, H * p)
        ff, fs = draw_factors(data, g, "f", H, p, d, lite=_lite_comparable(dtype, lead, d))
        inputs.update(ff)
        factors = gather("f", ff, fs)
        if factors is not None and factors.has_lite:
            inputs["w_k"] = rnd(g, Hk * p, d)
            if data.draw(st.booleans(), label="b_k"):
                inputs["b_k"] = rnd(g, Hk * p)

        def run(backend):
            def fn(x, weight, bias=None, w_k=None, b_k=None, **kw):
                return headwise_projection(xv(x), Wv(weight), bias, n_heads=H,
                                           factors=gather("f", kw, fs), w_k=w_k, b_k=b_k,
                                           n_key_heads=Hk if w_k is not None else None,
                                           backend=backend)
            return fn

        with rank_space(data):
            check(run("triton"), run("reference"), inputs, dtype)

    run_property(seed, body, 10)


def _oproj_inputs(data, g, H, p, dout, *, wise, shared):
    inputs = {}
    if wise:
        r = data.draw(st.integers(1, 3), label="r")
        inputs.update(wise_A=rnd(g, H, r, p), wise_B=rnd(g, dout, H * r))
        if data.draw(st.booleans(), label="wise_c"):
            inputs["wise_c"] = rnd(g, dout)
    if shared:
        rs = data.draw(st.integers(1, 3), label="r_s")
        inputs.update(shared_A=rnd(g, rs, H * p), shared_B=rnd(g, dout, rs))
    return inputs


def _oproj_example(data, exact=None):
    """One drawn headwise_oproj example checked against the reference (docs/math.md §4)."""
    dtype = draw_dtype(data)
    H = data.draw(st.integers(1, 4), label="H")
    p = extent(data, "p", min_extent(dtype, H), 5)
    dout = extent(data, "d_out", min_extent(dtype), 11)
    wise, shared = (data.draw(st.booleans(), label=k) for k in ("wise", "shared"))
    lead = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=2), label="lead")
    g = gen(data)
    os_, ov = strided(data, g, "o", (*lead, H * p), layouts_for(dtype))
    Ws, Wv = strided(data, g, "w_o", (dout, H * p), ("contiguous", "transpose", "slice"))
    inputs = {"o": os_, "w_o": Ws, **_oproj_inputs(data, g, H, p, dout, wise=wise,
                                                    shared=shared)}
    if data.draw(st.booleans(), label="b_o"):
        inputs["b_o"] = rnd(g, dout)
    scale = draw_scale(data)

    def run(backend):
        def fn(o, w_o, b_o=None, **kw):
            return headwise_oproj(ov(o), Wv(w_o), b_o, n_heads=H, scale=scale,
                                  backend=backend, **({"exact": exact} if backend == "triton"
                                                      else {}), **kw)
        return fn

    check(run("triton"), run("reference"), inputs, dtype)


def test_headwise_oproj_property(seed):
    run_property(seed, _oproj_example, 10)


class _FixedDraws:
    """A stand-in for hypothesis's ``data``: every draw returns the value recorded for its
    label (a failing example replayed exactly, whatever the process state)."""

    def __init__(self, values):
        self.values = values

    def draw(self, strategy, label=None):
        return self.values[label]


@pytest.mark.parametrize("exact", [None, False], ids=["exact", "folded"])
def test_oproj_shared_scale_float16_one_token(exact):
    """The example a full CI run's hypothesis drew (2026-11-27, KFUSED_TEST_SEED=1262740466;
    the replay command did not regenerate it: hypothesis drew other examples in a fresh
    process), replayed draw by draw. It failed (dshared_A 2.65e-3 from float64 against a
    bound of 2.44e-3, also before stop 38) while the backward formed dZ of the shared rows as
    dY·round(s·B_s); the same-precision torch path rounds s·dY first, as the backward now
    does. Folded (exact=False): the dO GEMM over [W' | B_w | B_s] gives dZ's shared rows as
    dY·B_s rounded once, and the unpack scales their token sums by s in float32 — one
    rounding fewer than the torch path's."""
    _oproj_example(_FixedDraws({
        "dtype": torch.float16, "H": 3, "p": 6, "d_out": 22, "wise": True, "shared": True,
        "lead": [1], "data seed": 4160, "o layout": "transpose", "w_o layout": "contiguous",
        "r": 2, "wise_c": False, "r_s": 2, "b_o": True, "scale": 0.4765675275852965,
        "scale positive": False}), exact=exact)


def test_oproj_width_one_with_wise_and_shared():
    g = torch.Generator().manual_seed(3)
    H, p = 2, 3
    inputs = {"o": rnd(g, 4, H * p), "w_o": rnd(g, 1, H * p), "wise_A": rnd(g, H, 2, p),
              "wise_B": rnd(g, 1, H * 2), "shared_A": rnd(g, 2, H * p),
              "shared_B": rnd(g, 1, 2)}

    def run(backend):
        return lambda o, w_o, **kw: headwise_oproj(o, w_o, n_heads=H, backend=backend, **kw)

    check(run("triton"), run("reference"), inputs, torch.float32)


# ------------------------------------------------------------------------------------------
# inducer


def _inducer_params(data, g, H, p, composition, l, dtype):
    """Random inducer parameters for ``composition`` ("none", "add", "gate") and ``l``
    prefix columns (float64); a 16-bit case has >= 16 elements in ak and b1."""
    out = {}
    if composition != "none":
        L = extent(data, "L", min_extent(dtype, H), 3)
        r = extent(data, "r", min_extent(dtype, H), 3)
        out.update(Ak=rnd(g, H, p, L) * 0.5, ak=rnd(g, H, L) * 0.5, Bk=rnd(g, H, L, p) * 0.5,
                   ck=rnd(g, H, p) * 0.5, W1=rnd(g, H, p, r) * 0.5, b1=rnd(g, H, r) * 0.5)
        if composition == "gate":
            out.update(W2=rnd(g, H, r, p), b2=rnd(g, H, p))
    if l:
        out.update(prefix_k=rnd(g, H, l, p), prefix_v=rnd(g, H, l, p))
    return out


def test_inducer_attention_property(seed):
    def body(data):
        dtype = draw_dtype(data)
        B = data.draw(st.integers(1, 2), label="B")
        Hkv = data.draw(st.integers(1, 2), label="H_kv")
        H = Hkv * data.draw(st.integers(1, 2), label="group")
        n_q = data.draw(st.integers(1, 9), label="n_q")
        n_k = data.draw(st.sampled_from([n_q, 1, 5, 11]), label="n_k")
        p = data.draw(st.sampled_from([32, 32, 64]), label="p")
        composition = data.draw(st.sampled_from(["none", "add", "gate"]), label="composition")
        causal = data.draw(st.booleans(), label="causal")
        l = data.draw(st.sampled_from([0, 0, 1, 3]), label="prefix length")
        g = gen(data)
        qkv_layouts = layouts_for(dtype, ("contiguous", "slice", "expand", "heads-major"))

        def qkv(name, heads, n):
            layout = data.draw(st.sampled_from(qkv_layouts), label=f"{name} layout")
            if layout == "heads-major":  # (B, n, H, p) storage, the usual projection output
                return rnd(g, B, n, heads, p), lambda s: s.transpose(1, 2)
            if layout == "expand":
                return rnd(g, 1, heads, n, p), lambda s: s.expand(B, heads, n, p)
            if layout == "slice":
                return rnd(g, B, heads, n, p + 7), lambda s: s[..., 3:3 + p]
            return rnd(g, B, heads, n, p), lambda s: s

        inputs, views = {}, {}
        for name, heads, n in (("q", H, n_q), ("k", Hkv, n_k), ("v", Hkv, n_k)):
            inputs[name], views[name] = qkv(name, heads, n)
        inputs.update(_inducer_params(data, g, H, p, composition, l, dtype))
        mask = data.draw(st.sampled_from(["none", "mask", "lens", "both"]), label="mask")
        if mask in ("mask", "both"):
            m = torch.rand(B, n_k, generator=g) > data.draw(st.sampled_from([0.2, 0.5, 1.0]),
                                                            label="mask drop rate")
            inputs["key_padding_mask"] = m
        if mask in ("lens", "both"):
            inputs["seq_lens"] = torch.randint(0, n_k + 1, (B,), generator=g)
        comp = "add" if composition == "none" else composition
        # A row that sees one column only (the keys it may see, the prefix columns and, with a
        # composition, the virtual inducer column) has a softmax over one column: the gradient
        # through its scores (dq, that column's dk, the key MLP's) is exactly 0, so
        # docs/math.md §4's bound is exactly 0, and the kernels' D_i - dP_ij cancellation leaves
        # a rounding residue (1e-7 relative; a known limit, see README "Known limits"). Such
        # draws get two prefix columns, so every row sees at least two.
        vis = key_allowed(n_q, n_k, causal=causal, device="cpu",
                          key_padding_mask=inputs.get("key_padding_mask"),
                          seq_lens=inputs.get("seq_lens"))
        fewest = n_k if vis is None else int(vis.sum(-1).min())
        if fewest + l + (composition != "none") <= 1:
            inputs.update(prefix_k=rnd(g, H, 2, p), prefix_v=rnd(g, H, 2, p))

        def run(backend):
            def fn(q, k, v, **kw):
                out, u = inducer_attention(views["q"](q), views["k"](k), views["v"](v),
                                           composition=comp, causal=causal, backend=backend,
                                           **kw)
                return out if u is None else (out, u)
            return fn

        check(run("triton"), run("reference"), inputs, dtype)

    run_property(seed, body, 12)


def test_inducer_attention_varlen_property(seed):
    """Packed variable-length batches: random lengths (empty sequences included), cross
    lengths, GQA, compositions, prefix, causal, strided packed tensors."""
    def body(data):
        dtype = draw_dtype(data)
        n_seq = data.draw(st.integers(1, 4), label="sequences")
        lens_q = [data.draw(st.integers(0, 9), label=f"len_q{b}") for b in range(n_seq)]
        same = data.draw(st.booleans(), label="keys packed like queries")
        lens_k = lens_q if same else [data.draw(st.integers(0, 11), label=f"len_k{b}")
                                      for b in range(n_seq)]
        Hkv = data.draw(st.integers(1, 2), label="H_kv")
        H = Hkv * data.draw(st.integers(1, 2), label="group")
        p = data.draw(st.sampled_from([32, 64]), label="p")
        composition = data.draw(st.sampled_from(["none", "add", "gate"]), label="composition")
        causal = data.draw(st.booleans(), label="causal")
        l = data.draw(st.sampled_from([0, 0, 1, 3]), label="prefix length")
        g = gen(data)

        def packed(name, heads, n):
            layout = data.draw(st.sampled_from(("contiguous", "slice", "heads-major", "fused")),
                               label=f"{name} layout")
            if layout == "heads-major":              # (H, total, p) storage
                return rnd(g, heads, n, p), lambda s: s.transpose(0, 1)
            if layout == "fused":                    # one part of a fused projection output
                return rnd(g, n, 2, heads, p), lambda s: s[:, 1]
            if layout == "slice":
                return rnd(g, n, heads, p + 5), lambda s: s[..., 2:2 + p]
            return rnd(g, n, heads, p), lambda s: s

        def cu(lens):
            return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)

        inputs, views = {}, {}
        for name, heads, n in (("q", H, sum(lens_q)), ("k", Hkv, sum(lens_k)),
                               ("v", Hkv, sum(lens_k))):
            inputs[name], views[name] = packed(name, heads, n)
        inputs["cu_seqlens_q"] = cu(lens_q)
        if not same:
            inputs["cu_seqlens_k"] = cu(lens_k)
        inputs.update(_inducer_params(data, g, H, p, composition, l, dtype))
        # the single-visible-column guard of test_inducer_attention_property, per sequence
        fewest = min([nk if not causal else max(0, min(nk, nk - nq + 1))
                      for nq, nk in zip(lens_q, lens_k) if nq] or [2])
        if fewest + l + (composition != "none") <= 1:
            inputs.update(prefix_k=rnd(g, H, 2, p), prefix_v=rnd(g, H, 2, p))
        comp = "add" if composition == "none" else composition

        def run(backend):
            def fn(q, k, v, cu_seqlens_q, cu_seqlens_k=None, **kw):
                out, u = inducer_attention_varlen(
                    views["q"](q), views["k"](k), views["v"](v), cu_seqlens_q, cu_seqlens_k,
                    composition=comp, causal=causal, backend=backend, **kw)
                return out if u is None else (out, u)
            return fn

        check(run("triton"), run("reference"), inputs, dtype)

    run_property(seed, body, 10)


def test_inducer_output_projection_property(seed):
    def body(data):
        dtype = draw_dtype(data)
        B, H, n = (data.draw(st.integers(1, 3), label=k) for k in ("B", "H", "n"))
        p, r = (extent(data, k, min_extent(dtype, H), 5) for k in ("p", "r"))
        d = extent(data, "d", min_extent(dtype), 5)
        g = gen(data)
        fs, fv = strided(data, g, "f", (B, H, n, p), layouts_for(dtype))
        Ws, Wv = strided(data, g, "W_o", (d, H * p), ("contiguous", "transpose", "slice"))
        inputs = {"f": fs, "W_o": Ws}
        if data.draw(st.booleans(), label="b_o"):
            inputs["b_o"] = rnd(g, d)
        if data.draw(st.booleans(), label="u"):
            inputs["u"], uv = strided(data, g, "u", (B, H, n, r), layouts_for(dtype))
            inputs["W2"] = rnd(g, H, r, d)
            if data.draw(st.booleans(), label="b2"):
                inputs["b2"] = rnd(g, d)
        else:
            uv = None

        def run(op):
            def fn(f, W_o, b_o=None, u=None, W2=None, b2=None):
                return op(fv(f), uv(u) if u is not None else None, Wv(W_o), b_o, W2, b2)
            return fn

        check(run(inducer_output_projection), run(inducer_output_projection_ref), inputs, dtype)

    run_property(seed, body, 8)


# ------------------------------------------------------------------------------------------
# bad inputs: every tensor argument, corrupted one way at a time, gives a ValueError or a
# TypeError whose message names it


def _valid_kron(g):
    return dict(x=rnd(g, 5, 6), A=rnd(g, 3, 2), B=rnd(g, 4, 3))


def _valid_krona(g):
    return dict(x=rnd(g, 5, 6), weight=rnd(g, 12, 6), bias=rnd(g, 12), A=rnd(g, 3, 2),
                B=rnd(g, 4, 3), scale=0.5)


def _valid_lowrank(g):
    return dict(basis=rnd(g, 5, 7), A=rnd(g, 2, 3, 7), B=rnd(g, 2, 4, 3), bias=rnd(g, 2, 4))


def _hf(g, H, p, d, prefix):
    return {f"{prefix}.shared_A": rnd(g, 2, d), f"{prefix}.shared_B": rnd(g, H * p, 2),
            f"{prefix}.wise_A": rnd(g, H, 3, d), f"{prefix}.wise_B": rnd(g, H, p, 3),
            f"{prefix}.wise_c": rnd(g, H, p), f"{prefix}.lite_A": rnd(g, H, 2, p),
            f"{prefix}.lite_B": rnd(g, H, p, 2)}


def _valid_qkv(g):  # H = 2, H_kv = 1, p = 3, d = 8
    return dict(x=rnd(g, 5, 8), w_q=rnd(g, 6, 8), w_k=rnd(g, 3, 8), w_v=rnd(g, 3, 8),
                b_q=rnd(g, 6), b_k=rnd(g, 3), b_v=rnd(g, 3), **_hf(g, 2, 3, 8, "q"),
                **_hf(g, 1, 3, 8, "v"))


def _valid_projection(g):  # H = 2, H_k = 1, p = 3, d = 8
    return dict(x=rnd(g, 5, 8), weight=rnd(g, 6, 8), bias=rnd(g, 6), w_k=rnd(g, 3, 8),
                b_k=rnd(g, 3), **_hf(g, 2, 3, 8, "factors"))


def _valid_oproj(g):  # H = 2, p = 3, d_out = 5
    return dict(o=rnd(g, 4, 6), w_o=rnd(g, 5, 6), b_o=rnd(g, 5), wise_A=rnd(g, 2, 2, 3),
                wise_B=rnd(g, 5, 4), wise_c=rnd(g, 5), shared_A=rnd(g, 2, 6),
                shared_B=rnd(g, 5, 2), scale=0.5)


def _valid_inducer(g):  # B = 2, H = 2, n = 5, p = 32
    return dict(q=rnd(g, 2, 2, 5, 32), k=rnd(g, 2, 2, 5, 32), v=rnd(g, 2, 2, 5, 32),
                Ak=rnd(g, 2, 32, 3), ak=rnd(g, 2, 3), Bk=rnd(g, 2, 3, 32), ck=rnd(g, 2, 32),
                W1=rnd(g, 2, 32, 4), b1=rnd(g, 2, 4), prefix_k=rnd(g, 2, 2, 32),
                prefix_v=rnd(g, 2, 2, 32), key_padding_mask=torch.ones(2, 5, dtype=torch.bool),
                seq_lens=torch.tensor([5, 3]))


def _valid_outproj(g):  # B = 2, H = 2, n = 5, p = 3, r = 4, d = 6
    return dict(f=rnd(g, 2, 2, 5, 3), u=rnd(g, 2, 2, 5, 4), W_o=rnd(g, 6, 6), b_o=rnd(g, 6),
                W2=rnd(g, 2, 4, 6), b2=rnd(g, 6))


def _split_factors(kw, names=("q", "v", "factors")):
    out, fac = {}, {n: {} for n in names}
    for k, v in kw.items():
        head, _, attr = k.partition(".")
        if attr:
            fac[head][attr] = v
        else:
            out[k] = v
    for n, parts in fac.items():
        if parts:
            out[n] = HeadFactors(scale=0.5, **parts)
    return out


def _call_qkv(kw):
    return headwise_qkv(**_split_factors(kw), n_heads=2, n_kv_heads=1, backend="triton")


def _call_projection(kw):
    return headwise_projection(**_split_factors(kw), n_heads=2, backend="triton")


OPS = {
    # op: (valid inputs, call, {argument: dims whose size is fixed by the other arguments});
    # a dim that defines a size (w_q's rows define p) is left out: changing it is reported on
    # the argument that then disagrees
    "kron_matvec": (_valid_kron, lambda kw: kron_matvec(**kw, backend="triton"),
                    {"x": [-1], "A": [1], "B": [1]}),
    "krona_linear": (_valid_krona, lambda kw: krona_linear(**kw, backend="triton"),
                     {"x": [-1], "weight": [0, 1], "bias": [0], "A": [1], "B": [1]}),
    "headwise_lowrank": (_valid_lowrank, lambda kw: headwise_lowrank(**kw, backend="triton"),
                         {"basis": [-1], "A": [2], "B": [0, 2], "bias": [0, 1]}),
    "headwise_qkv": (_valid_qkv, _call_qkv,
                     {"x": [-1], "w_q": [1], "w_k": [0, 1], "w_v": [0, 1], "b_q": [0],
                      "b_k": [0], "b_v": [0], "q.shared_A": [1], "q.shared_B": [0, 1],
                      "q.wise_A": [0, 2], "q.wise_B": [0, 1, 2], "q.wise_c": [0, 1],
                      "q.lite_A": [0, 2], "q.lite_B": [0, 1, 2], "v.shared_A": [1],
                      "v.shared_B": [0, 1], "v.wise_A": [0, 2], "v.wise_B": [0, 1, 2],
                      "v.wise_c": [0, 1], "v.lite_A": [0, 2], "v.lite_B": [0, 1, 2]}),
    "headwise_projection": (_valid_projection, _call_projection,
                            {"x": [-1], "weight": [1], "bias": [0], "w_k": [1],
                             "b_k": [0], "factors.shared_A": [1], "factors.shared_B": [0, 1],
                             "factors.wise_A": [0, 2], "factors.wise_B": [0, 1, 2],
                             "factors.wise_c": [0, 1], "factors.lite_A": [0, 2],
                             "factors.lite_B": [0, 1, 2]}),
    "headwise_oproj": (_valid_oproj, lambda kw: headwise_oproj(**kw, n_heads=2,
                                                               backend="triton"),
                       {"o": [], "w_o": [1], "b_o": [0], "wise_A": [0, 2], "wise_B": [0, 1],
                        "wise_c": [0], "shared_A": [1], "shared_B": [0, 1]}),
    "inducer_attention": (_valid_inducer, lambda kw: inducer_attention(**kw, backend="triton"),
                          {"q": [0, 3], "k": [0, 1, 3], "v": [0, 1, 2, 3], "Ak": [0, 1],
                           "ak": [0, 1], "Bk": [0, 1, 2], "ck": [0, 1], "W1": [0, 1],
                           "b1": [0, 1], "prefix_k": [0, 2], "prefix_v": [0, 1, 2],
                           "key_padding_mask": [0, 1], "seq_lens": [0]}),
    "inducer_output_projection": (_valid_outproj, lambda kw: inducer_output_projection(**kw),
                                  {"f": [], "u": [0, 1, 2], "W_o": [1], "b_o": [0],
                                   "W2": [0, 1, 2], "b2": [0]}),
}

KINDS = ("rank", "shape", "dtype", "device", "type")

def test_projection_short_w_k_names_w_k():
    g = torch.Generator().manual_seed(0)
    kw = {k: v.float() for k, v in _valid_projection(g).items()}
    kw["w_k"] = kw["w_k"][:2]  # 2 rows: fewer than one key head of width p = 3
    with pytest.raises((ValueError, TypeError), match="w_k"):
        _call_projection(kw)


def _cases():
    for op, (_, _, dims) in OPS.items():
        args = list(dims) + (["scale"] if op in ("krona_linear", "headwise_oproj") else [])
        for arg in args:
            kinds = ("type",) if arg == "scale" else KINDS
            for kind in kinds:
                if kind == "shape" and not dims.get(arg):
                    continue
                yield pytest.param(op, arg, kind, id=f"{op}-{arg}-{kind}")


def _corrupt(data, t, arg, kind, fixed_dims):
    if kind == "type":
        if not isinstance(t, torch.Tensor):  # scale: a string or a 2-element tensor
            return data.draw(st.sampled_from(["2", torch.tensor([1.0, 2.0]), None, [1.0]]),
                             label="bad scale")
        return t.tolist()
    if kind == "rank":
        if arg in ("x", "basis", "o"):  # any leading shape is fine: only 0-d is wrong
            return t.reshape(-1)[0].clone()
        how = data.draw(st.sampled_from(["add", "drop"]), label="rank change")
        return t.unsqueeze(0) if how == "add" or t.dim() == 1 else t.reshape(-1, *t.shape[2:])
    if kind == "shape":
        dim = data.draw(st.sampled_from(fixed_dims), label="dim")
        shape = list(t.shape)
        shape[dim] += data.draw(st.sampled_from([1, 2, -1] if shape[dim] > 1 else [1, 2]),
                                label="delta")
        if t.dtype == torch.bool:
            return torch.ones(shape, dtype=torch.bool)
        return torch.randn(shape, dtype=t.dtype) if t.is_floating_point() else \
            torch.zeros(shape, dtype=t.dtype)
    if kind == "dtype":
        if not t.is_floating_point():  # masks / lengths: a float tensor instead
            return t.float()
        return t.to(data.draw(st.sampled_from([torch.float64, torch.float16, torch.int32]),
                              label="bad dtype"))
    if kind == "device":
        return t.to("meta")
    raise AssertionError(kind)


@pytest.mark.parametrize("op,arg,kind", list(_cases()))
def test_bad_input_names_the_argument(op, arg, kind, seed):
    make, call, dims = OPS[op]

    def body(data):
        g = gen(data)
        kw = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
              for k, v in make(g).items()}
        kw[arg] = _corrupt(data, kw[arg], arg, kind, dims.get(arg, []))
        with pytest.raises((ValueError, TypeError)) as info:
            call(kw)
        msg = str(info.value)
        short = arg.split(".")[-1]
        assert arg in msg or short in msg, f"{type(info.value).__name__}: {msg!r} names no {arg}"

    run_property(seed, body, 3)


# ------------------------------------------------------------------------------------------
# the rule itself (docs/math.md §4: atol_t = c_t · eps_t · max|ref64|, c = 16 float32, 1 float16)


@pytest.mark.parametrize("dtype,c", [(torch.float32, 16.0), (torch.float16, 1.0),
                                     (torch.bfloat16, 1.0)])
def test_spec4_bound(dtype, c):
    from kfused.testing import compare

    ref = torch.tensor([4.0, -2.0, 1.0], dtype=F64)
    tor = ref + torch.tensor([0.0, 1e-9, 0.0], dtype=F64)
    eps = torch.finfo(dtype).eps
    bound = 2 * 1e-9 + c * eps * 4.0
    ok = compare("t", ref + torch.tensor([bound * 0.99, 0, 0], dtype=F64), ref, tor, dtype)
    bad = compare("t", ref + torch.tensor([bound * 1.01, 0, 0], dtype=F64), ref, tor, dtype)
    assert ok.bound == pytest.approx(bound, rel=1e-9) and ok.ok and not bad.ok
    nan = compare("t", ref + torch.tensor([float("nan"), 0, 0], dtype=F64), ref, tor, dtype)
    assert not nan.ok


def test_spec4_infinite_torch_error_fails():
    """torch_t overflowing (inf where ref64 is finite) made the bound infinite: any kernel,
    an infinite one too, passed."""
    from kfused.testing import compare

    ref = torch.tensor([4.0, -2.0, 1.0], dtype=F64)
    tor = torch.tensor([float("inf"), -2.0, 1.0], dtype=F64)
    for dtype in (torch.float16, torch.float32):
        for got in (ref + 1000.0, torch.full_like(ref, float("inf"))):
            r = compare("t", got, ref, tor, dtype)
            assert not r.ok and "not finite" in r.detail, r


def test_spec4_reference_below_float32_range():
    """A reference whose every element rounds to 0 in float32 (~1e-52: an inducer gate's
    gradient through 1 − λ ~ 1e-65) has no float32 answer but 0, whose relative error is 1:
    the relative clause failed the correctly rounded kernel. It still fails a kernel off by
    more than the absolute clause allows, and the relative clause still holds elsewhere."""
    from kfused.testing import compare

    ref = torch.tensor([1.7e-52, -3.0e-53, 0.0], dtype=F64)
    zero = torch.zeros(3, dtype=torch.float32)
    assert compare("t", zero, ref, zero, torch.float32).ok
    assert not compare("t", torch.full((3,), 1e-38), ref, zero, torch.float32).ok
    sub = torch.tensor([7.231e-45, 0.0, -1.4e-45], dtype=F64)      # float32 subnormals
    assert compare("t", zero, sub, zero, torch.float32).ok
    big = torch.tensor([1.0, 2.0, 3.0], dtype=F64)
    off = big.float() * (1 + 3e-4)
    assert not compare("t", off, big, off, torch.float32).ok    # rel 3e-4 ≥ 1e-4


def test_check_against_reference_compares_every_output():
    """A kernel returning fewer (or more) outputs than the reference, or out_names naming fewer,
    was compared on the common prefix only (zip) and passed."""
    from kfused.testing import check_against_reference

    x = torch.randn(5, 3, dtype=F64)
    ref = lambda x: (x * 2, x.sum(-1))  # noqa: E731
    for kernel in (lambda x: x * 2, lambda x: (x * 2, x.sum(-1), x)):
        res = check_against_reference(kernel, ref, {"x": x}, torch.float32, grad_names=[])
        assert not all(r.ok for r in res), res
    right = check_against_reference(ref, ref, {"x": x}, torch.float32, grad_names=[])
    assert [r.name for r in right] == ["out0", "out1"] and all(r.ok for r in right)
    with pytest.raises(ValueError, match="out_names"):
        check_against_reference(lambda x: (x * 2, x.sum(-1) + 1), ref, {"x": x}, torch.float32,
                                grad_names=[], out_names=["y"])


def test_spec4_output_in_another_dtype_fails():
    """A kernel answering a float16 call in float64 or float32 (exact here) was held to the
    float16 bound and passed; so did an empty output of the wrong dtype."""
    from kfused.testing import check_against_reference, compare

    x = torch.randn(4, 8, dtype=F64)
    for wrong in (torch.float64, torch.float32):
        res = check_against_reference(lambda x: (x * 2).to(wrong), lambda x: x * 2, {"x": x},
                                      torch.float16, grad_names=[])
        assert not res[0].ok and "dtype" in res[0].detail, res
    empty = torch.empty(0, 3, dtype=F64)
    assert not compare("e", empty.float(), empty, empty.half(), torch.float16).ok
    assert compare("e", empty.half(), empty, empty.half(), torch.float16).ok


def test_check_against_reference_refuses_grad_names_of_no_input():
    """A misspelt grad name ("X" for "x") compared no gradient and the check passed, although
    the kernel's gradient was wrong."""
    from kfused.testing import check_against_reference

    x = torch.randn(5, 3, dtype=F64)
    wrong_grad = lambda x, n=0: x.detach() * 2 + (x - x.detach()) * 3  # noqa: E731
    assert not all(r.ok for r in check_against_reference(wrong_grad, lambda x: x * 2, {"x": x},
                                                         torch.float32, grad_names=["x"]))
    for names in (["X"], ["x", "n"]):
        with pytest.raises(ValueError, match="grad_names"):
            check_against_reference(wrong_grad, lambda x, n=0: x * 2, {"x": x, "n": 3},
                                    torch.float32, grad_names=names)
