"""Benchmark cases for the fused attention-input projection with per-head updates (SPEC §2).

``cases(device, dtype, quick=False)`` returns :class:`kfused.bench.BenchCase` objects for the
shared harness (``kfused.bench.measure``). Each case is one (model width, adapter preset)
pair with the providers:

    floor          the frozen q|k|v projection alone (one GEMM against [W_q; W_k; W_v])
    kfused-triton  kfused.ops.headwise.headwise_qkv (one fused Triton kernel, fwd and bwd)
    eager          the per-head PyTorch reference (einsums over the head axis)
    compile        torch.compile of that reference
    peft-lora      plain LoRA on q and v with the same parameter budget, as PEFT runs it
                   (peft.get_peft_model on q_proj/k_proj/v_proj linears)

Presets: Kernel-mix(qvo) (intermediate; its q and v parts ride on this projection, its o part
belongs to the output projection) and Kernel-mix-lite(qv) (small). Widths: GPT-2 small
(d = 768, 12 heads) and Llama-7B-like (d = 4096, 32 heads, head width 128).

Run: ``python benchmarks/bench_headwise.py [--quick] [--dtype float16]`` prints the rows.
"""

from __future__ import annotations

import argparse
import json
from typing import List

import torch

from kfused.bench import BenchCase, Provider, measure
from kfused.backends import triton_unfit
from kfused.modules.headwise_presets import PRESETS, count_parameters
from kfused.reference.headwise import HeadFactors, headwise_qkv_ref

WIDTHS = {
    "gpt2-small": dict(d=768, H=12, tokens=8 * 512),
    "llama-7b": dict(d=4096, H=32, tokens=4 * 512),
}
# Off the GPU (Triton interpreter / CPU torch) only a smoke-sized case is meaningful.
CPU_WIDTHS = {"cpu-smoke": dict(d=96, H=4, tokens=64)}
BENCH_PRESETS = ("kernel-mix-qvo-intermediate", "kernel-mix-lite-qv-small")


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
    d, H = w["d"], w["H"]
    p = d // H
    cfg = PRESETS[preset]
    dev = torch.device(device)
    budget = count_parameters(dict_q_v(cfg), d, H)  # q and v parts only (this projection)
    lora_r = max(1, round(budget / (2 * 2 * d)))

    def inputs(seed=0):
        gen = torch.Generator(device=dev).manual_seed(seed)
        x = torch.randn(tokens, d, generator=gen, device=dev, dtype=dtype).requires_grad_()
        W = [torch.randn(d, d, generator=gen, device=dev, dtype=dtype) / d ** 0.5
             for _ in range(3)]
        b = [torch.randn(d, generator=gen, device=dev, dtype=dtype) * 0.1 for _ in range(3)]
        q = _factors(cfg.q, H, p, d, dev, dtype, gen)
        v = _factors(cfg.v, H, p, d, dev, dtype, gen)
        return x, W, b, q, v

    def floor():
        x, W, b, _, _ = inputs()
        Wc, bc = torch.cat(W), torch.cat(b)
        return (lambda: torch.nn.functional.linear(x, Wc, bc)), [x]

    def triton_fused():
        from kfused.ops.headwise import headwise_qkv

        x, W, b, q, v = inputs()
        return (lambda: headwise_qkv(x, *W, *b, n_heads=H, q=q, v=v, backend="triton",
                                     fused_output=True)), [x, *_leaves(q), *_leaves(v)]

    def eager():
        x, W, b, q, v = inputs()
        return (lambda: headwise_qkv_ref(x, *W, *b, n_heads=H, q=q, v=v)), \
            [x, *_leaves(q), *_leaves(v)]

    def compiled():
        x, W, b, q, v = inputs()
        fn = torch.compile(headwise_qkv_ref)
        return (lambda: fn(x, *W, *b, n_heads=H, q=q, v=v)), [x, *_leaves(q), *_leaves(v)]

    def peft_lora():
        import peft

        x, W, b, _, _ = inputs()

        class Attn(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.q_proj = torch.nn.Linear(d, d, device=dev, dtype=dtype)
                self.k_proj = torch.nn.Linear(d, d, device=dev, dtype=dtype)
                self.v_proj = torch.nn.Linear(d, d, device=dev, dtype=dtype)
                with torch.no_grad():
                    for m, wi, bi in zip((self.q_proj, self.k_proj, self.v_proj), W, b):
                        m.weight.copy_(wi)
                        m.bias.copy_(bi)

            def forward(self, x):
                return self.q_proj(x), self.k_proj(x), self.v_proj(x)

        model = peft.get_peft_model(Attn(), peft.LoraConfig(
            r=lora_r, lora_alpha=lora_r, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
        leaves = [prm for prm in model.parameters() if prm.requires_grad]
        with torch.no_grad():  # B = 0 at init: make the adapter path do real work
            for prm in leaves:
                prm.normal_(0, 0.02)
        return (lambda: model(x)), [x, *leaves]

    unfit = triton_unfit(dev, dtype)
    try:
        import peft  # noqa: F401
        peft_skip = None
    except Exception as exc:  # pragma: no cover
        peft_skip = f"peft not importable ({exc})"
    providers = [
        Provider("floor", floor),
        Provider("kfused-triton", triton_fused, skip_reason=unfit),
        Provider("eager", eager),
        Provider("compile", compiled,
                 skip_reason=None if dev.type == "cuda" else "torch.compile timed on CUDA only"),
        Provider("peft-lora", peft_lora, skip_reason=peft_skip),
    ]
    N = 3 * d
    rq, rv = cfg.q, cfg.v
    rank_cols = H * (rq.wise + rq.lite + rv.wise + rv.lite) + rq.shared + rv.shared
    flops_fwd = 2.0 * tokens * d * (N + rank_cols) + 2.0 * tokens * rank_cols * p
    el = torch.finfo(dtype).bits // 8
    return BenchCase(
        op="headwise_qkv",
        shape=dict(width=width, preset=preset, tokens=tokens, d=d, heads=H, head_dim=p,
                   adapter_params=budget, peft_lora_rank=lora_r),
        dtype=dtype, providers=providers, flops_fwd=flops_fwd, flops_bwd=2 * flops_fwd,
        bytes_fwd=float(el * (tokens * d + N * d + tokens * N)))


def dict_q_v(cfg):
    """The preset restricted to its q and v parts (what this projection carries)."""
    import dataclasses

    from kfused.modules.headwise import ProjRanks

    return dataclasses.replace(cfg, o=ProjRanks())


def cases(device="cuda", dtype=torch.float16, quick: bool = False) -> List[BenchCase]:
    """Benchmark cases; ``quick`` shrinks the token count (CPU smoke runs, CI)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        if dtype == torch.bfloat16:
            dtype = torch.float32
        return [_case(w, p, device, dtype, CPU_WIDTHS[w]["tokens"]) for w in CPU_WIDTHS
                for p in BENCH_PRESETS]
    out = []
    for width, w in WIDTHS.items():
        tokens = w["tokens"] // 4 if quick else w["tokens"]
        for preset in BENCH_PRESETS:
            out.append(_case(width, preset, device, dtype, tokens))
    return out


def main() -> None:  # pragma: no cover
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rep-ms", type=float, default=100)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    for case in cases(args.device, dtype, args.quick):
        for row in measure(case, args.device, rep_ms=args.rep_ms):
            print(json.dumps(row))


if __name__ == "__main__":  # pragma: no cover
    main()
