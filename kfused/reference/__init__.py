"""PyTorch references of every docs/math.md formula: float64-capable oracles and CPU fallbacks."""

from kfused.reference.inducer import (inducer_attention_ref, inducer_attention_varlen_ref,
                                      inducer_output_projection_ref)
from kfused.reference.krona import kron_delta_weight, kron_matvec_ref, krona_linear_ref
from kfused.reference.headwise import (HeadFactors, headwise_lowrank_ref, headwise_oproj_ref,
                                       headwise_qkv_ref, oproj_delta_weight,
                                       projection_delta_weight)

__all__ = ["kron_matvec_ref", "krona_linear_ref", "kron_delta_weight", "HeadFactors",
           "headwise_lowrank_ref", "headwise_qkv_ref", "headwise_oproj_ref",
           "projection_delta_weight", "oproj_delta_weight", "inducer_attention_ref",
           "inducer_attention_varlen_ref", "inducer_output_projection_ref"]
