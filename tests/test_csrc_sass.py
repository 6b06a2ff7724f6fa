"""Machine-code check of the CUDA C++ kernels (CPU CI, no GPU needed).

Every .cu file under csrc/ is compiled for sm_90 to a cubin (device code only, with
``-Xptxas -v``), disassembled with cuobjdump (the copy that ships with Triton when the toolkit
has none), and every GEMM-shaped kernel listed in ``TENSOR_CORE_KERNELS`` must contain

* tensor-core instructions (HMMA or HGMMA),
* 128-bit global loads (LDG.E.128 / LDG.E.128.CONSTANT, or the 16-byte cp.async LDGSTS...128),

and no kernel of the file may use local memory (ptxas "0 bytes spill stores, 0 bytes spill
loads" and no STL / LDL instruction in the SASS). A kernel name missing from the SASS fails too
(a renamed kernel must be renamed here).

When test_csrc_compile ran earlier in the same session (as in the full suite), its sm_90
objects — the same device code, built with the same flags and ``-Xptxas -v`` — are
disassembled instead of compiling every file again. Otherwise compiles run in parallel
processes (one per file, at most 2 at a time) and are cached under
``~/.cache/kfused/sass/<hash>`` keyed by the sources (csrc/**/*.{cu,cuh,h,hpp,cpp}), the nvcc
version and the flags, so a second run costs only the disassembly. Skipped without nvcc or
without cuobjdump.
"""

from __future__ import annotations

import concurrent.futures
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_csrc_compile as _cc  # noqa: E402  (nvcc / include discovery shared with the compile check)

# pytest-xdist (the README's test command): this file disassembles the objects
# test_csrc_compile's fixture compiled (DEVICE_OBJECTS), so both files run on one worker
pytestmark = pytest.mark.xdist_group("csrc")

ROOT = _cc.ROOT
CSRC = _cc.CSRC
CU_SOURCES = sorted(glob.glob(os.path.join(CSRC, "**", "*.cu"), recursive=True))
TIMEOUT_S = _cc.TIMEOUT_S
CACHE = os.path.join(os.path.expanduser(os.environ.get("KFUSED_CACHE", "~/.cache/kfused")), "sass")

# file (relative to csrc/) -> substrings of the (mangled) names of its GEMM-shaped kernels.
# Only the 16-bit instantiations are tensor-core kernels: float32 keeps the CUDA-core path
# (TF32 would fail the docs/math.md §4 rule), so each entry names the templates that are instantiated
# for c10::Half / c10::BFloat16 only.
TENSOR_CORE_KERNELS = {
    "inducer/inducer_mma_f16.cu": ["inducer_mma_kernel"],
    "inducer/inducer_mma_bf16.cu": ["inducer_mma_kernel"],
    "krona/kron_matvec.cu": ["kron_mma_fwd_kernel", "kron_mma_bwd_kernel"],
    "headwise/headwise_lowrank.cu": ["headwise_mma_kernel", "stream_gemm_mma_kernel"],
}

_VEC_LOAD = re.compile(r"\b(LDG\.E\.128|LDG\.E\.128\.CONSTANT|LDG\.E\.CONSTANT\.128|"
                       r"LDGSTS\.E(\.[A-Z0-9_]+)*\.128)\b")
_TENSOR = re.compile(r"\b(HMMA|HGMMA)\.")
_LOCAL = re.compile(r"\b(STL|LDL)(\.|\s)")


def _cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton

        cand = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                            "cuobjdump")
        if os.path.isfile(cand):
            return cand
    except ImportError:
        pass
    return None


def _command(src, nvcc, out):
    defines = ["-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    return [nvcc, "-cubin", "-std=c++17", "-arch=sm_90", "-x", "cu", *_cc._nvcc_torch_flags(),
            "-Xcudafe", "--diag_suppress=3306", "-Xptxas", "-v", *defines,
            *_cc._include_flags(nvcc), src, "-o", out]


def _key(src, nvcc):
    h = hashlib.sha256()
    for f in sorted(glob.glob(os.path.join(CSRC, "**", "*"), recursive=True)):
        if os.path.isfile(f) and f.endswith((".cu", ".cuh", ".h", ".hpp", ".cpp")):
            h.update(os.path.relpath(f, CSRC).encode())
            with open(f, "rb") as fh:
                h.update(fh.read())
    h.update(os.path.relpath(src, CSRC).encode())
    ver = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    h.update(ver.encode())
    h.update(" ".join(_command(src, nvcc, "OUT")[1:]).encode())
    return h.hexdigest()[:24]


