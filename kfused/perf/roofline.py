"""H100 roofline: every constant, where it comes from, and how a predicted time is formed.

All times this module produces are PREDICTED (a model of an H100 SXM5 80 GB), never measured.

Work of one kernel launch (or torch op) is split by the unit that executes it:

  dot16_flops   16-bit matrix products (tl.dot on bf16/fp16 tiles). Their rate depends on the
                instruction the compiler chose, read from the SASS: HGMMA (wgmma, sm_90
                asynchronous warpgroup MMA) or HMMA (mma.sync); neither -> CUDA-core FMA.
  fma32_flops   float32 products on CUDA cores (tl.dot with input_precision="ieee" on float32
                tiles lowers to FFMA; also broadcast-and-sum products).
  fma64_flops   float64 products / accumulations (DFMA/DADD).
  sfu_ops       transcendental instructions (MUFU: exp, exp2, log, rcp).
  alu_ops       other float32 element-wise instructions per element (scale, mask, max, sum...).
  hbm_bytes     bytes moved to/from HBM (the kernel's tiling + an L2 re-use rule below).
  dot16_feed_extra  tensor-core time lost to a starved wgmma operand feed (small-N products
                with both operands in shared memory, :func:`wgmma_feed_efficiency`), in FLOP
                equivalents at the dot16 rate; not counted as issued FLOPs.
  dot16_feed_from_sass  (a flag) the products' feed is read from the kernel's SASS instead:
                the FLOP-weighted wgmma_feed_efficiency of the HGMMA instructions in its loops,
                at the shapes (N) and A-operand sources the compiler chose
                (kfused.perf.compile.hgmma_loop_feed; the flash kernels, whose warps may
                split a tile's columns: S = QKᵀ of a 64-row tile on 8 warps is m64n32)
  dot16_sync_extra  in a kernel whose SASS has HGMMA, the extra time of its products that
                the compiler could only issue as mma.sync (M < 64 rows), in FLOP equivalents
                at the wgmma rate: flops · (WGMMA_RATE / MMA_RATE − 1); not issued FLOPs.

  t_compute = t_dot16 + t_fma32 + t_fma64 + t_sfu + t_alu     (pipes not overlapped: none of
              today's kernels software-pipelines softmax against MMA like FlashAttention-3)
  t_mem     = hbm_bytes / min(HBM_BW, min(programs, SMS) * SM_MEM_BW)   (a grid that leaves
              SMs idle streams at what its busy SMs can pull)
  t         = max(t_compute / wave_eff, t_mem) + t_tail + KERNEL_OVERHEAD_S
  t_tail    = serial work after the last wave (the split-KV decode's merge by the last
              program of each kv head), given by the kernel model as ``tail_s``
  wave_eff  = programs / (ceil(programs / (SMS * ctas_per_sm)) * SMS * ctas_per_sm)
              (tail effect: the last wave of CTAs leaves SMs idle; persistent grids ~1)

L2 re-use rule: an operand that a kernel re-reads in P passes (for instance x re-read for
every output-column block) costs its size once if it fits in L2_RESIDENT, P times if it is
twice that or larger, linearly in between.
"""

from __future__ import annotations

import math
from typing import Dict

