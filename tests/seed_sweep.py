"""Run test files under N consecutive KFUSED_TEST_SEED values and report every failure.

Not collected by pytest (no ``test_`` prefix). docs/math.md §4: "a test of this rule never flakes: every
kernel test file passes 20 consecutive random seeds". Each seed is one pytest process::

    python3 tests/seed_sweep.py --seeds 20 tests/test_krona.py tests/test_inducer.py
    python3 tests/seed_sweep.py --start 100 --seeds 3 -k float32 tests/test_headwise_ops.py

Exit status 0 when every seed passed, 1 otherwise; the failing test ids are listed per seed
with the command that replays them.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_seed(seed: int, files, extra) -> tuple:
    env = dict(os.environ, KFUSED_TEST_SEED=str(seed))
    env.setdefault("PYTHONPATH", ROOT)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *extra,
           *files]
    t0 = time.time()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    out = r.stdout + r.stderr
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, flags=re.M)
    summary = next((ln for ln in reversed(out.splitlines()) if re.search(
        r"\d+ (passed|failed|error)", ln)), out.strip().splitlines()[-1] if out.strip() else "")
    return r.returncode, failed, summary.strip("= "), time.time() - t0, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="test files (or node ids)")
    ap.add_argument("--seeds", type=int, default=20, help="how many consecutive seeds (20)")
    ap.add_argument("--start", type=int, default=0, help="first seed (0)")
    ap.add_argument("-k", default=None, help="pytest -k expression")
    ap.add_argument("-x", action="store_true", help="stop at the first failing seed")
    ap.add_argument("--log", default=None, help="write each failing seed's pytest output here")
    args = ap.parse_args(argv)
    extra = ["-k", args.k] if args.k else []
    bad = []
    for seed in range(args.start, args.start + args.seeds):
        rc, failed, summary, dt, out = run_seed(seed, args.files, extra)
        ok = rc == 0
        print(f"seed {seed:>6}: {'ok  ' if ok else 'FAIL'} {dt:7.1f}s  {summary}", flush=True)
        if not ok:
            bad.append((seed, rc, failed))
            for f in failed:
                print(f"    {f}\n      replay: KFUSED_TEST_SEED={seed} python3 -m pytest '{f}'")
            if args.log:
                with open(args.log, "a") as fh:
                    fh.write(f"\n===== seed {seed} (rc {rc}) =====\n{out}")
            if args.x:
                break
    n = seed - args.start + 1
    print(f"{n - len(bad)}/{n} seeds passed" + (f"; failing seeds: {[b[0] for b in bad]}"
                                                if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
