"""Compile every Triton kernel for a GPU target on a machine without a GPU.

Each op family's "representative launches" (odd head widths, masks, prefix, float32: compile
coverage beyond the benchmark shapes) are ``aot_launches()`` in :mod:`kfused.cases`. The compiling
itself — recording launches, specialising exactly as Triton's JIT does (integers equal to 1
as constexprs, 16-divisibility), ptxas, cubin statistics, the on-disk cache — lives in
:mod:`kfused.perf.compile`; ``kfused perf`` is the one entry point:

    python -m kfused.cli.main perf --structure-only --arch 90      # compile check
    python -m kfused.triton_kernels._aot [--arch 90] [--jobs 2] [ops...]   # same, this file

Must run without TRITON_INTERPRET (kernels must be JITFunctions). Exit status 1 if any launch
fails to compile.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List

from kfused.backends import triton_interpret

def main(argv=None) -> int:
    if triton_interpret():
        print("run without TRITON_INTERPRET: the kernels must be compiled, not interpreted",
              file=sys.stderr)
        return 2
    from kfused.perf.compile import compile_many, constexpr_summary, jit_spec, spec_key
    from kfused.perf.report import representative_launches

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ops", nargs="*")
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    args = p.parse_args(argv)
    items: List[tuple] = []
    seen = set()
    for op, launches in representative_launches(args.ops or None):
        for L in launches:
            spec = jit_spec(L.fn, L.args, L.kwargs, args.arch)
            k = (L.name, spec_key(L.fn, spec, args.arch))
            if k not in seen:
                seen.add(k)
                items.append((op, L, spec))
    print(f"compiling {len(items)} distinct launches for sm_{args.arch} ...", flush=True)
    res = compile_many([(L.fn, spec, args.arch) for _, L, spec in items], jobs=args.jobs)
    failures = 0
    for (op, L, spec), (info, err) in zip(items, res):
        desc = f"{L.name} {constexpr_summary(L.fn, spec)}"
        if err:
            failures += 1
            print(f"FAIL {op}: {desc}\n     {err}")
        else:
            print(f"ok   {op}: {desc}\n     regs={info['regs']} spill={info['spill_bytes']} "
                  f"shared={info['shared_bytes']}B ctas/SM={info['ctas_per_sm']}")
    print(f"{len(items) - failures} compiled, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
