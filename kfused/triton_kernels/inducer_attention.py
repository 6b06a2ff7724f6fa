"""Flash-style Triton kernels for inducer attention and prefix tuning (docs/math.md §3).

Forward (one pass over K/V tiles per query block, never materialising the n_q × n_k scores).
The inducer's per-row MLP — the virtual key's logit ``s0 = τ ⟨q, q + tanh(q Ak + ak) Bk + ck⟩``
and the value bottleneck ``tanh(q W1 + b1)`` — runs in a streaming kernel of its own first
(prefill: :func:`_inducer_fwd_mlp_kernel`, float32 rows of 1 + r), or, on the decode path
(a few rows per head: one launch per token), in the
attention kernel's prologue and epilogue. Then an online softmax in base 2 (log2 e folded
into the scale) over the l prefix columns (never masked) and the sequence key tiles: interior
tiles load and compute without any mask, only the last (ragged) tile checks bounds and only
tiles that straddle the causal diagonal compare positions; tiles wholly above it are never
visited. The epilogue gives f (ordinary attention over the real columns), LSE over the real
columns, λ = sigmoid(s0 − LSE) and 1 − λ, and u = λ · tanh(q W1 + b1). Of the MLP only its
O(H·p·(L + r)) weights, the (n, 1 + r) float32 rows (prefill) and the (n, r) output u touch
HBM. With the MLP inside, the prefill kernel compiled to 255 registers and spilled on sm_90
(24 B per thread at p = 64, 672 B at p = 128; kfused perf); split, 149 / 173 registers and
no spill.

The virtual column is one more term of the softmax; it joins in the epilogue instead of
seeding the running max/sum, because ``f`` is normalised over the real columns only: seeding
would force ``f = acc / (l − exp(s0 − m))``, a cancellation that loses every digit when λ → 1.
``sigmoid(s0 − LSE)`` is the same number without cancellation, and with no real column at all
(a fully masked row) it gives λ = 1, f = 0 and the finite LSE sentinel ``_EMPTY_LSE``. A NaN or
infinite visible logit makes the row sum NaN, and NaN flows into f, LSE, λ and u as in the
reference.

Backward (docs/math.md §3): the ordinary flash backward with ``D_i`` replaced by ``D_i − dLSE_i``,
``dLSE_i = −dλ_i λ_i (1 − λ_i)`` (+ any direct LSE gradient), evaluated as
``dS_ij = P_ij ((dP_ij − D_i) + dLSE_i)``: dLSE is usually far smaller than D, and folding it
into D first would round it away (a row with one visible column has dP − D = 0 exactly and
dS = P·dLSE). ``P = 2^(s·log2 e − m) / l`` is recomputed from q, k and the saved row max and
row sum. Three kernels, in order. The MLP kernel (per chunk of query rows) recomputes the
row's MLP from q, forms dλ = ⟨du, tanh(q W1 + b1)⟩ (+ a direct λ gradient), ds0 = dλ λ (1 − λ)
and −dLSE (stored per row), the MLP's whole share of dq (float32, rows × p) and its chunk's
partial sums of dAk, dak, dBk, dck, dW1, db1 (summed on the host in a fixed order:
deterministic). The dQ kernel is then a plain flash dQ: D_i, the key loop, and the MLP's dq
share added before its one rounding (16-bit: D_i = ⟨dO_i, O_i⟩ with O the stored output plus
its rounding residue (``O_lo``, written by the forward when a backward will follow): from the
rounded output alone D cancelled against dP to 1.4 % in float16 prefix gradients (rows with
few columns); hi + lo is float32-accurate for one extra 16-bit read per element. float32:
D_i = Σ_j P_ij dP_ij from the same dP values (``EXACT_DELTA``, two more products per key
tile), so that a row with a single visible column gets dP − D = 0 exactly, as the float64
rule of docs/math.md §4 needs there). Until 2026-11-28 the MLP work sat in the dQ kernel's
prologue and epilogue, which took it to 255 registers and a 1.5-2 KB per-thread spill on
sm_90; split, the dQ kernel compiles to 160 registers and no spill (p = 64, bf16). The dK/dV
kernel walks query tiles per key tile, over every query head of its kv head (grouped-query
attention). The prefix tiles' dK/dV are written per batch element (B·H·l·p floats) and summed
on the host. Extra memory is O(n) per head: a few floats per row, and with an inducer the
MLP's float32 dq share (4·p bytes per row, as FlashAttention-2's float32 dq accumulator).

With 16-bit inputs every MLP product is a tensor-core dot of 16-bit operands with float32
accumulation, nothing split. The prefill forward's q Ak, q Bkᵀ, q W1 take the stored operands
(q and the weights share one dtype: exact products). The backward recomputes them the same
way, then forms the dq share (cg Bk + dz Akᵀ + dz1 W1ᵀ) and the parameter gradients (qᵀ dz,
qᵀ cg, qᵀ dz1) with the element-wise gradients dz, cg, dz1 rounded once to the input dtype,
as the same-precision torch backward rounds every intermediate (docs/math.md §4 holds the
kernel to twice that path's error): one launch at p ≤ 64, two at p = 128 (the dq share, then
the parameter partials; together they spilled). float32 inputs keep the MLP-rows kernels'
CUDA-core form, exact: one MLP unit (a column of Ak or W1, a row of Bk) at a time — a row
sum of the q tile times the unit's weights, plus, backward, an outer-product update of the dq
share and a column sum for its weight gradient: no dot. That form was the 16-bit path too
until 2026-11-30 (sm_90 SASS: ~550 / ~1,200 warp-instructions a row at p = 64 / 128 in the
backward, against ~100 / ~250 on the tensor cores); its earlier form, float32 FMA dots of the
q tile against the weights padded to 8 columns, measured 0.81-0.85 ms forward and 1.4-1.9 ms
backward at 16k tokens × 32 heads on an H200 (2026-11-30, 12-21x its model). The decode
path's prologue and epilogue keep float32 FMA dots, L and r padded to powers of two ≥ 8
(:func:`_key_rows`, :func:`_value_hidden`). Products with a float32 operand were 16-bit
tensor-core dots (split hi + lo) until an H100 run showed that path faulting or wrong under
Triton 3.6 (see the comment above :func:`_mlp_dot`); no product splits an operand now.

Host functions: :func:`inducer_attention_forward`, :func:`inducer_attention_backward`.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kfused import _alloc, tuning
from kfused.backends import triton_interpret
from kfused.triton_kernels._common import (cdiv, _INTERPRETED, _mm, dot_precision, next_pow2,
                                           sm_count, targets_gpu)

# LSE of a row with no visible real column (log 0): finite so that nothing downstream is NaN;
# exp(s − LSE) is never evaluated on such a row because every column is masked.
_EMPTY_LSE = tl.constexpr(-1.0e30)  # constexpr: compiled kernels may read only constexpr globals
_LN2 = tl.constexpr(0.6931471805599453)
LOG2E = 1.4426950408889634

SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 128)  # the head widths the kernels are built for


# ------------------------------------------------------------------------------------------
# jit functions shared by the kernels below


@triton.jit
def _tanh(x):
    """``(tanh x, 1 − tanh² x)`` in float32. The slope is ``4e / (1 + e)²`` with
    ``e = exp(−2|x|)``, not ``1 − y²``: once tanh saturates, ``1 − y²`` from a float32 ``y``
    keeps only ``eps / (1 − y²)`` of its digits (0.6 % at |x| = 6, property sweep seed 13:
    the key MLP's dAk/dak in float32 failed docs/math.md §4's 1e-4 relative-norm rule).
    ``y``: libdevice on the GPU; the interpreter (no libdevice) evaluates both in float64 from
    exp, which is exact to float32 rounding."""
    if _INTERPRETED:
        xd = x.to(tl.float64)
        t = tl.exp(-2.0 * tl.abs(xd))
        y = (1.0 - t) / (1.0 + t)
        slope = 4.0 * t / ((1.0 + t) * (1.0 + t))
        return tl.where(xd < 0.0, -y, y).to(tl.float32), slope.to(tl.float32)
    else:
        t = tl.exp(-2.0 * tl.abs(x))
        return libdevice.tanh(x), 4.0 * t / ((1.0 + t) * (1.0 + t))


# The decode path's MLP products (q Ak, q Bkᵀ, q W1: N = L_PAD or R_PAD columns) run on the
# CUDA cores in float32 (an "ieee" dot: FMA, exact 16-bit products) in every dtype; the
# MLP-rows kernels take the tensor cores for 16-bit inputs, no operand split. Measured on an
# H100 (Triton 3.6.0, torch 2.11.0+cu130, 2026-11-25,
# benchmarks/results/h100/inducer-mlp-dot/): with these products as 16-bit tensor-core dots
# (float32 operands split hi + lo) the 16-bit kernels gave an illegal memory access (forward
# and dQ kernels), NaN gradients or silently wrong dAk/dak/dBk/dq on 4 of 5 fuzzed shapes;
# as FMA dots all 5 matched the float64 reference (one known 2e-7 dk residue aside) and the
# test_inducer kernel tests passed. The interpreter ran both correctly: a code-generation
# fault of the tensor-core path, not of the formulas. Cost: p·(L + r) FMAs per row and pass,
# beside the attention's 2·p·n_k tensor-core MACs.
@triton.jit
def _mlp_dot(a, b):
    """a @ b in float32 on the CUDA cores (FMA; 16-bit operands converted exactly)."""
    return _mm(a.to(tl.float32), b.to(tl.float32), True, "ieee")


@triton.jit
def _key_weights(AK, AKB, BK, CK, h, L, offs_d, d_ok, HEAD_DIM: tl.constexpr,
                 L_PAD: tl.constexpr):
    """Head h's key-MLP weights (contiguous (H, p, L), (H, L), (H, L, p), (H, p)) zero-padded:
    Ak (D_PAD, L_PAD), ak (L_PAD,) float32, Bkᵀ (D_PAD, L_PAD), ck (D_PAD,) float32."""
    offs_l = tl.arange(0, L_PAD)
    l_ok = offs_l < L
    ak_w = tl.load(AK + h * HEAD_DIM * L + offs_d[:, None] * L + offs_l[None, :],
                   mask=d_ok[:, None] & l_ok[None, :], other=0.0)
    ak_b = tl.load(AKB + h * L + offs_l, mask=l_ok, other=0.0).to(tl.float32)
    bk_t = tl.load(BK + h * L * HEAD_DIM + offs_l[None, :] * HEAD_DIM + offs_d[:, None],
                   mask=d_ok[:, None] & l_ok[None, :], other=0.0)
    ck = tl.load(CK + h * HEAD_DIM + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    return ak_w, ak_b, bk_t, ck


@triton.jit
def _key_rows(q, ak_w, ak_b, bk_t):
    """g = tanh(q Ak + ak), its slope 1 − g² and t = q Bkᵀ (BLOCK_M, L_PAD), all float32
    (padding: g = t = 0)."""
    g, gs = _tanh(_mlp_dot(q, ak_w) + ak_b[None, :])
    t = _mlp_dot(q, bk_t)
    return g, gs, t


@triton.jit
def _key_logit(q, g, t, ck, scale):
    """s0 = τ ⟨q, q + g Bk + ck⟩ = τ (Σ q (q + ck) + Σ_l g_l (q Bkᵀ)_l): only (BLOCK_M, L)
    products, no (BLOCK_M, p) intermediate."""
    qf = q.to(tl.float32)
    return (tl.sum(qf * (qf + ck[None, :]), 1) + tl.sum(g * t, 1)) * scale


@triton.jit
def _value_weights(W1, B1, h, R, offs_d, d_ok, HEAD_DIM: tl.constexpr, R_PAD: tl.constexpr):
    """Head h's value-MLP weights (contiguous (H, p, r), (H, r)) zero-padded: W1
    (D_PAD, R_PAD), b1 (R_PAD,) float32."""
    offs_r = tl.arange(0, R_PAD)
    r_ok = offs_r < R
    w1 = tl.load(W1 + h * HEAD_DIM * R + offs_d[:, None] * R + offs_r[None, :],
                 mask=d_ok[:, None] & r_ok[None, :], other=0.0)
    b1 = tl.load(B1 + h * R + offs_r, mask=r_ok, other=0.0).to(tl.float32)
    return w1, b1


@triton.jit
def _value_hidden(q, W1, B1, h, R, offs_d, d_ok, HEAD_DIM: tl.constexpr, R_PAD: tl.constexpr):
    """tanh(q W1 + b1) and its slope (BLOCK_M, R_PAD) float32 (padding columns tanh(0) = 0)
    and W1 (D_PAD, R_PAD) of head h."""
    w1, b1 = _value_weights(W1, B1, h, R, offs_d, d_ok, HEAD_DIM, R_PAD)
    hid, hs = _tanh(_mlp_dot(q, w1) + b1[None, :])
    return hid, hs, w1


@triton.jit
def _row_chunk(H, CU_Q, N_Q, CHUNK: tl.constexpr, VARLEN: tl.constexpr):
    """An MLP-rows program's work: batch element b, head h, its sequence's first token q0
    and the row range [lo, hi) of chunk ``program_id(0)`` (empty past the sequence's end)."""
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    q0, n_q = _seq_span(CU_Q, b, N_Q, VARLEN)
    lo = tl.program_id(0) * CHUNK
    return b, h, q0, lo, tl.minimum(n_q, lo + CHUNK)


@triton.jit
def _visible(offs_m, offs_n, n_ok, kmask_base, causal_off, BOUNDS: tl.constexpr,
             CAUSAL: tl.constexpr, HAS_KMASK: tl.constexpr):
    """(BLOCK_M, BLOCK_N) mask of the real keys each query row sees in this tile."""
    valid = (offs_n[None, :] >= 0) & (offs_m[:, None] >= 0)
    if BOUNDS:
        valid = valid & n_ok[None, :]
    if CAUSAL:
        valid = valid & (offs_n[None, :] <= offs_m[:, None] + causal_off)
    if HAS_KMASK:
        km = tl.load(kmask_base + offs_n, mask=n_ok, other=0)
        valid = valid & (km != 0)[None, :]
    return valid


@triton.jit
def _seq_span(CU, b, N, VARLEN: tl.constexpr):
    """``(start, length)`` of batch element b along the token axis: sequence b of a packed
    batch (``CU``: int32 cumulative lengths, rows ``[start, start + length)``) when VARLEN,
    else ``(0, N)``.

    VARLEN: N is the packed tensor's token count (from its shape, never from CU), and the
    span is clamped to it, ``0 <= start <= start + length <= N``. Every row a kernel loads
    or stores is ``start + i`` under its existing mask ``i < length`` (or in a loop bounded
    by length), so whatever CU holds — stale host values after a write that bypassed the
    version counter, negative or decreasing entries — no access leaves the tensor. Valid
    lengths are unchanged; two scalar clamps per program, nothing in the key loops."""
    if VARLEN:
        start = tl.load(CU + b)
        end = tl.load(CU + b + 1)
        start = tl.minimum(tl.maximum(start, 0), N)
        end = tl.minimum(tl.maximum(end, start), N)
        n = end - start
        start = start.to(tl.int64)
    else:
        start = 0
        n = N
    return start, n


@triton.jit
def _query_tile(pid_m, pid_bh, H, GROUP, CU_Q, CU_K, N_Q, N_K, N_PREFIX, causal_off,
                BLOCK_M: tl.constexpr, VARLEN: tl.constexpr):
    """Where a query-tile program (forward, dQ) works: batch element b, head h, its kv head
    hk (grouped-query attention: GROUP query heads per kv head), the token spans of b's
    queries and keys, the prefix length and the causal offset (packed: per sequence). A
    packed tile past its sequence's end (``pid_m·BLOCK_M ≥ n_q``) has no rows: both kernels
    return at once: the grid has cdiv(longest, BLOCK_M) tiles per sequence, so in a batch of
    unequal lengths most tiles are such (6 144 of 10 240 in the benchmark's 10 sequences),
    and they would otherwise run the MLP's prologue and epilogue on masked rows."""
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUP
    q0, n_q = _seq_span(CU_Q, b, N_Q, VARLEN)
    k0, n_k = _seq_span(CU_K, b, N_K, VARLEN)
    n_prefix = N_PREFIX
    if VARLEN:
        causal_off = n_k - n_q
    return b, h, hk, q0, n_q, k0, n_k, n_prefix, causal_off


# ------------------------------------------------------------------------------------------
# forward


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
               lo, hi, n_valid, offs_m, offs_d, kmask_base, causal_off, qk_scale,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BOUNDS: tl.constexpr,
               CAUSAL: tl.constexpr, HAS_KMASK: tl.constexpr, PREC: tl.constexpr):
    """Key tiles [lo, hi): BOUNDS checks n < n_valid (the ragged last tile), CAUSAL compares
    positions (diagonal tiles), HAS_KMASK reads the key padding mask; none of them: no mask."""
    d_ok = offs_d < HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_valid
        if BOUNDS:
            kT = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                         mask=d_ok[:, None] & n_ok[None, :], other=0.0)
            vt = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                         mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            kT = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                         mask=d_ok[:, None], other=0.0)
            vt = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                         mask=d_ok[None, :], other=0.0)
        s = tl.dot(q, kT, input_precision=PREC, out_dtype=tl.float32) * qk_scale
        if BOUNDS or CAUSAL or HAS_KMASK:
            valid = _visible(offs_m, offs_n, n_ok, kmask_base, causal_off, BOUNDS, CAUSAL,
                             HAS_KMASK)
            s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible column yet keeps m = -inf; shift by 0 there so that
        # exp(-inf - -inf) never happens.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PREC,
                                            out_dtype=tl.float32)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_rows(
    pid_m, b, h, hk, q0, n_q, k0, n_k, n_prefix, causal_off,
    Q, K, V, PK, PV, KMASK, AK, AKB, BK, CK, W1, B1, MROWS, O, OLO, U, LSE, LAM, STATS, N_ROWS,
    ROW_SB, ROW_SH, WS_ACC, WS_ML, N_WS, WS_BASE, NUM_SPLITS,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_pkh, stride_pkn, stride_pkd,
    stride_pvh, stride_pvn, stride_pvd,
    stride_mb,
    stride_ob, stride_oh, stride_on, stride_od,
    H, GROUP, N_Q, L, R, scale, qk_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, L_PAD: tl.constexpr, R_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_KMASK: tl.constexpr, HAS_PREFIX: tl.constexpr,
    HAS_MLP: tl.constexpr, SAVE_LO: tl.constexpr, PREC: tl.constexpr,
    MERGE: tl.constexpr, SPLIT_M: tl.constexpr, MLP_ROWS: tl.constexpr,
):
    """Query tile ``pid_m`` of head h of batch element b (kv head hk; queries q0 + [0, n_q),
    keys k0 + [0, n_k)): prologue (the key MLP's logit), the prefix tiles, the key loop —
    or, MERGE, the NUM_SPLITS partial (acc, m, l) slots of the split-KV workspace from row
    WS_BASE — and the epilogue
    (f, O_lo, LSE, row statistics, λ, 1 − λ, u). MLP_ROWS: the rows' s0 and hidden units
    were computed by :func:`_inducer_fwd_mlp_kernel` (MROWS, float32 rows of 1 + R): no MLP
    product in this kernel, the epilogue reads them."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    m_ok = offs_m < n_q
    d_ok = offs_d < HEAD_DIM

    q = tl.load(Q + b * stride_qb + h * stride_qh + (q0 + offs_m)[:, None] * stride_qn
                + offs_d[None, :] * stride_qd, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    if HAS_MLP and not MLP_ROWS:
        # prologue: the virtual key's logit from the q tile in registers (one float per row
        # stays live through the key loop)
        ak_w, ak_b, bk_t, ck = _key_weights(AK, AKB, BK, CK, h, L, offs_d, d_ok, HEAD_DIM,
                                            L_PAD)
        g, gs, t = _key_rows(q, ak_w, ak_b, bk_t)
        s0 = _key_logit(q, g, t, ck, scale)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)

    kmask_base = KMASK + b * stride_mb
    if HAS_PREFIX:
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, PK + h * stride_pkh, PV + h * stride_pvh,
            stride_pkn, stride_pkd, stride_pvn, stride_pvd, 0, n_prefix, n_prefix,
            offs_m, offs_d, kmask_base, causal_off, qk_scale,
            HEAD_DIM, BLOCK_N, True, False, False, PREC)
    k_base = K + b * stride_kb + hk * stride_kh + k0 * stride_kn
    v_base = V + b * stride_vb + hk * stride_vh + k0 * stride_vn
    if MERGE:
        # the kv head's workspace rows from WS_BASE hold this head's rows at g·N_Q + i of
        # each SPLIT_M-row slot (NUM_SPLITS slots)
        acc, l_i, m_i = _merge_partials(acc, l_i, m_i, WS_ACC, WS_ML, N_WS,
                                        WS_BASE + (h % GROUP) * N_Q + offs_m, m_ok, offs_d,
                                        NUM_SPLITS, SPLIT_M, D_PAD, 1)
    elif CAUSAL:
        # tiles wholly below the diagonal need no compare (and are in bounds); tiles wholly
        # above it are never visited
        hi = tl.minimum(n_k, (pid_m + 1) * BLOCK_M + causal_off)
        full = tl.minimum(tl.maximum(pid_m * BLOCK_M + causal_off + 1, 0) // BLOCK_N * BLOCK_N,
                          tl.maximum(hi, 0))
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
            0, full, n_k, offs_m, offs_d, kmask_base, causal_off, qk_scale,
            HEAD_DIM, BLOCK_N, False, False, HAS_KMASK, PREC)
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
            full, hi, n_k, offs_m, offs_d, kmask_base, causal_off, qk_scale,
            HEAD_DIM, BLOCK_N, True, True, HAS_KMASK, PREC)
    else:
        n_full = n_k // BLOCK_N * BLOCK_N
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
            0, n_full, n_k, offs_m, offs_d, kmask_base, causal_off, qk_scale,
            HEAD_DIM, BLOCK_N, False, False, HAS_KMASK, PREC)
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
            n_full, n_k, n_k, offs_m, offs_d, kmask_base, causal_off, qk_scale,
            HEAD_DIM, BLOCK_N, True, False, HAS_KMASK, PREC)

    # A row is empty only when its sum is exactly 0 (no visible column): a NaN sum (a NaN or
    # infinite visible key) is not empty and propagates into f, LSE, λ like the reference.
    has = l_i != 0.0
    l_safe = tl.where(has, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has, (m_i + tl.log2(l_safe)) * _LN2, _EMPTY_LSE)
    out_hi = out.to(O.dtype.element_ty)
    tl.store(O + b * stride_ob + h * stride_oh + (q0 + offs_m)[:, None] * stride_on
             + offs_d[None, :] * stride_od, out_hi, mask=m_ok[:, None] & d_ok[None, :])
    row = b * ROW_SB + h * ROW_SH + q0 + offs_m
    if SAVE_LO:
        # the rounding residue of the 16-bit output (rows × HEAD_DIM, contiguous): the
        # backward's D_i = ⟨dO_i, O_i⟩ from O_hi + O_lo is float32-accurate (module docstring)
        tl.store(OLO + row[:, None] * HEAD_DIM + offs_d[None, :],
                 (out - out_hi.to(tl.float32)).to(OLO.dtype.element_ty),
                 mask=m_ok[:, None] & d_ok[None, :])
    tl.store(LSE + row, lse, mask=m_ok)
    # The backward recomputes P = 2^(s − m) / l from the row max (base 2) and sum: exp(s − LSE)
    # would carry LSE's absolute rounding (eps·|LSE|) into every P in float32.
    tl.store(STATS + row, tl.where(m_i == float("-inf"), 0.0, m_i), mask=m_ok)
    tl.store(STATS + N_ROWS + row, tl.where(has, 1.0 / l_safe, 0.0), mask=m_ok)
    if HAS_MLP:
        # epilogue: λ and 1 − λ both as sigmoids (1 − λ formed by subtraction loses its digits
        # as λ → 1), from e = exp(−|s0 − LSE|) ∈ [0, 1]: no overflow, σ(−x) = e / (1 + e)
        # underflows as float32 does (exactly 0 for a row with no visible key, where
        # s0 − LSE = +inf; a clamp of x to ±88 had left 1 − λ at 6e-39 there), NaN kept
        offs_r = tl.arange(0, R_PAD)
        if MLP_ROWS:
            s0 = tl.load(MROWS + row * (R + 1), mask=m_ok, other=0.0)
        x_raw = s0 - lse
        e = tl.exp(-tl.abs(x_raw))
        is_nan = x_raw != x_raw
        big = 1.0 / (1.0 + e)
        small = e / (1.0 + e)
        lam = tl.where(is_nan, x_raw, tl.where(x_raw >= 0, big, small))
        tl.store(LAM + row, lam, mask=m_ok)
        tl.store(LAM + N_ROWS + row, tl.where(is_nan, x_raw, tl.where(x_raw >= 0, small, big)),
                 mask=m_ok)
        if MLP_ROWS:
            hid = tl.load(MROWS + row[:, None] * (R + 1) + 1 + offs_r[None, :],
                          mask=m_ok[:, None] & (offs_r < R)[None, :], other=0.0)
        else:
            hid, hs, w1 = _value_hidden(q, W1, B1, h, R, offs_d, d_ok, HEAD_DIM, R_PAD)
        u = lam[:, None] * hid
        tl.store(U + row[:, None] * R + offs_r[None, :], u.to(U.dtype.element_ty),
                 mask=m_ok[:, None] & (offs_r < R)[None, :])


@triton.jit
def _merge_partials(acc, l_i, m_i, WS_ACC, WS_ML, N_WS, rows, r_ok, offs_d, NUM_SPLITS,
                    SPLIT_M: tl.constexpr, D_PAD: tl.constexpr, SC: tl.constexpr):
    """Fold NUM_SPLITS split-KV partials (acc, base-2 row max m, row sum l), at ``rows`` +
    s·SPLIT_M of the workspace, into the running (acc, l, m), SC slots per step (SC loads in
    flight, not one dependent round trip per slot). Other programs wrote them: read through
    L2 (.cg), never a stale L1 line."""
    sc = tl.arange(0, SC)
    for s0 in range(0, NUM_SPLITS, SC):
        s_ok = (s0 + sc) < NUM_SPLITS
        r_s = rows[None, :] + (s0 + sc)[:, None] * SPLIT_M                  # (SC, rows)
        ok = s_ok[:, None] & r_ok[None, :]
        m_s = tl.load(WS_ML + r_s, mask=ok, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(WS_ML + N_WS + r_s, mask=ok, other=0.0, cache_modifier=".cg")
        a_s = tl.load(WS_ACC + r_s[:, :, None] * D_PAD + offs_d[None, None, :],
                      mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_i, tl.max(m_s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        beta = tl.exp2(m_s - m_safe[None, :])                               # (SC, rows)
        l_i = l_i * alpha + tl.sum(l_s * beta, 0)
        acc = acc * alpha[:, None] + tl.sum(a_s * beta[:, :, None], 0)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _split_chunk(Q, K, V, KMASK, WS_ACC, WS_ML, N_WS, pid_s, pid_bk, b, hk, NUM_SPLITS,
                 stride_qb, stride_qh, stride_qn, stride_qd,
                 stride_kb, stride_kh, stride_kn, stride_kd,
                 stride_vb, stride_vh, stride_vn, stride_vd, stride_mb,
                 GROUP, N_Q, N_K, CHUNK, causal_off, qk_scale,
                 HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLIT_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_KMASK: tl.constexpr,
                 PREC: tl.constexpr):
    """Key chunk pid_s of kv head (b, hk) for every query row of its GROUP query heads (row
    g·N_Q + i: head hk·GROUP + g, query i), so the cache is read once per kv head; writes
    the unnormalised partial acc (SPLIT_M, D_PAD) and the base-2 row max / row sum (WS_ML,
    WS_ML + N_WS) of the chunk, float32."""
    r = tl.arange(0, SPLIT_M)
    g = r // N_Q
    qi = r % N_Q                              # query position of each row
    r_ok = r < GROUP * N_Q
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + b * stride_qb + (hk * GROUP + g)[:, None] * stride_qh
                + qi[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    lo = pid_s * CHUNK
    hi = tl.minimum(lo + CHUNK, N_K)
    acc = tl.zeros([SPLIT_M, D_PAD], dtype=tl.float32)
    l_i = tl.zeros([SPLIT_M], dtype=tl.float32)
    m_i = tl.full([SPLIT_M], float("-inf"), dtype=tl.float32)
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, K + b * stride_kb + hk * stride_kh, V + b * stride_vb + hk * stride_vh,
        stride_kn, stride_kd, stride_vn, stride_vd, lo, hi, hi, qi, offs_d,
        KMASK + b * stride_mb, causal_off, qk_scale, HEAD_DIM, BLOCK_N, True, CAUSAL,
        HAS_KMASK, PREC)
    # only the real rows (GROUP·N_Q of the SPLIT_M): padding rows are never read
    row = (pid_bk.to(tl.int64) * NUM_SPLITS + pid_s) * SPLIT_M + r
    tl.store(WS_ACC + row[:, None] * D_PAD + offs_d[None, :], acc, mask=r_ok[:, None])
    tl.store(WS_ML + row, m_i, mask=r_ok)
    tl.store(WS_ML + N_WS + row, l_i, mask=r_ok)


@triton.jit
def _inducer_attn_fwd_kernel(
    Q, K, V, PK, PV, KMASK, AK, AKB, BK, CK, W1, B1, MROWS, O, OLO, U, LSE, LAM, STATS, N_ROWS,
    CU_Q, CU_K, ROW_SB, ROW_SH, WS_ACC, WS_ML, N_WS, COUNT, CHUNK,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_pkh, stride_pkn, stride_pkd,
    stride_pvh, stride_pvn, stride_pvd,
    stride_mb,
    stride_ob, stride_oh, stride_on, stride_od,
    H, GROUP, N_Q, N_K, N_PREFIX, L, R, causal_off, scale, qk_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, L_PAD: tl.constexpr, R_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_KMASK: tl.constexpr, HAS_PREFIX: tl.constexpr,
    HAS_MLP: tl.constexpr, SAVE_LO: tl.constexpr, PREC: tl.constexpr,
    VARLEN: tl.constexpr, SPLIT_KV: tl.constexpr, SPLIT_M: tl.constexpr,
    MLP_ROWS: tl.constexpr,
):
    """Rows of the per-row outputs (LSE, STATS, LAM, U, OLO) are ``b·ROW_SB + h·ROW_SH + i``
    ((B, H, n_q) or, packed, (H, total_q)); O is written through its strides. VARLEN: batch
    element b is sequence b of a packed batch (CU_Q, CU_K cumulative lengths; q, k, v, O with
    batch stride 0; N_Q, N_K the token counts of q and k, to which every span is clamped:
    :func:`_seq_span`); tiles past the sequence's end return at once (:func:`_query_tile`).
    MLP_ROWS (not with SPLIT_KV): the inducer MLP's rows come from MROWS (:func:`_fwd_rows`).

    SPLIT_KV (the decode path, flash-decoding in one launch): grid (key chunks, B·H_kv); each
    program reduces its chunk of CHUNK keys for the GQA-packed rows of its kv head
    (:func:`_split_chunk`), then takes a ticket on the kv head's arrival counter COUNT; the
    last of the chunks to arrive merges all of them for the packed rows at once (into slot
    0), runs the prologue, the prefix and the epilogue for each of the GROUP query heads from
    that slot, then sets the counter back to 0 for the next launch. Ordering: every thread's
    partial stores, a CTA barrier, then the ticket (one acquire-release atomic at GPU
    scope); the merging program reads the partials through L2."""
    if SPLIT_KV:
        pid_s = tl.program_id(0)
        pid_bk = tl.program_id(1)
        n_splits = tl.num_programs(0)
        b = (pid_bk // (H // GROUP)).to(tl.int64)
        hk = (pid_bk % (H // GROUP)).to(tl.int64)
        _split_chunk(Q, K, V, KMASK, WS_ACC, WS_ML, N_WS, pid_s, pid_bk, b, hk, n_splits,
                     stride_qb, stride_qh, stride_qn, stride_qd,
                     stride_kb, stride_kh, stride_kn, stride_kd,
                     stride_vb, stride_vh, stride_vn, stride_vd, stride_mb,
                     GROUP, N_Q, N_K, CHUNK, causal_off, qk_scale,
                     HEAD_DIM, D_PAD, SPLIT_M, BLOCK_N, CAUSAL, HAS_KMASK, PREC)
        tl.debug_barrier()
        ticket = tl.atomic_add(COUNT + pid_bk, 1, sem="acq_rel", scope="gpu")
        if ticket == n_splits - 1:
            # merge the chunks once for all the kv head's packed rows, into slot 0; then each
            # query head's prologue/prefix/epilogue reads that one merged slot
            base = pid_bk.to(tl.int64) * n_splits * SPLIT_M
            if n_splits > 1:        # one chunk: its partial in slot 0 is already the merge
                r = tl.arange(0, SPLIT_M)
                r_ok = r < GROUP * N_Q                      # padding rows: never read
                offs_d = tl.arange(0, D_PAD)
                acc, l_i, m_i = _merge_partials(
                    tl.zeros([SPLIT_M, D_PAD], dtype=tl.float32),
                    tl.zeros([SPLIT_M], dtype=tl.float32),
                    tl.full([SPLIT_M], float("-inf"), dtype=tl.float32),
                    WS_ACC, WS_ML, N_WS, base + r, r_ok, offs_d, n_splits,
                    SPLIT_M, D_PAD, 4)
                tl.store(WS_ACC + (base + r)[:, None] * D_PAD + offs_d[None, :], acc,
                         mask=r_ok[:, None])
                tl.store(WS_ML + base + r, m_i, mask=r_ok)
                tl.store(WS_ML + N_WS + base + r, l_i, mask=r_ok)
                tl.debug_barrier()
            for g in range(0, GROUP):
                _fwd_rows(
                    0, b, hk * GROUP + g, hk, 0, N_Q, 0, N_K, N_PREFIX, causal_off,
                    Q, K, V, PK, PV, KMASK, AK, AKB, BK, CK, W1, B1, MROWS, O, OLO, U, LSE,
                    LAM, STATS, N_ROWS, ROW_SB, ROW_SH, WS_ACC, WS_ML, N_WS, base, 1,
                    stride_qb, stride_qh, stride_qn, stride_qd,
                    stride_kb, stride_kh, stride_kn, stride_kd,
                    stride_vb, stride_vh, stride_vn, stride_vd,
                    stride_pkh, stride_pkn, stride_pkd,
                    stride_pvh, stride_pvn, stride_pvd,
                    stride_mb, stride_ob, stride_oh, stride_on, stride_od,
                    H, GROUP, N_Q, L, R, scale, qk_scale,
                    HEAD_DIM, D_PAD, L_PAD, R_PAD, BLOCK_M, BLOCK_N, CAUSAL, HAS_KMASK,
                    HAS_PREFIX, HAS_MLP, SAVE_LO, PREC, True, SPLIT_M, False)
            tl.atomic_xchg(COUNT + pid_bk, 0, sem="relaxed", scope="gpu")
    else:
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b, h, hk, q0, n_q, k0, n_k, n_prefix, causal_off = _query_tile(
            pid_m, pid_bh, H, GROUP, CU_Q, CU_K, N_Q, N_K, N_PREFIX, causal_off, BLOCK_M,
            VARLEN)
        if VARLEN:
            if pid_m * BLOCK_M >= n_q:          # past its sequence's end: no rows
                return
        _fwd_rows(
            pid_m, b, h, hk, q0, n_q, k0, n_k, n_prefix, causal_off,
            Q, K, V, PK, PV, KMASK, AK, AKB, BK, CK, W1, B1, MROWS, O, OLO, U, LSE, LAM,
            STATS, N_ROWS, ROW_SB, ROW_SH, WS_ACC, WS_ML, N_WS, 0, 1,
            stride_qb, stride_qh, stride_qn, stride_qd,
            stride_kb, stride_kh, stride_kn, stride_kd,
            stride_vb, stride_vh, stride_vn, stride_vd,
            stride_pkh, stride_pkn, stride_pkd,
            stride_pvh, stride_pvn, stride_pvd,
            stride_mb, stride_ob, stride_oh, stride_on, stride_od,
            H, GROUP, N_Q, L, R, scale, qk_scale,
            HEAD_DIM, D_PAD, L_PAD, R_PAD, BLOCK_M, BLOCK_N, CAUSAL, HAS_KMASK,
            HAS_PREFIX, HAS_MLP, SAVE_LO, PREC, False, SPLIT_M, MLP_ROWS)


@triton.jit
def _key_unit(AK, AKB, BK, h, l, L, offs_d, d_ok, HEAD_DIM: tl.constexpr):
    """Key-MLP unit l of head h: column l of Ak (D_PAD,), row l of Bk (D_PAD,) and ak_l, all
    float32 (padding lanes 0). A few hundred bytes a head, cached after the first step."""
    a_l = tl.load(AK + h * HEAD_DIM * L + offs_d * L + l, mask=d_ok, other=0.0).to(tl.float32)
    b_l = tl.load(BK + (h * L + l) * HEAD_DIM + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    return a_l, b_l, tl.load(AKB + h * L + l).to(tl.float32)


@triton.jit
def _value_unit(W1, B1, h, j, R, offs_d, d_ok, HEAD_DIM: tl.constexpr):
    """Value-MLP unit j of head h: column j of W1 (D_PAD,) and b1_j, float32."""
    w_j = tl.load(W1 + h * HEAD_DIM * R + offs_d * R + j, mask=d_ok, other=0.0).to(tl.float32)
    return w_j, tl.load(B1 + h * R + j).to(tl.float32)


@triton.jit
def _q_rows(Q, b, h, q0, m0, hi, offs_d, d_ok, stride_qb, stride_qh, stride_qn, stride_qd,
            ROW_SB, ROW_SH, BLOCK_M: tl.constexpr):
    """An MLP-rows step: rows m0 + [0, BLOCK_M) (of those below hi) of head h of batch element
    b — their offsets, mask, q tile (as stored) and per-row index."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < hi
    q = tl.load(Q + b * stride_qb + h * stride_qh + (q0 + offs_m)[:, None] * stride_qn
                + offs_d[None, :] * stride_qd, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    return offs_m, m_ok, q, b * ROW_SB + h * ROW_SH + q0 + offs_m


@triton.jit
def _inducer_fwd_mlp_kernel(
    Q, AK, AKB, BK, CK, W1, B1, MROWS, CU_Q, ROW_SB, ROW_SH,
    stride_qb, stride_qh, stride_qn, stride_qd, H, N_Q, L, R, scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, L_TC: tl.constexpr, R_TC: tl.constexpr,
    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, TC: tl.constexpr, VARLEN: tl.constexpr,
):
    """The inducer MLP's rows for the forward (prefill), before the attention kernel: for
    the CHUNK query rows of chunk ``program_id(0)`` of head h of batch element b, in
    BLOCK_M-row steps, the virtual key's logit s0 = τ ⟨q, q + tanh(q Ak + ak) Bk + ck⟩ and
    the hidden units tanh(q W1 + b1), as float32 rows of 1 + R in MROWS (s0, then the R
    units).

    float32 q: one MLP unit at a time (runtime loops over L and R: unrolled, the compiler kept
    every unit's weights in registers and spilled): its product with the q tile is an
    element-wise float32 multiply and a row sum, so every unit is an independent short
    reduction tree and nothing goes through shared memory. The FMA-dot form (q against the
    padded (p, 8) weights) computed each output as one 64-long chain of dependent FMAs with
    the q row replicated across 8 threads through shared memory and 6 barriers a step; it
    measured 0.81-0.85 ms at 16k tokens × 32 heads on an H200 (2026-11-30), 19x its model.

    TC (16-bit q, whose weights share its dtype: one floating dtype per call): the three
    products q Ak, q Bkᵀ, q W1 are tensor-core dots instead, 16-bit operands as stored (exact
    products, float32 accumulation: no operand is split or rounded), the weights zero-padded
    to L_TC / R_TC ≥ 16 columns and loaded once per program; the tanh and the logit's row sum
    then run on the (BLOCK_M, L_TC | R_TC) accumulator tiles, one lane per element."""
    b, h, q0, lo, hi = _row_chunk(H, CU_Q, N_Q, CHUNK, VARLEN)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    if TC:
        ak_w, ak_b, bk_t, ck = _key_weights(AK, AKB, BK, CK, h, L, offs_d, d_ok, HEAD_DIM,
                                            L_TC)
        w1, b1 = _value_weights(W1, B1, h, R, offs_d, d_ok, HEAD_DIM, R_TC)
        offs_r = tl.arange(0, R_TC)
        for m0 in range(lo, hi, BLOCK_M):
            offs_m, m_ok, q, row = _q_rows(Q, b, h, q0, m0, hi, offs_d, d_ok, stride_qb,
                                           stride_qh, stride_qn, stride_qd, ROW_SB, ROW_SH,
                                           BLOCK_M)
            g, gs = _tanh(tl.dot(q, ak_w, out_dtype=tl.float32) + ak_b[None, :])
            t = tl.dot(q, bk_t, out_dtype=tl.float32)
            tl.store(MROWS + row * (R + 1), _key_logit(q, g, t, ck, scale), mask=m_ok)
            hid, hs = _tanh(tl.dot(q, w1, out_dtype=tl.float32) + b1[None, :])
            tl.store(MROWS + row[:, None] * (R + 1) + 1 + offs_r[None, :], hid,
                     mask=m_ok[:, None] & (offs_r < R)[None, :])
        return
    ck = tl.load(CK + h * HEAD_DIM + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    for m0 in range(lo, hi, BLOCK_M):
        offs_m, m_ok, q, row = _q_rows(Q, b, h, q0, m0, hi, offs_d, d_ok, stride_qb, stride_qh,
                                       stride_qn, stride_qd, ROW_SB, ROW_SH, BLOCK_M)
        qf = q.to(tl.float32)
        # s0 / τ = Σ q (q + ck) + Σ_l tanh(q·Ak_l + ak_l) (q·Bk_l)
        s = tl.sum(qf * (qf + ck[None, :]), 1)
        for l in range(L):
            a_l, b_l, ak_l = _key_unit(AK, AKB, BK, h, l, L, offs_d, d_ok, HEAD_DIM)
            g, gs = _tanh(tl.sum(qf * a_l[None, :], 1) + ak_l)
            s += g * tl.sum(qf * b_l[None, :], 1)
        tl.store(MROWS + row * (R + 1), s * scale, mask=m_ok)
        for j in range(R):
            w_j, b1_j = _value_unit(W1, B1, h, j, R, offs_d, d_ok, HEAD_DIM)
            hid, hs = _tanh(tl.sum(qf * w_j[None, :], 1) + b1_j)
            tl.store(MROWS + row * (R + 1) + 1 + j, hid, mask=m_ok)


# ------------------------------------------------------------------------------------------
# backward


@triton.jit
def _inducer_attn_bwd_dkdv_kernel(
    Q, K, V, KMASK, DO, STATS, N_ROWS, DELTA, ADJ, DK, DV, CU_Q, CU_K, ROW_SB, ROW_SH,
    stride_dkb, stride_dkh, stride_dkn,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb,
    stride_dob, stride_doh, stride_don, stride_dod,
    H, H_KV, GROUP, N_Q, N_K, causal_off, qk_scale, scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_PREFIX: tl.constexpr, CAUSAL: tl.constexpr, HAS_KMASK: tl.constexpr,
    EXACT_DELTA: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr,
):
    """One key tile against every query tile that sees it; dK, dV accumulate in registers.

    Works on transposed tiles (keys along rows) so that dK, dV need no transposes. K, V are
    the sequence keys, or (IS_PREFIX, batch stride 0) the prefix keys, which are never masked.
    DK/DV (strides stride_dk*, unit along HEAD_DIM): float32 per-batch partials for the
    prefix. Per-row inputs are indexed as in the forward (ROW_SB, ROW_SH); VARLEN: batch
    element b is sequence b of a packed batch (the prefix keys are not packed; N_Q, N_K the
    token counts of q and k bounding the spans, as in the forward).
    """
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)                 # over batch × kv heads (H_KV)
    b = (pid_bh // H_KV).to(tl.int64)
    h = (pid_bh % H_KV).to(tl.int64)
    q0, n_q = _seq_span(CU_Q, b, N_Q, VARLEN)
    if IS_PREFIX:
        k0 = 0
        n_k = N_K
    else:
        k0, n_k = _seq_span(CU_K, b, N_K, VARLEN)
    if VARLEN:
        causal_off = n_k - n_q
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_k
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k_seq = K + b * stride_kb + h * stride_kh + k0 * stride_kn
    v_seq = V + b * stride_vb + h * stride_vh + k0 * stride_vn
    kt = tl.load(k_seq + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                 mask=kv_mask, other=0.0)
    vt = tl.load(v_seq + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                 mask=kv_mask, other=0.0)
    if EXACT_DELTA:
        kT_r = tl.load(k_seq + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                       mask=d_ok[:, None] & n_ok[None, :], other=0.0)
    key_ok = n_ok
    lo = 0
    q_end = n_q
    if VARLEN:
        if start_n >= n_k:                    # past this sequence's keys: nothing to do
            q_end = 0
    if not IS_PREFIX:
        if HAS_KMASK:
            km = tl.load(KMASK + b * stride_mb + offs_n, mask=n_ok, other=0)
            key_ok = key_ok & (km != 0)
        if CAUSAL:
            # query rows i < start_n - causal_off see none of this tile's keys
            lo = tl.maximum(start_n - causal_off, 0) // BLOCK_M * BLOCK_M

    dk = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
    for g in range(0, GROUP):
        hq = h * GROUP + g                    # the query heads sharing this kv head
        q_base = Q + b * stride_qb + hq * stride_qh + q0 * stride_qn
        do_base = DO + b * stride_dob + hq * stride_doh + q0 * stride_don
        row_base = b * ROW_SB + hq * ROW_SH + q0
        for start_m in range(lo, q_end, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            m_ok = offs_m < n_q
            qT = tl.load(q_base + offs_m[None, :] * stride_qn + offs_d[:, None] * stride_qd,
                         mask=d_ok[:, None] & m_ok[None, :], other=0.0)
            doT = tl.load(do_base + offs_m[None, :] * stride_don + offs_d[:, None] * stride_dod,
                          mask=d_ok[:, None] & m_ok[None, :], other=0.0)
            mrow = tl.load(STATS + row_base + offs_m, mask=m_ok, other=0.0)
            inv_l = tl.load(STATS + N_ROWS + row_base + offs_m, mask=m_ok, other=0.0)
            delta = tl.load(DELTA + row_base + offs_m, mask=m_ok, other=0.0)
            adj = tl.load(ADJ + row_base + offs_m, mask=m_ok, other=0.0)
            if EXACT_DELTA:
                # S in the dQ kernel's orientation, so P here is bit-identical to the P that
                # formed D_i there (a single visible column then gives dS = P·dLSE exactly)
                q_r = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                              mask=m_ok[:, None] & d_ok[None, :], other=0.0)
                sT = tl.trans(tl.dot(q_r, kT_r, input_precision=PREC,
                                     out_dtype=tl.float32) * qk_scale)
            else:
                sT = tl.dot(kt, qT, input_precision=PREC, out_dtype=tl.float32) * qk_scale
            valid = key_ok[:, None] & m_ok[None, :]
            if not IS_PREFIX:
                if CAUSAL:
                    valid = valid & (offs_n[:, None] <= offs_m[None, :] + causal_off)
            pT = tl.exp2(tl.where(valid, sT - mrow[None, :], float("-inf"))) * inv_l[None, :]
            dv += tl.dot(pT.to(doT.dtype), tl.trans(doT), input_precision=PREC,
                         out_dtype=tl.float32)
            if EXACT_DELTA:
                # the same product, operand layout and shape as in the dQ kernel's D_i
                do_r = tl.load(do_base + offs_m[:, None] * stride_don
                               + offs_d[None, :] * stride_dod,
                               mask=m_ok[:, None] & d_ok[None, :], other=0.0)
                vT_r = tl.load(v_seq + offs_n[None, :] * stride_vn + offs_d[:, None] * stride_vd,
                               mask=d_ok[:, None] & n_ok[None, :], other=0.0)
                dpT = tl.trans(tl.dot(do_r, vT_r, input_precision=PREC, out_dtype=tl.float32))
            else:
                dpT = tl.dot(vt, doT, input_precision=PREC, out_dtype=tl.float32)
            # (dP − D) first, then + dLSE (adj = −dLSE): folding dLSE into D would round it away
            dsT = pT * ((dpT - delta[None, :]) - adj[None, :])
            dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT), input_precision=PREC,
                         out_dtype=tl.float32)
    dk = dk * scale
    off = b * stride_dkb + h * stride_dkh + (k0 + offs_n)[:, None] * stride_dkn + offs_d[None, :]
    tl.store(DK + off, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + off, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _p_dp_tile(q, do, mrow, inv_l, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
               offs_n, n_ok, offs_m, offs_d, d_ok, kmask_base, causal_off, qk_scale,
               CAUSAL: tl.constexpr, HAS_KMASK: tl.constexpr, PREC: tl.constexpr):
    """One key tile of the backward: Kᵀ, the recomputed P = 2^(s − m) / l and dP = dO Vᵀ."""
    kT = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                 mask=d_ok[:, None] & n_ok[None, :], other=0.0)
    vT = tl.load(v_base + offs_n[None, :] * stride_vn + offs_d[:, None] * stride_vd,
                 mask=d_ok[:, None] & n_ok[None, :], other=0.0)
    s = tl.dot(q, kT, input_precision=PREC, out_dtype=tl.float32) * qk_scale
    valid = _visible(offs_m, offs_n, n_ok, kmask_base, causal_off, True, CAUSAL, HAS_KMASK)
    p = tl.exp2(tl.where(valid, s - mrow[:, None], float("-inf"))) * inv_l[:, None]
    dp = tl.dot(do, vT, input_precision=PREC, out_dtype=tl.float32)
    return kT, p, dp


