"""The public functional API: one module per op (torch.library custom ops, autograd,
validation and backend dispatch).

    kron_matvec, krona_linear                          Kronecker adapter (docs/math.md §1)
    headwise_qkv, headwise_projection, headwise_oproj, headwise_lowrank, HeadFactors
                                                       per-head low-rank updates (docs/math.md §2)
    inducer_attention, inducer_attention_varlen,       inducer attention, prefix (docs/math.md §3);
    inducer_output_projection                          packed variable-length batches
"""

from kfused.ops import _cache_tag
from kfused.ops.headwise_lowrank import headwise_lowrank
from kfused.ops.headwise_oproj import headwise_oproj
from kfused.ops.headwise_projection import headwise_projection
from kfused.ops.headwise_qkv import headwise_qkv
from kfused.ops.inducer_attention import inducer_attention, inducer_attention_varlen
from kfused.ops.inducer_output_projection import inducer_output_projection
from kfused.ops.kron_matvec import kron_matvec
from kfused.ops.krona_linear import check_scale, krona_linear
from kfused.reference.headwise import HeadFactors

_cache_tag.install()

__all__ = ["kron_matvec", "krona_linear", "check_scale", "headwise_qkv", "headwise_projection",
           "headwise_oproj", "headwise_lowrank", "HeadFactors", "inducer_attention",
           "inducer_attention_varlen", "inducer_output_projection"]
