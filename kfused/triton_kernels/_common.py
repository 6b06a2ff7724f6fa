"""Small pieces shared by the Triton kernels: the interpreter-exact product ``_mm``, dtype
choices, block sizes, GPU-target choices and the batched token reduction ``_atb``."""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from kfused import _alloc, tuning
from kfused.backends import triton_interpret

F32 = torch.float32


# The CPU interpreter evaluates an IEEE float32 tl.dot with numpy's float32 matmul (no fused
# multiply-add, its own summation order), which is less accurate than the GPU's FMA chains; in
# the interpreter _mm therefore forms float32 dots exactly in float64 and rounds once. 16-bit
# dots are untouched (their products are exact in the float32 accumulator either way).
_INTERPRETED = tl.constexpr(triton_interpret())


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
        if PREC == "ieee":
            # float32/float64 inputs: float64 products are exact for float32 operands, so
            # this path matches an IEEE FMA dot
            return _bcast_mm(a.to(tl.float64), b.to(tl.float64)).to(ACC)
        else:
            # 16-bit inputs (PREC "tf32"): float32 products and sums — exact products of
            # 16-bit operands, one rounding for a float32 operand (a float32 sum carried
            # into the next product), so at least as accurate as the tensor-core dot, which
            # accumulates in float32 too; float64 here cost the CUDA cores 2x (sm_90 DFMA
            # rate) for no accuracy the 16-bit result can keep
            return _bcast_mm(a.to(tl.float32), b.to(tl.float32)).to(ACC)


@triton.jit
def _bcast_mm(a, b):
    """a (M, K) @ b (K, N) as broadcast products summed over K on the CUDA cores, in the
    operands' (float32 / float64) dtype: every product exact, one FMA chain.

    Written plainly (``tl.sum(a[:, :, None] * b[None, :, :], 1)``) the float32 product is
    rewritten by Triton's combine pass into a ``tt.dot``, which Triton 3.6 (the GPU machine's)
    gives TF32 precision (upstream fix triton-lang/triton#9831; Triton 3.9 makes it IEEE):
    a tensor-core ``mma.sync.m16n8k8 ... tf32`` even at K = 2 or 4, and float32 operands cut to
    10 mantissa bits — neither of which the CPU interpreter (it ignores dot precision) shows.
    Compiled with Triton 3.6 for sm_90, the KronA factor-gradient kernel of exactly the three
    factor shapes the H100 failed on (9×3/3×5, 32×16/2×64, 1×10/5×5; K = 4, 2, 2) had such a
    dot, and of none of the seven shapes that passed. The + 0.0 on b's expanded operand
    (exact: x + 0 = x but for the sign of a zero) puts an op between the expansion and the
    broadcast, which that pattern requires to be adjacent; a Triton that still folds the
    product makes an IEEE dot (FMA), the same numbers. tests/test_kernel_source_rules.py keeps
    every such product in the kernels on this helper."""
    return tl.sum(a[:, :, None] * (b[None, :, :] + 0.0), axis=1)


# No tensor-core dot takes a float32 operand split into 16-bit high and low parts (x_hi =
# x.to(16-bit), x_lo = (x - x_hi).to(16-bit), two dots). Compiled by Triton 3.6 for sm_90 such
# small split products gave illegal memory accesses, NaN and silently wrong results that the
# CPU interpreter never shows: the inducer MLP's products on an H100 on 2026-11-25
# (benchmarks/results/h100/inducer-mlp-dot/), and headwise_lowrank on an H200 on 2026-11-30,
# whose backward used such products in its own kernel and in _atb (wrong dbasis/dA, then an
# illegal address; which launch faulted was not located: benchmarks/results/h200/
# proof-2026-11-30, benchmarks/gpu_probe.py lowrank re-checks it). A product with a float32
# operand runs as an IEEE (FMA) dot on the CUDA cores (_mm(..., "ieee")); 16-bit @ 16-bit
# products stay on the tensor cores. tests/test_kernel_source_rules.py holds the kernels to it.


@triton.jit
def _row_block_sum(acc, ptr, n_rows, row_stride, cols, c_ok, BR: tl.constexpr):
    """acc (C,) + Σ_r ptr[r·row_stride + cols] over the n_rows rows, BR rows per load (a
    (BR, C) block reduced over its rows, the blocks in order: a fixed order, deterministic),
    in acc's dtype. One row per load would make the sum a chain of n_rows dependent loads
    (the latency-bound reductions of partials the H100 showed on 2026-11-27)."""
    rb = tl.arange(0, BR)
    # each block loaded one block ahead: these loads feed no dot, so Triton does not pipeline
    # them, and a warp issues in order (a load placed after the previous block's sum waits a
    # DRAM round trip per block)
    v_n = tl.load(ptr + rb[:, None] * row_stride + cols[None, :],
                  mask=(rb < n_rows)[:, None] & c_ok[None, :], other=0.0)
    for r0 in range(0, n_rows, BR):
        v = v_n
        rows = r0 + BR + rb
        v_n = tl.load(ptr + rows[:, None] * row_stride + cols[None, :],
                      mask=(rows < n_rows)[:, None] & c_ok[None, :], other=0.0)
        acc += tl.sum(v.to(acc.dtype), axis=0)
    return acc


