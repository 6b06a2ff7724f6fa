"""kfused: fused Triton and CUDA C++ kernels for kernel-view adapters.

Functional ops (each takes ``backend="auto" | "triton" | "cuda" | "reference"``; the default
comes from $KFUSED_BACKEND, else "auto"):

    kron_matvec(x, A, B)                            (A ⊗ B) x per token       SPEC §1
    krona_linear(x, weight, bias, A, B, scale)      x Wᵀ + b + s (A ⊗ B) x    SPEC §1

Modules: :mod:`kfused.modules`. References (float64 oracles, CPU fallback):
:mod:`kfused.reference`. The SPEC §4 comparison: :mod:`kfused.testing`.
"""

from kfused import reference
from kfused.backends import BackendError, available_backends
from kfused.modules.krona import KronABlock, KronALinear, factorize
from kfused.ops.krona import kron_matvec, krona_linear

__version__ = "0.1.0"

__all__ = [
    "BackendError", "available_backends", "reference", "__version__",
    "kron_matvec", "krona_linear", "KronALinear", "KronABlock", "factorize",
]
