"""The torch side of the CUDA C++ inducer path (``_cuda_inference``) on the CPU, with a stand-in
for the kernel built from the float64 reference. float16 / bfloat16: the kernel takes the
inducer MLP's weights and returns u = λ tanh(q W1 + b1) itself; the host adds "gate"'s
(1 − λ) f + u W2 + λ b2. float32: the host computes s0 and tanh(q W1 + b1) in three passes over
q and the kernel only λ. Checked: the call contract (s0 or the weights, u in float32 for
"gate"), every formula the host computes, without a GPU. The kernel itself is tested on a
GPU (tests/test_cuda_ext.py, tests/test_inducer.py)."""

import types

import pytest
import torch

from _cuda_standin import F64, _d
from _cuda_standin import inducer_attention_fwd as _standin
from kfused.ops.inducer_attention import _cuda_inference
from kfused.reference.inducer import inducer_attention_ref


# float32: float32-accurate host MLP; float16: the output's own rounding (and f's) only
TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


@pytest.mark.parametrize("hkv", [3, 1], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("composition", ["add", "gate"])
@pytest.mark.parametrize("causal,prefix,lens", [(False, 0, False), (True, 2, False),
                                                (True, 0, True), (False, 3, True)])
def test_cuda_host_glue_matches_the_reference(composition, causal, prefix, lens, dtype, hkv):
    g = torch.Generator().manual_seed(7)
    B, H, n_q, n_k, p, L, r = 2, 3, 5, 7, 16, 4, 6

    def t(*s, sc=1.0):
        return (torch.randn(*s, generator=g, dtype=F64) * sc).to(dtype)

    # hkv < H: grouped-query k/v, passed to the kernel as they are (it reads kv head h // G)
    q, k, v = t(B, H, n_q, p), t(B, hkv, n_k, p), t(B, hkv, n_k, p)
    prm = dict(Ak=t(H, p, L, sc=0.3), ak=t(H, L), Bk=t(H, L, p, sc=0.3), ck=t(H, p, sc=0.3),
               W1=t(H, p, r, sc=0.3), b1=t(H, r), W2=t(H, r, p), b2=t(H, p))
    pk = t(H, prefix, p) if prefix else None
    pv = t(H, prefix, p) if prefix else None
    seq_lens = torch.tensor([n_k, 0]) if lens else None       # batch 1: every key masked
    calls = []

    def kernel(*a):
        calls.append(a)
        return _standin(*a)

    got, gu = _cuda_inference(q, k, v, *[prm[n] for n in ("Ak", "ak", "Bk", "ck", "W1", "b1",
                                                          "W2", "b2")],
                              composition, causal, seq_lens, pk, pv, p ** -0.5, True,
                              kernel=kernel)
    # 16-bit: no s0 from the host, the weights to the kernel, u in float32 for "gate"
    assert len(calls) == 1 and (calls[0][3] is None) == (dtype != torch.float32)
    assert calls[0][-1] == (dtype != torch.float32 and composition == "gate")
    want, wu = inducer_attention_ref(*map(_d, (q, k, v)), **{n: _d(x) for n, x in prm.items()},
                                     composition=composition, causal=causal,
                                     seq_lens=seq_lens, prefix_k=_d(pk), prefix_v=_d(pv))
    assert got.dtype == dtype and torch.isfinite(got).all()
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    if composition == "add":
        assert gu.dtype == dtype
        torch.testing.assert_close(gu.double(), wu, rtol=tol, atol=tol)
    else:
        assert gu is None and wu is None


def test_cuda_backend_takes_grouped_query_kv():
    """The CUDA kernel reads kv head h // (H / H_kv) (packing a kv head's query heads into one
    decode block): backend="cuda" no longer refuses grouped-query k/v; its other limits
    stand."""
    from kfused.ops.inducer_attention import _cuda_unfit

    q = torch.randn(1, 8, 1, 64, dtype=torch.float16)
    k = torch.randn(1, 2, 9, 64, dtype=torch.float16)
    unfit = _cuda_unfit(q, k, None, 64 ** -0.5, [q, k])
    assert unfit("cuda") is None and unfit("triton") is None
    assert "scale" in _cuda_unfit(q, k, None, 0.3, [q, k])("cuda")
    assert "seq_lens" in _cuda_unfit(q, k, torch.ones(1, 9, dtype=torch.bool), 64 ** -0.5,
                                     [q, k])("cuda")


def test_cuda_host_glue_without_inducer():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    f, u = _cuda_inference(q, k, v, *([None] * 8), "add", True, None, None, None,
                           8 ** -0.5, False, kernel=_standin)
    want, _ = inducer_attention_ref(q.double(), k.double(), v.double(), causal=True)
    assert u is None
    torch.testing.assert_close(f.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("lens_dtype", [torch.int16, torch.uint8, torch.int8], ids=str)
def test_cuda_host_glue_takes_any_integer_seq_lens(lens_dtype, dtype):
    """inducer_attention accepts seq_lens of any integer dtype (the Triton path and the
    reference do); the extension takes int32 / int64 only, and an int16 seq_lens reached it:
    a RuntimeError from inside the kernel call instead of the answer."""
    g = torch.Generator().manual_seed(11)
    B, H, n_q, n_k, p, L, r = 2, 2, 3, 6, 8, 2, 3

    def t(*s):
        return (torch.randn(*s, generator=g, dtype=F64) * 0.5).to(dtype)

    q, k, v = t(B, H, n_q, p), t(B, H, n_k, p), t(B, H, n_k, p)
    prm = [t(H, p, L), t(H, L), t(H, L, p), t(H, p), t(H, p, r), t(H, r), None, None]
    want = _cuda_inference(q, k, v, *prm, "add", False, torch.tensor([n_k, 2]), None, None,
                           p ** -0.5, True, kernel=_standin)
    got = _cuda_inference(q, k, v, *prm, "add", False, torch.tensor([n_k, 2], dtype=lens_dtype),
                          None, None, p ** -0.5, True, kernel=_standin)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("hkv,n_q,prefix", [(3, 9, 4), (1, 1, 0)], ids=["prefix", "gqa-decode"])
def test_cuda_backend_end_to_end_with_a_standin_extension(monkeypatch, hkv, n_q, prefix):
    """inducer_attention(backend="cuda") through everything but the kernel: backend choice,
    the CUDA checks, the custom op and the host glue, with the extension replaced by the
    float64 stand-in (tests/_cuda_standin.py) — what tests/test_inducer.py's GPU test runs."""
    import _cuda_standin

    from kfused import backends, cuda as kcuda
    from kfused.ops import inducer_attention
    from kfused.testing import assert_against_reference

    calls = []

    def fwd(*a):
        calls.append(a)
        return _cuda_standin.inducer_attention_fwd(*a)

    monkeypatch.setattr(kcuda, "require", lambda name: types.SimpleNamespace(
        inducer_attention_fwd=fwd))
    monkeypatch.setattr(backends, "cuda_unfit", lambda device, dtype, op: None)
    g = torch.Generator().manual_seed(5)
    B, H, n_k, p, L, r = 2, 3, 11, 16, 4, 6

    def t(*s, sc=1.0):
        return torch.randn(*s, generator=g, dtype=F64) * sc

    inputs = {"q": t(B, H, n_q, p), "k": t(B, hkv, n_k, p), "v": t(B, hkv, n_k, p),
              "Ak": t(H, p, L, sc=0.3), "ak": t(H, L), "Bk": t(H, L, p, sc=0.3),
              "ck": t(H, p, sc=0.3), "W1": t(H, p, r, sc=0.3), "b1": t(H, r),
              "seq_lens": torch.tensor([n_k, 5])}
    if prefix:
        inputs.update(prefix_k=t(H, prefix, p), prefix_v=t(H, prefix, p))
    for dtype in (torch.float32, torch.float16):
        assert_against_reference(
            lambda **kw: inducer_attention(**kw, causal=True, backend="cuda"),
            lambda **kw: inducer_attention_ref(**kw, causal=True), inputs, dtype, "cpu",
            grad_names=[])
    assert calls and all(c[1].shape[1] == hkv for c in calls)   # the kernel got k as given
