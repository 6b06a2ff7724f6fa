"""Unit tests of the static performance model (no compiler, no GPU)."""

import math
import os

from kfused.perf import roofline as R
from kfused.perf.compile import classify_sass, occupancy


def test_occupancy_limits():
    # 255 registers x 256 threads: one CTA (64K registers per SM)
    assert occupancy(255, 0, 8, 90) == 1
    # 128 registers x 128 threads: 4 CTAs by registers
    assert occupancy(128, 0, 4, 90) == 4
    # shared memory bound: 100 KB per CTA -> 2 on sm_90 (228 KB), 1 on sm_80 (164 KB)
    assert occupancy(32, 100 * 1024, 4, 90) == 2
    assert occupancy(32, 100 * 1024, 4, 80) == 1
    # too much shared memory: does not launch
    assert occupancy(32, 240 * 1024, 4, 90) == 0
    # threads: 2048 per SM
    assert occupancy(16, 0, 16, 90) == 4


def test_classify_sass():
    ops = ["HGMMA.64x128x16.F32.BF16", "HMMA.16816.F32.BF16", "FFMA", "FFMA.FTZ", "LDG.E.128",
           "LDG.E.U16", "LDG.E.64", "LDGSTS.E.BYPASS.128", "MUFU.EX2", "STG.E.128", "DFMA"]
    m = classify_sass(ops)
    assert m["hgmma"] == 1 and m["hmma"] == 1 and m["ffma"] == 2 and m["ldg128"] == 1
    assert m["ldg_narrow"] == 1 and m["ldg64"] == 1 and m["ldgsts128"] == 1 and m["mufu"] == 1
    assert m["stg128"] == 1 and m["dfma"] == 1 and m["total"] == len(ops)


def test_predict_units():
    # a compute-bound wgmma launch filling whole waves runs at the wgmma ceiling
    w = dict(dot16_flops=R.WGMMA_RATE * 1e-3, hbm_bytes=0.0)
    p = R.predict(w, {"hgmma": 1}, R.SMS * 4, 1)
    assert math.isclose(p["t"], 1e-3 + R.KERNEL_OVERHEAD_S)
    # the same FLOPs on mma.sync take 1 / MMA_SYNC_FRACTION longer, on CUDA cores much longer
    p2 = R.predict(w, {"hmma": 1}, R.SMS * 4, 1)
    assert math.isclose(p2["t"] - R.KERNEL_OVERHEAD_S, 1e-3 / R.MMA_SYNC_FRACTION)
    p3 = R.predict(w, {}, R.SMS * 4, 1)
    assert p3["t"] > 10 * p["t"]
    # tail effect: 133 programs on 132 single-CTA slots take two waves
    p4 = R.predict(w, {"hgmma": 1}, R.SMS + 1, 1)
    assert math.isclose(p4["wave_eff"], (R.SMS + 1) / (2 * R.SMS))
    # memory bound: a grid on every SM streams at the HBM ceiling
    p5 = R.predict(dict(hbm_bytes=R.HBM_BW * 1e-3), {}, R.SMS, 1)
    assert p5["bound"] == "memory" and math.isclose(p5["t"], 1e-3 + R.KERNEL_OVERHEAD_S)
    # ... one program streams at what one SM can pull; the ceiling needs HBM_BW / SM_MEM_BW
    p6 = R.predict(dict(hbm_bytes=R.HBM_BW * 1e-3), {}, 1, 1)
    assert math.isclose(p6["t_mem"], R.HBM_BW * 1e-3 / R.SM_MEM_BW)
    n_full = math.ceil(R.HBM_BW / R.SM_MEM_BW)
    assert R.mem_bw(n_full) == R.HBM_BW > R.mem_bw(n_full - 1)


def test_l2_reread_rule():
    assert R.reread_bytes(1e6, 8) == 1e6                         # fits: read once
    big = 4 * R.L2_RESIDENT
    assert R.reread_bytes(big, 8) == big * 8                     # thrashes: every pass
    mid = 1.5 * R.L2_RESIDENT
    assert big * 1 < R.reread_bytes(mid, 8) / mid * big < big * 8


def test_gemm_baseline_is_the_calibration():
    t = R.gemm_time(8192, 8192, 8192)
    assert abs(2 * 8192 ** 3 / t / 1e12 - 798) < 5


