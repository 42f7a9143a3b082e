"""Apply tensor and expert parallelism to a model, in a fixed order, before FSDP2 shards it over the data ranks."""

from __future__ import annotations

from torch import nn

from ...models.moe import MoEFeedForward
from ...protocols import DeclaresParallelPlan, ParallelPlan
from .experts import parallelize_experts
from .hf_plan import check_splittable, hf_tp_plan, plan_from_hf
from .mesh import ParallelMeshes
from .tensor import apply_tensor_parallel


def model_plan(holder: nn.Module, tensor_parallel: int = 1) -> ParallelPlan:
    """The plan ``holder`` declares (``parallel_plan()``), else its Hugging Face plan (``hf_plan.py``), checked
    against its blocks (a name it lacks, a module torch cannot split, are refused by name)."""
    if isinstance(holder, DeclaresParallelPlan):
        plan = holder.parallel_plan()
    elif tensor_parallel > 1 and (hf_tp_plan(holder) is not None
                                  or hasattr(getattr(holder, "config", None), "base_model_tp_plan")):
        return plan_from_hf(holder, tensor_parallel)  # a Hugging Face model: its own plan, or why it has none
    else:
        raise ValueError(f"P2RStrategy(tensor_parallel / expert_parallel > 1) splits a model by the plan it declares: "
                         f"{type(holder).__name__} has no parallel_plan() (lightning_p2r.protocols."
                         "DeclaresParallelPlan; M6Transformer.parallel_plan is an example) and no Hugging Face "
                         "tensor-parallel plan; expert parallelism splits lightning_p2r MoE layers only")
    if len(plan.blocks) != len(holder.blocks):
        raise ValueError(f"the parallel plan of {type(holder).__name__} has {len(plan.blocks)} block entries for "
                         f"{len(holder.blocks)} blocks")
    for index, (entries, block) in enumerate(zip(plan.blocks, holder.blocks)):
        if next(block.parameters(), None) is None:
            continue  # another pipeline stage's block: a stand-in
        names = {name for name, _ in block.named_modules()}
        missing = sorted(set(entries) - names)
        if missing:
            raise ValueError(f"the parallel plan of {type(holder).__name__} names {missing} in block {index}, which "
                             "has no such submodules")
        for name, kind in entries.items():
            if kind == "expert" and not isinstance(block.get_submodule(name), MoEFeedForward):
                raise ValueError(f"the parallel plan marks block {index}'s {name!r} as an expert layer; expert "
                                 "parallelism splits lightning_p2r.models.MoEFeedForward layers")
            check_splittable(f"block {index}'s {name}", block.get_submodule(name), kind)
    for name, kind in plan.outside.items():
        try:
            module = holder.get_submodule(name)
        except AttributeError:
            continue  # refused by name when the plan is applied (tensor.py)
        if next(module.parameters(), None) is not None:
            check_splittable(f"{type(holder).__name__}'s {name}", module, kind)
    return plan


def parallelize_model(holder: nn.Module, plan: ParallelPlan, meshes: ParallelMeshes, *, loss_parallel: bool = False,
                      sequence_parallel: bool = False) -> None:
    """Tensor parallelism first (the planned layers' weights become DTensors on "tp"), then the expert layers (split
    over "ep" and "tp"), on the meta device; FSDP2 shards the placed DTensors further afterwards, as torchtitan does.
    ``loss_parallel``: the module's loss is ``loss.VocabParallelCrossEntropy``."""
    dims = meshes.dims
    if dims.tensor_parallel > 1:
        apply_tensor_parallel(holder, plan, meshes.tensor, loss_parallel=loss_parallel,
                              sequence_parallel=sequence_parallel)
    data_group = meshes.data_group() if dims.data_parallel > 1 else None
    present = [i for i, block in enumerate(holder.blocks) if next(block.parameters(), None) is not None]
    for layer in plan.expert_layers(holder, present):
        parallelize_experts(
            layer, expert_tensor_mesh=meshes.experts["ep", "tp"],
            expert_group=meshes.experts["ep"].get_group() if dims.expert_parallel > 1 else None,
            tp_mesh=meshes.tensor if dims.tensor_parallel > 1 else None, data_group=data_group)

