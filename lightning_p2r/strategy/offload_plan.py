"""Which blocks live on the device and which in host memory, for a model in hand: its blocks' footprints and the
device's memory, handed to the rulebook's pure plan (``lightning_p2r.layout.plan_offload``).
"""

from __future__ import annotations

import os
from collections.abc import Collection

import torch
from torch import nn

from ..layout import BlockFootprint, OffloadPlan, parse_bytes, plan_offload
from .options import OffloadConfig

OPTIMIZER_MOMENTS = 2
"""AdamW keeps two moments per parameter, each of the parameter's dtype (8 bytes for an fp32 parameter, 4 for a
bf16 one under ``precision="bf16-true"``)."""


def parameter_footprint(params: list[nn.Parameter], optimizer_moments: int = OPTIMIZER_MOMENTS) -> BlockFootprint:
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    return BlockFootprint(param_bytes, param_bytes, optimizer_moments * param_bytes)


def block_footprints(blocks: nn.ModuleList, optimizer_moments: int = OPTIMIZER_MOMENTS) -> list[BlockFootprint]:
    """Footprint per block: its trainable parameters, their gradients and the optimizer's moments."""
    return [parameter_footprint([p for p in block.parameters() if p.requires_grad], optimizer_moments)
            for block in blocks]


def outside_blocks_bytes(model: nn.Module, blocks: nn.ModuleList) -> int:
    """Model-state bytes of the trainable parameters outside the blocks (they always stay on the device)."""
    in_blocks = {id(p) for p in blocks.parameters()}
    return parameter_footprint([p for p in model.parameters() if id(p) not in in_blocks and p.requires_grad]).total


def device_total_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan_for_model(model: nn.Module, blocks: nn.ModuleList, device: torch.device, offload: OffloadConfig,
                   mine: Collection[int] | None = None) -> OffloadPlan:
    """The offload options applied to ``model`` (whose block sequence is ``blocks``) as it is now, also after
    delinking. ``mine``: this pipeline rank's blocks (all by default), of which a fraction or a budget is a share;
    ``offload_blocks`` names blocks by their index in the model."""
    own = sorted(range(len(blocks)) if mine is None else mine)
    chosen = offload.offload_blocks
    if chosen is not None and len(own) < len(blocks):
        chosen = [own.index(i) for i in chosen if i in own]
    held = nn.ModuleList([blocks[i] for i in own])
    budget = offload.device_memory_budget
    local = plan_offload(
        len(own), offload_fraction=offload.offload_fraction, offload_blocks=chosen,
        budget_bytes=None if budget is None else parse_bytes(budget, total=device_total_memory(device)),
        footprints=block_footprints(held), other_bytes=outside_blocks_bytes(model, held) if budget is not None else 0,
        activation_bytes=parse_bytes(offload.activation_allowance, name="activation_allowance"),
        prefetch=offload.prefetch)
    return OffloadPlan(len(blocks), tuple(own[i] for i in local.offloaded))
