"""One structural compile run shared by the perf tests (cached for the pytest process).

It runs ``kfused perf --structure-only --arch 90 --no-csrc`` in a subprocess without
TRITON_INTERPRET (kernels must be compiled, not interpreted). Compiled statistics are cached
on disk (``$KFUSED_CACHE`` or ~/.cache/kfused/perf) keyed on kernel source, specialisation,
options and Triton version, so a warm run only traces the ops (about 10 s on 2 cores).

On a fresh machine (CI) the cache is cold and the run compiles about 350 kernels for sm_90
(about 9 minutes on 2 cores). Two things keep that off the suite's critical path:

* ``tests/perf_seed.json`` (``$KFUSED_CACHE_SEED`` of the run): the statistics of the last
  refresh's compiles, keyed as the cache is (kernel source, specialisation, options, Triton
  version), so only the launches whose kernel or specialisation changed since, or a Triton
  version other than the refresh's, are compiled. Refresh it after changing a kernel:
  ``python tests/_perf_helpers.py --refresh-seed`` (compiles only what the seed misses).
* conftest.py starts the run in the background as soon as the tests that need it are
  collected (:func:`start_structure_report`), so the compiles share the machine with the
  interpreter tests, which use one core, instead of running after them;
  :func:`structure_report` waits for it.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED = os.path.join(ROOT, "tests", "perf_seed.json")
TIMEOUT_S = 1800
STRUCTURE_ARGS = ["--structure-only", "--arch", "90", "--no-csrc", "--jobs", "2"]

_run = {}   # the background run: proc, tmp (TemporaryDirectory), out, log, t0


# Runs a module as __main__ (kfused.perf.report; pytest for tests/_background.py), and ends
# it with its workers (its process group) as soon as the pytest process that started it is
# gone: a session killed by a signal (a CI timeout, `kill`) runs no pytest_sessionfinish, and
# the background run would otherwise go on for minutes.
_EXIT_WITH_PARENT = """
import os, runpy, signal, sys, threading, time
parent = int(sys.argv.pop(1))
module = sys.argv.pop(1)
def watch():
    while os.getppid() == parent:
        time.sleep(0.5)
    os.killpg(0, signal.SIGKILL)
threading.Thread(target=watch, daemon=True).start()
sys.argv[0] = module
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def exit_with_parent(module: str, args) -> list:
    """The command that runs ``python -m module *args`` and ends with this process (start it
    with ``start_new_session=True``: the watchdog kills its own process group)."""
    return [sys.executable, "-c", _EXIT_WITH_PARENT, str(os.getpid()), module, *args]


def _env(cache: str = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env.setdefault("OMP_NUM_THREADS", "1")     # a background run beside the main session
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if os.path.exists(SEED):
        env["KFUSED_CACHE_SEED"] = SEED + (os.pathsep + env["KFUSED_CACHE_SEED"]
                                           if env.get("KFUSED_CACHE_SEED") else "")
    if cache:
        env["KFUSED_CACHE"] = cache
    return env


def start_structure_report() -> None:
    """Start the structural compile run in the background (once per process)."""
    if _run:
        return
    env = _env()
    tmp = tempfile.TemporaryDirectory()
    out = os.path.join(tmp.name, "structure.json")
    log = open(os.path.join(tmp.name, "structure.log"), "w+")
    proc = subprocess.Popen(exit_with_parent("kfused.perf.report",
                                             [*STRUCTURE_ARGS, "--json", out]),
                            stdout=log, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                            start_new_session=True)   # its own group: _kill ends the workers too
    _run.update(proc=proc, tmp=tmp, out=out, log=log, t0=time.perf_counter())


def _kill(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def structure_running() -> bool:
    """Whether the background structural compile run is under way now."""
    proc = _run.get("proc")
    return proc is not None and proc.poll() is None


def stop_structure_report() -> None:
    """At the session's end: end a run nobody waited for (a session stopped early) and remove
    its log and output."""
    proc = _run.get("proc")
    if proc is None:
        return
    if proc.poll() is None:
        _kill(proc)
    _run["log"].close()
    _run["tmp"].cleanup()


@functools.lru_cache(maxsize=None)
def structure_report():
    start_structure_report()
    proc = _run["proc"]
    try:
        proc.wait(timeout=max(1.0, TIMEOUT_S - (time.perf_counter() - _run["t0"])))
    except subprocess.TimeoutExpired:
        _kill(proc)
    secs = time.perf_counter() - _run["t0"]
    _run["log"].seek(0)
    output = _run["log"].read()
    out = _run["out"]
    if proc.returncode not in (0, 1) or not os.path.exists(out):
        raise RuntimeError(f"kfused perf failed (exit {proc.returncode}) after {secs:.0f} s:\n"
                           f"{output[-12000:]}")
    with open(out) as f:
        rep = json.load(f)
    rep["_seconds"] = secs
    rep["_stdout"] = output[-4000:]
    return rep


def refresh_seed() -> int:
    """Rewrite tests/perf_seed.json with the entries the structural run uses now: the run
    goes into an empty cache folder (seeded from the current file, so only what it misses
    compiles), and every entry it used is written back. Returns the entry count."""
    sys.path.insert(0, ROOT)
    with tempfile.TemporaryDirectory() as cache:
        out = os.path.join(cache, "structure.json")
        subprocess.run([sys.executable, "-m", "kfused.perf.report", *STRUCTURE_ARGS,
                        "--json", out], env=_env(cache), cwd=ROOT, check=False)
        if not os.path.exists(out):
            raise SystemExit("the structural run wrote no report; seed left as it was")
        os.environ["KFUSED_CACHE"] = cache
        from kfused.perf.compile import cache_dir, write_seed

        names = [n for n in os.listdir(cache_dir()) if n.endswith(".json")]
        return write_seed(SEED, names)


if __name__ == "__main__":
    if sys.argv[1:] != ["--refresh-seed"]:
        raise SystemExit("usage: python tests/_perf_helpers.py --refresh-seed")
    print(f"{SEED}: {refresh_seed()} entries")
