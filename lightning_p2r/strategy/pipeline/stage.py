"""One pipeline stage as a module ``torch.distributed.pipelining.PipelineStage`` can run: a range of whole layers of
the model, plus the embedding on the first stage and the head on the last; the FSDP2 root of its blocks where FSDP2
wraps them (data ranks per stage, a model split or an offload: ``Layout.wraps_blocks``), a plain module otherwise;
its blocks stay registered in the model. Its forward takes the previous stage's hidden states and the micro-batch
itself (every rank of a pipeline reads it), from which a later stage rebuilds the context the embedding would have
made.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ...protocols import PipelineParts


class AbsentModule(nn.Module):
    """Stands where the model holds a module that lives on another pipeline rank: no parameters, no forward."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this part of the model lives on another pipeline rank; under pipeline parallelism the "
                           "strategy runs the model through its stages")


def keep_only(holder: nn.Module, blocks: set[int], modules: list[nn.Module]) -> None:
    """Replace each block not in ``blocks``, and each other module owning parameters outside ``modules`` (at any
    depth: a Hugging Face head sits beside the module holding the embedding), by a stand-in."""
    for index in range(len(holder.blocks)):
        if index not in blocks:
            holder.blocks[index] = AbsentModule()
    kept = {id(m) for module in modules for m in module.modules()}
    inside = {id(m) for m in holder.blocks.modules()}
    replaced: list[str] = []
    for name, child in list(holder.named_modules()):
        if not name or id(child) in inside or id(child) in kept or any(name.startswith(r + ".") for r in replaced):
            continue
        if next(child.parameters(recurse=False), None) is not None:
            owner, _, attribute = name.rpartition(".")
            setattr(holder.get_submodule(owner), attribute, AbsentModule())
            replaced.append(name)


class _AttachLoss(torch.autograd.Function):
    """Pass ``hidden`` through; in backward give ``loss`` the gradient one, so a layer's extra loss (an MoE router's)
    joins the backward on the stage that computed it (as DeepSeek-MoE attaches its auxiliary loss). The output is a
    copy: FSDP2 warns about a stage returning a view (an in-place op on it would skip its pre-backward hook)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return hidden.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.loss_meta
        return grad, torch.ones(shape, dtype=dtype, device=device)


def attach_loss(hidden: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    return _AttachLoss.apply(hidden, loss)


def run_checkpointed(run_layer: Callable[..., Any], layer: int, hidden: torch.Tensor, context: Any) -> Any:
    """``run_layer(layer, hidden, context)`` under activation checkpointing, as a stage with recompute runs each layer:
    only the layer's input is kept; backward runs the layer again (same RNG state). ``lightning-p2r calibrate`` times
    this same call to price it (``Cluster.dense_checkpoint_overhead``)."""
    return checkpoint(run_layer, layer, hidden, context, use_reentrant=False)


class PipelineStageModule(nn.Module):
    """Layers ``layers`` of the model, the embedding if ``first``, the head if ``last``. In training the last stage
    returns the micro-batch's loss (the schedule's loss function passes it on), in evaluation the logits. Each forward
    keeps the micro-batch's context, whose router records the strategy gathers after the step."""

    def __init__(self, parts: PipelineParts, blocks: nn.ModuleList, layers: range, *, first: bool, last: bool,
                 embed_modules: list[nn.Module], head_modules: list[nn.Module], recompute: bool = False) -> None:
        super().__init__()
        self.recompute = recompute
        self.layers = layers
        self.first, self.last = first, last
        used = sorted({parts.stages.layer_to_block[layer] for layer in layers})
        modules = [blocks[i] for i in used]
        if first:
            modules += embed_modules
        if last:
            modules += [m for m in head_modules if not any(m is other for other in modules)]
        self.owned = nn.ModuleList(modules)
        self._parts = parts  # closures over the model, not modules: not registered
        self.computes_loss = True
        self.contexts: list[Any] = []
        self.losses: list[torch.Tensor] = []
        self.forward_calls = 0
        self.after_last_forward: Callable[[PipelineStageModule], None] | None = None
        """Called after the step's last forward (placement reshards there: ZeRO-3 with a breadth-first schedule)."""
        self.micro_batches = 1

    def begin(self, *, computes_loss: bool, micro_batches: int, infers_shapes: bool) -> None:
        """Before a step: the mode, and a fresh record of contexts and losses. ``infers_shapes``: the schedule is new,
        so its stage first runs one forward on placeholder inputs to learn its shapes (not one of the micro-batches)."""
        self.computes_loss = computes_loss
        self.micro_batches = micro_batches
        self.contexts, self.losses = [], []
        self.forward_calls = -1 if infers_shapes else 0

    def step_contexts(self) -> list[Any]:
        """The contexts of the step's micro-batches, in order (the shape inference's forward comes first)."""
        return self.contexts[-self.micro_batches:]

    def step_losses(self) -> list[torch.Tensor]:
        return self.losses[-self.micro_batches:] if self.last else []

    def forward(self, hidden: torch.Tensor | None = None, *, tokens: torch.Tensor) -> torch.Tensor:
        stages = self._parts.stages
        if self.first:
            hidden, context = stages.embed(tokens)
        else:
            context = self._parts.context(tokens)
        training = self.computes_loss and torch.is_grad_enabled()
        extras: list[torch.Tensor] = []
        for layer in self.layers:
            if training and self.recompute:
                # A rerun layer overwrites its own router records in the context.
                hidden, extra = run_checkpointed(stages.layer, layer, hidden, context)
            else:
                hidden, extra = stages.layer(layer, hidden, context)
            if extra is not None and training:
                extras.append(extra)
        if extras:
            hidden = attach_loss(hidden, torch.stack(extras).sum())
        self.contexts.append(context)
        self.forward_calls += 1
        if self.forward_calls == self.micro_batches and self.after_last_forward is not None:
            self.after_last_forward(self)
        if not self.last:
            return hidden
        if not self.computes_loss:
            return self._parts.logits(hidden)
        loss, _ = stages.head(hidden, context)
        self.losses.append(loss.detach())
        return loss


def stage_output_loss(output: torch.Tensor, target: Any) -> torch.Tensor:
    """The schedule's loss function: the last stage already returns the micro-batch's loss."""
    return output
