"""The shared machinery of the fused per-head projections (docs/math.md §2): the augmented GEMM, the
rank-space backward pass and the packing of low-rank rows per output tile. The ops' host
functions live in headwise_qkv.py (q|k|v, also every single projection) and
headwise_oproj.py (output projection); headwise_lowrank.py keeps its own small kernels.

Design: every adapted projection is a frozen GEMM whose B operand is *augmented* by a few
low-rank rows, and every rank-space product runs on the tensor cores in the input dtype with
float32 accumulation (float32 inputs: exact "ieee" dots). Two kernels do all the work:

``_gemm_kernel``       C = Σ_i A_i B_i (+ bias), up to four K segments with their own strides
                       (so ``[dY_q | dY_k | dY_v | dZ] · [W_q; W_k; W_v; D]`` is one GEMM
                       although the frozen weights are separate tensors or Conv1D views),
                       optional split-K (float32 partials, summed on the host in a fixed
                       order: deterministic token reductions without float64), and the
                       optional *packed low-rank epilogue*: output column tile l also runs
                       ``Z_l = A_0 D_lᵀ + zb_l`` inside its K-loop (D_l: the RB down-projection
                       rows whose up-projection touches tile l's columns, packed together:
                       per-head rows of every head in the tile and the shared LoRA rows, one
                       ≥16-wide block instead of 16 columns per head), rounds Z_l to the input
                       dtype (as the same-precision torch path rounds its rank-space
                       intermediates), stores it for the backward and adds ``Z_l U_lᵀ`` before
                       the tile is written. The frozen GEMM and every down-projection that
                       reads X (Kernel-wise A_h, lite bases A_h W_k^h, shared A_s) are thus one
                       pass over X.
``_lr_rank_bwd_kernel`` one pass over the output gradient of the adapted sections (q and v in
                       one launch): dZ_l = dY_l U_l (written once, in the input dtype), the
                       up-projection gradient Σ_t Z_lᵀ dY_l, the rank-space bias gradient
                       Σ_t dZ_l and the output bias gradient Σ_t dY (split over tokens,
                       float32 partials).
The small kernels around them (packing the factors per tile, unpacking their gradients) also
take both adapted sections in one launch each: at GPT-2 widths a launch costs about as much as
a tile pass over the rank space.

Passes (q|k|v projection):
  forward   Y = X [W; D]ᵀ + packed up-projection epilogue            (one GEMM, Z stored)
  backward  rank pass over dY (dZ, dU, dzb, db); dX = [dY | dZ]·[W; D] (one GEMM);
            dD = dZᵀ X (token reduction; cuBLAS for 16-bit on a GPU, split-K here otherwise).
  folded    (16-bit; exact=False, or exact=None on a GPU where fold_plan predicts it pays)
            W' = [W_q + U·D; W_k; W_v + U·D] and b' = b + c + U·zb (_qkv_fold_kernel, one
            launch, one rounding); forward Y = X W'ᵀ + b' (cuBLAS on a GPU), no Z stored;
            backward: Z = X Dᵀ + zb by one GEMM (rank_space), then the rank pass, W'
            folded again, dX = dY W' (cuBLAS). fold_plan may also fold dX alone (forward exact).
Output projection (the down-projection reads O head by head, the up-projection spans every
output column, so Z cannot be finished inside one output tile):
  forward   Z = O D_oᵀ (D_o: block-diagonal A_h plus A_s, thin GEMM), Y = [O | Z]·[W_o | B]ᵀ
  backward  dZ = dY B; dO = [dY | dZ]·[W_o; D_o] (one GEMM); dB = dYᵀ Z; dD_o = dZᵀ O.
  folded (16-bit, exact=False; W' = W_o + B D_o): [Y | Z] = O·[W'; D_o]ᵀ and
            [dO | dZ] = dY·[W' | B] (one GEMM each, the second output of ``gemm``), then the
            two token reductions. Where the buffer is no larger than Z (oproj_keeps_fold:
            GPT-2 widths at 16k tokens) one fold launch writes both operands as
            [[W', B], [D_o, 0]] and the backward reuses it (no second fold).

Roofline (PREDICTED, not measured: ``python benchmarks/bench_headwise.py --roofline``; H100
SXM, 700 TFLOP/s sustained bf16 tensor-core rate, 3.0 TB/s HBM, T = 16k tokens). For 16-bit
inputs every product is a tensor-core product (sm_90 SASS: HGMMA, no FFMA, no local-memory
spills in any config); CUDA-core work is only epilogue adds and column sums, O(T·N). Extra
work over the frozen projections: (a) RB/BN extra MMA columns per tile for the packed
down-projection in the forward (12.5 % at RB = 16, 25-50 % for Kernel-mix(qvo) intermediate
at p = 64, where v's 8 lite rows are doubled by the hi/lo split) and W/BN for the dZ segment
of dX (W <= RB: the slots a tile stores, 19-31 % there), (b) one extra read of dY (rank pass)
and of X (dD), (c) for the output projection a pass over O (Z) and two over dY (dZ, dB).
Predicted time / frozen, fwd+bwd (``kfused perf``, kernels and glue, each q|k|v case on the
path fold_plan picks: all folded at 16k tokens): GPT-2 small 1.50-1.56 (qkv), 1.88 (o); GPT-2
medium 1.35-1.44, 1.77; Llama-7B GQA 1.15-1.19, 1.23.
At GPT-2 widths every tiny launch (~3 µs) counts as much as a kernel pass: the factors reach
the kernels with no torch op in any forward (a lite section's basis, split and stacking:
one ``headwise_section`` kernel; per-head biases: the GEMM's second bias; the output
projection's D_o and [B_w | scale·B_s]: one pack kernel), nor in any backward (the bias
gradients' column sums are stored in the biases' dtype; tests/test_headwise_launches.py
holds the counts).
"""

from __future__ import annotations

import collections
import functools
import weakref
from typing import Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from kfused import _alloc, tuning
from kfused.triton_kernels._common import (_AOT_TARGET, _INTERPRETED, _blk, _grouped_tile, _mm,
                                           _rblk, _row_block_sum, _splits, F32, cdiv,
                                           dot_precision, targets_gpu)


def _tile_n(device: torch.device) -> int:
    """Output column tile of the augmented GEMM (fixed per device: the low-rank packing
    depends on it). 128 on a GPU; 32 in the interpreter so small test shapes have several
    tiles and heads that straddle tile edges."""
    return 128 if targets_gpu(device) else 32


# ------------------------------------------------------------------------------------------
# Autotuning. Under the interpreter a single small config keeps CI fast; on a GPU a small set
# of >= 64x128 tiles with software pipelining. The sm_90 compile check (_aot) compiles each.

# sm_90 compile check (16-bit): every 16-bit config below compiles to HGMMA (wgmma) with no
# local-memory spills; (BM 128, 4 warps) spilled 350-600 B and was dropped. float32 ("ieee"
# dots on the CUDA cores: the exactness docs/math.md §4 asks of float32) gets its own smaller tile:
# BM 128 spilled up to 1.7 KB there.
if bool(_INTERPRETED):
    _GEMM_CONFIGS = [triton.Config({"BM": 32, "BK": 32}, num_warps=4, num_stages=1)]
else:
    _GEMM_CONFIGS = [
        triton.Config({"BM": 128, "BK": 64}, num_warps=8, num_stages=3),
        triton.Config({"BM": 128, "BK": 64}, num_warps=8, num_stages=4),
        triton.Config({"BM": 64, "BK": 64}, num_warps=4, num_stages=4),
        triton.Config({"BM": 128, "BK": 32}, num_warps=8, num_stages=4),
        triton.Config({"BM": 64, "BK": 32}, num_warps=8, num_stages=2),   # float32 only
    ]


def _prune(configs, named_args, **kwargs):
    if len(configs) == 1:
        return configs
    f32 = named_args["a0_ptr"].dtype == torch.float32
    return configs[-1:] if f32 else configs[:-1]


_AOT_ALL_CONFIGS = [True]  # the compile check compiles every config on one shape only


