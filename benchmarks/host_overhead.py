"""Host cost of one fwd+bwd call per provider, on the CPU, with every Triton launch stubbed out.

    python3 benchmarks/host_overhead.py [krona headwise inducer] [--reps 7] [--calls 100]

The H100 run of 2026-11-27 (benchmarks/results/h100/proof-2026-11-27) found the KronA and
headwise paths host-bound at the benchmark shapes: the KronA fold path's fwd+bwd took 1.38 ms
of wall time for 0.17 ms of kernels, the frozen linear 0.12 ms. A GPU is rarely lent; this
script measures on any CPU what the Python side of a call costs — validation, backend choice,
the custom-op dispatch, block-size choices, allocations, torch glue, autograd — everything but
the kernels and Triton's own launch path (the stub replaces ``kernel[grid](...)``): run it
under ``TRITON_INTERPRET=1`` (set here) on the CPU-sized benchmark cases (kfused.cases,
``quick``; host cost barely depends on the shape). The frozen floor's row is the same call
without the adapter: a provider's excess over it is what kfused adds per call.

Prints a table (µs per call, the minimum over ``--reps`` runs of ``--calls`` calls: the least
disturbed) and writes it as JSON under benchmarks/results/local/.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"


def _stub_launches() -> None:
    from triton.runtime import interpreter

    def run(self, *args, grid, warmup, **kwargs):
        return None

    interpreter.InterpretedFunction.run = run


def _step(prov):
    from kfused.bench import fwdbwd_step

    return fwdbwd_step(prov)


def measure(step, reps: int, calls: int) -> float:
    for _ in range(10):
        step()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


PROVIDERS = ("floor", "kfused-triton", "kfused-triton-exact", "peft-lora", "eager")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ops", nargs="*", default=["krona", "headwise"])
    p.add_argument("--dtype", default="float32", choices=["float16", "float32"],
                   help="float32 (default; its CPU GEMMs are fast, so the floor is mostly host "
                        "cost) or float16 (the 16-bit paths a GPU trains with, but the CPU's "
                        "16-bit GEMMs dwarf the host cost). float32 adds "
                        "the float32-only float64 corrections, computed on this CPU")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "local"))
    args = p.parse_args(argv)
    from kfused._files import folder_refusal

    unusable = folder_refusal(args.out)   # before the measuring, not a traceback after it
    if unusable:
        p.error(f"argument --out: {unusable}")
    _stub_launches()
    import torch

    from kfused.cases import bench_cases

    rows = []
    for op in args.ops:
        for case in bench_cases(op, torch.device("cpu"), getattr(torch, args.dtype),
                                quick=True):
            label = ",".join(f"{k}={v}" for k, v in case.shape.items()
                             if not isinstance(v, (list, dict)))
            base = None
            for prov in case.providers:
                if prov.name not in PROVIDERS:
                    continue
                try:
                    us = measure(_step(prov), args.reps, args.calls)
                except Exception as exc:  # noqa: BLE001 (reported, the others still run)
                    print(f"{case.op:16} {label[:60]:60} {prov.name:20} failed: "
                          f"{type(exc).__name__}: {str(exc)[:80]}")
                    continue
                if prov.name == "floor":
                    base = us
                rows.append(dict(op=case.op, shape=case.shape, provider=prov.name,
                                 host_us=us, host_us_floor=base))
                extra = f"{us / base:6.2f}x floor" if base else ""
                print(f"{case.op:16} {label[:60]:60} {prov.name:20} {us:8.1f} us  {extra}",
                      flush=True)
    os.makedirs(args.out, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    from kfused._files import new_results_file

    path = new_results_file(args.out, f"host_overhead_{stamp}", json.dumps(
        {"torch": torch.__version__, "dtype": args.dtype, "python": sys.version.split()[0],
         "note": "CPU, Triton launches stubbed (TRITON_INTERPRET=1)", "rows": rows},
        indent=1, default=str))   # a new file, whole or absent
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
