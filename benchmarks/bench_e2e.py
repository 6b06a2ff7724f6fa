"""End-to-end benchmark entry script (one training step per adapter method); the cases live in
:mod:`kfused.cases.e2e`.

    python benchmarks/bench_e2e.py [--quick] [--out benchmarks/results/local]

writes ``e2e_<device>.json`` (``e2e_<device>-2.json``, ... when that name is taken: never over a
file), prints one table and draws the ``.png`` beside it.
"""

import argparse
import os
import sys

import torch

from kfused._files import folder_refusal
from kfused.cases.e2e import run
from kfused.cli.args import device, positive_float


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", type=device, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--quick", action="store_true",
                   help="2-layer models, seq 128, batch 2 (on a CPU: d 64, seq 64, float32)")
    p.add_argument("--rep-ms", type=positive_float, default=2000.0)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "results", "local"))
    a = p.parse_args(argv)
    unusable = folder_refusal(a.out)  # before the measurements, not after them
    if unusable:
        p.error(f"argument --out: {unusable}")
    rows = run(a.device, getattr(torch, a.dtype), a.quick, a.out, a.rep_ms)
    return 1 if any("error" in r for r in rows) else 0  # a provider failed (its row says how)


if __name__ == "__main__":
    sys.exit(main())
