"""Per-head low-rank (docs/math.md §2) cases: `kfused check` cases of every headwise kernel, the sm_90
compile-check launches and the benchmark cases of the fused attention-input projection.

``bench_cases(device, dtype, quick=False)`` returns :class:`kfused.bench.BenchCase` objects for the
shared harness (``kfused.bench.measure``). Each case is one (model width, adapter preset)
pair with the providers:

    floor          the frozen q|k|v projection alone (one GEMM against [W_q; W_k; W_v])
    kfused-triton  kfused.ops.headwise_qkv (one fused Triton kernel, fwd and bwd)
    eager          the per-head PyTorch reference (einsums over the head axis)
    compile        torch.compile of that reference
    peft-lora      plain LoRA on q and v with the same parameter budget, as PEFT runs it
                   (peft.get_peft_model on q_proj/k_proj/v_proj linears)

The output projection ``headwise_oproj`` has the same providers (floor: the frozen o_proj
linear; peft-lora on o_proj with the o part's budget) for the preset with an o part, on the
path ``exact=None`` takes (folded on 16-bit GPU inputs from 1024 tokens) beside
``kfused-triton-exact``;
plus the standalone ``headwise_lowrank`` op (LOWRANK_CASES) with its two fused backends side by
side: kfused-triton, kfused-cuda (the CUDA C++ extension) and eager (the reference).

Presets: Kernel-mix(qvo) (intermediate; its q and v parts ride on this projection, its o part
belongs to the output projection) and Kernel-mix-lite(qv) (small). Widths: GPT-2 small
(d = 768, 12 heads) and medium (d = 1024, 16 heads), head width 64, and Llama-7B-like with
grouped-query attention (d = 4096, 32 query / 8 key-value heads, head width 128); 16k tokens.
``--roofline`` prints the predicted fwd+bwd times of the frozen projections, kfused and
unfused LoRA of the same budget for every case (no GPU needed; labelled predicted).

Run: ``python benchmarks/bench_headwise.py [--quick] [--dtype float16]`` prints the rows.
"""

from __future__ import annotations

from typing import List

import torch

from kfused.backends import triton_unfit
from kfused.bench import BenchCase, Provider
from kfused.cases import CheckCase
from kfused.integration.headwise import HEADWISE_PRESETS as PRESETS
from kfused.integration.headwise import headwise_parameter_count as count_parameters
from kfused.ops import headwise_lowrank, headwise_oproj, headwise_qkv
from kfused.reference.headwise import HeadFactors, headwise_oproj_ref, headwise_qkv_ref

WIDTHS = {  # T = 16k tokens; head width 64 (GPT-2) and 128 (Llama-7B, grouped-query)
    "gpt2-small": dict(d=768, H=12, Hkv=12, tokens=16384),
    "gpt2-medium": dict(d=1024, H=16, Hkv=16, tokens=16384),
    "llama-7b-gqa": dict(d=4096, H=32, Hkv=8, tokens=16384),
}
# Off the GPU (Triton interpreter / CPU torch) only a smoke-sized case is meaningful.
CPU_WIDTHS = {"cpu-smoke": dict(d=96, H=4, Hkv=2, tokens=64)}
BENCH_PRESETS = ("kernel-mix-qvo-intermediate", "kernel-mix-lite-qv-small")
OPROJ_PRESET = "kernel-mix-qvo-intermediate"   # the bench preset with an o part


def _factors(ranks, H, p, d, device, dtype, gen) -> HeadFactors:
    def r(*s):
        return (torch.randn(*s, generator=gen, device=device, dtype=torch.float32) * 0.02
                ).to(dtype).requires_grad_()

    kw = {}
    if ranks.shared:
        kw.update(shared_A=r(ranks.shared, d), shared_B=r(H * p, ranks.shared))
    if ranks.wise:
        kw.update(wise_A=r(H, ranks.wise, d), wise_B=r(H, p, ranks.wise), wise_c=r(H, p))
    if ranks.lite:
        kw.update(lite_A=r(H, ranks.lite, p), lite_B=r(H, p, ranks.lite),
                  lite_c=None if ranks.wise else r(H, p))
    return HeadFactors(**kw)


def _leaves(f: HeadFactors) -> List[torch.Tensor]:
    return [t for t in (f.shared_A, f.shared_B, f.wise_A, f.wise_B, f.wise_c, f.lite_A,
                        f.lite_B, f.lite_c) if t is not None]


