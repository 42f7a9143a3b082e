"""Tensor parallelism (Megatron-LM) for a block-sequence model, applied from outside with ``parallelize_module``.

Per block: the attention's fused qkv projection is split column-wise (its rows are head-major, so each rank gets
whole heads), the output projection row-wise; a dense FFN's first matrix column-wise, its second row-wise. Each
pair costs one all-reduce of the block's activations in forward and one in backward (Megatron's f and g). Norms,
the router and position embeddings stay replicated: their inputs are the same on every tensor-parallel rank.
MoE experts are split along their hidden dimension by :mod:`.experts` (the same column/row pattern inside each
expert). Outside the blocks the token embedding is split by vocabulary rows (each rank looks up its rows, the
partial embeddings are all-reduced) and the LM head by vocabulary columns. In training each rank keeps its
vocabulary shard of the logits and the loss is computed from the shards (``loss.py``, Megatron's
vocabulary-parallel cross-entropy), so the logits are never gathered whole; in evaluation they are gathered, so
metrics and generation read ordinary logits.

Rotary embeddings and the banded attention act per head, so they run unchanged on a rank's heads.

With sequence parallelism (``block_plan(sequence_parallel=True)``) the activations between the layers stay split
by sequence position: each all-reduce becomes a reduce-scatter (row-parallel outputs, the embedding) and an
all-gather (column-parallel inputs) of the same bytes, and the norms run on a rank's positions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ...models.moe import MoEFeedForward, MoEOutput


def _gather_logits_outside_training(tp_mesh: Any) -> Any:
    """A forward hook for the head: in evaluation (metrics, generation, a validation loss) the vocabulary shards are
    gathered into whole logits; in training each rank keeps its shard for the vocabulary-parallel loss."""

    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        if module.training:
            return None
        return DTensor.from_local(output, tp_mesh, [Shard(-1)], run_check=False).full_tensor()

    return hook


def block_plan(block: nn.Module, *, sequence_parallel: bool = False) -> dict[str, Any]:
    """The ``parallelize_module`` plan of one block: the linear layers it has, by their names in the block. With
    ``sequence_parallel`` the residual stream between the layers stays split by sequence position: the norms run on
    a rank's positions, the column-parallel layers gather the sequence first, the row-parallel ones reduce-scatter
    it (Megatron-LM's sequence parallelism), and an MoE layer gathers the sequence and keeps its rank's part of the
    output."""
    plan: dict[str, Any] = {}
    names = {name for name, _ in block.named_modules()}
    sequence = Shard(1) if sequence_parallel else Replicate()
    if {"attn.qkv", "attn.out"} <= names:
        plan |= {"attn.qkv": ColwiseParallel(input_layouts=sequence),
                 "attn.out": RowwiseParallel(output_layouts=sequence)}
    if {"ffn.fc_in", "ffn.fc_out"} <= names:
        plan |= {"ffn.fc_in": ColwiseParallel(input_layouts=sequence),
                 "ffn.fc_out": RowwiseParallel(output_layouts=sequence)}
    if sequence_parallel:
        plan |= {name: SequenceParallel() for name in ("attn_norm", "ffn_norm") if name in names}
        if isinstance(getattr(block, "ffn", None), MoEFeedForward):
            plan["ffn"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                             use_local_output=True)
    return plan


def _keep_own_positions(tp_mesh: Any) -> Any:
    """A forward hook for an MoE layer under sequence parallelism: its output (computed on the whole sequence, the
    same on every tensor-parallel rank) is cut back to this rank's positions."""

    def hook(module: nn.Module, args: Any, output: MoEOutput) -> MoEOutput:
        whole = DTensor.from_local(output.output, tp_mesh, [Replicate()], run_check=False)
        return dataclasses.replace(output, output=whole.redistribute(tp_mesh, [Shard(1)]).to_local())

    return hook


def _holds_parameters(module: nn.Module | None) -> bool:
    return module is not None and next(module.parameters(), None) is not None


def apply_tensor_parallel(transformer: nn.Module, tp_mesh: Any, *, loss_parallel: bool,
                          sequence_parallel: bool = False) -> None:
    """Split ``transformer``'s blocks, embedding and head over ``tp_mesh`` (in place; works on the meta device).
    ``loss_parallel``: in training the head leaves each rank its vocabulary shard of the logits (the loss is then
    computed by ``loss.VocabParallelCrossEntropy``); in evaluation, and without it, the logits are gathered."""
    missing = [name for name in ("tok_embeddings", "lm_head") if not isinstance(getattr(transformer, name, None),
                                                                             nn.Module)]
    # A pipeline stage holds some blocks and maybe the embedding or the head: the others are parameterless
    # stand-ins, which have nothing to split.
    present = {name for name in ("tok_embeddings", "lm_head", "norm") if _holds_parameters(getattr(transformer, name,
                                                                                                   None))}
    if missing:
        raise ValueError(f"P2RStrategy(tensor_parallel>1) splits an M6-style model (blocks, tok_embeddings, lm_head); "
                         f"{type(transformer).__name__} has no {missing}")
    sequence = Shard(1) if sequence_parallel else Replicate()
    for block in transformer.blocks:
        if not _holds_parameters(block):
            continue
        parallelize_module(block, tp_mesh, block_plan(block, sequence_parallel=sequence_parallel))
        if sequence_parallel and isinstance(getattr(block, "ffn", None), MoEFeedForward):
            block.ffn.register_forward_hook(_keep_own_positions(tp_mesh))
    tied = {"tok_embeddings", "lm_head"} <= present and transformer.lm_head.weight is transformer.tok_embeddings.weight
    plan: dict[str, Any] = {
        # Vocabulary rows: each rank looks up the ids it holds (zeros for the others); the sum (reduce-scattered by
        # position under sequence parallelism) is the embedding.
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=sequence),
        # Vocabulary columns: each rank's shard of the logits (loss parallel), or gathered whole after the matmul.
        "lm_head": ColwiseParallel(input_layouts=sequence, output_layouts=Shard(-1) if loss_parallel else Replicate()),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    plan = {name: style for name, style in plan.items() if name in present}
    if plan:
        parallelize_module(transformer, tp_mesh, plan)
    if loss_parallel and "lm_head" in present:
        transformer.lm_head.register_forward_hook(_gather_logits_outside_training(tp_mesh))
    if tied:
        # Both styles place the shared weight as vocabulary rows (Shard(0)) but each wraps it in a Parameter of its
        # own: tie them again, so the embedding and the head update one tensor, as on one process.
        transformer.lm_head.weight = transformer.tok_embeddings.weight