def _disassemble(dump, path):
    return subprocess.run([dump, "-sass", path], capture_output=True, text=True)


def _from_compile_check(src, dump):
    """(0, ptxas log, sass text, seconds, "compile check") from the object test_csrc_compile
    built for ``src`` in this session, or None (not built there, or it failed: then the
    cubin build below reports the error itself)."""
    got = _cc.DEVICE_OBJECTS.get(src)
    if got is None or got[0] != 0 or not os.path.isfile(got[2]):
        return None
    t0 = time.perf_counter()
    dis = _disassemble(dump, got[2])
    if dis.returncode != 0 or "Function :" not in dis.stdout:
        return None
    return 0, got[1], dis.stdout, time.perf_counter() - t0, "compile check"


def _build(src, nvcc, dump):
    """(returncode, ptxas log, sass text, seconds, where it came from: "compile check",
    "cached" or "")."""
    reused = _from_compile_check(src, dump)
    if reused is not None:
        return reused
    key = _key(src, nvcc)
    d = os.path.join(CACHE, key)
    cub, log, sass = (os.path.join(d, n) for n in ("k.cubin", "ptxas.log", "k.sass"))
    if os.path.isfile(sass) and os.path.isfile(log):
        with open(log) as f1, open(sass) as f2:
            return 0, f1.read(), f2.read(), 0.0, "cached"
    os.makedirs(d, exist_ok=True)
    t0 = time.perf_counter()
    try:
        res = subprocess.run(_command(src, nvcc, cub), capture_output=True, text=True,
                             timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {TIMEOUT_S} s", "", time.perf_counter() - t0, ""
    out = res.stderr + res.stdout
    if res.returncode != 0:
        return res.returncode, out, "", time.perf_counter() - t0, ""
    dis = _disassemble(dump, cub)
    if dis.returncode != 0:
        return dis.returncode, out + dis.stderr, "", time.perf_counter() - t0, ""
    with open(log + ".tmp", "w") as f:
        f.write(out)
    with open(sass + ".tmp", "w") as f:
        f.write(dis.stdout)
    os.replace(log + ".tmp", log)
    os.replace(sass + ".tmp", sass)
    return 0, out, dis.stdout, time.perf_counter() - t0, ""


def _functions(sass):
    """{mangled kernel name: its SASS text}."""
    funcs, name, buf = {}, None, []
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            if name:
                funcs[name] = "\n".join(buf)
            name, buf = m.group(1), []
        elif name:
            buf.append(line)
    if name:
        funcs[name] = "\n".join(buf)
    return funcs


def _spills(log):
    """[(kernel, line)] for every ptxas report with non-zero spill stores or loads."""
    bad, fn = [], None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            fn = m.group(1)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and (int(m.group(1)) or int(m.group(2))):
            bad.append((fn, line.strip()))
    return bad


@pytest.fixture(scope="module")
def built():
    nvcc = _cc.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found: SASS check skipped")
    dump = _cuobjdump()
    if dump is None:
        pytest.skip("cuobjdump not found (neither the CUDA toolkit's nor Triton's)")
    t0 = time.perf_counter()
    order = sorted(CU_SOURCES, key=lambda s: -os.path.getsize(s))
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futs = {s: pool.submit(_build, s, nvcc, dump) for s in order}
        res = {s: f.result() for s, f in futs.items()}
    total = time.perf_counter() - t0
    print(f"\ncsrc SASS check: {len(res)} files in {total:.1f} s (2 in parallel)\n" + "\n".join(
        f"  {os.path.relpath(s, ROOT)}: {f'{r[3]:.1f} s' + (f' ({r[4]})' if r[4] else '')}"
        for s, r in res.items()), file=sys.stderr)
    return res


def test_every_listed_file_exists():
    for rel in TENSOR_CORE_KERNELS:
        assert os.path.isfile(os.path.join(CSRC, rel)), rel


@pytest.mark.parametrize("src", CU_SOURCES, ids=[os.path.relpath(s, CSRC) for s in CU_SOURCES])
def test_sass(built, src):
    rc, log, sass, secs, _ = built[src]
    rel = os.path.relpath(src, CSRC)
    if rc != 0:
        pytest.fail(f"{rel}: cubin build failed (exit {rc}, {secs:.1f} s)\n{log[-4000:]}",
                    pytrace=False)
    funcs = _functions(sass)
    assert funcs, f"{rel}: no kernel in the SASS"
    # the spill check below reads ptxas's -v report: without it, it would pass on nothing
    assert "Compiling entry function" in log and "spill stores" in log, \
        f"{rel}: no ptxas -v report in the build output\n{log[-2000:]}"
    problems = [f"{k}: {line}" for k, line in _spills(log)]
    for name, text in funcs.items():
        if _LOCAL.search(text):
            problems.append(f"{name}: local memory (STL/LDL) in the SASS")
    for want in TENSOR_CORE_KERNELS.get(rel, []):
        hits = [n for n in funcs if want in n]
        if not hits:
            problems.append(f"no kernel named *{want}* in {rel} (kernels: {sorted(funcs)})")
        for n in hits:
            text = funcs[n]
            if not _TENSOR.search(text):
                problems.append(f"{n}: no HMMA/HGMMA instruction")
            if not _VEC_LOAD.search(text):
                problems.append(f"{n}: no 128-bit global load (LDG.E.128 / LDGSTS .128)")
    assert not problems, f"{rel}:\n" + "\n".join(problems)


# The prefill key loop of the inducer tensor-core kernel (csrc/inducer/inducer_mma.cuh), per
# stage of BN = 64 keys: SASS instructions per HMMA at most (padded head width D -> bound).
# Measured on sm_90 (nvcc 13) when the loop was redesigned: D = 32: 12.8 (two 16-row tiles per
# warp), 64: 7.3 (two tiles), 96: 7.0, 128: 5.8 (one tile); the design before it (one tile per
# warp, every score masked and scaled, exp2f's range fix-up) ran 15.3 at D = 64 and 8.7 at 128.
# On the H100 that design ran at 137 TFLOP/s (p = 64, n = 16384, 2026-11-27) against the Triton
# kernel's 334: issue-bound, which the loop's length is the static measure of.
_PREFILL_INSTR_PER_HMMA = {32: 14.0, 64: 8.0, 96: 7.7, 128: 6.4}
_MMA_NAME = re.compile(r"inducer_mma_kernelI\w+?ELi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)EEEv")


def _key_loop(text, hmma_per_stage):
    """The innermost loop (backward branch) of a kernel's SASS that holds one stage's HMMAs:
    the list of its instructions, or None."""
    ins = []
    for line in text.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    best = None
    for addr, op in ins:
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", op)
        if not m or int(m.group(1), 16) >= addr:
            continue
        body = [o for a, o in ins if int(m.group(1), 16) <= a <= addr]
        if sum("HMMA" in o for o in body) == hmma_per_stage and (
                best is None or len(body) < len(best)):
            best = body
    return best


@pytest.mark.parametrize("src", ["inducer/inducer_mma_f16.cu", "inducer/inducer_mma_bf16.cu"])
def test_inducer_prefill_key_loop_is_short(built, src):
    """Each prefill instantiation's key loop: two 16-row tiles per warp up to D = 64 (each K / V
    fragment read from shared memory feeds both: at most one ldmatrix per 4 HMMA), one SFU exp2
    per score and per row rescale (no exp2f range fix-up), the mask only in the stages that
    need it, and at most the instructions per HMMA above."""
    rc, log, sass, _, _ = built[os.path.join(CSRC, src)]
    assert rc == 0, log[-2000:]
    seen = set()
    for name, text in _functions(sass).items():
        m = _MMA_NAME.search(name)
        if not m:
            continue
        D, BN, RW, KW, MR = (int(v) for v in m.groups())
        if KW != 1:
            continue                      # the decode schedule
        seen.add(D)
        assert MR == (2 if D <= 64 else 1), (name, MR)
        per_stage = MR * 2 * D * BN // 128
        loop = _key_loop(text, per_stage)
        assert loop is not None, f"{name}: no loop with {per_stage} HMMA"
        ops = [re.sub(r"^@!?U?P\w+\s+", "", o).split()[0] for o in loop]
        ldsm = sum(o.startswith("LDSM") for o in ops)
        mufu = sum(o.startswith("MUFU") for o in ops)
        assert ldsm * 4 <= per_stage * (2 if MR == 1 else 1), (name, ldsm, per_stage)
        assert mufu == MR * (BN // 8 * 4 + 2), (name, mufu)        # scores + 2 rescales per tile
        assert len(ops) / per_stage <= _PREFILL_INSTR_PER_HMMA[D], \
            (name, len(ops), per_stage, round(len(ops) / per_stage, 2))
    assert seen == {32, 64, 96, 128}, seen
