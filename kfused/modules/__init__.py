"""nn.Modules: they own adapter parameters and call the functional ops."""

from kfused.modules.headwise import (HeadwiseConfig, HeadwiseOutput, HeadwiseProjection,
                                     HeadwiseQKV, ProjRanks, attach_headwise)
from kfused.modules.headwise_presets import PRESETS as HEADWISE_PRESETS
from kfused.modules.inducer import InducerAttention, InducerOutputProjection
from kfused.modules.krona import KronABlock, KronALinear, factorize
from kfused.modules.lora import LoRALinear

__all__ = ["KronALinear", "KronABlock", "factorize", "LoRALinear", "HeadwiseConfig",
           "HeadwiseOutput", "HeadwiseProjection", "HeadwiseQKV", "ProjRanks", "attach_headwise",
           "HEADWISE_PRESETS", "InducerAttention", "InducerOutputProjection"]
