"""Which blocks live on the device and which in host memory: a pure function of sizes and a budget.

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
from dataclasses import dataclass

import torch
from torch import nn

from ..layout import offload_count, parse_bytes, spread


@dataclass(frozen=True)
class BlockFootprint:
    """Bytes one block needs while it is resident and trained."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int

    @property
    def total(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def streaming(self) -> int:
        """What an offloaded block occupies on the device while it runs: parameters and, in backward, gradients."""
        return self.param_bytes + self.grad_bytes


@dataclass(frozen=True)
class OffloadPlan:
    num_blocks: int
    offloaded: tuple[int, ...]

    @property
    def resident(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_blocks) if i not in self.offloaded)


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


def plan_offload(
    num_blocks: int,
    *,
    offload_fraction: float | None = None,
    offload_blocks: list[int] | None = None,
    budget_bytes: int | None = None,
    footprints: list[BlockFootprint] | None = None,
    other_bytes: int = 0,
    activation_bytes: int = 0,
    prefetch: int = 1,
) -> OffloadPlan:
    """Choose the offloaded blocks from exactly one of fraction, explicit list or budget."""
    given = [name for name, value in (("offload_fraction", offload_fraction), ("offload_blocks", offload_blocks),
                                      ("device_memory_budget", budget_bytes)) if value is not None]
    if len(given) > 1:
        raise ValueError(f"give one of offload_fraction, offload_blocks, device_memory_budget; got {given}")
    if offload_blocks is not None:
        bad = [i for i in offload_blocks if not 0 <= i < num_blocks]
        if bad:
            raise ValueError(f"offload_blocks {bad} are not block indices of a model with {num_blocks} blocks")
        return OffloadPlan(num_blocks, tuple(sorted(set(offload_blocks))))
    if budget_bytes is not None:
        if footprints is None:
            raise ValueError("a device_memory_budget plan needs the blocks' footprints")
        return _plan_for_budget(footprints, budget_bytes, other_bytes, activation_bytes, prefetch)
    fraction = offload_fraction or 0.0
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"offload_fraction must be in [0, 1], got {fraction}")
    # Half rounds up (Python's round() would send 0.5 of one block to 0 and 0.5 of three blocks to 2).
    return OffloadPlan(num_blocks, spread(offload_count(fraction, num_blocks), num_blocks))


def device_bytes_needed(footprints: list[BlockFootprint], offloaded: tuple[int, ...], other_bytes: int,
                        activation_bytes: int, prefetch: int) -> int:
    """Model-state bytes on the device under a plan (plus the activation allowance)."""
    resident = sum(f.total for i, f in enumerate(footprints) if i not in offloaded)
    largest_streamed = max((footprints[i].streaming for i in offloaded), default=0)
    streaming = min(prefetch + 1, len(offloaded)) * largest_streamed
    return other_bytes + activation_bytes + resident + streaming


def _plan_for_budget(footprints: list[BlockFootprint], budget: int, other_bytes: int, activation_bytes: int,
                     prefetch: int) -> OffloadPlan:
    num_blocks = len(footprints)
    # Try the most resident blocks first; for each count, offload an evenly spread set.
    for count in range(num_blocks + 1):
        offloaded = spread(count, num_blocks)
        if device_bytes_needed(footprints, offloaded, other_bytes, activation_bytes, prefetch) <= budget:
            return OffloadPlan(num_blocks, offloaded)
    minimum = device_bytes_needed(footprints, tuple(range(num_blocks)), other_bytes, activation_bytes, prefetch)
    raise ValueError(
        f"device_memory_budget of {budget:,} bytes is smaller than the least this model needs with every block "
        f"offloaded: {minimum:,} bytes (non-block states {other_bytes:,}, activation allowance "
        f"{activation_bytes:,}, streaming buffers for {min(prefetch + 1, num_blocks)} block(s)). Raise the "
        "budget, lower prefetch or the activation allowance, or shard the model"
    )


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
def check_fsdp_offload_states(offload_states: set[str]) -> None:
    """On FSDP2 an offloaded block keeps its parameter shard in host memory too (``CPUOffloadPolicy`` moves
    parameters, gradients and optimizer states together), so "params" cannot be left out."""
    if "params" not in offload_states:
        raise ValueError(
            "P2RStrategy: with sharding zero2/zero3, or offloading across processes, an offloaded block keeps its "
            "parameter shard in host memory (FSDP2's CPUOffloadPolicy); offload_states must include 'params'")


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
