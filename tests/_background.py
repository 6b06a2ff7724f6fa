"""The kernel test files under the GPU's block sizes (tests/test_gpu_configs.py), run in the
background from the moment they are collected.

Each file is its own pytest process (the switch must be set before the kernels load), about
13 minutes in all on 2 cores — run in the test itself, the main pytest process waited for
them with the second core idle. conftest.py starts them here (:func:`start`), one after the
other in one background thread, so they run beside the interpreter tests; each test then
waits for its file's result (:func:`result`) and asserts on it as before. A file whose run
was not started here (the test selected some other way, a different seed) runs in the test.
The README's command runs two pytest-xdist workers: there nothing starts here, and a worker
runs each file in its test while the other goes on with the rest.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import threading

from tests._perf_helpers import _kill, exit_with_parent

HERE = pathlib.Path(__file__).resolve().parent
TIMEOUT_S = 1200            # one file's run, as the test allowed before

_jobs = {}                  # file name -> {"seed", "done": Event, "proc", "result": (rc, out)}
_stopping = threading.Event()


# Left out of these runs: torch.library.opcheck (the op's schema, fake and autograd
# registrations, AOT dispatch against eager) and torch.compile tests, which check how the ops
# are registered and traced, not the kernels' launch configurations: the main run covers them
# (about 2 CPU minutes of these runs)
_DESELECT = "not opcheck and not compile"


def _command(name: str):
    return exit_with_parent("pytest", ["-x", "-p", "no:cacheprovider", "-k", _DESELECT,
                                       str(HERE / name)])


def _env(seed: int) -> dict:
    # one intra-op thread: the run shares the 2 cores with the main session, where a pool of
    # two waits at every parallel region for a thread that has no core
    env = dict(os.environ, KFUSED_GPU_CONFIGS="1", TRITON_INTERPRET="1",
               KFUSED_TEST_SEED=str(seed))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run(name: str, seed: int, job: dict = None):
    """One file's run: (returncode, output); -9 and what was printed when it timed out."""
    proc = subprocess.Popen(_command(name), cwd=HERE.parent, env=_env(seed),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)   # its own group: _kill ends it whole
    if job is not None:
        job["proc"] = proc
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _kill(proc)
        out, _ = proc.communicate()
        out += f"\n[kfused tests] timed out after {TIMEOUT_S} s"
    return proc.returncode, out


def _drive(order):
    for name in order:
        job = _jobs[name]
        if not _stopping.is_set():
            job["result"] = _run(name, job["seed"], job)
        job["done"].set()


def start(runs) -> None:
    """Start ``runs`` ((file name, seed) pairs) one after another in a background thread
    (once per process)."""
    if _jobs or not runs:
        return
    for name, seed in runs:
        _jobs[name] = {"seed": seed, "done": threading.Event()}
    threading.Thread(target=_drive, args=([n for n, _ in runs],), daemon=True,
                     name="kfused-gpu-configs").start()


def result(name: str, seed: int):
    """(returncode, output) of ``name``'s run with ``seed``: the background one when it was
    started with this seed (waiting for it), else run now."""
    job = _jobs.get(name)
    if job is None or job["seed"] != seed:
        return _run(name, seed)
    job["done"].wait()
    if "result" not in job:          # the session is ending
        return _run(name, seed)
    return job["result"]


def running() -> bool:
    """Whether a background run is under way now."""
    return any(job.get("proc") is not None and job["proc"].poll() is None
               for job in _jobs.values())


def stop() -> None:
    """At the session's end: end a run nobody waited for."""
    _stopping.set()
    for job in _jobs.values():
        proc = job.get("proc")
        if proc is not None and proc.poll() is None:
            _kill(proc)
