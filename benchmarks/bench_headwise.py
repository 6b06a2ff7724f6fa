"""Benchmark entry script for the fused attention-input projection with per-head updates; the
cases and the roofline model live in :mod:`kfused.cases.headwise`.

    python benchmarks/bench_headwise.py [--quick] [--dtype float16]   # prints the rows
    python benchmarks/bench_headwise.py --roofline   # PREDICTED fwd+bwd table (no GPU needed)

`kfused bench headwise` is the full run that writes benchmarks/results/.
"""

import argparse
import json

import torch

from kfused.bench import measure
from kfused.cases.headwise import bench_cases, roofline_table


def main() -> None:  # pragma: no cover
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rep-ms", type=float, default=100)
    ap.add_argument("--roofline", action="store_true",
                    help="print the predicted roofline table (no GPU needed) and exit")
    args = ap.parse_args()
    if args.roofline:
        print(roofline_table())
        return
    dtype = getattr(torch, args.dtype)
    for case in bench_cases(args.device, dtype, args.quick):
        for row in measure(case, args.device, rep_ms=args.rep_ms):
            print(json.dumps(row))


if __name__ == "__main__":  # pragma: no cover
    main()