@triton.jit
def _delta_tiles(dsum, q, do, mrow, inv_l, k_base, v_base, stride_kn, stride_kd, stride_vn,
                 stride_vd, lo, hi, n_valid, offs_m, offs_d, kmask_base, causal_off, qk_scale,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                 HAS_KMASK: tl.constexpr, PREC: tl.constexpr):
    d_ok = offs_d < HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_valid
        kT, p, dp = _p_dp_tile(q, do, mrow, inv_l, k_base, v_base, stride_kn, stride_kd,
                               stride_vn, stride_vd, offs_n, n_ok, offs_m, offs_d, d_ok,
                               kmask_base, causal_off, qk_scale, CAUSAL, HAS_KMASK, PREC)
        dsum += tl.sum(p * dp, 1)
    return dsum


@triton.jit
def _dq_tiles(dq, q, do, mrow, inv_l, delta, adj, k_base, v_base, stride_kn, stride_kd,
              stride_vn, stride_vd, lo, hi, n_valid, offs_m, offs_d, kmask_base, causal_off,
              qk_scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
              HAS_KMASK: tl.constexpr, PREC: tl.constexpr):
    d_ok = offs_d < HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_valid
        kT, p, dp = _p_dp_tile(q, do, mrow, inv_l, k_base, v_base, stride_kn, stride_kd,
                               stride_vn, stride_vd, offs_n, n_ok, offs_m, offs_d, d_ok,
                               kmask_base, causal_off, qk_scale, CAUSAL, HAS_KMASK, PREC)
        ds = p * ((dp - delta[:, None]) - adj[:, None])
        dq += tl.dot(ds.to(kT.dtype), tl.trans(kT), input_precision=PREC, out_dtype=tl.float32)
    return dq


