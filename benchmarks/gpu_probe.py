"""Short GPU probes for defects a proof run found (one device call; prints a line per probe).

    python3 benchmarks/gpu_probe.py [rng] [lowrank]

rng      a CUDA-graph capture that fails (a host sync inside), then a random draw outside any
         capture: raised "Offset increment outside graph capture" in every later provider of
         the H200 proof of 2026-11-30; ``kfused.bench.renew_generators`` must clear it
lowrank  headwise_lowrank's Triton backward against float64 on the GPU over the shape family
         of tests/test_headwise_ops.py::test_lowrank_kernel (the H200 proof of 2026-11-30
         failed [False-float16] at T=2x45, H=1, r=2, d_b=33: dbasis and dA off by up to 70 %,
         dB right), each draw run three times (a race shows as runs that differ)
"""

from __future__ import annotations

import itertools
import sys

import torch


def probe_rng() -> None:
    from kfused.bench import renew_generators

    dev = torch.device("cuda", torch.cuda.current_device())
    s = torch.cuda.Stream(dev)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(s):
            with torch.cuda.graph(g, stream=s):
                torch.randn(8, device=dev)
                torch.cuda.synchronize()
        print("rng: the capture did not fail (probe void)")
    except Exception as exc:
        print(f"rng: capture failed as meant: {type(exc).__name__}: {str(exc)[:120]}")
    try:
        torch.randn(8, device=dev)
        print("rng: a draw after the failed capture works without renewing")
    except Exception as exc:
        print(f"rng: a draw after the failed capture raised: {str(exc)[:100]}")
        renew_generators(dev)
        try:
            torch.randn(8, device=dev)
            print("rng: after renew_generators the draw works")
        except Exception as exc2:
            print(f"rng: after renew_generators it still raised: {str(exc2)[:100]}")


def probe_lowrank() -> None:
    gpu = torch.cuda.is_available()
    DEV = "cuda" if gpu else "cpu"
    DTS = [torch.float16, torch.bfloat16, torch.float32] if gpu else [torch.float16]
    from kfused.ops.headwise_lowrank import headwise_lowrank

    torch.manual_seed(0)
    bad = 0
    for per_head, dt, T, H, p, r, db in itertools.product(
            [False, True], DTS, [3, 17, 45],
            [1, 3, 4], [24, 40, 80], [1, 2, 5], [20, 33, 48]):
        if (T, H, r) not in ((45, 1, 2), (17, 3, 5), (3, 4, 1)) and db != 33:
            continue
        basis = torch.randn(2, T, H, db) if per_head else torch.randn(2, T, db)
        A, B, c = torch.randn(H, r, db), torch.randn(H, p, r), torch.randn(H, p)
        g = torch.randn(2, T, H, p)
        leaves64 = [t.to(dt).double().requires_grad_() for t in (basis, A, B, c)]
        out64 = headwise_lowrank(*leaves64, per_head=per_head, backend="reference")
        ref = torch.autograd.grad(out64, leaves64, g.to(dt).double())
        runs = []
        for _ in range(3):
            leaves = [t.to(DEV, dt).requires_grad_() for t in (basis, A, B, c)]
            out = headwise_lowrank(*leaves, per_head=per_head, backend="triton")
            runs.append(torch.autograd.grad(out, leaves, g.to(DEV, dt)))
        errs = [max(float((x.double().cpu() - y).abs().max() / (y.abs().max() + 1e-9))
                    for x, y in zip(run, ref)) for run in runs]
        same = all(torch.equal(a, b) for a, b in zip(runs[0], runs[1])) and \
            all(torch.equal(a, b) for a, b in zip(runs[0], runs[2]))
        names = ["dbasis", "dA", "dB", "dc"]
        per = [float((x.double().cpu() - y).abs().max() / (y.abs().max() + 1e-9))
               for x, y in zip(runs[0], ref)]
        tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 4e-2}[dt]
        if max(per) > tol or not same:
            bad += 1
            print(f"lowrank BAD per_head={per_head} {dt} T=2x{T} H={H} p={p} r={r} db={db}: "
                  + ", ".join(f"{n} {e:.2e}" for n, e in zip(names, per))
                  + f"; runs identical: {same}; run errs {['%.2e' % e for e in errs]}")
    print(f"lowrank: {bad} bad draws")


if __name__ == "__main__":
    which = sys.argv[1:] or ["rng", "lowrank"]
    for w in which:
        {"rng": probe_rng, "lowrank": probe_lowrank}[w]()
