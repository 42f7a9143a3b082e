"""Small helpers over optimizers that the engines share (public APIs only)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer


def unwrapped(optimizer: Any) -> torch.optim.Optimizer:
    """The optimizer behind Lightning's wrapper (its public ``optimizer`` property)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def optimizer_state_to(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move every tensor of ``optimizer``'s state to ``device`` (AdamW's scalar ``step`` stays where torch keeps it:
    on the CPU unless the optimizer is capturable or fused)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not (key == "step" and value.dim() == 0):
                state[key] = value.to(device)


def regrouped(groups: list[dict[str, Any]], params: Sequence[Any] | None = None) -> list[dict[str, Any]]:
    """``groups``' settings over ``params`` taken in order, as many per group as it holds; by default the parameters'
    numbers, as a state dict lists them."""
    params = range(sum(len(g["params"]) for g in groups)) if params is None else params
    result, start = [], 0
    for group in groups:
        count = len(group["params"])
        result.append({k: v for k, v in group.items() if k != "params"} | {"params": list(params[start:start + count])})
        start += count
    return result