@triton.jit
def _row_gate_grads(DLAM, DLSE, N_ROWS, row, m_ok, dlam, lam, lam_c, HAS_DLAM: tl.constexpr,
                    HAS_DLSE: tl.constexpr):
    """Per row: dλ (from du, plus a direct λ and 1 − λ gradient), ds0 = dλ λ (1 − λ) and
    ADJ = −dLSE = ds0 − dlse."""
    if HAS_DLAM:
        dlam += (tl.load(DLAM + row, mask=m_ok, other=0.0)
                 - tl.load(DLAM + N_ROWS + row, mask=m_ok, other=0.0))
    ds0 = dlam * (lam * lam_c)
    adj = ds0
    if HAS_DLSE:
        adj -= tl.load(DLSE + row, mask=m_ok, other=0.0).to(tl.float32)
    return ds0, adj


@triton.jit
def _mlp_bwd_rows_tc(Q, LAM, DU, DLAM, DLSE, AK, AKB, BK, CK, W1, B1, N_ROWS, ADJ, DQM, PART,
                     CU_Q, ROW_SB, ROW_SH, stride_qb, stride_qh, stride_qn, stride_qd,
                     H, N_Q, L, R, scale,
                     HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, L_TC: tl.constexpr,
                     R_TC: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                     HAS_DU: tl.constexpr, HAS_DLAM: tl.constexpr, HAS_DLSE: tl.constexpr,
                     VARLEN: tl.constexpr, WHAT: tl.constexpr):
    """:func:`_inducer_attn_bwd_mlp_kernel` for 16-bit q on the tensor cores. Per BLOCK_M-row
    step: the MLP rows recomputed as the forward's three dots (q Ak, q Bkᵀ, q W1: 16-bit
    operands as stored, float32 accumulation), the element-wise gradients on the (BLOCK_M,
    L_TC | R_TC) accumulator tiles, then

        dq share  = c (2q + ck) + dz1 W1ᵀ + cg Bk + dz Akᵀ        (BLOCK_M, D_PAD)
        dW1ᵀ, dAk, dBkᵀ  += qᵀ dz1, qᵀ dz, qᵀ cg                 (D_PAD, R_TC | L_TC)

    with dz1 = λ du (1 − hid²), cg = c g, dz = c t (1 − g²) rounded once to q's dtype for
    their products (as the same-precision torch backward rounds every intermediate; the
    weights and q enter as stored), everything else float32. The weights, zero-padded to
    L_TC / R_TC ≥ 16 columns, are loaded once per program; padding columns give g = t = 0 and
    du = 0, so they contribute nothing. The unit-at-a-time form (float32 q) issued ~550 (p =
    64) and ~1,200 (p = 128) warp-instructions a row on sm_90 (its model: 315 / 440 µs for
    16k tokens × 32 / 16 heads); this one ~100 at p = 64.

    WHAT (bits): 1 the dq share and ADJ, 2 the parameter partials; 3 both in one pass (p ≤
    64). At p = 128 one pass held too much at once (the (BLOCK_M, 128) dq share, q and the
    three (128, 16) parameter accumulators: 0.3-0.5 KB spilled on sm_90), so the host runs
    it as two launches, each recomputing the MLP rows from q."""
    b, h, q0, lo, hi = _row_chunk(H, CU_Q, N_Q, CHUNK, VARLEN)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    offs_l = tl.arange(0, L_TC)
    offs_r = tl.arange(0, R_TC)
    ak_w, ak_b, bk_t, ck = _key_weights(AK, AKB, BK, CK, h, L, offs_d, d_ok, HEAD_DIM, L_TC)
    w1, b1 = _value_weights(W1, B1, h, R, offs_d, d_ok, HEAD_DIM, R_TC)
    dt = ak_w.dtype
    d_ak = tl.zeros([D_PAD, L_TC], dtype=tl.float32)
    d_bk_t = tl.zeros([D_PAD, L_TC], dtype=tl.float32)
    d_w1 = tl.zeros([D_PAD, R_TC], dtype=tl.float32)
    d_ck = tl.zeros([D_PAD], dtype=tl.float32)
    d_akb = tl.zeros([L_TC], dtype=tl.float32)
    d_b1 = tl.zeros([R_TC], dtype=tl.float32)
    for m0 in range(lo, hi, BLOCK_M):
        offs_m, m_ok, q, row = _q_rows(Q, b, h, q0, m0, hi, offs_d, d_ok, stride_qb, stride_qh,
                                       stride_qn, stride_qd, ROW_SB, ROW_SH, BLOCK_M)
        lam = tl.load(LAM + row, mask=m_ok, other=0.0)
        lam_c = tl.load(LAM + N_ROWS + row, mask=m_ok, other=0.0)
        dlam = tl.zeros([BLOCK_M], dtype=tl.float32)
        dz1 = tl.zeros([BLOCK_M, R_TC], dtype=dt)
        if HAS_DU:
            hid, hs = _tanh(tl.dot(q, w1, out_dtype=tl.float32) + b1[None, :])
            du = tl.load(DU + row[:, None] * R + offs_r[None, :],
                         mask=m_ok[:, None] & (offs_r < R)[None, :], other=0.0).to(tl.float32)
            dlam += tl.sum(du * hid, 1)
            dz1 = ((lam[:, None] * du) * hs).to(dt)
            if WHAT & 2:
                d_w1 += tl.dot(tl.trans(q), dz1, out_dtype=tl.float32)
                d_b1 += tl.sum(dz1.to(tl.float32), 0)
        ds0, adj = _row_gate_grads(DLAM, DLSE, N_ROWS, row, m_ok, dlam, lam, lam_c,
                                   HAS_DLAM, HAS_DLSE)
        if WHAT & 1:
            tl.store(ADJ + row, adj, mask=m_ok)
        # d⟨q, p_k⟩/dq = 2q + ck + g Bk + ((q Bkᵀ) ∘ (1 − g²)) Akᵀ, times c per row
        c = ds0 * scale
        g, gs = _tanh(tl.dot(q, ak_w, out_dtype=tl.float32) + ak_b[None, :])
        t = tl.dot(q, bk_t, out_dtype=tl.float32)
        cg = (c[:, None] * g).to(dt)
        dz = (c[:, None] * t * gs).to(dt)
        if WHAT & 2:
            d_ak += tl.dot(tl.trans(q), dz, out_dtype=tl.float32)
            d_bk_t += tl.dot(tl.trans(q), cg, out_dtype=tl.float32)
            d_akb += tl.sum(dz.to(tl.float32), 0)
            d_ck += tl.sum(c[:, None] * q.to(tl.float32), 0)
        if WHAT & 1:
            dqm = tl.dot(cg, tl.trans(bk_t), out_dtype=tl.float32)
            dqm = tl.dot(dz, tl.trans(ak_w), dqm, out_dtype=tl.float32)
            if HAS_DU:
                dqm = tl.dot(dz1, tl.trans(w1), dqm, out_dtype=tl.float32)
            qf = q.to(tl.float32)
            tl.store(DQM + row[:, None] * HEAD_DIM + offs_d[None, :],
                     dqm + c[:, None] * (2.0 * qf + ck[None, :]),
                     mask=m_ok[:, None] & d_ok[None, :])
    if WHAT & 2:
        _store_mlp_partials(PART, d_ak, d_bk_t, d_ck, d_akb, d_b1, d_w1, offs_d, offs_l, offs_r,
                            d_ok, L, R, HEAD_DIM)


