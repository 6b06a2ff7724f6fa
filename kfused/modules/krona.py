"""Kronecker adapter modules (docs/math.md §1): KronALinear, KronABlock (KronA^B, KronA^B_res).

Modules own parameters and call the functional ops; every kernel choice lives in kfused.ops.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple

import torch
from torch import nn

from kfused.modules._init import PAIR_INITS, check_init, init_pair_
from kfused.modules._linear import (WrappedLinear, autocast_input, check_backend_name,
                                    check_block_widths, linear_dims, linear_weight)
from kfused.ops import check_scale, kron_matvec, krona_linear
from kfused.reference.krona import kron_delta_weight

__all__ = ["KronALinear", "KronABlock", "factorize", "factors_for_budget"]


def factorize(d: int) -> Tuple[int, int]:
    """Split ``d`` into ``(a, b)``, ``a * b = d``, with ``a`` the largest divisor <= √d.

    768 -> (24, 32), 1024 -> (32, 32), 3072 -> (48, 64), 4096 -> (64, 64).
    """
    if isinstance(d, bool) or not isinstance(d, numbers.Integral):
        raise TypeError(f"factorize: d must be an int, got {type(d).__name__} {d!r}")
    d = int(d)
    if d < 1:
        raise ValueError(f"cannot factorize dimension {d}: d must be >= 1")
    a = int(math.isqrt(d))
    while d % a:
        a -= 1
    return a, d // a


def factors_for_budget(d_out: int, d_in: int, budget: int
                       ) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """KronA factor shapes ``(a_shape, b_shape)`` for a ``d_out × d_in`` layer with as many
    parameters as fit in ``budget`` (``a_out·a_in + b_out·b_in``; the KronA paper compares
    it with LoRA at equal trainable parameters: a rank-r LoRA has ``r·(d_in + d_out)``).

    Among the factor pairs at the largest count ≤ ``budget``, A is the squarest; with no pair
    that small, the pair with the fewest parameters. 384×128 at a rank-8 budget (4,096):
    A 4×4, B 96×32 (3,088 parameters)."""
    d_out = _check_width("d_out", d_out)
    d_in = _check_width("d_in", d_in)
    budget = _check_width("budget", budget)

    def divisors(n):
        return [a for a in range(1, n + 1) if n % a == 0]

    best = None
    for ao in divisors(d_out):
        for ai in divisors(d_in):
            n = ao * ai + (d_out // ao) * (d_in // ai)
            fits = n <= budget
            key = (fits, n if fits else -n, -abs(math.log(ao / ai)), -ao)
            if best is None or key > best[0]:
                best = (key, (ao, ai), (d_out // ao, d_in // ai))
    return best[1], best[2]


def _check_width(name: str, d) -> int:
    if isinstance(d, bool) or not isinstance(d, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(d).__name__} {d!r}")
    if d < 1:
        raise ValueError(f"{name} must be >= 1, got {d}")
    return int(d)


def _check_pair(name: str, shape) -> Optional[Tuple[int, int]]:
    """``a_shape`` / ``b_shape``: None or two positive ints (a tuple or a list)."""
    if shape is None:
        return None
    if isinstance(shape, torch.Size):
        shape = tuple(shape)
    if not isinstance(shape, (tuple, list)):
        raise TypeError(f"{name} must be a pair of ints (out, in) or None, got "
                        f"{type(shape).__name__} {shape!r}")
    if len(shape) != 2:
        raise ValueError(f"{name} must be a pair (out, in), got {len(shape)} values "
                         f"{tuple(shape)}")
    for v in shape:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{name} must be a pair of ints (out, in), got {tuple(shape)!r} "
                            f"({type(v).__name__} {v!r})")
    if min(shape) < 1:
        raise ValueError(f"{name} must have dimensions >= 1, got {tuple(shape)}")
    return int(shape[0]), int(shape[1])


def _resolve_shapes(d_in: int, d_out: int, a_shape, b_shape) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    a_shape = _check_pair("a_shape", a_shape)
    b_shape = _check_pair("b_shape", b_shape)
    if a_shape is None and b_shape is None:
        ao, bo = factorize(d_out)
        ai, bi = factorize(d_in)
        return (ao, ai), (bo, bi)
    if a_shape is None:
        bo, bi = b_shape
        if d_out % bo or d_in % bi:
            raise ValueError(f"b_shape {tuple(b_shape)} does not divide (d_out, d_in) = "
                             f"({d_out}, {d_in})")
        return (d_out // bo, d_in // bi), (bo, bi)
    ao, ai = a_shape
    if b_shape is None:
        if d_out % ao or d_in % ai:
            raise ValueError(f"a_shape {tuple(a_shape)} does not divide (d_out, d_in) = "
                             f"({d_out}, {d_in})")
        return (ao, ai), (d_out // ao, d_in // ai)
    bo, bi = b_shape
    if ao * bo != d_out or ai * bi != d_in:
        raise ValueError(
            f"a_shape {tuple(a_shape)} and b_shape {tuple(b_shape)} give a "
            f"({ao * bo}, {ai * bi}) update, but the layer is (d_out, d_in) = ({d_out}, {d_in})")
    return (ao, ai), (bo, bi)


class _KronFactors:
    """Mixin: the A, B factors of a Kronecker adapter (nn.Module subclasses only)."""

    INITS = PAIR_INITS

    def _init_factors(self, a_shape, b_shape, init: str, dtype, device,
                      accepted: Tuple[str, ...] = PAIR_INITS):
        check_init(init, accepted, type(self).__name__)
        self.A = nn.Parameter(torch.empty(*a_shape, dtype=dtype, device=device))
        self.B = nn.Parameter(torch.empty(*b_shape, dtype=dtype, device=device))
        self.init = init
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_pair_(self.A, self.B, self.init)  # paper table 4 / LyCORIS

    def delta_weight(self) -> torch.Tensor:
        """``scale · A ⊗ B`` in (out, in) layout (materialised: for merge and inspection)."""
        # (contiguous: torch.kron raises on a transposed factor, e.g. one loaded with
        # load_state_dict(assign=True))
        return self.scale * kron_delta_weight(self.A.contiguous(), self.B.contiguous())


class KronALinear(_KronFactors, WrappedLinear):
    """KronA around a frozen linear layer: ``y = x Wᵀ + b + s · (A ⊗ B) x``.

    Args:
        base: nn.Linear, or transformers' Conv1D (GPT-2; its (in, out) weight is used through a
            transposed view). Its parameters are frozen.
        a_shape: (a_out, a_in) of A; b_shape: (b_out, b_in) of B. Either may be omitted and is
            then derived; with both omitted, each width is split by :func:`factorize`.
        scale: s (default 1). init: "zero" (A kaiming-uniform, B = 0) or "random".
        backend: forwarded to :func:`kfused.krona_linear` (None = auto / $KFUSED_BACKEND).
    """

    # exact= of krona_linear (None: its default; kfused.integration.set_exact sets it)
    exact: Optional[bool] = None

    def __init__(self, base: nn.Module, a_shape: Optional[Tuple[int, int]] = None,
                 b_shape: Optional[Tuple[int, int]] = None, scale: float = 1.0,
                 init: str = "zero", backend: Optional[str] = None):
        super().__init__(base)
        d_in, d_out = linear_dims(base)
        a_shape, b_shape = _resolve_shapes(d_in, d_out, a_shape, b_shape)
        self.scale = check_scale(scale)
        self.backend = check_backend_name(backend)
        w = base.weight
        self._init_factors(a_shape, b_shape, init, w.dtype, w.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            return self.base(x)
        w = linear_weight(self.base)
        A, B = self.A, self.B
        x = autocast_input(x)
        if x.dtype != w.dtype:  # e.g. autocast: compute in the activation dtype
            w = w.to(x.dtype)
        if x.dtype != A.dtype:  # e.g. float32 adapter factors on a bf16 base
            A, B = A.to(x.dtype), B.to(x.dtype)
        bias = self.base.bias
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        return krona_linear(x, w, bias, A, B, self.scale, backend=self.backend,
                            exact=self.exact)

    def extra_repr(self) -> str:
        return (f"A={tuple(self.A.shape)}, B={tuple(self.B.shape)}, scale={self.scale}, "
                f"merged={self.merged}")


class KronABlock(_KronFactors, nn.Module):
    """KronA^B / KronA^B_res: a Kronecker adapter parallel to a whole block (e.g. an FFN).

    ``y = block(x) + s · (A ⊗ B) x [+ bias] [+ s_res · x]``. Not mergeable (the block is not
    linear).

    Args:
        block: the frozen module (its parameters are frozen); called as ``block(x)``.
        d_in, d_out: the block's input and output widths (d_out defaults to d_in).
        a_shape, b_shape, scale, backend: as in :class:`KronALinear`.
        bias: add a learnable output bias (zero-initialised).
        residual: KronA^B_res — add ``s_res · x`` with a learnable ``s_res`` initialised to 1
            (needs d_in == d_out). That term makes every start non-exact, so KronA^B_res
            honours init "random" only.
        init: :meth:`inits_for` lists the accepted values; None: the first of them ("zero"
            for KronA^B, "random" for KronA^B_res).
    """

    @staticmethod
    def inits_for(residual: bool) -> Tuple[str, ...]:
        return ("random",) if residual else PAIR_INITS

    def __init__(self, block: nn.Module, d_in: int, d_out: Optional[int] = None,
                 a_shape: Optional[Tuple[int, int]] = None,
                 b_shape: Optional[Tuple[int, int]] = None, scale: float = 1.0,
                 bias: bool = False, residual: bool = False, init: Optional[str] = None,
                 backend: Optional[str] = None, dtype: Optional[torch.dtype] = None,
                 device=None):
        super().__init__()
        d_in = _check_width("d_in", d_in)
        d_out = d_in if d_out is None else _check_width("d_out", d_out)
        if residual and d_in != d_out:
            raise ValueError(f"residual (KronA^B_res) needs d_in == d_out, got {d_in} and {d_out}")
        if not isinstance(block, nn.Module):
            raise TypeError(f"block must be an nn.Module, got {type(block).__name__}")
        check_block_widths(block, d_in, d_out,
                           f"the adapter was given (d_in, d_out) = ({d_in}, {d_out})")
        a_shape, b_shape = _resolve_shapes(d_in, d_out, a_shape, b_shape)
        self.d_in, self.d_out = d_in, d_out
        self.block = block
        for p in block.parameters():
            p.requires_grad_(False)
        ref = next(iter(block.parameters()), None)
        dtype = dtype or (ref.dtype if ref is not None else torch.get_default_dtype())
        device = device or (ref.device if ref is not None else None)
        self.scale = check_scale(scale)
        self.backend = check_backend_name(backend)
        accepted = self.inits_for(residual)
        self._init_factors(a_shape, b_shape, init or accepted[0], dtype, device, accepted)
        self.bias = nn.Parameter(torch.zeros(d_out, dtype=dtype, device=device)) if bias else None
        self.res_scale = (nn.Parameter(torch.ones((), dtype=dtype, device=device))
                          if residual else None)

    def reset_parameters(self) -> None:
        """A, B by the module's init, the output bias 0 and s_res 1 (as constructed; after the
        meta-device recipe, to_empty then reset_parameters(), these two held uninitialised
        memory)."""
        super().reset_parameters()
        with torch.no_grad():
            if getattr(self, "bias", None) is not None:
                self.bias.zero_()
            if getattr(self, "res_scale", None) is not None:
                self.res_scale.fill_(1.0)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        y = self.block(x, *args, **kwargs)
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"KronABlock: the block returned {type(y).__name__}; the adapter "
                            "adds to a block that returns one tensor")
        want = (*x.shape[:-1], self.d_out)
        if tuple(y.shape) != want:
            # never broadcast: a width-1 (or otherwise mis-shaped) block output would silently
            # take the adapter's shape
            raise ValueError(f"KronABlock: the block returned shape {tuple(y.shape)} for x of "
                             f"shape {tuple(x.shape)}, expected {want} (x's leading dimensions "
                             f"and d_out={self.d_out})")
        A, B = self.A, self.B
        xa = autocast_input(x)
        if xa.dtype != A.dtype:
            A, B = A.to(xa.dtype), B.to(xa.dtype)
        out = y + (self.scale * kron_matvec(xa, A, B, backend=self.backend)).to(y.dtype)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        if self.res_scale is not None:
            # in the block output's dtype, as the adapter term: under autocast a float32 x
            # made the whole output float32
            out = out + (self.res_scale.to(x.dtype) * x).to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return (f"A={tuple(self.A.shape)}, B={tuple(self.B.shape)}, scale={self.scale}, "
                f"bias={self.bias is not None}, residual={self.res_scale is not None}")
