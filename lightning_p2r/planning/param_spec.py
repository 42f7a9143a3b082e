"""One parameter tensor as the planner counts it (shared by the M6 count and the Hugging Face one)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor of the model and how the strategy splits it."""

    name: str
    shape: tuple[int, ...]
    owner: str
    """"block" (a transformer block's dense parameters), "expert" (an MoE layer's experts) or "root" (embedding,
    positions, final norm, head)."""
    block: int | None = None
    """The unique block it belongs to (None outside the blocks)."""
    tensor_dim: int | None = None
    """The dimension tensor parallelism splits (None: replicated over the tensor-parallel ranks)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)