_SPEC_CHECK = r"""
import torch, triton, triton.language as tl
from kfused.perf.compile import jit_spec, _manual_spec

@triton.jit
def k(x_ptr, n, s1, s16, s7, f, B: tl.constexpr):
    pass

x = torch.empty(64, dtype=torch.bfloat16)
args = (x, 100, 1, 32, 7, 0.5)
for spec in (jit_spec(k, args, dict(B=16, num_warps=4), 90),
             _manual_spec(k, args, dict(B=16, num_warps=4), 90)):
    sig, consts, attrs, opts = spec
    assert sig["x_ptr"] == "*bf16" and sig["s1"] == "constexpr", sig
    assert consts[(2,)] == 1 and consts[(6,)] == 16, consts
    assert sig["n"] == "i32" and sig["s16"] == "i32" and sig["f"] == "fp32", sig
    div = lambda i: ["tt.divisibility", 16] in attrs.get((i,), [])
    assert div(0) and div(3) and not div(1) and not div(4), attrs
    assert opts["num_warps"] == 4
print("ok")
"""


def test_jit_spec_matches_triton_specialisation(tmp_path):
    """Integer arguments equal to 1 become constexprs and multiples of 16 (and aligned
    pointers) get divisibility 16 — as Triton's JIT specialises at launch — both through
    Triton's own binder and through the hand-written fallback."""
    import os
    import subprocess
    import sys

    import pytest

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    script = tmp_path / "spec_check.py"          # @triton.jit needs a source file
    script.write_text(_SPEC_CHECK)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_wgmma_feed_efficiency():
    # m64n32k16 with both operands in shared memory: 3 KB per 16 tensor clocks at 128 B/clk
    assert math.isclose(R.wgmma_feed_efficiency(32, False), 16 / 24)
    assert R.wgmma_feed_efficiency(64, False) == 1.0       # 4 KB in 32 clocks: keeps up
    assert R.wgmma_feed_efficiency(16, True) == 1.0        # A in registers: B alone keeps up
    # the lost time is charged only where the compiler chose wgmma
    w = dict(dot16_flops=R.WGMMA_RATE * 1e-3, dot16_feed_extra=R.WGMMA_RATE * 0.5e-3)
    p = R.predict(w, {"hgmma": 1}, R.SMS, 1)
    assert math.isclose(p["t_dot16"], 1.5e-3)
    p2 = R.predict(w, {"hmma": 1}, R.SMS, 1)
    assert math.isclose(p2["t_dot16"], 1e-3 / R.MMA_SYNC_FRACTION)


def test_kron_factor_steps_instruction_rule():
    """KronA factor-gradient products are charged by the instruction the sm_90 TTGIR shows:
    M >= 64 rows wgmma (feed-limited at N < 64 only with A from shared memory: G's loaded
    rows in W1 = G·B), M < 64 mma.sync (dot16_sync_extra); the 16-bit hi/lo pairs of dA and
    dB are one dot stacked along M."""
    from kfused.perf import cases as C

    a = dict(BT=2, AOP=32, AIP=32, BOP=32, BIP=32, DOT_W1=True, DOT_DA=True, DOT_V=True,
             DOT_DB=True, SPLIT=True)
    w = C._work()
    C._factor_steps(w, a, 1.0, True)
    w1, da, v, db = 2 * 64 * 32 * 32, 2 * 64 * 32 * 64, 2 * 64 * 32 * 32, 2 * 64 * 32 * 64
    assert w["dot16_flops"] == w1 + da + v + db
    assert w.get("dot16_sync_extra", 0.0) == 0.0                 # every M is 64
    assert math.isclose(w["dot16_feed_extra"], w1 * (1 / R.wgmma_feed_efficiency(32, False) - 1))
    # 16-wide factors: the stacked dA, dB have M = 32 -> mma.sync; W1 and V (M = 2·16) too
    w = C._work()
    C._factor_steps(w, dict(a, AOP=16, AIP=16, BOP=16, BIP=16), 1.0, True)
    assert w.get("dot16_feed_extra", 0.0) == 0.0
    assert math.isclose(w["dot16_sync_extra"],
                        w["dot16_flops"] * (R.WGMMA_RATE / R.MMA_RATE - 1))
    # float32 inputs: no split (dA, dB unstacked) and IEEE dots on the CUDA cores
    w = C._work()
    C._factor_steps(w, dict(a, SPLIT=False), 1.0, False)
    assert w["dot16_flops"] == 0 and w["fma32_flops"] == w1 + da / 2 + v + db / 2
    # the sync extra is charged only where the SASS has HGMMA
    p = R.predict(dict(dot16_flops=R.WGMMA_RATE * 1e-3,
                       dot16_sync_extra=R.WGMMA_RATE * 1e-3 * (R.WGMMA_RATE / R.MMA_RATE - 1)),
                  {"hgmma": 1}, R.SMS, 1)
    assert math.isclose(p["t_dot16"], 1e-3 / R.MMA_SYNC_FRACTION)


