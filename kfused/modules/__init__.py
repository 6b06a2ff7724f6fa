"""nn.Modules: they own adapter parameters and call the functional ops."""

from kfused.modules.krona import KronABlock, KronALinear, factorize

__all__ = ["KronALinear", "KronABlock", "factorize"]
