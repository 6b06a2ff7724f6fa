"""Rules on the Triton kernels' source that no CPU run of the kernels can check.

Triton <= 3.6 (the GPU machine's) rewrites ``tl.sum(a[:, :, None] * b[None, :, :], axis=1)``
into a ``tt.dot`` with TF32 precision: float32 operands rounded to 10 mantissa bits on the
tensor cores. The CPU interpreter ignores dot precision and Triton 3.9 makes such a dot IEEE,
so neither shows it; on the H100 it broke the 16-bit KronA factor gradients of exactly the
factor shapes whose CUDA-core products it rewrote (kfused.triton_kernels._common._bcast_mm).
Every broadcast-and-sum product therefore goes through ``_bcast_mm``."""

from __future__ import annotations

import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = sorted(glob.glob(os.path.join(ROOT, "kfused", "triton_kernels", "*.py")))
ALLOWED = {"_bcast_mm"}


def _expansion(node):
    """'mk1' for x[:, :, None], '1kn' for x[None, :, :], else None."""
    if not isinstance(node, ast.Subscript) or not isinstance(node.slice, ast.Tuple):
        return None
    parts = ["1" if isinstance(e, ast.Constant) and e.value is None
             else ":" if isinstance(e, ast.Slice) else "?" for e in node.slice.elts]
    return {"::1": "mk1", "1::": "1kn"}.get("".join(parts))


def dot_shaped_products(source: str):
    """(function, line) of every product of an (M, K, 1) and a (1, K, N) expansion — the
    form Triton's combine pass turns into a dot — outside the allowed helper."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef) or fn.name in ALLOWED:
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
                if {_expansion(node.left), _expansion(node.right)} == {"mk1", "1kn"}:
                    found.append((fn.name, node.lineno))
    return found


def test_every_broadcast_product_goes_through_bcast_mm():
    bad = []
    for path in KERNELS:
        with open(path) as f:
            bad += [f"{os.path.relpath(path, ROOT)}:{line} in {fn}"
                    for fn, line in dot_shaped_products(f.read())]
    assert not bad, ("broadcast-and-sum products written out (Triton <= 3.6 makes them TF32 "
                     "dots); use _common._bcast_mm:\n" + "\n".join(bad))


def test_the_rule_sees_the_forms_that_were_rewritten():
    # the three forms the H100's Triton rewrote (_mm's CUDA-core branch, the narrow
    # kernel's dx, the lite basis product), and forms it leaves alone
    src = '''
def k(a, b, w_l, x_l):
    p = a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]
    d = tl.sum(w_l[:, :, None] * a[None, :, :], axis=1)
    e = tl.sum(b[None, :, :] * a[:, :, None], axis=1)
    ok1 = tl.sum(x_l[:, None, :] * a[None, :, :], axis=2)
    ok2 = tl.sum(w_l[:, :, None] * x_l[:, None, :], axis=0)
    ok3 = tl.sum(a[:, :, None] * (b[None, :, :] + 0.0), axis=1)

def _bcast_mm(a, b):
    return tl.sum(a[:, :, None] * b[None, :, :], axis=1)
'''
    assert [line for _, line in dot_shaped_products(src)] == [3, 4, 5]


def split_operands(source: str):
    """(function, line) of every 16-bit low part taken of a float32 value — ``(x -
    x_hi.to(tl.float32)).to(...)``, the second half of a hi/lo split for two tensor-core dots."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef):
            continue
        for node in ast.walk(fn):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "to" and isinstance(node.func.value, ast.BinOp)
                    and isinstance(node.func.value.op, ast.Sub)):
                continue
            right = node.func.value.right
            if (isinstance(right, ast.Call) and isinstance(right.func, ast.Attribute)
                    and right.func.attr == "to" and len(right.args) == 1
                    and ast.unparse(right.args[0]) == "tl.float32"):
                found.append((fn.name, node.lineno))
    return found


# The splits a GPU run has passed, by (file, function): KronA's factor-gradient kernels (the
# H200 of 2026-11-30: test_krona's kernel tests and `kfused check`'s 432 krona_linear
# comparisons, float32/float16/bfloat16) and the inducer forward's output residue (a stored
# value, no dot operand). Any other needs a GPU run before it joins.
GPU_PASSED_SPLITS = {("krona_linear.py", "_dab_step"), ("krona_linear.py", "_kron_grad_bd_kernel"),
                     ("inducer_attention.py", "_fwd_rows")}


def test_no_float32_operand_is_split_for_a_tensor_core_dot_unless_a_gpu_passed_it():
    # Triton 3.6 on sm_90 compiled such split products wrongly in some kernels and shapes
    # (illegal addresses, NaN, wrong values) where the interpreter runs them right: the
    # inducer MLP on an H100 (2026-11-25), headwise_lowrank on an H200 (2026-11-30). See
    # kfused/triton_kernels/_common.py.
    found = {(os.path.basename(p), fn) for p in KERNELS for fn, _ in split_operands(open(p).read())}
    assert found <= GPU_PASSED_SPLITS, sorted(found - GPU_PASSED_SPLITS)


def test_the_split_rule_sees_the_form_that_was_removed():
    src = ("def f(a, b):\n"
           "    a_hi = a.to(b.dtype)\n"
           "    a_lo = (a - a_hi.to(tl.float32)).to(b.dtype)\n"
           "    return tl.dot(a_hi, b) + tl.dot(a_lo, b)\n")
    assert split_operands(src) == [("f", 3)]
    assert split_operands("def g(a):\n    return (a - a.to(tl.float16)).to(tl.float32)\n") == []
    assert split_operands("def h(a, b):\n    return (a - b).to(tl.float16)\n") == []