@triton.jit
def _store_mlp_partials(PART, d_ak, d_bk_t, d_ck, d_akb, d_b1, d_w1, offs_d, offs_l, offs_r,
                        d_ok, L, R, HEAD_DIM: tl.constexpr):
    """This program's parameter partials, unpadded, in the unit form's layout: dAk (p, L),
    dBk (L, p), dck (p), dak (L), db1 (r), dW1 (p, r); from (D_PAD, L | R)-oriented tiles."""
    l_ok = offs_l < L
    r_ok = offs_r < R
    base = PART + (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)).to(tl.int64) * (
        2 * HEAD_DIM * L + HEAD_DIM * R + HEAD_DIM + L + R)
    tl.store(base + offs_d[:, None] * L + offs_l[None, :], d_ak,
             mask=d_ok[:, None] & l_ok[None, :])
    base += HEAD_DIM * L
    tl.store(base + offs_l[None, :] * HEAD_DIM + offs_d[:, None], d_bk_t,
             mask=d_ok[:, None] & l_ok[None, :])
    base += HEAD_DIM * L
    tl.store(base + offs_d, d_ck, mask=d_ok)
    base += HEAD_DIM
    tl.store(base + offs_l, d_akb, mask=l_ok)
    base += L
    tl.store(base + offs_r, d_b1, mask=r_ok)
    base += R
    tl.store(base + offs_d[:, None] * R + offs_r[None, :], d_w1,
             mask=d_ok[:, None] & r_ok[None, :])


