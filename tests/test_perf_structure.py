"""CI checks of what the compiled code is (not of time), as a ratchet.

At the benchmark shapes, on sm_90: no kernel spills; every GEMM-shaped 16-bit Triton kernel
issues tensor-core instructions (HGMMA/HMMA) and no float32/float64 CUDA-core dots. Today's
violations are listed in kfused/perf/known_violations.json: a violation not listed, or worse
than listed, fails; a listed one that disappeared (or improved) fails too, asking for the
entry to be deleted/lowered (``python -m kfused.cli.main perf --update-known``), so the list
only shrinks. The CUDA C++ half of the ratchet is in tests/test_csrc_compile.py.
"""

import pytest

from kfused.perf import report as R
from tests._perf_helpers import structure_report

# pytest-xdist (the README's test command): one worker runs the structural compile run
# (tests/_perf_helpers.py) for every test that reads it
pytestmark = pytest.mark.xdist_group("structure")


def _triton_known():
    """Known Triton violations; the list was generated with one Triton version and the
    compiled code differs between versions (e.g. spills), so another version skips."""
    import json

    import triton

    with open(R.KNOWN) as f:
        made_with = json.load(f).get("versions", {}).get("triton", "")
    mm = lambda v: ".".join(v.split(".")[:2])  # noqa: E731
    if mm(made_with) != mm(triton.__version__):
        pytest.skip(f"known_violations.json was generated with triton {made_with}, this is "
                    f"{triton.__version__}: regenerate with `kfused perf --update-known` to "
                    "ratchet on this version")
    return [k for k in R.load_known() if not k["where"].startswith("csrc/")]


def test_no_new_or_worse_violations():
    pytest.importorskip("triton.backends.nvidia")
    rep = structure_report()
    found = [v for v in rep["violations"] if v["arch"] == "sm_90"]
    bad, _ = R.compare_known(found, _triton_known())
    assert not bad, ("structural regressions (fix the kernel; the list only shrinks):\n"
                     + "\n".join(bad))


def test_known_violations_still_exist():
    pytest.importorskip("triton.backends.nvidia")
    rep = structure_report()
    found = [v for v in rep["violations"] if v["arch"] == "sm_90"]
    _, gone = R.compare_known(found, _triton_known())
    assert not gone, "\n".join(gone)


def test_ratchet_logic():
    known = [dict(arch="sm_90", where="w", kernel="k", what="spill_bytes", value=100),
             dict(arch="sm_90", where="w", kernel="k2", what="no_tensor_core", value=1)]
    same = [dict(k) for k in known]
    assert R.compare_known(same, known) == ([], [])
    worse = [dict(known[0], value=200), known[1]]
    bad, gone = R.compare_known(worse, known)
    assert len(bad) == 1 and "WORSE" in bad[0] and not gone
    new = same + [dict(known[0], kernel="k3")]
    bad, _ = R.compare_known(new, known)
    assert len(bad) == 1 and "NEW" in bad[0]
    fixed = [known[1]]
    bad, gone = R.compare_known(fixed, known)
    assert not bad and len(gone) == 1 and "delete" in gone[0]
    better = [dict(known[0], value=50), known[1]]
    _, gone = R.compare_known(better, known)
    assert len(gone) == 1 and "IMPROVED" in gone[0]


def test_violation_rules():
    st = dict(spill_bytes=8, dots=dict(dot16=2, dot_f32_ieee=1), sass=dict(hgmma=0, hmma=0))
    what = {v["what"]: v["value"] for v in R.launch_violations(st, ["bf16"])}
    assert what == {"spill_bytes": 8, "no_tensor_core": 1, "cuda_core_dots": 1}
    st = dict(spill_bytes=0, dots=dict(dot16=2), sass=dict(hgmma=4))
    assert R.launch_violations(st, ["bf16"]) == []
    # float32 launches are not required to use tensor cores (IEEE dots by docs/math.md §4)
    st = dict(spill_bytes=0, dots=dict(dot_f32_ieee=2), sass={})
    assert R.launch_violations(st, ["fp32"]) == []
    # a float32 dot on TF32 tensor cores is a defect in any launch
    for dtypes in (["fp32"], ["bf16"]):
        st = dict(spill_bytes=0, dots=dict(dot16=1, dot_tf32=1), sass=dict(hmma=3))
        what = {v["what"]: v["value"] for v in R.launch_violations(st, dtypes)}
        assert what["tf32_dot"] == 1


