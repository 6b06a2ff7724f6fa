"""Compile check for the CUDA C++ sources (csrc/): every .cu and .cpp must compile.

Runs on CPU-only CI: it needs nvcc (skipped with the reason when there is none) and torch's
headers, not a GPU. .cu files go through ``nvcc -c -std=c++17 -arch=sm_90 -x cu``; .cpp files
(the pybind11 bindings) through the host C++ compiler, which is what setup.py uses for them and
is about 2.5x faster than nvcc on torch/extension.h. Files compile two at a time; the whole
check takes about a minute on 2 cores. Nothing is linked or run.
"""

from __future__ import annotations

import concurrent.futures
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
SOURCES = sorted(glob.glob(os.path.join(CSRC, "**", "*.cu"), recursive=True)
                 + glob.glob(os.path.join(CSRC, "**", "*.cpp"), recursive=True))
TIMEOUT_S = 300


def _find_nvcc():
    for env in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(env)
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    if os.path.isfile("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda/bin/nvcc"
    return None


def _cuda_include(nvcc):
    # nvcc may be a wrapper script (e.g. /usr/local/bin/nvcc), so look in several places.
    candidates = [os.path.join(os.environ[e], "include")
                  for e in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(e)]
    candidates.append(os.path.join(os.path.dirname(os.path.realpath(nvcc)), "..", "include"))
    candidates.append("/usr/local/cuda/include")
    for c in candidates:
        if os.path.isfile(os.path.join(c, "cuda_runtime.h")):
            return os.path.normpath(c)
    return None


def _include_flags(nvcc):
    from torch.utils.cpp_extension import include_paths

    incs = [CSRC] + list(include_paths())
    try:
        import pybind11

        incs.append(pybind11.get_include())
    except ImportError:  # torch ships its own copy of the pybind11 headers
        pass
    incs.append(sysconfig.get_paths()["include"])
    cuda_inc = _cuda_include(nvcc)
    if cuda_inc:
        incs.append(cuda_inc)
    return [f"-I{i}" for i in incs]


def _nvcc_torch_flags():
    # The flags torch's BuildExtension gives nvcc (no implicit __half conversions, ...), so the
    # check sees the same code paths as the real build.
    try:
        from torch.utils.cpp_extension import COMMON_NVCC_FLAGS
    except ImportError:
        return ["--expt-relaxed-constexpr"]
    return list(COMMON_NVCC_FLAGS)


def _command(src, nvcc, host_cxx, flags, out):
    defines = ["-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    if src.endswith(".cu") or host_cxx is None:
        # 3306: torch's headers use a C++20 bit-field initializer; harmless under -std=c++17.
        return [nvcc, "-c", "-std=c++17", "-arch=sm_90", "-x", "cu", *_nvcc_torch_flags(),
                "-Xcudafe", "--diag_suppress=3306", *defines, *flags, src, "-o", out]
    return [host_cxx, "-c", "-std=c++17", "-fPIC", "-Wno-c++20-extensions", *defines, *flags,
            src, "-o", out]


def _compile_one(cmd):
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
        rc, err = res.returncode, res.stderr + res.stdout
    except subprocess.TimeoutExpired:
        rc, err = -1, f"timed out after {TIMEOUT_S} s"
    return rc, err, time.perf_counter() - t0


@pytest.fixture(scope="module")
def compiled():
    nvcc = _find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (set CUDA_HOME or put nvcc on PATH): csrc/ compile check skipped")
    pytest.importorskip("torch")
    host_cxx = shutil.which("c++") or shutil.which("g++")
    flags = _include_flags(nvcc)
    results = {}
    with tempfile.TemporaryDirectory(prefix="kfused_csrc_") as tmp:
        cmds = {}
        for i, src in enumerate(SOURCES):
            out = os.path.join(tmp, f"{i}_{os.path.basename(src)}.o")
            cmds[src] = _command(src, nvcc, host_cxx, flags, out)
        # Longest first: .cpp (torch/extension.h) and the biggest .cu files.
        order = sorted(cmds, key=lambda s: (not s.endswith(".cpp"), -os.path.getsize(s)))
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            futs = {src: pool.submit(_compile_one, cmds[src]) for src in order}
            for src, fut in futs.items():
                results[src] = (cmds[src],) + fut.result()
        total = time.perf_counter() - t0
    lines = [f"  {os.path.relpath(s, ROOT)}: {r[3]:.1f} s" for s, r in results.items()]
    print(f"\ncsrc compile check: {len(results)} files in {total:.1f} s (2 in parallel)\n"
          + "\n".join(lines), file=sys.stderr)
    return results


def test_sources_exist():
    assert any(s.endswith(".cu") for s in SOURCES), f"no .cu files under {CSRC}"
    assert os.path.join(CSRC, "bindings.cpp") in SOURCES


@pytest.mark.parametrize("src", SOURCES, ids=[os.path.relpath(s, CSRC) for s in SOURCES])
def test_compiles(compiled, src):
    cmd, rc, err, secs = compiled[src]
    if rc != 0:
        pytest.fail(f"{os.path.relpath(src, ROOT)} failed to compile (exit {rc}, {secs:.1f} s)\n"
                    f"command: {' '.join(cmd)}\n{err}", pytrace=False)
