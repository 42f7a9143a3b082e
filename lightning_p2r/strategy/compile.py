"""Per-block torch.compile (placeholder until the compile branch lands)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn


def compile_blocks(blocks: nn.ModuleList, indices: Iterable[int] | None = None) -> None:
    for index in range(len(blocks)) if indices is None else indices:
        blocks[index].compile()
