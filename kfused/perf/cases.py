"""Benchmark cases, the kernel models and the baselines: the file to edit when a kernel changes.

Three registries:

* ``KERNELS``: kernel name -> model ``f(launch) -> work`` giving the work one launch issues
  (FLOPs by unit, transcendental and element-wise instruction counts, HBM bytes) from its
  arguments, constexprs (block sizes) and grid. Units and rates: :mod:`kfused.perf.roofline`.
  Adding a kernel = one function decorated with ``@kernel("name")``; a kernel without a model
  is reported as "unmodelled" (bytes = its tensor arguments read once, no FLOPs).
* ``CASES``: the benchmark shapes (benchmarks/bench_*.py and the targets of issues 11, 12,
  14). A case's ``run`` calls the public op forward and backward on CPU stand-in tensors;
  :func:`kfused.perf.trace.trace` records the Triton launches and the torch glue it makes.
* baselines: per case, the providers it is compared with (cuBLAS GEMM, SDPA flash,
  materialised kron, unfused LoRA), each a list of modelled kernels.

Every time computed from these is PREDICTED.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, List, Optional, Tuple

import torch

from kfused.perf import roofline as R

# ==========================================================================================
# kernel models


def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


KERNELS: Dict[str, Callable] = {}


def kernel(name: str):
    def deco(fn):
        KERNELS[name] = fn
        return fn
    return deco


def _el(t) -> int:
    return t.element_size() if isinstance(t, torch.Tensor) else 2


def _is16(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16)


def _prod(a: dict, key: str, flops: float, on_dot: bool, x16: bool) -> None:
    """Add a matrix product's FLOPs to the right unit: tl.dot on 16-bit tiles -> dot16; tl.dot
    on float32 (IEEE) -> fma32; the broadcast path (a tile dim < 16) forms float64 products."""
    if on_dot:
        a["dot16_flops" if x16 else "fma32_flops"] += flops
    else:
        a["fma64_flops"] += flops


def _work() -> Dict[str, float]:
    return dict(dot16_flops=0.0, fma32_flops=0.0, fma64_flops=0.0, sfu_ops=0.0, alu_ops=0.0,
                hbm_bytes=0.0)


@kernel("_krona_fwd_kernel")
def _m_krona_fwd(L) -> Dict[str, float]:
    a = L.bound()
    X, Y = a["X"], a["Y"]
    x16 = _is16(X)
    T, a_in, b_in = a["T"], a["a_in"], a["b_in"]
    BM, BI, BJ, BK, KC, LC = (a[k] for k in ("BM", "BI", "BJ", "BK", "KC", "LC"))
    P = L.programs()
    d_in = a_in * b_in
    w = _work()
    if a["HAS_W"]:
        _prod(w, "W", P * 2.0 * BM * BI * BJ * cdiv(d_in, BK) * BK, a["DOT_W"], x16)
    n_l = cdiv(b_in, LC)
    _prod(w, "U", P * n_l * cdiv(a_in, KC) * 2.0 * BM * LC * BI * KC, a["DOT_U"], x16)
    _prod(w, "Y", P * n_l * 2.0 * BM * BI * BJ * LC, a["DOT_Y"], x16)
    w["alu_ops"] += P * BM * BI * BJ * (n_l + 1)          # scale·y + acc per l chunk, epilogue
    el = _el(X)
    col_blocks = L.grid[1]
    w["hbm_bytes"] = (R.reread_bytes(T * d_in * el, col_blocks)       # x once per column block
                      + (a["W"].numel() * _el(a["W"]) if a["HAS_W"] else 0)
                      + Y.numel() * _el(Y))
    return w


@kernel("_kron_grad_kernel")
def _m_kron_grad(L) -> Dict[str, float]:
    a = L.bound()
    X, G = a["X"], a["G"]
    x16 = _is16(X)
    T, n_blocks = a["T"], a["n_blocks"]
    BT, AOP, AIP, BOP, BIP = (a[k] for k in ("BT", "AOP", "AIP", "BOP", "BIP"))
    w = _work()
    nb = float(n_blocks)
    _prod(w, "W1", nb * 2.0 * BT * AOP * BIP * BOP, a["DOT_W1"], x16)
    if a["COMPUTE_DX"]:
        _prod(w, "DX", nb * 2.0 * BT * BIP * AIP * AOP, a["DOT_DX"], x16)
    if a["COMPUTE_DAB"]:
        _prod(w, "DA", nb * 2.0 * AOP * AIP * BT * BIP, a["DOT_DA"], x16)
        _prod(w, "V", nb * 2.0 * BT * BIP * AOP * AIP, a["DOT_V"], x16)
        _prod(w, "DB", nb * 2.0 * BOP * BIP * BT * AOP, a["DOT_DB"], x16)
    el = _el(X)
    d_in, d_out = a["a_in"] * a["b_in"], a["a_out"] * a["b_out"]
    by = T * d_out * el
    if a["COMPUTE_DX"]:
        by += T * d_in * el
    if a["COMPUTE_DAB"]:
        by += T * d_in * el + a["DA"].element_size() * L.programs() * (
            a["a_out"] * a["a_in"] + a["b_out"] * a["b_in"])
    w["hbm_bytes"] = by
    return w


@kernel("_hw_qkv_fwd_kernel")
def _m_qkv_fwd(L) -> Dict[str, float]:
    a = L.bound()
    x = a["x_ptr"]
    x16 = _is16(x)
    T, D, P = a["T"], a["D"], a["P"]
    HQ, HK, HV = a["HQ"], a["HK"], a["HV"]
    BT, BK, PB = a["BT"], a["BK"], a["PB"]
    nT = L.grid[0]
    Dk = cdiv(D, BK) * BK
    w = _work()
    for H, hw, sh, RB, RSB in ((HQ, a["HWQ"], a["SHQ"], a["RBQ"], a["RSBQ"]), (HK, False, False, 0, 0),
                               (HV, a["HWV"], a["SHV"], a["RBV"], a["RSBV"])):
        progs = nT * H
        _prod(w, "W", progs * 2.0 * BT * PB * Dk, a["DOT"], x16)
        if hw:
            _prod(w, "D", progs * 2.0 * BT * RB * Dk, a["DOT"], x16)
            w["fma32_flops"] += progs * 2.0 * BT * PB * RB            # up-projection, ieee
        if sh:
            _prod(w, "S", progs * 2.0 * BT * RSB * Dk, a["DOT"], x16)  # shared down, per head
            w["fma32_flops"] += progs * 2.0 * BT * PB * RSB
    el = _el(x)
    y = a["y_ptr"]
    wbytes = sum(t.numel() * _el(t) for t in (a["wq_ptr"], a["wk_ptr"], a["wv_ptr"]))
    z = a["z_ptr"]
    w["hbm_bytes"] = (R.reread_bytes(T * D * el, HQ + HK + HV) + wbytes + y.numel() * _el(y)
                      + z.numel() * _el(z))
    return w


@kernel("_hw_qkv_bwd_kernel")
def _m_qkv_bwd(L) -> Dict[str, float]:
    a = L.bound()
    g = a["g_ptr"]
    x16 = _is16(g)
    T, D, P = a["T"], a["D"], a["P"]
    HQ, HK, HV = a["HQ"], a["HK"], a["HV"]
    BT, BD, PB = a["BT"], a["BD"], a["PB"]
    progs = L.programs()
    w = _work()
    for H, hw, sh, RB, RSB in ((HQ, a["HWQ"], a["SHQ"], a["RBQ"], a["RSBQ"]),
                               (HK, False, False, 0, 0),
                               (HV, a["HWV"], a["SHV"], a["RBV"], a["RSBV"])):
        _prod(w, "GW", progs * H * 2.0 * BT * PB * BD, a["DOT"], x16)
        if hw:   # dZ recomputed for every D-block, then dZ·D
            w["fma32_flops"] += progs * H * 2.0 * BT * (PB * RB + RB * BD)
        if sh:
            w["fma32_flops"] += progs * (H * 2.0 * BT * PB * RSB + 2.0 * BT * RSB * BD)
    el = _el(g)
    N = (HQ + HK + HV) * P
    wbytes = sum(t.numel() * _el(t) for t in (a["wq_ptr"], a["wk_ptr"], a["wv_ptr"]))
    dz = a["dz_ptr"]
    w["hbm_bytes"] = (R.reread_bytes(T * N * el, L.grid[1]) + wbytes + T * D * el
                      + dz.numel() * _el(dz))
    return w


@kernel("_atb_kernel")
def _m_atb(L) -> Dict[str, float]:
    a = L.bound()
    A, B = a["a_ptr"], a["b_ptr"]
    T, M, N, N2, NB = a["T"], a["M"], a["N"], a["N2"], a["NB"]
    BT, BM, BN, BN2 = a["BT"], a["BM"], a["BN"], a["BN2"]
    S = L.grid[1]
    Tp = S * cdiv(a["T_PER"], BT) * BT
    progs0 = L.grid[0]
    w = _work()
    cols = BN + (BN2 if a["HAS_B2"] else 0)
    w["fma32_flops"] += progs0 * 2.0 * Tp * BM * cols                 # float32 IEEE dots
    if str(a["RACC"]).endswith("float64") or "fp64" in str(a["RACC"]):
        w["fma64_flops"] += progs0 * (Tp / BT) * BM * cols            # float64 accumulation
    m_blocks, n_blocks = cdiv(M, BM), cdiv(N, BN)
    w["hbm_bytes"] = (R.reread_bytes(T * NB * M * _el(A), n_blocks)
                      + R.reread_bytes(B.numel() * _el(B), m_blocks)
                      + S * NB * M * cols * (8 if w["fma64_flops"] else 4))
    return w


def _attn_tiles(n_q: int, n_k: int, BM: int, BN: int, causal: bool, off: int) -> float:
    """Key tiles visited, summed over the query tiles of one head (forward / dQ loops)."""
    tot = 0
    for pm in range(cdiv(n_q, BM)):
        hi = min(n_k, (pm + 1) * BM + off) if causal else n_k
        tot += cdiv(max(hi, 0), BN)
    return tot


def _attn_tiles_kv(n_q: int, n_k: int, BM: int, BN: int, causal: bool, off: int) -> float:
    """Query tiles visited, summed over the key tiles of one head (dK/dV loop)."""
    tot = 0
    for pn in range(cdiv(n_k, BN)):
        lo = max(pn * BN - off, 0) // BM * BM if causal else 0
        tot += cdiv(max(n_q - lo, 0), BM)
    return tot


def _attn_common(a):
    q = a["Q"]
    return q, _is16(q), a["BLOCK_M"], a["BLOCK_N"], a["D_PAD"], bool(a["CAUSAL"])


@kernel("_inducer_attn_fwd_kernel")
def _m_ind_fwd(L) -> Dict[str, float]:
    a = L.bound()
    q, x16, BM, BN, DP, causal = _attn_common(a)
    n_q, n_k, off = a["N_Q"], a["N_K"], a["causal_off"]
    BH = L.grid[1]
    tiles = BH * (_attn_tiles(n_q, n_k, BM, BN, causal, off)
                  + (cdiv(a["N_PREFIX"], BN) * cdiv(n_q, BM) if a["HAS_PREFIX"] else 0))
    w = _work()
    _prod(w, "QK+PV", tiles * 2 * 2.0 * BM * BN * DP, True, x16)
    w["sfu_ops"] = tiles * BM * BN                                   # exp per score
    w["alu_ops"] = tiles * (BM * BN * 8 + BM * DP)                   # scale, mask, max, sub,
    el = _el(q)                                                      # sum, cvt; acc rescale
    p = a["HEAD_DIM"]
    kv = a["K"].numel() * el * 2
    per_head_kv = n_k * p * el * 2
    w["hbm_bytes"] = (q.numel() * el * 2 + R.reread_bytes(kv, 1 if per_head_kv <= R.L2_RESIDENT
                                                          else cdiv(n_q, BM))
                      + BH * n_q * 4 * 6)                              # lse, stats, λ, s0
    return w


@kernel("_inducer_attn_bwd_dq_kernel")
def _m_ind_dq(L) -> Dict[str, float]:
    a = L.bound()
    q, x16, BM, BN, DP, causal = _attn_common(a)
    n_q, n_k, off = a["N_Q"], a["N_K"], a["causal_off"]
    BH = L.grid[1]
    tiles = BH * _attn_tiles(n_q, n_k, BM, BN, causal, off)
    if a["EXACT_DELTA"]:
        tiles *= 1.5       # a first pass forms D from recomputed P, dP (2 of the 3 products)
    w = _work()
    _prod(w, "S,dP,dQ", tiles * 3 * 2.0 * BM * BN * DP, True, x16)
    w["sfu_ops"] = tiles * BM * BN
    w["alu_ops"] = tiles * BM * BN * 8
    el = _el(q)
    w["hbm_bytes"] = q.numel() * el * 3 + a["K"].numel() * el * 2 + BH * n_q * 4 * 5
    return w


@kernel("_inducer_attn_bwd_dkdv_kernel")
def _m_ind_dkdv(L) -> Dict[str, float]:
    a = L.bound()
    q, x16, BM, BN, DP, causal = _attn_common(a)
    n_q, n_k, off, group = a["N_Q"], a["N_K"], a["causal_off"], a["GROUP"]
    BHkv = L.grid[1]
    if a["IS_PREFIX"]:
        causal = False
    tiles = BHkv * group * _attn_tiles_kv(n_q, n_k, BM, BN, causal, off)
    w = _work()
    _prod(w, "S,dV,dP,dK", tiles * 4 * 2.0 * BM * BN * DP, True, x16)
    w["sfu_ops"] = tiles * BM * BN
    w["alu_ops"] = tiles * BM * BN * 8
    el = _el(q)
    w["hbm_bytes"] = (q.numel() * el * 2 + a["K"].numel() * el * 4
                      + BHkv * group * n_q * 4 * 4)
    return w


def model_launch(L) -> Tuple[Dict[str, float], bool]:
    """(work, modelled?) of a recorded launch."""
    f = KERNELS.get(L.name)
    if f is not None:
        return f(L), True
    w = _work()
    w["hbm_bytes"] = float(sum(v.numel() * v.element_size() for v in L.bound().values()
                               if isinstance(v, torch.Tensor)))
    return w, False


# ==========================================================================================
# baselines: lists of (name, work, pseudo-sass, programs, ctas_per_sm)


def _gemm(name, M, N, K, el=2):
    return dict(name=name, t=R.gemm_time(M, N, K, el), flops=2.0 * M * N * K)


def _stream(name, nbytes):
    return dict(name=name, t=R.stream_time(nbytes), flops=0.0)


def _fa2(name, B, H, n, p, causal, bwd, el=2, Hkv=None):
    """FlashAttention-2 (SDPA's flash backend on H100): mma.sync, 128-row tiles; forward 2
    products, backward 5 (+ the D = rowsum(dO∘O) preprocessing pass)."""
    Hkv = Hkv or H
    frac = 0.5 if causal else 1.0
    scores = B * H * n * n * frac
    prods = 5 if bwd else 2
    work = dict(dot16_flops=scores * prods * 2.0 * p, sfu_ops=scores,
                alu_ops=scores * (12 if bwd else 8),
                hbm_bytes=el * B * n * p * (H * (4 if bwd else 2) + Hkv * (4 if bwd else 2))
                + (B * H * n * p * 4 * 2 if bwd else 0))
    programs = B * H * cdiv(n, 128)
    pr = R.predict(work, {"hmma": 1}, programs, 1)
    out = [dict(name=name, t=pr["t"], flops=work["dot16_flops"])]
    if bwd:
        out.append(_stream(name + ":rowsum(dO*O)", el * 2 * B * H * n * p + 4 * B * H * n))
    return out


# ==========================================================================================
# cases


@dataclasses.dataclass
class Target:
    issue: int
    baseline: str           # baseline provider name
    max_ratio: float        # kfused fwd+bwd time / baseline time must be <= this
    text: str


@dataclasses.dataclass
class Case:
    op: str
    label: str
    shape: Dict[str, object]
    run: Callable[[], None]                      # forward + backward on CPU stand-ins
    useful_flops: float                          # fwd + bwd, what the math needs
    min_bytes: float                             # fwd + bwd, what must be read and written
    baselines: Dict[str, Callable[[], List[dict]]]
    targets: List[Target]
    compile_group: str = ""                      # cases sharing compiled kernels


def _e(*s, dtype=torch.bfloat16, grad=False):
    t = torch.empty(*s, dtype=dtype)
    return t.requires_grad_() if grad else t


def _grad(outs, leaves):
    outs = [o for o in (outs if isinstance(outs, (tuple, list)) else (outs,))
            if isinstance(o, torch.Tensor) and o.requires_grad]
    torch.autograd.grad(outs, leaves, [torch.empty_like(o) for o in outs], allow_unused=True)


# --- KronA (issue 11) ---------------------------------------------------------------------


def _krona_case(T, d_in, d_out, A_shape, B_shape, fac):
    (a_out, a_in), (b_out, b_in) = A_shape, B_shape
    assert a_out * b_out == d_out and a_in * b_in == d_in

    def run():
        import kfused

        x = _e(T, d_in, grad=True)
        W, b = _e(d_out, d_in), _e(d_out)
        A, B = _e(a_out, a_in, grad=True), _e(b_out, b_in, grad=True)
        y = kfused.krona_linear(x, W, b, A, B, 0.5, backend="triton")
        _grad(y, [x, A, B])

    gemm = 2.0 * T * d_in * d_out
    kron = 2.0 * T * (a_out * a_in * b_in + a_out * b_in * b_out)
    el = 2

    def floor():
        return [_gemm("fwd GEMM", T, d_out, d_in), _gemm("dx GEMM", T, d_in, d_out)]

    def kron_dense():
        dW = d_out * d_in * el
        return [_stream("kron(A,B)·s", dW * 2), _gemm("fwd GEMM W", T, d_out, d_in),
                _gemm("fwd GEMM ΔW", T, d_out, d_in), _stream("add", 3 * T * d_out * el),
                _gemm("dx GEMM W", T, d_in, d_out), _gemm("dx GEMM ΔW", T, d_in, d_out),
                _stream("add dx", 3 * T * d_in * el), _gemm("dΔW GEMM", d_out, d_in, T),
                _stream("kron backward (dA, dB from dΔW)", dW * 2)]

    def compiled():
        # torch.compile of the reference: cuBLAS for the frozen GEMMs and the two factor
        # products as batched GEMMs (memory-bound at these widths), Inductor fuses the adds.
        U = T * a_out * b_in * el
        return [_gemm("fwd GEMM", T, d_out, d_in),
                _stream("U = A·X_t", T * d_in * el + U), _stream("Y += U·Bᵀ", U + 3 * T * d_out * el),
                _gemm("dx GEMM", T, d_in, d_out),
                _stream("dU = G·B", T * d_out * el + U), _stream("dx += Aᵀ·dU", U + 3 * T * d_in * el),
                _stream("dA = Σ dU Xᵀ", U + T * d_in * el), _stream("dB = Σ Gᵀ U", U + T * d_out * el)]

    return Case(
        op="krona_linear", label=f"T={T} {d_in}->{d_out} A{a_out}x{a_in} B{b_out}x{b_in} ({fac})",
        shape=dict(T=T, d_in=d_in, d_out=d_out, A=[a_out, a_in], B=[b_out, b_in]), run=run,
        useful_flops=2 * gemm + 4 * kron,
        min_bytes=el * (2 * T * d_in + 2 * T * d_out + d_in * d_out),
        baselines={"floor": floor, "kron-dense": kron_dense, "compile": compiled},
        targets=[Target(11, "floor", 1.15, "≤ 1.15× the frozen linear"),
                 Target(11, "kron-dense", 0.5, "≥ 2× faster than materialised kron"),
                 Target(11, "compile", 1 / 1.3, "≥ 1.3× faster than torch.compile")],
        compile_group=f"krona {d_in}->{d_out} A{a_out}x{a_in} B{b_out}x{b_in}")


def _krona_cases():
    from kfused.modules.krona import factorize

    out = []
    for d_in, d_out in ((768, 768), (768, 3072)):
        (ao, bo), (ai, bi) = factorize(d_out), factorize(d_in)
        out.append(_krona_case(16384, d_in, d_out, (ao, ai), (bo, bi), "balanced"))
        out.append(_krona_case(16384, d_in, d_out, (d_out // 384, 384), (384, 2), "paper"))
    return out


# --- per-head low-rank q|k|v (issue 12) ---------------------------------------------------


def _headwise_case(width, d, H, Hkv, preset, T):
    from kfused.modules.headwise_presets import PRESETS
    from kfused.reference.headwise import HeadFactors

    p = d // H
    cfg = PRESETS[preset]

    def factors(r, Hs):
        kw = {}
        if r.shared:
            kw.update(shared_A=_e(r.shared, d, grad=True), shared_B=_e(Hs * p, r.shared, grad=True))
        if r.wise:
            kw.update(wise_A=_e(Hs, r.wise, d, grad=True), wise_B=_e(Hs, p, r.wise, grad=True),
                      wise_c=_e(Hs, p, grad=True))
        if r.lite:
            kw.update(lite_A=_e(Hs, r.lite, p, grad=True), lite_B=_e(Hs, p, r.lite, grad=True),
                      lite_c=None if r.wise else _e(Hs, p, grad=True))
        return HeadFactors(**kw)

    def run():
        from kfused.ops.headwise import headwise_qkv

        x = _e(T, d, grad=True)
        wq, wk, wv = _e(H * p, d), _e(Hkv * p, d), _e(Hkv * p, d)
        bq, bk, bv = _e(H * p), _e(Hkv * p), _e(Hkv * p)
        q, v = factors(cfg.q, H), factors(cfg.v, Hkv)
        leaves = [x] + [t for f in (q, v) for t in dataclasses.astuple(f)
                        if isinstance(t, torch.Tensor)]
        y = headwise_qkv(x, wq, wk, wv, bq, bk, bv, n_heads=H, n_kv_heads=Hkv, q=q, v=v,
                         backend="triton", fused_output=True)
        _grad(y, leaves)

    N = (H + 2 * Hkv) * p
    el = 2
    rq, rv = cfg.q, cfg.v
    # LoRA with the same parameter budget on q and v (what peft runs): rank r each
    budget = (rq.shared * (d + H * p) + H * (rq.wise * (d + p) + rq.lite * 2 * p)
              + rv.shared * (d + Hkv * p) + Hkv * (rv.wise * (d + p) + rv.lite * 2 * p))
    r = max(1, round(budget / (2 * (d + d))))

    def floor():
        return [_gemm("fwd GEMM [Wq;Wk;Wv]", T, N, d), _gemm("dx GEMM", T, d, N)]

    def lora():
        out = floor()
        for name, n_out in (("q", H * p), ("v", Hkv * p)):
            out += [_gemm(f"{name} down x·Aᵀ", T, r, d), _gemm(f"{name} up z·Bᵀ", T, n_out, r),
                    _stream(f"{name} add", 3 * T * n_out * el),
                    _gemm(f"{name} dz = g·B", T, r, n_out), _gemm(f"{name} dx += dz·A", T, d, r),
                    _stream(f"{name} dx add", 3 * T * d * el),
                    _gemm(f"{name} dA", r, d, T), _gemm(f"{name} dB", n_out, r, T)]
        out.append(_stream("split/cat q|k|v", 2 * T * N * el))
        return out

    rank_cols = H * (rq.wise + rq.lite) + Hkv * (rv.wise + rv.lite) + rq.shared + rv.shared
    useful = 2.0 * T * d * N * 2 + 3 * 2.0 * T * (d * rank_cols + rank_cols * p)
    return Case(
        op="headwise_qkv", label=f"{width} T={T} {preset}",
        shape=dict(width=width, d=d, H=H, H_kv=Hkv, p=p, T=T, preset=preset, lora_rank=r),
        run=run, useful_flops=useful,
        min_bytes=el * (2 * T * d + 2 * T * N + N * d),
        baselines={"floor": floor, "peft-lora": lora},
        targets=[Target(12, "floor", 1.25, "≤ 1.25× the frozen projections"),
                 Target(12, "peft-lora", 1.0, "no slower than unfused LoRA (same budget)")],
        compile_group=f"headwise {width} {preset}")


def _headwise_cases():
    out = []
    for width, d, H, Hkv in (("gpt2-small", 768, 12, 12), ("gpt2-medium", 1024, 16, 16),
                             ("llama-7b-gqa", 4096, 32, 8)):
        for preset in ("kernel-mix-qvo-intermediate", "kernel-mix-lite-qv-small"):
            out.append(_headwise_case(width, d, H, Hkv, preset, 16384))
    return out


# --- inducer attention (issue 14) ---------------------------------------------------------


def _inducer_case(n, p, causal, L_KEY=4, R_VALUE=8):
    B, H = max(1, 16384 // n), 2048 // p

    def run():
        from kfused.ops.inducer import inducer_attention

        q, k, v = (_e(B, H, n, p, grad=True) for _ in range(3))
        prm = dict(Ak=_e(H, p, L_KEY, grad=True), ak=_e(H, L_KEY, grad=True),
                   Bk=_e(H, L_KEY, p, grad=True), ck=_e(H, p, grad=True),
                   W1=_e(H, p, R_VALUE, grad=True), b1=_e(H, R_VALUE, grad=True))
        f, u = inducer_attention(q, k, v, **prm, causal=causal, backend="triton")
        _grad([f, u], [q, k, v, *prm.values()])

    fl = 4.0 * B * H * n * n * p * (0.5 if causal else 1.0)
    el = 2

    def sdpa():
        return _fa2("sdpa fwd", B, H, n, p, causal, False) + _fa2("sdpa bwd", B, H, n, p,
                                                                   causal, True)

    return Case(
        op="inducer_attention", label=f"B={B} H={H} n={n} p={p} {'causal' if causal else 'full'}",
        shape=dict(B=B, H=H, n=n, p=p, causal=causal, L=L_KEY, r=R_VALUE), run=run,
        useful_flops=fl * 3.5, min_bytes=el * B * H * n * p * 8,
        baselines={"sdpa": sdpa},
        targets=([Target(14, "sdpa", 1 / 0.85, "≥ 0.85× SDPA flash speed (n ≥ 2048)")]
                 if n >= 2048 else []),
        compile_group=f"inducer p={p} {'causal' if causal else 'full'}")


def _inducer_cases():
    return [_inducer_case(n, p, c) for p in (64, 128) for c in (False, True)
            for n in (512, 2048, 16384)]


def all_cases() -> List[Case]:
    return _krona_cases() + _headwise_cases() + _inducer_cases()
