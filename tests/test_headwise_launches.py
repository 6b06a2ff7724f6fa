"""Launch counts of the fused per-head projections (issue 12: host-side factor work).

At GPT-2 widths each tiny torch op on the factors costs a few µs of launch latency, as much as
a whole pass of the kernels, so the number of device launches per forward+backward is part of
the performance contract. This file counts them on the CPU (Triton interpreter) at a small
shape: every aten op that launches a kernel on CUDA (views and bare allocations excluded) plus
every Triton launch. The count does not depend on the shape, except that token reductions
split into partials (summed on the host) only above a few hundred tokens: the shape here is
large enough that they split, as they do at T = 16k on a GPU. One CUDA difference: there the
16-bit token reductions are ``torch.matmul(...).float()`` (two launches) where the interpreter
runs the split-K Triton GEMM and its partial sum (two launches): the same count.

The Triton kernels are counted, not run: the count depends only on the host code, which
reads no kernel output (``--run`` runs them too, and gives the same table). Interpreting them
took about a minute of CI.

Run ``TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 tests/test_headwise_launches.py`` for the
table (``-v`` lists the ops); the test keeps the counts at or under their budgets.
"""

from __future__ import annotations

import collections
import os
import sys

if __name__ == "__main__":  # run as a script: interpret Triton before the kernels load
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kfused.ops import HeadFactors, headwise_oproj, headwise_qkv

aten = torch.ops.aten

# aten ops that launch no kernel: allocations without a fill, and metadata-only ops.
_NO_KERNEL = {aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
              aten.new_empty_strided.default, aten.empty_like.default,
              aten.lift_fresh.default, aten.sym_size.int, aten.sym_stride.int,
              aten.sym_numel.default, aten.is_same_size.default, aten._local_scalar_dense.default}


def _is_view(func) -> bool:
    return bool(getattr(func, "is_view", False)) or func in (
        aten.detach.default, aten.split.Tensor, aten.split_with_sizes.default,
        aten.unbind.int, aten.chunk.default)


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "kfused":
            # A custom op: count what its implementation launches (the mode is popped while
            # this runs; push it again and go straight to the CPU kernel, the implementation).
            with self:
                return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU),
                                       *args, **kwargs)
        if not self.paused and func not in _NO_KERNEL and not _is_view(func):
            self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **kwargs)


class LaunchCount:
    """Context manager: ``.torch`` (Counter of aten ops by name), ``.triton`` (Counter of
    Triton kernels by name), ``.total``. ``execute=False``: Triton launches are counted but
    not interpreted (their outputs keep whatever the allocation held)."""

    def __init__(self, execute: bool = True):
        self.execute = execute

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction

        self._cls = InterpretedFunction
        self._orig = InterpretedFunction.run
        self.triton = collections.Counter()
        self._mode = _Counter()
        me = self

        def run(fn_self, *args, **kwargs):
            me.triton[fn_self.fn.__name__] += 1
            if not me.execute:
                return None
            me._mode.paused += 1           # the interpreter's own tensor traffic is not ours
            try:
                return me._orig(fn_self, *args, **kwargs)
            finally:
                me._mode.paused -= 1

        InterpretedFunction.run = run
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        self._cls.run = self._orig
        self.torch = self._mode.ops
        return False

    @property
    def total(self) -> int:
        return sum(self.torch.values()) + sum(self.triton.values())


# The benchmark presets (kfused/cases/headwise.py): q|k|v part, and the o part.
PRESETS = {
    "kernel-mix-qvo-intermediate": dict(q=dict(wise=3, shared=12), v=dict(lite=8, shared=8),
                                        o=dict(wise=8, shared=8)),
    "kernel-mix-lite-qv-small": dict(q=dict(lite=2, shared=2), v=dict(lite=1, shared=2)),
}
# Small stand-ins for GPT-2 (H = H_kv) and Llama-7B with GQA (H_kv < H); T = 320 tokens so the
# token reductions split (see the module docstring).
SHAPES = {"gpt2-like": dict(d=64, H=4, Hkv=4, p=16, T=320),
          "gqa-like": dict(d=64, H=4, Hkv=2, p=16, T=320)}


