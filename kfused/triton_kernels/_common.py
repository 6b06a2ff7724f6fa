"""Small pieces shared by the Triton kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mm(a, b, USE_DOT: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr = tl.float32):
    """a (M, K) @ b (K, N) -> (M, N) in ACC (float32; float64 for float64 inputs, which only
    the CPU interpreter runs — it lets gradcheck exercise the kernels' autograd path).

    tl.dot needs every dim >= 16 on the GPU; smaller tiles (tiny Kronecker factors, rank-1
    updates) use a broadcast-and-sum product on the CUDA cores instead. The host decides with
    :func:`use_dot` so the interpreter runs the same branch as the GPU.
    """
    if USE_DOT:
        return tl.dot(a, b, input_precision=PREC, out_dtype=ACC)
    else:
        # float64 products are exact for 16/32-bit inputs, so this path matches an FMA dot;
        # it only serves tiles with a dim < 16, where the float64 cost is negligible.
        prod = a.to(tl.float64)[:, :, None] * b.to(tl.float64)[None, :, :]
        return tl.sum(prod, axis=1).to(ACC)


def use_dot(m: int, k: int, n: int) -> bool:
    return m >= 16 and k >= 16 and n >= 16


def dot_precision(dtype: torch.dtype) -> str:
    """float32 dots must be exact IEEE (TF32 would fail SPEC §4); 16-bit inputs ignore it."""
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def acc_dtype(dtype: torch.dtype):
    """Accumulator: float32, or float64 for float64 inputs (interpreter-only gradcheck)."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def tl_dtype(dtype: torch.dtype):
    return {torch.float32: tl.float32, torch.float16: tl.float16,
            torch.bfloat16: tl.bfloat16, torch.float64: tl.float64}[dtype]


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


def grid_programs(device: torch.device, blocks: int, per_sm: int = 4, interp_cap: int = 4) -> int:
    """Programs for a persistent (grid-stride) kernel: a few per SM on a GPU, few on the CPU."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(blocks, sms * per_sm))
    return max(1, min(blocks, interp_cap))
