"""Pure PyTorch model code: nothing here imports Lightning or torch.distributed."""

from .attention import CausalSelfAttention, band_chunk_size, banded_attention, local_causal_mask
from .config import M6Config
from .moe import MoEFeedForward, MoEOutput, RoutingStats
from .transformer import Block, M6Output, M6Transformer

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
