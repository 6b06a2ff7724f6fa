"""Time the candidate launch configurations of a kernel on a GPU; record the fastest per shape.

    python3 benchmarks/tune_kernels.py [--table kfused/data/kernel_tuning.json]
                                       [--out tune.json] [--shapes targets|all] [--reps-ms 30]
    python3 benchmarks/tune_kernels.py --compile-only      # any machine: compile for sm_90
    python3 benchmarks/tune_kernels.py --warm-only         # GPU: compile + launch, untimed

Kernel: ``_kron_grad_kernel``, the factor-gradient pass of KronA's folded backward (dA, dB
from one read of x and dy). The H100 of 2026-11-27 ran it at 2.1x its predicted time with
the rule's 2 tokens per step (a short dependent chain per step that the roofline does not
price; benchmarks/results/h100/proof-2026-11-27). Its candidates
(:func:`kfused.triton_kernels.krona_linear.grad_candidates`: tokens per step, warps, stages)
are each tested on the CPU (tests/test_krona.py) and compile for sm_90 without spills
(``--compile-only`` checks it, CI runs it on one shape).

On a GPU, for every benchmark factor shape on the tensor-core path (bf16): each candidate's
``kron_factor_grads`` (the kernel and its partial sum) captured in a CUDA graph and replayed
(device time, no host cost: ``kfused.bench.graph_timer``); the fastest is merged into
``--table`` (``kfused.tuning``: ``KFUSED_KERNEL_TUNING`` points the library at a table, the
package's ``kfused/data/kernel_tuning.json`` is the committed one), every time into ``--out``
with the device, versions and commit. ``benchmarks/gpu_suite.sh proof`` runs it before the
krona benchmarks and points them at its table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

KERNEL = "_kron_grad_kernel"


def shapes(which: str):
    """(T, a_out, a_in, b_out, b_in) as ``kron_factor_grads`` is called, the benchmark's
    factor shapes on the tensor-core path (every padded factor dim >= 16, kernel-side)."""
    from kfused.cases import krona as kc
    from kfused.triton_kernels import krona_linear as kl

    widths = kc.QUICK_WIDTHS if which == "targets" else kc.WIDTHS
    tokens = [16384] if which == "targets" else kc.TOKENS
    out = []
    for d_in, d_out in widths:
        for fac in ("sqrt", "glue"):
            fs = kc.factor_shapes(d_in, d_out, fac)
            if fs is None:
                continue
            (a_out, a_in), (b_out, b_in) = fs
            if kl.grad_candidates(16384, *kernel_side(a_out, a_in, b_out, b_in)):
                for T in tokens:
                    if (T, a_out, a_in, b_out, b_in) not in out:
                        out.append((T, a_out, a_in, b_out, b_in))
    return out


def kernel_side(a_out, a_in, b_out, b_in):
    """The factors as the kernel sees them (kron_factor_grads swaps some pairs)."""
    from kfused.triton_kernels import krona_linear as kl

    if kl._swap_factors(a_out, a_in, b_out, b_in):
        return b_out, b_in, a_out, a_in
    return a_out, a_in, b_out, b_in


def label(c: dict) -> str:
    return f"BT{c['BT']}-w{c['num_warps']}-s{c['num_stages']}"


def compile_only(which: str, arch: int, limit: int = 0) -> int:
    """Compile every candidate of every shape for sm_<arch> on CPU stand-ins; print registers,
    spills and shared memory; nonzero when one spills or cannot launch."""
    from kfused.perf.compile import compile_launch, jit_spec, launch_error, recording
    from kfused.triton_kernels import krona_linear as kl

    bad = 0
    todo = shapes(which)
    for T, a_out, a_in, b_out, b_in in (todo[:limit] if limit else todo):
        ks = kernel_side(a_out, a_in, b_out, b_in)
        for c in kl.grad_candidates(T, *ks):
            x = torch.empty(T, a_in * b_in, dtype=torch.bfloat16)
            g = torch.empty(T, a_out * b_out, dtype=torch.bfloat16)
            A = torch.empty(a_out, a_in, dtype=torch.bfloat16)
            B = torch.empty(b_out, b_in, dtype=torch.bfloat16)
            with recording() as launches:
                kl.kron_factor_grads(g, x, A, B, 0.5, compute_dx=False, config=c)
            (L,) = [L for L in launches if L.name == KERNEL]
            st = compile_launch(L.fn, jit_spec(L.fn, L.args, L.kwargs, arch), arch)
            err = launch_error(st, arch)
            ok = st["spill_bytes"] == 0 and err is None
            bad += not ok
            print(f"T={T} A{a_out}x{a_in} B{b_out}x{b_in} {label(c):12s} regs {st['regs']:3d} "
                  f"spill {st['spill_bytes']} B shared {st['shared_bytes']} B "
                  f"ctas/SM {st['ctas_per_sm']}" + ("" if ok else f"  <- {err or 'spills'}"),
                  flush=True)
    return 1 if bad else 0


def warm(which: str) -> int:
    """Compile and launch every candidate once on the GPU, untimed (the Triton cache on disk
    then holds them: the proof runs this beside its tests, and the timed run later loads)."""
    from kfused.triton_kernels import krona_linear as kl

    dev = torch.device("cuda")
    for T, a_out, a_in, b_out, b_in in shapes(which):
        x = torch.randn(T, a_in * b_in, device=dev, dtype=torch.bfloat16)
        g = torch.randn(T, a_out * b_out, device=dev, dtype=torch.bfloat16)
        A = torch.randn(a_out, a_in, device=dev, dtype=torch.bfloat16)
        B = torch.randn(b_out, b_in, device=dev, dtype=torch.bfloat16)
        for c in kl.grad_candidates(T, *kernel_side(a_out, a_in, b_out, b_in)):
            t0 = time.monotonic()
            try:
                kl.kron_factor_grads(g, x, A, B, 0.5, compute_dx=False, config=c)
                torch.cuda.synchronize()
                msg = "ok"
            except Exception as exc:
                msg = f"{type(exc).__name__}: {str(exc)[:120]}"
            print(f"T={T} A{a_out}x{a_in} B{b_out}x{b_in} {label(c)}: {msg} "
                  f"({time.monotonic() - t0:.1f} s)", flush=True)
    return 0


def tune(which: str, table: str, out: str, reps_ms: float, time_limit: float,
         dev: torch.device = torch.device("cuda"), timer=None, name: str = "") -> int:
    """Time every candidate per shape (``timer(fn, dev, reps_ms)`` -> (p20, p50, p80) ms,
    default ``kfused.bench.graph_timer``), merge the fastest into ``table``, write ``out``."""
    from kfused import tuning
    from kfused.bench import graph_timer
    from kfused.cli.bench import environment
    from kfused.triton_kernels import krona_linear as kl

    timer = timer or graph_timer
    name = name or torch.cuda.get_device_name(dev)
    t_end = time.monotonic() + time_limit
    rows, entries = [], []
    for T, a_out, a_in, b_out, b_in in shapes(which):
        if time.monotonic() > t_end:
            print(f"time limit: T={T} A{a_out}x{a_in} B{b_out}x{b_in} and later not tuned")
            break
        gen = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(T, a_in * b_in, device=dev, dtype=torch.bfloat16, generator=gen)
        g = torch.randn(T, a_out * b_out, device=dev, dtype=torch.bfloat16, generator=gen)
        A = torch.randn(a_out, a_in, device=dev, dtype=torch.bfloat16, generator=gen)
        B = torch.randn(b_out, b_in, device=dev, dtype=torch.bfloat16, generator=gen)
        ks = kernel_side(a_out, a_in, b_out, b_in)
        cands = kl.grad_candidates(T, *ks)
        us, ref = {}, None
        for c in cands:
            run = lambda c=c: kl.kron_factor_grads(g, x, A, B, 0.5, compute_dx=False,  # noqa
                                                   config=c)
            try:
                got = run()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                if ref is None:
                    ref = got
                else:   # every candidate computes the same sums (same order within a
                    # program, programs summed in a fixed order): report a difference
                    for r, v in zip(ref[1:], got[1:]):
                        d = (r.float() - v.float()).abs().max().item()
                        s = r.float().abs().max().item()
                        if d > 1e-2 * max(s, 1e-6):
                            print(f"  {label(c)}: differs from {label(cands[0])} by {d:.3g}"
                                  f" (max {s:.3g})")
                us[label(c)] = timer(run, dev, reps_ms)[1] * 1e3
            except Exception as exc:   # a config this GPU cannot launch: not a candidate
                us[label(c)] = None
                print(f"  {label(c)}: {type(exc).__name__}: {str(exc)[:120]}")
        timed = [(v, c) for c in cands for k, v in us.items() if k == label(c) and v]
        if not timed:
            continue
        best_us, best = min(timed, key=lambda vc: vc[0])
        rule_us = us.get(label(cands[0]))
        print(f"T={T} A{a_out}x{a_in} B{b_out}x{b_in}: " + ", ".join(
            f"{k} {v:.1f}" if v else f"{k} -" for k, v in us.items())
            + f" us -> {label(best)}" + (f" ({rule_us / best_us:.2f}x the rule's)"
                                         if rule_us else ""), flush=True)
        key = kl.grad_tuning_key(*ks, 2)
        entries.append({"key": key, "T": T, "config": dict(best),
                        "us": {k: (round(v, 2) if v else None) for k, v in us.items()}})
        rows.append({"T": T, "A": [a_out, a_in], "B": [b_out, b_in], "kernel_side": list(ks),
                     "us": us, "best": label(best), "rule": label(cands[0])})
    meta = environment(dev)
    if entries:
        tuning.merge(table, name, KERNEL, entries,
                     extra={"commits": {**(tuning.load(table).get("commits", {})
                                           if os.path.exists(table) else {}),
                                        name: meta["git_commit"]}})
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump({"meta": meta, "kernel": KERNEL, "rows": rows}, f, indent=1)
    print(f"{len(entries)} shapes tuned; table {table}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table", default=os.path.join("kfused", "data", "kernel_tuning.json"))
    p.add_argument("--out", default="")
    p.add_argument("--shapes", choices=("targets", "all"), default="targets")
    p.add_argument("--reps-ms", type=float, default=30.0)
    p.add_argument("--time-limit", type=float, default=1e9, help="seconds; shapes after it "
                   "are not tuned")
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--warm-only", action="store_true", help="GPU: compile and launch every "
                   "candidate once, untimed")
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--limit", type=int, default=0, help="--compile-only: the first N shapes")
    a = p.parse_args(argv)
    if a.compile_only:
        if os.environ.get("TRITON_INTERPRET"):
            raise SystemExit("unset TRITON_INTERPRET: the kernels are compiled, not interpreted")
        return compile_only(a.shapes, a.arch, a.limit)
    if not torch.cuda.is_available():
        print("tune_kernels: no CUDA device (use --compile-only on a CPU)", file=sys.stderr)
        return 2
    if a.warm_only:
        return warm(a.shapes)
    return tune(a.shapes, a.table, a.out, a.reps_ms, a.time_limit)


if __name__ == "__main__":
    sys.exit(main())
