"""`kfused results`: the measured ratios of a GPU run against the issues' targets, as
RESULTS.md (see :mod:`kfused.results`).

    python -m kfused.cli.main results benchmarks/results/local/suite/bench \\
        --predicted benchmarks/results/local/suite/perf_predicted.json \\
        --out benchmarks/results/local/suite/RESULTS.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kfused results", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+",
                   help="JSON files written by `kfused bench`, or folders holding them")
    p.add_argument("--predicted", default=None, metavar="PERF_JSON",
                   help="`kfused perf --json` output for the same commit: its predicted ratio "
                        "and time beside each measured one")
    p.add_argument("--out", default=None, metavar="RESULTS_MD",
                   help="write the report here (a new file, or one `kfused results` wrote; "
                        "default: print it)")
    return p


def run(argv: Optional[List[str]] = None) -> int:
    from kfused import results

    p = build_parser()
    args = p.parse_args(argv)
    skipped: List[str] = []
    try:
        runs = results.load_runs(args.inputs, skipped)
    except (FileNotFoundError, ValueError) as exc:
        p.error(f"argument inputs: {exc}")
    if not runs:
        p.error("argument inputs: no `kfused bench` JSON (an object with 'meta' and 'rows') in "
                + ", ".join(args.inputs))
    pred = None
    if args.predicted:
        try:
            pred = results.load_predicted(args.predicted)
        except (OSError, ValueError) as exc:
            p.error(f"argument --predicted: {exc}")
    for why in skipped:
        print(f"kfused results: passed over {why}", file=sys.stderr)
    text = results.render(runs, pred, args.predicted, skipped)
    if args.out is None:
        print(text)
        return 0
    out = Path(args.out)
    from kfused._files import folder_refusal

    unusable = folder_refusal(out.parent if str(out.parent) else Path("."))
    if unusable:
        p.error(f"argument --out: {unusable}")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        results.write(out, text)
    except FileExistsError as exc:
        p.error(f"argument --out: {exc}")
    summary = next((ln for ln in text.splitlines() if ln.startswith("**")
                    and " not measured." in ln), "")
    print(f"wrote {out}: {summary.strip('*')}", file=sys.stderr)
    return 0
