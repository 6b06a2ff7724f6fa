"""One structural compile run shared by the perf tests (cached for the pytest process).

It runs ``kfused perf --structure-only --arch 90 --no-csrc`` in a subprocess without
TRITON_INTERPRET (kernels must be compiled, not interpreted). Compiled statistics are cached
on disk (``$KFUSED_CACHE`` or ~/.cache/kfused/perf) keyed on kernel source, specialisation,
options and Triton version, so a warm run only traces the ops (~1 minute on 2 cores).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=None)
def structure_report():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "structure.json")
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "kfused.perf.report", "--structure-only",
                               "--arch", "90", "--no-csrc", "--jobs", "2", "--json", out],
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
        secs = time.perf_counter() - t0
        if proc.returncode not in (0, 1) or not os.path.exists(out):
            raise RuntimeError(f"kfused perf failed (exit {proc.returncode}):\n"
                               f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
        with open(out) as f:
            rep = json.load(f)
    rep["_seconds"] = secs
    rep["_stdout"] = proc.stdout[-4000:]
    return rep
