"""The one placement path of every layout, in torchtitan's order: FSDP2's (ZeRO-2/3, the replicated layouts ``none``
and ``zero1`` across processes, tensor / expert parallelism, pipeline stages), and one process with nothing sharded,
which skips the steps that split the model (3, 6) and streams its offloaded blocks (8):

1. **stage parts**: under pipeline parallelism, replace what other ranks hold by meta-device stand-ins;
2. **offload plan** of this rank's blocks (which keep their FSDP2 shards in host memory);
3. **the model's tensor / expert plan** (``parallel.parallelize_model`` reads the model's own declaration);
   a model built eagerly and replicated takes the first rank's values, as DDP does when it wraps one;
4. **recompute**: pipeline stage modules checkpoint each layer (layered accumulation recomputes in its executor);
5. **compile** each block (``compile.py``), after the plan and recompute, before FSDP2 wraps it;
6. **data parallelism**: FSDP2 ``fully_shard`` on every unit (a block; its experts first), then the roots
   (``Layout.resharding``); replicated layouts take FSDP2's replicate layout (shards of one rank, gradients
   all-reduced) with offload or layered accumulation, and otherwise (the "ddp" path) DDP's reducer, whose bucketed
   all-reduces overlap the backward: it wraps the module once materialized (7). ZeRO-1 partitions the optimizer
   states afterwards (``replicated_zero.py``). A pipeline stage alone on its rank, nothing split or offloaded,
   stays plain (``Layout.wraps_blocks``);
7. **materialize** from the meta device: each rank allocates only its shards, unit by unit, and fills them
   (an offloaded block's in host memory);
8. **streaming offload** (one process, nothing sharded: ``offload.py``): the planned blocks' host values become the
   block streamer's masters, and the rest of an eagerly built model moves to the device.

The strategy's only ``fully_shard`` calls are here: one for units, one for roots; its only compile and
materialization calls too (a checkpoint's weights are written right after, by the strategy: ``Engine.load_weights``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from ..layout import fsdp_mode_for
from ..models.module_init import meta_template
from ..protocols import ComputesTokenLoss, HoldsWeight, ParallelPlan
from .blocks import block_names, module_name
from .compile import apply_compile
from .engines.base import EngineContext, holder_of
from .materialize import Initializer, allocate, ambiguous_tied_inits, default_init_note, has_meta_tensors
from .offload_plan import OffloadPlan, plan_for_model
from .parallel import ParallelMeshes, parallelize_model
from .parallel.loss import VocabParallelCrossEntropy
from .parallel.parallelize import check_sequence_parallel, model_plan
from .pipeline.rank_stages import RankStages
from .sharding import OutsideBlocksRoot, fsdp_modules, modules_outside_blocks
from .ties import (
    check_tensor_parallel_ties,
    check_ties_kept,
    check_ties_within_units,
    find_ties,
    placement_root,
    tie_remedy,
)


@dataclass
class Placement:
    """What one placement made of a model."""

    plan: OffloadPlan
    root: nn.Module
    """The deepest submodule holding every parameter (delinking rebuilds it)."""
    template: nn.Module | None
    """``root`` on the meta device, as it was before placement (delinking copies it); None on one process."""
    outside_root: nn.Module | None = None
    """Layered accumulation's FSDP2 root over the modules outside the blocks (see ``sharding.OutsideBlocksRoot``)."""
    wrapper: DistributedDataParallel | None = None
    """The "ddp" path: DDP's wrapper around the module, which Lightning then calls (its reducer syncs gradients)."""


def shard_unit(unit: nn.Module, mesh: object, *, reshard: bool, offloaded: bool, pin_memory: bool) -> None:
    """``fully_shard`` one unit; an offloaded one keeps its shards in host memory (FSDP2's CPU offload)."""
    policy = CPUOffloadPolicy(pin_memory=pin_memory) if offloaded else OffloadPolicy()
    fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, offload_policy=policy)


def shard_root(root: nn.Module, mesh: object) -> None:
    """``fully_shard`` a part's root; roots never reshard after forward, since the backward starts with them."""
    fully_shard(root, mesh=mesh, reshard_after_forward=False)


