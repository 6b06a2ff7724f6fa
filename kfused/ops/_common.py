"""Pieces every op family's custom ops share."""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode


def dense(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` contiguous (no copy when it is; None stays None): for the vectors and factors a
    kernel indexes without strides (biases, per-head c)."""
    return t.contiguous() if t is not None else None


def no_double_backward(op: str, backend: str = "triton"):
    """The autograd formula of a backward custom op: its kernels have no derivative of their
    own, so a second backward through it (``create_graph=True``, then the gradient of a
    gradient) raises this error instead of torch's generic "no autograd formula" (or, for an
    autograd.Function whose backward ran kernels, a silently missing term). The first
    backward is unaffected (it runs the op below autograd)."""
    def backward(ctx, *grads):
        raise RuntimeError(
            f"double backward is not supported by kfused.{op} (backend={backend!r}): its "
            "backward is a fused kernel with no derivative of its own; use "
            "backend='reference' for higher-order gradients")
    backward.refuses = True      # register_autograd: no formula for the eager fast path
    return backward


# ------------------------------------------------------------------------------------------
# Custom ops with an eager fast path
#
# Every kfused kernel entry is a torch.library custom op (torch.compile, export, fake tensors,
# opcheck see one op with its fake and autograd registrations). Calling a custom op costs its
# Python dispatch — the autograd wrapper, fill_defaults, the redispatch, the dynamo-disabled
# backend wrapper — several times a plain op's: measured on an H100 machine (torch 2.11), the
# KronA fold path's fwd+bwd spent 1.38 ms on the host for 0.17 ms of kernels, 11.8x the
# frozen linear (benchmarks/results/h100/proof-2026-11-27). In plain eager mode (no
# compilation, no functorch transform, no dispatch mode, plain tensors) ``kops.<name>`` runs
# the same implementation directly — through a light autograd.Function built from the same
# setup_context and backward when a gradient is wanted — and everywhere else the custom op.


class _Op:
    __slots__ = ("name", "impl", "op", "kind", "defaults", "setup", "backward", "fn_cls")

    def __init__(self, name: str, impl, op):
        import inspect

        self.name, self.impl, self.op = name, impl, op
        params = list(inspect.signature(impl).parameters.values())
        self.defaults = tuple(p.default for p in params)
        rets = op._opoverload._schema.returns
        self.kind = ("list" if len(rets) == 1 and str(rets[0].type).startswith("List[")
                     else "tuple" if len(rets) > 1 else "single")
        self.setup = self.backward = self.fn_cls = None


_OPS: dict = {}


def custom_op(name: str):
    """``torch.library.custom_op(name, mutates_args=())`` that also keeps the undecorated
    implementation for :data:`kops`' eager fast path."""
    def deco(fn):
        op = torch.library.custom_op(name, mutates_args=())(fn)
        short = name.split("::", 1)[1]
        _OPS[short] = _Op(name, fn, op)
        # an attribute from the start: Dynamo tracing a first ``kops.<name>`` lookup through
        # __getattr__ (whose setattr caches it) recursed until RecursionError, so
        # torch.compile of a module whose op had not yet run eagerly in the process failed
        setattr(kops, short, functools.partial(run_op, short))
        return op
    return deco


def register_autograd(op, backward, setup_context=None) -> None:
    """``op.register_autograd(backward, setup_context=...)``, recorded for the fast path. A
    backward that only refuses (:func:`no_double_backward`, a backward op's) is not recorded:
    the fast path leaves gradient-requiring calls to the custom op, which raises the same."""
    op.register_autograd(backward, setup_context=setup_context)
    if not getattr(backward, "refuses", False):
        entry = _OPS[op._name]
        entry.setup, entry.backward = setup_context, backward


def _function(e: _Op):
    kind, impl, setup, backward = e.kind, e.impl, e.setup, e.backward

    # the old-style forward (ctx first): a separate setup_context makes apply() bind its
    # arguments through inspect.signature on every call
    def forward(ctx, *args):
        out = impl(*args)
        if setup is not None:
            setup(ctx, args, out)
        return tuple(out) if kind == "list" else out

    def bwd(ctx, *grads):
        if kind == "list":
            return backward(ctx, list(grads))
        return backward(ctx, *grads)

    return type(f"Eager_{e.name.replace('::', '_')}", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(bwd)})


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_T, _P = _PLAIN
FAST_PATH = {"on": True}   # off: every call through torch.ops (tests compare the two)


def _plain_eager(args) -> bool:
    return _plain_eager_grad(args) is not None


def _plain_eager_grad(args) -> Optional[bool]:
    """None where the fast path does not apply (torch.compile, functorch transforms, a
    dispatch mode, a tensor subclass or a meta tensor among ``args``), else whether some
    tensor of ``args`` requires a gradient (grad mode on)."""
    if not FAST_PATH["on"] or torch.compiler.is_compiling() or \
            torch._C._are_functorch_transforms_active():
        return None
    if _get_current_dispatch_mode() is not None:
        return None
    grad, want = False, torch.is_grad_enabled()
    for a in args:
        # (one pass, type identity and is_meta: this runs for every argument of every call)
        if isinstance(a, torch.Tensor):
            if (type(a) is not _T and type(a) is not _P) or a.is_meta:
                return None
            if want and not grad and a.requires_grad:
                grad = True
    return grad


def run_op(name: str, *args):
    """The kfused custom op ``name`` on ``args`` (positional, as its schema orders them), by
    the eager fast path where it applies (see above), else by ``torch.ops.kfused``."""
    e = _OPS[name]
    grad = _plain_eager_grad(args)
    if grad is None:
        return e.op(*args)
    if len(args) < len(e.defaults):
        args = args + e.defaults[len(args):]
    if grad:
        if e.backward is None:
            return e.op(*args)      # no formula of its own (a backward op): the op decides
        if e.fn_cls is None:
            e.fn_cls = _function(e)
        out = e.fn_cls.apply(*args)
        return list(out) if e.kind == "list" else out
    return e.impl(*args)


class _Kops:
    """``kops.<name>(*args)``: :func:`run_op` for ``kfused::<name>`` (each an attribute set
    by :func:`custom_op` when the op is registered)."""

    def __getattr__(self, name: str):
        raise AttributeError(f"kops.{name}: no kfused custom op {name!r} is registered")


kops = _Kops()