def _factors(r, H, p, d, dtype, gen):
    def t(*s):
        return (torch.randn(*s, generator=gen) * 0.1).to(dtype).requires_grad_()

    kw = {}
    if r.get("shared"):
        kw.update(shared_A=t(r["shared"], d), shared_B=t(H * p, r["shared"]))
    if r.get("wise"):
        kw.update(wise_A=t(H, r["wise"], d), wise_B=t(H, p, r["wise"]), wise_c=t(H, p))
    if r.get("lite"):
        kw.update(lite_A=t(H, r["lite"], p), lite_B=t(H, p, r["lite"]),
                  lite_c=None if r.get("wise") else t(H, p))
    return HeadFactors(**kw)


def _leaves(f):
    return [t for t in (f.shared_A, f.shared_B, f.wise_A, f.wise_B, f.wise_c, f.lite_A,
                        f.lite_B, f.lite_c) if t is not None]


def count(preset: str, shape: str, op: str = "qkv", dtype=torch.float16, execute=False):
    """(forward LaunchCount, backward LaunchCount) of one call as the benchmark makes it:
    16-bit activations and factors, biases, autograd.grad into x and every factor.
    ``execute``: interpret the Triton kernels too (slow; the counts are the same)."""
    cfg, s = PRESETS[preset], SHAPES[shape]
    d, H, Hkv, p, T = s["d"], s["H"], s["Hkv"], s["p"], s["T"]
    gen = torch.Generator().manual_seed(0)
    if op == "qkv":
        x = torch.randn(T, d, generator=gen).to(dtype).requires_grad_()
        W = [(torch.randn(n, d, generator=gen) / d ** 0.5).to(dtype)
             for n in (H * p, Hkv * p, Hkv * p)]
        b = [(torch.randn(n, generator=gen) * 0.1).to(dtype) for n in (H * p, Hkv * p, Hkv * p)]
        q = _factors(cfg["q"], H, p, d, dtype, gen)
        v = _factors(cfg["v"], Hkv, p, d, dtype, gen)
        leaves = [x, *_leaves(q), *_leaves(v)]

        def fn():
            return headwise_qkv(x, *W, *b, n_heads=H, n_kv_heads=Hkv, q=q, v=v,
                                backend="triton", fused_output=True)
    else:
        r = cfg["o"]
        o = torch.randn(T, H * p, generator=gen).to(dtype).requires_grad_()
        w = (torch.randn(d, H * p, generator=gen) / (H * p) ** 0.5).to(dtype)
        bo = (torch.randn(d, generator=gen) * 0.1).to(dtype)
        f = dict(wise_A=torch.randn(H, r["wise"], p, generator=gen),
                 wise_B=torch.randn(d, H * r["wise"], generator=gen),
                 wise_c=torch.randn(d, generator=gen),
                 shared_A=torch.randn(r["shared"], H * p, generator=gen),
                 shared_B=torch.randn(d, r["shared"], generator=gen))
        f = {k: (t * 0.1).to(dtype).requires_grad_() for k, t in f.items()}
        leaves = [o, *f.values()]

        exact = False if op in ("oproj-folded", "oproj-kept") else None
        import kfused.triton_kernels.headwise_oproj as ho

        def fn():
            # oproj-folded: the backward folds W' again; oproj-kept: the forward keeps it
            old, ho.FORCE_KEEP = ho.FORCE_KEEP, {"oproj-folded": False,
                                                 "oproj-kept": True}.get(op)
            try:
                return headwise_oproj(o, w, bo, n_heads=H, scale=0.5, backend="triton",
                                      exact=exact, **f)
            finally:
                ho.FORCE_KEEP = old
    gY = None
    for it in range(2):                      # the second call runs with warm caches
        fwd = LaunchCount(execute).__enter__()
        Y = fn()
        fwd.__exit__(None, None, None)
        if gY is None:
            gY = torch.randn(Y.shape, generator=gen).to(dtype)
        bwd = LaunchCount(execute).__enter__()
        torch.autograd.grad([Y], leaves, [gY])
        bwd.__exit__(None, None, None)
    return fwd, bwd


CASES = [(p, s, "qkv") for p in PRESETS for s in SHAPES] + \
    [("kernel-mix-qvo-intermediate", "gpt2-like", op)
     for op in ("oproj", "oproj-folded", "oproj-kept")]

