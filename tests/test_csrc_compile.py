"""Compile check for the CUDA C++ sources (csrc/): every .cu and .cpp must compile.

Runs on CPU-only CI: it needs nvcc (skipped with the reason when there is none) and torch's
headers, not a GPU. .cu files go through ``nvcc -c -std=c++17 -arch=sm_90 -x cu``; .cpp files
(the pybind11 bindings) through the host C++ compiler, which is what setup.py uses for them and
is about 2.5x faster than nvcc on torch/extension.h. Files compile two at a time; the whole
check takes about a minute on 2 idle cores. The objects are then linked into a throwaway
``_C`` module against the CPU torch libraries and cudart, imported in a subprocess, and every
binding is called once with CPU tensors (each must raise its "must be a CUDA tensor" check):
this catches missing definitions and binding/signature mistakes without a GPU.
"""

from __future__ import annotations

import concurrent.futures
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import time

import pytest

from kfused.perf.compile import find_nvcc

# pytest-xdist (the README's test command): test_csrc_sass disassembles the objects this
# file's fixture compiled (DEVICE_OBJECTS), so both files run on one worker
pytestmark = pytest.mark.xdist_group("csrc")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
SOURCES = sorted(glob.glob(os.path.join(CSRC, "**", "*.cu"), recursive=True)
                 + glob.glob(os.path.join(CSRC, "**", "*.cpp"), recursive=True))
TIMEOUT_S = 900  # per compile; a loaded shared 2-core machine is several times slower than idle

# src -> (returncode, compiler output with ptxas's -v report, object path) of every .cu file the
# ``compiled`` fixture built in this session: test_csrc_sass disassembles these objects instead
# of compiling the device code a second time (about a minute of CI).
DEVICE_OBJECTS = {}


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
        # -Xptxas -v: the register / spill report test_csrc_sass reads (see DEVICE_OBJECTS)
        return [nvcc, "-c", "-std=c++17", "-arch=sm_90", "-x", "cu", "-Xcompiler", "-fPIC",
                *_nvcc_torch_flags(), "-Xptxas", "-v",
                "-Xcudafe", "--diag_suppress=3306", *defines, *flags, src, "-o", out]
    # the arch list setup.py gives the bindings (this check builds sm_90 only)
    return [host_cxx, "-c", "-std=c++17", "-fPIC", "-Wno-c++20-extensions", *defines,
            "-DKFUSED_CUDA_ARCH_LIST=90", *flags, src, "-o", out]


def _compile_one(cmd):
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
        rc, err = res.returncode, res.stderr + res.stdout
    except subprocess.TimeoutExpired:
        rc, err = -1, f"timed out after {TIMEOUT_S} s"
    return rc, err, time.perf_counter() - t0


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (set CUDA_HOME or put nvcc on PATH): "
                    "csrc/ compile check skipped")
    host_cxx = shutil.which("c++") or shutil.which("g++")
    flags = _include_flags(nvcc)
    tmp = str(tmp_path_factory.mktemp("kfused_csrc"))
    cmds = {}
    for i, src in enumerate(SOURCES):
        out = os.path.join(tmp, f"{i}_{os.path.basename(src)}.o")
        cmds[src] = _command(src, nvcc, host_cxx, flags, out)
    # Longest first: the biggest .cu files (most kernel instantiations), then the .cpp files.
    order = sorted(cmds, key=lambda s: (not s.endswith(".cu"), -os.path.getsize(s)))
    results = {}
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futs = {src: pool.submit(_compile_one, cmds[src]) for src in order}
        for src, fut in futs.items():
            # (command, returncode, output, seconds, object path)
            results[src] = (cmds[src],) + fut.result() + (cmds[src][-1],)
            if src.endswith(".cu"):
                DEVICE_OBJECTS[src] = (results[src][1], results[src][2], cmds[src][-1])
    total = time.perf_counter() - t0
    lines = [f"  {os.path.relpath(s, ROOT)}: {r[3]:.1f} s" for s, r in results.items()]
    print(f"\ncsrc compile check: {len(results)} files in {total:.1f} s (2 in parallel)\n"
          + "\n".join(lines), file=sys.stderr)
    results["__nvcc__"] = nvcc
    results["__tmp__"] = tmp
    return results


def test_sources_exist():
    assert any(s.endswith(".cu") for s in SOURCES), f"no .cu files under {CSRC}"
    assert os.path.join(CSRC, "bindings.cpp") in SOURCES


@pytest.mark.parametrize("src", SOURCES, ids=[os.path.relpath(s, CSRC) for s in SOURCES])
def test_compiles(compiled, src):
    cmd, rc, err, secs, _ = compiled[src]
    if rc != 0:
        pytest.fail(f"{os.path.relpath(src, ROOT)} failed to compile (exit {rc}, {secs:.1f} s)\n"
                    f"command: {' '.join(cmd)}\n{err}", pytrace=False)


