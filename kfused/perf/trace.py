"""Run an op's forward and backward on CPU stand-in tensors and record what a GPU would run.

Triton launches are recorded (not run) by :func:`kfused.perf.compile.recording`; every other
torch operation (the "glue" between kernels: casts, reductions, small MLPs, allocations) is
recorded by a dispatch mode and evaluated on the meta device only, so benchmark shapes cost
no CPU time. The Triton backend is forced on (it refuses CPU tensors otherwise).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from kfused.perf.compile import Launch, recording

# aten ops that move no data (allocation, metadata, views are skipped via func.is_view)
_FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
         "_local_scalar_dense", "detach", "detach_", "lift_fresh", "alias", "_to_copy_meta", "set_",
         "resize_", "_unsafe_view", "sym_size", "sym_stride", "sym_numel", "is_same_size"}
_MATMUL = {"mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "addbmm", "addmm_",
           "baddbmm_"}


@dataclasses.dataclass
class GlueOp:
    """One torch operation between kernels: bytes read + written, matmul FLOPs if any."""
    name: str
    bytes: float
    flops: float
    shapes: List[Tuple[int, ...]]


def _nbytes(t: torch.Tensor) -> int:
    """Bytes a kernel moves for ``t``: its elements, counting a broadcast (stride-0) dim once
    (an expanded factor of a batched GEMM is read once, not once per batch)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


