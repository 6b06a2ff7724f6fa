"""kfused: fused Triton and CUDA C++ kernels for kernel-view adapters.

Functional ops (each with ``backend="auto" | "triton" | "cuda" | "reference"``):
    kron_matvec, krona_linear                      (SPEC §1, Kronecker adapter)

References live in :mod:`kfused.reference`, modules in :mod:`kfused.modules`.
"""

from kfused.backends import BackendError, available_backends
from kfused import reference

__version__ = "0.1.0"

__all__ = ["BackendError", "available_backends", "reference", "__version__"]
