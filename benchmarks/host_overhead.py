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

``--gpu-path``: the same, on the code path a GPU takes, with 16-bit (float16) tensors on the
CPU: Triton launches recorded instead of run (``kfused.perf.compile.recording``: the GPU's
block sizes, one launch per autotuned kernel as after autotuning), the branches that hand
16-bit CUDA operands to cuBLAS taken (``kfused.perf.trace``: ``torch.matmul`` on the tiny CPU
tensors stands in), and the fold decisions a GPU makes at the benchmarks' 16k tokens (every
headwise benchmark preset folds its forward and dX there; KronA and the output projection
fold from ``FOLD_MIN_TOKENS``; the folded forwards keep W' for the backward, as there). The
cases are tiny (3 heads of width 4, d = 12, 2 tokens; KronA 16×16 with 4×4 factors): the
CPU's float16 GEMMs cost about 1.5 µs at these sizes, as a GPU's host pays for a cuBLAS call,
but about 20 µs from a few thousand multiply-adds up (this CPU: 8×48 by 48×144 took 20 µs,
2×12 by 12×36 1.8 µs), which would bill arithmetic to every provider as host cost — most to
PEFT LoRA, which runs the most GEMMs. Not counted either way: Triton's own launch path and
the CUDA launches of the torch ops (both real host cost on a GPU).

Prints a table (µs per call, the minimum over ``--reps`` runs of ``--calls`` calls: the least
disturbed) and writes it as JSON under benchmarks/results/local/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

if "--gpu-path" in sys.argv[1:]:
    os.environ.pop("TRITON_INTERPRET", None)   # compiled kernels' launch path, recorded
else:
    os.environ["TRITON_INTERPRET"] = "1"


def _stub_launches() -> None:
    from triton.runtime import interpreter

    def run(self, *args, grid, warmup, **kwargs):
        return None

    interpreter.InterpretedFunction.run = run


def _recorded(step, launches):
    def run():
        step()
        del launches[:]      # the recording's list, emptied (it would grow call by call)
    return run


@contextlib.contextmanager
def _gpu_path():
    """The host code takes the branches of a GPU at the benchmark shapes (module doc)."""
    import kfused.ops._fold as fo
    import kfused.triton_kernels._headwise_common as hc
    import kfused.triton_kernels.headwise_qkv as hq
    from kfused.perf.compile import recording
    from kfused.perf.trace import _gpu_dispatch, _triton_forced

    def fold_decision(dtype, tokens, exact, on_cuda):
        return decide(dtype, max(tokens, 16384), exact, True)

    def keeps_fold(N, K, T, M):     # the folded q|k|v forward keeps W' as at 16k tokens
        return keeps(N, K, max(T, 16384), M)

    def oproj_keeps_fold(N, HP, M, T):      # and the output projection its operands
        return okeeps(N, HP, M, max(T, 16384))

    import importlib

    okl = importlib.import_module("kfused.ops.krona_linear")   # (kfused.ops has the function)
    import kfused.triton_kernels.headwise_oproj as ho

    decide, keeps = fo.fold_decision, hq.keeps_fold
    okeeps = getattr(ho, "oproj_keeps_fold", None)     # (an older checkout, A/B: none)
    keep_ratio = okl.KEEP_FOLD_RATIO
    mods = [m for m in list(sys.modules.values()) if m is not None and
            getattr(m, "__name__", "").startswith("kfused.ops") and
            getattr(m, "fold_decision", None) is decide]
    saved = (hc._AOT_ALL_CONFIGS[0], hc.FORCE_FOLD)
    hc._AOT_ALL_CONFIGS[0], hc.FORCE_FOLD = False, True
    for m in mods:
        m.fold_decision = fold_decision
    hq.keeps_fold = keeps_fold
    if okeeps is not None:
        ho.oproj_keeps_fold = oproj_keeps_fold
    okl.KEEP_FOLD_RATIO = 0          # KronA keeps W' too (T >= 8·d_out at the benchmarks')
    try:
        with _triton_forced(), recording() as launches, _gpu_dispatch(launches):
            yield launches
    finally:
        for m in mods:
            m.fold_decision = decide
        hq.keeps_fold = keeps
        if okeeps is not None:
            ho.oproj_keeps_fold = okeeps
        okl.KEEP_FOLD_RATIO = keep_ratio
        hc._AOT_ALL_CONFIGS[0], hc.FORCE_FOLD = saved


