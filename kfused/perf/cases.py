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
import itertools
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
    on float32 (IEEE) -> fma32; the broadcast path (a tile dim < 16, ``_mm``) forms float32
    products for 16-bit inputs and float64 products for float32 ones."""
    if on_dot:
        a["dot16_flops" if x16 else "fma32_flops"] += flops
    else:
        a["fma32_flops" if x16 else "fma64_flops"] += flops


def _dot16_instr(w: Dict[str, float], flops: float, m: int, n: int, a_regs: bool) -> None:
    """Extra time of one 16-bit tensor-core product in a kernel whose SASS has HGMMA, by the
    instruction the sm_90 TTGIR shows Triton choosing: M < 64 rows cannot be a wgmma (it is
    mma.sync: ``dot16_sync_extra``); M >= 64 is a wgmma, whose operand feed limits N < 64
    outputs when A comes from shared memory (a tile loaded from global memory) rather than
    registers (a computed tile): ``dot16_feed_extra``."""
    if m < 64:
        w["dot16_sync_extra"] = w.get("dot16_sync_extra", 0.0) + flops * (
            R.WGMMA_RATE / R.MMA_RATE - 1.0)
    else:
        eff = R.wgmma_feed_efficiency(n, a_in_registers=a_regs)
        w["dot16_feed_extra"] = w.get("dot16_feed_extra", 0.0) + flops * (1.0 / eff - 1.0)


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
    n_l, n_k = cdiv(b_in, LC), cdiv(a_in, KC)
    if not a.get("XB_FIRST", False):
        _prod(w, "U", P * n_l * n_k * 2.0 * BM * LC * BI * KC, a["DOT_U"], x16)
        # 16-bit: U's rounding residue through the same dot (SPLIT): twice the Y products;
        # not a dot (LC = 1): a float64 outer product of U's float32 sums
        _prod(w, "Y", P * n_l * 2.0 * BM * BI * BJ * LC
              * (2 if a["SPLIT"] and a["DOT_Y"] else 1), a["DOT_Y"], x16)
        w["alu_ops"] += P * BM * BI * BJ * (n_l + 1)      # scale·y + acc per l chunk, epilogue
    else:
        # X Bᵀ first: V (BM·KC, BJ) over every l chunk, then through A per k chunk — a dot
        # (with V's residue when SPLIT) or, KC = 1, a float64 outer product into the tile
        _prod(w, "U", P * n_k * n_l * 2.0 * BM * KC * LC * BJ, a["DOT_U"], x16)
        _prod(w, "Y", P * n_k * 2.0 * BM * BJ * KC * BI
              * (2 if a["SPLIT"] and a["DOT_Y"] else 1), a["DOT_Y"], x16)
        w["alu_ops"] += P * BM * BI * BJ * (n_k + 1)
    el = _el(X)
    col_blocks = L.grid[1]
    w["hbm_bytes"] = (R.reread_bytes(T * d_in * el, col_blocks)       # x once per column block
                      + (a["W"].numel() * _el(a["W"]) if a["HAS_W"] else 0)
                      + Y.numel() * _el(Y))
    return w


def _factor_steps(w: Dict[str, float], a: dict, steps: float, x16: bool,
                  dx: bool = False, dab: bool = True) -> None:
    """Products of ``steps`` factor-gradient steps of BT tokens (_kron_grad_kernel's loop
    body, also _kron_dx_grad_kernel's): W1 = G·B, (dX = Aᵀ W1,) (dA += W1 Xᵀ, V = A X,
    dB += Gᵀ V); 16-bit (SPLIT) tensor-core dots: the W1 and V residues through dA and dB
    again, each hi/lo pair one dot stacked along M (dB as dBᵀ: M = 2·BIP).

    Which instruction each product gets, as the sm_90 TTGIR of _kron_dx_grad_kernel shows
    (24/32-wide factors): a dot with M < 64 rows is mma.sync (Triton's wgmma needs M >= 64),
    charged at MMA_RATE inside a kernel whose SASS has HGMMA (``dot16_sync_extra``); M >= 64
    is wgmma, whose operand feed (:func:`R.wgmma_feed_efficiency`) depends on whether A is a
    register operand — computed tiles (W1, the stacked residues, X's permuted rows) are, G's
    rows loaded for W1 = G·B are read from shared memory."""
    BT, AOP, AIP, BOP, BIP = (a[k] for k in ("BT", "AOP", "AIP", "BOP", "BIP"))
    split = bool(a.get("SPLIT"))
    # (key, M, N, K, A in registers)
    prods = [("W1", BT * AOP, BIP, BOP, False)]
    if dab:
        prods.append(("DA", (2 if split and a["DOT_DA"] else 1) * AOP, AIP, BT * BIP, True))
        prods.append(("V", BT * BIP, AOP, AIP, True))
        if split and a["DOT_DB"]:
            prods.append(("DB", 2 * BIP, BOP, BT * AOP, True))
        else:
            prods.append(("DB", BOP, BIP, BT * AOP, True))
    if dx:
        prods.append(("DX", BT * BIP, AIP, AOP, True))
    for key, m, n, k, a_regs in prods:
        flops = steps * 2.0 * m * n * k
        _prod(w, key, flops, a[f"DOT_{key}"], x16)
        if a[f"DOT_{key}"] and x16:
            _dot16_instr(w, flops, m, n, a_regs)


@kernel("_kron_grad_kernel")
def _m_kron_grad(L) -> Dict[str, float]:
    a = L.bound()
    X, G = a["X"], a["G"]
    x16 = _is16(X)
    T, n_blocks = a["T"], a["n_blocks"]
    w = _work()
    _factor_steps(w, a, float(n_blocks), x16, dx=a["COMPUTE_DX"], dab=a["COMPUTE_DAB"])
    el = _el(X)
    d_in, d_out = a["a_in"] * a["b_in"], a["a_out"] * a["b_out"]
    by = T * d_out * el
    if a["COMPUTE_DX"]:
        by += T * d_in * el
    if a["COMPUTE_DAB"]:
        by += T * d_in * el + a["DAB"].element_size() * L.programs() * (
            a["a_out"] * a["a_in"] + a["b_out"] * a["b_in"])
    w["hbm_bytes"] = by
    return w


@kernel("_kron_narrow_grad_kernel")
def _m_kron_narrow_grad(L) -> Dict[str, float]:
    """Factor gradients for two small factor sides: per block of BT tokens, broadcast
    products on the CUDA cores over the padded small sides (M, N) and the padded big ones
    (BK, BJ) — W (over J), V (over K), dA (over the tokens), dB (over M and the tokens), dX
    (over M) for each of the N columns — in float32 (float64 products for float32 inputs); x,
    dy once, dx once, the per-program partials. The padded lanes count: their products issue."""
    a = L.bound()
    X = a["X"]
    x16 = _is16(X)
    M, N, BT, BK, BJ = (a[k] for k in ("M", "N", "BT", "BK", "BJ"))
    blocks = float(a["n_blocks"])
    per_col = BT * M * BJ                                   # W_l
    if a["COMPUTE_DAB"]:
        per_col += BT * M * BK * 2 + BT * M * BJ            # V_l, dA, dB_l
    if a["COMPUTE_DX"]:
        per_col += BT * M * BK                              # dX_l
    w = _work()
    w["fma64_flops" if not x16 else "fma32_flops"] = blocks * N * per_col * 2.0
    # conversions of the loaded tiles; picking column l of the (BT, N, BK) x tile and of B'ᵀ
    w["alu_ops"] = blocks * (BT * (N * BK + M * BJ) + N * (BT * N * BK + N * BJ))
    el = _el(X)
    T, m, n, K, J = a["T"], a["m"], a["n"], a["K"], a["J"]
    by = T * (m * J + K * n) * el                           # dy, x (read once)
    if a["COMPUTE_DX"]:
        by += T * K * n * el
    if a["COMPUTE_DAB"]:
        by += a["DAB"].element_size() * L.programs() * a["nAB"]
    w["hbm_bytes"] = by
    return w


@kernel("_kron_narrow_tc_kernel")
def _m_kron_narrow_tc(L) -> Dict[str, float]:
    """The narrow factor gradients on the tensor cores (16-bit, no dx): per block of BT tokens
    Wᵀ = B'ᵀ G2ᵀ (16 × BT·M over the J parts) and Vᵀ = R A'ᵀ (BT·N × 16 over the K parts),
    then per part of K and J a token sum with the big side as M (dA'ᵀ: KP × 16 over the BT·N
    rows (t, l); dB': JP × 16 over the BT·M rows (t, i)), A from the shared-memory copy of the
    loaded tile. The padded columns of the 16-wide operands count (their products issue).
    HBM: x and dy once, the per-program partials."""
    a = L.bound()
    X = a["X"]
    x16 = _is16(X)
    M, N, BT = a["M"], a["N"], a["BT"]
    MP, NP = a.get("MP", 16), a.get("NP", 16)
    parts_k = [p for p in (a["K1"], a["K2"]) if p]
    parts_j = [p for p in (a["J1"], a["J2"]) if p]
    steps = float(a["n_blocks"])
    w = _work()
    prods = [(NP, BT * M, p, True) for p in parts_j]              # Wᵀ (mma.sync)
    prods += [(BT * N, MP, p, True) for p in parts_k]             # Vᵀ
    prods += [(p, MP, BT * N, False) for p in parts_k]            # dA'ᵀ
    prods += [(p, NP, BT * M, False) for p in parts_j]            # dB'
    for m_, n_, k_, a_regs in prods:
        flops = steps * 2.0 * m_ * n_ * k_
        _prod(w, "TC", flops, True, x16)
        if x16:
            _dot16_instr(w, flops, m_, n_, a_regs)
    # W and V to their (t, ·) rows and padded operands: a few passes over those tiles
    w["alu_ops"] = steps * 6.0 * (NP * BT * M + MP * BT * N)
    T, m, n, K, J = a["T"], a["m"], a["n"], a["K"], a["J"]
    w["hbm_bytes"] = (T * (m * J + K * n) * _el(X)
                      + a["DAB"].element_size() * L.programs() * a["nAB"])
    return w


@kernel("_kron_dx_grad_kernel")
def _m_kron_dx_grad(L) -> Dict[str, float]:
    """The folded backward in one pass: a (BM × BN) tile of dx = dy W' per program (K = d_out
    padded to BK; tensor cores), then factor steps over its slice of the row block's tokens
    (every token once in all). HBM: dy once (the factor steps re-read their rows from L2:
    the row block's GEMM tiles have just streamed them), W' once per group of row blocks
    (L2 rule), x once (factor steps), dx once, the per-program partials."""
    a = L.bound()
    X, G, WF = a["X"], a["G"], a["WF"]
    x16 = _is16(X)
    T, BM, BN, BK, GM = a["T"], a["BM"], a["BN"], a["BK"], a["GROUP_M"]
    d_in, d_out = a["a_in"] * a["b_in"], a["a_out"] * a["b_out"]
    n_m, n_n = cdiv(T, BM), cdiv(d_in, BN)
    P = n_m * n_n
    w = _work()
    _prod(w, "GEMM", P * 2.0 * BM * BN * _k_pad(d_out, BK), True, x16)
    tok, BT = a["tok_per_prog"], a["BT"]
    steps = sum(cdiv(max(0, min(tok, BM - n * tok)), BT) for n in range(n_n)) * n_m
    _factor_steps(w, a, float(steps), x16)
    w["alu_ops"] += P * BM * BN                                    # convert on store
    el = _el(X)
    w["hbm_bytes"] = (T * d_out * el + R.reread_bytes(WF.numel() * _el(WF), cdiv(n_m, GM))
                      + T * d_in * el + T * d_in * el
                      + a["DAB"].element_size() * P * (a["a_out"] * a["a_in"]
                                                       + a["b_out"] * a["b_in"]))
    return w


@kernel("_sum_partials_kernel")
def _m_sum_partials(L) -> Dict[str, float]:
    """dA, dB from the factor kernels' per-program partials: every partial read once (rows
    padded to BR per program), one add per element, the totals converted and written once."""
    a = L.bound()
    P = a["DAB"]
    rows, cols = a["n_rows"], a["n_cols"]
    w = _work()
    w["alu_ops"] = L.programs() * cdiv(rows, a["BR"]) * a["BR"] * a["BC"] * 2
    w["hbm_bytes"] = rows * cols * _el(P) + a["n_a"] * _el(a["DA"]) + (cols - a["n_a"]) * _el(
        a["DB"])
    return w


@kernel("_kron_fold_kernel")
def _m_kron_fold(L) -> Dict[str, float]:
    """W' = W + s·A⊗B: one (BO × BC) tile per program, element-wise on the CUDA cores (the
    A and B gathers are L1/L2 hits: the factors are a few KB). Per element: two conversions,
    s·(a·b) (2 multiplies), + w, one conversion on store."""
    a = L.bound()
    A, OUT = a["A"], a["OUT"]
    d_out, d_in = a["d_out"], a["d_in"]
    elems = L.programs() * a["BO"] * a["BC"]                # padded tiles: every lane issues
    w = _work()
    w["alu_ops"] = elems * (6 if a["HAS_W"] else 4)
    w["hbm_bytes"] = (d_out * d_in * (_el(a["W"]) if a["HAS_W"] else 0)   # W once
                      + d_out * d_in * _el(OUT)                            # W' once
                      + A.numel() * _el(A) + a["B"].numel() * _el(a["B"]))
    return w


@kernel("_oproj_fold_kernel")
def _m_oproj_fold(L) -> Dict[str, float]:
    """W' = W + Bc·Do (headwise_oproj, exact=False): one (BN × BK) tile of W' per program,
    cdiv(M, BR) tensor-core dots (BN × BR)·(BR × BK) (M padded to BR; programs of the
    appended rows / columns issue them too, masked); the W tile converted and added, W'
    converted on store. APPEND 1 / 2: Do's rows / Bc's columns copied after W' (read once
    more, written once); APPEND 3: both (and an M × M corner of zeros written). HBM: W read
    and W' written once; Bc re-read by every column program and Do by every row program (L2
    rule of reread_bytes)."""
    a = L.bound()
    N, HP, M = a["N"], a["HP"], a["M"]
    BN, BK, BR = a["BN"], a["BK"], a["BR"]
    progs = L.programs()
    w = _work()
    _prod(w, "fold", progs * 2.0 * BN * BK * cdiv(M, BR) * BR, True, _is16(a["do_ptr"]))
    w["alu_ops"] = progs * BN * BK * 3
    el = _el(a["out_ptr"])
    mode = a.get("APPEND", 0)
    appended = ((2 * M * HP * el if mode in (1, 3) else 0)
                + (2 * M * N * el if mode in (2, 3) else 0) + (M * M * el if mode == 3 else 0))
    w["hbm_bytes"] = (N * HP * (_el(a["w_ptr"]) + el) + R.reread_bytes(N * M * el, cdiv(HP, BK))
                      + R.reread_bytes(M * HP * el, cdiv(N, BN)) + appended)
    return w


@kernel("_qkv_fold_kernel")
def _m_qkv_fold(L) -> Dict[str, float]:
    """W' = [W_q + U_q·D_q; W_k; W_v + U_v·D_v] (headwise_qkv folded): one (BN × BK) tile of
    W' per program; adapted tiles issue one (BN × RB)·(RB × BK) tensor-core dot (two with a
    scaled shared part); W converted and added, W' converted on store; BIAS: the first
    column programs also form b' (U·zb, a row sum per slot). HBM: W read and W' written
    once, each tile's U re-read by its column programs (L2 rule), D once."""
    a = L.bound()
    K, BN, BK = a["K"], a["BN"], a["BK"]
    kb = L.grid[1]
    w = _work()
    out_el = _el(a["out_ptr"])
    w["hbm_bytes"] = 0.0
    La, Lk = a["a_L"], a["k_L"]
    secs = [("a_", "A_", La), ("k_", "K_", Lk), ("b_", "B_", L.grid[0] - La - Lk)]
    for pre, cpre, Lt in secs:
        if Lt <= 0:
            continue
        N = a[pre + "N"]
        w["alu_ops"] += Lt * kb * BN * BK * 3
        w["hbm_bytes"] += N * K * (_el(a[pre + "w"]) + out_el)
        if a.get(cpre + "LR"):
            RB, W = a[cpre + "RB"], a[pre + "W"]
            dots = 2 if a.get(cpre + "SH_SCALE") else 1
            _prod(w, "fold", Lt * kb * dots * 2.0 * BN * RB * BK, True, _is16(a[pre + "d"]))
            w["hbm_bytes"] += (R.reread_bytes(Lt * W * BN * out_el, kb)
                               + Lt * W * K * out_el)
            if a["BIAS"]:
                w["alu_ops"] += Lt * BN * RB * 2
        if a["BIAS"]:
            w["hbm_bytes"] += N * out_el * 2
    return w


