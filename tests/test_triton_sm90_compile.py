"""Every Triton kernel launch the ops make on a GPU compiles for sm_90.

The CPU interpreter accepts programs that the GPU compiler rejects (tl.dot on tiles < 16,
layouts, shared memory). ``kfused perf`` records the launches the ops make at the benchmark
shapes plus each kernel module's representative launches (``aot_launches`` in kfused.cases: odd head widths,
masks, prefix, float32), specialises them exactly as Triton's JIT does, and compiles each with
Triton's compiler and ptxas for sm_90, no GPU needed (cached across runs; see
tests/_perf_helpers.py).
"""

import pytest

from tests._perf_helpers import structure_report

# pytest-xdist (the README's test command): one worker runs the structural compile run
# (tests/_perf_helpers.py) for every test that reads it
pytestmark = pytest.mark.xdist_group("structure")


def test_all_triton_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    rep = structure_report()
    print(f"structure run: {rep['_seconds']:.0f} s\n{rep['_stdout']}")
    fails = [f for f in rep["failures"]]
    assert not fails, "sm_90 compile failures:\n" + "\n".join(
        f"{f['kernel']} ({f['where']}): {f['error'][:1500]}" for f in fails)
