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
