"""nn.Modules: they own adapter parameters (and their init, merge/unmerge and factorization)
and call the functional ops. Placing them in a model is :mod:`kfused.integration`'s work."""

from kfused.modules.headwise import (HeadwiseConfig, HeadwiseOutput, HeadwiseProjection,
                                     HeadwiseQKV, ProjRanks)
from kfused.modules.inducer import InducerAttention, InducerOutputProjection
from kfused.modules.krona import KronABlock, KronALinear, factorize, factors_for_budget
from kfused.modules.lora import LoRALinear
from kfused.modules.parallel_adapter import ScaledParallelAdapter

__all__ = ["KronALinear", "KronABlock", "factorize", "factors_for_budget", "LoRALinear",
           "HeadwiseConfig",
           "HeadwiseOutput", "HeadwiseProjection", "HeadwiseQKV", "ProjRanks",
           "InducerAttention", "InducerOutputProjection", "ScaledParallelAdapter"]
