"""Compile one benchmark case's launches of a kernel for sm_90 on any machine and keep the code.

    python3 benchmarks/kernel_asm.py CASE KERNEL [--out DIR] [--arch 90]
    PYTHONPATH=/path/to/triton-3.6 python3 benchmarks/kernel_asm.py ...   # the GPU's Triton

CASE is a substring of a `kfused perf` case label (`python -m kfused.cli.main perf` prints
them, e.g. "gpt2-small T=16384 kernel-mix-qvo" or "768->768 A24x24"); KERNEL a Triton kernel
name (`_lr_rank_bwd_kernel`). The case's forward and backward are traced on CPU stand-in
tensors as the performance model traces them (kfused.perf.trace: the GPU's block sizes and
dispatch), and every launch of KERNEL is compiled as Triton's JIT would compile it on the GPU
(kfused.perf.compile.jit_spec). For each launch it writes <kernel>.<i>.{ttir,ttgir,ptx,cubin}
to DIR and prints the grid, the constexprs, the registers, spills and shared memory, and how
many reductions (`tt.reduce`) and dots sit inside loops of the TTGIR — the shape of a kernel's
critical path that the roofline model does not see (a reduction or a dependent load per loop
step made several kernels latency-bound on the H100 of 2026-11-27; see
benchmarks/results/h100/proof-2026-11-27/README.md).
"""

from __future__ import annotations

import argparse
import os
import re
import sys


def loop_summary(ttgir: str) -> dict:
    """Reductions and dots inside / outside scf.for bodies of a TTGIR text (by indentation
    depth of the op relative to the enclosing loops)."""
    depth, inside = 0, {"reduce": 0, "dot": 0}
    outside = {"reduce": 0, "dot": 0}
    for line in ttgir.splitlines():
        s = line.strip()
        kind = ("reduce" if '"tt.reduce"' in s else
                "dot" if re.search(r"\b(tt\.dot|ttng\.warp_group_dot)\b", s) else None)
        if kind:
            (inside if depth else outside)[kind] += 1
        if "scf.for" in s and s.endswith("{"):
            depth += 1
        elif s.startswith("scf.yield") and depth:
            depth -= 1
    return {"in_loops": inside, "outside": outside}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("case")
    p.add_argument("kernel")
    p.add_argument("--out", default="kernel_asm")
    p.add_argument("--arch", type=int, default=90)
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("unset TRITON_INTERPRET: the kernels are compiled, not interpreted")
    # FMA contraction as kfused perf compiles (Triton 3.9 warns when unset; 3.10 flips it)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import triton
    from triton.compiler import ASTSource

    from kfused.perf.cases import all_cases
    from kfused.perf.compile import _target, _ttir_dots, cubin_stats, jit_spec, spill_bytes
    from kfused.perf.trace import trace

    case = next((c for c in all_cases() if args.case in c.label), None)
    if case is None:
        raise SystemExit(f"no perf case label contains {args.case!r}")
    launches, _ = trace(case.run)
    mine = [(i, L) for i, L in enumerate(launches) if L.fn.__name__ == args.kernel]
    print(f"{case.label}: {len(launches)} launches, {len(mine)} of {args.kernel} "
          f"(triton {triton.__version__}, sm_{args.arch})")
    if not mine:
        print("kernels traced: " + ", ".join(sorted({L.fn.__name__ for L in launches})))
        return 1
    os.makedirs(args.out, exist_ok=True)
    for i, L in mine:
        sig, consts, attrs, opts = jit_spec(L.fn, L.args, L.kwargs, args.arch)
        opts = {k: v for k, v in opts.items() if k != "arch"}
        k = triton.compile(ASTSource(L.fn, sig, consts, attrs), target=_target(args.arch),
                           options=opts)
        stem = os.path.join(args.out, f"{args.kernel}.{i}")
        try:    # new files only ("x"): never over a file, never through a link
            for ext in ("ttir", "ttgir", "ptx"):
                with open(f"{stem}.{ext}", "x") as f:
                    f.write(k.asm[ext])
            with open(f"{stem}.cubin", "xb") as f:
                f.write(k.asm["cubin"])
        except FileExistsError as exc:
            print(f"kernel_asm: {exc.filename} exists; not replacing it (give another --out, "
                  "or remove the earlier dump)", file=sys.stderr)
            return 2
        st = next(iter(cubin_stats(k.asm["cubin"]).values()), {})
        const = {n: v for n, v in L.kwargs.items() if not hasattr(v, "data_ptr")}
        print(f"#{i} grid {L.grid} {const}")
        sass = st.get("sass") or {}
        print(f"   registers {st.get('regs')}, spill {spill_bytes(st)} B (stack "
              f"{st.get('stack', 0)} B, {sass.get('stl', 0)} STL / {sass.get('ldl', 0)} LDL), "
              f"shared {getattr(k.metadata, 'shared', 0)} B, warps {k.metadata.num_warps}, "
              f"stages {k.metadata.num_stages}; {loop_summary(k.asm['ttgir'])}; {stem}.*")
        dots = {n: c for n, c in _ttir_dots(k.asm["ttir"]).items() if c}
        print(f"   dots {dots or 'none'}" + ("  <- float32 TF32 dot (see _common._bcast_mm)"
                                           if dots.get("dot_tf32") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
