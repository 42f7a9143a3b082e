"""Around FSDP2's units (docs/sharding.md): layered accumulation's stage runner and events, and resharding."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

from .layered import BlockEvents, LayeredStages


class StageRunner(nn.Module):
    """The modules owning parameters outside the blocks (embedding, final norm, head) as one FSDP2 root, which only
    references them. Layered accumulation calls the embedding and head stages directly, and FSDP2 gathers a unit's
    parameters in its forward hooks, so each stage call runs *through* this module's ``forward``."""

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        self.owners = nn.ModuleList(modules)

    def forward(self, stage: Callable[..., Any], *args: Any) -> Any:
        return stage(*args)


def stages_through_runner(stages: LayeredStages, runner: nn.Module | None) -> LayeredStages:
    """``stages`` with the embedding and head called through ``runner`` (the FSDP2 root that holds their
    parameters, see :class:`StageRunner`), so FSDP2 gathers those parameters first; unchanged without a runner."""
    if runner is None:
        return stages
    return dataclasses.replace(stages, embed=lambda mb: runner(stages.embed, mb),
                               head=lambda hidden, context: runner(stages.head, hidden, context))


def modules_outside_blocks(root: nn.Module, blocks: nn.ModuleList) -> list[nn.Module]:
    """Modules under ``root`` that own parameters or buffers directly and are not part of a block."""
    inside = {id(m) for m in blocks.modules()}
    return [m for m in root.modules() if id(m) not in inside and (
        next(m.parameters(recurse=False), None) is not None or next(m.buffers(recurse=False), None) is not None)]


class FSDPEvents(BlockEvents):
    """Layered accumulation on FSDP2: each block is gathered once for the forward of all micro-batches (zero3
    reshards it right after), once for their backward, and its gradient is reduce-scattered once, after the last
    micro-batch. The same for the stage runner's parameters (embedding and head), whose backward opens and closes it."""

    def __init__(self, blocks: nn.ModuleList, runner: nn.Module | None, *, reshard_after_last: bool) -> None:
        self.blocks = blocks
        self.runner = runner
        self.reshard_after_last = reshard_after_last  # zero3 reshards each block after its last forward

    def after_forward(self, block: int) -> None:
        if self.reshard_after_last:
            for unit in fsdp_modules(self.blocks[block]):  # the block, and a unit inside it (experts under EP)
                unit.reshard()

    def before_micro_backward(self, block: int, micro_batch: int, last: bool) -> None:
        module = self.blocks[block]
        module.set_requires_gradient_sync(last, recurse=True)
        module.set_reshard_after_backward(last, recurse=True)

    def before_head_backward(self) -> None:
        if self.runner is not None:
            self.runner.set_requires_gradient_sync(False, recurse=False)
            self.runner.set_reshard_after_backward(False, recurse=False)

    def before_embed_backward(self, micro_batch: int, last: bool) -> None:
        if self.runner is not None and last:
            self.runner.set_requires_gradient_sync(True, recurse=False)
            self.runner.set_reshard_after_backward(True, recurse=False)


def fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def reshard_all(module: nn.Module, runner: nn.Module | None) -> None:
    """Every FSDP2 unit of ``module`` back to its shards, and the stage runner's (which is not inside it): an
    evaluation forward leaves layered blocks gathered, since their own forward hooks never reshard them."""
    for unit in fsdp_modules(module):
        unit.reshard()
    if runner is not None:
        runner.reshard()
