"""benchmarks/gpu_suite.sh, the script a lent GPU runs (often once per session, with no second
try): its stage loop, its packing of the results into the device tool's $OUT, and which
committed prediction RESULTS.md is set against — run here on the CPU with the stage that
needs no GPU (``results``, on the committed H100 run's benchmark JSON)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "gpu_suite.sh"
PROOF = ROOT / "benchmarks" / "results" / "h100" / "proof-2026-11-27" / "bench"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def test_script_parses():
    res = subprocess.run(["bash", "-n", str(SUITE)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def _run(tmp_path, stages, gpu_name=None, tools=None, env_extra=None):
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "bench").mkdir(parents=True)
    out.mkdir()
    for f in PROOF.glob("*.json"):
        shutil.copy(f, work / "bench" / f.name)
    # the script's python3 is this interpreter (the one with kfused and its dependencies)
    path = f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ.get('PATH', '')}"
    env = dict(os.environ, WORK=str(work), OUT=str(out), CALL_LIMIT_S="300", PATH=path)
    tools = dict(tools or {})
    if gpu_name is not None:   # an nvidia-smi that names this GPU (on any machine)
        tools["nvidia-smi"] = f"#!/bin/sh\necho '{gpu_name}'\n"
    if tools:                  # stand-ins for the GPU machine's tools, first on the PATH
        bindir = tmp_path / "bin"
        bindir.mkdir()
        for name, script in tools.items():
            (bindir / name).write_text(script)
            (bindir / name).chmod(0o755)
        env["PATH"] = f"{bindir}{os.pathsep}{env['PATH']}"
    env.update(env_extra or {})
    res = subprocess.run(["bash", str(SUITE), stages], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    return res, work, out


@pytest.mark.parametrize("gpu,prediction", [("NVIDIA H100 80GB HBM3", "perf-latest.json"),
                                            ("NVIDIA H200", "perf-h200.json")])
def test_results_stage_packs_results_md_against_this_gpus_prediction(tmp_path, gpu,
                                                                     prediction):
    # the proof stage set an H200's measurements against the H100 prediction (perf-latest)
    # while the results stage chose perf-h200: both now ask predicted_json
    if not (PROOF.is_dir() and any(PROOF.glob("*.json"))):
        pytest.skip("the committed H100 run's JSON is not in this checkout")
    res, work, out = _run(tmp_path, "results", gpu)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    names = sorted(p.name for p in out.iterdir())
    assert {"RESULTS.md", "summary.txt", "results.tar.gz"} <= set(names), names
    assert len(names) <= 8          # the device tool brings back at most 8 files
    text = (out / "RESULTS.md").read_text()
    assert f"benchmarks/results/predicted/{prediction}" in text
    assert "stage results: status so far 0" in (out / "summary.txt").read_text()


def test_an_unknown_stage_fails_and_still_packs(tmp_path):
    res, work, out = _run(tmp_path, "no-such-stage")
    assert res.returncode == 2
    assert "unknown stage no-such-stage" in res.stdout
    assert (out / "summary.txt").is_file() and (out / "results.tar.gz").is_file()


# compute-sanitizer stand-ins: run the command they are given (from its python3 on) and say
# what memcheck would
_SANITIZER_RUNS = """#!/bin/sh
echo "$PYTORCH_NO_CUDA_MEMORY_CACHING $*" > "$SAN_SEEN"
while [ "$1" != python3 ]; do shift; done
"$@"
rc=$?
echo '========= ERROR SUMMARY: 0 errors'
exit $rc
"""
_SANITIZER_FINDS = """#!/bin/sh
echo '========= Invalid __global__ write of size 4 bytes'
echo '=========     at kron_matvec_kernel+0x1f0'
echo '========= ERROR SUMMARY: 1 error'
exit 86
"""
_SANITIZER_REFUSED = """#!/bin/sh
echo '========= Device not supported'
exit 255
"""


def test_sanitize_stage_runs_the_tests_under_memcheck_without_the_caching_allocator(tmp_path):
    t = tmp_path / "test_tiny.py"
    t.write_text("def test_ok():\n    pass\n")
    seen = tmp_path / "seen.txt"
    res, work, out = _run(tmp_path, "sanitize", tools={"compute-sanitizer": _SANITIZER_RUNS},
                          env_extra={"SANITIZE_TESTS": str(t), "SAN_SEEN": str(seen)})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    args = seen.read_text()
    assert args.startswith("1 ") and "--tool memcheck" in args and "--error-exitcode 86" in args
    summary = (out / "summary.txt").read_text()
    assert "sanitize: rc=0" in summary and "ERROR SUMMARY: 0 errors" in summary, summary
    assert "1 passed" in (work / "sanitize.log").read_text()


def test_sanitize_stage_fails_on_a_memcheck_error(tmp_path):
    res, work, out = _run(tmp_path, "sanitize", tools={"compute-sanitizer": _SANITIZER_FINDS})
    assert res.returncode == 1
    assert "sanitize: rc=86" in (out / "summary.txt").read_text()
    assert "Invalid __global__ write of size 4 bytes" in res.stdout


def test_sanitize_stage_says_when_the_machine_refuses_the_tool(tmp_path):
    res, work, out = _run(tmp_path, "sanitize", tools={"compute-sanitizer": _SANITIZER_REFUSED})
    assert res.returncode == 0
    assert "refused this machine's device" in (out / "summary.txt").read_text()


@pytest.mark.parametrize("family,op", [("krona", "krona"), ("headwise", "headwise"),
                                       ("inducer", "inducer"), ("e2e", "e2e"),
                                       ("onepass", "krona")])
def test_proof_skip_lists_name_providers_of_their_family(tmp_path, family, op):
    # `kfused bench e2e --skip eager` was refused on the H200 of 2026-11-30 (e2e has no eager
    # provider) and the proof lost its e2e family; kfused bench checks --skip before any case
    env = dict(os.environ, WORK=str(tmp_path / "work"), GPU_SUITE_PROOF_SKIP_OF=family)
    env.pop("PROOF_SKIP", None)
    res = subprocess.run(["bash", str(SUITE)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    skip = res.stdout.strip()
    cmd = [sys.executable, "-m", "kfused.cli.main", "bench", op, "--device", "cpu",
           "--time-limit", "1e-9", "--no-plot", "--out", str(tmp_path / "out")]
    if skip:
        cmd += ["--skip", skip]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert "argument --skip" not in run.stderr, run.stderr[-2000:]
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
