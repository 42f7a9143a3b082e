"""Apply tensor and expert parallelism to a model, in a fixed order, before FSDP2 shards it over the data ranks."""

from __future__ import annotations

import functools

from torch import nn

from ...layout.names import divisors
from ...protocols import BalancesOverRanks, DeclaredPlan, DeclaresParallelPlan, ParallelPlan, StackedExperts
from .differentiable import all_reduce_sum
from .experts import parallelize_experts
from .hf_plan import check_splittable, hf_ep_plan, hf_tp_plan, plan_from_hf, with_sequence_parallel_entries
from .mesh import ParallelMeshes
from .tensor import apply_tensor_parallel


def _is_hf_planned(holder: nn.Module) -> bool:
    """Whether ``holder`` is a Hugging Face model with a tensor-parallel plan (its own, or its config class's)."""
    return hf_tp_plan(holder) is not None or hasattr(getattr(holder, "config", None), "base_model_tp_plan")


def model_plan(holder: nn.Module, tensor_parallel: int = 1, expert_parallel: int = 1,
               pipeline_parallel: int = 1) -> ParallelPlan:
    """The plan ``holder`` declares (``parallel_plan()``), else its Hugging Face plans (``hf_plan.py``), checked
    against its blocks and the layout (a name it lacks, a module torch cannot split, are refused by name)."""
    declared = vars(holder).get("parallel_plan")
    if isinstance(declared, DeclaredPlan):  # given to the model from outside: for this holder (a copy has its own)
        plan = declared.plan_of(holder)
    elif isinstance(holder, DeclaresParallelPlan):
        plan = holder.parallel_plan()
    elif (tensor_parallel > 1 and _is_hf_planned(holder)) or (expert_parallel > 1 and hf_ep_plan(holder) is not None):
        plan = plan_from_hf(holder, tensor_parallel, expert_parallel)  # a Hugging Face model: its own plans
        check_experts(holder, plan, tensor_parallel, expert_parallel)
        return plan
    elif expert_parallel > 1 and _is_hf_planned(holder):
        # A Hugging Face model without an expert plan: a dense one, or an MoE whose experts transformers cannot
        # split either.
        raise ValueError(f"P2RStrategy(expert_parallel={expert_parallel}) splits the experts a model's plan names: "
                         f"{type(holder).__name__} has no Hugging Face expert-parallel plan (base_model_ep_plan) "
                         "naming any; use expert_parallel=1 (tensor_parallel splits its layers by its tensor-parallel "
                         "plan)")
    else:
        raise ValueError(f"P2RStrategy(tensor_parallel={tensor_parallel}, expert_parallel={expert_parallel}) splits a "
                         f"model by the plan it declares: {type(holder).__name__} has no parallel_plan() "
                         "(lightning_p2r.protocols.DeclaresParallelPlan; docs/your_model.md shows one) "
                         "and no Hugging Face tensor-parallel (base_model_tp_plan) or expert-parallel "
                         "(base_model_ep_plan) plan")
    if plan.gathers_for_sequence_parallel:
        plan = with_sequence_parallel_entries(holder, plan)
    bad = {name: size for name, size in plan.divisible.items() if size % tensor_parallel}
    if bad:
        raise ValueError(f"tensor_parallel={tensor_parallel} must divide {type(holder).__name__}'s "
                         + ", ".join(f"{name}={size}" for name, size in bad.items()))
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
            if kind == "expert" and not _declares_stacked_experts(plan, name) \
                    and not any(inner.startswith(name + ".") and entries[inner] in ("column", "row")
                                for inner in entries):
                raise ValueError(f"the parallel plan marks block {index}'s {name!r} as an expert layer but declares "
                                 f"no expert weights inside it: name its expert module in ParallelPlan.experts "
                                 "(lightning_p2r.protocols.StackedExperts), or split its expert modules by column "
                                 "and row entries")
            check_splittable(f"block {index}'s {name}", block.get_submodule(name), kind, name in plan.transposed)
    for name, kind in plan.outside.items():
        try:
            module = holder.get_submodule(name)
        except AttributeError:
            continue  # refused by name when the plan is applied (tensor.py)
        if next(module.parameters(), None) is not None:
            check_splittable(f"{type(holder).__name__}'s {name}", module, kind)
    check_experts(holder, plan, tensor_parallel, expert_parallel)
    if tensor_parallel > 1 and pipeline_parallel > 1:
        check_pipelined_expert_modules(holder, plan, tensor_parallel, pipeline_parallel)
    return plan