def _launch(kernel, grid, args: Sequence, kwargs: dict) -> None:
    """Launch an autotuned kernel; while _aot records launches for the sm_90 compile check,
    record one launch per config instead (autotuning would time them on a GPU)."""
    if _AOT_TARGET["on"]:
        cfgs = _prune(kernel.configs, dict(zip(kernel.fn.arg_names, args)))
        for cfg in (cfgs if _AOT_ALL_CONFIGS[0] else cfgs[:1]):
            meta = {**kwargs, **cfg.kwargs}
            g = grid(meta) if callable(grid) else grid
            kernel.fn[g](*args, **meta, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return
    kernel[grid](*args, **kwargs)


# ------------------------------------------------------------------------------------------
# The augmented GEMM


@triton.jit
def _seg_loop(acc, a_ptr, s_am, s_ak, b_ptr, s_bk, s_bn, K, rm, rn, mmask, nmask,
              BK: tl.constexpr, PREC: tl.constexpr, cs_ptr, k_cs, CS: tl.constexpr,
              CS_BM: tl.constexpr = 16, cs_left=0):
    # CS: also store the column sums of A's rows per CS_BM-row slice (float32): slice i <
    # cs_left of this row block at cs_ptr + i·K + k, for k < k_cs (the same rows whatever BM
    # the autotuner picks)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        kmask = ks < K
        a = tl.load(a_ptr + rm[:, None] * s_am + ks[None, :] * s_ak,
                    mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptr + ks[:, None] * s_bk + rn[None, :] * s_bn,
                    mask=kmask[:, None] & nmask[None, :], other=0.0)
        acc += _mm(a, b, True, PREC)
        if CS:
            BMq: tl.constexpr = a.shape[0] // CS_BM
            part = tl.sum(tl.reshape(a.to(tl.float32), (BMq, CS_BM, BK)), axis=1)
            sl = tl.arange(0, BMq)
            tl.store(cs_ptr + sl[:, None] * K + ks[None, :], part,
                     mask=(ks < k_cs)[None, :] & (sl < cs_left)[:, None])
    return acc


@triton.autotune(configs=_GEMM_CONFIGS, key=["M", "N", "K0", "K1", "K2", "K3", "NSEG", "LR",
                                               "SPLIT", "BN", "RB"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _gemm_kernel(a0_ptr, s_a0m, s_a0k, b0_ptr, s_b0k, s_b0n, K0,
                 a1_ptr, s_a1m, s_a1k, b1_ptr, s_b1k, s_b1n, K1,
                 a2_ptr, s_a2m, s_a2k, b2_ptr, s_b2k, s_b2n, K2,
                 a3_ptr, s_a3m, s_a3k, b3_ptr, s_b3k, s_b3n, K3,
                 bias_ptr, bias2_ptr, c_ptr, s_cm, s_cn, M, N, K_PER,
                 d_ptr, zb_ptr, u_ptr, z_ptr, s_zm, lr_scale, LR_RS, LR_W, cs_ptr,
                 c2_ptr, s_c2m, N1,
                 BN: tl.constexpr, RB: tl.constexpr, NSEG: tl.constexpr, LR: tl.constexpr,
                 SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_BIAS2: tl.constexpr,
                 PREC: tl.constexpr, LR_SCALE: tl.constexpr, COLSUM: tl.constexpr,
                 CS_BM: tl.constexpr, OUT2: tl.constexpr,
                 BM: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr = 8):
    # grid: (cdiv(M, BM) * cdiv(N, BN), S). Grouped order: GROUP row blocks share the B
    # columns in L2. SPLIT: program s reduces K0 range [s*K_PER, (s+1)*K_PER) of the single
    # segment and writes float32 partials c[s] (contiguous (S, M, N)). OUT2: columns [N1, N)
    # go to c2 (column n − N1, unit column stride) instead of c; the biases cover [0, N1).
    pid = tl.program_id(0)
    s = tl.program_id(1)
    pid_m, pid_n = _grouped_tile(pid, tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mmask = rm < M
    nmask = rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if SPLIT:
        k_lo = s * K_PER
        k_hi = tl.minimum(k_lo + K_PER, K0)
        acc = _seg_loop(acc, a0_ptr + k_lo * s_a0k, s_a0m, s_a0k, b0_ptr + k_lo * s_b0k,
                        s_b0k, s_b0n, k_hi - k_lo, rm, rn, mmask, nmask, BK, PREC,
                        cs_ptr, 0, False)
        tl.store(c_ptr + (s * M + rm[:, None]) * N + rn[None, :], acc,
                 mask=mmask[:, None] & nmask[None, :])
    else:
        if LR:
            # Segment 0 with the packed down-projection of this column tile (pid_n): LR_W
            # slots (the tile's stride in D, zb, U and Z), computed as an RB-wide block.
            rr = tl.arange(0, RB)
            wmask = rr < LR_W
            z = tl.zeros((BM, RB), dtype=tl.float32)
            for k0 in range(0, K0, BK):
                ks = k0 + tl.arange(0, BK)
                kmask = ks < K0
                a = tl.load(a0_ptr + rm[:, None] * s_a0m + ks[None, :] * s_a0k,
                            mask=mmask[:, None] & kmask[None, :], other=0.0)
                b = tl.load(b0_ptr + ks[:, None] * s_b0k + rn[None, :] * s_b0n,
                            mask=kmask[:, None] & nmask[None, :], other=0.0)
                acc += _mm(a, b, True, PREC)
                dt = tl.load(d_ptr + (pid_n * LR_W + rr[None, :]) * K0 + ks[:, None],
                             mask=kmask[:, None] & wmask[None, :], other=0.0)
                z += _mm(a, dt, True, PREC)
            z += tl.load(zb_ptr + pid_n * LR_W + rr, mask=wmask, other=0.0)[None, :]
            zl = z.to(z_ptr.dtype.element_ty)
            tl.store(z_ptr + rm[:, None] * s_zm + pid_n * LR_W + rr[None, :], zl,
                     mask=mmask[:, None] & wmask[None, :])
            cn = tl.arange(0, BN)
            u = tl.load(u_ptr + (pid_n * LR_W + rr[:, None]) * BN + cn[None, :],
                        mask=wmask[:, None], other=0.0)
            if LR_SCALE:    # shared rows: round(scale·Z) against B_s (U holds it unscaled)
                zl = tl.where((rr < LR_RS)[None, :],
                              (zl.to(tl.float32) * lr_scale).to(zl.dtype), zl)
            acc += _mm(zl, u, True, PREC)
        else:
            # COLSUM: the first column tile of each row block also stores segment 0's
            # column sums (the output projection's bias gradient, read once with dY)
            acc = _seg_loop(acc, a0_ptr, s_a0m, s_a0k, b0_ptr, s_b0k, s_b0n, K0, rm, rn,
                            mmask, nmask, BK, PREC, cs_ptr + pid_m * (BM // CS_BM) * K0,
                            tl.where(pid_n == 0, K0, 0), COLSUM, CS_BM,
                            tl.cdiv(M, CS_BM) - pid_m * (BM // CS_BM))
        if NSEG > 1:
            acc = _seg_loop(acc, a1_ptr, s_a1m, s_a1k, b1_ptr, s_b1k, s_b1n, K1, rm, rn,
                            mmask, nmask, BK, PREC, cs_ptr, 0, False)
        if NSEG > 2:
            acc = _seg_loop(acc, a2_ptr, s_a2m, s_a2k, b2_ptr, s_b2k, s_b2n, K2, rm, rn,
                            mmask, nmask, BK, PREC, cs_ptr, 0, False)
        if NSEG > 3:
            acc = _seg_loop(acc, a3_ptr, s_a3m, s_a3k, b3_ptr, s_b3k, s_b3n, K3, rm, rn,
                            mmask, nmask, BK, PREC, cs_ptr, 0, False)
        n1mask = rn < N1
        if HAS_BIAS:
            # bias2: a second vector summed with the first in float32 (the per-head biases c
            # beside the frozen bias: no host-side fold)
            bias = tl.load(bias_ptr + rn, mask=n1mask, other=0.0).to(tl.float32)
            if HAS_BIAS2:
                bias += tl.load(bias2_ptr + rn, mask=n1mask, other=0.0).to(tl.float32)
            acc += bias[None, :]
        tl.store(c_ptr + rm[:, None] * s_cm + rn[None, :] * s_cn,
                 acc.to(c_ptr.dtype.element_ty), mask=mmask[:, None] & n1mask[None, :])
        if OUT2:
            r2 = tl.maximum(rn - N1, 0)
            tl.store(c2_ptr + rm[:, None] * s_c2m + r2[None, :],
                     acc.to(c2_ptr.dtype.element_ty),
                     mask=mmask[:, None] & (nmask & (rn >= N1))[None, :])


class LowRankTiles:
    """Packed low-rank epilogue operands of one output section for the augmented GEMM.

    D (L, W, K) and U (L, W, BN) in the input dtype, zb (L, W) float32; z: the (T, L·W)
    view of the rank-space buffer where the forward stores Z (input dtype). W: the slots of
    each tile (its stride in all four); the kernels compute on RB = _rblk(W) wide blocks
    (a power of 2, >= 16) with the slots past W masked. ``scale`` multiplies the RS shared
    rows of every tile (slots [0, RS)), whose U holds B_s unscaled.
    """

    __slots__ = ("D", "zb", "U", "z", "scale", "RS", "W", "RB", "scaled")

    def __init__(self, D, zb, U, z, scale: float = 1.0, RS: int = 0):
        self.D, self.zb, self.U, self.z = D, zb, U, z
        self.scale, self.RS = float(scale), int(RS)
        # (plain attributes: the launches read them on every call)
        self.W = D.shape[1]
        self.RB = _rblk(self.W)
        self.scaled = self.RS > 0 and self.scale != 1.0

    def with_z(self, z) -> "LowRankTiles":
        """The same tiles reading the rank-space buffer view ``z``."""
        out = LowRankTiles.__new__(LowRankTiles)
        out.D, out.zb, out.U, out.z = self.D, self.zb, self.U, z
        out.scale, out.RS, out.W, out.RB, out.scaled = (self.scale, self.RS, self.W, self.RB,
                                                         self.scaled)
        return out


_CS_BM = min(c.kwargs["BM"] for c in _GEMM_CONFIGS)


def colsum_rows(M: int) -> int:
    """Rows of :func:`gemm`'s column-sum partials: one per slice of _CS_BM rows of A_0 (the
    smallest BM of the configs)."""
    return cdiv(M, _CS_BM)


def gemm(segs: Sequence[Tuple[torch.Tensor, torch.Tensor]], out: torch.Tensor,
         bias: Optional[torch.Tensor] = None, lr: Optional[LowRankTiles] = None,
         bias2: Optional[torch.Tensor] = None,
         colsum: Optional[torch.Tensor] = None, config: Optional[dict] = None,
         out2: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out (M, N) = Σ_i A_i B_i (+ bias + bias2) (+ packed low-rank epilogue)``.

    out2: an (M, N2) view with unit column stride: the B_i then have N + N2 columns and the
    last N2 of the product go to out2 (no bias there; e.g. an output and the rank-space Z of
    the same A from one GEMM over an appended weight); not with ``lr``.

    segs: up to four (A_i (M, K_i), B_i (K_i, N)) pairs, any strides (views, transposes,
    expands); all in one dtype. out: an (M, N) view (any strides) in any float dtype. The
    low-rank epilogue (``lr``) reads segment 0's A. bias, bias2: contiguous (N,) vectors in
    any float dtype, summed in float32. colsum: a float32 (colsum_rows(M), K_0) buffer that
    receives segment 0's column sums per slice of _CS_BM rows (every row written, whatever
    tile the autotuner picks: their sum over rows is Σ_m A_0[m, :]); not with ``lr``.
    config: launch with these meta-parameters (BM, BK, num_warps, num_stages) instead of
    the autotuned ones (tests).
    """
    assert colsum is None or lr is None
    assert out2 is None or (lr is None and out2.shape[0] == out.shape[0]
                            and (out2.shape[1] <= 1 or out2.stride(1) == 1))
    if bias is None:
        bias, bias2 = bias2, None
    M, N1 = out.shape
    N = N1 + (out2.shape[1] if out2 is not None else 0)
    assert 1 <= len(segs) <= 4
    if M == 0 or N == 0:
        return out
    dev = out.device
    BN = _tile_n(dev)
    segs = list(segs)
    nseg = len(segs)
    dt = segs[0][0].dtype
    while len(segs) < 4:
        segs.append(segs[0])
    flat = []
    for i, (a, b) in enumerate(segs):
        flat += [a, a.stride(0), a.stride(1), b, b.stride(0), b.stride(1),
                 a.shape[1] if i < nseg else 0]
    if lr is not None:
        lra = [lr.D, lr.zb, lr.U, lr.z, lr.z.stride(0), lr.scale, lr.RS, lr.W]
        RB = lr.RB
    else:
        lra = [out, out, out, out, 0, 1.0, 0, 0]
        RB = 16
    lra.append(colsum if colsum is not None else out)
    grid = lambda meta: (cdiv(M, meta["BM"]) * cdiv(N, BN), 1)  # noqa: E731
    o2 = out2 if out2 is not None and out2.numel() else None
    args = [*flat, bias if bias is not None else out, bias2 if bias2 is not None else out,
            out, out.stride(0), out.stride(1), M, N, 0, *lra,
            o2 if o2 is not None else out, o2.stride(0) if o2 is not None else 0, N1]
    kw = dict(BN=BN, RB=RB, NSEG=nseg, LR=lr is not None, SPLIT=False,
              HAS_BIAS=bias is not None, HAS_BIAS2=bias2 is not None, PREC=dot_precision(dt),
              LR_SCALE=lr is not None and lr.scaled, COLSUM=colsum is not None, CS_BM=_CS_BM,
              OUT2=o2 is not None)
    if config is not None:
        _gemm_kernel.fn[grid({**kw, **config})](*args, **kw, **config)
    else:
        _launch(_gemm_kernel, grid, args, kw)
    return out


def reduce_tokens(a_t: torch.Tensor, b: torch.Tensor, partials: bool = False) -> torch.Tensor:
    """``a_tᵀ b`` in float32 for a (T, M) and b (T, N), any strides: the token reductions of
    the factor gradients. 16-bit on a GPU: cuBLAS (no fusion needed, float32 accumulation,
    deterministic). Otherwise the split-K Triton GEMM with exact float32 ("ieee") dots and
    float32 partials summed in a fixed order — deterministic, no float64 accumulators.

    partials=True: return the unsummed (S, M, N) partials instead (the cuBLAS result as
    (1, M, N) in the input dtype), for a consumer that sums them itself (the unpack kernel)."""
    T, M = a_t.shape
    N = b.shape[1]
    dev = b.device
    if T == 0 or M == 0 or N == 0:
        z = torch.zeros(M, N, dtype=F32, device=dev)
        return z[None] if partials else z
    if dev.type == "cuda" and b.dtype in (torch.float16, torch.bfloat16):
        # cuBLAS accumulates in float32 and rounds its output to the input dtype.
        r = torch.matmul(a_t.t(), b)
        return r[None] if partials else r.float()
    BN = _tile_n(dev)
    BM_max = 128 if targets_gpu(dev) else 32
    programs = cdiv(M, BM_max) * cdiv(N, BN)
    S = _splits(dev, T, programs)
    K_PER = cdiv(cdiv(T, S), 64) * 64
    S = cdiv(T, K_PER)
    part = _alloc.empty(S, M, N, dtype=F32, device=dev)
    at = a_t.t()
    grid = lambda meta: (cdiv(M, meta["BM"]) * cdiv(N, BN), S)  # noqa: E731
    segs = [at, at.stride(0), at.stride(1), b, b.stride(0), b.stride(1), T] + \
        [at, 0, 0, b, 0, 0, 0] * 3
    _launch(_gemm_kernel, grid,
            [*segs, part, part, part, 0, 0, M, N, K_PER, part, part, part, part, 0, 1.0, 0, 0,
             part, part, 0, N],
            dict(BN=BN, RB=16, NSEG=1, LR=False, SPLIT=True, HAS_BIAS=False, HAS_BIAS2=False,
                 PREC=dot_precision(b.dtype), LR_SCALE=False, COLSUM=False, CS_BM=_CS_BM,
                 OUT2=False))
    if partials:
        return part
    return part.sum(0) if S > 1 else part[0]


# ------------------------------------------------------------------------------------------
# Rank-space backward of a packed section


@triton.jit
def _lr_rank_tile(l, s, g_ptr, s_gm, s_gn, N, z_ptr, s_zm, u_ptr, dz_ptr, s_dzm,
                  du_ptr, dzb_ptr, db_ptr, T, T_PER, L, scale, RS, W,
                  BT: tl.constexpr, BN: tl.constexpr, RB: tl.constexpr,
                  PREC: tl.constexpr, SH_SCALE: tl.constexpr, ONES: tl.constexpr):
    # Tile l, token split s of one section. One pass over dY's tile columns: dZ_l = dY_l U_lᵀ
    # (stored in the input dtype), partials of U_l's gradient Z_lᵀ dY_l, of Σ_t dZ_l (float32,
    # before rounding) and of the bias gradient Σ_t dY_l. SH_SCALE: the shared rows (slots
    # [0, RS) of every tile) take dZ = round(scale·dY_l) U_lᵀ, rounding the scaled gradient
    # first as the same-precision torch path does (U holds B_s unscaled). U, Z and dZ hold W
    # slots per tile (their tile stride); the partials RB (the slots past W are zero).
    # ONES (W < RB, host-decided): slot W of Z, padding, reads 1, so row W of the Z_lᵀ dY_l
    # dot is Σ_t dY_l — the bias gradient from the tensor cores, with no reduction across
    # the token rows in the loop — and Σ_t dZ_l = (Σ_t dY_l) U_lᵀ once after it (not with
    # SH_SCALE, whose shared rows sum round(scale·dY_l) U_lᵀ).
    cn = tl.arange(0, BN)
    rn = l * BN + cn
    nmask = rn < N
    rr = tl.arange(0, RB)
    wmask = rr < W
    ut = tl.load(u_ptr + (l * W + rr[None, :]) * BN + cn[:, None], mask=wmask[None, :],
                 other=0.0)  # (BN, RB) = U_lᵀ
    du = tl.zeros((RB, BN), dtype=tl.float32)
    dzb = tl.zeros((RB,), dtype=tl.float32)
    db = tl.zeros((BN,), dtype=tl.float32)
    t_lo = s * T_PER
    t_hi = tl.minimum(t_lo + T_PER, T)
    # Z's tile columns start at l·W, W any slot count: the compiler cannot prove them aligned,
    # so Z's loads are element-wise and outside Triton's asynchronous pipeline (sm_90 TTGIR:
    # a plain tt.load with sizePerThread [1, 1], against dY's 16-byte async copies) — a DRAM
    # round trip inside every step. Each step's Z is loaded one step ahead instead
    # (registers), so that round trip overlaps the step before.
    bt = tl.arange(0, BT)
    z_next = tl.load(z_ptr + (t_lo + bt)[:, None] * s_zm + l * W + rr[None, :],
                     mask=((t_lo + bt) < t_hi)[:, None] & wmask[None, :], other=0.0)
    for t0 in range(t_lo, t_hi, BT):
        rt = t0 + bt
        tmask = rt < t_hi
        z = z_next
        rt_n = rt + BT
        z_next = tl.load(z_ptr + rt_n[:, None] * s_zm + l * W + rr[None, :],
                         mask=(rt_n < t_hi)[:, None] & wmask[None, :], other=0.0)
        g = tl.load(g_ptr + rt[:, None] * s_gm + rn[None, :] * s_gn,
                    mask=tmask[:, None] & nmask[None, :], other=0.0)
        if ONES:
            z = tl.where((rr == W)[None, :], 1.0, z).to(g.dtype)
        dz = _mm(g, ut, True, PREC)
        if SH_SCALE:
            gs = (g.to(tl.float32) * scale).to(g.dtype)
            dz = tl.where((rr < RS)[None, :], _mm(gs, ut, True, PREC), dz)
        tl.store(dz_ptr + rt[:, None] * s_dzm + l * W + rr[None, :],
                 dz.to(dz_ptr.dtype.element_ty), mask=tmask[:, None] & wmask[None, :])
        if not ONES or SH_SCALE:
            dzb += tl.sum(dz, axis=0)
        du += _mm(tl.trans(z), g, True, PREC)
        if not ONES:
            db += tl.sum(g.to(tl.float32), axis=0)
    if ONES:
        onerow = (rr == W)[:, None]
        db = tl.sum(tl.where(onerow, du, 0.0), axis=0)
        du = tl.where(onerow, 0.0, du)
        if not SH_SCALE:
            dzb = tl.sum(db[:, None] * ut.to(tl.float32), axis=0)
    base = s * L + l
    tl.store(du_ptr + (base * RB + rr[:, None]) * BN + cn[None, :], du)
    tl.store(dzb_ptr + base * RB + rr, dzb)
    tl.store(db_ptr + s * N + rn, db, mask=nmask)


@triton.jit
def _lr_rank_bwd_kernel(T, T_PER,
                        a_g, a_sgm, a_sgn, a_N, a_z, a_szm, a_u, a_dz, a_sdzm, a_du, a_dzb,
                        a_db, a_L, a_scale, a_RS, a_W,
                        b_g, b_sgm, b_sgn, b_N, b_z, b_szm, b_u, b_dz, b_sdzm, b_du, b_dzb,
                        b_db, b_L, b_scale, b_RS, b_W,
                        BT: tl.constexpr, BN: tl.constexpr, A_RB: tl.constexpr,
                        B_RB: tl.constexpr, PREC: tl.constexpr, A_SH_SCALE: tl.constexpr,
                        B_SH_SCALE: tl.constexpr, A_ONES: tl.constexpr,
                        B_ONES: tl.constexpr):
    # grid: (L_a + L_b tiles, S token splits), up to two sections in one launch (the q and v
    # sections of a q|k|v projection; L_b = 0 for one): program (l, s) runs tile l of
    # section a or tile l − L_a of section b (_lr_rank_tile), each with its own RB.
    l = tl.program_id(0)
    s = tl.program_id(1)
    if l < a_L:
        _lr_rank_tile(l, s, a_g, a_sgm, a_sgn, a_N, a_z, a_szm, a_u, a_dz, a_sdzm, a_du, a_dzb,
                      a_db, T, T_PER, a_L, a_scale, a_RS, a_W, BT, BN, A_RB, PREC, A_SH_SCALE,
                      A_ONES)
    else:
        _lr_rank_tile(l - a_L, s, b_g, b_sgm, b_sgn, b_N, b_z, b_szm, b_u, b_dz, b_sdzm, b_du,
                      b_dzb, b_db, T, T_PER, b_L, b_scale, b_RS, b_W, BT, BN, B_RB, PREC,
                      B_SH_SCALE, B_ONES)


# Candidates of the rank pass timed by benchmarks/tune_kernels.py on a GPU (16-bit): (tokens
# per step, warps, stages), the rule's first. sm_90 (triton 3.6, GPT-2 small q|k|v,
# Kernel-mix qvo-intermediate: RB 32 and 64, BN 128): none spills; 8 warps 172-188
# registers (1 CTA per SM), 4 warps 220-255 (2 CTAs per SM at 2 stages, 1 at 128 tokens and
# 3-4 stages). The H100 of 2026-11-27 ran the rule's (64, 8, 3) at 92.5 µs against 30.4 µs
# predicted (before its loop lost its two reductions): one CTA of 8 warps per SM and a
# dependent chain per step, which more tokens per step or more stages in flight may hide.
RANK_CANDIDATES = ((64, 8, 3), (64, 8, 4), (128, 8, 2), (128, 8, 3), (64, 4, 2), (32, 4, 4))
_RANK_TUNE_MIN_T = 2048


def rank_tuning_key(items, elem_bytes: int) -> dict:
    """The shape key of the rank pass's entries in a tuning table: per section its tiles,
    slots, shared rows and whether they are scaled, the tile width, the element size."""
    return {"sections": [[lr.U.shape[0], lr.W, lr.RS, bool(lr.scaled)] for _, lr, _ in items],
            "BN": int(items[0][1].U.shape[2]), "elem_bytes": int(elem_bytes)}


def rank_config(dev: torch.device, dtype: torch.dtype, T: int, key, config=None) -> dict:
    """The rank pass's launch configuration ({"BT", "num_warps"[, "num_stages"]}): the rule's
    (sm_90: 4 warps spilled at RB = 32; float32, CUDA-core dots, takes the smaller token
    tile), ``config`` over it, else on a CUDA device (16-bit, T >= _RANK_TUNE_MIN_T) the
    measured one of a tuning table for the sections ``key()`` names."""
    gpu = targets_gpu(dev)
    cfg = {"BT": 64 if gpu and dtype != F32 else 32, "num_warps": 8 if gpu else 4}
    if (config is None and dev.type == "cuda" and T >= _RANK_TUNE_MIN_T
            and dtype in (torch.float16, torch.bfloat16)):
        config = tuning.lookup("_lr_rank_bwd_kernel", dev, key(), T, rank_candidates())
    if config:
        cfg.update({k: int(v) for k, v in config.items()
                    if k in ("BT", "num_warps", "num_stages")})
    return cfg


def rank_candidates() -> list:
    """The rank pass's launch configurations a GPU run times ({"BT", "num_warps",
    "num_stages"}), the rule's first."""
    return [{"BT": bt, "num_warps": w, "num_stages": st} for bt, w, st in RANK_CANDIDATES]


def lr_rank_backward_sections(items, config: Optional[dict] = None) -> list:
    """The rank pass of one or two sections in one launch. items: per section (g, lr, dz):
    g (T, N) view of the section's output gradient, its LowRankTiles (lr.z: the forward's Z,
    or :func:`rank_space` of X after a folded forward), dz (T, L·W) view to fill. Returns
    per section the float32 token-split partials (dU (S, L, RB, BN), dzb (S, L, RB),
    db (S, N)) with RB = lr.RB (slots past W zero), S shared.

    ``config`` ({"BT", "num_warps", "num_stages"}, e.g. one of :func:`rank_candidates`):
    launch with it; otherwise, 16-bit on a CUDA device with T >= _RANK_TUNE_MIN_T, the
    configuration this GPU model timed fastest for these sections (:mod:`kfused.tuning`,
    benchmarks/tune_kernels.py), else the rule's."""
    assert 1 <= len(items) <= 2
    T = items[0][0].shape[0]
    g0 = items[0][0]
    dev = g0.device
    Ls = [lr.U.shape[0] for _, lr, _ in items]
    cfg = rank_config(dev, g0.dtype, T, lambda: rank_tuning_key(items, g0.element_size()),
                      config)
    BT = cfg.pop("BT")
    S = _splits(dev, T, sum(Ls), BT // 4)
    T_PER = cdiv(cdiv(max(T, 1), S), BT) * BT
    S = max(1, cdiv(T, T_PER))
    outs, args, meta = [], [], []
    for g, lr, dz in items:
        L, W, BN = lr.U.shape
        N = g.shape[1]
        du = _alloc.empty(S, L, lr.RB, BN, dtype=F32, device=dev)
        dzb = _alloc.empty(S, L, lr.RB, dtype=F32, device=dev)
        db = _alloc.empty(S, N, dtype=F32, device=dev)
        if T == 0:
            du, dzb, db = du.zero_(), dzb.zero_(), db.zero_()
        outs.append((du, dzb, db))
        args.append([g, g.stride(0), g.stride(1), N, lr.z, lr.z.stride(0), lr.U, dz,
                     dz.stride(0), du, dzb, db, L, lr.scale, lr.RS, W])
        meta.append((lr.RB, lr.scaled, W < lr.RB))
    if T == 0:
        return outs
    if len(items) == 1:             # one section: the second's tiles are none
        args.append(args[0])
        meta.append(meta[0])
    _lr_rank_bwd_kernel[(sum(Ls), S)](
        T, T_PER, *args[0], *args[1], BT=BT, BN=items[0][1].U.shape[2],
        A_RB=meta[0][0], B_RB=meta[1][0], PREC=dot_precision(g0.dtype),
        A_SH_SCALE=meta[0][1], B_SH_SCALE=meta[1][1], A_ONES=meta[0][2], B_ONES=meta[1][2],
        **cfg)
    return outs


def rank_space(x: torch.Tensor, D: torch.Tensor, zb: torch.Tensor) -> torch.Tensor:
    """Z = X Dᵀ + zb (T, M) in x's dtype, summed in float32 and rounded once as the exact
    forward's augmented GEMM rounds it: the rank-space input of the rank pass after a folded
    forward (which stores no Z). x (T, K) any strides; D (M, K) the packed down-projection
    rows; zb (M,) float32.

    One GEMM over all tiles of both sections: X is read once. (The rank pass recomputed
    Z_l per tile instead until 2026-11-27, when the H100 measured it: GPT-2 small q|k|v,
    T = 16384, Kernel-mix qvo-intermediate, 197.6 µs against 92.5 µs for the same pass
    reading a stored Z — X and D re-read by every tile's programs.)"""
    Z = _alloc.empty(x.shape[0], D.shape[0], dtype=x.dtype, device=x.device)
    return gemm([(x, D.t())], Z, bias=zb)


def lr_rank_backward(g: torch.Tensor, lr: LowRankTiles, dz: torch.Tensor,
                     partials: bool = False):
    """The rank pass of one section (:func:`lr_rank_backward_sections`); partials=False:
    the partials summed, (dU (L, RB, BN), dzb (L, RB), db (N,))."""
    du, dzb, db = lr_rank_backward_sections([(g, lr, dz)])[0]
    if partials:
        return du, dzb, db
    return du.sum(0), dzb.sum(0), db.sum(0)


# ------------------------------------------------------------------------------------------
# Folding (16-bit, exact=False, or exact=None on a GPU where the roofline says it pays): the
# adapted sections' updates rounded once into a copy of the frozen weight, W' = W + U·D
# (from the packed tiles), so that Y = X W'ᵀ + b' and dX = dY W' are frozen-shaped GEMMs


@triton.jit
def _fold_tile(l, kb, w_ptr, s_wn, s_wk, d_ptr, u_ptr, zb_ptr, b_ptr, c_ptr, out_ptr, bo_ptr,
               K, N, RS, W, scale,
               BN: tl.constexpr, RB: tl.constexpr, BK: tl.constexpr, LR: tl.constexpr,
               SH_SCALE: tl.constexpr, HAS_B: tl.constexpr, HAS_C: tl.constexpr,
               BIAS: tl.constexpr):
    # Rows [l·BN, (l+1)·BN) of one section, columns [kb·BK, (kb+1)·BK):
    # W'[n, k] = W[n, k] + Σ_slot s(slot)·U[l, slot, n − l·BN]·D[l, slot, k], s = scale on
    # the RS shared slots (U holds B_s unscaled), 1 on the others; LR False: a copy (a
    # section with no update). Exact 16-bit products (tensor cores) summed with W in
    # float32, rounded once on store (out: unit column stride, row stride K). BIAS: the
    # kb = 0 programs also write b'[n] = b[n] + c[n] + Σ_slot s(slot)·U[l, slot, n]·zb[l, slot]
    # (float32 sum, rounded once to bo's dtype).
    cn = tl.arange(0, BN)
    rn = l * BN + cn
    nmask = rn < N
    ks = kb * BK + tl.arange(0, BK)
    kmask = ks < K
    acc = tl.load(w_ptr + rn[:, None] * s_wn + ks[None, :] * s_wk,
                  mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
    if LR:
        rr = tl.arange(0, RB)
        wmask = rr < W
        ut = tl.load(u_ptr + (l * W + rr[None, :]) * BN + cn[:, None], mask=wmask[None, :],
                     other=0.0)                                         # (BN, RB) = U_lᵀ
        dd = tl.load(d_ptr + (l * W + rr[:, None]) * K + ks[None, :],
                     mask=wmask[:, None] & kmask[None, :], other=0.0)   # (RB, BK)
        if SH_SCALE:
            sh = (rr < RS)[None, :]
            zero = tl.zeros_like(ut)
            acc += scale * tl.dot(tl.where(sh, ut, zero), dd, out_dtype=tl.float32)
            acc += tl.dot(tl.where(sh, zero, ut), dd, out_dtype=tl.float32)
        else:
            acc += tl.dot(ut, dd, out_dtype=tl.float32)
    tl.store(out_ptr + rn[:, None] * K + ks[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=nmask[:, None] & kmask[None, :])
    if BIAS:
        if kb == 0:
            bsum = tl.zeros((BN,), dtype=tl.float32)
            if HAS_B:
                bsum += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
            if HAS_C:
                bsum += tl.load(c_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
            if LR:
                zb = tl.load(zb_ptr + l * W + rr, mask=wmask, other=0.0)
                if SH_SCALE:
                    zb = tl.where(rr < RS, zb * scale, zb)
                bsum += tl.sum(ut.to(tl.float32) * zb[None, :], axis=1)
            tl.store(bo_ptr + rn, bsum.to(bo_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _qkv_fold_kernel(K, out_ptr, bo_ptr,
                     a_w, a_swn, a_swk, a_d, a_u, a_zb, a_b, a_c, a_N, a_RS, a_W, a_scale,
                     a_L,
                     k_w, k_swn, k_swk, k_b, k_N, k_row, k_L,
                     b_w, b_swn, b_swk, b_d, b_u, b_zb, b_b, b_c, b_N, b_RS, b_W, b_scale,
                     b_row,
                     BN: tl.constexpr, BK: tl.constexpr, BIAS: tl.constexpr,
                     A_LR: tl.constexpr, A_RB: tl.constexpr, A_SH_SCALE: tl.constexpr,
                     A_HAS_B: tl.constexpr, A_HAS_C: tl.constexpr, K_HAS_B: tl.constexpr,
                     B_LR: tl.constexpr, B_RB: tl.constexpr, B_SH_SCALE: tl.constexpr,
                     B_HAS_B: tl.constexpr, B_HAS_C: tl.constexpr):
    # grid: (L_a + L_k + L_b tiles, cdiv(K, BK)): the three sections q (a, rows [0, N_a)),
    # k (copied, rows [k_row, k_row + N_k)) and v (b, rows [b_row, b_row + N_b)) of
    # W' = [W'_q; W_k; W'_v] (_fold_tile), any of them empty; an unadapted q or v is a copy.
    l = tl.program_id(0)
    kb = tl.program_id(1)
    if l < a_L:
        _fold_tile(l, kb, a_w, a_swn, a_swk, a_d, a_u, a_zb, a_b, a_c, out_ptr, bo_ptr, K,
                   a_N, a_RS, a_W, a_scale, BN, A_RB, BK, A_LR, A_SH_SCALE, A_HAS_B, A_HAS_C,
                   BIAS)
    elif l < a_L + k_L:
        _fold_tile(l - a_L, kb, k_w, k_swn, k_swk, out_ptr, out_ptr, out_ptr, k_b, out_ptr,
                   out_ptr + k_row * K, bo_ptr + k_row, K, k_N, 0, 0, 1.0, BN, 16, BK, False,
                   False, K_HAS_B, False, BIAS)
    else:
        _fold_tile(l - a_L - k_L, kb, b_w, b_swn, b_swk, b_d, b_u, b_zb, b_b, b_c,
                   out_ptr + b_row * K, bo_ptr + b_row, K, b_N, b_RS, b_W, b_scale, BN, B_RB,
                   BK, B_LR, B_SH_SCALE, B_HAS_B, B_HAS_C, BIAS)


def fold_qkv(ws, lrs, K: int, dtype: torch.dtype, biases=None, cs=None):
    """W' = [W'_q; W_k; W'_v] (ΣN, K) contiguous in ``dtype`` (one launch): ws the three
    frozen weights (N_i, K) any strides (N_i may be 0), lrs the LowRankTiles of q and v (None:
    that section is copied). ``biases`` (b_q, b_k, b_v) and ``cs`` (c_q, c_v), contiguous or
    None: also return b' (ΣN,) in ``dtype``, the frozen biases plus the per-head biases plus
    U·zb of each tile (the lite heads' down-projection bias through the up-projection), each
    rounded once; else (W', None)."""
    dev = ws[0].device
    rows = [w.shape[0] for w in ws]
    out = _alloc.empty(sum(rows), K, dtype=dtype, device=dev)
    bias = biases is not None
    bo = _alloc.empty(sum(rows), dtype=dtype, device=dev) if bias else out
    if out.numel() == 0:
        return out, (bo if bias else None)
    BN = _tile_n(dev)
    biases = biases if bias else (None, None, None)
    cs = cs if cs is not None else (None, None)
    secs, meta, Ls = [], {}, []
    for i, (tag, w, lr, b, c) in enumerate((("A", ws[0], lrs[0], biases[0], cs[0]),
                                             ("B", ws[2], lrs[1], biases[2], cs[1]))):
        L = cdiv(w.shape[0], BN)
        Ls.append(L)
        secs.append([w, w.stride(0), w.stride(1),
                     lr.D if lr is not None else out, lr.U if lr is not None else out,
                     lr.zb if lr is not None else out, b if b is not None else out,
                     c if c is not None else out, w.shape[0],
                     lr.RS if lr is not None else 0, lr.W if lr is not None else 0,
                     lr.scale if lr is not None else 1.0,
                     L if tag == "A" else rows[0] + rows[1]])
        meta.update({f"{tag}_LR": lr is not None, f"{tag}_RB": lr.RB if lr is not None else 16,
                     f"{tag}_SH_SCALE": lr is not None and lr.scaled,
                     f"{tag}_HAS_B": b is not None, f"{tag}_HAS_C": c is not None})
    wk, bk = ws[1], biases[1]
    Lk = cdiv(wk.shape[0], BN)
    ksec = [wk, wk.stride(0), wk.stride(1), bk if bk is not None else out, wk.shape[0],
            rows[0], Lk]
    BK = _blk(K, 16, 64 if targets_gpu(dev) else 32)
    _qkv_fold_kernel[(Ls[0] + Lk + Ls[1], cdiv(K, BK))](
        K, out, bo, *secs[0], *ksec, *secs[1], BN=BN, BK=BK, BIAS=bias, K_HAS_B=bk is not None,
        **meta, num_warps=4 if targets_gpu(dev) else 1)
    return out, (bo if bias else None)


def frozen_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out = a @ b (+ bias) for a GEMM that needs no fusion (the folded, frozen-shaped ones; the
    output projection's thin ones): cuBLAS for 16-bit on a GPU, the Triton GEMM otherwise
    (exact float32 dots). a (M, K), b (K, N) any strides, out (M, N) contiguous."""
    if out.device.type == "cuda" and a.dtype in (torch.float16, torch.bfloat16):
        if bias is None:
            return torch.matmul(a, b, out=out)
        return torch.addmm(bias, a, b, out=out)
    if out.numel() == 0:
        return out
    if a.shape[1] == 0:
        out.zero_()
        return out.add_(bias) if bias is not None else out
    return gemm([(a, b)], out, bias=bias)


# Tests set these to True or False to take one path in mode 1 whatever the shapes (None:
# decide): FORCE_FOLD for the forward and dX together, FORCE_FOLD_DX for dX alone.
FORCE_FOLD = None
FORCE_FOLD_DX = None


def fold_plan(mode: int, packs, T: int, K: int, N: int, dtype: torch.dtype):
    """(fold the forward, fold dX) of a q|k|v call (``mode``: the ops' fold argument, 0
    exact, 1 where the roofline says it pays, 2 fold; only 16-bit ever folds). The forward
    folds only with dX (the same W'). Pure Python on shapes (fake kernels use it)."""
    live = [pk for pk in packs if pk is not None]
    if mode == 0 or not live or T == 0 or dtype not in (torch.float16, torch.bfloat16):
        return False, False
    if mode == 2:
        return True, True
    el = torch.finfo(dtype).bits // 8
    fwd = fold_pays(packs, T, K, N, el) if FORCE_FOLD is None else bool(FORCE_FOLD)
    if fwd:
        return True, True
    compact = compact_pays(packs, T, K, el)
    return False, (dx_fold_pays(packs, T, K, N, el, compact) if FORCE_FOLD_DX is None
                   else bool(FORCE_FOLD_DX))


def _fold_cost(N: int, K: int, M: int, BN: int, el: int) -> float:
    from kfused.perf import roofline as R

    return R.KERNEL_OVERHEAD_S + (2 * N * K * el + M * (K + BN) * el) / R.HBM_BW


def dx_fold_pays(packs, T: int, K: int, N: int, el: int, compact: bool) -> bool:
    """Whether folding dX alone pays (the forward exact): the exact dx is our augmented GEMM
    over [dY | dZ] (N + (MC if compact else M) rows of K, at ``TRITON_GEMM_EFFICIENCY`` of
    the cuBLAS ceiling), the folded one a frozen-shaped cuBLAS GEMM plus one fold launch
    that reads the frozen weights (N rows of q|k|v) and writes W' once. Decided by the H100
    roofline's ceilings (kfused.perf.roofline; PREDICTED)."""
    from kfused.perf import roofline as R

    live = [pk for pk in packs if pk is not None]
    M = sum(pk.L * pk.W for pk in live)
    _, MC = compact_offsets(packs)
    t_exact = (2.0 * T * (N + (MC if compact else M)) * K
               / (R.WGMMA_RATE * TRITON_GEMM_EFFICIENCY) + R.KERNEL_OVERHEAD_S)
    return t_exact > R.gemm_time(T, K, N, el) + _fold_cost(N, K, M, live[0].BN, el)


def fold_pays(packs, T: int, K: int, N: int, el: int) -> bool:
    """Whether folding the forward too pays, from the H100 roofline's ceilings
    (kfused.perf.roofline; PREDICTED), pass against pass:
    forward — the augmented GEMMs (one launch per section; each adapted tile also computes
    Z_l = X D_lᵀ and Z_l U_l over its RB-wide block) against one frozen-shaped GEMM (N rows
    of q|k|v) and a fold launch;
    backward — the same rank pass over a stored Z in both plans; folded, one more GEMM
    first computes Z = X Dᵀ + zb again (:func:`rank_space`: X read once, Z written).
    dX folds in both plans (see :func:`fold_plan`)."""
    from kfused.perf import roofline as R

    live = [pk for pk in packs if pk is not None]
    BN = live[0].BN
    M = sum(pk.L * pk.W for pk in live)
    lr = sum(pk.L * pk.RB for pk in live)
    n_ad = sum(pk.H * pk.P for pk in live)
    launches = len(live) + (1 if N > n_ad else 0)
    rate, bw = R.WGMMA_RATE * TRITON_GEMM_EFFICIENCY, R.HBM_BW
    t_exact = ((2.0 * T * N * K + 2.0 * T * lr * (K + BN)) / rate
               + launches * R.KERNEL_OVERHEAD_S)
    t_fold = R.gemm_time(T, N, K, el) + _fold_cost(N, K, M, BN, el)
    t_z = R.KERNEL_OVERHEAD_S + max(2.0 * T * M * K / rate, T * (K + M) * el / bw)
    return t_exact > t_fold + t_z


# The augmented GEMM (_gemm_kernel) against cuBLAS, measured on the H100 (benchmarks/results/
# h100/proof-2026-11-27, bf16, T = 16384, GPT-2 small q|k|v): its three launches of the
# exact forward ran 74.9 GFLOP in 172.1 µs (Kernel-mix qvo-intermediate; 435 TFLOP/s) and
# 62.8 GFLOP in 139.0 µs (lite-qv-small; 452 TFLOP/s), where cuBLAS ran the frozen-shaped
# 58.0 GFLOP in 91.0 µs (637 TFLOP/s): 0.68–0.71 of cuBLAS's rate per FLOP. fold_pays prices
# our GEMMs (the augmented forward, the folded backward's Z) at this fraction of the model's
# cuBLAS ceiling.
TRITON_GEMM_EFFICIENCY = 0.7


# ------------------------------------------------------------------------------------------
# Packing the low-rank rows of one section per output column tile
#
# Slots of tile l (output columns [l·BN, min((l+1)·BN, N)) of a section with H heads of width
# P, per-head rank R and shared rank RS): the RS shared rows first, then R rows for every head
# whose columns meet the tile (heads h0(l) = l·BN // P, ..., h1(l) = (min((l+1)·BN, N) - 1) // P),
# then zero padding up to W, the most slots any tile needs rounded up to a multiple of 8 (16-byte
# rows). W is each tile's stride in D, zb, U, Z and dZ; the kernels compute on RB = _rblk(W)
# wide blocks (>= 16, a power of 2: the tl.dot width), masking the slots past W, so the dx
# GEMM's dZ segment, the token reduction dZᵀ X and the rank pass's Z / dZ traffic carry W
# columns per tile, not RB (Kernel-mix(qvo) intermediate at p = 64: 24 and 40 instead of 32
# and 64). Slot k of tile l therefore holds
#   k < RS:                     shared row k
#   RS <= k < RS + nh(l)·R:     per-head row (h0(l) + (k - RS) // R, (k - RS) % R)
#   otherwise (k < W):          zero
# and per-head row (h, j) occurs in tiles h·P // BN ... ((h+1)·P - 1) // BN, at slot
# RS + (h - h0(l))·R + j. Both kernels below compute these maps from (H, P, R, RS, BN): no
# index tensors, and one launch each per section (the torch version took ~40 small launches
# per section and call, which dominated at GPT-2 widths).


@functools.lru_cache(maxsize=1024)
def _most_slots(H: int, P: int, R: int, RS: int, BN: int) -> Tuple[int, int]:
    N = H * P
    L = cdiv(N, BN)
    most = 0
    for l in range(L):
        c0, c1 = l * BN, min((l + 1) * BN, N)
        most = max(most, RS + R * ((c1 - 1) // P - c0 // P + 1))
    return L, most


def pack_dims(H: int, P: int, R: int, RS: int, BN: int) -> Tuple[int, int]:
    """(L tiles, RB: the computed block width per tile) of a section's packing (pure Python:
    fake kernels use it)."""
    L, most = _most_slots(H, P, R, RS, BN)
    return L, _rblk(most)


def pack_width(H: int, P: int, R: int, RS: int, BN: int) -> int:
    """W, the slots stored per tile (the tile stride of D, zb, U, Z and dZ): the most any
    tile needs, rounded up to a multiple of 8, at most RB."""
    L, most = _most_slots(H, P, R, RS, BN)
    return min(_rblk(most), cdiv(max(most, 1), 8) * 8)


class _Packing:
    """Dimensions of one section's packing (see the comment above)."""

    __slots__ = ("H", "P", "R", "RS", "BN", "L", "RB", "W", "SPAN")

    def __init__(self, H: int, P: int, R: int, RS: int, BN: int):
        self.H, self.P, self.R, self.RS, self.BN = H, P, R, RS, BN
        self.L, self.RB = pack_dims(H, P, R, RS, BN)
        self.W = pack_width(H, P, R, RS, BN)
        # the most tiles one head's columns meet (2 where heads straddle tile edges)
        self.SPAN = max((((h + 1) * P - 1) // BN - (h * P) // BN + 1 for h in range(H)),
                        default=1)


@triton.jit
def _pack_slot(l, k, down_ptr, zb_ptr, up_ptr, sdown_ptr, sup_ptr, d_ptr, zbp_ptr, u_ptr, dc_ptr,
               K, N, P, R, RS,
               HW: tl.constexpr, HAS_ZB: tl.constexpr, SH: tl.constexpr,
               BN: tl.constexpr, W: tl.constexpr, BK: tl.constexpr):
    # Slot k of tile l of one section: D[l, k, :] (input dtype), zb[l, k] (float32) and
    # U[l, k, :] (input dtype) from the section's factors down (H·R, K), zb (H·R,),
    # up (H·P, R), sdown (RS, K), sup (H·P, RS), all contiguous; and, from the first tile a
    # row occurs in, its compact row Dc[j] (shared) or Dc[RS + h·R + j] (per-head), input
    # dtype (see compact_dz). d, zbp, u and dc point at the section's first row.
    c0 = l * BN
    h0 = c0 // P
    nh = (tl.minimum(c0 + BN, N) - 1) // P - h0 + 1
    is_sh = k < RS
    kk = k - RS
    is_hw = (kk >= 0) & (kk < nh * R)
    rr = tl.maximum(R, 1)
    h = h0 + tl.maximum(kk, 0) // rr
    j = tl.maximum(kk, 0) % rr
    g = h * R + j                       # global per-head row
    js = tl.minimum(k, tl.maximum(RS - 1, 0))  # shared row (clamped: masked when not shared)
    # Scalar conditions enter the vector masks as limits (the interpreter mishandles
    # scalar & vector masks).
    k_hw = tl.where(is_hw, K, 0)
    k_sh = tl.where(is_sh, K, 0)
    first = (is_sh & (l == 0)) | (is_hw & (l == (h * P) // BN))
    crow = tl.where(is_sh, js, RS + g)
    k_c = tl.where(first, K, 0)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        kmask = ks < K
        row = tl.zeros((BK,), dtype=tl.float32)
        if HW:
            row += tl.load(down_ptr + g * K + ks, mask=ks < k_hw, other=0.0).to(tl.float32)
        if SH:
            row += tl.load(sdown_ptr + js * K + ks, mask=ks < k_sh, other=0.0).to(tl.float32)
        row = row.to(d_ptr.dtype.element_ty)
        tl.store(d_ptr + (l * W + k) * K + ks, row, mask=kmask)
        tl.store(dc_ptr + crow * K + ks, row, mask=ks < k_c)
    zbv = 0.0
    if HAS_ZB:
        zbv = tl.load(zb_ptr + g, mask=is_hw, other=0.0).to(tl.float32)
    tl.store(zbp_ptr + l * W + k, zbv)
    cn = tl.arange(0, BN)
    n = c0 + cn
    nmask = n < N
    u = tl.zeros((BN,), dtype=tl.float32)
    if HW:
        u += tl.load(up_ptr + n * R + j, mask=(n < tl.where(is_hw, N, 0)) & (n // P == h),
                     other=0.0).to(tl.float32)
    if SH:   # B_s unscaled: the GEMM and the rank pass apply the scale (LowRankTiles)
        u += tl.load(sup_ptr + n * RS + js, mask=n < tl.where(is_sh, N, 0),
                     other=0.0).to(tl.float32)
    tl.store(u_ptr + (l * W + k) * BN + cn, u.to(u_ptr.dtype.element_ty))


@triton.jit
def _pack_kernel(d_ptr, zbp_ptr, u_ptr, dc_ptr, K, P,
                 a_down, a_zb, a_up, a_sdown, a_sup, a_off, a_coff, a_N, a_R, a_RS, a_L,
                 b_down, b_zb, b_up, b_sdown, b_sup, b_off, b_coff, b_N, b_R, b_RS,
                 A_HW: tl.constexpr, A_HAS_ZB: tl.constexpr, A_SH: tl.constexpr,
                 A_W: tl.constexpr, B_HW: tl.constexpr, B_HAS_ZB: tl.constexpr,
                 B_SH: tl.constexpr, B_W: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # grid: (L_a + L_b, max(W_a, W_b)), up to two sections in one launch (the q and v
    # sections of a q|k|v projection; L_b = 0 for one): program (l, k) fills slot k of tile
    # l of section a, or of tile l − L_a of section b. Both sections' packed rows live in the
    # same buffers D, zb, U (from row a_off / b_off) and Dc (from row a_coff / b_coff).
    l = tl.program_id(0)
    k = tl.program_id(1)
    if l < a_L:
        if k < A_W:
            _pack_slot(l, k, a_down, a_zb, a_up, a_sdown, a_sup, d_ptr + a_off * K,
                       zbp_ptr + a_off, u_ptr + a_off * BN, dc_ptr + a_coff * K,
                       K, a_N, P, a_R, a_RS, A_HW, A_HAS_ZB, A_SH, BN, A_W, BK)
    else:
        if k < B_W:
            _pack_slot(l - a_L, k, b_down, b_zb, b_up, b_sdown, b_sup, d_ptr + b_off * K,
                       zbp_ptr + b_off, u_ptr + b_off * BN, dc_ptr + b_coff * K,
                       K, b_N, P, b_R, b_RS, B_HW, B_HAS_ZB, B_SH, BN, B_W, BK)


def pack_sections(items, D: torch.Tensor, zb: torch.Tensor, U: torch.Tensor,
                  Dc: torch.Tensor) -> None:
    """Fill the packed operands of one or two sections in one launch. items: (pk, f, off,
    coff) per section: its rows off : off + L·W of D (M, K) and U (M, BN) in the input
    dtype and of zb (M,) float32, and its rows coff : coff + RS + H·R of the compact
    down-projection Dc (MC, K) in the input dtype (the rows of the compact rank space, see
    compact_dz), all contiguous. The sections share the head width and BN."""
    assert 1 <= len(items) <= 2
    K = D.shape[1]
    c = lambda t: t.contiguous() if t is not None else D  # noqa: E731  (no copy when contiguous)
    args, meta = [], {}
    for tag, (pk, f, off, coff) in zip("ab", (items + items)[:2]):
        args += [c(f.down), c(f.zb), c(f.up), c(f.sdown), c(f.sup), off, coff, pk.H * pk.P,
                 pk.R, pk.RS]
        if tag == "a":
            args.append(pk.L)
        T = tag.upper()
        meta.update({f"{T}_HW": f.hw, f"{T}_HAS_ZB": f.hw and f.zb is not None,
                     f"{T}_SH": f.sh, f"{T}_W": pk.W})
    pa = items[0][0]
    L = sum(it[0].L for it in items)
    _pack_kernel[(L, max(it[0].W for it in items))](
        D, zb, U, Dc, K, pa.P, *args, **meta, BN=pa.BN,
        BK=_blk(K, 16, 256 if targets_gpu(D.device) else 64), num_warps=4)


@triton.jit
def _unpack_tile(t, du_ptr, db_ptr, S_R, dup_ptr, dsu_ptr, dbo_ptr, N, P, R, RS, L, scale,
                 HW: tl.constexpr, SH: tl.constexpr, BN: tl.constexpr, RB: tl.constexpr,
                 RC: tl.constexpr, SB: tl.constexpr):
    # Program t of _unpack_kernel's tile part: rows [rc·RC, (rc+1)·RC) of tile l's dU
    # (t = l·(RB / RC) + rc) -> dup, dsu; the rc = 0 program also db (a function of its own:
    # the two roles' variables must not meet in one if/else). The token-split partials are
    # summed SB splits per load (a (SB, RC, BN) block reduced over its first axis, then the
    # blocks in order: fixed, deterministic), so the loads of a program are few and
    # independent: one (RB, BN) load per split in turn, each waiting on memory, made the
    # kernel latency-bound (H100: 31.5 µs, GPT-2 small q|k|v at S = 22 splits).
    l = t // (RB // RC)
    rc = t % (RB // RC)
    c0 = l * BN
    h0 = c0 // P
    cn = tl.arange(0, BN)
    n = c0 + cn
    nmask = n < N
    rk = rc * RC + tl.arange(0, RC)
    ss = tl.arange(0, SB)
    du = tl.zeros((RC, BN), dtype=tl.float32)
    for s0 in range(0, S_R, SB):
        sv = s0 + ss
        blk = tl.load(du_ptr + ((sv[:, None, None] * L + l) * RB + rk[None, :, None]) * BN
                      + cn[None, None, :], mask=(sv < S_R)[:, None, None], other=0.0)
        du += tl.sum(blk, axis=0)
    if rc == 0:
        db = _row_block_sum(tl.zeros((BN,), dtype=tl.float32), db_ptr, S_R, N, n, nmask, SB)
        tl.store(dbo_ptr + n, db.to(dbo_ptr.dtype.element_ty), mask=nmask)
    if SH:
        js = tl.minimum(rk, tl.maximum(RS - 1, 0))
        tl.store(dsu_ptr + n[None, :] * RS + js[:, None],
                 (du * scale).to(dsu_ptr.dtype.element_ty),
                 mask=(rk < RS)[:, None] & nmask[None, :])
    if HW:
        kk = tl.maximum(rk - RS, 0)
        h = h0 + kk // R
        j = kk % R
        mine = (rk >= RS)[:, None] & (h[:, None] == n[None, :] // P) & nmask[None, :]
        tl.store(dup_ptr + n[None, :] * R + j[:, None], du.to(dup_ptr.dtype.element_ty),
                 mask=mine)


@triton.jit
def _unpack_prog(pid, dd_ptr, s_dds, s_ddm, dzb_ptr, du_ptr, db_ptr, S_D, S_R,
                 ddown_ptr, dzbh_ptr, dup_ptr, dsd_ptr, dsu_ptr, dbo_ptr,
                 K, N, P, R, RS, L, W, scale,
                 HW: tl.constexpr, SH: tl.constexpr, BN: tl.constexpr, RB: tl.constexpr,
                 BK: tl.constexpr, COMPACT: tl.constexpr, RC: tl.constexpr,
                 SB: tl.constexpr):
    # Program pid of one section's H·R + RS + L·RB/RC. Gradients of the packed operands -> the
    # section's factor gradients, every sum in a fixed order (no atomics):
    #   programs [0, H·R):        per-head row g = (h, j): ddown[g] = Σ_s dD[RS + g]
    #                             (COMPACT) or Σ_occurrences Σ_s dD[slot],
    #                             dzbh[g] = Σ_occurrences Σ_s dzb
    #   programs [H·R, H·R + RS): shared row j: dsd[j] = Σ_s dD[j] (COMPACT) or
    #                             Σ_l Σ_s dD[l, j]
    #   programs [.., + L·RB/RC): tile l, RC of its rows: dup, dsu (Σ_s dU scattered to the
    #                             factor layouts); its first: the section bias gradient
    #                             db = Σ_s db (_unpack_tile).
    # dD: (S_D, RS + H·R, K) partials over the compact rank space (COMPACT) or (S_D, L·W, K)
    # over the tiles' W slots (any float dtype, strides s_dds, s_ddm); dzb (S_R, L·RB),
    # dU (S_R, L·RB, BN), db (S_R, N) float32 partials of the rank pass (RB per tile).
    HR = (N // P) * R
    if pid < HR + RS:
        rr = tl.maximum(R, 1)
        h = pid // rr
        j = pid % rr
        l_lo = (h * P) // BN
        l_hi = ((h + 1) * P - 1) // BN
        if pid >= HR:
            j = pid - HR
            h = pid * 0
            l_lo = pid * 0
            l_hi = pid * 0 + L - 1
        crow = tl.where(pid < HR, RS + pid, j)      # the row's compact slot
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            kmask = ks < K
            acc = tl.zeros((BK,), dtype=tl.float32)
            # the token-split partials SB per load (_row_block_sum: a fixed order), not one
            # dependent load per split (the H200 measured this kernel at 21.5 µs, GPT-2
            # small q|k|v, 4.4x the bytes-only estimate)
            if COMPACT:
                acc = _row_block_sum(acc, dd_ptr + crow * s_ddm, S_D, s_dds, ks, kmask, SB)
            else:
                for l in range(l_lo, l_hi + 1):
                    slot = l * W + j
                    if pid < HR:
                        slot = l * W + RS + (h - (l * BN) // P) * R + j
                    acc = _row_block_sum(acc, dd_ptr + slot * s_ddm, S_D, s_dds, ks, kmask, SB)
            if pid < HR:
                tl.store(ddown_ptr + pid * K + ks, acc.to(ddown_ptr.dtype.element_ty),
                         mask=kmask)
            else:
                tl.store(dsd_ptr + j * K + ks, acc.to(dsd_ptr.dtype.element_ty), mask=kmask)
        if pid < HR:
            z = pid.to(tl.float32) * 0.0
            ss = tl.arange(0, SB)
            for l in range(l_lo, l_hi + 1):
                slot = l * RB + RS + (h - (l * BN) // P) * R + j
                for s0 in range(0, S_R, SB):    # SB splits per load (see _unpack_tile)
                    sv = s0 + ss
                    z += tl.sum(tl.load(dzb_ptr + sv * (L * RB) + slot, mask=sv < S_R,
                                        other=0.0), axis=0)
            tl.store(dzbh_ptr + pid, z)
    else:
        _unpack_tile(pid - HR - RS, du_ptr, db_ptr, S_R, dup_ptr, dsu_ptr, dbo_ptr, N, P, R, RS,
                     L, scale, HW, SH, BN, RB, RC, SB)


@triton.jit
def _unpack_kernel(K, P,
                   a_dd, a_sdds, a_sddm, a_dzb, a_du, a_db, a_SD, a_SR, a_ddown, a_dzbh, a_dup,
                   a_dsd, a_dsu, a_dbo, a_N, a_R, a_RS, a_L, a_W, a_scale, a_progs,
                   b_dd, b_sdds, b_sddm, b_dzb, b_du, b_db, b_SD, b_SR, b_ddown, b_dzbh, b_dup,
                   b_dsd, b_dsu, b_dbo, b_N, b_R, b_RS, b_L, b_W, b_scale,
                   A_HW: tl.constexpr, A_SH: tl.constexpr, A_RB: tl.constexpr,
                   B_HW: tl.constexpr, B_SH: tl.constexpr, B_RB: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, COMPACT: tl.constexpr,
                   RC: tl.constexpr, SB: tl.constexpr):
    # grid: (progs_a + progs_b,), up to two sections in one launch (the q and v sections of
    # a q|k|v projection; progs_b = 0 for one), progs = H·R + RS + L·RB/RC each
    # (_unpack_prog).
    pid = tl.program_id(0)
    if pid < a_progs:
        _unpack_prog(pid, a_dd, a_sdds, a_sddm, a_dzb, a_du, a_db, a_SD, a_SR, a_ddown, a_dzbh,
                     a_dup, a_dsd, a_dsu, a_dbo, K, a_N, P, a_R, a_RS, a_L, a_W, a_scale,
                     A_HW, A_SH, BN, A_RB, BK, COMPACT, RC, SB)
    else:
        _unpack_prog(pid - a_progs, b_dd, b_sdds, b_sddm, b_dzb, b_du, b_db, b_SD, b_SR,
                     b_ddown, b_dzbh, b_dup, b_dsd, b_dsu, b_dbo, K, b_N, P, b_R, b_RS, b_L,
                     b_W, b_scale, B_HW, B_SH, BN, B_RB, BK, COMPACT, RC, SB)


def _unpack_outputs(pk: _Packing, f: "SectionFactors", K: int, db: torch.Tensor,
                    db_dtype: Optional[torch.dtype]):
    """The factor-gradient dict of one section and the kernel's output pointers."""
    H, P, R, RS = pk.H, pk.P, pk.R, pk.RS
    N = H * P
    dev = db.device
    out = {}
    dummy = db
    if f.hw:
        out["down"] = ddown = _alloc.empty(H, R, K, dtype=f.down.dtype, device=dev)
        out["zb"] = dzbh = _alloc.empty(H, R, dtype=F32, device=dev)
        out["up"] = dup = _alloc.empty(H, P, R, dtype=f.up.dtype, device=dev)
    else:
        ddown = dzbh = dup = dummy
    if f.sh:
        out["sdown"] = dsd = _alloc.empty(RS, K, dtype=f.sdown.dtype, device=dev)
        out["sup"] = dsu = _alloc.empty(N, RS, dtype=f.sup.dtype, device=dev)
    else:
        dsd = dsu = dummy
    out["db"] = dbo = _alloc.empty(N, dtype=db_dtype or F32, device=dev)
    return out, (ddown, dzbh, dup, dsd, dsu, dbo)


def unpack_sections(items, compact: bool) -> list:
    """Factor gradients of one or two sections from the gradients of their packed operands
    (one launch). items: per section (pk, f, dD, dzb, dU, db, db_dtype): dD token-reduction
    partials, (S_D, RS + H·R, K) over the compact rank space (``compact``) or (S_D, L·W, K)
    over the tiles' slots (any float dtype, unit last stride); dzb (S, L·RB),
    dU (S, L·RB, BN), db (S, N) float32 partials of the rank pass.

    Returns per section the dict of :func:`headwise_qkv_backward` (down, zb, up, sdown, sup
    in their factor's dtype; zb float32; db float32 or ``db_dtype``: the sum in float32,
    rounded once on store, so the caller needs no conversion kernel)."""
    assert 1 <= len(items) <= 2
    outs, args, meta, progs = [], [], {}, []
    K = items[0][2].shape[-1]
    dev = items[0][2].device
    gpu = targets_gpu(dev)
    # dU rows per tile program and token splits per load (see _unpack_tile): a (SB, RC, BN)
    # float32 block, 8K elements on a GPU (64 registers a thread at 4 warps, BN = 128)
    RC = 8 if gpu else 16
    SB = 8 if gpu else 4
    for pk, f, dD, dzb, dU, db, db_dtype in items:
        out, ptrs = _unpack_outputs(pk, f, K, db, db_dtype)
        outs.append(out)
        progs.append(pk.H * pk.R + pk.RS + pk.L * (pk.RB // RC))
        args.append([dD, dD.stride(0), dD.stride(1), dzb, dU, db, dD.shape[0], dzb.shape[0],
                     *ptrs, pk.H * pk.P, pk.R, pk.RS, pk.L, pk.W, f.scale])
        meta[len(meta)] = (f.hw, f.sh, pk.RB)
    if len(items) == 1:             # one section: the second's programs are none
        args.append(args[0])
        meta[1] = meta[0]
    assert all(pk.RB % RC == 0 for pk, *_ in items)
    pk0 = items[0][0]
    _unpack_kernel[(sum(progs),)](
        K, pk0.P, *args[0], progs[0], *args[1],
        A_HW=meta[0][0], A_SH=meta[0][1], A_RB=meta[0][2],
        B_HW=meta[1][0], B_SH=meta[1][1], B_RB=meta[1][2], BN=pk0.BN, COMPACT=compact,
        RC=RC, SB=SB, BK=_blk(K, 16, 256 if gpu else 64), num_warps=4)
    return outs


# Packed operands built by a forward, handed to its backward (saves re-packing). Keyed by the
# factor tensors' storage, version, shape and strides: the backward holds those very tensors
# (saved for backward), so an entry with its key was built from identical contents (an
# in-place change bumps the version). Popped on use; bounded for forwards whose backward
# never runs.
_PACKED: "collections.OrderedDict" = collections.OrderedDict()
_PACKED_MAX = 8


def _operand_keys(ts) -> Optional[tuple]:
    """What identifies the contents of packed operands built from the tensors ``ts`` (None
    entries allowed; see _PACKED), or None when one is an inference tensor
    (``torch.inference_mode``), which has no version counter: nothing is recorded then."""
    # (one pass, torch.Size and torch.device as they hash: this runs for every factor of
    # every call)
    keys = []
    for t in ts:
        if t is None:
            keys.append(None)
        elif t.is_inference():
            return None
        else:
            keys.append((t.data_ptr(), t._version, t.shape, t.stride(), t.dtype, t.device))
    return tuple(keys)


def _pack_key(fs: Sequence["SectionFactors"], dtype: torch.dtype, BN: int):
    """The key of _PACKED, or None when a factor is an inference tensor (e.g. lite factors
    built under torch.inference_mode)."""
    parts = []
    for f in fs:
        keys = _operand_keys((f.down, f.up, f.sdown, f.sup))  # not zb: the backward uses D, U
        if keys is None:
            return None
        parts.append((keys, f.scale))
    return (tuple(parts), dtype, BN)


def _pack_all(packs, offs, fs, M: int, K: int, dtype: torch.dtype, Z: torch.Tensor,
              keep: bool):
    """Packed operands of every adapted section in one set of buffers laid out like Z's
    columns: D (M, K), U (M, BN) in ``dtype``, zb (M,) float32 (section s at rows
    offs[s]:offs[s] + L·W), and the compact down-projection Dc (MC, K) laid out like the
    compact rank space (:func:`compact_offsets`), so the dx GEMM reads it with no
    concatenation; last, per section its :class:`LowRankTiles` over those buffers (z None;
    None where the section is not adapted). The forward
    (keep=True) always packs and records the result with a weak reference to its rank-space
    output Z; the backward (keep=False) consumes the record only if it was made for the very
    Z object it received (else it packs again). The forward never reads a record."""
    dev = Z.device
    BN = _tile_n(dev)
    key = _pack_key(fs, dtype, BN)
    keep = keep and key is not None
    if not keep and key is not None:
        rec = _PACKED.pop(key, None)
        if rec is not None and rec[0]() is Z:
            return rec[1]
    D = _alloc.empty(M, K, dtype=dtype, device=dev)
    zb = _alloc.empty(M, dtype=F32, device=dev)
    U = _alloc.empty(M, BN, dtype=dtype, device=dev)
    coffs, MC = compact_offsets(packs)
    Dc = _alloc.empty(MC, K, dtype=dtype, device=dev)
    items = [(pk, f, off, coff) for pk, off, coff, f in zip(packs, offs, coffs, fs)
             if pk is not None]
    if items:
        pack_sections(items, D, zb, U, Dc)
    tiles = tuple(None if pk is None else LowRankTiles(
        D[off:off + pk.L * pk.W].view(pk.L, pk.W, K), zb[off:off + pk.L * pk.W].view(pk.L, pk.W),
        U[off:off + pk.L * pk.W].view(pk.L, pk.W, BN), None, f.scale, pk.RS)
        for pk, off, f in zip(packs, offs, fs))
    out = (D, zb, U, Dc, tiles)
    if keep:
        _PACKED.pop(key, None)
        _PACKED[key] = (weakref.ref(Z), out)
        while len(_PACKED) > _PACKED_MAX:
            _PACKED.popitem(last=False)
    return out


# ------------------------------------------------------------------------------------------
# The compact rank space of the backward. A shared row occurs in every tile of its section
# and a head that straddles a tile edge in two: the rank pass writes one dZ column per
# occurrence (the partial from that tile's output columns). Summed per row they give the
# compact dZ (T, RS + H·R per section: shared rows, then per-head rows h·R + j), which the
# dx GEMM (against Dc) and the token reduction dZᵀ X read: at Llama-7B q (32 tiles, 12 shared
# rows, 3 per head) 108 columns instead of 512. The per-occurrence buffer is float32 when
# some row has several occurrences, so each compact column is rounded once, from the
# float32 sum (the same-precision torch path rounds dZ = dY B once too).


def compact_offsets(packs) -> Tuple[list, int]:
    """Column offsets of each section's block in the compact rank space, and its width."""
    offs, MC = [], 0
    for pk in packs:
        offs.append(MC)
        if pk is not None:
            MC += pk.RS + pk.H * pk.R
    return offs, MC


# Tests set this to True or False to take one path whatever the shapes (None: decide).
FORCE_COMPACT = None


def compact_pays(packs, T: int, K: int, el: int, dx: bool = True) -> bool:
    """Whether the backward should run on the compact rank space: the dx GEMM (``dx``: when
    it has a dZ segment, i.e. not folded) and the token reduction each lose (M − MC)·K MACs
    per token, against one more launch per section and the per-occurrence buffer written
    (float32 when summed) and read once more. Decided by
    the H100 roofline's ceilings (kfused.perf.roofline; PREDICTED): at GPT-2 widths it does
    not pay (Kernel-mix(qvo) intermediate, gpt2-small: 17 µs saved, 28 µs spent), at
    Llama-7B (32 tiles per section) it saves ~140 µs per q|k|v backward."""
    from kfused.perf import roofline as R

    live = [pk for pk in packs if pk is not None]
    if FORCE_COMPACT is not None:
        return bool(FORCE_COMPACT) and bool(live)
    M = sum(pk.L * pk.W for pk in live)
    _, MC = compact_offsets(packs)
    if not live or MC >= M:
        return False
    summed = any(needs_sum(pk) for pk in live)
    saved = (4.0 if dx else 2.0) * T * (M - MC) * K / R.WGMMA_RATE   # compute-bound GEMMs
    cost = (len(live) * R.KERNEL_OVERHEAD_S
            + T * (M * ((4 - el) if summed else 0) + M * (4 if summed else el) + MC * el)
            / R.HBM_BW)
    return saved > cost


def needs_sum(pk: "_Packing") -> bool:
    """Whether some compact column of the section sums several tile occurrences."""
    return (pk.RS > 0 and pk.L > 1) or (pk.R > 0 and pk.SPAN > 1)


@triton.jit
def _compact_dz_kernel(dzt_ptr, s_dzt, dzc_ptr, s_dzc, T, P, R, RS, L, MC,
                       BN: tl.constexpr, W: tl.constexpr, SPAN: tl.constexpr,
                       BT: tl.constexpr, CB: tl.constexpr):
    # grid (cdiv(T, BT), cdiv(MC, CB)), one section: dzt (T, L·W) per-occurrence view (any
    # float dtype), dzc (T, MC) compact view (input dtype). Compact column c < RS: the sum of
    # slot c over every tile; c = RS + h·R + j: the sum of its slot in the SPAN (at most)
    # tiles head h's columns meet. Float32 sums in tile order, one rounding.
    rt = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = rt < T
    cc = tl.program_id(1) * CB + tl.arange(0, CB)
    cmask = cc < MC
    is_sh = cc < RS
    acc = tl.zeros((BT, CB), dtype=tl.float32)
    base = dzt_ptr + rt[:, None] * s_dzt
    for l in range(0, L):
        m = tmask[:, None] & (is_sh & cmask)[None, :]
        acc += tl.load(base + (l * W + cc)[None, :], mask=m, other=0.0).to(tl.float32)
    rr = tl.maximum(R, 1)
    gg = tl.maximum(cc - RS, 0)
    h = gg // rr
    j = gg % rr
    l_lo = (h * P) // BN
    l_hi = ((h + 1) * P - 1) // BN
    for i in range(0, SPAN):
        lt = l_lo + i
        ok = (cc >= RS) & cmask & (lt <= l_hi)
        slot = lt * W + RS + (h - (lt * BN) // P) * R + j
        acc += tl.load(base + slot[None, :], mask=tmask[:, None] & ok[None, :],
                       other=0.0).to(tl.float32)
    tl.store(dzc_ptr + rt[:, None] * s_dzc + cc[None, :], acc.to(dzc_ptr.dtype.element_ty),
             mask=tmask[:, None] & cmask[None, :])


def compact_dz(pk: "_Packing", dzt: torch.Tensor, dzc: torch.Tensor) -> None:
    """dzc (T, RS + H·R) ← the per-occurrence rank-pass output dzt (T, L·W) of one section
    (views with unit last stride; one launch)."""
    T, MC = dzc.shape
    if T == 0 or MC == 0:
        return
    BT = 64 if targets_gpu(dzc.device) else 16
    CB = _blk(MC, 16, 64)
    _compact_dz_kernel[(cdiv(T, BT), cdiv(MC, CB))](
        dzt, dzt.stride(0), dzc, dzc.stride(0), T, pk.P, pk.R, pk.RS, pk.L, MC,
        BN=pk.BN, W=pk.W, SPAN=pk.SPAN, BT=BT, CB=CB, num_warps=4)


@functools.lru_cache(maxsize=256)
def _packing(H: int, P: int, R: int, RS: int, BN: int) -> _Packing:
    return _Packing(H, P, R, RS, BN)


# ------------------------------------------------------------------------------------------
# The user factors of one section, as the kernels take them


class SectionFactors:
    """Kernel-level factors of one projection section (host-built from the user factors).

    down (H, R, d): per-head down-projections (Kernel-wise A_h and lite A_h W_k^h stacked);
    zb (H, R): per-head down-projection bias (lite: b_k^h A_hᵀ; Kernel-wise: 0);
    up (H, p, R): per-head up-projections; sdown (R_s, d), sup (H·p, R_s): the shared LoRA
    part; ``scale`` multiplies ``sup`` (the packing folds it in float32). Absent parts are
    None (zb None: zero). Any float dtypes (the kernels compute in float32); contiguous.
    """

    __slots__ = ("down", "zb", "up", "sdown", "sup", "scale")

    def __init__(self, down=None, zb=None, up=None, sdown=None, sup=None, scale=1.0):
        self.down, self.zb, self.up, self.sdown, self.sup = down, zb, up, sdown, sup
        self.scale = float(scale)

    @property
    def hw(self) -> bool:
        return self.down is not None

    @property
    def sh(self) -> bool:
        return self.sdown is not None

    def ranks(self) -> Tuple[int, int]:
        return (self.down.shape[1] if self.hw else 0, self.sdown.shape[0] if self.sh else 0)
