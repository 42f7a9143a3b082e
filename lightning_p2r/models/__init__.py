"""Pure PyTorch model code: nothing here imports Lightning or torch.distributed. ``M6Config`` (``models.config``)
needs not even torch: the planner and the layout rulebook read it without loading the model code, which is why the
names below load on first use (PEP 562)."""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .config import M6Config

if TYPE_CHECKING:
    from .attention import CausalSelfAttention, band_chunk_size, banded_attention, local_causal_mask
    from .moe import MoEFeedForward, MoEOutput, RoutingStats
    from .transformer import Block, M6Output, M6Transformer

_LAZY = {"CausalSelfAttention": ".attention", "band_chunk_size": ".attention", "banded_attention": ".attention",
         "local_causal_mask": ".attention", "MoEFeedForward": ".moe", "MoEOutput": ".moe", "RoutingStats": ".moe",
         "Block": ".transformer", "M6Output": ".transformer", "M6Transformer": ".transformer"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'lightning_p2r.models' has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "Block",
    "CausalSelfAttention",
    "M6Config",
    "M6Output",
    "M6Transformer",
    "MoEFeedForward",
    "MoEOutput",
    "RoutingStats",
    "band_chunk_size",
    "banded_attention",
    "local_causal_mask",
]
