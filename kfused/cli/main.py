"""The `kfused` command: demo (the main job), bench, check, info, perf, results."""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

USAGE = """usage: kfused <command> [options]

commands:
  demo    the main job: adapt the shipped pretrained base with LoRA and each kfused method,
          score generations (BLEU, slot accuracy); fused vs reference on a GPU
  bench   benchmark every op against its baselines; JSON + PNG into benchmarks/results/local
  check   every available kernel on this device against the float64 reference (docs/math.md §4)
  info    versions, device and which backends can run
  perf    compile every kernel launch (sm_90/sm_80), SASS stats, PREDICTED H100 roofline
  results a GPU run's bench JSON against the issues' targets (measured vs predicted): RESULTS.md

`kfused <command> --help` for the options of each."""


def _ensure_interpreter_on_cpu(argv: List[str]) -> None:
    """On a machine without CUDA, kernels can only run in Triton's interpreter, which must be
    switched on before any kernel is defined: re-run this process with TRITON_INTERPRET=1."""
    if "TRITON_INTERPRET" in os.environ:
        return
    import torch

    if torch.cuda.is_available():
        return
    os.environ["TRITON_INTERPRET"] = "1"
    os.execv(sys.executable, [sys.executable, "-m", "kfused.cli.main", *argv])


def _interpreter_caches() -> None:
    """Under Triton's CPU interpreter, the caches of kfused/triton_kernels/_interp_speed.py:
    the same results in less time (``KFUSED_INTERP_SPEED=0`` leaves them off). Only in this
    command's own process; importing kfused changes nothing in Triton."""
    from kfused import backends

    if backends.triton_interpret():
        from kfused.triton_kernels import _interp_speed

        _interp_speed.install_unless_disabled()


def info_parser() -> argparse.ArgumentParser:
    """``kfused info`` takes no options (only ``--help``)."""
    return argparse.ArgumentParser(
        prog="kfused info",
        description="Print the versions of kfused, torch and triton, the device, and which "
                    "backends (triton, cuda, reference) can run each dtype here, with the "
                    "reason for each one that cannot.")


def _info() -> int:
    import torch

    import kfused
    from kfused import backends

    print(f"kfused {kfused.__version__}, torch {torch.__version__}")
    try:
        import triton

        print(f"triton {triton.__version__}")
    except Exception as exc:
        print(f"triton: not importable ({exc})")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cuda":
        print(f"device: {torch.cuda.get_device_name()} (CUDA {torch.version.cuda})")
    else:
        print(f"device: cpu (TRITON_INTERPRET={int(backends.triton_interpret())})")
    reasons: List[str] = []  # each distinct reason printed once, as a numbered note

    def why(reason: str) -> str:
        if reason not in reasons:
            reasons.append(reason)
        return f"no [{reasons.index(reason) + 1}]"

    for dt in (torch.float32, torch.float16, torch.bfloat16):
        status = kfused.available_backends("kron_matvec", device=dev, dtype=dt)
        print(f"  {str(dt).replace('torch.', ''):<9} " + ", ".join(
            f"{k}: {'yes' if v is None else why(v)}" for k, v in status.items()))
    for i, reason in enumerate(reasons, 1):
        print(f"  [{i}] {reason}")
    try:
        print(f"default backend: {backends.default_backend()} ({backends.ENV_VAR})")
    except backends.BackendError as exc:   # reported, not raised: every op call will raise it
        print(f"default backend: {exc}; every kfused op called without backend= will raise "
              "this")
    _info_measured(dev)
    return 0


def _info_measured(dev: str) -> None:
    """Which measured choices apply here: the backend preferences and the kernel tuning table
    (their files, and how many entries they hold for this GPU model)."""
    import torch

    from kfused import backends, tuning

    name = torch.cuda.get_device_name() if dev == "cuda" else None
    for what, path, load, key in (
            ("backend preferences", backends.prefs_path(), backends.load_prefs, "devices"),
            ("kernel tuning table", tuning.table_path(), tuning.load, "devices")):
        if path is None:
            print(f"{what}: none (the defaults)")
            continue
        try:
            data = load(path)
            mine = data[key].get(name, {}) if name else {}
        except Exception as exc:   # a broken file is reported, not raised, by info
            print(f"{what}: {path}: {exc}")
            continue
        n = sum(len(v) for v in mine.values())
        print(f"{what}: {path} ({n} entr{'y' if n == 1 else 'ies'} for "
              f"{name or 'this CPU: none apply'})")


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "check":
        from kfused.cli import check

        check.parse_args(rest)  # usage errors (and --help) before re-running in the interpreter
        _ensure_interpreter_on_cpu(argv)
        _interpreter_caches()
        return check.run(rest)
    if cmd == "bench":
        from kfused.cli import bench

        _interpreter_caches()
        return bench.run(rest)
    if cmd == "demo":
        from kfused.cli.demo import run_demo

        _interpreter_caches()
        return run_demo(rest)
    if cmd == "info":
        info_parser().parse_args(rest)
        return _info()
    if cmd == "perf":
        from kfused.perf import report

        return report.run(rest)
    if cmd == "results":
        from kfused.cli import results

        return results.run(rest)
    print(f"kfused: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