def _k_pad(K: int, BK: int) -> int:
    return cdiv(K, BK) * BK if K > 0 else 0


@kernel("_gemm_kernel")
def _m_hw_gemm(L) -> Dict[str, float]:
    """headwise's augmented GEMM C = Σ_i A_i B_i (+ bias) (+ packed low-rank epilogue), or
    its split-K mode (float32 partials). Products: tl.dot on (BM × BK)·(BK × BN) tiles, K
    padded to BK per segment (masked lanes still issue); the LR epilogue adds the (BM × BK)·
    (BK × RB) down-projection in segment 0's K loop and the (BM × RB)·(RB × BN) up-projection
    (RB: the computed block; D, zb, U and the stored Z hold LR_W <= RB slots per tile).
    16-bit operands: tensor cores; float32 ("ieee"): CUDA-core FMA.

    HBM: the grid runs in grouped order (GROUP row blocks walk every column tile before the
    next group starts), so a group's A rows stay in L2 while its column tiles pass (A read
    once if GROUP·BM rows of every segment fit in L2_RESIDENT) and B is read once per group
    of row blocks (the L2 rule decides whether those passes hit L2)."""
    a = L.bound()
    A0 = a["a0_ptr"]
    x16 = _is16(A0)
    el = _el(A0)
    M, N, BM, BN, BK, RB = a["M"], a["N"], a["BM"], a["BN"], a["BK"], a["RB"]
    GROUP = a.get("GROUP", 8)
    n_m, n_n = cdiv(M, BM), cdiv(N, BN)
    P = n_m * n_n
    w = _work()
    unit = "dot16_flops" if x16 else "fma32_flops"
    C = a["c_ptr"]
    if a["SPLIT"]:
        S, K0, K_PER = L.grid[1], a["K0"], a["K_PER"]
        kp = sum(_k_pad(max(0, min(K_PER, K0 - s * K_PER)), BK) for s in range(S))
        w[unit] += P * 2.0 * BM * BN * kp
        w["alu_ops"] += P * S * BM * BN                        # float32 store of the partials
        b_el = _el(a["b0_ptr"])
        w["hbm_bytes"] = (R.reread_bytes(M * K0 * el, n_n) + R.reread_bytes(K0 * N * b_el, n_m)
                          + S * M * N * 4)
        return w
    segs = [(a[f"a{i}_ptr"], a[f"b{i}_ptr"], a[f"K{i}"]) for i in range(a["NSEG"])]
    ksum = sum(K for _, _, K in segs)
    for _, _, K in segs:
        w[unit] += P * 2.0 * BM * BN * _k_pad(K, BK)
    a_bytes = sum(M * K * _el(A) for A, _, K in segs)
    b_bytes = sum(K * N * _el(B) for _, B, K in segs)
    group_rows = GROUP * BM * ksum * el
    by = (a_bytes if group_rows <= R.L2_RESIDENT else R.reread_bytes(a_bytes, n_n))
    by += R.reread_bytes(b_bytes, cdiv(n_m, GROUP))
    if a["LR"]:
        K0 = a["K0"]
        w[unit] += P * 2.0 * BM * RB * _k_pad(K0, BK)          # Z_l = A_0 D_lᵀ (packed rows)
        w[unit] += P * 2.0 * BM * RB * BN                      # + Z_l U_l (epilogue)
        w["alu_ops"] += P * BM * RB * 2                        # + zb, round to the input dtype
        D = a["d_ptr"]
        by += (R.reread_bytes(D.numel() * _el(D), cdiv(n_m, GROUP))   # D_l per row group
               + M * n_n * a["LR_W"] * el                              # Z stored
               + a["u_ptr"].numel() * _el(a["u_ptr"]) + a["zb_ptr"].numel() * 4)
    nb = a.get("N1", N) if a.get("OUT2") else N           # OUT2: biases on [0, N1) only
    if a["HAS_BIAS"]:
        by += nb * _el(a["bias_ptr"])
        if a.get("HAS_BIAS2"):
            by += nb * _el(a["bias2_ptr"])
    w["alu_ops"] += P * BM * BN * (2 if a["HAS_BIAS"] else 1)  # (+ bias), convert on store
    if a.get("COLSUM"):                    # column sums of A_0 (the first column tile)
        w["alu_ops"] += M * a["K0"]
        by += cdiv(M, a["CS_BM"]) * a["K0"] * 4
    by += M * N * _el(C)                   # OUT2: the last N − N1 columns go to c2
    w["hbm_bytes"] = by
    return w


@kernel("_lr_rank_bwd_kernel")
def _m_hw_lr_rank_bwd(L) -> Dict[str, float]:
    """One pass over the output gradient of up to two packed sections (a, then b: tiles
    [0, a_L) and [a_L, grid[0])): per token block dZ_l = dY_l U_lᵀ (BT × BN)·(BN × RB) and
    Z_lᵀ dY_l (RB × BT)·(BT × BN), column sums of dZ and dY; float32 partials per token
    split (S shared). Token blocks padded to BT per split. Z and dZ hold W <= RB slots per
    tile (the products run on RB-wide blocks, the slots past W masked). 16-bit products by
    their instruction (:func:`_dot16_instr`; the sm_90 TTGIR of the GPT-2 q|k|v launch: dZ
    a wgmma with A (dY rows) in shared memory, N = RB; Z_lᵀ dY_l a wgmma with A in registers
    at RB = 64, mma.sync at RB = 32)."""
    a = L.bound()
    T, T_PER, BT, BN = a["T"], a["T_PER"], a["BT"], a["BN"]
    S = L.grid[1]
    tp = sum(_k_pad(max(0, min(T_PER, T - s * T_PER)), BT) for s in range(S))
    w = _work()
    w["hbm_bytes"] = 0.0
    secs = [("a_", "A_", a["a_L"])]
    if L.grid[0] > a["a_L"]:
        secs.append(("b_", "B_", L.grid[0] - a["a_L"]))
    for pre, cpre, Lt in secs:
        g = a[pre + "g"]
        x16 = _is16(g)
        el = _el(g)
        N, RB, W = a[pre + "N"], a[cpre + "RB"], a[pre + "W"]
        unit = "dot16_flops" if x16 else "fma32_flops"
        prod = Lt * 2.0 * tp * BN * RB
        w[unit] += 2 * prod                                         # dZ and dU products
        if x16:
            _dot16_instr(w, prod, BT, RB, False)                    # dZ = dY Uᵀ
            _dot16_instr(w, prod, RB, BN, True)                     # dU = Zᵀ dY
        if a.get(cpre + "SH_SCALE"):
            w[unit] += prod                                         # dZ of round(s·dY) (shared)
            if x16:
                _dot16_instr(w, prod, BT, RB, True)
            w["alu_ops"] += Lt * tp * BN * 2                        # s·dY, round
        if a.get(cpre + "ONES") and not a.get(cpre + "SH_SCALE"):
            w["alu_ops"] += Lt * tp * RB                            # round dZ (Σ dY in the dot)
        else:
            w["alu_ops"] += Lt * tp * (RB * 2 + BN * 2)             # Σ dZ, round dZ; Σ dY (+cvt)
        w["hbm_bytes"] += (T * N * el                               # dY once (own columns)
                           + T * Lt * W * _el(a[pre + "z"])         # Z read
                           + T * Lt * W * _el(a[pre + "dz"])        # dZ written
                           + a[pre + "u"].numel() * _el(a[pre + "u"])
                           + S * (Lt * RB * BN + Lt * RB + N) * 4)  # float32 partials
    return w