def _gpu_path_cases():
    """Tiny float16 cases (CPU tensors) of the headwise projections and KronA (module doc)."""
    import torch

    import kfused.cases.headwise as ch
    import kfused.cases.krona as ck
    from kfused.bench import BenchCase

    dt, dev, T = torch.float16, torch.device("cpu"), 2
    ch.CPU_WIDTHS["gpt2-tiny"] = dict(d=12, H=3, Hkv=3, tokens=T)
    try:
        cases = [ch._case("gpt2-tiny", p, dev, dt, T) for p in ch.BENCH_PRESETS]
        cases.append(ch._oproj_case("gpt2-tiny", ch.OPROJ_PRESET, dev, dt, T))
    finally:
        del ch.CPU_WIDTHS["gpt2-tiny"]
    common = dict(T=T, d_in=16, d_out=16, dtype=dt, device=dev, factors="sqrt")
    from kfused.ops import krona_linear

    provs = [ck._provider("floor", lambda x, W, b, A, B: torch.nn.functional.linear(x, W, b),
                          leaves_idx=(0,), **common),
             ck._provider("kfused-triton", lambda x, W, b, A, B: krona_linear(
                 x, W, b, A, B, 0.5, backend="triton"), **common)]
    cases.append(BenchCase(op="krona_linear", shape=dict(T=T, d_in=16, d_out=16,
                                                         factors="sqrt"),
                           dtype=dt, providers=provs, flops_fwd=0.0, flops_bwd=0.0,
                           bytes_fwd=0.0))
    return cases


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
    p.add_argument("--gpu-path", action="store_true",
                   help="the code path a GPU takes, 16-bit (see the module doc)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "local"))
    args = p.parse_args(argv)
    from kfused._files import folder_refusal

    unusable = folder_refusal(args.out)   # before the measuring, not a traceback after it
    if unusable:
        p.error(f"argument --out: {unusable}")
    import torch

    from kfused.cases import bench_cases

    stack = contextlib.ExitStack()
    if args.gpu_path:
        launches = stack.enter_context(_gpu_path())
        cases = [c for c in _gpu_path_cases() if c.op.split("_")[0] in
                 {o.split("_")[0] for o in args.ops}]
    else:
        _stub_launches()
        cases = [c for op in args.ops for c in bench_cases(op, torch.device("cpu"),
                                                             getattr(torch, args.dtype),
                                                             quick=True)]
    rows = []
    with stack:
        for case in cases:
            label = ",".join(f"{k}={v}" for k, v in case.shape.items()
                             if not isinstance(v, (list, dict)))
            base = None
            for prov in case.providers:
                if prov.name not in PROVIDERS:
                    continue
                try:
                    step = _step(prov)
                    if args.gpu_path:
                        del launches[:]
                        step()
                        per_call = len(launches)
                        step = _recorded(step, launches)
                    us = measure(step, args.reps, args.calls)
                except Exception as exc:  # noqa: BLE001 (reported, the others still run)
                    print(f"{case.op:16} {label[:60]:60} {prov.name:20} failed: "
                          f"{type(exc).__name__}: {str(exc)[:80]}")
                    continue
                if prov.name == "floor":
                    base = us
                rows.append(dict(op=case.op, shape=case.shape, provider=prov.name,
                                 host_us=us, host_us_floor=base))
                extra = f"{us / base:6.2f}x floor" if base else ""
                if args.gpu_path:
                    rows[-1]["triton_launches"] = per_call
                    extra += f"  {per_call} Triton launches"
                print(f"{case.op:16} {label[:60]:60} {prov.name:20} {us:8.1f} us  {extra}",
                      flush=True)
    os.makedirs(args.out, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    from kfused._files import new_results_file
    from kfused.cli.bench import _git_commit   # the kfused that ran (an A/B tree's own)

    path = new_results_file(args.out, f"host_overhead_{stamp}", json.dumps(
        {"torch": torch.__version__, "dtype": "float16" if args.gpu_path else args.dtype,
         "python": sys.version.split()[0],
         "note": ("CPU, the GPU's code path, Triton launches recorded (--gpu-path)"
                  if args.gpu_path else "CPU, Triton launches stubbed (TRITON_INTERPRET=1)"),
         "commit": _git_commit(), "rows": rows},
        indent=1, default=str))   # a new file, whole or absent
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