def test_ttir_dots_tell_tf32_from_ieee():
    """The TTIR printer omits a dot's default (IEEE) precision; only a line naming TF32 is a
    TF32 dot — as Triton 3.6's combine pass printed the broadcast products it rewrote."""
    from kfused.perf.compile import _ttir_dots

    ttir = "\n".join([
        "%4 = tt.dot %0, %1, %3 : tensor<128x64xf32> * tensor<64x8xf32> -> tensor<128x8xf32>",
        "%5 = tt.dot %0, %1, %3, inputPrecision = ieee : tensor<16x16xf32> * tensor<16x16xf32>"
        " -> tensor<16x16xf32>",
        "%6 = tt.dot %0, %1, %3, inputPrecision = tf32 : tensor<128x4xf32> * tensor<4x16xf32>"
        " -> tensor<128x16xf32>",
        "%7 = tt.dot %q, %k, %c, inputPrecision = tf32 : tensor<128x64xbf16> * "
        "tensor<64x64xbf16> -> tensor<128x64xf32>",
        "%8 = tt.dot %a, %b, %c : tensor<16x16xf64> * tensor<16x16xf64> -> tensor<16x16xf64>",
    ])
    assert _ttir_dots(ttir) == {"dot16": 1, "dot_f32_ieee": 2, "dot_tf32": 1, "dot_f64": 1,
                                "dot_other": 0}


def test_update_known_refused_after_compile_failures(tmp_path, monkeypatch):
    """`kfused perf --update-known` after a run with compile failures (or without the CUDA C++
    objects) leaves known_violations.json as it is and exits 1: a kernel that did not compile
    shows no violation, so writing the list would drop its entries from the ratchet."""
    known = tmp_path / "known.json"
    entry = dict(arch="sm_90", where="csrc/x.cu", kernel="k", what="spill_bytes", value=8)
    known.write_text('{"violations": [' + __import__("json").dumps(entry) + "]}\n")
    before = known.read_text()
    monkeypatch.setattr(R, "KNOWN", str(known))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    for extra in (dict(failures=[dict(kernel="k", where="csrc", arch=90, error="boom")]),
                  dict(csrc={"skipped": "nvcc not found"})):
        report = dict(label=R.LABEL, versions={}, violations=[], failures=[], elapsed_s=0.0)
        report.update(extra)
        monkeypatch.setattr(R, "analyse", lambda *a, **k: report)
        rc = R.run(["--update-known", "--structure-only", "--json", str(tmp_path / "r.json")])
        assert rc == 1 and known.read_text() == before


_SPILLER = r"""
__global__ void spills(float* a, int n) {
  float r[64];
#pragma unroll
  for (int i = 0; i < 64; i++) r[i] = a[threadIdx.x + i * n] * a[threadIdx.x * 3 + i];
  float s = 0;
#pragma unroll
  for (int j = 0; j < 64; j++)
#pragma unroll
    for (int i = 0; i < 64; i++) s += r[i] * r[(i + j) % 64];
  a[threadIdx.x] = s;
}
__global__ void fits(float* a, int n) { a[threadIdx.x] += n; }
"""


def test_spill_bytes_reads_the_stack_frame_where_the_sass_touches_local_memory():
    from kfused.perf.compile import spill_bytes

    assert spill_bytes(dict(local=0, stack=1552, sass=dict(stl=409, ldl=525))) == 1552
    assert spill_bytes(dict(local=0, stack=16, sass=dict(stl=0, ldl=0))) == 0   # a call frame
    assert spill_bytes(dict(local=8, stack=0, sass={})) == 8


def test_a_kernel_ptxas_spills_is_seen_spilling(tmp_path):
    """cuobjdump reports spilled registers as STACK, not LOCAL: the tool read LOCAL and saw
    no spill in a kernel ptxas says spills 10 KB (nor in the inducer dQ kernel's 2 KB)."""
    import re
    import subprocess

    from kfused.perf.compile import file_stats, find_nvcc, spill_bytes

    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    src = tmp_path / "k.cu"
    src.write_text(_SPILLER)
    cubin = tmp_path / "k.cubin"
    r = subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-maxrregcount=32", "-Xptxas", "-v",
                        str(src), "-o", str(cubin)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    stores = [int(m) for m in re.findall(r"(\d+) bytes spill stores", r.stderr)]
    assert max(stores) > 0 and min(stores) == 0        # ptxas: one spills, one does not
    st = {name: spill_bytes(s) for name, s in file_stats(str(cubin)).items()}
    spiller = next(v for k, v in st.items() if "spills" in k)
    fitter = next(v for k, v in st.items() if "fits" in k)
    assert spiller > 0 and fitter == 0, st