# Launches per forward+backward (the redesign of issue 12's host side); a regression guard.
# 40, 61 and 22 launches before the factor assembly moved into kernels (q|k|v: LiteSection
# and the GEMM's second bias for the per-head biases; o: one pack and one unpack kernel for
# D_o and [B_w | scale·B_s], the bias gradient from the dx GEMM's column sums); the forwards
# now launch no torch op. The folded output projection (exact=False) adds the fold of W' in
# each direction (11 launches) and, since its GEMMs run over the appended [W'; D_o] and
# [W' | B_c], drops the thin GEMMs for Z and dZ (9). The bias gradients' column sums are
# written in the dtype of the biases they serve (c, b), so no backward converts them with a
# torch op, and the q and v sections share one launch each of the pack, rank-pass and
# unpack kernels (15, 17, 9, 9 before both). The output projection's backward with a shared
# part and scale != 1 forms the shared rows of dZ as round(s·dY) B_s, the torch path's
# rounding order (docs/math.md §4 failed on dA_s without it): a multiply, a thin GEMM and the
# copy into dZ, 3 launches (8 before); folded, the dO GEMM over [W' | B_w | B_s] gives those
# rows as dY·B_s and the unpack applies s to their sums in float32, so the folded backward
# launches none of the three (11 → 8). Where the folded forward keeps its operands
# [[W', B_c], [D_o, 0]] (oproj_keeps_fold; forced here), the backward folds nothing (7).
# Since the H200 run of 2026-11-30 the folded output projection's GEMMs are frozen-shaped
# (cuBLAS on a GPU): the one Triton GEMM per direction over the appended operand measured
# 91 µs forward and 274 µs backward where cuBLAS takes ~30 µs a frozen GEMM, so each
# direction runs two GEMMs (Y and Z; dO and dZ) and the bias gradient is one torch sum over
# dY: 3 launches more (8 → 11, 7 → 10), the fold launch writing the forward's bias b + c.
BUDGET = {("kernel-mix-qvo-intermediate", "qkv"): 10,
          ("kernel-mix-lite-qv-small", "qkv"): 12,
          ("kernel-mix-qvo-intermediate", "oproj"): 11,
          ("kernel-mix-qvo-intermediate", "oproj-folded"): 11,
          ("kernel-mix-qvo-intermediate", "oproj-kept"): 10}
FWD_TORCH_BUDGET = {"qkv": 0, "oproj": 0, "oproj-folded": 0, "oproj-kept": 0}


def _interpreting() -> bool:
    from kfused.backends import triton_interpret

    return triton_interpret()


@pytest.mark.skipif(not _interpreting(), reason="counts launches in the Triton CPU interpreter "
                    "(InterpretedFunction, CPU tensors, the CPU dispatch key); compiled Triton "
                    "on a GPU runs the same host code, counted here on the CPU")
@pytest.mark.parametrize("preset,shape,op", CASES)
def test_launch_budget(preset, shape, op):
    from kfused import _alloc

    old = _alloc.set_poisoning(False)   # the tests' NaN fill of fresh buffers is not the op's
    try:
        fwd, bwd = count(preset, shape, op)
    finally:
        _alloc.set_poisoning(old)
    assert fwd.total + bwd.total <= BUDGET[(preset, op)], (fwd.torch, fwd.triton, bwd.torch,
                                                           bwd.triton)
    assert sum(fwd.torch.values()) <= FWD_TORCH_BUDGET[op], fwd.torch


def main(argv):
    verbose = "-v" in argv
    execute = "--run" in argv
    print(f"{'preset':<28} {'shape':<10} {'op':<6} {'fwd':>4} {'(triton)':>8} {'bwd':>4} "
          f"{'(triton)':>8} {'total':>5}")
    for preset, shape, op in CASES:
        fwd, bwd = count(preset, shape, op, execute=execute)
        print(f"{preset:<28} {shape:<10} {op:<6} {fwd.total:4d} {sum(fwd.triton.values()):8d} "
              f"{bwd.total:4d} {sum(bwd.triton.values()):8d} {fwd.total + bwd.total:5d}")
        if verbose:
            for name, lc in (("fwd", fwd), ("bwd", bwd)):
                print(f"    {name} torch:  {dict(lc.torch.most_common())}")
                print(f"    {name} triton: {dict(lc.triton)}")


if __name__ == "__main__":
    main(sys.argv[1:])