def _declares_stacked_experts(plan: ParallelPlan, layer: str) -> bool:
    """Whether the plan declares stacked expert weights (``ParallelPlan.experts``) at or inside ``layer``."""
    return any(inner == layer or inner.startswith(layer + ".") for inner in plan.experts)


def _expert_layers_of_modules(plan: ParallelPlan) -> list[str]:
    """The plan's expert layers that hold no stacked expert weights (their experts are modules of their own)."""
    return [f"block {index}'s {name!r}" for index, entries in enumerate(plan.blocks)
            for name, kind in entries.items() if kind == "expert" and not _declares_stacked_experts(plan, name)]


def check_pipelined_expert_modules(holder: nn.Module, plan: ParallelPlan, tensor_parallel: int,
                                   pipeline_parallel: int) -> None:
    """Refuse expert modules split by hidden unit inside pipeline stages: each expert's collectives carry the rows
    routed to it, and torch's pipeline stage first runs on uninitialized inputs to learn its output shapes, so the
    tensor-parallel ranks of a stage would route differently and their collectives would not match."""
    bare = _expert_layers_of_modules(plan)
    if bare:
        raise ValueError(f"tensor_parallel={tensor_parallel} with pipeline_parallel={pipeline_parallel} cannot split "
                         f"{type(holder).__name__}'s expert layer {bare[0]}: its experts are separate modules whose "
                         "collectives carry the rows routed to each, and a pipeline stage first runs on uninitialized "
                         "inputs to learn its shapes, where the tensor-parallel ranks would route differently; use "
                         "pipeline_parallel=1 or tensor_parallel=1 for this model")


def check_experts(holder: nn.Module, plan: ParallelPlan, tensor_parallel: int, expert_parallel: int) -> None:
    """Refuse, in one line naming the module, a declared expert module that the layout cannot split: weights that
    are missing or not stacked alike, experts that do not divide by ``expert_parallel``, a hidden-unit dimension
    tensor parallelism needs but the declaration lacks (or that does not divide). (A plan without expert modules
    leaves the MoE layers whole: experts that still share one FFN, say.)"""
    if expert_parallel > 1:
        # An expert layer whose experts are separate modules (litgpt's LLaMAMoE: a list of MLPs, each split by
        # hidden unit under tensor parallelism) has no stacked weights to deal out by expert.
        bare = _expert_layers_of_modules(plan)
        if bare:
            raise ValueError(f"expert_parallel={expert_parallel} deals out stacked expert weights "
                             f"(ParallelPlan.experts), and {type(holder).__name__} declares none in its expert layer "
                             f"{bare[0]} (its experts are separate modules, which tensor_parallel splits by hidden "
                             "unit): use expert_parallel=1 for this model")
    found = plan.stacked_experts(holder, [i for i, block in enumerate(holder.blocks)
                                          if next(block.parameters(), None) is not None])
    for module, declared in found:
        _check_stacked(type(holder).__name__, module, declared, tensor_parallel, expert_parallel)