def apply_model_plan(module: nn.Module, holder: nn.Module, plan: ParallelPlan, meshes: ParallelMeshes,
                     ctx: EngineContext) -> None:
    """Split the model as ``plan`` says; a ``token_loss`` module gets the vocabulary-parallel loss (logits stay
    split)."""
    output = [holder.get_submodule(name) for name, kind in plan.outside.items() if kind == "output"]
    # A pipeline rank without the output layer (a stand-in) never computes the loss.
    vocab = output[0].weight.shape[0] if output and isinstance(output[0], HoldsWeight) else None
    loss_parallel = meshes.dims.tensor_parallel > 1 and vocab is not None and isinstance(module, ComputesTokenLoss)
    if ctx.parallel.sequence_parallel:
        check_sequence_parallel(holder, plan)
    parallelize_model(holder, plan, meshes, loss_parallel=loss_parallel,
                      sequence_parallel=ctx.parallel.sequence_parallel)
    if loss_parallel:
        module.token_loss = VocabParallelCrossEntropy(meshes.tensor, vocab)


def place(module: nn.Module, ctx: EngineContext, meshes: ParallelMeshes | None, stages: RankStages | None, *,
          move_module: bool = True, stream: Callable[[OffloadPlan], None] | None = None) -> Placement:
    """Place ``module`` (on the meta device, or eager) in the order of the module docstring. ``meshes`` None: one
    process with nothing sharded, no FSDP2; ``stream`` then keeps the offload plan's blocks in host memory (step 8).
    ``move_module=False``: an eager model stays where it is until FSDP2 moves its shards (after delinking)."""
    holder = holder_of(module)
    # 1. stage parts
    mine = stages.keep_own(module, holder) if stages is not None else None
    own = sorted(mine) if mine is not None else range(len(holder.blocks))
    # 2. offload plan
    plan = plan_for_model(module, holder.blocks, ctx.device, ctx.offload, mine)
    root = placement_root(module, holder)  # holds every name of a tied parameter, and the blocks (ties.py)
    # FSDP2 changes the modules' tensors in place: a meta copy keeps the whole shapes (initialization, delinking).
    placement = Placement(plan, root, meta_template(root) if meshes is not None else None)
    ties = find_ties(root)
    # 3. the model's tensor / expert plan
    split = (model_plan(holder, meshes.dims.tensor_parallel, meshes.dims.expert_parallel,
                        meshes.dims.pipeline_parallel)
             if meshes is not None and meshes.dims.model_parallel else None)
    if split is not None:
        if meshes.dims.tensor_parallel > 1:
            check_tensor_parallel_ties(root, planned_modules(root, holder, split))
        apply_model_plan(module, holder, split, meshes, ctx)
    lazy = has_meta_tensors(module)
    reducer = ctx.layout.path(ctx.world_size) == "ddp"  # DDP broadcasts rank 0's model itself when it wraps
    if (not lazy and not reducer and split is None and stages is None and ctx.world_size > 1
            and fsdp_mode_for(ctx.sharding.sharding) == "replicate"):
        copy_first_replica(module, meshes.data_group(), ctx.device)
    if move_module and not lazy and meshes is not None:  # one process: after the block streamer (8)
        module.to(ctx.device)
    # 4. recompute
    stage_modules = stages.build_stage_modules(holder) if stages is not None else []
    # 5. compile
    apply_compile(ctx.accumulation.compile, holder.blocks, own)
    # 6. data parallelism: FSDP2's units, then roots; or DDP's reducer, around the materialized module
    if meshes is None:
        return _place_on_one_process(module, holder, placement, ctx, lazy, ties, stream)
    # A pipeline stage alone on its rank (no data ranks, split or offload) stays plain (Layout.wraps_blocks).
    plain_stages = stages is not None and not ctx.layout.wraps_blocks(ctx.world_size)
    if reducer or plain_stages:
        if lazy:  # 7. materialize
            _materialize_shards(module, holder, plan, ctx, placement.template)
        if reducer:
            device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
            placement.wrapper = DistributedDataParallel(module, device_ids=device_ids,
                                                        process_group=meshes.data_group())
        check_ties_kept(root, ties)
        return placement
    reshard = ctx.layout.resharding
    units = [holder.blocks[i] for i in own]
    if split is not None:
        units += [experts for experts, _ in split.stacked_experts(holder, list(own))]
    layout = ctx.layout
    asked = ", ".join(f"{k}={v!r}" for k, v in layout.strategy_options().items()) or f"sharding={layout.sharding!r}"
    check_ties_within_units(root, units, asked, tie_remedy(
        layout.sharding, layout.offloading, layout.accumulation == "layered"))
    for index in own:
        offloaded = index in plan.offloaded
        if split is not None:  # the expert weights first: their own unit, over the ranks holding them
            for experts, _ in split.stacked_experts(holder, [index]):
                shard_unit(experts, meshes.experts[meshes.expert_data_dims], reshard=reshard.after_each_forward,
                           offloaded=offloaded, pin_memory=ctx.pin_memory)
        shard_unit(holder.blocks[index], meshes.data, reshard=reshard.after_each_forward, offloaded=offloaded,
                   pin_memory=ctx.pin_memory)
    if stages is not None:
        roots: list[nn.Module] = list(stage_modules)
    elif ctx.accumulation.accumulation == "layered":
        owners = modules_outside_blocks(root, holder.blocks)
        placement.outside_root = OutsideBlocksRoot(owners) if owners else None
        roots = [placement.outside_root] if owners else []
    else:
        roots = [root]
    for part_root in roots:
        shard_root(part_root, meshes.data)
    if stages is not None and reshard.after_last_micro_batch:
        for stage_module in stage_modules:
            stage_module.after_last_forward = _reshard_blocks
    # 7. materialize
    if lazy:
        _materialize_shards(module, holder, plan, ctx, placement.template)  # the strategy then writes ctx.weights
    if placement.outside_root is not None:
        # The model's own forward (evaluation, a callback measuring a loss) reads the embedding and head outside
        # the outside root: gather them first. Training calls the stages through that root instead.
        outside = placement.outside_root
        root.register_forward_pre_hook(lambda *_: outside.unshard())
    check_ties_kept(root, ties)
    return placement