@triton.jit
def _inducer_attn_bwd_mlp_kernel(
    Q, LAM, DU, DLAM, DLSE, AK, AKB, BK, CK, W1, B1, N_ROWS, ADJ, DQM, PART, CU_Q,
    ROW_SB, ROW_SH, stride_qb, stride_qh, stride_qn, stride_qd,
    H, N_Q, L, R, scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, L_PAD: tl.constexpr, R_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
    HAS_DU: tl.constexpr, HAS_DLAM: tl.constexpr, HAS_DLSE: tl.constexpr,
    VARLEN: tl.constexpr, TC: tl.constexpr = False, L_TC: tl.constexpr = 16,
    R_TC: tl.constexpr = 16, WHAT: tl.constexpr = 3,
):
    """The inducer's backward apart from the attention, for the CHUNK query rows
    ``program_id(0)·CHUNK + [0, CHUNK)`` of head h of batch element b (:func:`_row_chunk`)
    in BLOCK_M-row steps: the MLP rows recomputed from q, dλ = ⟨du, tanh(q W1 + b1)⟩
    (+ a direct λ gradient), ds0 = dλ λ (1 − λ), ADJ = −dLSE = ds0 − dlse, the MLP's share
    of dq (DQM, float32, rows × HEAD_DIM: the dQ kernel adds it before its one rounding),
    and this program's partial sums of dAk (p, L), dBk (L, p), dck (p), dak (L), db1 (r),
    dW1 (p, r), accumulated over its steps in registers and written once, unpadded (zeros
    for a chunk past its sequence's end; the host sums the programs' partials in a fixed
    order).

    float32 q: one MLP unit at a time, as the forward's :func:`_inducer_fwd_mlp_kernel`: a
    row sum for its pre-activation, an outer-product update of the dq share, and a column sum
    over the step's rows for its parameter gradient (placed in its row of the (L_PAD |
    R_PAD, D_PAD) accumulators); all float32. At p = 64 launched on one warp: every row and
    column sum stays in the warp (shuffles, no shared memory, no barrier).

    A kernel of its own, launched before the dQ kernel: in the dQ kernel's prologue and
    epilogue the MLP products took it to 255 registers and a 1.5-2 KB per-thread spill on
    sm_90, paid by every query tile on top of its key loop. Its FMA-dot form measured
    1.4-1.9 ms at 16k tokens × 32 heads on an H200 (2026-11-30), 12-16x its model.

    TC (16-bit q and weights): :func:`_mlp_bwd_rows_tc` instead, every product on the
    tensor cores (WHAT: what this launch computes, see there)."""
    if TC:
        _mlp_bwd_rows_tc(Q, LAM, DU, DLAM, DLSE, AK, AKB, BK, CK, W1, B1, N_ROWS, ADJ, DQM,
                         PART, CU_Q, ROW_SB, ROW_SH, stride_qb, stride_qh, stride_qn,
                         stride_qd, H, N_Q, L, R, scale, HEAD_DIM, D_PAD, L_TC, R_TC,
                         BLOCK_M, CHUNK, HAS_DU, HAS_DLAM, HAS_DLSE, VARLEN, WHAT)
        return
    b, h, q0, lo, hi = _row_chunk(H, CU_Q, N_Q, CHUNK, VARLEN)
    offs_d = tl.arange(0, D_PAD)
    offs_l = tl.arange(0, L_PAD)
    offs_r = tl.arange(0, R_PAD)
    d_ok = offs_d < HEAD_DIM
    ck = tl.load(CK + h * HEAD_DIM + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    d_ak_t = tl.zeros([L_PAD, D_PAD], dtype=tl.float32)      # dAk transposed: row l, column l
    d_bk = tl.zeros([L_PAD, D_PAD], dtype=tl.float32)
    d_ck = tl.zeros([D_PAD], dtype=tl.float32)
    d_akb = tl.zeros([L_PAD], dtype=tl.float32)
    d_w1_t = tl.zeros([R_PAD, D_PAD], dtype=tl.float32)      # dW1 transposed
    d_b1 = tl.zeros([R_PAD], dtype=tl.float32)
    for m0 in range(lo, hi, BLOCK_M):
        offs_m, m_ok, q, row = _q_rows(Q, b, h, q0, m0, hi, offs_d, d_ok, stride_qb, stride_qh,
                                       stride_qn, stride_qd, ROW_SB, ROW_SH, BLOCK_M)
        io_mask = m_ok[:, None] & d_ok[None, :]
        qf = q.to(tl.float32)
        lam = tl.load(LAM + row, mask=m_ok, other=0.0)
        lam_c = tl.load(LAM + N_ROWS + row, mask=m_ok, other=0.0)
        dlam = tl.zeros([BLOCK_M], dtype=tl.float32)
        dqm = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        if HAS_DU:
            for j in range(R):
                w_j, b1_j = _value_unit(W1, B1, h, j, R, offs_d, d_ok, HEAD_DIM)
                hid, hs = _tanh(tl.sum(qf * w_j[None, :], 1) + b1_j)
                du_j = tl.load(DU + row * R + j, mask=m_ok, other=0.0).to(tl.float32)
                dlam += du_j * hid
                dz1 = (lam * du_j) * hs
                dqm += dz1[:, None] * w_j[None, :]
                d_w1_t += tl.where(offs_r[:, None] == j, tl.sum(qf * dz1[:, None], 0)[None, :],
                                   0.0)
                d_b1 += tl.where(offs_r == j, tl.sum(dz1, 0), 0.0)
        ds0, adj = _row_gate_grads(DLAM, DLSE, N_ROWS, row, m_ok, dlam, lam, lam_c,
                                   HAS_DLAM, HAS_DLSE)
        tl.store(ADJ + row, adj, mask=m_ok)
        # the key MLP: d⟨q, p_k⟩/dq = p_k + q + Ak (Bk q ∘ (1 − g²)) = 2q + ck + g Bk + (…) Akᵀ
        c = ds0 * scale                                    # ∂L/∂⟨q, p_k⟩ per row
        dqm += c[:, None] * (2.0 * qf + ck[None, :])
        d_ck += tl.sum(c[:, None] * qf, 0)
        for l in range(L):
            a_l, b_l, ak_l = _key_unit(AK, AKB, BK, h, l, L, offs_d, d_ok, HEAD_DIM)
            g, gs = _tanh(tl.sum(qf * a_l[None, :], 1) + ak_l)
            t = tl.sum(qf * b_l[None, :], 1)
            cg = c * g
            dz = c * t * gs
            dqm += cg[:, None] * b_l[None, :] + dz[:, None] * a_l[None, :]
            d_ak_t += tl.where(offs_l[:, None] == l, tl.sum(qf * dz[:, None], 0)[None, :], 0.0)
            d_bk += tl.where(offs_l[:, None] == l, tl.sum(qf * cg[:, None], 0)[None, :], 0.0)
            d_akb += tl.where(offs_l == l, tl.sum(dz, 0), 0.0)
        tl.store(DQM + row[:, None] * HEAD_DIM + offs_d[None, :], dqm, mask=io_mask)
    # this program's partials, unpadded (padding lanes are never stored)
    _store_mlp_partials(PART, tl.trans(d_ak_t), tl.trans(d_bk), d_ck, d_akb, d_b1,
                        tl.trans(d_w1_t), offs_d, offs_l, offs_r, d_ok, L, R, HEAD_DIM)


@triton.jit
def _inducer_attn_bwd_dq_kernel(
    Q, K, V, PK, PV, KMASK, DO, O, OLO, STATS, DLSE, DQM,
    N_ROWS, DQ, DELTA, ADJ, CU_Q, CU_K, ROW_SB, ROW_SH,
    stride_dqb, stride_dqh, stride_dqn,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_pkh, stride_pkn, stride_pkd,
    stride_pvh, stride_pvn, stride_pvd,
    stride_mb,
    stride_dob, stride_doh, stride_don, stride_dod,
    stride_ob, stride_oh, stride_on, stride_od,
    H, GROUP, N_Q, N_K, N_PREFIX, causal_off, scale, qk_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_KMASK: tl.constexpr, HAS_PREFIX: tl.constexpr,
    HAS_MLP: tl.constexpr, HAS_DLSE: tl.constexpr, EXACT_DELTA: tl.constexpr,
    HAS_LO: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr,
):
    """dQ for one query tile: D_i (16-bit: ⟨dO, O_hi + O_lo⟩; float32: a first pass over the
    key tiles) stored in DELTA for the dK/dV kernel, then dQ over the key tiles. HAS_MLP:
    ADJ (−dLSE, the inducer's share included) was written by
    :func:`_inducer_attn_bwd_mlp_kernel`, and its float32 share of dq (DQM, rows × HEAD_DIM)
    is added before the one rounding to DQ's dtype; else this kernel writes ADJ from DLSE (or
    0). Rows, VARLEN: as in the forward; DQ through its strides (unit along HEAD_DIM)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b, h, hk, q0, n_q, k0, n_k, n_prefix, causal_off = _query_tile(
        pid_m, pid_bh, H, GROUP, CU_Q, CU_K, N_Q, N_K, N_PREFIX, causal_off, BLOCK_M, VARLEN)
    if VARLEN:
        if pid_m * BLOCK_M >= n_q:              # past its sequence's end: no rows
            return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    m_ok = offs_m < n_q
    d_ok = offs_d < HEAD_DIM
    io_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * stride_qb + h * stride_qh + (q0 + offs_m)[:, None] * stride_qn
                + offs_d[None, :] * stride_qd, mask=io_mask, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + (q0 + offs_m)[:, None] * stride_don
                 + offs_d[None, :] * stride_dod, mask=io_mask, other=0.0)
    row = b * ROW_SB + h * ROW_SH + q0 + offs_m
    mrow = tl.load(STATS + row, mask=m_ok, other=0.0)
    inv_l = tl.load(STATS + N_ROWS + row, mask=m_ok, other=0.0)
    if HAS_MLP:
        adj = tl.load(ADJ + row, mask=m_ok, other=0.0)
    else:
        adj = tl.zeros([BLOCK_M], dtype=tl.float32)
        if HAS_DLSE:
            adj -= tl.load(DLSE + row, mask=m_ok, other=0.0).to(tl.float32)
        tl.store(ADJ + row, adj, mask=m_ok)
    dq = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)

    kmask_base = KMASK + b * stride_mb
    k_base = K + b * stride_kb + hk * stride_kh + k0 * stride_kn
    v_base = V + b * stride_vb + hk * stride_vh + k0 * stride_vn
    hi = n_k
    if CAUSAL:
        hi = tl.minimum(n_k, (pid_m + 1) * BLOCK_M + causal_off)
    if EXACT_DELTA:
        dsum = tl.zeros([BLOCK_M], dtype=tl.float32)
        if HAS_PREFIX:
            dsum = _delta_tiles(dsum, q, do, mrow, inv_l, PK + h * stride_pkh, PV + h * stride_pvh,
                                stride_pkn, stride_pkd, stride_pvn, stride_pvd, 0, n_prefix,
                                n_prefix, offs_m, offs_d, kmask_base, causal_off, qk_scale,
                                HEAD_DIM, BLOCK_N, False, False, PREC)
        dsum = _delta_tiles(dsum, q, do, mrow, inv_l, k_base, v_base, stride_kn, stride_kd,
                            stride_vn, stride_vd, 0, hi, n_k, offs_m, offs_d, kmask_base,
                            causal_off, qk_scale, HEAD_DIM, BLOCK_N, CAUSAL, HAS_KMASK, PREC)
        delta = dsum
    else:
        # D_i = ⟨dO_i, O_hi + O_lo⟩ (O_lo: the forward's 16-bit rounding residue)
        o = tl.load(O + b * stride_ob + h * stride_oh + (q0 + offs_m)[:, None] * stride_on
                    + offs_d[None, :] * stride_od, mask=io_mask, other=0.0).to(tl.float32)
        if HAS_LO:
            o += tl.load(OLO + row[:, None] * HEAD_DIM + offs_d[None, :], mask=io_mask,
                         other=0.0).to(tl.float32)
        delta = tl.sum(do.to(tl.float32) * o, 1)
    tl.store(DELTA + row, delta, mask=m_ok)
    if HAS_PREFIX:
        dq = _dq_tiles(dq, q, do, mrow, inv_l, delta, adj, PK + h * stride_pkh, PV + h * stride_pvh,
                       stride_pkn, stride_pkd, stride_pvn, stride_pvd, 0, n_prefix, n_prefix,
                       offs_m, offs_d, kmask_base, causal_off, qk_scale,
                       HEAD_DIM, BLOCK_N, False, False, PREC)
    dq = _dq_tiles(dq, q, do, mrow, inv_l, delta, adj, k_base, v_base, stride_kn, stride_kd,
                   stride_vn, stride_vd, 0, hi, n_k, offs_m, offs_d, kmask_base, causal_off,
                   qk_scale, HEAD_DIM, BLOCK_N, CAUSAL, HAS_KMASK, PREC)
    dq = dq * scale
    if HAS_MLP:
        dq += tl.load(DQM + row[:, None] * HEAD_DIM + offs_d[None, :], mask=io_mask, other=0.0)
    tl.store(DQ + b * stride_dqb + h * stride_dqh + (q0 + offs_m)[:, None] * stride_dqn
             + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=io_mask)


# ------------------------------------------------------------------------------------------
# host side


# 16-bit launch configurations (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and padded
# head width, the rule's first; benchmarks/tune_kernels.py --kernels attn times them on a GPU
# (kfused.tuning) and every one compiles for sm_90 without spills under Triton 3.6 and 3.9
# (--compile-only). The H200 of 2026-11-30 measured the p = 128 kernels at 1.3-2.7x their
# prediction where the p = 64 ones ran at 0.6-1.4x: their former tiles (forward 64x64 on 8
# warps, dQ 64x32 on 8, dK/dV 64x64 on 8) split a 64-row tile over two warpgroups, so S = QKᵀ
# ran as m64n32 (dQ: m64n16) wgmma, and their sm_90 SASS (Triton 3.6) issues 0.82 (forward),
# 1.17 (dQ) and 1.22 (dK/dV) warp-instructions per score in the key loop against 0.44, 0.40
# and 0.69 for the rule's tiles now (p = 64: 0.36, 0.37, 0.52). Larger stationary tiles also
# halve the re-reads of the moving operand through L2 (forward and dQ: K, V once per 128 query
# rows; dK/dV: Q, dO once per 128 keys).
ATTN_CANDIDATES = {
    64: {"_inducer_attn_fwd_kernel": ((128, 64, 8, 3), (64, 64, 4, 2)),
         "_inducer_attn_bwd_dq_kernel": ((64, 64, 4, 2), (128, 64, 8, 2)),
         "_inducer_attn_bwd_dkdv_kernel": ((64, 64, 4, 2), (64, 128, 8, 2), (32, 128, 8, 2))},
    128: {"_inducer_attn_fwd_kernel": ((128, 64, 8, 3), (64, 64, 4, 2), (64, 64, 8, 2)),
          "_inducer_attn_bwd_dq_kernel": ((128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 8, 2)),
          # (the former 64 × 64 on 8 warps spills 56 B under Triton 3.9 with a key mask)
          "_inducer_attn_bwd_dkdv_kernel": ((32, 128, 8, 2), (32, 64, 4, 2))},
}
ATTN_KERNELS = ("_inducer_attn_fwd_kernel", "_inducer_attn_bwd_dq_kernel",
                "_inducer_attn_bwd_dkdv_kernel")
_ATTN_TUNE_MIN_N = 1024          # shorter sequences keep the rule (the table's shapes are long)
_CFG_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")


def attn_candidates(kernel: str, d_pad: int) -> list:
    """The launch configurations a GPU run times for ``kernel`` at this padded head width
    ({"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}), the rule's first."""
    return [dict(zip(_CFG_KEYS, c)) for c in ATTN_CANDIDATES[max(64, d_pad)][kernel]]


def attn_tuning_key(d_pad: int, causal: bool, elem_bytes: int) -> dict:
    """What a tuning-table entry of the attention kernels must match (the sequence length is
    its token count)."""
    return {"D_PAD": int(d_pad), "causal": bool(causal), "elem_bytes": int(elem_bytes)}


@functools.lru_cache(maxsize=512)
def _attn_config(kernel: str, dtype: torch.dtype, d_pad: int, device: torch.device,
                 causal: bool, n: int, state: tuple) -> Tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of a 16-bit launch on a GPU: a tuning table's
    measured entry for this device and shape where one exists (from _ATTN_TUNE_MIN_N keys; a
    causal launch without an entry of its own takes the non-causal one: the same loop with
    the diagonal tiles masked, and the proof times non-causal shapes only), else the rule's."""
    cands = attn_candidates(kernel, d_pad)
    cfg = cands[0]
    if device.type == "cuda" and n >= _ATTN_TUNE_MIN_N:
        got = None
        for c in ((True, False) if causal else (False,)):
            got = got or tuning.lookup(kernel, device,
                                       attn_tuning_key(d_pad, c, dtype.itemsize), n, cands)
        cfg = got or cfg
    return tuple(int(cfg[k]) for k in _CFG_KEYS)


def _fwd_config(dtype: torch.dtype, d_pad: int, device: torch.device, causal: bool = False,
                n: int = 0, config: Optional[dict] = None) -> Tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); ``config`` over the rule (a tuning run)."""
    if not targets_gpu(device):
        cfg = (64, 64, 4, 1)           # the interpreter is fastest with few, large tiles
    elif dtype == torch.float32:
        cfg = (64, (32 if d_pad > 64 else 64), 4, 1)
    else:
        cfg = _attn_config("_inducer_attn_fwd_kernel", dtype, d_pad, device, bool(causal),
                           int(n), tuning.state())
    if config:
        cfg = tuple(int(config.get(k, v)) for k, v in zip(_CFG_KEYS, cfg))
    return cfg


# decode path: at most this many query rows per kv head (GROUP × n_q) in one split tile
DECODE_MAX_ROWS = 64
DECODE_MAX_QUERIES = 16
# The split-KV decode's (BLOCK_N, num_warps, num_stages), the rule's first; tune_kernels.py
# --kernels attn times them (kfused.tuning, table name DECODE_TUNING). The H200 of 2026-11-30
# measured the rule's launch at 119 µs for B = 16, 8 kv heads, n_k = 4096, p = 128 (64 key
# steps of 64 keys: ~1.9 µs a step) and 73.5 µs at B = 1, n_k = 16384 (16 chunks of 1024),
# against 20-66 µs predicted at the HBM rate: its sm_90 key loop (Triton 3.6) has 9 barriers
# a step (softmax across the 4 warps, P to the PV operand) whatever the step's width, so
# wider steps pay them for 2-4x the keys (19.0, 16.0, 14.8 warp-instructions per key at 64,
# 128, 256). Not measured yet.
DECODE_CANDIDATES = ((64, 4, 2), (128, 4, 2), (256, 4, 2))
DECODE_TUNING = "_inducer_attn_fwd_kernel[decode]"


def decode_candidates() -> list:
    """The split-KV decode's launch configurations a GPU run times, the rule's first."""
    return [dict(zip(("BLOCK_N", "num_warps", "num_stages"), c)) for c in DECODE_CANDIDATES]


def decode_tuning_key(d_pad: int, rows: int, kv_heads: int, elem_bytes: int) -> dict:
    """What a decode entry must match: padded head width, packed query rows per kv head,
    kv heads in the batch (B·H_kv: with them the split count); the cache length is its T."""
    return {"D_PAD": int(d_pad), "rows": int(rows), "kv_heads": int(kv_heads),
            "elem_bytes": int(elem_bytes)}


@functools.lru_cache(maxsize=256)
def _decode_config(d_pad: int, rows: int, kv_heads: int, n_k: int, elem_bytes: int,
                   device: torch.device, state: tuple) -> Optional[dict]:
    return tuning.lookup(DECODE_TUNING, device,
                         decode_tuning_key(d_pad, rows, kv_heads, elem_bytes), n_k,
                         decode_candidates())


class _DecodePlan:
    """Split-KV launch shape for few queries against a long KV cache (flash-decoding):
    ``split_m`` rows per tile (the GROUP query heads × n_q queries of one kv head), key
    chunks of ``chunk`` keys (a multiple of ``block_n``), ``splits`` of them."""

    def __init__(self, lay: "_Layout", device: torch.device, chunk: Optional[int] = None,
                 config: Optional[dict] = None, dtype: Optional[torch.dtype] = None):
        group = lay.H // lay.h_kv
        self.split_m = max(16, next_pow2(group * lay.n_q))
        self.block_m = max(16, next_pow2(lay.n_q))      # a query head's rows when merging
        # keys per step, warps, stages: ``config`` (a tuning run), else a tuning table's
        # measured entry (16-bit on a GPU), else the rule's (DECODE_CANDIDATES[0])
        self.block_n, self.num_warps, self.num_stages = DECODE_CANDIDATES[0]
        if device.type != "cuda" and triton_interpret():
            self.num_stages = 1
        elif (config is None and device.type == "cuda"
              and dtype in (torch.float16, torch.bfloat16)):
            config = _decode_config(max(16, next_pow2(lay.p)), self.split_m,
                                    lay.B * lay.h_kv, lay.n_k, dtype.itemsize, device,
                                    tuning.state())
        if config:
            self.block_n = int(config.get("BLOCK_N", self.block_n))
            self.num_warps = int(config.get("num_warps", self.num_warps))
            self.num_stages = int(config.get("num_stages", self.num_stages))
        if chunk is None:
            if triton_interpret():
                chunk = 2 * self.block_n                # several chunks even on test shapes
            else:
                # about one program per SM, each with >= 256 keys (the partial it writes,
                # split_m × p float32, stays small next to the K/V chunk it reads); no split
                # when the kv heads alone nearly fill the SMs (FlashAttention-2's 80 % rule).
                # PREDICTED by kfused.perf (H100, p = 128, B = 1, H_kv = 8, n_k = 16k): 16
                # chunks 27.5 µs, 12 chunks 27.1 µs, 32 chunks (two programs per SM, more
                # partials merged after the last wave) 29.3 µs, 8 chunks 29.5 µs (64 programs
                # cannot stream at the HBM rate); B = 16 (128 kv heads): no split, 93.5 µs
                # against 95.0 µs in 3 chunks.
                sms = (sm_count(device) if device.type == "cuda"
                       else 132)                                # H100 SXM (perf model)
                kv_heads = max(1, lay.B * lay.h_kv)
                want = 1 if kv_heads >= 0.8 * sms else cdiv(sms, kv_heads)
                chunk = max(256, cdiv(lay.n_k, want))
        self.chunk = cdiv(max(1, chunk), self.block_n) * self.block_n
        self.splits = cdiv(lay.n_k, self.chunk)
        # Something to split (several chunks) or to pack (query heads per kv head): else the
        # single pass on block_m-row tiles does the same work with no workspace and no merge.
        # PREDICTED (kfused.perf, H100, B=8 H=32/32 n_k=4096 p=128): 182.9 -> 182.0 µs (2.1 MB
        # of partials and the serial merge after the last wave gone; SDPA 182.0 µs).
        self.split_kv = self.splits > 1 or group > 1

    @staticmethod
    def applies(lay: "_Layout") -> bool:
        """The shapes the split-KV path takes (any dtype when asked for explicitly)."""
        group = lay.H // max(1, lay.h_kv)
        return (not lay.varlen and 0 < lay.n_q <= DECODE_MAX_QUERIES and lay.n_k > 0
                and group * lay.n_q <= DECODE_MAX_ROWS)

    @staticmethod
    def chosen(lay: "_Layout", dtype: torch.dtype) -> bool:
        """Taken by default: those shapes, 16-bit inputs. float32 keeps the single pass: its
        backward (EXACT_DELTA) needs the forward's row max bit-identical to the score it
        recomputes (a row with one visible column has dP − D = 0 exactly only then), and the
        split-KV chunk's GQA-packed tile may round that score differently (property sweep seed
        1: n_k = 1, dk 2e-4 off in float32). 16-bit backward takes D from O_hi + O_lo."""
        return dtype in (torch.float16, torch.bfloat16) and _DecodePlan.applies(lay)


_COUNTERS = {}


def _arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` int32 zeros for the split-KV decode's per-kv-head arrival counters.

    Kept per (device, stream) and reused: every launch leaves them at 0 (the merging program
    resets its counter), so no launch pays a memset, and launches on one stream run in order.
    A larger request replaces the buffer (the old one stays alive until the stream's earlier
    launches are done, through the caching allocator's stream ordering)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def _bwd_config(dtype: torch.dtype, d_pad: int, device: torch.device, causal: bool = False,
                n: int = 0, configs: Optional[dict] = None
                ) -> Tuple[Tuple[int, int, int, int], Tuple[int, int, int, int]]:
    """((dQ rows, dQ key tile, dQ warps, stages), (dK/dV query tile, dK/dV keys, dK/dV warps,
    stages)); ``configs`` {kernel name: config} over the rule (a tuning run).

    16-bit (ATTN_CANDIDATES): dK/dV's Sᵀ = K Qᵀ and dPᵀ = V dOᵀ products have N = the query
    tile, and with both operands in shared memory wgmma is feed-bound below N = 64
    (kfused.perf.roofline.wgmma_feed_efficiency: 2/3 of the rate at N = 32); at p = 128 the
    dK/dV accumulators (2 × keys × 128 float32) leave room for 128 keys on 8 warps only with
    a 32-row query tile (64 × 64 on 4 warps spills 72 B, 64 × 128 on 8 warps 40 B: sm_90,
    Triton 3.6). sm_90 compile (Triton 3.6, bf16): p = 64 dQ 164, dK/dV 216-238 registers;
    p = 128 dQ 128 × 64 on 8 warps 227-242, dK/dV 32 × 128 on 8 warps 240-252; no spill."""
    configs = configs or {}
    out = []
    for kernel in ATTN_KERNELS[1:]:
        if not targets_gpu(device):
            cfg = (64, 64, 4, 1)
        elif dtype == torch.float32:
            cfg = (32, 32, 4, 1)
        else:
            cfg = _attn_config(kernel, dtype, d_pad, device, bool(causal), int(n),
                               tuning.state())
        c = configs.get(kernel)
        if c:
            cfg = tuple(int(c.get(k, v)) for k, v in zip(_CFG_KEYS, cfg))
        out.append(cfg)
    return out[0], out[1]


def _mlp_rows_config(d_pad: int, backward: bool, tc: bool = False) -> Tuple[int, int, int]:
    """(rows per step, rows per program, num_warps) of the MLP-rows kernels. Forward: rows
    are independent, one step per program, 4 warps (row sums stay in a warp). Backward: CHUNK
    rows in BLOCK_M-row steps, so that its parameter partials (2pL + pr + p + L + r floats per
    program) stay small next to q; at p = 64 on one warp, so that the column sums of its
    parameter gradients stay in the warp too. sm_90 compile (bf16, L = 4, r = 8; registers /
    spill bytes, Triton 3.6 and 3.9): p = 64, 16 rows on 1 warp 254 / 0 both; p = 128, 16
    rows on 2 warps 255 / 0 and 255 / 32, on 4 warps 168 / 0 and 213 / 0 (taken: no spill
    under either, for about 20 % more instructions a row). Tensor-core backward (16-bit): 64-row
    steps on 4 warps, at p > 64 as two launches (the second, the parameter partials, on 32-row
    steps): sm_90 p = 64 254-255 registers, p = 128 254-255, no spill (Triton 3.6 and 3.9)."""
    if triton_interpret():
        return 16, 32, (1 if backward else 4)   # several steps per program on test shapes
    if backward and tc:                         # tensor-core backward: 64-row tiles, 4 warps
        return 64, 256, 4
    if backward:
        return 16, 256, (1 if d_pad <= 64 else 4)
    if tc:                                      # tensor-core forward: 64-row tiles, 4 warps
        return 64, 256, 4
    return (64 if d_pad <= 64 else 32), (64 if d_pad <= 64 else 32), 4


def _key_mask_u8(key_mask: Optional[torch.Tensor], q: torch.Tensor):
    if key_mask is None:
        return q, 0, False                    # dummy pointer, never read
    km = key_mask.to(torch.bool).contiguous().view(torch.uint8)
    return km, km.stride(0), True


def _prefix_args(prefix_k, prefix_v, k):
    if prefix_k is None or prefix_k.shape[1] == 0:
        return k, k, (0, 0, 0), (0, 0, 0), 0, False
    return (prefix_k, prefix_v, tuple(prefix_k.stride()), tuple(prefix_v.stride()),
            prefix_k.shape[1], True)


Mlp = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
# packed variable-length batch: (cu_seqlens_q, cu_seqlens_k) int32 (n_seq + 1,), max lengths
Varlen = Tuple[torch.Tensor, torch.Tensor, int, int]


class _Layout:
    """Where the kernels find batch element b's tokens. Batched: q (B, H, n_q, p), k/v
    (B, H_kv, n_k, p), per-row outputs (B, H, n_q). Packed (``varlen``): q (total_q, H, p),
    k/v (total_k, H_kv, p), B = number of sequences, n_q/n_k the longest sequence (the grid),
    per-row outputs (H, total_q); the kernels read each sequence's span from the cumulative
    lengths. ``bounds``: the kernels' (N_Q, N_K), the lengths (batched) or the token counts
    total_q, total_k (packed: the spans are clamped to them)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, varlen: Optional[Varlen]):
        self.varlen = varlen is not None
        if varlen is None:
            self.B, self.H, self.n_q, self.p = q.shape
            self.h_kv, self.n_k = k.shape[1], k.shape[2]
            self.rows = (self.B, self.H, self.n_q)
            self.row_strides = (self.H * self.n_q, self.n_q)
            self.cu_q = self.cu_k = q                      # dummy pointers, never read
            self.bounds = (self.n_q, self.n_k)
        else:
            self.cu_q, self.cu_k, self.n_q, self.n_k = varlen
            total_q, self.H, self.p = q.shape
            self.h_kv = k.shape[1]
            for name, cu in (("cu_seqlens_q", self.cu_q), ("cu_seqlens_k", self.cu_k)):
                if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
                    raise ValueError(f"{name} must be a 1-D int32 tensor of cumulative lengths, "
                                     f"got dtype {cu.dtype}, shape {tuple(cu.shape)}")
            if self.cu_k.numel() != self.cu_q.numel():
                raise ValueError(f"cu_seqlens_q describes {self.cu_q.numel() - 1} sequences "
                                 f"but cu_seqlens_k {self.cu_k.numel() - 1}")
            self.B = self.cu_q.numel() - 1
            self.rows = (self.H, total_q)
            self.row_strides = (0, total_q)
            # the kernels' N_Q / N_K: the token counts of q and k (from their shapes), which
            # bound every sequence's span (_seq_span)
            self.bounds = (total_q, k.shape[0])

    @property
    def n_rows(self) -> int:
        return int(torch.Size(self.rows).numel())

    def strides(self, t: torch.Tensor) -> Tuple[int, int, int, int]:
        """(batch, head, token, feature) strides; a packed tensor has batch stride 0."""
        if self.varlen:
            return (0, t.stride(1), t.stride(0), t.stride(2))
        return tuple(t.stride())

    def token_shape(self, heads: int, n: int, total: Optional[int] = None) -> Tuple[int, ...]:
        """Shape of a q/k-like tensor with ``heads`` heads: (B, heads, n, p) or (total, heads, p)."""
        return (total, heads, self.p) if self.varlen else (self.B, heads, n, self.p)

    def args(self):
        return (self.cu_q, self.cu_k, *self.row_strides)