# --- H100 SXM5 (sm_90), NVIDIA H100 Tensor Core GPU datasheet / architecture whitepaper ------
SMS = 132                              # streaming multiprocessors
PEAK_BF16_DENSE = 989e12               # FLOP/s, bf16/fp16 tensor core, dense (datasheet)
PEAK_HBM = 3.35e12                     # B/s, HBM3 (datasheet)
# Achievable ceilings (issue 10): cuBLAS bf16 GEMM measured at 798 TFLOP/s at 8192^3 on this
# project's H100; 3.0 TB/s is the usual achieved copy bandwidth (~90 % of 3.35).
WGMMA_RATE = 798e12
HBM_BW = 3.0e12
# mma.sync (HMMA) on sm_90 reaches roughly 60-65 % of the wgmma peak (FlashAttention-3 paper,
# Shah et al. 2024, section 1; FA2 on H100 ~ 335-370 TFLOP/s): 0.62 x the achievable ceiling.
MMA_SYNC_FRACTION = 0.62
MMA_RATE = MMA_SYNC_FRACTION * WGMMA_RATE
# CUDA cores: 128 FP32 lanes/SM x 132 SMs x 1.98 GHz boost = 33.5 T FMA/s = 67 TFLOP/s
# (datasheet "FP32 67 TFLOPS"); 80 % achievable like the tensor cores.
FMA32_RATE = 67e12 * 0.8
ALU32_RATE = 33.5e12 * 0.8             # element-wise instructions per second (1 per lane-clk)
FMA64_RATE = 34e12 * 0.8               # datasheet "FP64 34 TFLOPS" (non-tensor)
# MUFU (exp2, rcp, ...): 16 per SM per clock (CUDA C Programming Guide, arithmetic
# instruction throughput, cc 9.0) -> 132 x 16 x 1.98e9 = 4.2e12 /s.
SFU_RATE = 132 * 16 * 1.98e9
# Fixed cost per kernel: launch gap + ramp-up/drain of a short kernel (~2-3 us observed for
# back-to-back launches on H100 with CUDA graphs off); the model uses 3 us.
KERNEL_OVERHEAD_S = 3e-6
L2_BYTES = 50 * 2**20                  # H100 SXM5 L2
# L2 read bandwidth: an assumption of the order that published H100 microbenchmarks report
# (5-7 TB/s); used only for serial tails (one SM's share, L2_BW / SMS), not for kernels' bytes.
L2_BW = 5.5e12
L2_RESIDENT = L2_BYTES // 2            # what an operand may occupy and still be re-used
# What one busy SM can stream: its share of L2 bandwidth (an assumption of the same source),
# so a memory-bound grid of fewer than HBM_BW / SM_MEM_BW ≈ 72 programs cannot reach HBM_BW
# (a split-KV decode with a chunk per kv head, an unpack over a few rows).
SM_MEM_BW = L2_BW / SMS

CONSTANTS = {k: v for k, v in dict(
    SMS=SMS, PEAK_BF16_DENSE=PEAK_BF16_DENSE, PEAK_HBM=PEAK_HBM, WGMMA_RATE=WGMMA_RATE,
    HBM_BW=HBM_BW, MMA_SYNC_FRACTION=MMA_SYNC_FRACTION, MMA_RATE=MMA_RATE,
    FMA32_RATE=FMA32_RATE, ALU32_RATE=ALU32_RATE, FMA64_RATE=FMA64_RATE, SFU_RATE=SFU_RATE,
    KERNEL_OVERHEAD_S=KERNEL_OVERHEAD_S, L2_BYTES=L2_BYTES, L2_RESIDENT=L2_RESIDENT,
    L2_BW=L2_BW, SM_MEM_BW=SM_MEM_BW).items()}


# The devices the model knows: what differs from the H100 SXM5 above. H200 SXM (datasheet):
# the same GH100 compute (132 SMs, 989 TFLOP/s dense 16-bit, 50 MB L2) with HBM3e at 4.8 TB/s;
# its achievable copy bandwidth is ASSUMED at the H100's 90 % of peak (4.3 TB/s) and its GEMM
# ceiling at the H100's until a run measures them (bench JSON: "ceilings").
DEVICES = {
    "h100": dict(PEAK_HBM=3.35e12, HBM_BW=3.0e12, NAME="H100 SXM5"),
    "h200": dict(PEAK_HBM=4.8e12, HBM_BW=4.3e12, NAME="H200 SXM"),
}
DEVICE = "h100"
CONSTANTS["DEVICE"] = DEVICE


def device_key(name: str):
    """The model's key for a device name as torch reports it ("NVIDIA H200" -> "h200"), or
    None for a device the model does not know."""
    low = (name or "").lower()
    for key in DEVICES:
        if key in low:
            return key
    return None


def use_device(key: str) -> None:
    """Predict for device ``key`` (a key of DEVICES) from now on in this process: the module's
    bandwidth constants (read at call time by every model) and CONSTANTS are replaced."""
    global PEAK_HBM, HBM_BW, DEVICE
    if key not in DEVICES:
        raise ValueError(f"device {key!r}: the performance model knows {', '.join(DEVICES)}")
    d = DEVICES[key]
    PEAK_HBM, HBM_BW, DEVICE = d["PEAK_HBM"], d["HBM_BW"], key
    CONSTANTS.update(PEAK_HBM=PEAK_HBM, HBM_BW=HBM_BW, DEVICE=key)


def reread_bytes(size: float, passes: float) -> float:
    """HBM bytes for an operand of ``size`` bytes read in ``passes`` passes (L2 rule above)."""
    if passes <= 1:
        return size
    miss = min(1.0, max(0.0, (size - L2_RESIDENT) / L2_RESIDENT))
    return size * (1 + (passes - 1) * miss)


