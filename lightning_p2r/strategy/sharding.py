"""Around FSDP2's units (docs/sharding.md): layered accumulation's root over the modules outside the blocks and its
events, and resharding."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

from .layered import BlockEvents, LayeredStages


class OutsideBlocksRoot(nn.Module):
    """The modules owning parameters outside the blocks (embedding, final norm, head) as one FSDP2 root, which only
    references them. Layered accumulation calls the embedding and head stages directly, and FSDP2 gathers a unit's
    parameters in its forward hooks, so each stage call runs *through* this module's ``forward``."""

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        self.owners = nn.ModuleList(modules)

    def forward(self, stage: Callable[..., Any], *args: Any) -> Any:
        return stage(*args)


def stages_through_root(stages: LayeredStages, root: nn.Module | None) -> LayeredStages:
    """``stages`` with the embedding and head called through ``root`` (the FSDP2 root that holds their parameters,
    see :class:`OutsideBlocksRoot`), so FSDP2 gathers those parameters first; unchanged without one."""
    if root is None:
        return stages
    return dataclasses.replace(stages, embed=lambda mb: root(stages.embed, mb),
                               head=lambda hidden, context: root(stages.head, hidden, context))


def modules_outside_blocks(root: nn.Module, blocks: nn.ModuleList) -> list[nn.Module]:
    """Modules under ``root`` that own parameters or buffers directly and are not part of a block."""
    inside = {id(m) for m in blocks.modules()}
    return [m for m in root.modules() if id(m) not in inside and (
        next(m.parameters(recurse=False), None) is not None or next(m.buffers(recurse=False), None) is not None)]


class FSDPEvents(BlockEvents):
    """Layered accumulation on FSDP2: each block is gathered once for the forward of all micro-batches (zero3
    reshards it right after), once for their backward, and its gradient is reduce-scattered once, after the last
    micro-batch. The same for the outside root's parameters (embedding and head), whose backward opens and closes it."""

    def __init__(self, blocks: nn.ModuleList, outside_root: nn.Module | None, *, reshard_after_last: bool) -> None:
        self.blocks = blocks
        self.outside_root = outside_root
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
        if self.outside_root is not None:
            self.outside_root.set_requires_gradient_sync(False, recurse=False)
            self.outside_root.set_reshard_after_backward(False, recurse=False)

    def before_embed_backward(self, micro_batch: int, last: bool) -> None:
        if self.outside_root is not None and last:
            self.outside_root.set_requires_gradient_sync(True, recurse=False)
            self.outside_root.set_reshard_after_backward(True, recurse=False)


def fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def recover_from_error(module: nn.Module, outside_root: nn.Module | None) -> None:
    """FSDP2's state as before the step, after a forward or backward raised mid-way: the root left gathered and
    in its forward, which ``reshard`` leaves as it is. ``FSDPModule.reset_iter_state`` (torch >= 2.12) resets it
    and every unit the root forwards; the other units refuse it ("must be called on the root FSDP module"), and
    older torch has none (the blocks are resharded all the same)."""
    for unit in [m for m in (outside_root, *fsdp_modules(module)) if m is not None]:
        if hasattr(unit, "reset_iter_state"):
            with contextlib.suppress(RuntimeError):
                unit.reset_iter_state()
    reshard_all(module, outside_root)


def reshard_all(module: nn.Module, outside_root: nn.Module | None) -> None:
    """Every FSDP2 unit of ``module`` back to its shards, and the outside root's (which is not inside it): an
    evaluation forward leaves layered blocks gathered, since their own forward hooks never reshard them."""
    for unit in fsdp_modules(module):
        unit.reshard()
    if outside_root is not None:
        outside_root.reshard()