_IMPORT_CHECK = r"""
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("_C", sys.argv[1])
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
names = sorted(n for n in dir(m) if n.endswith(("_fwd", "_bwd")))
assert m.USES_TORCH_CURRENT_STREAM in (True, False)
assert m.CUDA_ARCHS == (90,), m.CUDA_ARCHS
assert names == ["headwise_lowrank_bwd", "headwise_lowrank_fwd", "inducer_attention_fwd",
                 "kron_matvec_bwd", "kron_matvec_fwd", "krona_fold_fwd"], names
r = torch.randn
calls = {
    "kron_matvec_fwd": lambda: m.kron_matvec_fwd(r(4, 6), r(2, 3), r(2, 2)),
    "kron_matvec_bwd": lambda: m.kron_matvec_bwd(r(4, 4), r(4, 6), r(2, 3), r(2, 2)),
    "kron_matvec_bwd(need_dx=False, scale)": lambda: m.kron_matvec_bwd(
        r(4, 4), r(4, 6), r(2, 3), r(2, 2), need_dx=False, scale=0.5),
    "krona_fold_fwd": lambda: m.krona_fold_fwd(r(4, 6), r(2, 3), r(2, 2), 0.5),
    "headwise_lowrank_fwd": lambda: m.headwise_lowrank_fwd(r(3, 8), r(2, 1, 8), r(2, 4, 1)),
    "headwise_lowrank_fwd(save_u)": lambda: m.headwise_lowrank_fwd(
        r(3, 8), r(2, 1, 8), r(2, 4, 1), None, save_u=True),
    "headwise_lowrank_bwd": lambda: m.headwise_lowrank_bwd(r(3, 2, 4), r(3, 8), r(2, 1, 8),
                                                           r(2, 4, 1), True),
    "headwise_lowrank_bwd(U)": lambda: m.headwise_lowrank_bwd(
        r(3, 2, 4), r(3, 8), r(2, 1, 8), r(2, 4, 1), True, U=r(3, 2, 8)),
    "inducer_attention_fwd": lambda: m.inducer_attention_fwd(
        r(1, 2, 3, 32), r(1, 2, 5, 32), r(1, 2, 5, 32), r(1, 2, 3), causal=True),
}
for name, call in calls.items():
    try:
        call()
    except RuntimeError as e:
        assert "must be a CUDA tensor" in str(e), (name, str(e))
    else:
        raise AssertionError(name + " accepted CPU tensors")
print("ok")
"""


def test_links_and_imports(compiled):
    """Link the objects against the CPU torch + cudart and exercise the bindings' checks."""
    objs = [compiled[s][4] for s in SOURCES]
    if any(compiled[s][1] != 0 for s in SOURCES):
        pytest.skip("some source failed to compile (reported by test_compiles)")
    host_cxx = shutil.which("c++") or shutil.which("g++")
    if host_cxx is None:
        pytest.skip("no host C++ compiler to link with")
    import torch

    nvcc = compiled["__nvcc__"]
    cuda_inc = _cuda_include(nvcc)
    libdirs = [os.path.join(os.path.dirname(cuda_inc), d) for d in ("lib64", "lib")] \
        if cuda_inc else []
    libdirs = [d for d in libdirs if glob.glob(os.path.join(d, "libcudart.so*"))]
    if not libdirs:
        pytest.skip("libcudart.so not found next to the CUDA headers")
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    so = os.path.join(compiled["__tmp__"], "_C.so")
    cmd = [host_cxx, "-shared", "-o", so, *objs, f"-L{torch_lib}", "-lc10", "-ltorch",
           "-ltorch_cpu", "-ltorch_python", f"-L{libdirs[0]}", "-lcudart",
           f"-Wl,-rpath,{torch_lib}", f"-Wl,-rpath,{libdirs[0]}"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert res.returncode == 0, f"link failed: {' '.join(cmd)}\n{res.stderr}"
    res = subprocess.run([sys.executable, "-c", _IMPORT_CHECK, so], capture_output=True,
                         text=True, timeout=TIMEOUT_S)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr


def test_compiled_structure_ratchet(compiled):
    """Structure of the sm_90 code in the objects (kfused/perf/known_violations.json ratchet):
    no spill, and HMMA/HGMMA in every GEMM-shaped kernel (kron, headwise, inducer). A new or
    worse violation fails; a listed one that disappeared fails too (delete its entry, or run
    `python -m kfused.cli.main perf --update-known`)."""
    from kfused.perf import report as R
    from kfused.perf.compile import csrc_object_stats

    files = {}
    for src in SOURCES:
        if not src.endswith(".cu"):
            continue
        if compiled[src][1] != 0:
            pytest.skip("some source failed to compile (reported by test_compiles)")
        files[os.path.relpath(src, CSRC)] = {90: csrc_object_stats(compiled[src][4], 90)}
    n_kernels = sum(len(v[90]) for v in files.values())
    assert n_kernels > 0, "no kernels found in the compiled objects"
    found = R.csrc_violations({"files": files})
    known = [k for k in R.load_known() if k["where"].startswith("csrc/")]
    bad, gone = R.compare_known(found, known)
    assert not bad and not gone, "\n".join(bad + gone)
