"""``module_hook_overhead``, measured: what FSDP2's hooks cost per unit and micro-batch, beyond the unit's work.

A stack of tiny blocks (two norms and two linear layers of width 16: eight parameter tensors, as a transformer
block has) trains forward and backward over a few micro-batches, once plain and once with every block and the
stack's root wrapped by ``fully_shard`` over a mesh of this rank alone. The model work is the same and negligible,
and a one-rank mesh issues no collective the cost model prices apart, so the difference is the hooks' Python:
gathering into and out of the unit's buffers, registering and running the backward hooks, the gradient's
reduce-scatter bookkeeping. It is the mean over ZeRO-2's units (kept gathered after forward) and ZeRO-3's
(resharded after forward and gathered again for backward). ``calibrate`` runs it in every process at once, so an
oversubscribed CPU's share of a core is already in it.

``fsdp_collective_overhead``, measured on several processes: the same stack, one micro-batch per step, over the
mesh of every rank and over each rank alone. Over every rank each unit's gathers and reduce-scatter are real
collectives (a ZeRO-2 unit one of each per step, a ZeRO-3 unit two gathers and one); the difference per call, less
the call's priced link time (:func:`collective_call_overhead`), is what FSDP2 adds to a collective the
microbenchmark times alone: the asynchronous call handed to the process group and waited for, the division and the
copies into and out of its buffers, the bookkeeping around them. On a 2-vCPU machine with gloo it measured 1.4 ms per
call, of which the link's latency prices 0.4 (2026-11-30); a one-rank mesh issues none of it.
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
                        loss: Callable[[Any], torch.Tensor] = torch.sum,
                        micro_batches: int = HOOK_MICRO_BATCHES) -> float:
    """The median time of one step of ``micro_batches`` forward and backward passes of ``loss(model(batch))``
    (standard accumulation: the gradient is reduced after the last one only)."""
    def step() -> None:
        for index in range(micro_batches):
            if hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(index == micro_batches - 1)
            loss(model(batch)).backward()

    return median_seconds(step, warmup=3, iters=repeats, device=batch.device)


def module_hook_seconds(device: torch.device, mesh: Any, repeats: int) -> float:
    """FSDP2's cost per hooked module and micro-batch on ``device``, its units sharded over ``mesh`` (a mesh of
    this rank alone: see the module docstring)."""
    batch = torch.randn(4, HOOK_WIDTH, device=device)
    torch.manual_seed(0)
    plain = hooked_step_seconds(hook_stack(device), batch, repeats)
    overheads = []
    for reshard in (False, True):
        hooked = hooked_step_seconds(sharded_stack(device, mesh, reshard), batch, repeats)
        overheads.append(hook_call_overhead(plain, hooked, HOOK_UNITS + 1, HOOK_MICRO_BATCHES))
    return sum(overheads) / len(overheads)


def sharded_stack(device: torch.device, mesh: Any, reshard: bool) -> nn.Sequential:
    """:func:`hook_stack` with every block and the root under ``fully_shard`` over ``mesh`` (the blocks resharded
    after forward or not, the root kept gathered)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = hook_stack(device)
    for block in model:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return model


COLLECTIVE_ARMS = {"zero2": (False, 1, 1), "zero3": (True, 2, 1)}
"""The arms of :func:`fsdp_collective_timings`: (resharded after forward, gathers, reduce-scatters) of each unit in
a step of one micro-batch (the root holds no parameter and issues none)."""


def fsdp_collective_timings(device: torch.device, own_mesh: Any, data_mesh: Any, repeats: int) -> dict[str, float]:
    """For each of ``COLLECTIVE_ARMS``, the extra seconds per step of the sharded stack over ``data_mesh`` (every
    rank) against the same over ``own_mesh`` (this rank alone), one micro-batch per step: what its collectives cost
    inside FSDP2 (every rank must call it, in step)."""
    batch = torch.randn(4, HOOK_WIDTH, device=device)
    extra = {}
    for arm, (reshard, _, _) in COLLECTIVE_ARMS.items():
        alone, shared = (hooked_step_seconds(sharded_stack(device, mesh, reshard), batch, repeats, micro_batches=1)
                         for mesh in (own_mesh, data_mesh))
        extra[arm] = shared - alone
    return extra


def collective_call_overhead(extra: dict[str, float], priced_gather: float, priced_reduce: float) -> float:
    """Seconds per FSDP2 collective call beyond its priced link time (``priced_gather`` / ``priced_reduce``: the
    cost model's seconds of one unit's gather and reduce-scatter), from :func:`fsdp_collective_timings`' ``extra``
    seconds per step: each arm's extra over its calls (``HOOK_UNITS`` units' worth), less the mean priced call; the
    arms' mean, never below 0 (timing noise)."""
    per_call = []
    for arm, seconds in extra.items():
        _, gathers, reduces = COLLECTIVE_ARMS[arm]
        calls = HOOK_UNITS * (gathers + reduces)
        priced = HOOK_UNITS * (gathers * priced_gather + reduces * priced_reduce)
        per_call.append((seconds - priced) / calls)
    return max(sum(per_call) / len(per_call), 0.0)


def stack_unit_bytes() -> int:
    """Bytes of fp32 parameters in one block of :func:`hook_stack` (what each of its collectives moves)."""
    return 4 * sum(p.numel() for p in hook_stack(torch.device("cpu"))[0].parameters())


def own_rank_mesh(device: torch.device) -> Any:
    """A device mesh of this rank alone, inside an initialized process group (every rank must call it: each
    one-rank group is created by all of them, in the same order)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    groups = [dist.new_group([rank]) for rank in range(dist.get_world_size())]
    return DeviceMesh.from_group(groups[dist.get_rank()], device.type)
