"""Every Triton kernel launch that the ops make on a GPU compiles for sm_90.

The CPU interpreter accepts programs that the GPU compiler rejects (tl.dot on tiles < 16,
layouts, shared memory). kfused.triton_kernels._aot records representative launches (with the
block sizes the host functions pick for a GPU) and compiles each with Triton's compiler and
ptxas for sm_90, no GPU needed.
"""

import os
import subprocess
import sys

import pytest


def test_all_triton_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-m", "kfused.triton_kernels._aot", "--jobs", "2"],
                          capture_output=True, text=True, env=env, timeout=1500)
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, f"sm_90 compile failures:\n{proc.stdout[-20000:]}\n{proc.stderr[-4000:]}"
    assert " 0 failed" in proc.stdout and "compiled" in proc.stdout
