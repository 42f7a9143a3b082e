"""lightning-p2r: Pseudo-to-Real training, granular offload and sharding for MoE language models on Lightning."""

from lightning.pytorch.strategies import StrategyRegistry

from .callbacks import PseudoToReal
from .data import TextDataModule
from .known_warnings import silence_known_noise
from .models import M6Config, M6Output, M6Transformer
from .module import M6LanguageModel, OptimizerConfig
from .sharing import delink
from .strategy import P2RStrategy

# Trainer(strategy="p2r") and `strategy: p2r` in YAML resolve through Lightning's registry.
P2RStrategy.register_strategies(StrategyRegistry)
silence_known_noise()

__version__ = "0.1.0"

__all__ = [
    "M6Config",
    "M6LanguageModel",
    "M6Output",
    "M6Transformer",
    "OptimizerConfig",
    "P2RStrategy",
    "PseudoToReal",
    "TextDataModule",
    "__version__",
    "delink",
]
