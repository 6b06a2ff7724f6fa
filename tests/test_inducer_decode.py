"""The decode path of inducer attention (few queries against a long KV cache): split-KV over
key chunks with the query heads of a kv head packed into one tile, merged in the same launch
by the last chunk of each kv head to finish. Taken automatically for 16-bit inputs with at most 16 queries; checked against the float64 reference
(docs/math.md §4, outputs and gradients: the backward reads the merged row statistics) and
against the single-pass forward."""

import math

import pytest
import torch

from tests.conftest import DEVICE, DTYPES
from tests.test_inducer import _params
from kfused.ops import inducer_attention
from kfused.testing import assert_against_reference
from kfused.triton_kernels.inducer_attention import (DECODE_MAX_QUERIES, _DecodePlan, _Layout,
                                                     decode_candidates,
                                                     inducer_attention_forward)

f64 = torch.float64


def _cache(B, H, H_kv, n_q, n_k, p):
    return {"q": torch.randn(B, H, n_q, p, dtype=f64),
            "k": torch.randn(B, H_kv, n_k, p, dtype=f64),
            "v": torch.randn(B, H_kv, n_k, p, dtype=f64)}


CASES = [
    # B, H, H_kv, n_q, n_k, p, l, causal, composition, inducer, mask
    (3, 4, 2, 1, 300, 64, 2, True, "add", True, "lens0"),    # GQA; an empty cache + prefix
    (2, 2, 1, 3, 150, 32, 0, True, "gate", True, "mask"),    # 3 new tokens, padded cache
    (2, 8, 1, 1, 70, 128, 0, False, "add", False, None),     # MQA, plain attention
    (2, 2, 2, 16, 200, 80, 1, True, "add", True, "lens0"),   # the most queries it takes
    (2, 3, 3, 1, 100, 64, 0, True, "add", True, "lens0"),    # one chunk, H == H_kv: 1 pass
]


def _fns(composition, causal):
    def make(backend):
        def fn(q, k, v, **kw):
            out, u = inducer_attention(q, k, v, composition=composition, causal=causal,
                                       backend=backend, **kw)
            return out if u is None else (out, u)
        return fn
    return make("triton"), make("reference")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("B,H,H_kv,n_q,n_k,p,l,causal,composition,inducer,mask", CASES,
                         ids=[f"B{c[0]}H{c[1]}/{c[2]}q{c[3]}k{c[4]}p{c[5]}l{c[6]}"
                              f"{'c' if c[7] else ''}-{c[8] if c[9] else 'plain'}-{c[10]}"
                              for c in CASES])
def test_decode_against_reference(B, H, H_kv, n_q, n_k, p, l, causal, composition, inducer,
                                  mask, dtype):
    lay = _Layout(torch.empty(B, H, n_q, p), torch.empty(B, H_kv, n_k, p), None)
    # the path under test is the one taken (16-bit; float32 keeps the single pass, see
    # _DecodePlan.chosen, and is checked here as the comparison)
    assert _DecodePlan.chosen(lay, dtype) == (dtype != torch.float32)
    inputs = _cache(B, H, H_kv, n_q, n_k, p)
    P = _params(H, p, composition=composition, l=l)
    if not inducer:
        P = {k_: t for k_, t in P.items() if k_.startswith("prefix")}
    inputs.update(P)
    if mask == "lens0":
        lens = torch.randint(1, n_k + 1, (B,))
        lens[-1] = 0                             # nothing cached yet: only the prefix / λ = 1
        inputs["seq_lens"] = lens
    elif mask == "mask":
        m = torch.rand(B, n_k) > 0.3
        m[-1] = False
        inputs["key_padding_mask"] = m
    kern, ref = _fns(composition, causal)
    assert_against_reference(kern, ref, inputs, dtype, DEVICE)