@kernel("_hw_lowrank_fwd_kernel")
def _m_hw_lowrank_fwd(L) -> Dict[str, float]:
    """headwise_lowrank forward, grid (T blocks, H): Z = basis·A_hᵀ over d_b in BK chunks
    (tensor cores for 16-bit tiles ≥ 16), out = Z B_hᵀ in float32 IEEE on the CUDA cores in
    every dtype (no split-operand tensor-core product: kfused/triton_kernels/_common.py), Z
    written as float32 for the backward. A shared basis is read by every head: HBM once when
    it fits in L2."""
    a = L.bound()
    x = a["x_ptr"]
    x16, el = _is16(x), _el(x)
    T, H, DB, P, Rk = a["T"], a["H"], a["DB"], a["P"], a["R"]
    BT, BK, PB, RB = a["BT"], a["BK"], a["PB"], a["RB"]
    tp = cdiv(T, BT) * BT
    w = _work()
    _prod(w, "down", H * 2.0 * tp * cdiv(DB, BK) * BK * RB, a["DOT_DOWN"], x16)
    _prod(w, "up", H * 2.0 * tp * RB * PB, a["DOT_UP"], False)       # float32 operands
    shared = a["s_xh"] == 0
    w["hbm_bytes"] = ((R.reread_bytes(T * DB * el, H) if shared else T * H * DB * el)
                      + a["a_ptr"].numel() * el + T * H * (Rk * 4 + P * _el(a["out_ptr"])))
    return w


@kernel("_hw_lowrank_bwd_kernel")
def _m_hw_lowrank_bwd(L) -> Dict[str, float]:
    """headwise_lowrank backward, grid (T blocks, d_b blocks, heads or 1): per head dZ = g_h B_h
    and dbasis += dZ A_h, both float32 IEEE on the CUDA cores in every dtype (the 16-bit
    tensor-core forms failed on the H200: kfused/triton_kernels/_common.py); g is re-read by
    every d_b block (L2), dZ written by the first."""
    a = L.bound()
    g = a["g_ptr"]
    el = _el(g)
    T, H, DB, P, Rk = a["T"], a["H"], a["DB"], a["P"], a["R"]
    BT, BD, PB, RB = a["BT"], a["BD"], a["PB"], a["RB"]
    hpp = a["HEADS_PER_PROG"]
    tb, db_blocks, nh = L.grid
    heads = nh * hpp
    tp = tb * BT
    w = _work()
    _prod(w, "dz", db_blocks * heads * 2.0 * tp * PB * RB, a["DOT_G"], False)   # float32
    _prod(w, "dx", db_blocks * heads * 2.0 * tp * RB * BD, a["DOT_A"], False)   # operands
    w["alu_ops"] += db_blocks * heads * tp * PB                       # g -> float32
    w["hbm_bytes"] = (R.reread_bytes(T * H * P * el, db_blocks) + T * H * Rk * 4
                      + T * nh * DB * _el(a["dx_ptr"]))
    return w


@kernel("_atb_kernel")
def _m_atb(L) -> Dict[str, float]:
    """Batched token reduction C[b] = A[b]ᵀ B[b]: TC (every operand 16-bit) on the tensor
    cores; else (a float32 operand) float32 IEEE dots on the CUDA cores."""
    a = L.bound()
    A, B = a["a_ptr"], a["b_ptr"]
    T, M, N, N2, NB = a["T"], a["M"], a["N"], a["N2"], a["NB"]
    BT, BM, BN, BN2 = a["BT"], a["BM"], a["BN"], a["BN2"]
    S = L.grid[1]
    Tp = S * cdiv(a["T_PER"], BT) * BT
    progs0 = L.grid[0]
    w = _work()
    cols = BN + (BN2 if a["HAS_B2"] else 0)
    flops = progs0 * 2.0 * Tp * BM * cols
    if a.get("TC"):
        w["dot16_flops"] += flops
    else:
        w["fma32_flops"] += flops                                      # float32 IEEE dots
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


def _spans(L, a, heads_of_grid: int) -> List[Tuple[int, int, int, int]]:
    """``(programs' heads, n_q, n_k, causal offset)`` groups of one attention launch: one group
    of every (batch, head) for a batched launch, one per sequence (its true lengths, the
    cumulative lengths read from the traced launch) for a packed one (VARLEN)."""
    if not a.get("VARLEN"):
        return [(L.grid[1], a["N_Q"], a["N_K"], a["causal_off"])]
    cq = a["CU_Q"].tolist()
    ck = a["CU_K"].tolist() if not a.get("IS_PREFIX") else None
    out = []
    for b in range(len(cq) - 1):
        nq = cq[b + 1] - cq[b]
        nk = a["N_K"] if ck is None else ck[b + 1] - ck[b]
        out.append((heads_of_grid, nq, nk, nk - nq))
    return out


def _live_programs(spans, BM: int) -> int:
    """Query-tile programs that have rows: the whole grid for a batched launch; for a packed
    one (VARLEN) each sequence's cdiv(n_q, BM) tiles, since a tile past its sequence's end
    returns at once."""
    return sum(c * cdiv(nq, BM) for c, nq, _, _ in spans)


def _attn_common(a):
    q = a["Q"]
    return q, _is16(q), a["BLOCK_M"], a["BLOCK_N"], a["D_PAD"], bool(a["CAUSAL"])


def _flash(w: Dict[str, float], flops: float, x16: bool) -> None:
    """Products of a flash loop (S = QKᵀ, PV, dP, dS·K, ...): tensor cores for 16-bit (the
    rate of the instruction in the SASS: the Triton-tutorial forward at this rate is within
    3 % of its H100 measurement, see grounding.py), IEEE FMA for float32. Their wgmma
    operand feed is read from the kernel's SASS (``dot16_feed_from_sass``): the instruction
    shapes follow the tile and the warps (the H200 of 2026-11-30 ran the p = 128 kernels,
    whose 64-row tiles on 8 warps issued m64n32 / m64n16 wgmma for S and dP, at 1.3-2.7x a
    prediction that assumed the tile's own N)."""
    w["dot16_flops" if x16 else "fma32_flops"] += flops
    w["dot16_feed_from_sass"] = 1.0


def _mlp_units(programs: float, BM: int, DP: int, width: int, n: int,
               w: Dict[str, float]) -> None:
    """``n`` MLP products of a (BM × DP)·(DP × width) shape (or its transposes) per program,
    float32 FMA dots in every dtype (kfused/triton_kernels/inducer_attention.py: the 16-bit
    tensor-core form faulted on an H100 under Triton 3.6)."""
    _prod(w, "MLP", programs * n * 2.0 * BM * DP * width, True, False)


@kernel("_inducer_attn_fwd_kernel")
def _m_ind_fwd(L) -> Dict[str, float]:
    """Per query tile: prologue q·Ak, q·Bkᵀ (the virtual key's logit, L padded to L_PAD), the
    online softmax in base 2 over the visited key tiles (causal: tiles above the diagonal are
    skipped, see _attn_tiles), epilogue λ, 1 − λ and u = λ tanh(q W1 + b1) (R_PAD). MLP_ROWS
    (prefill): s0 and the hidden units are read from the MLP-rows kernel's float32 rows
    (:func:`_m_ind_fwd_mlp`), no MLP product here.

    SPLIT_KV (decode, one launch): grid (key chunks, B·H_kv); each program runs S = QKᵀ and PV
    over its chunk's key tiles for the SPLIT_M GQA-packed rows of its kv head (the cache read
    once per kv head) and writes a float32 partial (acc, m, l); the last chunk of each kv head
    merges the partials for the packed rows at once, then runs the prologue, prefix and
    epilogue of its GROUP query heads from the merged slot. That merge runs after the
    kernel's last wave, one program per kv head: ``tail_s``."""
    a = L.bound()
    q, x16, BM, BN, DP, causal = _attn_common(a)
    n_q, n_k = a["N_Q"], a["N_K"]
    split = bool(a.get("SPLIT_KV", False))
    el = _el(q)
    w = _work()
    if split:
        splits, BHkv = L.grid[0], L.grid[1]
        heads = BHkv * a["GROUP"]
        progs = heads * cdiv(n_q, BM)
        spans = [(heads, n_q, n_k, a["causal_off"])]
        SM, chunk = a["SPLIT_M"], a["CHUNK"]
        ctiles = BHkv * sum(cdiv(max(0, min(chunk, n_k - s * chunk)), BN) for s in range(splits))
        _flash(w, ctiles * 2 * 2.0 * SM * BN * DP, x16)
        w["sfu_ops"] += ctiles * SM * BN
        w["alu_ops"] += ctiles * (SM * BN * 8 + SM * DP)
    else:
        spans = _spans(L, a, a["H"])
        progs = _live_programs(spans, BM)
    tiles = sum(c * ((0 if split else _attn_tiles(nq, nk, BM, BN, causal, off))
                     + (cdiv(a["N_PREFIX"], BN) * cdiv(nq, BM) if a["HAS_PREFIX"] else 0))
                for c, nq, nk, off in spans)
    _flash(w, tiles * 2 * 2.0 * BM * BN * DP, x16)                  # S = QKᵀ, PV
    w["sfu_ops"] += tiles * BM * BN                                  # exp2 per score
    w["alu_ops"] += tiles * (BM * BN * 8 + BM * DP)                  # scale, mask, max, sub,
    merge_alu = 0.0                                                  # sum, cvt; acc rescale
    mlp_rows = bool(a.get("MLP_ROWS", False))
    if a["HAS_MLP"] and mlp_rows:          # s0 and the hidden units read from MROWS
        w["sfu_ops"] += progs * BM * 4                               # σ twice
        merge_alu = progs * BM * (a["R_PAD"] + 16)                   # σ, u
        w["alu_ops"] += merge_alu
    elif a["HAS_MLP"]:
        LP, RP = a["L_PAD"], a["R_PAD"]
        _mlp_units(progs, BM, DP, LP, 2, w)                     # q Ak, q Bkᵀ
        _mlp_units(progs, BM, DP, RP, 1, w)                     # q W1
        w["sfu_ops"] += progs * BM * (2 * (LP + RP) + 4)             # tanh (ex2+rcp), σ twice
        merge_alu = progs * BM * (3 * DP + 4 * (LP + RP) + 16)       # logit dot, σ, u
        w["alu_ops"] += merge_alu
    p = a["HEAD_DIM"]
    kv = a["K"].numel() * el * 2
    per_head_kv = n_k * p * el * 2
    u = a["U"]
    out_bytes = (q.numel() * el * (3 if a["SAVE_LO"] else 2)         # q, O (+ O_lo)
                 + a["N_ROWS"] * 4 * 5                               # lse, stats ×2, λ ×2
                 + (u.numel() * _el(u) if a["HAS_MLP"] else 0)
                 + (a["N_ROWS"] * (a["R"] + 1) * 4 if a["HAS_MLP"] and mlp_rows else 0))
    w["hbm_bytes"] = out_bytes
    if split:
        row = (DP + 2) * 4
        merges = 1 if splits > 1 else 0                              # one chunk: no merge
        written = (splits + merges) * BHkv * a["GROUP"] * n_q * row  # the chunks' partials,
        # then the merged slot 0, real rows only (GROUP·n_q per kv head, not SPLIT_M); the
        # last chunk reads each slot's real rows once, then each query head its rows of slot 0
        read = (merges * BHkv * splits * a["GROUP"] * n_q * row + heads * n_q * row)
        w["hbm_bytes"] += q.numel() * el + kv + written + read
        m_alu = (merges * BHkv * splits * SM + heads * BM) * (3 * DP + 8)
        w["alu_ops"] += m_alu
        # the merge of one kv head, serial after the last wave: its partials through one
        # SM's share of L2 bandwidth, its element-wise work at one SM's ALU rate, plus the
        # prologue/epilogue products of its GROUP heads at one SM's tensor rate
        per_kv = 1.0 / BHkv
        w["tail_s"] = (read * per_kv / (R.L2_BW / R.SMS)
                       + (m_alu + merge_alu) * per_kv / (R.ALU32_RATE / R.SMS)
                       + out_bytes * per_kv / (R.L2_BW / R.SMS))
    elif a.get("VARLEN"):                                            # each sequence's K, V
        Hkv = a["H"] // a["GROUP"]
        w["hbm_bytes"] += sum(R.reread_bytes(Hkv * nk * p * el * 2, 1 if nk * p * el * 2
                                             <= R.L2_RESIDENT else cdiv(nq, BM))
                              for _, nq, nk, _ in spans)
    else:
        w["hbm_bytes"] += R.reread_bytes(kv, 1 if per_head_kv <= R.L2_RESIDENT
                                         else cdiv(n_q, BM))
    return w


