"""Enumerate the layouts a model can run with on a cluster, drop those that do not fit, rank the rest.

A layout "fits" when its device total (model states, gathered parameters, offload window, activations, logits,
pipeline buffers) stays under ``device_memory`` times ``memory_headroom`` (the allocator's fragmentation and the
framework's own buffers take the rest), and its offloaded states, times the devices of a node, fit the node's host
memory. Layouts are ranked by predicted seconds per token; for a pseudo model (shared blocks) the same layout is
priced for the real model too, since a run that delinks must fit both.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ..layout import SINGLE_STAGE_SCHEDULES, divisors
from .cluster import Cluster
from .layout import BREADTH_FIRST, SCHEDULES, Layout, Workload, check_layout
from .memory import MemoryEstimate, estimate_memory
from .model import PricedModel
from .step_time import StepEstimate, estimate_step


@dataclass(frozen=True)
class Plan:
    layout: Layout
    memory: MemoryEstimate
    step: StepEstimate
    fits: bool
    reason: str = ""
    """Why it does not fit ("" when it does)."""

    def tokens_per_second(self, workload: Workload) -> float:
        return workload.tokens / self.step.total


@dataclass(frozen=True)
class SearchSpace:
    """The options the search tries (each list may be narrowed from the command line)."""

    shardings: tuple[str, ...] = ("none", "zero1", "zero2", "zero3")
    offload_fractions: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0)
    schedules: tuple[str, ...] = SCHEDULES
    max_stages_per_rank: int = 4
    recompute: tuple[bool, ...] = (False, True)
    accumulations: tuple[str, ...] = ("standard", "layered")
    sequence_parallel: tuple[bool, ...] = (False, True)
    micro_batch_counts: tuple[int, ...] | None = None
    """None: the powers of two that divide the sequences per data-parallel rank, and that number itself."""
    pipeline_degrees: tuple[int, ...] | None = None
    """None: every pipeline degree that divides the devices and the layers."""
    expert_degrees: tuple[int, ...] | None = None
    """None: every expert-parallel degree that divides the data ranks and the experts."""
    max_tensor_parallel: int | None = None
    """None: up to the devices of a node."""


def powers_of_two_dividing(value: int, limit: int) -> list[int]:
    return [2**i for i in range(0, 64) if 2**i <= limit and value % 2**i == 0]


def candidate_layouts(config: PricedModel, cluster: Cluster, workload: Workload,
                      space: SearchSpace = SearchSpace()) -> Iterator[Layout]:
    """Every valid layout in ``space`` (``check_layout`` accepts it)."""
    return (layout for layout in _base_layouts(config, cluster, workload, space)
            if is_valid(layout, config, cluster, workload))


def layout_space(config: PricedModel, cluster: Cluster, workload: Workload,
                 space: SearchSpace = SearchSpace()) -> Iterator[Layout]:
    """Every layout the search may consider, valid or not: the base layouts and their memory savers (the rulebook's
    consistency test runs the strategy's checks over exactly these)."""
    for layout in _base_layouts(config, cluster, workload, space):
        yield layout
        yield from memory_savers(layout, space)


def _base_layouts(config: PricedModel, cluster: Cluster, workload: Workload, space: SearchSpace) -> Iterator[Layout]:
    n = cluster.devices
    tp_limit = space.max_tensor_parallel or cluster.devices_per_node
    for tp in powers_of_two_dividing(n, tp_limit):
        for pp in [d for d in divisors(n // tp) if d <= config.num_layers and (
                space.pipeline_degrees is None or d in space.pipeline_degrees)]:
            dp = n // (tp * pp)
            for ep in (e for e in divisors(dp) if config.num_experts % e == 0 and (e == 1 or config.moe_layers != [])
                       and (space.expert_degrees is None or e in space.expert_degrees)):
                yield from _variants(config, cluster, workload, space, tp, ep, pp, dp)


def _variants(config: PricedModel, cluster: Cluster, workload: Workload, space: SearchSpace, tp: int, ep: int, pp: int,
              dp: int) -> Iterator[Layout]:
    if workload.global_batch % dp:
        return
    per_rank = workload.global_batch // dp
    counts = space.micro_batch_counts or tuple(sorted(set(powers_of_two_dividing(per_rank, per_rank)) | {per_rank}))
    schedules: Iterable[str] = space.schedules if pp > 1 else ("1f1b",)
    for schedule, sharding, m, accumulation, sp in itertools.product(
            schedules, space.shardings, counts, space.accumulations, space.sequence_parallel if tp > 1 else (False,)):
        if per_rank % m or (accumulation == "layered" and m == 1 and pp == 1):
            continue  # layered accumulation of one micro-batch is standard accumulation
        if pp > 1 and accumulation == "standard" and schedule in BREADTH_FIRST and "layered" in space.accumulations:
            continue  # a breadth-first pipeline is layered accumulation: the same layout under its other name
        stage_counts = [1] if schedule in SINGLE_STAGE_SCHEDULES or pp == 1 else range(2, space.max_stages_per_rank + 1)
        for v in stage_counts:
            yield Layout(sharding=sharding, tensor_parallel=tp, expert_parallel=ep, pipeline_parallel=pp,
                         pipeline_schedule=schedule, stages_per_rank=v, sequence_parallel=sp,
                         accumulation=accumulation, micro_batches=m)


def memory_savers(layout: Layout, space: SearchSpace) -> Iterator[Layout]:
    """``layout`` with recompute and each offload fraction, cheapest first (both only ever add time, so they are
    tried only when the plain layout does not fit)."""
    for offload in sorted(space.offload_fractions):
        for recompute in sorted(space.recompute):
            if (offload, recompute) != (0.0, False):
                yield dataclasses.replace(layout, offload_fraction=offload, recompute=recompute)


def evaluate(config: PricedModel, layout: Layout, cluster: Cluster, workload: Workload, *,
             memory_headroom: float = 0.9) -> Plan:
    """Price one layout (it must be valid: see ``check_layout``)."""
    check_layout(layout, config, cluster, workload)
    memory = estimate_memory(config, layout, cluster, workload)
    step = estimate_step(config, layout, cluster, workload)
    reason = ""
    if config.num_blocks < config.num_layers:
        real = config.replace(num_unique_blocks=None)
        memory_real = estimate_memory(real, layout, cluster, workload)
        if memory_real.device_total > memory.device_total:
            memory = memory_real  # the delinked model must fit too
    budget = cluster.device_memory * memory_headroom
    host_per_node = memory.host * min(cluster.devices_per_node, cluster.devices)
    if memory.device_total > budget:
        reason = f"device memory {memory.device_total / 1e9:.1f} GB > {budget / 1e9:.1f} GB"
    elif host_per_node > cluster.host_memory_per_node:
        reason = f"host memory {host_per_node / 1e9:.1f} GB > {cluster.host_memory_per_node / 1e9:.1f} GB per node"
    return Plan(layout, memory, step, fits=not reason, reason=reason)


def is_valid(layout: Layout, config: PricedModel, cluster: Cluster, workload: Workload) -> bool:
    """Whether ``check_layout`` accepts ``layout`` for this model, cluster and workload."""
    try:
        check_layout(layout, config, cluster, workload)
    except ValueError:
        return False
    return True


def search(config: PricedModel, cluster: Cluster, workload: Workload, space: SearchSpace = SearchSpace(), *,
           memory_headroom: float = 0.9) -> tuple[list[Plan], int]:
    """The layouts that fit, fastest first, equivalent ones merged (:func:`merge_equivalent`), and how many valid
    layouts were priced. A layout that does not fit is priced again with recompute and offload (``memory_savers``);
    the fastest variant that fits is kept."""
    fitting, priced = [], 0
    for layout in candidate_layouts(config, cluster, workload, space):
        plan = evaluate(config, layout, cluster, workload, memory_headroom=memory_headroom)
        priced += 1
        if not plan.fits:
            savers = [v for v in memory_savers(layout, space) if is_valid(v, config, cluster, workload)]
            # The variant that saves most (recompute and the largest offload) first: if even it does not fit,
            # none of the others can.
            variants = [evaluate(config, v, cluster, workload, memory_headroom=memory_headroom)
                        for v in savers[-1:]]
            if variants and variants[0].fits:
                variants += [evaluate(config, v, cluster, workload, memory_headroom=memory_headroom)
                             for v in savers[:-1]]
            priced += len(variants)
            plan = min((v for v in variants if v.fits), key=lambda p: p.step.total, default=plan)
        if plan.fits:
            fitting.append(plan)
    fitting.sort(key=lambda p: (p.step.total, p.memory.device_total))
    return merge_equivalent(fitting, cluster.devices), priced


def equivalence_key(layout: Layout, devices: int) -> Layout:
    """What tells layouts apart on ``devices``: with one data-parallel rank (one device, or every device in one
    tensor-parallel group or pipeline) there is nothing for ZeRO to shard, so every ZeRO stage is the layout with
    ``sharding="none"``."""
    if layout.data_parallel(devices) == 1:
        return dataclasses.replace(layout, sharding="none")
    return layout


def merge_equivalent(plans: list[Plan], devices: int) -> list[Plan]:
    """``plans`` (fastest first) with each group of equivalent layouts (:func:`equivalence_key`) as one row: the
    fastest of the group, the others dropped (a list of ZeRO stages on one device tells a user nothing)."""
    seen: set[Layout] = set()
    merged = []
    for plan in plans:
        key = equivalence_key(plan.layout, devices)
        if key not in seen:
            seen.add(key)
            merged.append(plan)
    return merged
