"""PyTorch references of every SPEC formula: float64-capable oracles and CPU fallbacks."""

from kfused.reference.krona import kron_delta_weight, kron_matvec_ref, krona_linear_ref

__all__ = ["kron_matvec_ref", "krona_linear_ref", "kron_delta_weight"]
