"""lightning-p2r: Pseudo-to-Real training, granular offload and sharding for MoE language models on Lightning."""

import sys
from importlib import import_module
from typing import TYPE_CHECKING, Any

from .console.known_warnings import silence_known_noise

if TYPE_CHECKING:
    from .callbacks import PseudoToReal, Throughput
    from .causal_lm import CausalLMModule
    from .data import TextDataModule
    from .models import M6Config, M6Output, M6Transformer
    from .module import M6LanguageModel, OptimizerConfig
    from .sharing import delink
    from .strategy import P2RStrategy

# The public names load on first use (PEP 562), so that the parts that need neither torch nor Lightning (the layout
# rulebook, ``lightning_p2r.layout``) import without them.
_PUBLIC = {
    "CausalLMModule": ".causal_lm", "M6Config": ".models", "M6LanguageModel": ".module", "M6Output": ".models",
    "M6Transformer": ".models", "OptimizerConfig": ".module", "P2RStrategy": ".strategy",
    "PseudoToReal": ".callbacks", "Throughput": ".callbacks", "TextDataModule": ".data", "delink": ".sharing",
}


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'lightning_p2r' has no attribute {name!r}")
    register_strategies()
    value = getattr(import_module(_PUBLIC[name], __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def _build_strategy(**options: Any) -> Any:
    from .strategy import P2RStrategy
    return P2RStrategy(**options)


def register_strategies() -> None:
    """Make ``Trainer(strategy="p2r")`` and ``strategy: p2r`` in YAML resolve through Lightning's registry, which
    builds the strategy by calling what is registered (a function importing it then). Idempotent."""
    from lightning.pytorch.strategies import StrategyRegistry

    if "p2r" not in StrategyRegistry:
        StrategyRegistry.register("p2r", _build_strategy,
                                  description="lightning_p2r: granular offload (nothing offloaded unless configured)")
    if "p2r_offload" not in StrategyRegistry:
        StrategyRegistry.register("p2r_offload", _build_strategy,
                                  description="lightning_p2r: half the blocks offloaded to host memory",
                                  offload_fraction=0.5)
    silence_known_noise()


if "lightning" in sys.modules:  # Lightning is loaded already: registering costs nothing
    register_strategies()

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