def _check_stacked(owner: str, module: nn.Module, declared: StackedExperts, tensor_parallel: int,
                   expert_parallel: int) -> None:
    what = f"{owner}'s {type(module).__name__}"
    experts = set()
    by_expert = tensor_parallel > 1 and declared.splits_by_expert_over_tensor_parallel
    for name, hidden_dim in declared.weights.items():
        weight = getattr(module, name, None)
        if not isinstance(weight, nn.Parameter) or weight.dim() < 2:
            raise ValueError(f"the expert plan names {what}.{name}, which is not a stacked weight "
                             "(experts x ...) parameter")
        experts.add(weight.shape[0])
        if by_expert and declared.call != "top_k":
            raise ValueError(f"tensor_parallel={tensor_parallel} cannot split {what}.{name} by hidden unit (none "
                             "declared: gate and up packed in one tensor?), and splits by expert only a module "
                             "called as 'top_k'; use tensor_parallel=1 with expert_parallel for this model")
        if tensor_parallel > 1 and not by_expert and weight.shape[hidden_dim] % tensor_parallel:
            raise ValueError(f"tensor_parallel={tensor_parallel} must divide the hidden units of {what}.{name} "
                             f"({weight.shape[hidden_dim]})")
    missing = [name for name in declared.counts if not hasattr(module, name)]
    if missing:
        raise ValueError(f"the expert plan says {what} records its number of experts in {missing}, which it lacks")
    if len(experts) != 1:
        raise ValueError(f"the stacked weights of {what} disagree on the number of experts: {sorted(experts)}")
    count = experts.pop()
    if count % expert_parallel:
        raise ValueError(f"P2RStrategy(expert_parallel={expert_parallel}) gives each rank an equal share of "
                         f"{what}'s {count} experts: use expert_parallel in {divisors(count)}")
    if by_expert and count % (expert_parallel * tensor_parallel):
        raise ValueError(f"P2RStrategy(tensor_parallel={tensor_parallel}, expert_parallel={expert_parallel}) splits "
                         f"{what}'s {count} experts by expert over both (its weights have no hidden-unit dimension to "
                         "split): their product must divide the number of experts")


def check_sequence_parallel(holder: nn.Module, plan: ParallelPlan) -> None:
    """Sequence parallelism runs what lies between the split layers on this rank's sequence positions: the plan must
    say which modules those are ("sequence", its norms); a plan without any is refused in one line, before anything
    is placed. A plan that gathers at module entry ("gather") cuts the sequence at the first block, which must then
    run at one layer only."""
    if "sequence" not in plan.kinds():
        raise ValueError(f"P2RStrategy(sequence_parallel=True) needs the parallel plan of {type(holder).__name__} to "
                         "mark the modules that run on the rank's sequence positions (its norms) as 'sequence'; "
                         "its plan marks none (a Hugging Face plan never does): use sequence_parallel=False, or "
                         "declare a ParallelPlan whose blocks can run on a share of the sequence")
    layers = list(getattr(holder, "layer_to_block", range(len(holder.blocks))))
    first_shared = layers.count(layers[0]) > 1 or any(block is holder.blocks[0] for block in list(holder.blocks)[1:])
    if "gather" in plan.kinds() and first_shared and "vocabulary" not in plan.outside.values() and not callable(
            getattr(holder, "get_input_embeddings", None)):
        # A plan that gathers at module entry cuts the hidden states to the rank's positions at the first block's
        # entry; a block run at several layers tells its first layer's whole input from the later layers' by the
        # embedding's output length, which a plan without a "vocabulary" embedding does not record.
        raise ValueError("P2RStrategy(sequence_parallel=True) cuts the sequence at the first layer's block, which this "
                         f"{type(holder).__name__} runs at several layers (a shared, pseudo model), and neither its "
                         "plan ('vocabulary') nor get_input_embeddings() names the embedding whose output length "
                         "tells the first layer's input from the later ones': delink it first, or use "
                         "sequence_parallel=False")


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
    for module, declared in plan.stacked_experts(holder, present):
        parallelize_experts(
            module, declared, expert_tensor_mesh=meshes.experts["ep", "tp"],
            expert_group=meshes.experts["ep"].get_group() if dims.expert_parallel > 1 else None,
            tp_mesh=meshes.tensor if dims.tensor_parallel > 1 else None)
    total = functools.partial(all_reduce_sum, group=data_group) if data_group is not None else None
    for layer in plan.expert_layers(holder, present):
        if isinstance(layer, BalancesOverRanks):  # its balance loss counts every data rank's tokens
            layer.balance_over(total)