def _case(width: str, preset: str, device, dtype, tokens: int) -> BenchCase:
    w = {**WIDTHS, **CPU_WIDTHS}[width]
    d, H, Hkv = w["d"], w["H"], w["Hkv"]
    p = d // H
    nkv = Hkv * p
    cfg = PRESETS[preset]
    dev = torch.device(device)
    # q and v parts only (this projection); LoRA on q (d -> d) and v (d -> H_kv·p)
    budget = count_parameters(dict_q_v(cfg), d, H, n_kv_heads=Hkv)
    lora_r = max(1, round(budget / ((d + d) + (d + nkv))))

    def inputs(seed=0):
        gen = torch.Generator(device=dev).manual_seed(seed)
        x = torch.randn(tokens, d, generator=gen, device=dev, dtype=dtype).requires_grad_()
        W = [torch.randn(n, d, generator=gen, device=dev, dtype=dtype) / d ** 0.5
             for n in (d, nkv, nkv)]
        b = [torch.randn(n, generator=gen, device=dev, dtype=dtype) * 0.1 for n in (d, nkv, nkv)]
        q = _factors(cfg.q, H, p, d, dev, dtype, gen)
        v = _factors(cfg.v, Hkv, p, d, dev, dtype, gen)
        return x, W, b, q, v

    def floor():
        x, W, b, _, _ = inputs()
        Wc, bc = torch.cat(W), torch.cat(b)
        return (lambda: torch.nn.functional.linear(x, Wc, bc)), [x]

    def triton_fused(exact=None):
        def make():
            x, W, b, q, v = inputs()
            return (lambda: headwise_qkv(x, *W, *b, n_heads=H, n_kv_heads=Hkv, q=q, v=v,
                                         backend="triton", fused_output=True, exact=exact)), \
                [x, *_leaves(q), *_leaves(v)]
        return make

    def eager():
        x, W, b, q, v = inputs()
        return (lambda: headwise_qkv_ref(x, *W, *b, n_heads=H, n_kv_heads=Hkv, q=q, v=v)), \
            [x, *_leaves(q), *_leaves(v)]

    def compiled():
        x, W, b, q, v = inputs()
        fn = torch.compile(headwise_qkv_ref)
        return (lambda: fn(x, *W, *b, n_heads=H, n_kv_heads=Hkv, q=q, v=v)), \
            [x, *_leaves(q), *_leaves(v)]

    def peft_lora():
        x, W, b, _, _ = inputs()
        return _peft_lora(x, {"q_proj": (W[0], b[0]), "k_proj": (W[1], b[1]),
                              "v_proj": (W[2], b[2])}, ["q_proj", "v_proj"], lora_r)

    unfit = triton_unfit(dev, dtype)
    peft_skip = _peft_skip()
    providers = [
        Provider("floor", floor),
        # exact=None: what a GPU takes (the fold where the roofline predicts it pays);
        # exact=True: the augmented GEMMs, never folded (measured beside it)
        Provider("kfused-triton", triton_fused(), skip_reason=unfit),
        Provider("kfused-triton-exact", triton_fused(True), skip_reason=unfit),
        Provider("eager", eager),
        Provider("compile", compiled,
                 skip_reason=None if dev.type == "cuda" else "torch.compile timed on CUDA only"),
        Provider("peft-lora", peft_lora, skip_reason=peft_skip),
    ]
    N = d + 2 * nkv
    rq, rv = cfg.q, cfg.v
    rank_cols = H * (rq.wise + rq.lite) + Hkv * (rv.wise + rv.lite) + rq.shared + rv.shared
    flops_fwd = 2.0 * tokens * d * (N + rank_cols) + 2.0 * tokens * rank_cols * p
    el = torch.finfo(dtype).bits // 8
    return BenchCase(
        op="headwise_qkv",
        shape=dict(width=width, preset=preset, tokens=tokens, d=d, heads=H, kv_heads=Hkv,
                   head_dim=p,
                   adapter_params=budget, peft_lora_rank=lora_r),
        dtype=dtype, providers=providers, flops_fwd=flops_fwd, flops_bwd=2 * flops_fwd,
        bytes_fwd=float(el * (tokens * d + N * d + tokens * N)))


