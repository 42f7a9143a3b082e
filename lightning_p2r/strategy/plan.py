"""Which blocks live on the device and which in host memory, for a model in hand: its blocks' footprints and the
device's memory, handed to the rulebook's pure plan (``lightning_p2r.layout.plan_offload``).

M6-10T's granular offloading keeps only *some* layers in host memory, so the bytes streamed per step stay small
and most compute never waits. The planner turns one of three user inputs into a set of offloaded block indices:

- ``offload_fraction``: that share of the blocks, spread evenly through the depth;
- ``offload_blocks``: an explicit list;
- ``device_memory_budget``: as many device-resident blocks as fit (offloading an evenly spread set, the fewest
  that make the plan fit), given everything else the device must hold (non-block parameters with their
  gradients and optimizer states, an activation allowance, and streaming buffers for ``prefetch + 1``
  offloaded blocks).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ..layout import BlockFootprint, OffloadPlan, device_bytes_needed, parse_bytes, plan_offload


def parameter_footprint(params: list[nn.Parameter], optimizer_bytes_per_param: int) -> BlockFootprint:
    numel = sum(p.numel() for p in params)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    return BlockFootprint(param_bytes, param_bytes, numel * optimizer_bytes_per_param)


def block_footprints(blocks: nn.ModuleList, optimizer_bytes_per_param: int = 8) -> list[BlockFootprint]:
    """Footprint per block; AdamW keeps two fp32 moments, 8 bytes per parameter."""
    return [parameter_footprint([p for p in block.parameters() if p.requires_grad], optimizer_bytes_per_param)
            for block in blocks]


def device_total_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan_for_model(model: nn.Module, blocks: nn.ModuleList, device: torch.device, *,
                   offload_fraction: float | None, offload_blocks: list[int] | None,
                   device_memory_budget: int | str | None, activation_allowance: int | str,
                   prefetch: int) -> OffloadPlan:
    """The offload plan for ``model`` (whose block sequence is ``blocks``) as it is now, also after delinking
    changed its blocks. A budget may be a share of ``device``'s memory, and must also hold the trainable
    parameters outside the blocks, which always stay on the device."""
    budget = None
    footprints = block_footprints(blocks)
    other = []
    if device_memory_budget is not None:
        budget = parse_bytes(device_memory_budget, total=device_total_memory(device))
        in_blocks = {id(p) for p in blocks.parameters()}
        other = [p for p in model.parameters() if id(p) not in in_blocks and p.requires_grad]
    return plan_offload(
        len(blocks), offload_fraction=offload_fraction, offload_blocks=offload_blocks,
        budget_bytes=budget, footprints=footprints,
        other_bytes=parameter_footprint(other, 8).total if other else 0,
        activation_bytes=parse_bytes(activation_allowance, name="activation_allowance"),
        prefetch=prefetch,
    )


# ------------------------------------------------------------------------------------ P2RStrategy's options
# Checked when the strategy is built, so a bad option fails before any process group or model exists; the
# messages name the strategy's own arguments.


def resolve_pin_memory(pin_memory: bool | str, device: torch.device) -> bool:
    """Whether host buffers are page-locked: "auto" pins only with an accelerator (CPU-only torch cannot pin)."""
    if pin_memory == "auto":
        return device.type == "cuda"
    if pin_memory and device.type == "cpu":
        raise ValueError("P2RStrategy(pin_memory=True) needs an accelerator: CPU-only torch cannot pin memory; "
                         "use pin_memory='auto' or False")
    return bool(pin_memory)


def format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    return f"{count:.1f} TiB"


def setup_summary(*, engine: str, sharding: str, world_size: int, plan: OffloadPlan, model: nn.Module,
                  blocks: nn.ModuleList, prefetch: int, budget: int | None) -> str:
    """The one line P2RStrategy logs at setup: which engine, which layout, which blocks live in host memory, and the
    model-state bytes (parameters, gradients, AdamW states) the plan keeps on each rank's device, against the
    budget. Sharded layouts divide the states by the ranks (FSDP2's shards at rest)."""
    footprints = block_footprints(blocks)
    in_blocks = {id(p) for p in blocks.parameters()}
    other = [p for p in model.parameters() if id(p) not in in_blocks and p.requires_grad]
    other_bytes = parameter_footprint(other, 8).total if other else 0
    device = device_bytes_needed(footprints, plan.offloaded, other_bytes, 0, prefetch)
    if sharding in ("zero2", "zero3"):
        device //= world_size
    offloaded = list(plan.offloaded)
    limit = "no budget" if budget is None else f"budget {format_bytes(budget)}"
    return (f"P2RStrategy: engine {engine}, sharding {sharding} on {world_size} process(es), offloaded blocks "
            f"{offloaded} of {plan.num_blocks}, planned device model states {format_bytes(device)} per rank "
            f"({limit})")
