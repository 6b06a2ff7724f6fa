"""benchmarks/kernel_asm.py: one benchmark case's launches of a kernel compiled for sm_90 on the
CPU (the tool stop 40 read the changed kernels' registers and loop structure with), and its
TTGIR loop summary on hand-written text."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "kernel_asm.py")


def _run(*args, tmp):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, SCRIPT, *args, "--out", str(tmp)], env=env,
                          capture_output=True, text=True, timeout=600)


def test_compiles_a_case_launch_and_writes_its_code(tmp_path):
    r = _run("768->768 A24x24", "_sum_partials_kernel", tmp=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "registers" in r.stdout and "spill 0 B" in r.stdout
    names = sorted(os.listdir(tmp_path))
    assert {n.rsplit(".", 1)[1] for n in names} == {"ttir", "ttgir", "ptx", "cubin"}
    # its one loop sums row blocks: one reduction inside it, no dot
    assert "'in_loops': {'reduce': 1, 'dot': 0}" in r.stdout


def test_a_kernel_the_case_does_not_launch_lists_the_ones_it_does(tmp_path):
    r = _run("768->768 A24x24", "_no_such_kernel", tmp=tmp_path)
    assert r.returncode == 1 and "_kron_grad_kernel" in r.stdout
    r = _run("no such case", "_kron_grad_kernel", tmp=tmp_path)
    assert r.returncode != 0 and "no perf case label contains" in r.stderr


def test_loop_summary_counts_by_loop_depth():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from kernel_asm import loop_summary
    finally:
        sys.path.pop(0)
    text = "\n".join([
        '%a = "tt.reduce"(%x) <{axis = 0 : i32}> ({',
        "%f = scf.for %i = %c0 to %n step %c1 iter_args(%acc = %z) -> (f32) {",
        "  %d = ttng.warp_group_dot %p, %q, %acc",
        '  %r = "tt.reduce"(%d) <{axis = 0 : i32}> ({',
        "  scf.yield %r",
        "}",
        "%e = tt.dot %u, %v, %w",
    ])
    assert loop_summary(text) == {"in_loops": {"reduce": 1, "dot": 1},
                                  "outside": {"reduce": 1, "dot": 1}}