def _oproj_case(width: str, preset: str, device, dtype, tokens: int) -> BenchCase:
    """The output projection with the preset's o part (Kernel-wise + shared LoRA on W_o,
    basis O): the other half of issue 12's q/k/v/o target."""
    import dataclasses

    from kfused.modules.headwise import ProjRanks

    w = {**WIDTHS, **CPU_WIDTHS}[width]
    d, H = w["d"], w["H"]
    p = d // H
    HP = H * p
    ro = PRESETS[preset].o
    dev = torch.device(device)
    budget = count_parameters(dataclasses.replace(PRESETS[preset], q=ProjRanks(),
                                                  v=ProjRanks()), d, H)
    lora_r = max(1, round(budget / (HP + d)))

    def inputs(seed=0):
        gen = torch.Generator(device=dev).manual_seed(seed)

        def rnd(*s, scale=1.0, grad=False):
            t = torch.randn(*s, generator=gen, device=dev, dtype=dtype) * scale
            return t.requires_grad_(grad)

        o = rnd(tokens, HP, grad=True)
        w_o, b_o = rnd(d, HP, scale=HP ** -0.5), rnd(d, scale=0.1)
        kw = {}
        if ro.wise:
            kw.update(wise_A=rnd(H, ro.wise, p, scale=p ** -0.5, grad=True),
                      wise_B=rnd(d, H * ro.wise, scale=0.02, grad=True),
                      wise_c=rnd(d, scale=0.02, grad=True))
        if ro.shared:
            kw.update(shared_A=rnd(ro.shared, HP, scale=HP ** -0.5, grad=True),
                      shared_B=rnd(d, ro.shared, scale=0.02, grad=True))
        return o, w_o, b_o, kw

    def floor():
        o, w_o, b_o, _ = inputs()
        return (lambda: torch.nn.functional.linear(o, w_o, b_o)), [o]

    def fused(backend, exact=None, compiled=False):
        def make():
            o, w_o, b_o, kw = inputs()
            extra = {} if backend == "reference" else dict(backend=backend, exact=exact)
            fn = headwise_oproj_ref if backend == "reference" else headwise_oproj
            fn = torch.compile(fn) if compiled else fn
            return (lambda: fn(o, w_o, b_o, n_heads=H, scale=0.5, **kw, **extra)), \
                [o, *kw.values()]
        return make

    def peft_lora():
        o, w_o, b_o, _ = inputs()
        return _peft_lora(o, {"o_proj": (w_o, b_o)}, ["o_proj"], lora_r)

    unfit = triton_unfit(dev, dtype)
    providers = [
        Provider("floor", floor),
        Provider("kfused-triton", fused("triton"), skip_reason=unfit),
        Provider("kfused-triton-exact", fused("triton", True), skip_reason=unfit),
        Provider("eager", fused("reference")),
        Provider("compile", fused("reference", compiled=True),
                 skip_reason=None if dev.type == "cuda" else "torch.compile timed on CUDA only"),
        Provider("peft-lora", peft_lora, skip_reason=_peft_skip()),
    ]
    rank_cols = H * ro.wise + ro.shared
    flops_fwd = 2.0 * tokens * HP * d + 2.0 * tokens * (ro.wise * HP + ro.shared * HP
                                                         + rank_cols * d)
    el = torch.finfo(dtype).bits // 8
    return BenchCase(
        op="headwise_oproj",
        shape=dict(width=width, preset=preset, tokens=tokens, d=d, heads=H, head_dim=p,
                   adapter_params=budget, peft_lora_rank=lora_r),
        dtype=dtype, providers=providers, flops_fwd=flops_fwd, flops_bwd=2 * flops_fwd,
        bytes_fwd=float(el * (tokens * HP + d * HP + tokens * d)))


class _Projections(torch.nn.Module):
    """Frozen linears with the given weights under the given names (the attention's q_proj,
    k_proj, v_proj or o_proj, as PEFT targets them); forward returns each one's output."""

    def __init__(self, weights):
        super().__init__()
        self.names = list(weights)
        for name, (w, b) in weights.items():
            lin = torch.nn.Linear(w.shape[1], w.shape[0], device=w.device, dtype=w.dtype)
            with torch.no_grad():
                lin.weight.copy_(w)
                lin.bias.copy_(b)
            self.add_module(name, lin)

    def forward(self, x):
        out = tuple(getattr(self, n)(x) for n in self.names)
        return out if len(out) > 1 else out[0]