class _Glue(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: List[GlueOp] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "kfused":
            from torch._library.custom_ops import OPDEFS

            opdef = OPDEFS[func._schema.name]
            with self:
                return opdef._init_fn(*args, **kwargs)
        short = func._schema.name.split("::")[-1]
        if func.is_view or short in ("_local_scalar_dense", "sym_size", "sym_stride"):
            return func(*args, **kwargs)
        to_meta = lambda a: a.to("meta") if isinstance(a, torch.Tensor) else a  # noqa: E731
        try:
            out = func(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
            real = False
        except (NotImplementedError, RuntimeError):   # e.g. a copy to a device: run it
            out = func(*args, **kwargs)
            real = True
        if short not in _FREE:
            # (an out= buffer is written, not read: not an input)
            ins = [a for a in tree_flatten((args, {k: v for k, v in kwargs.items()
                                                   if k != "out"}))[0]
                   if isinstance(a, torch.Tensor)]
            outs = [a for a in tree_flatten(out)[0] if isinstance(a, torch.Tensor)]
            nb = sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs)
            if short in ("zero_", "fill_", "zeros", "ones", "full", "zeros_like", "ones_like",
                         "full_like", "new_zeros", "new_ones", "new_full"):
                nb = sum(_nbytes(t) for t in outs)          # write only
            elif short == "copy_" and ins:
                nb = sum(_nbytes(t) for t in ins)           # src read, dst written (not read)
            flops = 0.0
            if short in _MATMUL and outs:
                k = ins[-1].shape[-2] if short in ("mm", "bmm", "addmm", "baddbmm", "addmm_",
                                                   "baddbmm_") else \
                    ins[0].shape[-1]
                flops = 2.0 * outs[0].numel() * k
            self.ops.append(GlueOp(short, float(nb), flops, [tuple(t.shape) for t in ins]))
        if real:
            return out
        if func._schema.is_mutable:
            for i, a in enumerate(func._schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write:
                    return kwargs.get(a.name, args[i] if i < len(args) else None)
        alloc = (lambda m: torch.empty_strided(m.shape, m.stride(), dtype=m.dtype)  # noqa: E731
                 if isinstance(m, torch.Tensor) else m)
        return tree_map(alloc, out)


@contextlib.contextmanager
def _triton_forced():
    import kfused.backends as kb

    orig = kb.triton_unfit
    kb.triton_unfit = lambda device, dtype: None
    try:
        yield
    finally:
        kb.triton_unfit = orig


def _clear_kernel_caches() -> None:
    """Forget every memoised value of the kernel and op modules (``functools.lru_cache``:
    index maps, packings). Under tracing those are built from stand-in tensors whose contents
    are never computed, so they must not outlive the trace, nor be picked up by it."""
    import sys

    for name, mod in list(sys.modules.items()):
        if not name.startswith(("kfused.triton_kernels", "kfused.ops")) or mod is None:
            continue
        for obj in list(vars(mod).values()):
            clear = getattr(obj, "cache_clear", None)
            if callable(clear):
                clear()


_IS16 = (torch.float16, torch.bfloat16)


@contextlib.contextmanager
def _gpu_dispatch(launches: List[Launch]):
    """Make the host code take the branches it takes on a CUDA device although the stand-in
    tensors are on the CPU, and tag autotuned alternatives.

    * ``reduce_tokens`` and ``frozen_gemm`` (also ``headwise_oproj._thin``) hand 16-bit CUDA
      operands to cuBLAS (``torch.matmul``) and only fall back to the Triton GEMM otherwise: the same branch is
      taken here for 16-bit operands, so the trace records the cuBLAS GEMM (priced as a
      matmul glue op) instead of a split-K Triton launch that the GPU never runs. The
      conditions mirror those two functions (their ``device.type == "cuda"`` test is the only
      difference).
    * ``_headwise_common._launch`` records one launch per autotuning config while compiling
      for a GPU; those launches share an ``alt`` id so the report keeps only the fastest
      predicted one.
    * ``headwise_qkv``'s ``_fold_mode`` (how ``exact`` applies the update) and
      ``krona_linear``'s ``exact_composes`` (the exact path's cuBLAS composition) are
      evaluated as for a CUDA device.

    Each name is replaced in every headwise kernel module that looks it up as a global.
    """
    import importlib

    import kfused.triton_kernels._headwise_common as hc
    import kfused.triton_kernels.headwise_oproj as ho
    import kfused.triton_kernels.headwise_qkv as hq

    ops_qkv = importlib.import_module("kfused.ops.headwise_qkv")  # (not the function)
    fold_mode = ops_qkv._fold_mode

    orig = dict(reduce_tokens=hc.reduce_tokens, _launch=hc._launch,
                frozen_gemm=hc.frozen_gemm)
    counter = [0]

    def reduce_tokens(a_t, b, partials=False):
        if b.dtype in _IS16 and a_t.shape[0] and a_t.shape[1] and b.shape[1]:
            out = torch.matmul(a_t.t(), b)
            return out.unsqueeze(0) if partials else out.float()
        return orig["reduce_tokens"](a_t, b, partials=partials)

    def _launch(kernel, grid, args, kwargs):
        n0 = len(launches)
        orig["_launch"](kernel, grid, args, kwargs)
        if len(launches) - n0 > 1:
            for L in launches[n0:]:
                L.alt = counter[0]
            counter[0] += 1

    def _fold_mode(dtype, tokens, exact, device):
        return fold_mode(dtype, tokens, exact, torch.device("cuda"))

    def frozen_gemm(a, b, out, bias=None):
        if a.dtype in _IS16:
            if bias is None:
                return torch.matmul(a, b, out=out)
            return torch.addmm(bias, a, b, out=out)
        return orig["frozen_gemm"](a, b, out, bias=bias)

    import kfused.triton_kernels.krona_linear as kl

    composes = kl.exact_composes

    def exact_composes(device, dtype, T):
        return composes(torch.device("cuda"), dtype, T)

    patched = dict(reduce_tokens=reduce_tokens, _thin=frozen_gemm, _launch=_launch,
                   _fold_mode=_fold_mode, frozen_gemm=frozen_gemm,
                   exact_composes=exact_composes)
    saved = [(m, k, getattr(m, k)) for m in (hc, hq, ho, ops_qkv, kl) for k in patched
             if hasattr(m, k)]
    for m, k, _ in saved:
        setattr(m, k, patched[k])
    try:
        yield
    finally:
        for m, k, v in saved:
            setattr(m, k, v)


def _traced(run: Callable[[], None]) -> Tuple[List[Launch], List[GlueOp]]:
    with _triton_forced(), recording() as launches, _gpu_dispatch(launches):
        mode = _Glue()
        with mode:
            run()
    return launches, mode.ops


def trace(run: Callable[[], None], warm: bool = True) -> Tuple[List[Launch], List[GlueOp]]:
    """Call ``run()`` (which runs an op forward and backward on CPU tensors); return the Triton
    launches it made and the torch glue operations between them. Host-side dispatch follows
    the GPU's choices (:func:`_gpu_dispatch`; the fold-or-exact choice of KronA and of the
    output projection is made by the benchmark case itself from
    ``kfused.ops._fold.fold_decision``).

    ``warm``: run once unrecorded first, so that what the ops memoise per shape (index maps,
    packings by dimensions: ``functools.lru_cache``) is built, and record the second call:
    the steady state of a training loop, which builds those once, not every step. Whatever
    depends on the factor values (packing them) is rebuilt by every call and is recorded."""
    _clear_kernel_caches()
    try:
        if warm:
            _traced(run)
        launches, ops = _traced(run)
    finally:
        _clear_kernel_caches()
    return launches, ops
