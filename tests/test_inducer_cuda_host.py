"""The torch side of the CUDA C++ inducer path (``_cuda_inference``: the inducer MLP in float32
around the extension's flash kernel) on the CPU, with a stand-in for the kernel built from the
float64 reference: it checks every formula the host computes (the key logit s0, λ from the
kernel's log-sum-exp, u, the "gate" composition) without a GPU. The kernel itself is tested
on a GPU (tests/test_inducer.py, CUDA backend)."""

import pytest
import torch

from kfused.ops.inducer_attention import _cuda_inference
from kfused.reference.inducer import inducer_attention_ref

F64 = torch.float64


def _standin(q, k, v, s0, pk, pv, lens, causal):
    """What inducer_attention_fwd returns: f (ordinary prefix-attention), its LSE and
    λ = σ(s0 − LSE), from the float64 reference (float32 stats like the kernel's)."""
    f, _, lse, _ = inducer_attention_ref(q.double(), k.double(), v.double(), causal=causal,
                                         seq_lens=lens, prefix_k=None if pk is None else
                                         pk.double(), prefix_v=None if pv is None else
                                         pv.double(), return_stats=True)
    lam = torch.sigmoid(s0.double() - lse)
    return f.to(q.dtype), lse.float(), lam.float()


@pytest.mark.parametrize("composition", ["add", "gate"])
@pytest.mark.parametrize("causal,prefix,lens", [(False, 0, False), (True, 2, False),
                                                (True, 0, True), (False, 3, True)])
def test_cuda_host_glue_matches_the_reference(composition, causal, prefix, lens):
    g = torch.Generator().manual_seed(7)
    B, H, n_q, n_k, p, L, r = 2, 3, 5, 7, 16, 4, 6

    def t(*s, sc=1.0):
        return torch.randn(*s, generator=g, dtype=F64) * sc

    q, k, v = t(B, H, n_q, p), t(B, H, n_k, p), t(B, H, n_k, p)
    prm = dict(Ak=t(H, p, L, sc=0.3), ak=t(H, L), Bk=t(H, L, p, sc=0.3), ck=t(H, p, sc=0.3),
               W1=t(H, p, r, sc=0.3), b1=t(H, r), W2=t(H, r, p), b2=t(H, p))
    pk = t(H, prefix, p) if prefix else None
    pv = t(H, prefix, p) if prefix else None
    seq_lens = torch.tensor([n_k, 0]) if lens else None       # batch 1: every key masked
    f32 = lambda x: None if x is None else x.float()          # noqa: E731
    got, gu = _cuda_inference(f32(q), f32(k), f32(v), *[f32(prm[n]) for n in
                                                         ("Ak", "ak", "Bk", "ck", "W1", "b1",
                                                          "W2", "b2")],
                              composition, causal, seq_lens, f32(pk), f32(pv), p ** -0.5, True,
                              kernel=_standin)
    want, wu = inducer_attention_ref(q, k, v, **prm, composition=composition, causal=causal,
                                     seq_lens=seq_lens, prefix_k=pk, prefix_v=pv)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)
    if composition == "add":
        torch.testing.assert_close(gu.double(), wu, rtol=2e-5, atol=2e-5)
    else:
        assert gu is None and wu is None


def test_cuda_host_glue_without_inducer():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    f, u = _cuda_inference(q, k, v, *([None] * 8), "add", True, None, None, None,
                           8 ** -0.5, False, kernel=_standin)
    want, _ = inducer_attention_ref(q.double(), k.double(), v.double(), causal=True)
    assert u is None
    torch.testing.assert_close(f.double(), want, rtol=1e-5, atol=1e-5)