def _place_on_one_process(module: nn.Module, holder: nn.Module, placement: Placement, ctx: EngineContext, lazy: bool,
                          ties: Any, stream: Callable[[OffloadPlan], None] | None) -> Placement:
    """Steps 7 and 8 of one process with nothing sharded (no FSDP2 units)."""
    # 7. materialize
    if lazy:
        _materialize_shards(module, holder, placement.plan, ctx, placement.template)
    # 8. streaming offload: the host values become the masters before anything else moves to the device
    if stream is not None:
        stream(placement.plan)
    module.to(ctx.device)  # the streamed blocks' parameters are empty device placeholders by now
    check_ties_kept(placement.root, ties)
    return placement


def copy_first_replica(module: nn.Module, group: Any, device: torch.device) -> None:
    """Every parameter and buffer of an eagerly built ``module`` takes the value of the group's first rank: replicas
    must start equal (a model built without a common seed differs per rank), which DDP guarantees when it wraps a
    model and FSDP2 does not. Each tensor is staged on ``device`` for the collective (NCCL sends device memory)."""
    source = dist.get_global_rank(group, 0)
    for tensor in chain(module.parameters(), module.buffers()):
        value = tensor.detach()
        staged = value.to(device)
        dist.broadcast(staged, src=source, group=group)
        if staged is not value:
            value.copy_(staged)


def planned_modules(root: nn.Module, holder: nn.Module, plan: ParallelPlan) -> dict[str, str]:
    """``plan`` (the holder's) by module names relative to ``root`` (what the tie check reads). On a pipeline rank
    without the head, the root lies below the holder (a Hugging Face model's inner ``model``): the entries outside
    the root are another rank's."""
    named = dict(plan.outside)
    # A pseudo model's block by the first layer running it: the tie check reads its other layers' names as that one.
    for prefix, entries in zip(block_names(holder), plan.blocks):
        named |= {f"{prefix}.{name}": kind for name, kind in entries.items()}
    if any(module is holder for module in root.modules()):
        prefix = module_name(root, holder)
        return {(f"{prefix}.{name}" if prefix else name): kind for name, kind in named.items()}
    inner = module_name(holder, root) + "."
    return {name[len(inner):]: kind for name, kind in named.items() if name.startswith(inner)}


def _materialize_shards(module: nn.Module, holder: nn.Module, plan: OffloadPlan, ctx: EngineContext,
                        template: nn.Module | None) -> None:
    """Each unit in turn gets storage for this rank's shards only (an offloaded block's in host memory) and its
    values: the peak is the shards plus one whole tensor (or one module's, initialized by the model's own rule) being
    cut. ``template``: the root as it was before placement, on the meta device (whole shapes; None: unsplit)."""
    initializer = Initializer(module, holder, seed=ctx.init_seed, template=template)
    fill = ctx.weights is None
    if fill and initializer.values_from is None:
        default = default_init_note(initializer.root, initializer.hook)
        for note in ambiguous_tied_inits(initializer.root, initializer.hook) + ([default] if default else []):
            rank_zero_warn(f"P2RStrategy: {note}")
    for index, block in enumerate(holder.blocks):
        params = allocate(block, "cpu" if index in plan.offloaded else ctx.device)
        if fill:
            initializer.fill(params)
    params = allocate(module, ctx.device, skip=[holder.blocks])
    if fill:
        initializer.fill(params)
    initializer.finish()


def _reshard_blocks(stage_module: nn.Module) -> None:
    for block in stage_module.owned:
        for unit in fsdp_modules(block):
            unit.reshard()