@triton.jit
def _grouped_tile(pid, n_m, n_n, GROUP: tl.constexpr):
    """(row block, column block) of program ``pid`` of an (n_m × n_n)-tile GEMM in grouped
    order: GROUP row blocks walk every column block before the next group starts, so the
    group's rows and the column blocks' B tiles are re-read from L2."""
    per_group = GROUP * n_n
    first = (pid // per_group) * GROUP
    gsz = tl.minimum(n_m - first, GROUP)
    return first + (pid % per_group) % gsz, (pid % per_group) // gsz


def use_dot(m: int, k: int, n: int) -> bool:
    return m >= 16 and k >= 16 and n >= 16


def dot_precision(dtype: torch.dtype) -> str:
    """float32 dots must be exact IEEE (TF32 would fail docs/math.md §4); 16-bit inputs ignore it."""
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


def host_config(fn=None, *, tuned: bool = False):
    """Remember a host configuration function's result per arguments (ints, dtypes, devices,
    bools) and ``_AOT_TARGET`` state: block sizes are chosen once per shape, not on every call
    (the launch path is host-bound at the benchmark shapes: see kfused.ops._common). A dict
    result is handed out as a copy (callers may edit theirs). At most 4096 entries (a run
    with ever-new token counts restarts the cache rather than grow it). ``tuned=True``: the
    function may take its choice from the tuning table, so the key holds the table in use
    too (:func:`kfused.tuning.state`): another table or ``tuning.forget()`` reaches the next
    call."""
    if fn is None:
        return functools.partial(host_config, tuned=tuned)
    cache: dict = {}
    state = tuning.state if tuned else (lambda: None)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        key = (args, tuple(kwargs.items()) if kwargs else (), _AOT_TARGET["on"],
               _AOT_TARGET["sms"], state())
        try:
            hit = cache[key]
        except KeyError:
            if len(cache) >= 4096:
                cache.clear()
            hit = cache[key] = fn(*args, **kwargs)
        return dict(hit) if isinstance(hit, dict) else hit

    wrapper.cache_clear = cache.clear
    return wrapper


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host code (``triton.cdiv`` is a constexpr function in newer Triton,
    microseconds a call)."""
    return -(-int(a) // int(b))


def next_pow2(n: int) -> int:
    """The smallest power of two >= max(n, 1). Plain Python: host code calls it a score of
    times per op call, and ``triton.next_power_of_2`` (a constexpr function in newer Triton)
    costs microseconds a call."""
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# Set by kfused.perf.compile.recording while it records launches to compile them for a GPU on a
# machine without one: host functions then choose their GPU configurations for CPU tensors.
_AOT_TARGET = {"on": False, "sms": 132}


def targets_gpu(device: torch.device) -> bool:
    """Choose GPU block sizes: a CUDA device, or an ahead-of-time compile for one."""
    return device.type == "cuda" or _AOT_TARGET["on"]


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The SMs of a CUDA device, asked once per device (host functions size grids with it
    on every call)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def ctas_per_sm(regs: int, shared: int, num_warps: int, sm_regs: int = 65536,
                sm_smem: int = 233472, sm_threads: int = 2048, max_ctas: int = 32,
                smem_per_block: int = 232448, reserved_smem: int = 1024) -> int:
    """CTAs of a compiled kernel resident on one SM at once: registers (allocated per warp in
    units of 256), shared memory (plus the 1 KB the driver reserves per CTA), threads. The
    defaults are sm_90's (the CUDA C Programming Guide's table); kfused.perf uses the same
    rule with each architecture's limits."""
    regs_per_warp = ((max(regs, 1) * 32 + 255) // 256) * 256
    by_regs = sm_regs // (regs_per_warp * num_warps)
    by_threads = sm_threads // (32 * num_warps)
    by_smem = (sm_smem // (shared + reserved_smem)) if shared else max_ctas
    if shared > smem_per_block:
        by_smem = 0
    return int(max(0, min(by_regs, by_threads, by_smem, max_ctas)))


@functools.lru_cache(maxsize=None)
def _sm_limits(index: int) -> dict:
    p = torch.cuda.get_device_properties(index)
    out = {}
    for key, attr in (("sm_regs", "regs_per_multiprocessor"),
                      ("sm_smem", "shared_memory_per_multiprocessor"),
                      ("sm_threads", "max_threads_per_multi_processor"),
                      ("smem_per_block", "shared_memory_per_block_optin")):
        v = getattr(p, attr, None)
        if isinstance(v, int) and v > 0:
            out[key] = v
    return out


def resident_ctas(device: torch.device, compiled) -> Optional[int]:
    """CTAs per SM of a compiled Triton kernel (what its launch returned) on this CUDA device,
    or None where the compiled object does not say (the interpreter, another Triton)."""
    try:
        regs = int(compiled.n_regs)
        shared = int(getattr(compiled.metadata, "shared", 0) or 0)
        warps = int(compiled.metadata.num_warps)
    except (AttributeError, TypeError, ValueError):
        return None
    if regs <= 0 or device.type != "cuda":
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return ctas_per_sm(regs, shared, warps, **_sm_limits(idx)) or None


def grid_programs(device: torch.device, blocks: int, per_sm: int = 4, interp_cap: int = 4) -> int:
    """Programs for a persistent (grid-stride) kernel: a few per SM on a GPU, few on the CPU."""
    if device.type == "cuda":
        return max(1, min(blocks, sm_count(device) * per_sm))
    if _AOT_TARGET["on"]:
        return max(1, min(blocks, _AOT_TARGET["sms"] * per_sm))
    return max(1, min(blocks, interp_cap))


# Warps per program of _atb_kernel and the headwise_lowrank kernels.
_NW = 8


def _blk(n: int, lo: int = 16, hi: int = 64) -> int:
    return max(lo, min(hi, next_pow2(n)))


def _rblk(r: int) -> int:
    return max(16, next_pow2(max(r, 1)))



def _splits(device: torch.device, K: int, programs: int, BK: int = 64) -> int:
    """How many K splits for a long reduction (over tokens): enough programs to fill the GPU."""
    chunks = max(1, cdiv(K, 4 * BK))
    if not targets_gpu(device):
        return min(chunks, 2)
    sms = sm_count(device) if device.type == "cuda" else _AOT_TARGET["sms"]
    want = max(1, (2 * sms) // max(1, programs))
    return max(1, min(chunks, want, 64))



# ------------------------------------------------------------------------------------------
# Batched split-T reduction  C[b] = A[b]ᵀ B[b]  (+ colsum_t A[b])


@triton.jit
def _atb_kernel(a_ptr, s_at, s_ab, s_am,
                b_ptr, s_bt, s_bb, s_bn,
                b2_ptr, s_b2t, s_b2b, s_b2n,
                c_ptr, c2_ptr, cs_ptr,
                T, M, N, N2, NB, T_PER,
                BT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BN2: tl.constexpr,
                HAS_B2: tl.constexpr, COLSUM: tl.constexpr, RACC: tl.constexpr,
                TC: tl.constexpr):
    # grid: (NB * cdiv(M, BM) * cdiv(N, BN), S). Split s reduces tokens
    # [s*T_PER, (s+1)*T_PER) and writes float32 partials c[s, b]; the host sums over s.
    # C2 and the column sums are produced by the programs of the first N-block.
    # TC (every operand of one 16-bit dtype; tile dims >= 16): the products on the tensor
    # cores; else IEEE float32 dots on the CUDA cores (no split float32 operand: see above).
    pid = tl.program_id(0)
    s = tl.program_id(1)
    n_mb = tl.cdiv(M, BM)
    n_nb = tl.cdiv(N, BN)
    b = pid // (n_mb * n_nb)
    rest = pid % (n_mb * n_nb)
    mb = rest // n_nb
    nb = rest % n_nb
    rm = mb * BM + tl.arange(0, BM)
    rn = nb * BN + tl.arange(0, BN)
    rn2 = tl.arange(0, BN2)
    mmask = rm < M
    nmask = rn < N
    # Token sums accumulate in float32 (RACC) across blocks; splits are summed by the host.
    acc = tl.zeros((BM, BN), dtype=RACC)
    acc2 = tl.zeros((BM, BN2), dtype=RACC)
    cs = tl.zeros((BM,), dtype=RACC)
    t_lo = s * T_PER
    t_hi = tl.minimum(t_lo + T_PER, T)
    rt0 = tl.arange(0, BT)
    for t0 in range(t_lo, t_hi, BT):
        rt = t0 + rt0
        tmask = rt < t_hi
        a = tl.load(a_ptr + b * s_ab + rt[:, None] * s_at + rm[None, :] * s_am,
                    mask=tmask[:, None] & mmask[None, :], other=0.0)
        bt = tl.load(b_ptr + b * s_bb + rt[:, None] * s_bt + rn[None, :] * s_bn,
                     mask=tmask[:, None] & nmask[None, :], other=0.0)
        if TC:
            at = tl.trans(a)
            acc += tl.dot(at, bt, out_dtype=tl.float32).to(RACC)
        else:
            a = a.to(tl.float32)
            at = tl.trans(a)
            acc += _mm(at, bt.to(tl.float32), True, "ieee").to(RACC)
        if HAS_B2:
            b2 = tl.load(b2_ptr + b * s_b2b + rt[:, None] * s_b2t + rn2[None, :] * s_b2n,
                         mask=tmask[:, None] & (rn2[None, :] < N2), other=0.0)
            if TC:
                acc2 += tl.dot(at, b2, out_dtype=tl.float32).to(RACC)
            else:
                acc2 += _mm(at, b2.to(tl.float32), True, "ieee").to(RACC)
        if COLSUM:
            cs += tl.sum(a.to(RACC), axis=0)
    base = (s * NB + b) * M
    tl.store(c_ptr + (base + rm[:, None]) * N + rn[None, :], acc,
             mask=mmask[:, None] & nmask[None, :])
    if nb == 0:
        if HAS_B2:
            tl.store(c2_ptr + (base + rm[:, None]) * N2 + rn2[None, :], acc2,
                     mask=mmask[:, None] & (rn2[None, :] < N2))
        if COLSUM:
            tl.store(cs_ptr + base + rm, cs, mask=mmask)


def _atb(a: torch.Tensor, b: torch.Tensor, b2: Optional[torch.Tensor] = None,
        colsum: bool = False, out_dtype: torch.dtype = F32
        ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Batched ``a[:, i]ᵀ b[:, i]`` reduced over tokens (the factor gradients).

    a (T, NB, M); b (T, NB or 1, N); b2 (T, NB or 1, N2) with N2 <= 128; any strides (a
    size-1 batch dim of b/b2 is broadcast). Returns C (NB, M, N), C2 (NB, M, N2) or None and
    colsum_t a (NB, M) or None, in ``out_dtype``. Accumulates in float32: on the tensor cores
    when every operand has the same 16-bit dtype, else (a float32 operand) IEEE dots on the
    CUDA cores, which keep that operand whole.
    """
    T, NB, M = a.shape
    N = b.shape[2]
    N2 = b2.shape[2] if b2 is not None else 1
    if N2 > 128:
        C, _, CS = _atb(a, b, None, colsum, out_dtype)
        C2, _, _ = _atb(a, b2, None, False, out_dtype)
        return C, C2, CS
    dev = a.device
    dts = {t.dtype for t in (a, b, b2) if t is not None}
    # every operand of one 16-bit dtype: tensor-core products (a float32 operand: FMA dots)
    tc = len(dts) == 1 and dts <= {torch.float16, torch.bfloat16}
    BT = 64 if targets_gpu(dev) else 32
    # FMA dots hold their (BM, BN) float32 products' operands in registers: 64 x 64 tiles
    # spilled (255 registers, sm_90) where 32-wide ones do not
    BM = _blk(M, 16, 64 if tc else 32)
    BN = _blk(N, 16, 64 if tc else 32)
    BN2 = _rblk(N2)
    programs = NB * cdiv(M, BM) * cdiv(N, BN)
    S = _splits(dev, T, programs, BT // 4)
    T_PER = max(BT, cdiv(cdiv(max(T, 1), S), BT) * BT)
    S = max(1, cdiv(T, T_PER))
    racc = F32
    c = _alloc.empty(S, NB, M, N, dtype=racc, device=dev)
    c2 = _alloc.empty(S, NB, M, N2, dtype=racc, device=dev) if b2 is not None else c
    cs = _alloc.empty(S, NB, M, dtype=racc, device=dev) if colsum else c
    sb = lambda t: t.stride(1) if t.shape[1] > 1 else 0  # noqa: E731
    bb2 = b2 if b2 is not None else b
    _atb_kernel[(programs, S)](
        a, a.stride(0), a.stride(1), a.stride(2),
        b, b.stride(0), sb(b), b.stride(2),
        bb2, bb2.stride(0), sb(bb2), bb2.stride(2),
        c, c2, cs, T, M, N, N2, NB, T_PER,
        BT=BT, BM=BM, BN=BN, BN2=BN2, HAS_B2=b2 is not None, COLSUM=colsum,
        RACC=tl.float32, TC=tc, num_warps=_NW)
    C = c.sum(0).to(out_dtype)
    C2 = c2.sum(0).to(out_dtype) if b2 is not None else None
    CS = cs.sum(0).to(out_dtype) if colsum else None
    return C, C2, CS
