"""Cases for every op family, one module per family (krona, headwise, inducer; e2e for the
end-to-end training step). A family module defines what applies to it:

    check_cases(device) -> list[CheckCase]     `kfused check`: every fused kernel against the
                                               float64 reference (docs/math.md §4), per backend
    aot_launches()                             representative launches for the sm_90 compile
                                               check (kfused.triton_kernels._aot, kfused perf)
    bench_cases(device, dtype, quick) -> list[kfused.bench.BenchCase]
                                               `kfused bench` and benchmarks/bench_<family>.py

The families are loaded by name on first use, so importing this package costs nothing and the
family modules may import the ops, the kernels and the benchmark harness.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, List, Mapping, Optional, Sequence

import torch

# `kfused check` op name -> family module
CHECK_FAMILIES = {"krona": "krona", "headwise": "headwise", "inducer_attention": "inducer"}
# sm_90 compile-check op name -> family module
AOT_FAMILIES = {"krona": "krona", "headwise": "headwise", "inducer_attention": "inducer"}
# `kfused bench` op name (the family itself)
BENCH_FAMILIES = ("e2e", "headwise", "inducer", "krona")


@dataclasses.dataclass
class CheckCase:
    op: str
    label: str                              # shape description
    backend: str                            # "triton" or "cuda"
    kernel_fn: Callable
    ref_fn: Callable
    inputs: Mapping[str, object]            # float64 CPU tensors (+ other arguments)
    grad_names: Optional[Sequence[str]] = None


def family(name: str):
    """The family module ``kfused.cases.<name>``."""
    return importlib.import_module(f"{__name__}.{name}")


def check_ops() -> List[str]:
    return list(CHECK_FAMILIES)


def check_cases(device: torch.device, ops: Optional[Sequence[str]] = None) -> List[CheckCase]:
    """Every family's check cases (only those of ``ops`` when given)."""
    out: List[CheckCase] = []
    for op, fam in CHECK_FAMILIES.items():
        if not ops or op in ops:
            out.extend(family(fam).check_cases(device))
    return out


def aot_drivers() -> dict:
    """op name -> the family's ``aot_launches``."""
    return {op: family(fam).aot_launches for op, fam in AOT_FAMILIES.items()}


def bench_cases(name: str, device, dtype: torch.dtype, quick: bool = False) -> list:
    """The benchmark cases of family ``name`` (one of BENCH_FAMILIES)."""
    if name not in BENCH_FAMILIES:
        raise ValueError(f"no benchmark family {name!r}; expected one of "
                         f"{', '.join(BENCH_FAMILIES)}")
    return family(name).bench_cases(device, dtype, quick=quick)


def regime_of(op: str, shape: Mapping[str, object]) -> Optional[str]:
    """The backend-preference regime of a benchmark case (kfused.backends.measured_order), as
    the op itself computes it for a call of that shape; None for ops without regimes."""
    if op == "inducer_attention":
        from kfused.ops.inducer_attention import regime

        n_q = shape.get("n_q", shape.get("n"))
        return regime(int(n_q)) if n_q is not None else None
    if op == "krona_linear" and "T" in shape:
        from kfused.ops.krona_linear import regime as krona_regime

        # the benchmark's calls: bfloat16 on a GPU, exact=None (kfused.cases.krona)
        factors = None
        if "A" in shape and "B" in shape:
            factors = (*(int(v) for v in shape["A"]), *(int(v) for v in shape["B"]))
        return krona_regime(int(shape["T"]), torch.bfloat16, None, True, factors)
    return None