def _mlp_row_steps(L, a) -> Tuple[int, int]:
    """(rows, BLOCK_M-row steps) of an MLP-rows launch: each program takes CHUNK rows of one
    head's sequence in BLOCK_M-row steps (the last step of a chunk may be partial)."""
    if a.get("VARLEN"):
        cq = a["CU_Q"].tolist()
        lens = [cq[b + 1] - cq[b] for b in range(len(cq) - 1)]
    else:
        lens = [a["N_Q"]] * (L.grid[1] // a["H"])
    chunk, BM = a["CHUNK"], a["BLOCK_M"]
    steps = a["H"] * sum(cdiv(min(chunk, n - c * chunk), BM) for n in lens
                         for c in range(cdiv(n, chunk)))
    return a["H"] * sum(lens), steps


# Issue cost of the MLP-rows kernels where they work one MLP unit at a time (a unit: one
# column of Ak, one row of Bk or one column of W1; its row sum against the q tile, its tanh
# and, in the backward, its slope, its outer-product update of the dq share and its column sum
# for the parameter gradient), in lane-instructions per row, {element bytes of q: {D_PAD:
# (fixed, key unit, value unit)}}. Read from the sm_90 SASS of these kernels compiled here
# with the launch configurations of _mlp_rows_config (Triton 3.6.0 as on the GPU machine):
# each loop body's instruction count per BLOCK_M-row step and warp, times 32 lanes, over the
# step's rows per warp (key-unit loop once per L, value-unit loop once per r; Triton 3.9
# within 10 %). The count includes the float32 products (FFMA), the warp-shuffle trees of the
# row and column sums, the tanh and slope evaluated on every lane that holds the row (8 at
# p = 64 in 16-bit), the weight loads and the stores: all of it issues on the SM's four
# schedulers, so it is charged at the element-wise rate (ALU32_RATE, one lane-instruction per
# lane-clock). The forward works this way for float32 q only (16-bit: tensor cores, below).
_MLP_FWD_ISSUE = {4: {64: (512, 812, 618), 128: (1112, 1776, 1292)}}
_MLP_BWD_ISSUE = {2: {64: (1042, 1290, 852), 128: (2456, 3960, 2520)},
                  4: {64: (898, 1658, 1246), 128: (2352, 4168, 3120)}}


def _mlp_issue(table, d_pad, el=None):
    t = table if el is None else table.get(el, table[max(table)])
    return t[64] if d_pad <= 64 else t[128]


# The tensor-core forward (TC: 16-bit q; three 16-bit dots q Ak, q Bkᵀ, q W1 padded to
# L_TC, R_TC ≥ 16 columns, then tanh and the logit on the accumulator tiles): its step loop's
# instructions per row, counted as above (64-row steps on 4 warps; Triton 3.9 within 9 %),
# {D_PAD: lane-instructions per row}; the dots at the wgmma rate on top.
_MLP_FWD_TC_ISSUE = {64: 1400, 128: 1746}


@kernel("_inducer_fwd_mlp_kernel")
def _m_ind_fwd_mlp(L) -> Dict[str, float]:
    """The forward's inducer rows (prefill), before the attention kernel: the virtual key's
    logit and the hidden units written as float32 rows of 1 + r. TC (16-bit): three
    tensor-core dots per BLOCK_M-row step (:data:`_MLP_FWD_TC_ISSUE`). Otherwise (float32)
    one MLP unit at a time: per row the L key units (q·Ak_l, q·Bk_l, tanh) and the r value
    units (q·W1_j, tanh), each a row sum over the q tile (:data:`_MLP_FWD_ISSUE`; the two
    MUFU ops of each tanh on every lane of the row at the SFU rate too)."""
    a = L.bound()
    q = a["Q"]
    rows, steps = _mlp_row_steps(L, a)
    w = _work()
    w["hbm_bytes"] = rows * (a["HEAD_DIM"] * _el(q) + (a["R"] + 1) * 4)
    if a.get("TC"):
        BM, DP, LT, RT = a["BLOCK_M"], a["D_PAD"], a["L_TC"], a["R_TC"]
        fl = steps * 2.0 * BM * DP * (2 * LT + RT)
        _prod(w, "MLP", fl, True, True)
        _dot16_instr(w, fl, BM, max(LT, RT), False)                 # N = 16: a starved feed
        w["alu_ops"] = rows * _mlp_issue(_MLP_FWD_TC_ISSUE, DP)
        w["sfu_ops"] = rows * 2 * (LT + RT)
        return w
    fixed, key, val = _mlp_issue(_MLP_FWD_ISSUE, a["D_PAD"], _el(q))
    lanes = max(1, a["D_PAD"] // (16 // _el(q)))                  # lanes holding a row
    w["alu_ops"] = rows * (fixed + a["L"] * key + a["R"] * val)
    w["sfu_ops"] = rows * lanes * 2 * (a["L"] + a["R"])
    return w


# The tensor-core backward (TC, 16-bit: kfused/triton_kernels/inducer_attention.py
# _mlp_bwd_rows_tc): its step loop's lane-instructions per row, {(WHAT, D_PAD): count}, read
# from the sm_90 SASS (Triton 3.6, the GPU machine's; 3.9 within 8 %): p = 64 one launch (64-row
# steps, 4 warps), p = 128 two (the dq share on 64-row steps, the parameter partials on 32).
_MLP_BWD_TC_ISSUE = {(3, 64): 3226, (1, 128): 3030, (2, 128): 5164}


def _m_ind_mlp_tc(L, a, rows: int, steps: int) -> Dict[str, float]:
    """The tensor-core backward's products per BLOCK_M-row step: the MLP rows recomputed (q Ak,
    q Bkᵀ, and q W1 with du), then for WHAT & 1 the dq share's (cg Bk, dz Akᵀ, dz1 W1ᵀ) and
    for WHAT & 2 the parameter gradients' (qᵀ dz, qᵀ cg, qᵀ dz1), each 2·BM·D_PAD·16 FLOPs
    (L_TC, R_TC columns); their wgmma feed from the SASS (N = 16 products); the rest of the
    step by the issue table :data:`_MLP_BWD_TC_ISSUE`."""
    BM, DP, LT, RT = a["BLOCK_M"], a["D_PAD"], a["L_TC"], a["R_TC"]
    what, du = a.get("WHAT", 3), bool(a["HAS_DU"])
    per_group = 2 * LT + (RT if du else 0)              # columns of one group of products
    groups = 1 + (1 if what & 1 else 0) + (1 if what & 2 else 0)
    w = _work()
    _prod(w, "MLP", steps * 2.0 * BM * DP * per_group * groups, True, True)
    w["dot16_feed_from_sass"] = 1.0
    w["alu_ops"] = rows * _MLP_BWD_TC_ISSUE.get((what, max(64, DP)),
                                                _MLP_BWD_TC_ISSUE[(3, 64)])
    w["sfu_ops"] = rows * 2 * (LT + (RT if du else 0))               # tanh: ex2 + rcp
    w["hbm_bytes"] = _mlp_bwd_bytes(L, a, rows, bool(what & 1), bool(what & 2))
    return w


def _mlp_bwd_bytes(L, a, rows: int, dq: bool, params: bool) -> float:
    """HBM bytes of an MLP-rows backward launch: q, λ and 1 − λ, the row gradients it reads
    (du, dλ, dlse), and what it writes: the dq share and ADJ (``dq``), the programs'
    parameter partials (``params``)."""
    pL, pR, hd = a["L"], a["R"], a["HEAD_DIM"]
    by = rows * hd * _el(a["Q"]) + rows * 4 * 2                      # q; λ ×2
    if dq:
        by += rows * (hd + 1) * 4                                    # DQM, ADJ
    if params:
        by += L.programs() * (2 * hd * pL + hd * pR + hd + pL + pR) * 4      # unpadded
    if a["HAS_DU"]:
        by += rows * pR * _el(a["DU"])
    if a["HAS_DLAM"]:
        by += rows * 4 * 2
    if a["HAS_DLSE"]:
        by += rows * 4
    return by


@kernel("_inducer_attn_bwd_mlp_kernel")
def _m_ind_mlp(L) -> Dict[str, float]:
    """The backward's inducer rows, before the dQ kernel: per row, the r value units (q·W1_j,
    tanh and slope, dλ, the unit's dq outer product, the column sum of q·dz1_j for dW1) and
    the L key units (q·Ak_l, q·Bk_l, tanh and slope, two dq outer products, two column sums
    for dAk and dBk), −dLSE and the MLP's float32 share of dq written; the parameter partials
    accumulated over a program's CHUNK rows and written once per program. Issue-bound
    (:data:`_MLP_BWD_ISSUE`, four MUFU ops per unit on every lane of the row)."""
    a = L.bound()
    q = a["Q"]
    rows, steps = _mlp_row_steps(L, a)
    if a.get("TC"):
        return _m_ind_mlp_tc(L, a, rows, steps)
    fixed, key, val = _mlp_issue(_MLP_BWD_ISSUE, a["D_PAD"], _el(q))
    units_v = a["R"] if a["HAS_DU"] else 0
    lanes = max(1, a["D_PAD"] // (16 // _el(q)))
    w = _work()
    w["alu_ops"] = rows * (fixed + a["L"] * key + units_v * val)
    w["sfu_ops"] = rows * lanes * 4 * (a["L"] + units_v)
    w["hbm_bytes"] = _mlp_bwd_bytes(L, a, rows, True, True)
    return w


@kernel("_inducer_attn_bwd_dq_kernel")
def _m_ind_dq(L) -> Dict[str, float]:
    """Per query tile: 16-bit D_i = ⟨dO, O_hi + O_lo⟩, then per visited key tile S = QKᵀ,
    dP = dO Vᵀ, dQ += dS K (3 products; float32 EXACT_DELTA: a first pass forming D_i from P
    and dP adds 2 more); with an inducer, −dLSE and the MLP's float32 share of dq are read
    (written by the MLP kernel, :func:`_m_ind_mlp`)."""
    a = L.bound()
    q, x16, BM, BN, DP, causal = _attn_common(a)
    spans = _spans(L, a, a["H"])
    tiles = sum(c * (_attn_tiles(nq, nk, BM, BN, causal, off)
                     + (cdiv(a["N_PREFIX"], BN) * cdiv(nq, BM) if a["HAS_PREFIX"] else 0))
                for c, nq, nk, off in spans)
    passes = 1.0 + (2.0 / 3.0 if a["EXACT_DELTA"] else 0.0)
    w = _work()
    _flash(w, tiles * passes * 3 * 2.0 * BM * BN * DP, x16)
    w["sfu_ops"] = tiles * BM * BN * (2 if a["EXACT_DELTA"] else 1)
    w["alu_ops"] = tiles * BM * BN * 8 * passes
    el = _el(q)
    by = q.numel() * el * 3 + a["K"].numel() * el * 2 + a["N_ROWS"] * 4 * 4
    if not a["EXACT_DELTA"]:                                         # O (+ O_lo) for D_i
        by += q.numel() * el * (2 if a["HAS_LO"] else 1)
    if a["HAS_MLP"]:
        by += a["N_ROWS"] * a["HEAD_DIM"] * 4                        # the MLP's dq share
    w["hbm_bytes"] = by
    return w


@kernel("_inducer_attn_bwd_dkdv_kernel")
def _m_ind_dkdv(L) -> Dict[str, float]:
    """Per key tile, over every query tile that sees it (causal: from the diagonal on) of each
    query head of its kv head: S, dV += Pᵀ dO, dP, dK += dSᵀ Q (4 products; float32
    EXACT_DELTA recomputes S and dP in the dQ kernel's orientation: same count)."""
    a = L.bound()
    q, x16, BM, BN, DP, causal = _attn_common(a)
    group = a["GROUP"]
    if a["IS_PREFIX"]:
        causal = False
    tiles = sum(c * group * _attn_tiles_kv(nq, nk, BM, BN, causal, off)
                for c, nq, nk, off in _spans(L, a, a["H_KV"]))
    w = _work()
    # Sᵀ = K Qᵀ and dPᵀ = V dOᵀ have N = BLOCK_M (query rows) and both operands in shared
    # memory (sm_90: m64n32k16 wgmma with a descriptor A at BLOCK_M = 32), dV and dK N =
    # HEAD_DIM: their feed, read from the SASS (_flash), caps the first two at 2/3 at N = 32
    _flash(w, tiles * 4 * 2.0 * BM * BN * DP, x16)
    w["sfu_ops"] = tiles * BM * BN
    w["alu_ops"] = tiles * BM * BN * 8
    el = _el(q)
    w["hbm_bytes"] = (q.numel() * el * 2 + a["K"].numel() * el * 4
                      + a["N_ROWS"] * 4 * 4)
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
    return _fa2_varlen(name, [n] * B, H, p, causal, bwd, el, Hkv)


def _fa2_varlen(name, lens, H, p, causal, bwd, el=2, Hkv=None):
    """FlashAttention-2 over sequences of the given lengths in one launch (a batch: equal
    lengths; the varlen kernel: packed ones). Programs: every sequence's 128-row tiles.

    Work is what its tiles issue, as for kfused's kernels (_attn_tiles): 128-row query tiles
    (forward; the backward's key tiles are 128 wide) against whole key tiles, so a causal
    tile on the diagonal is computed in full and masked — m(m + 128)/2 scores per head of a
    sequence of m = 128·k, not m²/2 (FA2 sm_90 tiles for p <= 128: forward 128 × 128 (p 64)
    or 128 × 64 (p 128), backward 128 × 128 or 64 × 128 query × key rows, all the same count)."""
    Hkv = Hkv or H
    scores = sum(H * _attn_tiles(m, m, 128, 128, causal, 0) * 128 * 128 for m in lens)
    T = sum(lens)
    prods = 5 if bwd else 2
    work = dict(dot16_flops=scores * prods * 2.0 * p, sfu_ops=scores,
                alu_ops=scores * (12 if bwd else 8),
                hbm_bytes=el * T * p * (H * (4 if bwd else 2) + Hkv * (4 if bwd else 2))
                + (T * H * p * 4 * 2 if bwd else 0))
    programs = H * sum(cdiv(m, 128) for m in lens)
    pr = R.predict(work, {"hmma": 1}, programs, 1)
    out = [dict(name=name, t=pr["t"], flops=work["dot16_flops"])]
    if bwd:
        out.append(_stream(name + ":rowsum(dO*O)", el * 2 * T * H * p + 4 * T * H))
    return out


def _fa2_num_splits(blocks: int, n_blocks: int, max_splits: int = 128) -> int:
    """FlashAttention-2's split-KV count (num_splits_heuristic in its flash_api.cpp, which
    PyTorch's copy calls with twice the SM count, "128 threads per block"): one split when the
    (batch × heads × query blocks) programs nearly fill the GPU, else the smallest split count
    whose wave efficiency is within 85 % of the best."""
    slots = 2 * R.SMS
    if blocks >= 0.8 * slots:
        return 1
    max_splits = min(max_splits, slots, n_blocks)

    def eligible(s):
        return s == 1 or cdiv(n_blocks, s) != cdiv(n_blocks, s - 1)

    eff = {}
    for s in range(1, max_splits + 1):
        if eligible(s):
            waves = blocks * s / slots
            eff[s] = waves / math.ceil(waves)
    best = max(eff.values())
    return next(s for s in sorted(eff) if eff[s] >= 0.85 * best)


# FlexAttention (torch.compile's Triton attention templates) against FlashAttention-2: the
# PyTorch team's FlexAttention announcement (pytorch.org/blog/flexattention, August 2024)
# reports 90 % of FlashAttention-2's performance in the forward pass and 85 % in the backward
# pass (A100). The model takes those fractions of the FA2 model above: an assumption carried
# over from another GPU, not an H100 figure.
FLEX_FWD_FRACTION, FLEX_BWD_FRACTION = 0.90, 0.85


def _flex(name, B, H, n, p, causal, bwd):
    frac = FLEX_BWD_FRACTION if bwd else FLEX_FWD_FRACTION
    return [dict(part, t=part["t"] / frac) for part in _fa2(name, B, H, n, p, causal, bwd)]


def _traced_torch(prefix: str, run: Callable[[], None]) -> List[dict]:
    """A baseline written in PyTorch: trace ``run`` (forward + backward on CPU stand-ins) and
    cost every operation it makes like the glue of our own ops (roofline.torch_op_time)."""
    from kfused.perf.trace import trace

    _, ops = trace(run, warm=False)
    return [dict(name=f"{prefix}: {g.name}", t=R.torch_op_time(g.flops, g.bytes), flops=g.flops)
            for g in ops]


# --- the CUDA C++ inference kernel of inducer attention (issue 15) --------------------------
# csrc/inducer/inducer.cuh: prefill blocks of 16·MR·RW rows (MR = 2 row tiles per warp up to a
# padded head width of 64, else 1) walk stages of BN keys; decode blocks (n_q <= 16) of 16 rows
# split each stage of BN·KW keys over their KW warps. mma.sync m16n8k16.
_CU_PREFILL_BN, _CU_PREFILL_RW, _CU_DECODE_BN, _CU_DECODE_KW = 64, 4, 16, 4
_CU_PREFILL_MR_MAX_D = 64
_CU_SMEM_PER_SM = 227 * 1024            # sm_90 shared memory a CTA set may use


def _cu_prefill_rows(p: int) -> int:
    """Rows per prefill block of head width p (inducer.cuh ``prefill_rows``)."""
    D = cdiv(p, 32) * 32
    return 16 * _CU_PREFILL_RW * (2 if D <= _CU_PREFILL_MR_MAX_D else 1)


def _cuda_inducer_grid(B: int, H: int, n_q: int, n_k: int, l: int = 0,
                       Hkv: Optional[int] = None, p: int = 128):
    """(decode?, rows per block, keys per stage, row tiles, nsplit, stages per split, query
    heads per block): the host decision of inducer_attention_fwd
    (csrc/inducer/inducer_attention_fwd.cu, 16-bit) for head width ``p``. Grouped-query decode
    without a prefix packs query heads of one kv head into a block: the most that divide
    H / Hkv and whose rows fit one tile."""
    decode = n_q <= 16
    BM = 16 if decode else _cu_prefill_rows(p)
    SK = _CU_DECODE_BN * _CU_DECODE_KW if decode else _CU_PREFILL_BN
    group = H // (Hkv or H)
    gpack = 1
    if decode and l == 0:
        gpack = max((g for g in range(1, group + 1) if group % g == 0 and g * n_q <= BM),
                    default=1)
    row_tiles = cdiv(gpack * n_q, BM)
    blocks = row_tiles * B * (H // gpack)
    ntiles = cdiv(l + n_k, SK)
    nsplit = 1
    if blocks < R.SMS:
        nsplit = max(1, min(cdiv(2 * R.SMS, blocks), ntiles, 64))
    per = max(1, cdiv(ntiles, nsplit))
    return decode, BM, SK, row_tiles, max(1, cdiv(ntiles, per)), per, gpack


def _cuda_inducer(name: str, B: int, H: int, n_q: int, n_k: int, p: int, causal: bool,
                  L_KEY: int = 4, R_VALUE: int = 8, l: int = 0, el: int = 2,
                  Hkv: Optional[int] = None) -> List[dict]:
    """PREDICTED time of ``inducer_attention(..., backend="cuda")`` (16-bit, "add"): the CUDA
    C++ flash kernel (mma.sync: the HMMA rate; per block S = QKᵀ and PV over the visited
    stages, causal blocks stopping at their last row's key; every score exp'd, masked and
    rescaled; K and V read once per head, L2 holding them across its row tiles) with the
    inducer MLP inside (csrc/inducer/inducer_mma.cuh: the key-split-0 block of each row tile
    stages [Ak | W1 | Bkᵀ | ck] and multiplies its Q tile by it on the tensor cores, one
    thread per row finishes s0 and tanh(q W1 + b1) — 2 SFU ops per tanh —, the epilogue
    writes u), the flash-decoding merge when the keys are split (s0 and the hidden row
    through a float32 workspace; the last block of each tile merges, no second launch), and
    whatever torch work ``_cuda_inference`` still does around the kernel, traced with a
    stand-in kernel (none for "add"). Grouped-query k/v
    (``Hkv`` kv heads): K and V read once per kv head (packed decode blocks read them once
    for all their query heads; otherwise L2 holds them across the group's adjacent blocks)."""
    Hkv = Hkv or H
    decode, BM, SK, row_tiles, nsplit, per, gpack = _cuda_inducer_grid(B, H, n_q, n_k, l, Hkv,
                                                                        p=p)
    ncp = cdiv(2 * L_KEY + R_VALUE + 1, 16) * 16        # [Ak | W1 | Bkᵀ | ck] padded
    D = cdiv(p, 32) * 32
    NR = gpack * n_q                                    # packed rows per head block
    stages = masked = 0
    for rt in range(row_tiles):
        r0, r1 = rt * BM, min((rt + 1) * BM, NR) - 1
        last = r1 if gpack == 1 else (n_q - 1 if r0 // n_q != r1 // n_q else r1 % n_q)
        first = r0 if gpack == 1 else 0
        end = min(n_k, n_k - n_q + last + 1) if causal else n_k
        st = cdiv(l + max(end, 0), SK)
        stages += st
        # stages that mask: the one crossing the key end, and (causal) those crossing the
        # diagonal between the tile's first and last row
        diag_lo = l + n_k - n_q + first
        crossing = cdiv(max(0, l + max(end, 0) - max(diag_lo, 0)), SK) if causal else 0
        masked += min(st, 1 + crossing)
    stages *= B * (H // gpack)
    masked *= B * (H // gpack)
    rows = B * H * n_q
    work = _work()
    work["dot16_flops"] = stages * 2 * 2.0 * BM * SK * D
    work["sfu_ops"] = stages * BM * SK
    # per score: the row max, the exponent's FFMA, the row sum, half a pack (sm_90 SASS of the
    # key loop: 933 instructions per 128 HMMA at D = 64, MR = 2), and the rescale of O; the
    # stages that mask add a compare and a select per score
    work["alu_ops"] = stages * (BM * SK * 4 + BM * D) + masked * BM * SK * 2
    work["hbm_bytes"] = (el * B * (2 * H * n_q * p + 2 * Hkv * n_k * p) + 2 * el * H * l * p
                         + rows * 4 * 2 + (rows * nsplit * (p + 2) * 4 if nsplit > 1 else 0))
    # the MLP, once per row tile (key split 0): Q·C on the tensor cores (a packed block: once
    # per query head it holds), the weights staged from L2 (read from HBM once per head), the
    # per-row finish, u written (its workspace when split)
    mlp_blocks = row_tiles * B * H
    work["dot16_flops"] += mlp_blocks * 2.0 * BM * D * ncp
    work["sfu_ops"] += rows * (2 * (L_KEY + R_VALUE) + 2)
    work["alu_ops"] += mlp_blocks * ncp * D + rows * (3 * L_KEY + 2 * R_VALUE + D + 8)
    work["hbm_bytes"] += (el * H * (2 * L_KEY * p + R_VALUE * p + p + L_KEY + R_VALUE)
                          + rows * R_VALUE * el
                          + (rows * (1 + R_VALUE) * 4 if nsplit > 1 else 0))
    pitch = D + 8
    smem = el * (BM * pitch + 2 * 2 * SK * pitch)
    if decode:
        smem = max(smem, el * BM * pitch + 4 * (_CU_DECODE_KW * 16 * D + 2 * _CU_DECODE_KW * 16))
    smem += 4 * BM * (ncp + 2)                          # the MLP's per-row results
    ctas = max(1, min(4, _CU_SMEM_PER_SM // smem))
    programs = row_tiles * nsplit * B * (H // gpack)
    if nsplit > 1:
        # the last block of each tile to arrive merges its splits (InducerParams::count): the
        # partials read back through L2, f, lse, λ and u written; serial after the last
        # wave, the tiles' last blocks in parallel, each at one SM's share of L2 bandwidth
        # and of the element-wise rate: ``tail_s``
        tiles = row_tiles * B * (H // gpack)
        m_read = rows * nsplit * (p + 2) * 4 + rows * (1 + R_VALUE) * 4
        m_write = rows * (p * el + 8) + rows * R_VALUE * el
        m_alu = rows * nsplit * (p + 4) + rows * 2 * R_VALUE
        work["hbm_bytes"] += m_write
        work["alu_ops"] += m_alu
        work["sfu_ops"] += rows * (nsplit + 2)
        work["tail_s"] = ((m_read + m_write) / tiles / (R.L2_BW / R.SMS)
                          + m_alu / tiles / (R.ALU32_RATE / R.SMS))
    pr = R.predict(work, {"hmma": 1}, programs, ctas)
    out = [dict(name=f"{name}: inducer_mma_kernel ({'decode' if decode else 'prefill'}, "
                     f"{programs} blocks, {nsplit} split{'s' if nsplit > 1 else ''}"
                     f"{f', {gpack} heads per block' if gpack > 1 else ''})",
                t=pr["t"], flops=work["dot16_flops"])]

    def glue():
        from kfused.ops.inducer_attention import _cuda_inference

        q = _e(B, H, n_q, p)
        k = v = _e(B, Hkv, n_k, p)
        prm = [_e(H, p, L_KEY), _e(H, L_KEY), _e(H, L_KEY, p), _e(H, p), _e(H, p, R_VALUE),
               _e(H, R_VALUE)]

        def kernel(q, k, v, s0, pk, pv, lens, causal, Ak, ak, Bk, ck, W1, b1, u_float):
            st = q.new_empty(q.shape[:3], dtype=torch.float32)    # stand-in: the kernel above
            u = q.new_empty(*q.shape[:3], W1.shape[-1], dtype=torch.float32 if u_float
                            else q.dtype)
            return torch.empty_like(q), st, torch.empty_like(st), u

        with torch.no_grad():
            _cuda_inference(q, k, v, *prm, None, None, "add", causal, None, None, None,
                            p ** -0.5, True, kernel=kernel)

    return out + _traced_torch(f"{name}: torch", glue)


# --- krona_linear(backend="cuda") (issue 15): the extension's fold + cuBLAS -----------------
# csrc/krona/kron_matvec.cu: kron_mma_bwd_kernel, 256 threads, persistent over tiles of TT <= 16
# tokens (kron_tc_tokens: a 100 KiB budget, at least 2 tiles per SM), 16 x 16 block_mma warp
# tiles whose two operands come from shared memory by ldmatrix every k-step.
_CU_KRON_THREADS, _CU_KRON_MAX_TT, _CU_KRON_BUDGET = 256, 16, 100 * 1024


def _pitch16(n: int) -> int:
    return cdiv(n, 16) * 16 + 8                          # mma::pitch_for


def _block_mma_rate() -> float:
    """block_mma's rate: a 16 × 16 × 16 warp step loads 2 × 512 B by ldmatrix for 8192 FLOPs,
    so shared memory (SMEM_BYTES_PER_CLK per SM) feeds at most 8 FLOP/B — below mma.sync's."""
    feed = R.SMEM_BYTES_PER_CLK * 8.0 * R.SMS * 1.98e9
    return min(R.MMA_RATE, feed)


from kfused.ops._krona_common import CUDA_TC_MAX_WASTE as _CU_KRON_TC_MAX_WASTE  # noqa: E402
from kfused.ops._krona_common import (  # noqa: E402
    CUDA_NARROW_THREADS, CUDA_NARROW_TIERS, _kron_bwd_macs, cuda_factor_kernel, cuda_narrow_plan)


# sm_90 registers of kron_narrow_kernel per tier (16-bit; ptxas -v, nvcc 13): they set the
# blocks per SM (256 threads each); and the cycles of one token's dependent chain (PREDICTED
# from its structure: 5 shuffles per value, two shared-memory reductions, three barriers)
_CU_NARROW_REGS = {0: 56, 1: 149, 2: 159, 3: 138}
_CU_NARROW_TOKEN_CLK = 750


def _cuda_kron_tc_pays(A_shape, B_shape) -> bool:
    """kron_matvec.cu kron_tc_pays (backward): the tensor-core kernel unless padding every
    factor side to 16 multiplies the MACs by more than kTcMaxWaste."""
    return cuda_factor_kernel(*A_shape, *B_shape) == "tensor-core"


def _cuda_kron_bwd(name: str, T: int, A_shape, B_shape, need_dx: bool, el: int = 2) -> List[dict]:
    """kron_matvec_bwd (+ the fixed-order reduction of its partials): the tensor-core kernel,
    or — where the 16-padding would waste more than kTcMaxWaste — the CUDA-core kernel
    (block_gemm on float shared-memory operands: 8 operand loads per 16 FMAs, about half the
    FMA rate; up to 2 blocks per SM)."""
    (a_out, a_in), (b_out, b_in) = A_shape, B_shape
    nAB = a_out * a_in + b_out * b_in
    plan = None if _cuda_kron_tc_pays(A_shape, B_shape) else \
        cuda_narrow_plan(a_out, a_in, b_out, b_in)
    if plan is not None:
        # kron_narrow_kernel: a block per token (persistent), x and g rows staged by
        # cp.async, V and W as per-thread partial sums reduced over the block (5 shuffles a
        # value per warp, the warps' sums by 2·M·N threads, 2 barriers), the rank-m / rank-n
        # updates on the CUDA cores with operands from shared memory
        tier, _, m, n, K, J = plan
        M, N = CUDA_NARROW_TIERS[tier][:2]
        macs = _kron_bwd_macs(a_out, a_in, b_out, b_in, need_dx)
        w = _work()
        # FMAs over the padded small sides: V, W, dA', dB' (and dX'), operands from shared
        # memory (about half the FMA rate)
        w["fma32_flops"] = T * 2.0 * M * N * ((3 if need_dx else 2) * K + 2 * J) * 2
        # shared-memory operand loads (x', g' twice, A', B'^T once a pass) and the block
        # reduction: 2·M·N values, 5 shuffles in each of the 8 warps (32 lanes each)
        w["alu_ops"] = T * (2 * (K * N + M * J) + 2 * (M * K + N * J)
                            + 2 * M * N * 8 * 5 * 32)
        per_sm = max(1, min(2048 // CUDA_NARROW_THREADS,
                            65536 // (_CU_NARROW_REGS[tier] * CUDA_NARROW_THREADS)))
        grid = min(T, per_sm * R.SMS)
        w["hbm_bytes"] = (el * T * (a_out * b_out + a_in * b_in * (2 if need_dx else 1))
                          + grid * nAB * 4)
        t = R.predict(w, {}, grid, per_sm)["t"]
        # a token's latency chain (shuffles, two reductions through shared memory, three
        # block barriers: ~750 cycles, the next token's rows landing meanwhile), the block's
        # tokens one after another: per_sm tokens in flight per SM
        t = max(t, cdiv(T, grid) * _CU_NARROW_TOKEN_CLK / 1.98e9 + R.KERNEL_OVERHEAD_S)
        out = [dict(name=f"{name}: kron_narrow_kernel (tier {tier}, {grid} blocks)",
                    t=t, flops=T * 2.0 * macs)]
        return out + [_reduce_partials(name, grid, nAB, el)]
    if not _cuda_kron_tc_pays(A_shape, B_shape):
        w = _work()
        macs = _kron_bwd_macs(a_out, a_in, b_out, b_in, need_dx)
        w["fma32_flops"] = T * 2.0 * macs * 2                       # at half the FMA rate
        w["alu_ops"] = T * (a_in * b_in + a_out * b_out) / 4         # float staging
        grid = min(cdiv(T, _CU_KRON_MAX_TT), 2 * R.SMS)
        w["hbm_bytes"] = (el * T * (a_out * b_out + a_in * b_in * (2 if need_dx else 1))
                          + grid * nAB * 4)
        out = [dict(name=f"{name}: kron_bwd_kernel (CUDA cores; {grid} blocks)",
                    t=R.predict(w, {}, grid, 2)["t"], flops=T * 2.0 * macs)]
        return out + [_reduce_partials(name, grid, nAB, el)]
    ao, ai, bo, bi = (cdiv(v, 16) * 16 for v in (a_out, a_in, b_out, b_in))
    sX, sG, sV = ai * _pitch16(b_in), ao * _pitch16(b_out), ao * _pitch16(b_in)
    fixed = 2 * (ao * _pitch16(a_in) + bo * _pitch16(b_in))
    token = 2 * (2 * sX + 2 * sG + 2 * sV)
    tt = max(1, min(_CU_KRON_MAX_TT, (_CU_KRON_BUDGET - fixed - 16 - 4 * nAB) // token,
                    cdiv(T, 2 * R.SMS)))
    smem = fixed + tt * token + 16 + 4 * nAB
    per_sm = max(1, min(2048 // _CU_KRON_THREADS, _CU_SMEM_PER_SM // smem))
    ntiles = cdiv(T, tt)
    grid = min(ntiles, per_sm * R.SMS)
    products = ao * bi * bo + ao * bi * ai + ao * ai * bi + bo * bi * ao    # W, V, dA, dB
    if need_dx:
        products += ai * bi * ao
    w = _work()
    # block_mma's shared-memory feed, expressed as mma.sync-rate FLOPs
    w["dot16_flops"] = T * 2.0 * products * (R.MMA_RATE / _block_mma_rate())
    w["alu_ops"] = T * (2 * ao * bi + ai * bi + ao * bo) / 8            # 128-bit smem stages
    w["hbm_bytes"] = (el * T * (a_out * b_out + a_in * b_in * (2 if need_dx else 1))
                      + grid * nAB * 4)
    out = [dict(name=f"{name}: kron_mma_bwd_kernel ({grid} blocks, {tt} tokens per tile)",
                t=R.predict(w, {"hmma": 1}, grid, per_sm)["t"], flops=T * 2.0 * products)]
    return out + [_reduce_partials(name, grid, nAB, el)]


def _reduce_partials(name: str, grid: int, n: int, el: int) -> dict:
    """common.cuh reduce_partials_kernel: 32 values a block, 8 warps over the partials."""
    rw = _work()
    rw["hbm_bytes"] = grid * n * 4 + n * el
    rw["alu_ops"] = grid * n
    return dict(name=f"{name}: reduce_partials_kernel",
                t=R.predict(rw, {}, cdiv(n, 32), 8)["t"], flops=0.0)


def _cuda_krona(T: int, d_in: int, d_out: int, A_shape, B_shape, el: int = 2) -> List[dict]:
    """PREDICTED time of ``krona_linear(..., backend="cuda")`` fwd+bwd on the folded path
    (16-bit, T >= FOLD_MIN_TOKENS): the fold kernel (W read, W' written: 128-bit element-wise)
    before the forward GEMM and, unless the forward kept W' (``keeps_fold``: T >= 8·d_out),
    again before the dx GEMM (cuBLAS), and the factor gradients from the extension's
    kron_matvec backward without dx (g and x read once, block partials reduced in a fixed
    order)."""
    from kfused.ops.krona_linear import KEEP_FOLD_RATIO

    fold = el * d_out * d_in * 2
    refold = KEEP_FOLD_RATIO * d_out * d_in > T * d_in
    return ([_stream("cuda: krona_fold_kernel (fwd)", fold),
             _gemm("cuda: fwd GEMM on W' (cuBLAS)", T, d_out, d_in)]
            + ([_stream("cuda: krona_fold_kernel (bwd)", fold)] if refold else [])
            + [_gemm("cuda: dx GEMM on W' (cuBLAS)", T, d_in, d_out)]
            + _cuda_kron_bwd("cuda", T, A_shape, B_shape, need_dx=False, el=el))


# ==========================================================================================
# cases


@dataclasses.dataclass
class Target:
    issue: int
    baseline: str           # baseline provider name
    max_ratio: float        # kfused fwd+bwd time / baseline time must be <= this
    text: str
    min_ratio: Optional[float] = None   # ... and >= this (a baseline that must keep up
    #                                     with kfused's Triton path: the CUDA C++ one)


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


def _krona_case(T, d_in, d_out, A_shape, B_shape, fac, path="gpu-default"):
    """path "gpu-default": what ``krona_linear(exact=None)`` runs on a GPU for bfloat16 at this
    T (``kfused.ops._fold.fold_decision`` evaluated as on CUDA: the folded W' + cuBLAS path
    from T ≥ FOLD_MIN_TOKENS); "exact": the factored kernels (``exact=True``, also what
    float32 and small T run)."""
    from kfused.ops._fold import fold_decision

    (a_out, a_in), (b_out, b_in) = A_shape, B_shape
    assert a_out * b_out == d_out and a_in * b_in == d_in
    if path == "exact":
        exact, tag = True, "exact"
    else:
        folded = fold_decision(torch.bfloat16, T, None, on_cuda=True)
        exact, tag = (not folded), ("fold+cuBLAS" if folded else "exact")

    def run():
        import kfused

        x = _e(T, d_in, grad=True)
        W, b = _e(d_out, d_in), _e(d_out)
        A, B = _e(a_out, a_in, grad=True), _e(b_out, b_in, grad=True)
        y = kfused.krona_linear(x, W, b, A, B, 0.5, backend="triton", exact=exact)
        _grad(y, [x, A, B])

    gemm = 2.0 * T * d_in * d_out
    kron = 2.0 * T * (a_out * a_in * b_in + a_out * b_in * b_out)
    el = 2

    def floor():
        return [_gemm("fwd GEMM", T, d_out, d_in), _gemm("dx GEMM", T, d_in, d_out)]

    def kron_dense():
        # the benchmark's kron-dense provider (kfused.cases.krona) in eager PyTorch, traced
        # and costed op by op like our glue: torch.kron is a broadcast multiply, its backward
        # two multiplies and two sums, the scale a multiply each way (as one stream each way,
        # five launches and their bytes were missing)
        def run():
            import torch.nn.functional as F

            x = _e(T, d_in, grad=True)
            W, b = _e(d_out, d_in), _e(d_out)
            A, B = _e(a_out, a_in, grad=True), _e(b_out, b_in, grad=True)
            y = F.linear(x, W, b) + F.linear(x, 0.5 * torch.kron(A, B))
            _grad(y, [x, A, B])

        return _traced_torch("kron-dense", run)

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
        op="krona_linear",
        label=f"T={T} {d_in}->{d_out} A{a_out}x{a_in} B{b_out}x{b_in} ({fac}; {tag})",
        shape=dict(T=T, d_in=d_in, d_out=d_out, A=[a_out, a_in], B=[b_out, b_in],
                   path=tag), run=run,
        useful_flops=2 * gemm + 4 * kron,
        min_bytes=el * (2 * T * d_in + 2 * T * d_out + d_in * d_out),
        baselines=dict({"floor": floor, "kron-dense": kron_dense, "compile": compiled},
                       **({"kfused-cuda": lambda: _cuda_krona(T, d_in, d_out, A_shape, B_shape)}
                          if not exact else {})),
        targets=[Target(11, "floor", 1.15, "≤ 1.15× the frozen linear"),
                 Target(11, "kron-dense", 0.5, "≥ 2× faster than materialised kron"),
                 Target(11, "compile", 1 / 1.3, "≥ 1.3× faster than torch.compile")]
        + ([Target(15, "kfused-cuda", math.inf, "CUDA C++ within 10 % of the Triton path",
                   min_ratio=1 / 1.1)] if not exact else []),
        compile_group=f"krona {d_in}->{d_out} A{a_out}x{a_in} B{b_out}x{b_in}"
                      + (" exact" if path == "exact" else ""))


def _krona_cases():
    from kfused.modules.krona import factorize

    out = []
    for d_in, d_out in ((768, 768), (768, 3072)):
        (ao, bo), (ai, bi) = factorize(d_out), factorize(d_in)
        for path in ("gpu-default", "exact"):
            out.append(_krona_case(16384, d_in, d_out, (ao, ai), (bo, bi), "balanced", path))
            out.append(_krona_case(16384, d_in, d_out, (d_out // 384, 384), (384, 2), "paper",
                                   path))
    return out


# --- per-head low-rank q|k|v (issue 12) ---------------------------------------------------


def _headwise_case(width, d, H, Hkv, preset, T):
    from kfused.integration.headwise import HEADWISE_PRESETS as PRESETS
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
        from kfused.ops import headwise_qkv

        x = _e(T, d, grad=True)
        wq, wk, wv = _e(H * p, d), _e(Hkv * p, d), _e(Hkv * p, d)
        bq, bk, bv = _e(H * p), _e(Hkv * p), _e(Hkv * p)
        q, v = factors(cfg.q, H), factors(cfg.v, Hkv)
        # getattr, not dataclasses.astuple: astuple deep-copies every tensor (10 copy
        # kernels the op never makes were counted as its glue)
        leaves = [x] + [t for f in (q, v) for t in (getattr(f, fl.name)
                                                     for fl in dataclasses.fields(f))
                        if isinstance(t, torch.Tensor)]
        y = headwise_qkv(x, wq, wk, wv, bq, bk, bv, n_heads=H, n_kv_heads=Hkv, q=q, v=v,
                         backend="triton", fused_output=True)
        _grad(y, leaves)

    N = (H + 2 * Hkv) * p
    el = 2
    rq, rv = cfg.q, cfg.v
    # LoRA with the same parameter budget on q and v (what peft runs): rank r each, on
    # q (d -> H·p) and v (d -> Hkv·p: narrower than d with grouped-query attention); the
    # budget counts the per-head biases c (as for o below, and headwise_parameter_count)
    budget = (rq.shared * (d + H * p) + H * (rq.wise * (d + p) + rq.lite * 2 * p)
              + rv.shared * (d + Hkv * p) + Hkv * (rv.wise * (d + p) + rv.lite * 2 * p)
              + (H * p if rq.wise or rq.lite else 0) + (Hkv * p if rv.wise or rv.lite else 0))
    r = max(1, round(budget / ((d + H * p) + (d + Hkv * p))))

    def floor():
        return [_gemm("fwd GEMM [Wq;Wk;Wv]", T, N, d), _gemm("dx GEMM", T, d, N)]

    def lora():
        # peft's Linear: result + lora_B(lora_A(x)) * scaling — the scaling is its own kernel
        # forward (and its gradient backward) even at scaling 1 (the benchmark's alpha = r)
        out = floor()
        for name, n_out in (("q", H * p), ("v", Hkv * p)):
            out += [_gemm(f"{name} down x·Aᵀ", T, r, d), _gemm(f"{name} up z·Bᵀ", T, n_out, r),
                    _stream(f"{name} ·scaling", 2 * T * n_out * el),
                    _stream(f"{name} add", 3 * T * n_out * el),
                    _stream(f"{name} g·scaling", 2 * T * n_out * el),
                    _gemm(f"{name} dz = g·B", T, r, n_out), _gemm(f"{name} dx += dz·A", T, d, r),
                    _stream(f"{name} dx add", 3 * T * d * el),
                    _gemm(f"{name} dA", r, d, T), _gemm(f"{name} dB", n_out, r, T)]
        out.append(_stream("split/cat q|k|v", 2 * T * N * el))
        return out

    # the adapter's products per token (docs/math.md §2), forward: Kernel-wise d -> r -> p per
    # head; lite p -> r -> p per head (Z = K^h A_hᵀ: K^h is the frozen GEMM's); shared LoRA
    # d -> r_s -> the projection's whole width. Backward twice that (dZ, dB; dA, dX).
    macs = (H * rq.wise * (d + p) + Hkv * rv.wise * (d + p)
            + H * rq.lite * 2 * p + Hkv * rv.lite * 2 * p
            + rq.shared * (d + H * p) + rv.shared * (d + Hkv * p))
    useful = 2.0 * T * d * N * 2 + 3 * 2.0 * T * macs
    return Case(
        op="headwise_qkv", label=f"{width} T={T} {preset}",
        shape=dict(width=width, d=d, H=H, H_kv=Hkv, p=p, T=T, preset=preset, lora_rank=r),
        run=run, useful_flops=useful,
        min_bytes=el * (2 * T * d + 2 * T * N + N * d),
        baselines={"floor": floor, "peft-lora": lora},
        targets=[Target(12, "floor", 1.25, "≤ 1.25× the frozen projections"),
                 Target(12, "peft-lora", 1.0, "no slower than unfused LoRA (same budget)")],
        compile_group=f"headwise {width} {preset}")


def _oproj_case(width, d, H, preset, T):
    """headwise_oproj (Kernel-wise + shared LoRA on W_o, basis O) with the preset's o ranks,
    on the path ``exact=None`` takes on a GPU in bfloat16 at this T
    (``kfused.ops._fold.fold_decision`` evaluated as on CUDA: W' = W_o + B D_o folded from
    T ≥ FOLD_MIN_TOKENS)."""
    from kfused.integration.headwise import HEADWISE_PRESETS as PRESETS
    from kfused.ops._fold import fold_decision

    folded = fold_decision(torch.bfloat16, T, None, on_cuda=True)
    tag = "folded" if folded else "exact"

    p = d // H
    HP = H * p
    ro = PRESETS[preset].o
    assert ro is not None and not ro.lite

    def run():
        from kfused.ops import headwise_oproj

        o = _e(T, HP, grad=True)
        w, b = _e(d, HP), _e(d)
        kw, leaves = {}, [o]
        if ro.wise:
            kw.update(wise_A=_e(H, ro.wise, p, grad=True), wise_B=_e(d, H * ro.wise, grad=True),
                      wise_c=_e(d, grad=True))
        if ro.shared:
            kw.update(shared_A=_e(ro.shared, HP, grad=True), shared_B=_e(d, ro.shared, grad=True))
        leaves += [t for t in kw.values()]
        y = headwise_oproj(o, w, b, n_heads=H, **kw, scale=0.5, backend="triton",
                           exact=not folded)
        _grad(y, leaves)

    el = 2
    budget = ro.shared * (HP + d) + ro.wise * (H * p + d * H) + (d if ro.wise else 0)
    r = max(1, round(budget / (HP + d)))

    def floor():
        return [_gemm("fwd GEMM W_o", T, d, HP), _gemm("dx GEMM", T, HP, d)]

    def lora():   # as peft runs it (the scaling a kernel each way, as for q|k|v above)
        return floor() + [_gemm("down o·Aᵀ", T, r, HP), _gemm("up z·Bᵀ", T, d, r),
                          _stream("·scaling", 2 * T * d * el), _stream("add", 3 * T * d * el),
                          _stream("g·scaling", 2 * T * d * el), _gemm("dz = g·B", T, r, d),
                          _gemm("do += dz·A", T, HP, r), _stream("do add", 3 * T * HP * el),
                          _gemm("dA", r, HP, T), _gemm("dB", d, r, T)]

    # per token: Kernel-wise p -> r -> d per head (B: d × H·r), shared LoRA H·p -> r_s -> d
    macs = H * ro.wise * (p + d) + ro.shared * (HP + d)
    useful = 2.0 * T * d * HP * 2 + 3 * 2.0 * T * macs
    return Case(
        op="headwise_oproj", label=f"{width} T={T} {preset}[o] ({tag})",
        shape=dict(width=width, d=d, H=H, p=p, T=T, preset=preset, lora_rank=r, path=tag),
        run=run,
        useful_flops=useful, min_bytes=el * (2 * T * HP + 2 * T * d + d * HP),
        baselines={"floor": floor, "peft-lora": lora},
        targets=[Target(12, "floor", 1.25, "≤ 1.25× the frozen projections"),
                 Target(12, "peft-lora", 1.0, "no slower than unfused LoRA (same budget)")],
        compile_group=f"headwise-o {width} {preset}")


def _headwise_cases():
    out = []
    for width, d, H, Hkv in (("gpt2-small", 768, 12, 12), ("gpt2-medium", 1024, 16, 16),
                             ("llama-7b-gqa", 4096, 32, 8)):
        for preset in ("kernel-mix-qvo-intermediate", "kernel-mix-lite-qv-small"):
            out.append(_headwise_case(width, d, H, Hkv, preset, 16384))
        out.append(_oproj_case(width, d, H, "kernel-mix-qvo-intermediate", 16384))
    return out


# --- headwise_lowrank, the standalone op: its Triton path against the CUDA C++ one (issue 15)
# csrc/headwise/headwise_lowrank.cu (16-bit, r <= 64): headwise_mma_kernel (64 tokens × a group of
# HG = 64 / r8 heads sharing the basis tile; it also saves U), stream_gemm_mma_kernel (64 × 64
# tiles; dU, dbasis, dA, dB with K = T split over blocks; dB's ones column of U gives dbias),
# the fixed-order reductions.
_CU_HW_BM, _CU_HW_MAXN, _CU_SG_TILE = 64, 64, 64


def _cu_launch(name: str, programs: int, dot16=0.0, fma32=0.0, nbytes=0.0, ctas=2) -> dict:
    w = _work()
    w["dot16_flops"], w["fma32_flops"], w["hbm_bytes"] = dot16, fma32, nbytes
    return dict(name=name, t=R.predict(w, {"hmma": 1}, programs, ctas)["t"],
                flops=dot16 + fma32)


def _cuda_headwise_lowrank(T, H, d_b, p, r, shared, el=2, has_bias=True) -> List[dict]:
    """PREDICTED fwd+bwd of ``headwise_lowrank(..., backend="cuda")`` (16-bit, r ≤ 64): the
    forward also writes U (T, H, uw) for the backward (uw = r + 1 rounded up to 8: csrc
    ``u_width``), so the backward neither recomputes U nor reads g for the bias: U's ones
    column makes dB's product yield dbias as its column r."""
    r8, r16, p16 = cdiv(r, 8) * 8, cdiv(r, 16) * 16, cdiv(p, 16) * 16
    uw = cdiv(r + 1, 8) * 8
    HG = max(1, min(H, _CU_HW_MAXN // r8)) if shared else 1
    groups = cdiv(H, HG)
    tiles = cdiv(T, _CU_HW_BM) * groups
    basis = (R.reread_bytes(T * d_b * el, groups) if shared else T * H * d_b * el)
    down = 2.0 * cdiv(T, _CU_HW_BM) * _CU_HW_BM * groups * HG * r8 * cdiv(d_b, 64) * 64
    up = 2.0 * T * H * r16 * p16
    hr = H * r
    u_bytes = T * H * uw * el
    out = [_cu_launch("cuda fwd: headwise_mma_kernel (+ U for the backward)", tiles, down + up,
                      0.0, basis + T * H * p * el + u_bytes)]

    def sg(name, M, N, K, batch, nbytes, split=False):
        t = cdiv(M, _CU_SG_TILE) * cdiv(N, _CU_SG_TILE) * batch
        sp = max(1, min(cdiv(2 * R.SMS, t), K // 256)) if split else 1
        res = [_cu_launch(f"cuda bwd: stream_gemm_mma_kernel ({name})", t * sp,
                          2.0 * M * N * K * batch, 0.0, nbytes + (2 * sp * M * N * batch * 4
                                                                    if split else 0))]
        if split:
            res.append(_reduce_partials(f"cuda bwd ({name})", sp, M * N * batch, el))
        return res

    dU, g = T * hr * el, T * H * p * el
    out += sg("dU = g B", T, r, p, H, g + dU)
    out += sg("dbasis", T, d_b, hr if shared else r, 1 if shared else H,
              dU + T * (1 if shared else H) * d_b * el)
    out += sg("dA", hr if shared else r, d_b, T, 1 if shared else H, dU + basis, split=True)
    out += sg("dB + dbias" if has_bias else "dB", p, r + (1 if has_bias else 0), T, H,
              g + u_bytes, split=True)
    return out


def _headwise_lowrank_case(label, T, H, d_b, p, r, shared):
    def run():
        from kfused.ops import headwise_lowrank

        basis = _e(*((T, d_b) if shared else (T, H, d_b)), grad=True)
        A, B, c = _e(H, r, d_b, grad=True), _e(H, p, r, grad=True), _e(H, p, grad=True)
        y = headwise_lowrank(basis, A, B, c, per_head=not shared, backend="triton")
        _grad(y, [basis, A, B, c])

    flops = 2.0 * T * H * r * (d_b + p)
    return Case(
        op="headwise_lowrank", label=f"{label} T={T} H={H} d_b={d_b} p={p} r={r}",
        shape=dict(T=T, H=H, d_b=d_b, p=p, r=r, shared=shared), run=run,
        useful_flops=3 * flops,
        min_bytes=2 * (T * (1 if shared else H) * d_b * 2 + T * H * p * 2),
        baselines={"kfused-cuda": lambda: _cuda_headwise_lowrank(T, H, d_b, p, r, shared)},
        targets=[Target(15, "kfused-cuda", math.inf, "CUDA C++ within 10 % of the Triton path",
                        min_ratio=1 / 1.1)],
        compile_group=f"headwise_lowrank {label}")


def _headwise_lowrank_cases():
    # the benchmark's LOWRANK_CASES (kfused/cases/headwise.py)
    from kfused.cases.headwise import LOWRANK_CASES

    return [_headwise_lowrank_case(label.split(" (")[0], T, H, d_b, p, r, not per_head)
            for label, T, H, d_b, p, r, per_head in LOWRANK_CASES]


# --- inducer attention (issue 14) ---------------------------------------------------------


def _inducer_case(n, p, causal, L_KEY=4, R_VALUE=8):
    B, H = max(1, 16384 // n), 2048 // p

    def run():
        from kfused.ops import inducer_attention

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

    def flex_epilogue():
        from kfused.cases.inducer import flex_epilogue as epilogue

        q = _e(B, H, n, p, grad=True)
        lse = _e(B, H, n, dtype=torch.float32, grad=True)
        prm = dict(Ak=_e(H, p, L_KEY, grad=True), ak=_e(H, L_KEY, grad=True),
                   Bk=_e(H, L_KEY, p, grad=True), ck=_e(H, p, grad=True),
                   W1=_e(H, p, R_VALUE, grad=True), b1=_e(H, R_VALUE, grad=True))
        _grad([epilogue(q, lse, prm)], [q, lse, *prm.values()])

    def flex():
        # what the benchmark's "flex" provider runs: FlexAttention with return_lse, then the
        # λ / u epilogue in PyTorch (kfused.cases.inducer.flex_epilogue), forward + backward
        return (_flex("flex fwd", B, H, n, p, causal, False)
                + _flex("flex bwd", B, H, n, p, causal, True)
                + _traced_torch("λ/u epilogue", flex_epilogue))

    return Case(
        op="inducer_attention", label=f"B={B} H={H} n={n} p={p} {'causal' if causal else 'full'}",
        shape=dict(B=B, H=H, n=n, p=p, causal=causal, L=L_KEY, r=R_VALUE), run=run,
        useful_flops=fl * 3.5, min_bytes=el * B * H * n * p * 8,
        baselines={"sdpa": sdpa, "flex": flex},
        targets=([Target(14, "sdpa", 1 / 0.85, "≥ 0.85× SDPA flash speed (n ≥ 2048)")]
                 if n >= 2048 else [])
        + [Target(14, "flex", 1 / 1.2, "≥ 1.2× FlexAttention computing the same λ")],
        compile_group=f"inducer p={p} {'causal' if causal else 'full'}")


def _inducer_decode_case(B, H, Hkv, n_k, p, L_KEY=4, R_VALUE=8):
    """One new token per sequence against a KV cache of n_k keys (no grad): the split-KV
    decode path (issue 14)."""
    def run():
        from kfused.ops import inducer_attention

        q = _e(B, H, 1, p)
        k, v = _e(B, Hkv, n_k, p), _e(B, Hkv, n_k, p)
        prm = dict(Ak=_e(H, p, L_KEY), ak=_e(H, L_KEY), Bk=_e(H, L_KEY, p), ck=_e(H, p),
                   W1=_e(H, p, R_VALUE), b1=_e(H, R_VALUE))
        with torch.no_grad():
            inducer_attention(q, k, v, **prm, causal=True, backend="triton")

    el = 2
    kv_bytes = el * B * Hkv * n_k * p * 2

    def sdpa():
        # SDPA's flash backend (PyTorch's copy of FlashAttention-2, mha_fwd): one query per
        # head with grouped kv heads is swapped to GROUP query rows per kv head (the cache is
        # read once per kv head), and set_params_splitkv picks the split count with FA2's
        # heuristic; more than one split adds the combine launch over the float32 partials.
        # Each launch is taken at the streaming rate (its best case).
        # key blocks of FA2's set_params_splitkv: 256 keys for p <= 64, 128 to p 128, else 64
        block_n = 256 if p <= 64 else 128 if p <= 128 else 64
        splits = _fa2_num_splits(B * Hkv * cdiv(H // Hkv, 64), cdiv(n_k, block_n))
        partials = splits * B * H * p * 4 if splits > 1 else 0
        out = [_stream(f"sdpa decode ({splits} split{'s' if splits > 1 else ''}; K, V read "
                       "once)", kv_bytes + el * B * H * p * 2 + partials)]
        if splits > 1:
            out.append(_stream("sdpa decode: combine the splits", partials + el * B * H * p))
        return out

    baselines = {"sdpa": sdpa}
    targets = [Target(14, "sdpa", 1.0, "decode at least as fast per token as SDPA")]
    baselines["kfused-cuda"] = lambda: _cuda_inducer("cuda decode", B, H, 1, n_k, p, True,
                                                     L_KEY, R_VALUE, Hkv=Hkv)
    targets.append(Target(15, "kfused-cuda", math.inf, "CUDA C++ faster than Triton on "
                          "decode", min_ratio=1.0))
    return Case(
        op="inducer_attention", label=f"decode B={B} H={H}/{Hkv} n_k={n_k} p={p}",
        shape=dict(B=B, H=H, H_kv=Hkv, n_q=1, n_k=n_k, p=p, L=L_KEY, r=R_VALUE, decode=True),
        run=run, useful_flops=4.0 * B * H * n_k * p, min_bytes=kv_bytes,
        baselines=baselines, targets=targets, compile_group=f"inducer decode p={p}")


def _inducer_fwd_case(n, p, causal, L_KEY=4, R_VALUE=8):
    """The forward alone (inference prefill, no grad): the Triton kernel against the CUDA C++
    one (issue 15: within 10 % of the Triton path) and SDPA's flash forward."""
    B, H = max(1, 16384 // n), 2048 // p

    def run():
        from kfused.ops import inducer_attention

        q, k, v = (_e(B, H, n, p) for _ in range(3))
        prm = dict(Ak=_e(H, p, L_KEY), ak=_e(H, L_KEY), Bk=_e(H, L_KEY, p), ck=_e(H, p),
                   W1=_e(H, p, R_VALUE), b1=_e(H, R_VALUE))
        with torch.no_grad():
            inducer_attention(q, k, v, **prm, causal=causal, backend="triton")

    fl = 4.0 * B * H * n * n * p * (0.5 if causal else 1.0)
    return Case(
        op="inducer_attention",
        label=f"fwd B={B} H={H} n={n} p={p} {'causal' if causal else 'full'} (inference)",
        shape=dict(B=B, H=H, n=n, p=p, causal=causal, L=L_KEY, r=R_VALUE, forward_only=True),
        run=run, useful_flops=fl, min_bytes=2 * B * H * n * p * 4,
        baselines={"kfused-cuda": lambda: _cuda_inducer("cuda prefill", B, H, n, n, p, causal,
                                                        L_KEY, R_VALUE),
                   "sdpa-fwd": lambda: _fa2("sdpa fwd", B, H, n, p, causal, False)},
        targets=[Target(15, "kfused-cuda", math.inf, "CUDA C++ within 10 % of the Triton "
                        "path", min_ratio=1 / 1.1)],
        compile_group=f"inducer fwd p={p} {'causal' if causal else 'full'}")


def _inducer_varlen_case(lens, H, p, L_KEY=4, R_VALUE=8):
    """Padding-free training: a packed batch of mixed-length causal sequences (fwd+bwd)."""
    T, n = sum(lens), max(lens)
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)

    def run():
        from kfused.ops import inducer_attention_varlen

        q, k, v = (_e(T, H, p, grad=True) for _ in range(3))
        prm = dict(Ak=_e(H, p, L_KEY, grad=True), ak=_e(H, L_KEY, grad=True),
                   Bk=_e(H, L_KEY, p, grad=True), ck=_e(H, p, grad=True),
                   W1=_e(H, p, R_VALUE, grad=True), b1=_e(H, R_VALUE, grad=True))
        f, u = inducer_attention_varlen(q, k, v, cu, None, n, n, **prm, causal=True,
                                        backend="triton")
        _grad([f, u], [q, k, v, *prm.values()])

    def flash_varlen():
        return (_fa2_varlen("flash varlen fwd", lens, H, p, True, False)
                + _fa2_varlen("flash varlen bwd", lens, H, p, True, True))

    def sdpa_padded():
        B = len(lens)
        return _fa2("sdpa fwd (padded)", B, H, n, p, True, False) + _fa2(
            "sdpa bwd (padded)", B, H, n, p, True, True)

    fl = sum(2.0 * H * m * m * p for m in lens)
    return Case(
        op="inducer_attention", label=f"packed {len(lens)} seqs T={T} (longest {n}) H={H} p={p} "
                                      "causal",
        shape=dict(lens=list(lens), H=H, p=p, causal=True, L=L_KEY, r=R_VALUE, packed=True),
        run=run, useful_flops=fl * 3.5, min_bytes=2 * T * H * p * 8,
        baselines={"flash-varlen": flash_varlen, "sdpa-padded": sdpa_padded},
        targets=[Target(14, "flash-varlen", 1 / 0.85, "≥ 0.85× flash-attention varlen speed"),
                 Target(14, "sdpa-padded", 1.0, "packed: faster than padding for SDPA")],
        compile_group=f"inducer varlen p={p}")


def _inducer_cases():
    return ([_inducer_case(n, p, c) for p in (64, 128) for c in (False, True)
             for n in (512, 2048, 16384)]
            + [_inducer_fwd_case(n, p, True) for p in (64, 128) for n in (2048, 16384)]
            + [_inducer_decode_case(B, 32, Hkv, n_k, 128)
               for B, Hkv, n_k in ((1, 8, 16384), (16, 8, 4096), (8, 32, 4096))]
            + [_inducer_varlen_case([2048, 128, 1024, 512, 4096, 256, 3072, 640, 1536, 3072],
                                    16, 128)])


def all_cases() -> List[Case]:
    return _krona_cases() + _headwise_cases() + _headwise_lowrank_cases() + _inducer_cases()
