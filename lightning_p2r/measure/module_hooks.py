"""``module_hook_overhead``, measured: what FSDP2's hooks cost per unit and micro-batch, beyond the unit's work.

A stack of tiny blocks (two norms and two linear layers of width 16: eight parameter tensors, as a transformer
block has) trains forward and backward over a few micro-batches, once plain and once with every block and the
stack's root wrapped by ``fully_shard`` over a mesh of this rank alone. The model work is the same and negligible,
and a one-rank mesh issues no collective the cost model prices apart, so the difference is the hooks' Python:
gathering into and out of the unit's buffers, registering and running the backward hooks, the gradient's
reduce-scatter bookkeeping. It is the mean over ZeRO-2's units (kept gathered after forward) and ZeRO-3's
(resharded after forward and gathered again for backward). ``calibrate`` runs it in every process at once, so an
oversubscribed CPU's share of a core is already in it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .run import median_seconds

HOOK_UNITS = 12
"""Blocks in the measured stack (each one FSDP2 unit; the root is one more)."""
HOOK_MICRO_BATCHES = 4
HOOK_WIDTH = 16


def hook_call_overhead(plain_s: float, hooked_s: float, hooked_modules: int, micro_batches: int) -> float:
    """Seconds per hooked module and micro-batch: the hooked step (``hooked_s``) less the plain one (``plain_s``),
    over the hooked modules times micro-batches; never below 0 (timing noise)."""
    if hooked_modules < 1 or micro_batches < 1:
        raise ValueError(f"hooked_modules and micro_batches must be >= 1, got {hooked_modules} and {micro_batches}")
    return max(hooked_s - plain_s, 0.0) / (hooked_modules * micro_batches)


def hook_stack(device: torch.device) -> nn.Sequential:
    def block() -> nn.Module:
        return nn.Sequential(nn.LayerNorm(HOOK_WIDTH), nn.Linear(HOOK_WIDTH, HOOK_WIDTH), nn.LayerNorm(HOOK_WIDTH),
                             nn.Linear(HOOK_WIDTH, HOOK_WIDTH))

    return nn.Sequential(*[block() for _ in range(HOOK_UNITS)]).to(device)


def hooked_step_seconds(model: nn.Module, batch: torch.Tensor, repeats: int,
                        loss: Callable[[Any], torch.Tensor] = torch.sum) -> float:
    """The median time of one step of ``HOOK_MICRO_BATCHES`` forward and backward passes of ``loss(model(batch))``
    (standard accumulation: the gradient is reduced after the last one only)."""
    def step() -> None:
        for index in range(HOOK_MICRO_BATCHES):
            if hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(index == HOOK_MICRO_BATCHES - 1)
            loss(model(batch)).backward()

    return median_seconds(step, warmup=3, iters=repeats, device=batch.device)


def module_hook_seconds(device: torch.device, mesh: Any, repeats: int) -> float:
    """FSDP2's cost per hooked module and micro-batch on ``device``, its units sharded over ``mesh`` (a mesh of
    this rank alone: see the module docstring)."""
    from torch.distributed.fsdp import fully_shard

    batch = torch.randn(4, HOOK_WIDTH, device=device)
    torch.manual_seed(0)
    plain = hooked_step_seconds(hook_stack(device), batch, repeats)
    overheads = []
    for reshard in (False, True):
        torch.manual_seed(0)
        model = hook_stack(device)
        for block in model:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        hooked = hooked_step_seconds(model, batch, repeats)
        overheads.append(hook_call_overhead(plain, hooked, HOOK_UNITS + 1, HOOK_MICRO_BATCHES))
    return sum(overheads) / len(overheads)


def own_rank_mesh(device: torch.device) -> Any:
    """A device mesh of this rank alone, inside an initialized process group (every rank must call it: each
    one-rank group is created by all of them, in the same order)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    groups = [dist.new_group([rank]) for rank in range(dist.get_world_size())]
    return DeviceMesh.from_group(groups[dist.get_rank()], device.type)
