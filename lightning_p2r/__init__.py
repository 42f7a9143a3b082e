"""lightning-p2r: Pseudo-to-Real training, granular offload and sharding for MoE language models on Lightning."""

from typing import TYPE_CHECKING, Any

from lightning.pytorch.strategies import StrategyRegistry

from .callbacks import PseudoToReal, Throughput
from .causal_lm import CausalLMModule
from .data import TextDataModule
from .known_warnings import silence_known_noise
from .models import M6Config, M6Output, M6Transformer
from .module import M6LanguageModel, OptimizerConfig
from .sharing import delink

if TYPE_CHECKING:
    from .strategy import P2RStrategy


def __getattr__(name: str) -> Any:
    # The strategy (and torch.distributed's machinery behind it) loads on first use, so that the planner and the
    # layout rulebook (``lightning_p2r.planning``, ``lightning_p2r.layout``) import without it.
    if name == "P2RStrategy":
        from .strategy import P2RStrategy
        return P2RStrategy
    raise AttributeError(f"module 'lightning_p2r' has no attribute {name!r}")


def _build_strategy(**options: Any) -> Any:
    from .strategy import P2RStrategy
    return P2RStrategy(**options)


# Trainer(strategy="p2r") and `strategy: p2r` in YAML resolve through Lightning's registry, which builds the strategy
# by calling what is registered: a function importing it then.
if "p2r" not in StrategyRegistry:
    StrategyRegistry.register("p2r", _build_strategy,
                              description="lightning_p2r: granular offload (nothing offloaded unless configured)")
if "p2r_offload" not in StrategyRegistry:
    StrategyRegistry.register("p2r_offload", _build_strategy,
                              description="lightning_p2r: half the blocks offloaded to host memory",
                              offload_fraction=0.5)
silence_known_noise()

__version__ = "0.1.0"

__all__ = [
    "CausalLMModule",
    "M6Config",
    "M6LanguageModel",
    "M6Output",
    "M6Transformer",
    "OptimizerConfig",
    "P2RStrategy",
    "PseudoToReal",
    "Throughput",
    "TextDataModule",
    "__version__",
    "delink",
]