@pytest.mark.parametrize("chunk,config", [(64, None), (128, None), (1024, None)]
                         + [(c["BLOCK_N"], c) for c in decode_candidates()],
                         ids=lambda v: v if isinstance(v, int) else
                         (f"keys{v['BLOCK_N']}" if v else "rule"))
def test_decode_matches_single_pass(chunk, config):
    """Every chunking gives the single-pass forward's outputs and row statistics; so does
    every launch configuration of the split-KV decode (DECODE_CANDIDATES: the rule's and
    those a tuning table may choose; chunks of one step, the last one ragged)."""
    torch.manual_seed(0)
    B, H, H_kv, n_q, n_k, p = 2, 6, 2, 2, 333, 64
    X = {k_: t.float().to(DEVICE) for k_, t in _cache(B, H, H_kv, n_q, n_k, p).items()}
    P = {k_: t.float().to(DEVICE) for k_, t in _params(H, p, l=3).items()}
    mlp = tuple(P[n] for n in ("Ak", "ak", "Bk", "ck", "W1", "b1"))
    km = (torch.rand(B, n_k) > 0.2).to(DEVICE)
    a = inducer_attention_forward(X["q"], X["k"], X["v"], mlp, P["prefix_k"], P["prefix_v"],
                                  km, True, decode=True, decode_chunk=chunk, config=config)
    b = inducer_attention_forward(X["q"], X["k"], X["v"], mlp, P["prefix_k"], P["prefix_v"],
                                  km, True, decode=False)
    for name, x, y in zip(("out", "u", "lse", "lam", "stats"), a, b):
        torch.testing.assert_close(x, y, rtol=2e-6, atol=2e-6, msg=name)


def test_decode_is_one_launch_and_leaves_its_counters_at_zero(launches):
    """One kernel launch per decode step (grid: key chunks × kv heads); the arrival counters
    it takes tickets on are back at 0 afterwards, so the next step starts clean and gives the
    same result."""
    from kfused.triton_kernels import inducer_attention as ia

    torch.manual_seed(2)
    B, H, H_kv, n_q, n_k, p = 2, 4, 2, 1, 300, 32
    X = {k_: t.half().to(DEVICE) for k_, t in _cache(B, H, H_kv, n_q, n_k, p).items()}
    P = {k_: t.half().to(DEVICE) for k_, t in _params(H, p, l=2).items()}
    grids = launches(ia, "_inducer_attn_fwd_kernel")
    first = inducer_attention(**X, **P, causal=True, backend="triton")
    plan = _DecodePlan(_Layout(X["q"], X["k"], None), X["q"].device, dtype=X["q"].dtype)
    assert grids == [(plan.splits, B * H_kv)] and plan.splits > 1
    counters = ia._arrival_counters(X["q"].device, B * H_kv)
    assert int(counters.abs().sum()) == 0
    second = inducer_attention(**X, **P, causal=True, backend="triton")
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("H_kv,n_k,split", [(3, 100, False), (3, 200, True), (1, 100, True)])
def test_decode_splits_only_when_there_is_something_to_split(launches, H_kv, n_k, split):
    """With one key chunk and a kv head per query head there is nothing to split or pack:
    the decode path runs the single pass on 16-row tiles (grid (1, B·H), no workspace, no
    merge); several chunks, or query heads to pack (grouped-query attention), take the
    split-KV launch (grid (chunks, B·H_kv)). Same outputs as the single pass either way."""
    from kfused.triton_kernels import inducer_attention as ia

    torch.manual_seed(3)
    B, H, n_q, p = 2, 3, 1, 32
    X = {k_: t.half().to(DEVICE) for k_, t in _cache(B, H, H_kv, n_q, n_k, p).items()}
    P = {k_: t.half().to(DEVICE) for k_, t in _params(H, p, l=0).items()}
    mlp = tuple(P[n] for n in ("Ak", "ak", "Bk", "ck", "W1", "b1"))
    plan = _DecodePlan(_Layout(X["q"], X["k"], None), X["q"].device, dtype=X["q"].dtype)
    assert (plan.splits > 1) == (n_k > plan.chunk)
    grids = launches(ia, "_inducer_attn_fwd_kernel")
    a = inducer_attention_forward(X["q"], X["k"], X["v"], mlp, causal=True, decode=True)
    assert grids == ([(plan.splits, B * H_kv)] if split else [(1, B * H)])
    b = inducer_attention_forward(X["q"], X["k"], X["v"], mlp, causal=True, decode=False)
    for name, x, y in zip(("out", "u", "lse", "lam", "stats"), a, b):
        torch.testing.assert_close(x, y, rtol=2e-3, atol=2e-3, msg=name)


