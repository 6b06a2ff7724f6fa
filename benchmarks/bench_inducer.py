"""Inducer attention benchmark entry script; the cases live in :mod:`kfused.cases.inducer`.

    python benchmarks/bench_inducer.py [--quick]   # one JSON row per case, provider and mode

`kfused bench inducer` is the full run that writes benchmarks/results/.
"""

import json
import sys

import torch

from kfused.bench import measure
from kfused.cases.inducer import bench_cases

if __name__ == "__main__":  # pragma: no cover - manual run
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    for case in bench_cases(dev, dt, quick="--quick" in sys.argv):
        for row in measure(case, dev):
            print(json.dumps(row))
