"""Tensor parallelism (Megatron-LM) for a block-sequence model, applied from outside with ``parallelize_module``:
the model declares which submodules split how (``protocols.ParallelPlan``), this module turns each kind into
torch's ``ParallelStyle`` (docs/parallelism.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ...protocols import ParallelPlan, SplitKind
from ..ties import find_ties, retie
from .experts import copy_to_tensor_parallel, owned


def _logits_hook(tp_mesh: Any, *, loss_parallel: bool) -> Any:
    """The head's forward hook: with ``loss_parallel`` the logits stay split in training, whole in evaluation."""

    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        if loss_parallel and not module.training:
            output = DTensor.from_local(output, tp_mesh, [Shard(-1)], run_check=False).full_tensor()
        return owned(output)

    return hook


def _own_positions(whole: torch.Tensor, tp_mesh: Any) -> torch.Tensor:
    """This rank's sequence positions of a tensor every tensor-parallel rank holds whole (its gradient gathered)."""
    return DTensor.from_local(whole, tp_mesh, [Replicate()], run_check=False).redistribute(
        tp_mesh, [Shard(1)]).to_local()


def _on_hidden_states(change: Any, what: str) -> Any:
    """A forward pre-hook applying ``change`` to a module's input hidden states: its first positional argument, or
    ``hidden_states=`` (how Hugging Face's decoder layers call their attention)."""

    def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args:
            return (change(args[0]), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, kwargs | {"hidden_states": change(kwargs["hidden_states"])}
        raise ValueError(f"{what} was called without positional arguments or hidden_states=: no hidden states")

    return hook


class GatherSequence(ParallelStyle):
    """A module run on the whole sequence under sequence parallelism (the "gather" kind): its input hidden states,
    this rank's positions, are all-gathered at its entry (their gradient reduce-scattered back)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        def gather(tensor: torch.Tensor) -> torch.Tensor:
            if not isinstance(tensor, DTensor):
                tensor = DTensor.from_local(tensor, device_mesh, [Shard(1)], run_check=False)
            return tensor.redistribute(device_mesh, [Replicate()]).to_local()

        module.register_forward_pre_hook(_on_hidden_states(gather, f"{type(module).__name__}, planned 'gather',"),
                                         with_kwargs=True)
        return module


def _place(module: nn.Module, device_mesh: Any, placement_of: Any) -> None:
    """Turn each of ``module``'s own parameters into a DTensor on ``device_mesh`` (on the meta device too)."""
    for name, param in list(module.named_parameters(recurse=False)):
        placed = distribute_tensor(param.data, device_mesh, [placement_of(param)], src_data_rank=None)
        setattr(module, name, nn.Parameter(placed, requires_grad=param.requires_grad))


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """``x`` through a linear layer's (local) weight: stored out x in (``nn.Linear``), or in x out (``transposed``:
    GPT-2's ``Conv1D``, ``x @ weight + bias``)."""
    if not transposed:
        return F.linear(x, weight, bias)
    out = torch.matmul(x, weight)
    return out + bias if bias is not None else out


class PackedColumnParallel(ParallelStyle):
    """A linear layer whose output features pack several parts (the "packed_column" kind, litgpt's ``qkv``): each rank
    computes its share of every part (its heads' queries, keys and values). No contiguous shard of the weight is that
    share, so the weight (and bias) stay DTensors split in contiguous rows, the model's own order, which checkpoints
    keep; each forward gathers the weight, takes the rank's rows, and the backward reduce-scatters its gradient
    (ZeRO-3's traffic, for this layer only). The input arrives whole on every rank; its gradient, partial on each,
    is summed over the ranks (Megatron-LM's f). ``transposed``: the weight is stored in x out (GPT-2's ``c_attn``),
    its output features along dimension 1."""

    def __init__(self, sizes: tuple[int, ...], transposed: bool = False) -> None:
        super().__init__()
        self.sizes, self.transposed = sizes, transposed

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        ranks, rank = device_mesh.size(), device_mesh.get_local_rank()

        def out_dim(param: torch.Tensor) -> int:
            return 1 if self.transposed and param.dim() == 2 else 0

        _place(module, device_mesh, lambda param: Shard(out_dim(param)))
        starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        rows = torch.cat([torch.arange(start + rank * size // ranks, start + (rank + 1) * size // ranks)
                          for start, size in zip(starts, self.sizes)])

        def own(param: torch.Tensor | None) -> torch.Tensor | None:
            if param is None:
                return None
            whole = param.redistribute(device_mesh, [Replicate()]).to_local(grad_placements=[Partial()])
            return whole.index_select(out_dim(param), rows.to(whole.device))

        def forward(x: torch.Tensor) -> torch.Tensor:
            return _matmul(copy_to_tensor_parallel(x, device_mesh), own(module.weight), own(module.bias),
                           self.transposed)

        vars(module)["forward"] = forward  # an instance attribute: nn.Module.__call__ runs it, hooks included
        return module


class TransposedLinearParallel(ParallelStyle):
    """A linear layer stored in x out (GPT-2's ``Conv1D``: ``x @ weight + bias``), which torch's styles do not split:
    by column (weight split along its outputs, dimension 1, the bias with it; the input whole on every rank, its
    gradient summed, Megatron-LM's f) or by row (weight split along its inputs, dimension 0; the partial outputs
    summed, Megatron-LM's g, and the whole bias added once). Under sequence parallelism (``scatter``) a row layer's
    partial outputs are reduce-scattered to the rank's positions instead; a column layer then sits inside a module
    that gathers the sequence at its entry (:func:`styles` refuses any other)."""

    def __init__(self, kind: SplitKind, scatter: bool = False) -> None:
        super().__init__()
        self.column = kind == "column"
        self.scatter = scatter

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if self.column:
            _place(module, device_mesh, lambda param: Shard(param.dim() - 1))
        else:
            _place(module, device_mesh, lambda param: Shard(0) if param.dim() == 2 else Replicate())

        def forward(x: torch.Tensor) -> torch.Tensor:
            weight = module.weight.to_local()
            bias = None
            if module.bias is not None:
                # A row layer's whole bias added to the rank's positions only (sequence parallelism): its gradient
                # is this rank's share, summed over the ranks into the replicated bias.
                bias = module.bias.to_local(grad_placements=[Partial()]) if self.scatter else module.bias.to_local()
            if self.column:
                return _matmul(copy_to_tensor_parallel(x, device_mesh), weight, bias, transposed=True)
            partial = DTensor.from_local(torch.matmul(x, weight), device_mesh, [Partial()], run_check=False)
            out = partial.redistribute(device_mesh, [Shard(1) if self.scatter else Replicate()]).to_local()
            return out + bias if bias is not None else out

        vars(module)["forward"] = forward
        return module


class WholeLength:
    """The sequence length of the latest embedding output, which a plan that gathers at module entry keeps whole
    (a forward hook on the embedding records it)."""

    def __init__(self) -> None:
        self.value: int | None = None

    def record(self, module: nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor) and output.dim() >= 2:
            self.value = output.shape[1]


def token_embeddings(holder: nn.Module, plan: ParallelPlan) -> list[nn.Module]:
    """The modules embedding the tokens, which this rank holds: the plan's "vocabulary" layers, else a Hugging Face
    model's ``get_input_embeddings()`` (its plans split no embedding)."""
    named = [_find(holder, name) for name, kind in plan.outside.items() if kind == "vocabulary"]
    if not named and callable(getattr(holder, "get_input_embeddings", None)):
        named = [holder.get_input_embeddings()]
    return [module for module in named if _holds_parameters(module)]


def cut_to_own_positions(tp_mesh: Any, whole: WholeLength | None = None) -> Any:
    """A forward pre-hook giving a block only this rank's positions of its (whole) input hidden states: the first
    block of a plan that gathers at module entry, whose embedding output stays whole. With ``whole``, hidden states
    shorter than the embedding's output pass unchanged: a pseudo model runs its first block at later layers too,
    where they are the rank's positions already."""

    def cut(hidden: torch.Tensor) -> torch.Tensor:
        if whole is not None and whole.value is not None and hidden.shape[1] != whole.value:
            return hidden
        return _own_positions(hidden, tp_mesh)

    return _on_hidden_states(cut, "the first block")


def styles(entries: dict[str, SplitKind], *, sequence_parallel: bool = False,
           loss_parallel: bool = False, gathers: bool = False,
           packed: dict[str, tuple[int, ...]] | None = None, transposed: frozenset[str] = frozenset()
           ) -> dict[str, Any]:
    """torch's ``ParallelStyle`` for each of a plan's entries (see ``protocols.SplitKind``). With
    ``sequence_parallel`` the residual stream between the layers stays split by sequence position (Megatron-LM), and
    an expert layer gathers the sequence. ``loss_parallel``: the output layer leaves each rank its vocabulary shard.
    ``gathers``: the plan has "gather" modules (the embedding's output then stays whole, and the norms hand on plain
    tensors of their positions). ``packed``: the part sizes of each "packed_column" entry; ``transposed``: the
    entries whose weights are stored in x out."""
    sequence = Shard(1) if sequence_parallel else Replicate()
    gathered = [name for name, kind in entries.items() if kind == "gather"]
    # An expert layer runs on the whole sequence, and its experts on the rows routed to them, in no sequence order:
    # the linears of expert modules inside it take and give whole rows (a row layer's partial outputs all-reduced).
    in_expert_layer = [name for name, kind in entries.items() if kind == "expert"]
    made: dict[str, Any] = {}
    for name, kind in entries.items():
        if name in transposed and kind in ("column", "row"):
            inside_gathered = any(name.startswith(outer + ".") for outer in gathered)
            if sequence_parallel and kind == "column" and not inside_gathered:
                raise ValueError(f"sequence parallelism splits {name}, a layer the plan declares transposed (weights "
                                 "stored in x out), only inside a module that gathers the sequence ('gather'): use "
                                 "sequence_parallel=False or mark its parent 'gather'")
            made[name] = TransposedLinearParallel(kind, scatter=sequence_parallel and kind == "row")
        elif kind == "column":
            whole = any(name.startswith(outer + ".") for outer in gathered + in_expert_layer)
            made[name] = ColwiseParallel(input_layouts=Replicate() if whole else sequence)
        elif kind == "row":
            whole = any(name.startswith(outer + ".") for outer in in_expert_layer)
            made[name] = RowwiseParallel(output_layouts=Replicate() if whole else sequence)
        elif kind == "gathered_column":
            made[name] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        elif kind == "row_of_whole":
            whole = any(name.startswith(outer + ".") for outer in in_expert_layer)
            made[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate() if whole else sequence)
        elif kind == "vocabulary":
            # Each rank looks up the ids it holds (zeros for the others); the sum (reduce-scattered by position
            # under sequence parallelism, unless the plan cuts at the first block) is the embedding.
            made[name] = RowwiseParallel(input_layouts=Replicate(),
                                         output_layouts=Replicate() if gathers else sequence)
        elif kind == "output":
            # After a final norm that gathers the sequence (GPT-2's, whose model reshapes its output by the whole
            # length), the output layer's input is whole.
            made[name] = ColwiseParallel(input_layouts=Replicate() if gathered else sequence,
                                         output_layouts=Shard(-1) if loss_parallel else Replicate())
        elif kind == "sequence" and sequence_parallel:
            made[name] = SequenceParallel(use_local_output=gathers)
        elif kind == "gather" and sequence_parallel:
            made[name] = GatherSequence()
        elif kind == "heads":
            # Whole weights (replicated DTensors) applied to this rank's heads (dimension 2): the weight's gradient,
            # a sum over the heads, comes out partial on each rank and is summed into the replicated weight.
            made[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
        elif kind == "packed_column":
            made[name] = PackedColumnParallel((packed or {})[name], transposed=name in transposed)
        elif kind == "expert" and sequence_parallel:
            made[name] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                            use_local_output=True)
    return made


def _keep_own_positions(tp_mesh: Any) -> Any:
    """A forward hook cutting an MoE layer's output (the whole sequence's) back to this rank's positions."""

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        # A tensor, or a dataclass carrying it as ``output`` beside statistics (an MoE layer's routing statistics).
        if isinstance(output, torch.Tensor):
            return _own_positions(output, tp_mesh)
        return dataclasses.replace(output, output=_own_positions(output.output, tp_mesh))

    return hook


def _holds_parameters(module: nn.Module | None) -> bool:
    return module is not None and next(module.parameters(), None) is not None


def apply_tensor_parallel(holder: nn.Module, plan: ParallelPlan, tp_mesh: Any, *, loss_parallel: bool,
                          sequence_parallel: bool = False) -> None:
    """Split ``holder``'s blocks and other modules over ``tp_mesh`` as ``plan`` declares (in place, also on meta)."""
    # Weights the model ties (the embedding and the output layer): each style wraps its own Parameter, tied again
    # after, so every name updates one tensor as on one process (``ties.check_tensor_parallel_ties`` has refused
    # a tie split one way under one name and another way, or not at all, under another).
    ties = find_ties(holder)
    gathers = sequence_parallel and "gather" in plan.kinds()
    whole = WholeLength()
    if gathers:  # the embeddings' output length tells the first block's whole input from its later layers' cut one
        for embedding in token_embeddings(holder, plan):
            embedding.register_forward_hook(whole.record)
    for index, (block, entries) in enumerate(zip(holder.blocks, plan.blocks)):
        # A pipeline stage holds some blocks: the others are parameterless stand-ins, with nothing to split.
        if not _holds_parameters(block):
            continue
        parallelize_module(block, tp_mesh, styles(entries, sequence_parallel=sequence_parallel, gathers=gathers,
                                                  packed=plan.packed, transposed=plan.transposed))
        if gathers and index == 0:
            block.register_forward_pre_hook(cut_to_own_positions(tp_mesh, whole), with_kwargs=True)
        if sequence_parallel:
            for name, kind in entries.items():
                if kind == "expert":
                    block.get_submodule(name).register_forward_hook(_keep_own_positions(tp_mesh))
    present = {name: kind for name, kind in plan.outside.items() if _holds_parameters(_find(holder, name))}
    made = styles(present, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, gathers=gathers)
    if made:
        parallelize_module(holder, tp_mesh, made)
    for name, kind in present.items():
        if kind == "output":
            holder.get_submodule(name).register_forward_hook(_logits_hook(tp_mesh, loss_parallel=loss_parallel))
    retie(holder, ties)
    if plan.on_tensor_parallel is not None:  # the model's own head counts, for the rank's share of the heads
        plan.on_tensor_parallel(tp_mesh.size())


def _find(holder: nn.Module, name: str) -> nn.Module:
    try:
        return holder.get_submodule(name)
    except AttributeError:
        raise ValueError(f"the parallel plan of {type(holder).__name__} names {name!r}, which it does not have") \
            from None
