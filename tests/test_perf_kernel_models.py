"""The per-kernel work models of kfused.perf.cases against hand counts on tiny launches.

Launches are recorded (never run) by kfused.perf.trace on CPU stand-in tensors with the GPU
configurations chosen (``_AOT_TARGET``), in a subprocess without TRITON_INTERPRET (recording
intercepts compiled JIT functions, not the interpreter). Each hand count below is written
from the kernel's loop structure, independently of the model's code.
"""

import json
import os
import subprocess
import sys

import pytest

_SCRIPT = r"""
import json, math, torch
from kfused.perf import cases as C
from kfused.perf.trace import trace

bf = torch.bfloat16
cd = lambda a, b: -(-a // b)
pad = lambda k, b: cd(k, b) * b
out = {}

# ---- headwise _gemm_kernel: two K segments, bias; one launch per autotuning config
import kfused.triton_kernels._headwise_common as hw
M, N, K0, K1 = 100, 200, 40, 24
a0, b0 = torch.empty(M, K0, dtype=bf), torch.empty(K0, N, dtype=bf)
a1, b1 = torch.empty(M, K1, dtype=bf), torch.empty(K1, N, dtype=bf)
c, bias = torch.empty(M, N, dtype=bf), torch.empty(N, dtype=bf)
L, G = trace(lambda: hw.gemm([(a0, b0), (a1, b1)], c, bias=bias))
rows = []
for l in L:
    a = l.bound()
    BM, BN, BK = a["BM"], a["BN"], a["BK"]
    P = cd(M, BM) * cd(N, BN)
    hand = P * 2 * BM * BN * (pad(K0, BK) + pad(K1, BK))
    w, modelled = C.model_launch(l)
    rows.append(dict(model=w["dot16_flops"], hand=hand, modelled=modelled, alt=l.alt,
                     fma=w["fma32_flops"], bytes=w["hbm_bytes"],
                     min_bytes=2 * (M * K0 + K0 * N + M * K1 + K1 * N + M * N + N)))
out["gemm"] = rows

# ---- split-K mode (float32 token reduction: the Triton path also on a GPU)
T, Mr, Nr = 300, 40, 50
at, bt = torch.empty(T, Mr), torch.empty(T, Nr)
L, G = trace(lambda: hw.reduce_tokens(at, bt))
rows = []
for l in L:
    a = l.bound()
    BM, BN, BK, S, KP = a["BM"], a["BN"], a["BK"], l.grid[1], a["K_PER"]
    P = cd(Mr, BM) * cd(Nr, BN)
    hand = P * 2 * BM * BN * sum(pad(min(KP, T - s * KP), BK) for s in range(S))
    w, modelled = C.model_launch(l)
    rows.append(dict(model=w["fma32_flops"], hand=hand, modelled=modelled, dot16=w["dot16_flops"]))
out["split"] = rows

# ---- 16-bit token reduction: cuBLAS on a GPU, so the trace records a matmul, no launch
at16, bt16 = at.to(bf), bt.to(bf)
L, G = trace(lambda: hw.reduce_tokens(at16, bt16))
out["reduce16"] = dict(launches=len(L), mm_flops=sum(g.flops for g in G), hand=2 * T * Mr * Nr)

# ---- headwise _lr_rank_bwd_kernel
Tt, Lt, RB, BNt = 200, 2, 16, 128
g = torch.empty(Tt, Lt * BNt, dtype=bf)
lr = hw.LowRankTiles(torch.empty(Lt, RB, 64, dtype=bf), torch.empty(Lt, RB),
                     torch.empty(Lt, RB, BNt, dtype=bf), torch.empty(Tt, Lt * RB, dtype=bf))
dz = torch.empty(Tt, Lt * RB, dtype=bf)
L, G = trace(lambda: hw.lr_rank_backward(g, lr, dz))
(l,) = L
a = l.bound()
BT, S, TP = a["BT"], l.grid[1], a["T_PER"]
tp = sum(pad(min(TP, Tt - s * TP), BT) for s in range(S))
w, modelled = C.model_launch(l)
out["lr_rank"] = dict(model=w["dot16_flops"], hand=Lt * 2 * (2 * tp * BNt * RB),
                      modelled=modelled, grid=list(l.grid))
# two sections in one launch (q and v of a q|k|v projection), each with its own RB: 24
# stored slots of a 32-wide block next to the 16 above, the shared rows of the second scaled
W2, RB2, Lt2 = 24, 32, 3
g2 = torch.empty(Tt, Lt2 * BNt, dtype=bf)
lr2 = hw.LowRankTiles(torch.empty(Lt2, W2, 64, dtype=bf), torch.empty(Lt2, W2),
                      torch.empty(Lt2, W2, BNt, dtype=bf), torch.empty(Tt, Lt2 * W2, dtype=bf),
                      scale=0.5, RS=4)
dz2 = torch.empty(Tt, Lt2 * W2, dtype=bf)
L, G = trace(lambda: hw.lr_rank_backward_sections([(g, lr, dz), (g2, lr2, dz2)]))
(l,) = L
a = l.bound()
BT, S, TP = a["BT"], l.grid[1], a["T_PER"]
tp = sum(pad(min(TP, Tt - s * TP), BT) for s in range(S))
w, modelled = C.model_launch(l)
out["lr_rank2"] = dict(model=w["dot16_flops"],
                       hand=Lt * 2 * (2 * tp * BNt * RB) + Lt2 * 3 * (2 * tp * BNt * RB2),
                       bytes=w["hbm_bytes"],
                       hand_bytes=(Tt * (Lt + Lt2) * BNt * 2 + Tt * Lt * RB * 4 + Tt * Lt2 * W2 * 4
                                   + Lt * RB * BNt * 2 + Lt2 * W2 * BNt * 2
                                   + S * (Lt * RB * BNt + Lt * RB + Lt * BNt) * 4
                                   + S * (Lt2 * RB2 * BNt + Lt2 * RB2 + Lt2 * BNt) * 4),
                       modelled=modelled, grid=list(l.grid))

# ---- KronA _kron_fold_kernel
import kfused.triton_kernels.krona_linear as kk
A, B = torch.empty(3, 5, dtype=bf), torch.empty(7, 11, dtype=bf)
W = torch.empty(21, 55, dtype=bf)
L, G = trace(lambda: kk.fold_weight(W, A, B, 0.5))
(l,) = L
a = l.bound()
w, modelled = C.model_launch(l)
out["fold"] = dict(alu=w["alu_ops"], hand_alu=l.programs() * a["BO"] * a["BC"] * 6,
                   bytes=w["hbm_bytes"], hand_bytes=2 * 21 * 55 * 2 + 2 * (15 + 77),
                   flops=w["dot16_flops"] + w["fma32_flops"] + w["fma64_flops"],
                   modelled=modelled)

# ---- KronA on the GPU's default path: the fold, cuBLAS GEMMs as matmul glue
from kfused.ops.krona_linear import fold_decision
out["decision"] = [fold_decision(bf, 16384, None, True), fold_decision(bf, 16384, None, False),
                   fold_decision(torch.float32, 16384, None, True),
                   fold_decision(bf, 100, None, True), fold_decision(bf, 100, False, False),
                   fold_decision(bf, 16384, True, True)]
krona_cases = [c for c in C.all_cases() if c.op == "krona_linear"]
c0 = next(c for c in krona_cases if "fold+cuBLAS" in c.label and "768->768 A24x24" in c.label)
L, G = trace(c0.run)
out["krona_fold_two_pass"] = dict(names=[l.name for l in L], mm_flops=sum(g.flops for g in G))
import os
os.environ["KFUSED_KRONA_FOLDED_BWD"] = "one-pass"
L, G = trace(c0.run)
del os.environ["KFUSED_KRONA_FOLDED_BWD"]
dxl = [l for l in L if l.name == "_kron_dx_grad_kernel"]
out["krona_fold_case"] = dict(names=[l.name for l in L],
                              mm_flops=sum(g.flops for g in G),
                              hand=2 * 16384 * 768 * 768,
                              dx_dot16=C.model_launch(dxl[0])[0]["dot16_flops"] if dxl else 0,
                              # dx GEMM (tiles divide the shape) + factor steps of BT = 2
                              # tokens, 32-padded factors: W1, V once, dA, dB twice (hi/lo)
                              dx_hand=2 * 16384 * 768 * 768
                              + 8192 * 2 * 2 * (32 ** 3) * (1 + 1 + 2 + 2))
c1 = next(c for c in krona_cases if "exact" in c.label and "768->768 A24x24" in c.label)
L, G = trace(c1.run)
out["krona_exact_case"] = dict(names=[l.name for l in L], glue=[g.name for g in G],
                               glue_flops=sum(g.flops for g in G))

# ---- inducer forward / dQ / dK-dV: flash products + MLP products
from kfused.ops import inducer_attention
Bq, H, n, p, Lk, r = 1, 2, 200, 64, 4, 8
def run_in(dt):
    e = lambda *s: torch.empty(*s, dtype=dt, requires_grad=True)
    def run():
        q, k, v = e(Bq, H, n, p), e(Bq, H, n, p), e(Bq, H, n, p)
        prm = dict(Ak=e(H, p, Lk), ak=e(H, Lk), Bk=e(H, Lk, p), ck=e(H, p), W1=e(H, p, r),
                   b1=e(H, r))
        f, u = inducer_attention(q, k, v, **prm, causal=True, backend="triton")
        torch.autograd.grad([f, u], [q, k, v, *prm.values()],
                            [torch.empty_like(f), torch.empty_like(u)])
    return run

def unit_loops(l, a, w, modelled):
    # the inducer rows, one MLP unit at a time: the model charges per row the issue table
    # (fixed + L key units + r value units); hand: the same from the loops of the SASS this
    # launch compiles to (sm_90, the installed Triton): the step loop's body with each unit
    # loop's body counted L or r times, 32 lanes a warp, over the step's rows a warp
    from kfused.perf import compile as PC
    spec = PC.jit_spec(l.fn, l.args, l.kwargs)
    opts = spec[3]
    k = PC.compile_kernel(l.fn, spec)
    loops = [c for _, c in next(iter(PC.sass_loops(k.asm["cubin"]).values()))]
    step, first, second = loops[0], loops[1], loops[2]
    if l.name == "_inducer_fwd_mlp_kernel":
        key, val = first, second                 # the key units come first
    else:
        val, key = first, second                 # the value units (du given) first
    per_step = step - key - val + a["L"] * key + a["R"] * val
    rows = Bq * H * n
    return dict(model=w["dot16_flops"], hand=0, modelled=modelled,
                model_fma=w["fma32_flops"], hand_fma=0,
                model_row=w["alu_ops"] / rows,
                hand_row=32 * per_step * opts["num_warps"] / a["BLOCK_M"])

L, G = trace(run_in(bf))
res = {}
for l in L:
    a = l.bound()
    w, modelled = C.model_launch(l)
    if l.name == "_inducer_fwd_mlp_kernel":
        # the tensor-core forward (16-bit): three 16-bit dots per BLOCK_M-row step, L and r
        # padded to 16 columns (L_TC, R_TC), no unit loops
        assert a["TC"]
        BM, DP, CH = a["BLOCK_M"], a["D_PAD"], a["CHUNK"]
        steps = Bq * H * sum(cd(min(CH, n - c * CH), BM) for c in range(cd(n, CH)))
        res[l.name] = dict(model=w["dot16_flops"], hand=steps * 2 * BM * DP * (16 + 16 + 16),
                           modelled=modelled, model_fma=w["fma32_flops"], hand_fma=0)
        continue
    if l.name == "_inducer_attn_bwd_mlp_kernel":
        # the tensor-core backward (16-bit, p = 64: one launch, WHAT 3): per BLOCK_M-row step
        # the rows recomputed (q Ak, q Bkᵀ, q W1), the dq share's and the parameter
        # gradients' products: three groups of L_TC + L_TC + R_TC = 48 columns; its issue
        # table against the one loop of its SASS (the step loop)
        assert a["TC"] and a["WHAT"] == 3 and a["HAS_DU"]
        from kfused.perf import compile as PC
        BM, DP, CH = a["BLOCK_M"], a["D_PAD"], a["CHUNK"]
        steps = Bq * H * sum(cd(min(CH, n - c * CH), BM) for c in range(cd(n, CH)))
        spec = PC.jit_spec(l.fn, l.args, l.kwargs)
        (step,) = [c for _, c in next(iter(PC.sass_loops(
            PC.compile_kernel(l.fn, spec).asm["cubin"]).values()))]
        res[l.name] = dict(model=w["dot16_flops"], hand=steps * 2 * BM * DP * 48 * 3,
                           modelled=modelled, model_fma=w["fma32_flops"], hand_fma=0,
                           model_row=w["alu_ops"] / (Bq * H * n),
                           hand_row=32 * step * spec[3]["num_warps"] / BM)
        continue
    BM, BN, DP = a["BLOCK_M"], a["BLOCK_N"], a["D_PAD"]
    # causal visits: query tile i sees key columns < (i + 1)·BM (n_q = n_k: offset 0)
    # the MLP's rows come from the MLP-rows kernels: no MLP product in the attention kernels
    hand_fma = 0
    if l.name == "_inducer_attn_bwd_dkdv_kernel":
        tiles = sum(cd(n - (j * BN) // BM * BM, BM) for j in range(cd(n, BN)))
        hand = Bq * H * tiles * 4 * 2 * BM * BN * DP
    else:   # forward: S, PV; dQ: 3 flash products (D_i = ⟨dO, O_hi + O_lo⟩ is no product)
        tiles = sum(cd(min(n, (i + 1) * BM), BN) for i in range(cd(n, BM)))
        products = 2 if l.name == "_inducer_attn_fwd_kernel" else 3
        hand = Bq * H * tiles * products * 2 * BM * BN * DP
    res[l.name] = dict(model=w["dot16_flops"], hand=hand, modelled=modelled,
                       model_fma=w["fma32_flops"], hand_fma=hand_fma)
# float32: both MLP-rows kernels work one unit at a time
L32, _ = trace(run_in(torch.float32))
for l in L32:
    if l.name in ("_inducer_fwd_mlp_kernel", "_inducer_attn_bwd_mlp_kernel"):
        a = l.bound()
        w, modelled = C.model_launch(l)
        assert not a.get("TC")
        res[l.name + " float32"] = unit_loops(l, a, w, modelled)
out["inducer"] = res
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    script = tmp_path_factory.mktemp("perf") / "models.py"
    script.write_text(_SCRIPT)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                       timeout=600, cwd=root)
    line = [s for s in r.stdout.splitlines() if s.startswith("RESULT")]
    assert r.returncode == 0 and line, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(line[0][len("RESULT"):])


def test_headwise_gemm_model(counts):
    rows = counts["gemm"]
    assert rows and all(r["modelled"] for r in rows)
    for r in rows:
        assert r["model"] == r["hand"] and r["fma"] == 0
        assert r["bytes"] >= r["min_bytes"]          # at least every operand once
    if len(rows) > 1:                                # one launch per autotuning config
        assert len({r["alt"] for r in rows}) == 1 and rows[0]["alt"] >= 0


def test_headwise_split_k_model(counts):
    rows = counts["split"]
    assert rows and all(r["modelled"] for r in rows)
    for r in rows:                                   # float32: IEEE dots on the CUDA cores
        assert r["model"] == r["hand"] and r["dot16"] == 0


def test_reduce_tokens_16bit_is_cublas_in_the_trace(counts):
    r = counts["reduce16"]
    assert r["launches"] == 0 and r["mm_flops"] == r["hand"]


def test_lr_rank_bwd_model(counts):
    r = counts["lr_rank"]
    assert r["modelled"] and r["model"] == r["hand"]
    r = counts["lr_rank2"]      # both sections of one launch, each with its own RB and W
    assert r["modelled"] and r["model"] == r["hand"] and r["bytes"] == r["hand_bytes"]


def test_kron_fold_model(counts):
    r = counts["fold"]
    assert r["modelled"] and r["flops"] == 0
    assert r["alu"] == r["hand_alu"] and r["bytes"] == r["hand_bytes"]


def test_krona_trace_follows_gpu_dispatch(counts):
    assert counts["decision"] == [True, False, False, False, True, False]
    f = counts["krona_fold_case"]
    # one fold per step: at T = 16384 the forward keeps W' (4.7 % of x) for dx
    assert f["names"].count("_kron_fold_kernel") == 1 and "_krona_fwd_kernel" not in f["names"]
    assert f["mm_flops"] == f["hand"]                # y = x W'ᵀ via cuBLAS
    # one-pass mode: dx = dy W' and the factor gradients in one launch of our own kernel
    assert f["names"].count("_kron_dx_grad_kernel") == 1 and "_kron_grad_kernel" not in f["names"]
    assert f["dx_dot16"] == f["dx_hand"]
    # by default (two passes, measured faster on the H100): dx = dy W' on cuBLAS too, then the
    # factor-gradient kernel
    t = counts["krona_fold_two_pass"]
    assert t["mm_flops"] == 2 * f["hand"]
    assert t["names"].count("_kron_grad_kernel") == 1 and "_kron_dx_grad_kernel" not in t["names"]
    assert t["names"].count("_kron_fold_kernel") == 1
    ex = counts["krona_exact_case"]
    assert "_kron_fold_kernel" not in ex["names"]
    # exact, 16-bit at T = 16384 on a GPU: y and dx each as three cuBLAS calls (the frozen
    # GEMM, bias in its epilogue; the Kronecker term's GEMM and its batched GEMM adding into
    # y), the factor gradients from our kernel
    assert "_krona_fwd_kernel" not in ex["names"] and "_kron_grad_kernel" in ex["names"]
    assert sorted(ex["glue"]) == ["addmm", "baddbmm", "baddbmm", "matmul", "matmul", "mm"], \
        ex["glue"]
    # frozen GEMMs 2·T·768² each, plus the Kronecker terms (X Bᵀ, A V per direction)
    frozen = 2 * 2 * 16384 * 768 * 768
    kron = 2 * (2 * 16384 * 24 * 32 * 32 + 2 * 16384 * 24 * 24 * 32)
    assert ex["glue_flops"] == frozen + kron, (ex["glue_flops"], frozen + kron)


def test_inducer_models(counts):
    res = counts["inducer"]
    assert set(res) == {"_inducer_fwd_mlp_kernel", "_inducer_attn_fwd_kernel",
                        "_inducer_attn_bwd_mlp_kernel", "_inducer_attn_bwd_dq_kernel",
                        "_inducer_attn_bwd_dkdv_kernel", "_inducer_fwd_mlp_kernel float32",
                        "_inducer_attn_bwd_mlp_kernel float32"}
    for name, r in res.items():
        assert r["modelled"] and r["model"] == r["hand"], name
        assert r["model_fma"] == r["hand_fma"], name
        if "hand_row" in r:       # the MLP-rows kernels' issue table against their SASS
            assert 0.85 < r["model_row"] / r["hand_row"] < 1.15, (name, r)