def test_decode_refuses_what_it_cannot_take():
    q = torch.randn(1, 2, DECODE_MAX_QUERIES + 1, 32, device=DEVICE)
    with pytest.raises(ValueError, match="at most 16 queries"):
        inducer_attention_forward(q, q, q, decode=True)
    lay = _Layout(q, q, None)
    assert not _DecodePlan.applies(lay)
    one = _Layout(q[:, :, :1], q, None)
    assert _DecodePlan.chosen(one, torch.bfloat16) and not _DecodePlan.chosen(one, torch.float32)


def test_decode_checks_cache_lengths_scale_and_causal():
    """The decode regime (16-bit, one query against a cache) takes the op's checks: cache
    lengths outside [0, n_k], a non-number or non-finite scale, a non-bool causal are errors
    before any launch; the split-KV path never takes a packed batch."""
    X = {k_: t.half() for k_, t in _cache(2, 4, 2, 1, 130, 32).items()}
    P = {k_: t.half() for k_, t in _params(4, 32).items()}
    for lens, bad in (([131, 7], 131), ([5, -1], -1)):
        with pytest.raises(ValueError, match=rf"seq_lens\[\d\] = {bad} is out of range.*"
                                             r"\[0, 130\]"):
            inducer_attention(**X, **P, seq_lens=torch.tensor(lens), backend="triton")
    with pytest.raises(ValueError, match="scale must be a finite positive number"):
        inducer_attention(**X, **P, scale=float("nan"), backend="triton")
    with pytest.raises(TypeError, match="causal must be a bool"):
        inducer_attention(**X, **P, causal="no", backend="triton")
    q = torch.randn(3, 2, 32, device=DEVICE)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="no packed batch"):
        inducer_attention_forward(q, q, q, varlen=(cu, cu, 2, 2), decode=True)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_decode_non_finite_cache_propagates(bad):
    """A non-finite cached key reaches f, λ and u as in the reference (no silent 0 or 1)."""
    torch.manual_seed(1)
    X = {k_: t.half() for k_, t in _cache(2, 2, 1, 1, 130, 32).items()}   # the decode path
    P = {k_: t.half() for k_, t in _params(2, 32).items()}
    X["k"][0, 0, 77, 3] = bad
    got, gu = inducer_attention(**{k_: t.to(DEVICE) for k_, t in X.items()},
                                **{k_: t.to(DEVICE) for k_, t in P.items()}, backend="triton")
    got, gu = got.float(), gu.float()
    ref, ru = inducer_attention(**{k_: t.float() for k_, t in X.items()},
                                **{k_: t.float() for k_, t in P.items()}, backend="reference")
    assert torch.equal(torch.isnan(got.cpu()), torch.isnan(ref))
    assert torch.equal(torch.isnan(gu.cpu()), torch.isnan(ru))
    assert torch.isfinite(got[1]).all() and torch.isfinite(gu[1]).all()   # other sequence
    if math.isnan(bad):
        assert torch.isnan(got[0]).all() and torch.isnan(gu[0]).all()
    # an infinite key gives a ±inf logit: NaN (+inf) or an excluded column (−inf), per row
    fin = torch.isfinite(ref)
    torch.testing.assert_close(got.cpu()[fin], ref[fin], rtol=2e-3, atol=2e-3)

