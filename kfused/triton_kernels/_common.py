"""Small pieces shared by the Triton kernels."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


# The CPU interpreter evaluates an IEEE float32 tl.dot with numpy's float32 matmul (no fused
# multiply-add, its own summation order), which is less accurate than the GPU's FMA chains; in
# the interpreter _mm therefore forms float32 dots exactly in float64 and rounds once. 16-bit
# dots are untouched (their products are exact in the float32 accumulator either way).
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


@triton.jit
def _mm(a, b, USE_DOT: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr = tl.float32):
    """a (M, K) @ b (K, N) -> (M, N) in ACC (float32; float64 for float64 inputs, which only
    the CPU interpreter runs — it lets gradcheck exercise the kernels' autograd path).

    tl.dot needs every dim >= 16 on the GPU; smaller tiles (tiny Kronecker factors, rank-1
    updates) use a broadcast-and-sum product on the CUDA cores instead. The host decides with
    :func:`use_dot` so the interpreter runs the same branch as the GPU.
    """
    if USE_DOT:
        if _INTERPRETED and PREC == "ieee":
            return tl.dot(a.to(tl.float64), b.to(tl.float64), input_precision="ieee",
                          out_dtype=tl.float64).to(ACC)
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
    """Accumulator: float32 on the GPU; float64 for float64 inputs (interpreter-only gradcheck)
    and, in the interpreter, for float32 inputs (see _INTERPRETED: numpy's float32 arithmetic
    is not the GPU's, so the CPU run models exact accumulation; the GPU run checks float32)."""
    if dtype == torch.float64 or (dtype == torch.float32 and bool(_INTERPRETED)):
        return tl.float64
    return tl.float32


def inter_dtype(dtype: torch.dtype):
    """Dtype of intermediates between two products: the input dtype for 16-bit inputs (torch
    rounds them there too), the accumulator for float32/float64."""
    return acc_dtype(dtype) if dtype in (torch.float32, torch.float64) else tl_dtype(dtype)


def tl_dtype(dtype: torch.dtype):
    return {torch.float32: tl.float32, torch.float16: tl.float16,
            torch.bfloat16: tl.bfloat16, torch.float64: tl.float64}[dtype]


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


# Set by kfused.triton_kernels._aot while it records launches to compile them for a GPU on a
# machine without one: host functions then choose their GPU configurations for CPU tensors.
_AOT_TARGET = {"on": False, "sms": 132}


def targets_gpu(device: torch.device) -> bool:
    """Choose GPU block sizes: a CUDA device, or an ahead-of-time compile for one."""
    return device.type == "cuda" or _AOT_TARGET["on"]


def grid_programs(device: torch.device, blocks: int, per_sm: int = 4, interp_cap: int = 4) -> int:
    """Programs for a persistent (grid-stride) kernel: a few per SM on a GPU, few on the CPU."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(blocks, sms * per_sm))
    if _AOT_TARGET["on"]:
        return max(1, min(blocks, _AOT_TARGET["sms"] * per_sm))
    return max(1, min(blocks, interp_cap))