def _mlp_args(mlp: Optional[Mlp], q: torch.Tensor):
    """(Ak, ak, Bk, ck, W1, b1) made contiguous (the kernels index them by shape), L, r and
    the padded widths; dummies without an inducer."""
    if mlp is None:
        return (q,) * 6, 1, 1, 16, 16, False
    ts = tuple(t.contiguous() for t in mlp)
    L, r = ts[0].shape[2], ts[4].shape[2]
    return ts, L, r, max(8, next_pow2(L)), max(8, next_pow2(r)), True


def inducer_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mlp: Optional[Mlp] = None,
    prefix_k: Optional[torch.Tensor] = None, prefix_v: Optional[torch.Tensor] = None,
    key_mask: Optional[torch.Tensor] = None, causal: bool = False, scale: Optional[float] = None,
    u_dtype: Optional[torch.dtype] = None, save_lo: bool = False, varlen: Optional[Varlen] = None,
    decode: Optional[bool] = None, decode_chunk: Optional[int] = None,
    config: Optional[dict] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flash forward. q (B, H, n_q, p); k, v (B, H_kv, n_k, p) with H_kv dividing H (grouped-
    query attention: query head h reads kv head h // (H / H_kv)); mlp = (Ak (H, p, L),
    ak (H, L), Bk (H, L, p), ck (H, p), W1 (H, p, r), b1 (H, r)) or None; prefix_k/v (H, l, p)
    or None; key_mask (B, n_k) bool (True = real key) or None.

    Returns ``out`` (B, H, n_q, p) in q's dtype (contiguous), ``u`` = λ tanh(q W1 + b1)
    (B, H, n_q, r) in ``u_dtype`` (default q's), ``lse`` (B, H, n_q) float32 over the real
    columns (``_EMPTY_LSE`` for rows with none), ``lam`` (2, B, H, n_q) float32 holding λ and
    1 − λ, and ``stats`` (2, B, H, n_q) float32: the row max (base 2) and the reciprocal row
    sum the backward uses to recompute P. ``u`` and ``lam`` are empty without an inducer.
    ``out_lo``: with ``save_lo`` and 16-bit inputs, the rounding residue of ``out`` (same
    shape and dtype; the backward's D_i), else empty. Any strides are accepted.

    ``varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)``: a packed batch,
    q (total_q, H, p), k/v (total_k, H_kv, p); sequence b is rows cu[b]:cu[b+1] of each;
    no key_mask. ``out`` is then (total_q, H, p) and the per-row outputs are (H, total_q)
    (``u`` (H, total_q, r), ``lam``/``stats`` (2, H, total_q)).

    ``decode`` (default: 16-bit inputs with at most 16 queries and 64 query rows per kv
    head, see :meth:`_DecodePlan.chosen`): the split-KV path in one launch — the forward
    kernel with SPLIT_KV, one program per key chunk of ``decode_chunk`` keys (default: sized
    to fill the GPU) and kv head, the last chunk to finish merging them. Same outputs (the
    backward reads the same row statistics).

    ``config``: a launch configuration over the rule's and any tuning table's, for a tuning
    run ({"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}, :data:`ATTN_CANDIDATES`; the
    decode path reads "BLOCK_N", "num_warps", "num_stages", :data:`DECODE_CANDIDATES`).
    """
    lay = _Layout(q, k, varlen)
    B, H, n_q, p, n_k, h_kv = lay.B, lay.H, lay.n_q, lay.p, lay.n_k, lay.h_kv
    if scale is None:
        scale = p ** -0.5
    d_pad = max(16, next_pow2(p))
    BM, BN, warps, stages = _fwd_config(q.dtype, d_pad, q.device, causal, n_k, config)
    (ak_w, ak_b, bk_w, ck, w1, b1), L, r, l_pad, r_pad, has_mlp = _mlp_args(mlp, q)
    f32 = dict(dtype=torch.float32, device=q.device)
    out = _alloc.empty(*lay.token_shape(H, n_q, q.shape[0]), dtype=q.dtype, device=q.device)
    save_lo = bool(save_lo) and q.dtype in (torch.float16, torch.bfloat16)
    out_lo = (_alloc.empty(*lay.rows, p, dtype=q.dtype, device=q.device) if save_lo else
              q.new_empty(0))
    lse = _alloc.empty(*lay.rows, **f32)
    stats = _alloc.empty(2, *lay.rows, **f32)
    if has_mlp:
        lam = _alloc.empty(2, *lay.rows, **f32)
        u = _alloc.empty(*lay.rows, r, dtype=u_dtype or q.dtype, device=q.device)
    else:
        lam = torch.empty(0, **f32)
        u = torch.empty(0, dtype=u_dtype or q.dtype, device=q.device)
    km, smb, has_km = _key_mask_u8(key_mask, q)
    pk, pv, spk, spv, n_prefix, has_prefix = _prefix_args(prefix_k, prefix_v, k)
    if decode is None:
        decode = _DecodePlan.chosen(lay, q.dtype)
    elif decode and not _DecodePlan.applies(lay):
        raise ValueError(f"the decode path takes at most {DECODE_MAX_QUERIES} queries and "
                         f"{DECODE_MAX_ROWS} query rows per kv head, no packed batch")
    ws_acc = ws_ml = count = mrows = lse
    n_ws = chunk = 0
    split_m = 16
    grid = (cdiv(n_q, BM), B * H)
    # prefill: the MLP's rows in a kernel of their own first (the decode path, a few rows
    # per head, keeps them in its prologue/epilogue: no second launch per token)
    mlp_rows = has_mlp and not decode
    if mlp_rows and B * H * n_q > 0:
        mlp_tc = q.dtype in (torch.float16, torch.bfloat16)
        mlp_bm, mlp_chunk, mlp_warps = _mlp_rows_config(d_pad, False, mlp_tc)
        mrows = _alloc.empty(lay.n_rows, r + 1, **f32)
        _inducer_fwd_mlp_kernel[(cdiv(n_q, mlp_chunk), B * H)](
            q, ak_w, ak_b, bk_w, ck, w1, b1, mrows, lay.cu_q, *lay.row_strides,
            *lay.strides(q), H, lay.bounds[0], L, r, float(scale), HEAD_DIM=p, D_PAD=d_pad,
            L_TC=max(16, l_pad), R_TC=max(16, r_pad), BLOCK_M=mlp_bm, CHUNK=mlp_chunk,
            TC=mlp_tc, VARLEN=lay.varlen, num_warps=mlp_warps, num_stages=1)
    if decode and B * H * n_q > 0:
        plan = _DecodePlan(lay, q.device, decode_chunk, config, q.dtype)
        BM, BN, split_m, chunk = plan.block_m, plan.block_n, plan.split_m, plan.chunk
        warps, stages = plan.num_warps, plan.num_stages
        decode = plan.split_kv
        grid = (cdiv(n_q, BM), B * H)
    if decode and B * H * n_q > 0:
        n_ws = B * h_kv * plan.splits * split_m
        ws_acc = torch.empty(n_ws, d_pad, **f32)
        ws_ml = torch.empty(2, n_ws, **f32)
        count = _arrival_counters(q.device, B * h_kv)
        grid = (plan.splits, B * h_kv)
    if B * H * n_q > 0:
        _inducer_attn_fwd_kernel[grid](
            q, k, v, pk, pv, km, ak_w, ak_b, bk_w, ck, w1, b1, mrows, out,
            out_lo if save_lo else out,
            u if has_mlp else lse, lse, lam if has_mlp else lse, stats, lay.n_rows, *lay.args(),
            ws_acc, ws_ml, n_ws, count, chunk,
            *lay.strides(q), *lay.strides(k), *lay.strides(v), *spk, *spv, smb,
            *lay.strides(out), H, H // h_kv, *lay.bounds, n_prefix, L, r, n_k - n_q,
            float(scale), float(scale) * LOG2E,
            HEAD_DIM=p, D_PAD=d_pad, L_PAD=l_pad, R_PAD=r_pad, BLOCK_M=BM, BLOCK_N=BN,
            CAUSAL=bool(causal), HAS_KMASK=has_km, HAS_PREFIX=has_prefix, HAS_MLP=has_mlp,
            SAVE_LO=save_lo, PREC=dot_precision(q.dtype), VARLEN=lay.varlen,
            SPLIT_KV=bool(decode), SPLIT_M=split_m, MLP_ROWS=mlp_rows, num_warps=warps,
            num_stages=stages)
    return out, u, lse, lam, stats, out_lo


def inducer_attention_backward(
    dout: torch.Tensor, du: Optional[torch.Tensor], dlam: Optional[torch.Tensor],
    dlse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, stats: torch.Tensor, lam: Optional[torch.Tensor],
    mlp: Optional[Mlp] = None, prefix_k: Optional[torch.Tensor] = None,
    prefix_v: Optional[torch.Tensor] = None, key_mask: Optional[torch.Tensor] = None,
    causal: bool = False, scale: Optional[float] = None,
    out_lo: Optional[torch.Tensor] = None, varlen: Optional[Varlen] = None,
    configs: Optional[dict] = None,
):
    """Flash backward. Returns ``(dq, dk, dv, dmlp, dprefix_k, dprefix_v)``: ``dmlp`` the
    gradients of (Ak, ak, Bk, ck, W1, b1) (None without an inducer), the prefix grads None
    without a prefix. ``du`` (B, H, n_q, r), ``dlam`` (2, B, H, n_q) (gradients of λ and of
    1 − λ) and ``dlse`` may each be None (zero).

    ``dLSE = dlse − dλ λ (1 − λ)`` and ``ds0 = dλ λ (1 − λ)`` (docs/math.md §3); the kernels use
    ``dS = P ((dP − D) + dLSE)``. 16-bit: ``D_i = ⟨dO_i, out_i + out_lo_i⟩`` (``out_lo``: the
    forward's rounding residue, contiguous; None or empty: from ``out`` alone, which loses
    ~1 % to cancellation in rows with few columns). float32: ``D_i = Σ_j P_ij dP_ij`` from the
    same dP values (``EXACT_DELTA``; a second S / dP pass in the dQ kernel). ``varlen``: as in
    :func:`inducer_attention_forward` (dq, dk, dv packed like q, k, v). ``configs``: {kernel
    name: launch configuration} over the rule's for the dQ / dK/dV kernels (a tuning run).
    """
    lay = _Layout(q, k, varlen)
    B, H, n_q, p, n_k, h_kv = lay.B, lay.H, lay.n_q, lay.p, lay.n_k, lay.h_kv
    group = H // h_kv
    if scale is None:
        scale = p ** -0.5
    d_pad = max(16, next_pow2(p))
    (BM, BN, warps, stages), (BM_KV, BN_KV, warps_kv, stages_kv) = _bwd_config(
        q.dtype, d_pad, q.device, causal, n_k, configs)
    (ak_w, ak_b, bk_w, ck, w1, b1), L, r, l_pad, r_pad, has_mlp = _mlp_args(mlp, q)
    # lam is (2, *rows) with an inducer (also with no rows at all: n_q = 0 must still give
    # zero MLP gradients, not empty ones), (0,) without
    has_mlp = has_mlp and lam is not None and lam.dim() > 1
    has_du = has_mlp and du is not None
    has_dlam = has_mlp and dlam is not None
    du = du.contiguous() if has_du else lse
    dlam = dlam.contiguous() if has_dlam else lse
    has_dlse = dlse is not None
    dlse = dlse.contiguous() if has_dlse else lse
    exact_delta = q.dtype == torch.float32
    has_lo = (not exact_delta) and out_lo is not None and out_lo.numel() > 0
    lse = lse.contiguous()
    delta = _alloc.empty(*lay.rows, dtype=torch.float32, device=q.device)
    adj = _alloc.empty(*lay.rows, dtype=torch.float32, device=q.device)
    km, smb, has_km = _key_mask_u8(key_mask, q)
    pk, pv, spk, spv, n_prefix, has_prefix = _prefix_args(prefix_k, prefix_v, k)
    dq = _alloc.empty(*lay.token_shape(H, n_q, q.shape[0]), dtype=q.dtype, device=q.device)
    dk = _alloc.empty(*lay.token_shape(h_kv, n_k, k.shape[0]), dtype=k.dtype, device=q.device)
    dv = _alloc.empty(*lay.token_shape(h_kv, n_k, k.shape[0]), dtype=v.dtype, device=q.device)
    dpk_part = dpv_part = None
    if has_prefix:
        dpk_part = _alloc.empty(B, H, n_prefix, p, dtype=torch.float32, device=q.device)
        dpv_part = _alloc.empty(B, H, n_prefix, p, dtype=torch.float32, device=q.device)
    prec = dot_precision(q.dtype)
    kw = dict(HEAD_DIM=p, D_PAD=d_pad, CAUSAL=bool(causal), HAS_KMASK=has_km,
              EXACT_DELTA=exact_delta, PREC=prec, VARLEN=lay.varlen)
    kv_kw = dict(BLOCK_M=BM_KV, BLOCK_N=BN_KV, num_warps=warps_kv, num_stages=stages_kv, **kw)
    part = dqm = lse
    if has_mlp:
        # the inducer's rows first (ADJ, its float32 share of dq, the parameter partials)
        mlp_tc = q.dtype in (torch.float16, torch.bfloat16)
        mlp_bm, chunk, mlp_warps = _mlp_rows_config(d_pad, True, mlp_tc)
        grid_c = cdiv(n_q, chunk)
        part_size = 2 * p * L + p * r + p + L + r             # unpadded (see the kernel)
        part = _alloc.empty(grid_c * B, H, part_size, dtype=torch.float32, device=q.device)
        dqm = _alloc.empty(lay.n_rows, p, dtype=torch.float32, device=q.device)
        # 16-bit at p > 64: the dq share and the parameter partials in two launches (one
        # spilled, see _mlp_bwd_rows_tc), the second on 32-row steps
        whats = ((1, mlp_bm), (2, mlp_bm // 2)) if mlp_tc and d_pad > 64 else ((3, mlp_bm),)
        for what, what_bm in whats if B * H * grid_c > 0 else ():
            _inducer_attn_bwd_mlp_kernel[(grid_c, B * H)](
                q, lam, du, dlam, dlse, ak_w, ak_b, bk_w, ck, w1, b1, lay.n_rows, adj, dqm,
                part, lay.cu_q, *lay.row_strides, *lay.strides(q), H, lay.bounds[0], L, r,
                float(scale), HEAD_DIM=p, D_PAD=d_pad, L_PAD=l_pad, R_PAD=r_pad,
                BLOCK_M=max(16, what_bm), CHUNK=chunk, HAS_DU=has_du, HAS_DLAM=has_dlam,
                HAS_DLSE=has_dlse, VARLEN=lay.varlen, TC=mlp_tc, L_TC=max(16, l_pad),
                R_TC=max(16, r_pad), WHAT=what, num_warps=mlp_warps, num_stages=1)
    if B * H * n_q > 0:
        _inducer_attn_bwd_dq_kernel[(cdiv(n_q, BM), B * H)](
            q, k, v, pk, pv, km, dout, out, out_lo if has_lo else out, stats, dlse, dqm,
            lay.n_rows, dq, delta, adj, *lay.args(),
            *lay.strides(dq)[:3], *lay.strides(q), *lay.strides(k), *lay.strides(v), *spk,
            *spv, smb, *lay.strides(dout), *lay.strides(out), H, group, *lay.bounds, n_prefix,
            n_k - n_q, float(scale), float(scale) * LOG2E,
            HAS_PREFIX=has_prefix, HAS_MLP=has_mlp, HAS_DLSE=has_dlse, HAS_LO=has_lo,
            BLOCK_M=BM, BLOCK_N=BN, num_warps=warps, num_stages=stages, **kw)
    if B * h_kv * n_k > 0:
        _inducer_attn_bwd_dkdv_kernel[(cdiv(n_k, BN_KV), B * h_kv)](
            q, k, v, km, dout, stats, lay.n_rows, delta, adj, dk, dv, *lay.args(),
            *lay.strides(dk)[:3], *lay.strides(q), *lay.strides(k), *lay.strides(v), smb,
            *lay.strides(dout), H, h_kv, group, *lay.bounds, n_k - n_q, float(scale) * LOG2E,
            float(scale), IS_PREFIX=False, **kv_kw)
    if has_prefix and B * H > 0:
        _inducer_attn_bwd_dkdv_kernel[(cdiv(n_prefix, BN_KV), B * H)](
            q, pk, pv, km, dout, stats, lay.n_rows, delta, adj, dpk_part, dpv_part, *lay.args(),
            *dpk_part.stride()[:3], *lay.strides(q), 0, *spk, 0, *spv, smb, *lay.strides(dout),
            H, H, 1, lay.bounds[0], n_prefix, n_k - n_q, float(scale) * LOG2E, float(scale),
            IS_PREFIX=True, **kv_kw)
    dpk = dpv = None
    if has_prefix:
        dpk = dpk_part.sum(0).to(prefix_k.dtype)
        dpv = dpv_part.sum(0).to(prefix_v.dtype)
    dmlp = None
    if has_mlp:
        dmlp = _mlp_grads(part, H, p, L, r, mlp)
    return dq, dk, dv, dmlp, dpk, dpv


def _mlp_grads(part, H, p, L, r, mlp):
    """Sum the dQ tiles' partials (fixed order: deterministic) into the MLP gradients."""
    if part.shape[0] == 0:
        return tuple(torch.zeros_like(t) for t in mlp)
    tot = part.sum(0)                                           # (H, part_size)
    sizes = (p * L, L * p, p, L, r, p * r)
    d_ak, d_bk, d_ck, d_akb, d_b1, d_w1 = tot.split(sizes, dim=1)
    grads = (d_ak.view(H, p, L), d_akb, d_bk.view(H, L, p), d_ck, d_w1.view(H, p, r), d_b1)
    # copies: views of one buffer would make the custom op's outputs alias each other
    return tuple(g.to(dtype=t.dtype, memory_format=torch.contiguous_format, copy=True)
                 for g, t in zip(grads, mlp))