# wgmma operand feed: one m64nNk16 instruction does 2·64·N·16 FLOPs, i.e. N/2 clocks of an
# SM's dense 16-bit tensor rate (989 TFLOP/s / 132 SMs / 1.83 GHz ~ 4096 FLOP/clk); it reads
# its B operand (N×16, 2 B) and, unless A comes from registers, its A operand (64×16) from
# shared memory at SMEM_BYTES_PER_CLK (32 banks × 4 B). Below N = 64 with A in shared memory
# the feed, not the tensor core, sets the pace.
SMEM_BYTES_PER_CLK = 128


def wgmma_feed_efficiency(n: int, a_in_registers: bool) -> float:
    """Fraction of the tensor-core rate an m64nNk16 wgmma stream can reach from its
    shared-memory operand feed (1.0 when the feed keeps up)."""
    tensor_clk = 2.0 * 64 * n * 16 / 4096
    smem_clk = ((0 if a_in_registers else 64 * 16 * 2) + n * 16 * 2) / SMEM_BYTES_PER_CLK
    return min(1.0, tensor_clk / smem_clk)


def dot16_rate(sass: Dict[str, int]) -> float:
    """Rate of 16-bit products from the instruction the compiler chose."""
    if sass.get("hgmma", 0):
        return WGMMA_RATE
    if sass.get("hmma", 0):
        return MMA_RATE
    return FMA32_RATE


def wave_efficiency(programs: int, ctas_per_sm: int) -> float:
    if programs <= 0 or ctas_per_sm <= 0:
        return 1.0
    slots = SMS * ctas_per_sm
    waves = math.ceil(programs / slots)
    return programs / (waves * slots)


def mem_bw(programs: int) -> float:
    """HBM bandwidth a grid of ``programs`` CTAs can use (0: unknown, the full ceiling)."""
    if programs <= 0:
        return HBM_BW
    return min(HBM_BW, min(programs, SMS) * SM_MEM_BW)


def predict(work: Dict[str, float], sass: Dict[str, int], programs: int,
            ctas_per_sm: int) -> Dict[str, float]:
    """Predicted time (seconds) of one launch, with its parts."""
    # dot16_feed_extra: tensor-core time lost to a starved wgmma operand feed, in FLOP
    # equivalents (see wgmma_feed_efficiency); only where the compiler chose wgmma
    feed = work.get("dot16_feed_extra", 0.0)
    if work.get("dot16_feed_from_sass") and sass.get("hgmma_loop_feed_milli"):
        feed = work.get("dot16_flops", 0.0) * (1000.0 / sass["hgmma_loop_feed_milli"] - 1.0)
    extra = feed + work.get("dot16_sync_extra", 0.0) if sass.get("hgmma", 0) else 0.0
    t_dot = (work.get("dot16_flops", 0.0) + extra) / dot16_rate(sass)
    t_fma = work.get("fma32_flops", 0.0) / FMA32_RATE
    t_f64 = work.get("fma64_flops", 0.0) / FMA64_RATE
    t_sfu = work.get("sfu_ops", 0.0) / SFU_RATE
    t_alu = work.get("alu_ops", 0.0) / ALU32_RATE
    t_comp = t_dot + t_fma + t_f64 + t_sfu + t_alu
    eff = wave_efficiency(programs, max(1, ctas_per_sm)) if programs else 1.0
    t_mem = work.get("hbm_bytes", 0.0) / mem_bw(programs)
    t_tail = work.get("tail_s", 0.0)
    t = max(t_comp / eff, t_mem) + t_tail + KERNEL_OVERHEAD_S
    bound = "memory" if t_mem >= t_comp / eff else "compute"
    return dict(t=t, t_dot16=t_dot, t_fma32=t_fma, t_fma64=t_f64, t_sfu=t_sfu, t_alu=t_alu,
                t_mem=t_mem, t_tail=t_tail, wave_eff=eff, bound=bound)


def gemm_time(M: int, N: int, K: int, el: int = 2, rate: float = WGMMA_RATE,
              out_el: int = 2) -> float:
    """cuBLAS-class GEMM: max(FLOPs at the achievable ceiling, minimum bytes) + overhead."""
    flops = 2.0 * M * N * K
    bytes_ = el * (M * K + K * N) + out_el * M * N
    return max(flops / rate, bytes_ / HBM_BW) + KERNEL_OVERHEAD_S


def torch_op_time(flops: float, nbytes: float) -> float:
    """One torch operation between kernels (the "glue"): matmul FLOPs at the GEMM ceiling or
    its bytes at the streaming rate, whichever is longer, plus the launch."""
    return max(flops / WGMMA_RATE, nbytes / HBM_BW) + KERNEL_OVERHEAD_S


def stream_time(nbytes: float) -> float:
    """A memory-bound torch element-wise / reduction kernel."""
    return nbytes / HBM_BW + KERNEL_OVERHEAD_S
