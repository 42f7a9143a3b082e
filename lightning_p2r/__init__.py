"""lightning-p2r: Pseudo-to-Real training, granular offload and sharding for MoE language models on Lightning."""

from .callbacks import PseudoToReal
from .data import TextDataModule
from .models import M6Config, M6Output, M6Transformer
from .module import M6LanguageModel, OptimizerConfig
from .sharing import delink

__version__ = "0.1.0"

__all__ = [
    "M6Config",
    "M6LanguageModel",
    "M6Output",
    "M6Transformer",
    "OptimizerConfig",
    "PseudoToReal",
    "TextDataModule",
    "__version__",
    "delink",
]
