"""Argument checks and layout shared by the KronA ops (kron_matvec, krona_linear)."""

from __future__ import annotations

from typing import Tuple

import torch

from kfused import _validate
from kfused.ops._common import dense, no_double_backward  # noqa: F401  (re-exported)


def check_factors(x: torch.Tensor, A, B, x_name: str = "x") -> Tuple[int, int, int, int]:
    _validate.check_tensor(x_name, x, min_ndim=1)
    _validate.check_tensor("A", A, ndim=2)
    _validate.check_tensor("B", B, ndim=2)
    _validate.check_same(x_name, x, A=A, B=B)
    a_out, a_in = A.shape
    b_out, b_in = B.shape
    if min(a_out, a_in, b_out, b_in) == 0:
        raise ValueError(f"A {tuple(A.shape)} and B {tuple(B.shape)} must have no empty dimension")
    if x.shape[-1] != a_in * b_in:
        raise ValueError(
            f"{x_name} has shape {tuple(x.shape)}: its last dimension must equal "
            f"a_in * b_in = {a_in} * {b_in} = {a_in * b_in} for A {tuple(A.shape)} and "
            f"B {tuple(B.shape)}")
    return a_out, a_in, b_out, b_in


# csrc/krona/kron_matvec.cu kTcMaxWaste: the CUDA extension's factor kernels run on the tensor
# cores unless padding every factor side to 16 multiplies their products' MACs by more.
CUDA_TC_MAX_WASTE = 4.0


def _kron_bwd_macs(ao: int, ai: int, bo: int, bi: int, need_dx: bool = True) -> int:
    """MACs per token of kron_matvec_bwd: W = G B, V = A X, dX = Aᵀ W, dA, dB."""
    return ao * bo * bi + ao * ai * bi + (ai * ao * bi if need_dx else 0) + ao * ai * bi \
        + bo * ao * bi


def cuda_factor_kernel(a_out: int, a_in: int, b_out: int, b_in: int) -> str:
    """Which kernel the CUDA extension's kron_matvec_bwd runs for these factors on 16-bit
    inputs (kron_matvec.cu): "tensor-core" unless padding every factor side to 16 would
    multiply the MACs by more than CUDA_TC_MAX_WASTE (``kron_tc_pays``); then "narrow" where
    two small sides fit a tier of the narrow kernel (:func:`cuda_narrow_plan`: the paper's
    2×384 / 384×2, 64× waste), else "cuda-core" (block_gemm, which the H100 of 2026-11-27
    measured at 753 µs on the paper's factors against 68 µs for the Triton factor kernel,
    T = 16384, 768×768, before the narrow kernel existed)."""
    pad = [-(-v // 16) * 16 for v in (a_out, a_in, b_out, b_in)]
    if _kron_bwd_macs(*pad) <= CUDA_TC_MAX_WASTE * _kron_bwd_macs(a_out, a_in, b_out, b_in):
        return "tensor-core"
    return "narrow" if cuda_narrow_plan(a_out, a_in, b_out, b_in) is not None else "cuda-core"


# csrc/krona/kron_matvec.cu kNarrowTiers: (M, N, KC, JC) of kron_narrow_kernel, the CUDA
# extension's factor-gradient kernel for two small factor sides (kThreads = 256 per block).
CUDA_NARROW_TIERS = ((2, 2, 2, 2), (8, 2, 2, 2), (2, 8, 2, 2), (2, 2, 8, 8))
CUDA_NARROW_THREADS = 256


def cuda_narrow_plan(a_out: int, a_in: int, b_out: int, b_in: int):
    """kron_matvec.cu ``narrow_plan`` (shared memory aside): ``(tier, swapped, m, n, K, J)``
    of the narrow kernel for factors whose small sides fit a tier, else None. Unswapped, the
    small sides are a_out and b_in (m, n) and the big ones a_in and b_out (K, J); swapped, the
    kernel runs on the transposed tokens with b_out, a_in small."""
    for swapped in (False, True):
        m, n = (b_out, a_in) if swapped else (a_out, b_in)
        K, J = (b_in, a_out) if swapped else (a_in, b_out)
        for tier, (M, N, KC, JC) in enumerate(CUDA_NARROW_TIERS):
            if m <= M and n <= N and K <= CUDA_NARROW_THREADS * KC and \
                    J <= CUDA_NARROW_THREADS * JC:
                return tier, swapped, m, n, K, J
    return None


def rows(x: torch.Tensor) -> torch.Tensor:
    """x as (T, d) rows with unit inner stride (no copy when it has one): the layout every
    KronA kernel reads (any row stride, 0 included)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()