def test_cuda_inducer_model_follows_the_csrc_host():
    """The Python replica of inducer_attention_fwd's launch decision (kfused.perf.cases) uses
    the tile constants csrc/inducer/inducer.cuh defines, and splits the keys the way the
    host does: prefill fills the GPU with 128-row (p <= 64) or 64-row blocks (no split);
    decode with few blocks splits the keys (at most 64 splits, at least one stage each), else
    not."""
    import pathlib
    import re

    from kfused.perf import cases as C

    src = (pathlib.Path(__file__).resolve().parents[1] / "csrc" / "inducer" /
           "inducer.cuh").read_text()
    consts = dict(re.findall(r"(k(?:Prefill|Decode)(?:BN|RW|KW)) = (\d+)", src))
    assert (int(consts["kPrefillBN"]), int(consts["kPrefillRW"]), int(consts["kDecodeBN"]),
            int(consts["kDecodeKW"])) == (C._CU_PREFILL_BN, C._CU_PREFILL_RW, C._CU_DECODE_BN,
                                          C._CU_DECODE_KW)
    decode, BM, SK, row_tiles, nsplit, per, gpack = C._cuda_inducer_grid(8, 16, 2048, 2048)
    assert (decode, BM, SK, row_tiles, nsplit, gpack) == (False, 64, 64, 32, 1, 1)
    # two 16-row tiles per warp up to a padded head width of 64 (inducer.cuh prefill_rows)
    assert re.search(r"kPrefillMrMaxD = (\d+);", src).group(1) == str(C._CU_PREFILL_MR_MAX_D)
    for p, rows in ((16, 128), (32, 128), (64, 128), (65, 64), (96, 64), (128, 64)):
        assert C._cuda_inducer_grid(8, 16, 2048, 2048, p=p)[1:4] == (rows, 64, 2048 // rows), p
    decode, BM, SK, row_tiles, nsplit, per, gpack = C._cuda_inducer_grid(1, 8, 1, 16384)
    assert decode and (BM, SK, row_tiles, gpack) == (16, 64, 1, 1)
    # min(cdiv(2·132, 8) = 33, 256 stages, 64) splits of cdiv(256, 33) = 8 stages -> 32
    assert (nsplit, per) == (32, 8)
    assert C._cuda_inducer_grid(8, 32, 1, 4096)[4] == 1     # 256 blocks fill the GPU
    # grouped-query decode: a kv head's 4 query heads packed into one block (64 blocks, so
    # the keys split again), unless their rows overflow the 16-row tile or a prefix is given
    # (csrc/inducer/inducer_attention_fwd.cu's gpack rule)
    assert C._cuda_inducer_grid(8, 32, 1, 4096, Hkv=8)[6] == 4
    assert C._cuda_inducer_grid(8, 32, 1, 4096, Hkv=8)[4] > 1
    assert C._cuda_inducer_grid(8, 32, 4, 4096, Hkv=8)[6] == 4       # 16 rows: still one tile
    assert C._cuda_inducer_grid(8, 32, 5, 4096, Hkv=8)[6] == 2       # 2 heads x 5 rows
    assert C._cuda_inducer_grid(8, 24, 6, 4096, Hkv=8)[6] == 1       # 3 x 6 > 16, 3 prime
    assert C._cuda_inducer_grid(8, 32, 17, 4096, Hkv=4)[6] == 1      # prefill schedule
    assert C._cuda_inducer_grid(8, 32, 1, 4096, l=3, Hkv=8)[6] == 1  # a prefix per query head
    assert C._cuda_inducer_grid(8, 32, 64, 4096, Hkv=8)[6] == 1      # prefill
    host = (pathlib.Path(__file__).resolve().parents[1] / "csrc" / "inducer" /
            "inducer_attention_fwd.cu").read_text()
    assert "if (group % d == 0 && d * n_q <= rows_blk) {" in host
    assert "rows_blk = decode ? 16 : prefill_rows(static_cast<int>(ceil_div(p, 32)) * 32);" in host
    # the host's limit on the in-kernel MLP (kfused.ops refuses wider MLPs for "cuda")
    from kfused.ops.inducer_attention import CUDA_MLP_MAX_COLS
    assert int(re.search(r"kMlpMaxCols = (\d+)", src).group(1)) == CUDA_MLP_MAX_COLS


def test_cuda_krona_model_follows_the_csrc_host():
    """The model of krona_linear(backend="cuda") uses kron_matvec.cu's launch constants
    (threads, tokens per tile, the 100 KiB budget) and costs what the folded path runs: the
    fold once when the forward keeps W' (T >= 8·d_out) and twice otherwise, cuBLAS twice,
    the backward kernel without dx and its reduction."""
    import pathlib
    import re

    from kfused.perf import cases as C

    src = (pathlib.Path(__file__).resolve().parents[1] / "csrc" / "krona" /
           "kron_matvec.cu").read_text()
    assert int(re.search(r"kThreads = (\d+);", src).group(1)) == C._CU_KRON_THREADS
    assert int(re.search(r"kTileMaxTokens = (\d+);", src).group(1)) == C._CU_KRON_MAX_TT
    assert re.search(r"kPreferred = (\d+) \* 1024", src).group(1) == "100"
    assert C._CU_KRON_BUDGET == 100 * 1024
    for T, folds in ((16384, 1), (6143, 2)):
        parts = C._cuda_krona(T, 768, 768, (24, 24), (32, 32))
        names = [p["name"] for p in parts]
        assert sum("krona_fold_kernel" in n for n in names) == folds
        assert sum("GEMM on W'" in n for n in names) == 2
    assert any("kron_mma_bwd_kernel" in n for n in names) and "reduce_partials" in names[-1]
    # the host's choice between the tensor-core and the CUDA-core backward kernel
    assert float(re.search(r"kTcMaxWaste = ([\d.]+);", src).group(1)) == C._CU_KRON_TC_MAX_WASTE
    assert C._cuda_kron_tc_pays((24, 24), (32, 32)) and C._cuda_kron_tc_pays((48, 24), (64, 32))
    assert not C._cuda_kron_tc_pays((2, 384), (384, 2))          # 64x padding waste
    # the narrow kernel's tiers (kron_matvec.cu kNarrowTiers, 256 threads) and its plan
    from kfused.ops import _krona_common as KC

    tiers = re.search(r"kNarrowTiers\[\] = \{(.*?)\};", src, re.S).group(1)
    assert tuple(tuple(int(v) for v in t.split(",")) for t in
                 re.findall(r"\{([\d, ]+)\}", tiers)) == KC.CUDA_NARROW_TIERS
    assert int(re.search(r"constexpr int kThreads = (\d+);", src).group(1)) == \
        KC.CUDA_NARROW_THREADS
    assert KC.cuda_narrow_plan(2, 384, 384, 2) == (0, False, 2, 2, 384, 384)
    assert KC.cuda_narrow_plan(384, 2, 2, 384) == (0, True, 2, 2, 384, 384)
    assert KC.cuda_narrow_plan(8, 384, 384, 2)[:2] == (1, False)
    assert KC.cuda_narrow_plan(2, 1536, 384, 2)[:2] == (3, False)
    assert KC.cuda_narrow_plan(3, 5, 7, 11) is None                  # block_gemm kernel
    assert KC.cuda_factor_kernel(2, 384, 384, 2) == "narrow"
    assert KC.cuda_factor_kernel(3, 5, 7, 11) == "cuda-core"
    assert KC.cuda_factor_kernel(24, 24, 32, 32) == "tensor-core"
    assert "kron_narrow_kernel" in C._cuda_kron_bwd("x", 4096, (2, 384), (384, 2),
                                                         False)[0]["name"]
    assert "CUDA cores" in C._cuda_kron_bwd("x", 4096, (3, 5), (7, 11), False)[0]["name"]
    with_dx = C._cuda_kron_bwd("x", 16384, (24, 24), (32, 32), need_dx=True)
    without = C._cuda_kron_bwd("x", 16384, (24, 24), (32, 32), need_dx=False)
    assert with_dx[0]["flops"] > without[0]["flops"] and with_dx[0]["t"] > without[0]["t"]


def test_cuda_headwise_lowrank_model_follows_the_csrc_host():
    """The headwise_lowrank CUDA model uses headwise_lowrank.cu's tile constants and costs
    every launch of its backward (dU, dbasis, dA, dB with dbias — all stream GEMMs — and the
    reductions)."""
    import pathlib
    import re

    from kfused.perf import cases as C

    src = (pathlib.Path(__file__).resolve().parents[1] / "csrc" / "headwise" /
           "headwise_lowrank.cu").read_text()
    assert int(re.search(r"kHwBM = (\d+)", src).group(1)) == C._CU_HW_BM
    assert int(re.search(r"kHwMaxN = (\d+)", src).group(1)) == C._CU_HW_MAXN
    assert int(re.search(r"kSgBM = (\d+)", src).group(1)) == C._CU_SG_TILE
    names = [p["name"] for p in C._cuda_headwise_lowrank(4096, 12, 768, 64, 8, True)]
    for part in ("headwise_mma_kernel", "(dU = g B)", "(dbasis)", "(dA)", "(dB + dbias)"):
        assert any(part in n for n in names), part
    # U comes from the forward (no recompute launch), dbias from dB's product (no column pass)
    assert sum("headwise_mma_kernel" in n for n in names) == 1
    assert not any("colreduce" in n or "du_kernel" in n for n in names)
    assert sum("stream_gemm_mma_kernel" in n for n in names) == 4
    assert sum("reduce_partials" in n for n in names) == 2
    assert "inline int u_width(int r) { return (r + 1 + 7) / 8 * 8; }" in src


def test_min_ratio_targets():
    """A target with a lower limit (a baseline that must keep up with kfused's Triton path,
    such as the CUDA C++ one) is met only at or above it, and prints as ">=x"."""
    from kfused.perf.report import _limit, _within

    assert _within(0.95, None, 1 / 1.1) and not _within(0.5, None, 1 / 1.1)
    assert _within(1.2, 1.25) and not _within(1.3, 1.25)
    assert _limit(dict(max_ratio=None, min_ratio=1.0)) == ">=1.00"
    assert _limit(dict(max_ratio=1.25, min_ratio=None)) == "1.25"


def test_compiled_kernel_that_cannot_launch_is_a_failure(monkeypatch, tmp_path):
    """Triton compiles a kernel whatever shared memory it asks for and refuses it only when
    loading it on the GPU (OutOfResources): compile_many reports such a kernel (no CTA fits
    an SM) as a failure, so `kfused perf --check` cannot pass a kernel that never runs."""
    import types

    from kfused.perf import compile as CP

    monkeypatch.setenv("KFUSED_CACHE", str(tmp_path))
    fn = types.SimpleNamespace(__name__="k_nolaunch", cache_key="k_nolaunch-src")
    spec = ({"x": "*bf16"}, {}, {}, dict(num_warps=4, num_stages=3))
    big = CP.SM_LIMITS[90]["smem_per_block"] + 1024
    stats = dict(regs=64, shared_bytes=big, num_warps=4,
                 ctas_per_sm=CP.occupancy(64, big, 4, 90), sass={}, dots={})
    assert stats["ctas_per_sm"] == 0
    monkeypatch.setattr(CP, "compile_launch", lambda f, s, a, use_cache=True: dict(stats))
    (st, err), = CP.compile_many([(fn, spec, 90)], jobs=1)
    assert st is None and "shared memory" in err and str(big) in err
    ok = dict(stats, shared_bytes=1024, ctas_per_sm=CP.occupancy(64, 1024, 4, 90))
    monkeypatch.setattr(CP, "compile_launch", lambda f, s, a, use_cache=True: dict(ok))
    (st, err), = CP.compile_many([(fn, spec, 90)], jobs=1)
    assert err is None and st["ctas_per_sm"] > 0


def test_fa2_baseline_counts_the_causal_diagonal_tiles():
    """The FlashAttention-2 baseline issues whole 128 × 128 tiles like kfused's kernels (whose
    causal diagonal tiles are counted in full): a causal head of m = 128·k tokens computes
    k(k + 1)/2 tiles, m(m + 128)/2 scores, not m²/2 (for m = 512: 10 tiles, not 8)."""
    from kfused.perf import cases as C

    H, m, p = 2, 512, 64
    causal = H * (m * (m + 128) // 2)                        # 163 840 scores per head · H
    fwd = C._fa2("f", 1, H, m, p, True, False)
    assert fwd[0]["flops"] == causal * 2 * 2.0 * p           # S = QKᵀ, PV
    bwd = C._fa2("b", 1, H, m, p, True, True)
    assert bwd[0]["flops"] == causal * 5 * 2.0 * p
    full = C._fa2("f", 1, H, m, p, False, False)
    assert full[0]["flops"] == H * m * m * 2 * 2.0 * p       # no padding at m = 128·k
    var = C._fa2_varlen("v", [128, 384], H, p, True, False)  # 1 and 6 tiles of 128 × 128
    assert var[0]["flops"] == H * (1 + 6) * 128 * 128 * 2 * 2.0 * p


def test_headwise_lora_baseline_has_the_same_parameter_budget():
    """The peft-LoRA baseline of a headwise_qkv case has the rank whose q (d -> H·p) and v
    (d -> Hkv·p) LoRA pair holds the preset's trainable q/v parameters (per-head biases
    included, as headwise_parameter_count counts them): with grouped-query attention v is
    Hkv·p wide, not d (llama-7b-gqa: rank 43, not 34)."""
    import dataclasses

    from kfused.modules.headwise import ProjRanks
    from kfused.integration.headwise import HEADWISE_PRESETS, headwise_parameter_count
    from kfused.perf import cases as C

    seen = 0
    for case in C.all_cases():
        if case.op != "headwise_qkv":
            continue
        s = case.shape
        d, H, Hkv, p = s["d"], s["H"], s["H_kv"], s["p"]
        cfg = dataclasses.replace(HEADWISE_PRESETS[s["preset"]], o=ProjRanks(0, 0, 0))
        budget = headwise_parameter_count(cfg, d, H, n_kv_heads=Hkv)
        per_rank = (d + H * p) + (d + Hkv * p)
        r = s["lora_rank"]
        assert abs(r * per_rank - budget) <= per_rank / 2, (case.label, r, budget / per_rank)
        seen += 1
    assert seen == 6
    llama = {c.shape["preset"]: c.shape["lora_rank"] for c in C.all_cases()
             if c.op == "headwise_qkv" and c.shape["width"] == "llama-7b-gqa"}
    assert llama == {"kernel-mix-qvo-intermediate": 43, "kernel-mix-lite-qv-small": 4}


def test_headwise_useful_flops_by_hand():
    """useful_flops of the headwise cases (what the math needs, docs/math.md §2): the frozen
    GEMM forward and dx, plus three times the adapter's forward products — a shared LoRA
    up-projects to the projection's whole width (H·p, not p), a lite head down-projects
    K^h (p wide, not d), o's shared LoRA down-projects the whole H·p."""
    from kfused.perf import cases as C

    T = 16384
    want = {
        # q: 12 heads x wise 3 (768 -> 3 -> 64), shared 12 (768 -> 12 -> 768);
        # v: 12 heads x lite 8 (64 -> 8 -> 64), shared 8 (768 -> 8 -> 768)
        "headwise_qkv gpt2-small T=16384 kernel-mix-qvo-intermediate":
            4.0 * T * 768 * 2304 + 6.0 * T * (12 * 3 * 832 + 12 * 1536 + 12 * 8 * 128
                                              + 8 * 1536),
        # q: 32 heads x lite 2 (128 -> 2 -> 128), shared 2 (4096 -> 2 -> 4096);
        # v: 8 kv heads x lite 1, shared 2 (4096 -> 2 -> 1024)
        "headwise_qkv llama-7b-gqa T=16384 kernel-mix-lite-qv-small":
            4.0 * T * 4096 * 6144 + 6.0 * T * (32 * 2 * 256 + 2 * 8192 + 8 * 1 * 256
                                               + 2 * 5120),
        # o: 12 heads x wise 8 (64 -> 8 -> 768), shared 8 (768 -> 8 -> 768)
        "headwise_oproj gpt2-small T=16384 kernel-mix-qvo-intermediate[o] (folded)":
            4.0 * T * 768 * 768 + 6.0 * T * (12 * 8 * (64 + 768) + 8 * (768 + 768)),
    }
    got = {f"{c.op} {c.label}": c.useful_flops for c in C.all_cases()}
    for label, flops in want.items():
        assert got[label] == flops, label


def test_headwise_peft_lora_baseline_by_hand():
    """The peft-LoRA baseline of headwise_qkv (GPT-2 small, kernel-mix-qvo-intermediate:
    rank 24 on q and v) is what peft runs: the fused frozen GEMM and its dx GEMM, per
    adapted projection the two LoRA GEMMs each way, the factor gradients, the scaling
    multiply (a kernel forward and one backward, even at scaling 1), the add to the frozen
    output and to dx; plus splitting / joining q|k|v. Each GEMM at the cuBLAS ceiling or its
    bytes at HBM_BW, each element-wise kernel at HBM_BW, each with the launch cost."""
    from kfused.perf import cases as C
    from kfused.perf import roofline as R

    def gemm(M, N, K):
        return max(2.0 * M * N * K / R.WGMMA_RATE,
                   2.0 * (M * K + K * N + M * N) / R.HBM_BW) + R.KERNEL_OVERHEAD_S

    def stream(nbytes):
        return nbytes / R.HBM_BW + R.KERNEL_OVERHEAD_S

    T, d, N, r = 16384, 768, 3 * 768, 24
    want = gemm(T, N, d) + gemm(T, d, N) + stream(2 * T * N * 2)
    for n in (768, 768):                                  # q and v, 12 heads of 64
        want += (gemm(T, r, d) + gemm(T, n, r) + stream(2 * T * n * 2)   # x·Aᵀ, z·Bᵀ, ·s
                 + stream(3 * T * n * 2)                                  # + frozen output
                 + stream(2 * T * n * 2) + gemm(T, r, n) + gemm(T, d, r)  # g·s, dz, dz·A
                 + stream(3 * T * d * 2) + gemm(r, d, T) + gemm(n, r, T))  # dx +=, dA, dB
    case = next(c for c in C.all_cases() if c.op == "headwise_qkv"
                and c.label == "gpt2-small T=16384 kernel-mix-qvo-intermediate")
    assert case.shape["lora_rank"] == r
    got = sum(part["t"] for part in case.baselines["peft-lora"]())
    assert math.isclose(got, want, rel_tol=1e-12), (got, want)


def test_krona_kron_dense_baseline_counts_every_eager_kernel():
    """The kron-dense baseline is the benchmark's provider, F.linear(x, W, b) +
    F.linear(x, s·torch.kron(A, B)), in eager PyTorch fwd + bwd (x, A, B): 14 kernels, each
    at the GEMM ceiling or its bytes at HBM_BW plus a launch — torch.kron is a broadcast
    multiply (and its backward two multiplies and two sums), the scale a multiply each way."""
    from kfused.perf import cases as C
    from kfused.perf import roofline as R

    def op(nbytes, flops=0.0):
        return max(flops / R.WGMMA_RATE, nbytes / R.HBM_BW) + R.KERNEL_OVERHEAD_S

    T, d, (ao, ai), (bo, bi) = 16384, 768, (24, 24), (32, 32)
    dW, ab, act, gemm = d * d * 2, (ao * ai + bo * bi) * 2, T * d * 2, 2.0 * T * d * d
    want = (op(act + dW + 2 * d + act, gemm)           # x Wᵀ + b
            + op(ab + dW) + op(2 * dW)                 # kron(A, B), ·s
            + op(act + dW + act, gemm) + op(3 * act)   # x ΔWᵀ, +
            + op(act + act + dW, gemm)                 # dΔW = gᵀ x
            + op(act + dW + act, gemm)                 # g ΔW
            + op(2 * dW)                               # dΔW·s
            + op(2 * dW + ao * ai * 2) + op(2 * dW + bo * bi * 2)   # · B, · A (broadcast)
            + op(dW + ao * ai * 2) + op(dW + bo * bi * 2)           # Σ -> dA, dB
            + op(act + dW + act, gemm) + op(3 * act))  # g W, dx1 + dx2
    case = next(c for c in C.all_cases() if c.op == "krona_linear"
                and c.label.startswith("T=16384 768->768 A24x24 B32x32") and "exact" in c.label)
    parts = case.baselines["kron-dense"]()
    assert len(parts) == 14
    assert math.isclose(sum(p_["t"] for p_ in parts), want, rel_tol=1e-3)


def test_glue_bytes_of_a_copy():
    """A traced dst.copy_(src) reads src and writes dst (dst is not read): 2 × its bytes, like
    an out-of-place cast; an in-place add reads both operands and writes one (3 ×)."""
    import torch

    from kfused.perf.trace import trace

    def run():
        dst, src = torch.empty(1000, 64, dtype=torch.bfloat16), torch.empty(1000, 64,
                                                                            dtype=torch.bfloat16)
        dst.copy_(src)
        dst.add_(src)

    _, ops = trace(run, warm=False)
    n = 1000 * 64 * 2
    assert [(g.name, g.bytes) for g in ops] == [("copy_", 2 * n), ("add_", 3 * n)]


def test_grounding_without_a_compiled_kernel_is_not_within_25pct(monkeypatch):
    """A grounding kernel that fails to compile has no prediction (NaN): the report must not
    say the model is within 25 % of its references (it skipped such rows)."""
    from kfused.perf import compile as CP
    from kfused.perf import grounding

    monkeypatch.setattr(CP, "jit_spec", lambda *a, **k: None)   # nothing is compiled here
    monkeypatch.setattr(CP, "compile_many",
                        lambda items, jobs=2: [(None, "CompileError: boom")] * len(items))
    res = grounding.run(jobs=1)
    assert any("error" in r for r in res["rows"])
    assert res["within_25pct"] is False
    # ... and the run reports them as compile failures (kfused perf --check exits 1)
    from kfused.perf import report

    rep = report.analyse(ops=["no-such-op"], archs=(90,), jobs=1, with_csrc=False,
                         with_representative=False)
    assert rep["cases"] == []
    assert [f["where"] for f in rep["failures"]] == ["grounding", "grounding"]


def test_sdpa_decode_split_count_uses_fa2_key_blocks():
    """SDPA's decode baseline splits the keys with FlashAttention-2's heuristic over its key
    blocks: 256 keys for p <= 64 (set_params_splitkv), 128 for p = 128. B = 1, 8 heads, 2048
    keys, p = 64: 8 key blocks, 8 blocks of rows -> 8 splits (with 128-key blocks: 16)."""
    from kfused.perf import cases as C

    assert C._fa2_num_splits(8, 8) == 8 and C._fa2_num_splits(8, 16) == 16
    parts = C._inducer_decode_case(1, 8, 8, 2048, 64).baselines["sdpa"]()
    assert "(8 splits;" in parts[0]["name"], parts[0]["name"]
    parts = C._inducer_decode_case(1, 8, 8, 2048, 128).baselines["sdpa"]()
    assert "(16 splits;" in parts[0]["name"], parts[0]["name"]


def test_seed_file_answers_a_cold_cache_and_only_for_the_identical_compile(tmp_path,
                                                                           monkeypatch):
    """tests/perf_seed.json (KFUSED_CACHE_SEED): an entry answers exactly the compile it was
    written for (kernel source, specialisation, options, arch, Triton version), lands in the
    cache folder, and compile_many then compiles nothing for it; any other launch misses."""
    import json
    import types

    from kfused.perf import compile as CP

    monkeypatch.setenv("KFUSED_CACHE", str(tmp_path / "a"))
    monkeypatch.delenv("KFUSED_CACHE_SEED", raising=False)
    CP._seed.cache_clear()
    fn = types.SimpleNamespace(__name__="k_seeded", cache_key="k_seeded-src")
    spec = ({"x": "*bf16"}, {}, {}, dict(num_warps=4, num_stages=3))
    name = f"k_seeded-sm90-{CP.spec_key(fn, spec, 90)}.json"
    stats = dict(regs=72, shared_bytes=1024, num_warps=4, ctas_per_sm=3, sass={}, dots={})
    with open(os.path.join(CP.cache_dir(), name), "w") as f:
        json.dump(stats, f)
    seed = str(tmp_path / "seed.json")
    assert CP.write_seed(seed, [name, "k_gone-sm90-0.json"]) == 1

    monkeypatch.setenv("KFUSED_CACHE", str(tmp_path / "b"))      # a fresh machine
    assert CP.cached_stats(fn, spec, 90) is None
    monkeypatch.setenv("KFUSED_CACHE_SEED", seed)
    other = (spec[0], spec[1], spec[2], dict(num_warps=8, num_stages=3))
    edited = types.SimpleNamespace(__name__="k_seeded", cache_key="k_seeded-src-edited")
    assert CP.cached_stats(fn, other, 90) is None
    assert CP.cached_stats(edited, spec, 90) is None
    assert CP.cached_stats(fn, spec, 80) is None

    def no_compile(*a, **k):
        raise AssertionError("compiled a seeded launch")

    monkeypatch.setattr(CP, "compile_launch", no_compile)
    (st, err), = CP.compile_many([(fn, spec, 90)], jobs=1)
    assert err is None and st == stats
    with open(os.path.join(CP.cache_dir(), name)) as f:
        assert json.load(f) == stats                              # now in the cache folder
    CP._seed.cache_clear()


def test_hgmma_loop_feed_reads_shapes_operands_and_loops():
    """The flash kernels' wgmma feed from their SASS: FLOP-weighted over the HGMMAs inside
    loops (a backward branch's range), each at its N and A-operand source; outside a loop
    (a prologue product) not counted; 1.0 without loops' HGMMAs."""
    from kfused.perf.compile import hgmma_loop_feed

    sass = """
        /*0100*/                   HGMMA.64x16x16.F32.BF16 R10, gdesc[UR4], RZ, !UPT ;
        /*0200*/                   MOV R1, R2 ;
        /*0300*/                   HGMMA.64x32x16.F32.BF16 R88, gdesc[UR12], RZ, !UPT ;
        /*0310*/                   HGMMA.64x128x16.F32.BF16 R24, R120, gdesc[UR12].tnspB, R24 ;
        /*0400*/              @!P0 BRA 0x200 ;
        /*0500*/                   BRA 0x500;
    """
    e32 = R.wgmma_feed_efficiency(32, a_in_registers=False)
    assert abs(e32 - 2 / 3) < 1e-9
    assert R.wgmma_feed_efficiency(128, a_in_registers=True) == 1.0
    want = (32 + 128) / (32 / e32 + 128)
    assert abs(hgmma_loop_feed(sass) - want) < 1e-9
    # without the loop every HGMMA counts, the N = 16 prologue product too
    flat = sass.replace("@!P0 BRA 0x200", "NOP").replace("BRA 0x500", "NOP")
    e16 = R.wgmma_feed_efficiency(16, a_in_registers=False)
    assert abs(hgmma_loop_feed(flat) - (16 + 32 + 128) / (16 / e16 + 32 / e32 + 128)) < 1e-9
    assert hgmma_loop_feed("/*0100*/  FFMA R1, R2, R3, R4 ;") == 1.0
    # the predictor charges the flag's kernels by it
    w = dict(dot16_flops=1e12, dot16_feed_from_sass=1.0, dot16_feed_extra=5e12)
    sass_mix = {"hgmma": 2, "hgmma_loop_feed_milli": 800}
    t = R.predict(w, sass_mix, 0, 1)["t_dot16"]
    assert abs(t - 1e12 / 0.8 / R.WGMMA_RATE) < 1e-12
