"""The one placement path of every FSDP2 layout (ZeRO-2/3, the replicated layouts across processes, tensor / expert
parallelism, pipeline stages), in torchtitan's order:

1. **stage parts**: under pipeline parallelism, replace what other ranks hold by meta-device stand-ins;
2. **offload plan** of this rank's blocks (which keep their FSDP2 shards in host memory);
3. **the model's tensor / expert plan** (``parallel.parallelize_model`` reads the model's own declaration);
4. **recompute**: pipeline stage modules checkpoint each layer (layered accumulation recomputes in its executor);
5. **compile** each block (``compile.py``), after the plan and recompute, before FSDP2 wraps it;
6. **FSDP2**: ``fully_shard`` every unit (a block; its experts first), then the roots (``Layout.resharding``);
7. **materialize** from the meta device: each rank allocates only its shards, unit by unit, and fills them.

The strategy's only ``fully_shard`` calls are here: one for units, one for roots.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

from ..protocols import ComputesTokenLoss, HoldsWeight, ParallelPlan
from .blocks import module_name
from .compile import apply_compile
from .engines.base import EngineContext, holder_of
from .materialize import Initializer, allocate, has_meta_tensors
from .parallel import ParallelMeshes, parallelize_model
from .parallel.loss import VocabParallelCrossEntropy
from .parallel.parallelize import model_plan
from .pipeline.placement import StagePlacement
from .plan import OffloadPlan, plan_for_model
from .regather import meta_template
from .sharding import StageRunner, fsdp_modules, modules_outside_blocks
from .ties import (
    check_tensor_parallel_ties,
    check_ties_kept,
    check_ties_within_units,
    find_ties,
    smallest_parameter_root,
)


@dataclass
class Placement:
    """What one placement made of a model."""

    plan: OffloadPlan
    root: nn.Module
    """The deepest submodule holding every parameter (delinking rebuilds it)."""
    template: nn.Module
    """``root`` on the meta device, as it was before placement (delinking copies it)."""
    runner: nn.Module | None = None
    """Layered accumulation's FSDP2 root over the modules outside the blocks (see ``sharding.StageRunner``)."""


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
    parallelize_model(holder, plan, meshes, loss_parallel=loss_parallel,
                      sequence_parallel=ctx.parallel.sequence_parallel)
    if loss_parallel:
        module.token_loss = VocabParallelCrossEntropy(meshes.tensor, vocab)


def place(module: nn.Module, ctx: EngineContext, meshes: ParallelMeshes, stages: StagePlacement | None, *,
          move_module: bool = True) -> Placement:
    """Place ``module`` (on the meta device, or eager after delinking) in the order of the module docstring."""
    holder = holder_of(module)
    # 1. stage parts
    mine = stages.keep_own(module, holder) if stages is not None else None
    own = sorted(mine) if mine is not None else range(len(holder.blocks))
    # 2. offload plan
    plan = plan_for_model(module, holder.blocks, ctx.device, ctx.offload, mine)
    root = smallest_parameter_root(module)  # holds every name of a tied parameter (ties.py)
    placement = Placement(plan, root, meta_template(root))
    ties = find_ties(root)
    # 3. the model's tensor / expert plan
    split = (model_plan(holder, meshes.dims.tensor_parallel, meshes.dims.expert_parallel)
             if meshes.dims.model_parallel else None)
    if split is not None:
        if meshes.dims.tensor_parallel > 1:
            check_tensor_parallel_ties(root, planned_modules(root, holder, split))
        apply_model_plan(module, holder, split, meshes, ctx)
    lazy = has_meta_tensors(module)
    if move_module and not lazy:
        module.to(ctx.device)
    # 4. recompute
    stage_modules = stages.build_stage_modules(holder) if stages is not None else []
    # 5. compile
    apply_compile(ctx.accumulation.compile, holder.blocks, own)
    # 6. FSDP2: units, then roots
    reshard = ctx.layout.resharding
    units = [holder.blocks[i] for i in own]
    if split is not None:
        units += [experts for experts, _ in split.stacked_experts(holder, list(own))]
    check_ties_within_units(root, units, f"sharding={ctx.sharding.sharding!r}")
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
        placement.runner = StageRunner(owners) if owners else None
        roots = [placement.runner] if owners else []
    else:
        roots = [root]
    for part_root in roots:
        shard_root(part_root, meshes.data)
    if stages is not None and reshard.after_last_micro_batch:
        for stage_module in stage_modules:
            stage_module.after_last_forward = _reshard_blocks
    # 7. materialize
    if lazy:
        _materialize_shards(module, holder, plan, ctx, placement.template)  # the engine writes ctx.weights, if any
    if placement.runner is not None:
        # The model's own forward (evaluation, a callback measuring a loss) reads the embedding and head outside
        # the runner: gather them first. Training calls the stages through the runner instead.
        runner = placement.runner
        root.register_forward_pre_hook(lambda *_: runner.unshard())
    check_ties_kept(root, ties)
    return placement


def planned_modules(root: nn.Module, holder: nn.Module, plan: ParallelPlan) -> dict[str, str]:
    """``plan`` (the holder's) by module names relative to ``root`` (what the tie check reads)."""
    prefix = module_name(root, holder)
    prefix = prefix + "." if prefix else ""
    named = {prefix + name: kind for name, kind in plan.outside.items()}
    blocks = module_name(holder, holder.blocks)
    for index, entries in enumerate(plan.blocks):
        named |= {f"{prefix}{blocks}.{index}.{name}": kind for name, kind in entries.items()}
    return named


def _materialize_shards(module: nn.Module, holder: nn.Module, plan: OffloadPlan, ctx: EngineContext,
                        template: nn.Module) -> None:
    """Each unit in turn gets storage for this rank's shards only (an offloaded block's in host memory) and its
    values: the peak is the shards plus one whole tensor (or one module's, initialized by the model's own rule) being
    cut. ``template``: the root as it was before placement, on the meta device (whole shapes)."""
    initializer = Initializer(module, holder, seed=ctx.init_seed, template=template)
    fill = ctx.weights is None
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
