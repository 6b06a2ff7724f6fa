"""Check cases for `kfused check`: every fused kernel against the float64 reference (SPEC §4).

Each op registers a function ``(device) -> list[CheckCase]`` with :func:`register`. A case
names the backend it exercises; `kfused check` runs it for every dtype the device supports.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Mapping, Optional, Sequence

import torch


@dataclasses.dataclass
class CheckCase:
    op: str
    label: str                              # shape description
    backend: str                            # "triton" or "cuda"
    kernel_fn: Callable
    ref_fn: Callable
    inputs: Mapping[str, object]            # float64 CPU tensors (+ other arguments)
    grad_names: Optional[Sequence[str]] = None


_REGISTRY: Dict[str, Callable[[torch.device], List[CheckCase]]] = {}


def register(op: str):
    def deco(fn):
        _REGISTRY[op] = fn
        return fn
    return deco


def all_cases(device: torch.device, ops: Optional[Sequence[str]] = None) -> List[CheckCase]:
    out: List[CheckCase] = []
    for name, fn in _REGISTRY.items():
        if ops and name not in ops:
            continue
        out.extend(fn(device))
    return out


def registered_ops() -> List[str]:
    return list(_REGISTRY)


# ------------------------------------------------------------------------------------------
# KronA


@register("krona")
def _krona_cases(device: torch.device) -> List[CheckCase]:
    from kfused.ops.krona import kron_matvec, krona_linear
    from kfused.reference.krona import kron_matvec_ref, krona_linear_ref

    g = torch.Generator().manual_seed(0)
    T = 1000 if device.type == "cuda" else 33
    cases = []
    for shape in [(24, 24, 32, 32), (32, 24, 24, 32), (2, 384, 384, 2), (3, 5, 7, 2)]:
        a_out, a_in, b_out, b_in = shape
        x = torch.randn(T, a_in * b_in, generator=g, dtype=torch.float64)
        A = torch.randn(a_out, a_in, generator=g, dtype=torch.float64)
        B = torch.randn(b_out, b_in, generator=g, dtype=torch.float64)
        W = torch.randn(a_out * b_out, a_in * b_in, generator=g, dtype=torch.float64)
        W /= (a_in * b_in) ** 0.5
        bias = torch.randn(a_out * b_out, generator=g, dtype=torch.float64)
        label = f"T={T} A={a_out}x{a_in} B={b_out}x{b_in}"
        for be in ("triton", "cuda"):
            cases.append(CheckCase("kron_matvec", label, be,
                                   lambda x, A, B, be=be: kron_matvec(x, A, B, backend=be),
                                   kron_matvec_ref, {"x": x, "A": A, "B": B}))
        cases.append(CheckCase(
            "krona_linear", label, "triton",
            lambda **kw: krona_linear(**kw, scale=0.5, backend="triton"),
            lambda **kw: krona_linear_ref(**kw, scale=0.5),
            {"x": x, "weight": W, "bias": bias, "A": A, "B": B}, ["x", "A", "B"]))
    return cases


@register("headwise")
def _headwise_cases(device: torch.device) -> List[CheckCase]:
    from kfused.ops.headwise import check_cases

    return check_cases(device)


@register("inducer_attention")
def _inducer_cases(device: torch.device) -> List[CheckCase]:
    from kfused.ops.inducer import check_cases

    return check_cases(device)