def _peft_lora(x, weights, targets, r):
    """Plain LoRA of rank r on ``targets`` as PEFT runs it (peft.get_peft_model), its factors
    drawn at random (B = 0 at init would skip the adapter's real work)."""
    import peft

    model = peft.get_peft_model(_Projections(weights), peft.LoraConfig(
        r=r, lora_alpha=r, lora_dropout=0.0, target_modules=targets))
    leaves = [prm for prm in model.parameters() if prm.requires_grad]
    with torch.no_grad():
        for prm in leaves:
            prm.normal_(0, 0.02)
    return (lambda: model(x)), [x, *leaves]


def _peft_skip():
    try:
        import peft  # noqa: F401
        return None
    except Exception as exc:  # pragma: no cover
        return f"peft not importable ({exc})"


def dict_q_v(cfg):
    """The preset restricted to its q and v parts (what this projection carries)."""
    import dataclasses

    from kfused.modules.headwise import ProjRanks

    return dataclasses.replace(cfg, o=ProjRanks())


def bench_cases(device="cuda", dtype=torch.float16, quick: bool = False) -> List[BenchCase]:
    """Benchmark cases; ``quick`` shrinks the token count (CPU smoke runs, CI)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return ([_case(w, p, device, dtype, CPU_WIDTHS[w]["tokens"]) for w in CPU_WIDTHS
                 for p in BENCH_PRESETS]
                + [_oproj_case(w, OPROJ_PRESET, device, dtype, CPU_WIDTHS[w]["tokens"])
                   for w in CPU_WIDTHS]
                + [_lowrank_case("cpu-sized kernel-wise-lite", 64, 2, 16, 16, 4, True, dev,
                                 dtype)])
    out = []
    for width, w in WIDTHS.items():
        tokens = w["tokens"] // 4 if quick else w["tokens"]
        for preset in BENCH_PRESETS:
            out.append(_case(width, preset, device, dtype, tokens))
        out.append(_oproj_case(width, OPROJ_PRESET, device, dtype, tokens))
    for label, T, H, d_b, p, r, per_head in LOWRANK_CASES:
        out.append(_lowrank_case(label, T // 4 if quick else T, H, d_b, p, r, per_head, dev,
                                 dtype))
    return out


# headwise_lowrank on its own (the standalone op; the modules use the fused projections):
# its two fused backends side by side (issue 15: the CUDA C++ path against the Triton one)
LOWRANK_CASES = [  # label, T, H, d_b, p, r, per_head
    ("gpt2-small kernel-wise (shared basis x)", 16384, 12, 768, 64, 8, False),
    ("gpt2-small kernel-wise-lite (basis k_h)", 16384, 12, 64, 64, 8, True),
    ("llama-7b kernel-wise-lite (basis k_h)", 16384, 32, 128, 128, 16, True),
]


def _lowrank_case(label, T, H, d_b, p, r, per_head, device, dtype) -> BenchCase:
    from kfused.backends import available_backends
    from kfused.ops import headwise_lowrank

    def make(backend):
        def mk():
            g = torch.Generator(device=device).manual_seed(0)

            def rnd(*shape, s=1.0):
                return (torch.randn(*shape, device=device, dtype=dtype, generator=g) * s
                        ).requires_grad_()

            basis = rnd(*((T, H, d_b) if per_head else (T, d_b)))
            A, B, bias = rnd(H, r, d_b, s=d_b ** -0.5), rnd(H, p, r, s=r ** -0.5), rnd(H, p)
            return (lambda: headwise_lowrank(basis, A, B, bias, per_head=per_head,
                                             backend=backend)), [basis, A, B, bias]
        return mk

    unfit = available_backends("headwise_lowrank", device=str(device), dtype=dtype)
    el = torch.finfo(dtype).bits // 8
    flops = 2.0 * T * H * r * (d_b + p)
    return BenchCase(
        op="headwise_lowrank",
        shape=dict(model=label, T=T, H=H, d_b=d_b, p=p, r=r, per_head=per_head),
        dtype=dtype,
        providers=[Provider("kfused-triton", make("triton"), skip_reason=unfit["triton"]),
                   Provider("kfused-cuda", make("cuda"), skip_reason=unfit["cuda"]),
                   Provider("eager", make("reference"))],
        flops_fwd=flops, flops_bwd=2 * flops,
        bytes_fwd=el * T * ((H if per_head else 1) * d_b + H * p))


# ------------------------------------------------------------------------------------------
# Roofline model (PREDICTED times; no GPU was used to make it)

# H100 SXM, bf16: sustained tensor-core rate of a large Triton/cuBLAS GEMM (~70 % of the
# 990 TFLOP/s dense peak), sustained HBM bandwidth (~90 % of 3.35 TB/s), GPU time of one tiny
# elementwise/gather kernel (the host-side factor building, launch-latency bound).
ROOF = dict(tc_flops=700e12, hbm=3.0e12, tiny_us=2.0)

MODELS = {  # (d, H, H_kv): GPT-2 small/medium (p = 64), Llama-7B with GQA (p = 128)
    "gpt2-small": (768, 12, 12),
    "gpt2-medium": (1024, 16, 16),
    "llama-7b-gqa": (4096, 32, 8),
}


def _t(flops: float, nbytes: float) -> float:
    """Seconds of one kernel: the larger of its tensor-core and HBM times."""
    return max(flops / ROOF["tc_flops"], nbytes / ROOF["hbm"])


def roofline(model: str, preset: str, tokens: int = 16384, el: int = 2) -> dict:
    """Predicted fwd+bwd time (µs) of the frozen projections, of kfused and of unfused LoRA
    with the same parameter budget (PEFT style: separate A and B GEMMs, then scale and add),
    for the q|k|v projection and (when the preset adapts o) the output projection."""
    from kfused.triton_kernels._headwise_common import pack_dims, pack_width

    d, H, Hkv = MODELS[model]
    p = d // H
    cfg = PRESETS[preset]
    T = tokens
    BN = 128
    Nq, Nkv = H * p, Hkv * p
    N = Nq + 2 * Nkv
    out = {}
    # ---- q|k|v
    frozen = 2 * _t(2 * T * d * N, el * (T * d + N * d + T * N))
    k = 0.0
    tiny = 0
    Mz = 0
    secs = []
    for Hs, rk in ((H, cfg.q), (Hkv, cfg.v)):
        R = rk.wise + 2 * rk.lite       # 16-bit: lite basis split into hi/lo rows
        if not (R or rk.shared):
            secs.append(None)
            continue
        L, RB = pack_dims(Hs, p, R, rk.shared, BN)
        W = pack_width(Hs, p, R, rk.shared, BN)       # slots stored per tile (<= RB computed)
        secs.append((Hs * p, L, RB, W))
        Mz += L * W
        # Tiny torch kernels per adapted section, fwd+bwd, counted by reading the code (bf16
        # factors): casts and folds of the factors (~15), pack in the forward (~10; the
        # backward reuses it), unpack in the backward (~8), autograd of the host-built
        # factors (~10).
        tiny += 43
    # forward: one augmented GEMM per section (k plain)
    for n, sec in zip((Nq, Nkv, Nkv), (secs[0], None, secs[1])):
        extra = sec[1] * sec[2] if sec else 0
        fl = 2 * T * d * (n + extra) + (2 * T * extra * BN if sec else 0)
        k += _t(fl, el * (T * d + n * d + T * n + T * (sec[1] * sec[3] if sec else 0)))
    # backward: rank pass per adapted section, dX GEMM over [dY | dZ], dD = dZᵀ X
    for sec in secs:
        if sec:
            n, L, RB, W = sec
            k += _t(2 * 2 * T * n * RB, el * (T * n + 2 * T * L * W))
    k += _t(2 * T * d * (N + Mz), el * (T * N + T * Mz + (N + Mz) * d + T * d))
    k += _t(2 * T * Mz * d, el * (T * Mz + T * d))
    tiny += 10                          # bias folds and reductions
    host = tiny * ROOF["tiny_us"] * 1e-6
    # unfused LoRA, same budget, on q and v (rank rl): base GEMMs + A, B GEMMs + scale + add
    from kfused.integration.headwise import headwise_parameter_count as count_parameters
    import dataclasses
    from kfused.modules.headwise import ProjRanks
    budget = count_parameters(dataclasses.replace(cfg, o=ProjRanks()), d, H, n_kv_heads=Hkv)
    rl = max(1, round(budget / ((d + Nq) + (d + Nkv))))
    lora = frozen
    for n in (Nq, Nkv):
        lora += _t(2 * T * d * rl, el * (T * d + T * rl))              # z = x Aᵀ
        lora += _t(2 * T * rl * n, el * (T * rl + T * n))              # z Bᵀ
        lora += 2 * _t(0, el * 3 * T * n)                              # scale, add
        lora += _t(2 * T * n * rl, el * (T * n + T * rl))              # dz = dy B
        lora += _t(2 * T * n * rl, el * (T * n + T * rl))              # dB = dyᵀ z
        lora += _t(2 * T * rl * d, el * (T * rl + T * d))              # dA = dzᵀ x
        lora += _t(2 * T * rl * d, el * (T * rl + T * d))              # dx += dz A
        lora += _t(0, el * 3 * T * d) + _t(0, el * 2 * T * n)          # dx add, scale bwd
        lora += 8 * ROOF["tiny_us"] * 1e-6
    out["qkv"] = dict(frozen=frozen * 1e6, kernels=k * 1e6, host=host * 1e6,
                      kfused=(k + host) * 1e6, lora=lora * 1e6, lora_rank=rl)
    # ---- output projection
    if cfg.o.wise or cfg.o.shared:
        HP = H * p
        M = H * cfg.o.wise + cfg.o.shared
        frozen_o = 2 * _t(2 * T * HP * d, el * (T * HP + HP * d + T * d))
        ko = _t(2 * T * HP * M, el * (T * HP + T * M))                  # Z = O D_oᵀ
        ko += _t(2 * T * (HP + M) * d, el * (T * HP + T * M + T * d + (HP + M) * d))
        ko += _t(2 * T * d * M, el * (T * d + T * M))                   # dZ = dY B
        ko += _t(2 * T * (d + M) * HP, el * (T * d + T * M + T * HP + (d + M) * HP))
        ko += _t(2 * T * d * M, el * (T * d + T * M))                   # dB = dYᵀ Z
        ko += _t(2 * T * M * HP, el * (T * M + T * HP))                 # dD_o = dZᵀ O
        ko += _t(0, el * T * d)                                         # db
        host_o = 30 * ROOF["tiny_us"] * 1e-6   # D_o / B builds (fwd and bwd), casts, A gather
        budget_o = count_parameters(dataclasses.replace(cfg, q=ProjRanks(), v=ProjRanks()),
                                    d, H)
        rlo = max(1, round(budget_o / (HP + d)))
        lo = frozen_o + _t(2 * T * HP * rlo, el * (T * HP + T * rlo)) \
            + _t(2 * T * rlo * d, el * (T * rlo + T * d)) + 2 * _t(0, el * 3 * T * d) \
            + 2 * _t(2 * T * d * rlo, el * (T * d + T * rlo)) \
            + 2 * _t(2 * T * rlo * HP, el * (T * rlo + T * HP)) + _t(0, el * 3 * T * HP) \
            + 8 * ROOF["tiny_us"] * 1e-6
        out["oproj"] = dict(frozen=frozen_o * 1e6, kernels=ko * 1e6, host=host_o * 1e6,
                            kfused=(ko + host_o) * 1e6, lora=lo * 1e6, lora_rank=rlo)
    return out


def roofline_table(tokens: int = 16384) -> str:
    rows = ["PREDICTED (roofline model, bf16, H100 SXM; not measured)",
            f"{'model':<13} {'preset':<28} {'op':<6} {'frozen':>7} {'kernels':>7} {'host':>6} "
            f"{'lora':>7} {'kern/frozen':>11} {'total/frozen':>12} {'total/lora':>10}  (us)"]
    for model in MODELS:
        for preset in BENCH_PRESETS:
            for op, r in roofline(model, preset, tokens).items():
                rows.append(f"{model:<13} {preset:<28} {op:<6} {r['frozen']:7.1f} "
                            f"{r['kernels']:7.1f} {r['host']:6.1f} {r['lora']:7.1f} "
                            f"{r['kernels'] / r['frozen']:11.3f} "
                            f"{r['kfused'] / r['frozen']:12.3f} {r['kfused'] / r['lora']:10.3f}")
    return "\n".join(rows)

# ------------------------------------------------------------------------------------------
# `kfused check`


def check_cases(device: torch.device):
    """Every headwise kernel on a few odd shapes against the float64 reference (docs/math.md §4)."""
    device = torch.device(device)
    g = torch.Generator().manual_seed(0)
    T = 1000 if device.type == "cuda" else 37
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    cases = []
    for H, Hkv, p in ((12, 12, 64), (8, 2, 80), (3, 1, 13)):
        d = H * p if device.type == "cuda" else min(H * p, 96)
        label = f"T={T} d={d} H={H} H_kv={Hkv} p={p}"
        q = dict(shared_A=r(4, d), shared_B=r(H * p, 4), wise_A=r(H, 3, d), wise_B=r(H, p, 3),
                 wise_c=r(H, p), lite_A=r(H, 2, p), lite_B=r(H, p, 2))
        v = dict(shared_A=r(2, d), shared_B=r(Hkv * p, 2), lite_A=r(Hkv, 5, p),
                 lite_B=r(Hkv, p, 5), lite_c=r(Hkv, p))
        inputs = dict(x=r(T, d), w_q=r(H * p, d) / d ** 0.5, w_k=r(Hkv * p, d) / d ** 0.5,
                      w_v=r(Hkv * p, d) / d ** 0.5, b_q=r(H * p), b_k=r(Hkv * p),
                      b_v=r(Hkv * p), **{f"q_{k}": t for k, t in q.items()},
                      **{f"v_{k}": t for k, t in v.items()})

        def qkv(backend, H=H, Hkv=Hkv, exact=None):
            def fn(x, w_q, w_k, w_v, b_q, b_k, b_v, **kw):
                fq = HeadFactors(scale=0.5, **{k[2:]: t for k, t in kw.items() if k[0] == "q"})
                fv = HeadFactors(scale=0.5, **{k[2:]: t for k, t in kw.items() if k[0] == "v"})
                extra = {} if backend == "reference" else dict(exact=exact)
                return headwise_qkv(x, w_q, w_k, w_v, b_q, b_k, b_v, n_heads=H, n_kv_heads=Hkv,
                                    q=fq, v=fv, backend=backend, **extra)
            return fn

        grads = [k for k in inputs if k.startswith(("x", "q_", "v_"))]
        cases.append(CheckCase("headwise_qkv", label, "triton", qkv("triton"), qkv("reference"),
                               inputs, grads))
        # the folded path (W' = W + U·D, Z recomputed; what 16-bit GPU inputs take where the
        # roofline predicts it pays)
        cases.append(CheckCase("headwise_qkv", label + " folded", "triton",
                               qkv("triton", exact=False), qkv("reference"), inputs, grads))
        o_in = dict(o=r(T, H * p), w_o=r(d, H * p) / (H * p) ** 0.5, b_o=r(d),
                    wise_A=r(H, 2, p), wise_B=r(d, H * 2), wise_c=r(d), shared_A=r(3, H * p),
                    shared_B=r(d, 3))

        def oproj(backend, H=H, exact=None):
            return lambda **kw: headwise_oproj(**kw, n_heads=H, scale=0.5, backend=backend,
                                               exact=exact)

        o_grads = ["o", "wise_A", "wise_B", "wise_c", "shared_A", "shared_B"]
        cases.append(CheckCase("headwise_oproj", label, "triton", oproj("triton"),
                               oproj("reference"), o_in, o_grads))
        # the folded path (W' = W_o + B D_o; what 16-bit GPU inputs take from 1024 tokens)
        cases.append(CheckCase("headwise_oproj", label + " folded", "triton",
                               oproj("triton", exact=False), oproj("reference"), o_in, o_grads))
        lr_in = dict(basis=r(T, H, p), A=r(H, 3, p), B=r(H, p, 3), bias=r(H, p))

        def lowrank(backend):
            return lambda **kw: headwise_lowrank(**kw, per_head=True, backend=backend)

        for be in ("triton", "cuda"):
            cases.append(CheckCase("headwise_lowrank", label, be, lowrank(be),
                                   lowrank("reference"), lr_in))
    return cases


# ------------------------------------------------------------------------------------------
# sm_90 compile check


def aot_launches() -> None:
    """GPT-2 small (p = 64), Llama-7B-like with GQA (p = 128), a p = 80 model; Kernel-mix(qvo)
    intermediate ranks; bfloat16 everywhere, float16 and float32 (IEEE dots) on one shape.
    Every autotuning config of the GEMM is compiled."""
    from kfused.triton_kernels import _headwise_common as hc
    from kfused.triton_kernels.headwise_lowrank import (headwise_lowrank_backward,
                                                        headwise_lowrank_forward)
    from kfused.triton_kernels.headwise_oproj import (headwise_oproj_backward,
                                                      headwise_oproj_forward)
    from kfused.triton_kernels.headwise_qkv import headwise_qkv_backward, headwise_qkv_forward

    SectionFactors = hc.SectionFactors
    T = 4096
    f32 = torch.float32
    configs = [(768, 12, 12, 64), (4096, 32, 8, 128), (640, 8, 8, 80)]
    runs = [(torch.bfloat16, c) for c in configs] + [(torch.float16, configs[0]),
                                                     (f32, configs[0])]
    for i, (dt, (d, H, Hkv, p)) in enumerate(runs):
        hc._AOT_ALL_CONFIGS[0] = i == 0
        e = lambda *s, dtype=dt: torch.empty(*s, dtype=dtype)  # noqa: E731
        x = e(T, d)
        # headwise_lowrank: shared basis X (Kernel-wise) and per-head basis K (lite)
        for basis, per_head, db in ((x, False, d), (e(T, H, p), True, p)):
            A, B, c = e(H, 8, db), e(H, p, 8), e(H, p)
            out, z = headwise_lowrank_forward(basis, A, B, c, per_head)
            headwise_lowrank_backward(e(T, H, p), basis, A, B, z, per_head, True, True, True)
        # fused q|k|v: q = Kernel-wise 3 + shared 12, v = lite 8 (+ Kernel-wise 2) + shared 8
        wq, wk, wv = e(H * p, d), e(Hkv * p, d), e(Hkv * p, d)
        bq, bk, bv = e(H * p, dtype=f32), e(Hkv * p), e(Hkv * p, dtype=f32)
        q = SectionFactors(e(H, 3, d, dtype=f32), e(H, 3, dtype=f32), e(H, p, 3, dtype=f32),
                           e(12, d, dtype=f32), e(H * p, 12, dtype=f32))
        v = SectionFactors(e(Hkv, 10, d, dtype=f32), e(Hkv, 10, dtype=f32),
                           e(Hkv, p, 10, dtype=f32), e(8, d, dtype=f32),
                           e(Hkv * p, 8, dtype=f32))
        Y, Z, _ = headwise_qkv_forward(x, wq, wk, wv, bq, bk, bv, q, v, p)
        headwise_qkv_backward(e(T, Y.shape[1]), x, wq, wk, wv, q, v, Z, p)
        # factors as the ops pass them now: Kernel-wise + shared in the activation dtype, no
        # zb, the shared scale folded by the pack/unpack kernels
        qa = SectionFactors(e(H, 3, d), None, e(H, p, 3), e(12, d), e(H * p, 12), 0.5)
        Y, Z, _ = headwise_qkv_forward(x, wq, wk, wv, bq, bk, bv, qa, v, p)
        headwise_qkv_backward(e(T, Y.shape[1]), x, wq, wk, wv, qa, v, Z, p)
        # folded (exact=False; 16-bit only, float32 takes the exact path): W' and b' (lite zb,
        # per-head biases c; the shared scale on one section) in one launch, the rank pass
        # recomputing Z from X
        for qf in (q, qa):
            Y, Z, _ = headwise_qkv_forward(x, wq, wk, wv, bq, bk, bv, qf, v, p, e(H * p),
                                           e(Hkv * p), fold=2)
            headwise_qkv_backward(e(T, Y.shape[1]), x, wq, wk, wv, qf, v, Z, p, fold=2)
        # single adapted projection (q slot only), Conv1D-style strided weight, no bias;
        # exact and folded
        none = SectionFactors()
        wt = e(d, H * p).t()
        for fold in (0, 2):
            Y, Z, _ = headwise_qkv_forward(x, wt, e(0, d), e(0, d), None, None, None, q, none,
                                           p, fold=fold)
            headwise_qkv_backward(e(T, H * p), x, wt, e(0, d), e(0, d), q, none, Z, p,
                                  fold=fold)
        # output projection: Kernel-wise 8 + shared 8
        o, wo = e(T, H * p), e(d, H * p)
        A, Bw, As, Us = e(H, 8, p), e(d, H * 8), e(8, H * p), e(d, 8, dtype=f32)
        Y, Z, _ = headwise_oproj_forward(o, wo, e(d, dtype=f32), A, Bw, As, Us, H)
        headwise_oproj_backward(e(T, d), o, wo, A, Bw, As, Us, Z, H)
    hc._AOT_ALL_CONFIGS[0] = True
