"""Layered (breadth-first) gradient accumulation, a pure-torch executor for one optimizer step (Lamy-Poirier 2021,
arXiv:2106.02679): every micro-batch passes layer i before layer i + 1 (backward, i - 1), so the strategy (through
:class:`BlockEvents`) fetches each block once per direction and reduces its gradient once, not m times.

Each layer's output is detached and handed on as a fresh leaf: one small autograd graph per (layer, micro-batch),
its input leaf's ``.grad`` feeding the layer below. With ``recompute`` forward keeps only these boundaries and
backward re-runs one layer for one micro-batch at a time, under the RNG state of its first run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..protocols import LayeredStages  # noqa: F401  (defined with the other contracts; imported here too)

__all__ = ["BlockEvents", "LayeredStages", "LayeredStep", "layered_forward", "split_micro_batches"]


class BlockEvents:
    """Callbacks a strategy overrides to move blocks (no-ops here). They fire per layer with its block's index, so a
    block several layers share sees one before/after pair per layer; the step enters the events as a context around
    the forward and around the backward (a block streamer opens and closes its copy streams there)."""

    def __enter__(self) -> BlockEvents:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def before_forward(self, block: int) -> None:
        """Before the first micro-batch runs this layer's block."""

    def after_forward(self, block: int) -> None:
        """After the last micro-batch ran this layer's block."""

    def before_backward(self, block: int) -> None:
        """Before the first micro-batch's backward (and recompute) through this layer's block."""

    def before_micro_backward(self, block: int, micro_batch: int, last: bool) -> None:
        """Before one micro-batch's backward through this layer; ``last`` marks the final one (e.g. to start the
        gradient reduction with it, as DDP's ``no_sync`` does for the last micro-batch)."""

    def after_backward(self, block: int) -> None:
        """After the last micro-batch's backward through this layer."""

    def before_head_backward(self) -> None:
        """Before the backward of the first micro-batch's head (the first backward of the step)."""

    def before_embed_backward(self, micro_batch: int, last: bool) -> None:
        """Before one micro-batch's backward through the embedding stage; ``last`` marks the step's final one."""


def split_micro_batches(batch: Any, micro_batches: int) -> list[Any]:
    """Split every tensor of ``batch`` along dim 0 into ``micro_batches`` equal parts, through tuples (named ones
    too), lists and dicts; other leaves are shared by every micro-batch."""
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be an integer >= 1, got {micro_batches!r}")
    return _split(batch, micro_batches)


def _split(obj: Any, parts: int) -> list[Any]:
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0:
            raise ValueError("cannot split a 0-dim tensor into micro-batches: batch tensors need a batch dimension")
        size = obj.shape[0]
        if size % parts:
            raise ValueError(f"batch size {size} is not divisible by micro_batches={parts}: choose a number of "
                             f"micro-batches that divides it")
        return list(obj.split(size // parts))
    if isinstance(obj, dict):
        columns = {key: _split(value, parts) for key, value in obj.items()}
        return [type(obj)((key, column[i]) for key, column in columns.items()) for i in range(parts)]
    if isinstance(obj, (tuple, list)):
        columns = [_split(value, parts) for value in obj]
        rows = [[column[i] for column in columns] for i in range(parts)]
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple: positional constructor
            return [type(obj)(*row) for row in rows]
        return [type(obj)(row) for row in rows]
    return [obj] * parts


def _boundary(hidden: torch.Tensor) -> torch.Tensor:
    """Cut the graph at a block boundary: a leaf the next layer can backpropagate into."""
    leaf = hidden.detach()
    return leaf.requires_grad_(leaf.is_floating_point() or leaf.is_complex())


@dataclass(frozen=True)
class _RerunState:
    """What a recomputed layer must see again: the RNG state and the autocast settings of its first forward."""

    cpu_rng: torch.Tensor
    cuda_rng: torch.Tensor | None
    autocast: tuple[tuple[str, bool, torch.dtype], ...]


def _rng_state(hidden: torch.Tensor) -> _RerunState:
    cuda = torch.cuda.get_rng_state(hidden.device) if hidden.is_cuda else None
    # Backward (where the rerun happens) runs outside the training step's autocast context: record it here.
    kinds = ("cpu", "cuda") if hidden.is_cuda else ("cpu",)
    autocast = tuple((kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in kinds)
    return _RerunState(torch.get_rng_state(), cuda, autocast)


def _rerun(stages: LayeredStages, layer: int, leaf: torch.Tensor, context: Any,
           state: _RerunState) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Re-run one layer with grad under the RNG state and autocast settings of its first forward
    (torch.utils.checkpoint's preserve_rng_state), leaving the global RNG stream as it was."""
    devices = [leaf.device] if state.cuda_rng is not None else []
    with torch.random.fork_rng(devices=devices), contextlib.ExitStack() as autocast:
        torch.set_rng_state(state.cpu_rng)
        if state.cuda_rng is not None:
            torch.cuda.set_rng_state(state.cuda_rng, leaf.device)
        for kind, enabled, dtype in state.autocast:
            autocast.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
        with torch.enable_grad():
            return stages.layer(layer, leaf, context)


class LayeredStep:
    """One optimizer step of layered accumulation, split where Lightning splits a step: :func:`layered_forward` runs
    every micro-batch's forward (in ``training_step``), :meth:`backward` their backward (in ``backward``). The heads
    keep their graphs until backward: their logits are as large as those of one step on the whole batch."""

    def __init__(self, stages: LayeredStages, events: BlockEvents, recompute: bool, m: int) -> None:
        self.stages = stages
        self.events = events
        self.recompute = recompute
        self.m = m
        self.embedded: list[torch.Tensor | None] = []
        self.contexts: list[Any] = []
        # inputs[layer][i]: the boundary leaf layer `layer` reads for micro-batch i; inputs[L] feeds the head.
        self.inputs: list[list[torch.Tensor | None]] = []
        self.outputs: list[list[torch.Tensor | None]] = []  # with graph, only without recompute
        self.extras: list[list[torch.Tensor | None]] = []
        self.rng_states: list[list[_RerunState]] = []
        self.head_losses: list[torch.Tensor | None] = []
        self.loss = torch.zeros(())  # detached mean of the micro-batch losses (head loss plus the layers' extra ones)
        self.metrics: dict[str, torch.Tensor] = {}  # mean over micro-batches of the head metrics
        self._done = False

    def backward(self, scale: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Backward of every micro-batch, layer by layer from the head down; gradients accumulate into ``.grad``.
        ``scale`` multiplies every loss term before its backward (a ``GradScaler``'s ``scale``), so the gradients
        carry the scale the optimizer step's unscaling divides out, as a scaled loss's backward would."""
        scale = scale if scale is not None else (lambda tensor: tensor)
        if self._done:
            raise RuntimeError("this layered step has already run its backward")
        self._done = True
        stages, events, m = self.stages, self.events, self.m
        num_layers = len(stages.layer_to_block)
        events.before_head_backward()
        grads: list[torch.Tensor | None] = []
        for i in range(m):
            leaf = self.inputs[num_layers][i]
            loss = self.head_losses[i]
            if loss is not None and loss.requires_grad:
                torch.autograd.backward(scale(loss / m))
            grads.append(leaf.grad)
            self.inputs[num_layers][i] = self.head_losses[i] = None

        for layer in reversed(range(num_layers)):
            block = stages.layer_to_block[layer]
            events.before_backward(block)
            for i in range(m):
                events.before_micro_backward(block, i, last=i == m - 1)
                leaf = self.inputs[layer][i]
                if self.recompute:
                    hidden, extra = _rerun(stages, layer, leaf, self.contexts[i], self.rng_states[layer][i])
                else:
                    hidden, extra = self.outputs[layer][i], self.extras[layer][i]
                tensors, grad_tensors = [], []
                if grads[i] is not None and hidden.requires_grad:
                    tensors.append(hidden)
                    grad_tensors.append(grads[i])
                if extra is not None and extra.requires_grad:
                    tensors.append(scale(extra / m))
                    grad_tensors.append(None)
                if tensors:
                    torch.autograd.backward(tensors, grad_tensors)
                # Drop this (layer, micro-batch)'s graph and the boundary above as soon as they are used.
                grads[i] = leaf.grad
                self.inputs[layer][i] = None
                if not self.recompute:
                    self.outputs[layer][i] = self.extras[layer][i] = None
                del hidden, extra, tensors, grad_tensors, leaf
            events.after_backward(block)

        for i in range(m):
            events.before_embed_backward(i, last=i == m - 1)
            hidden = self.embedded[i]
            if grads[i] is not None and hidden.requires_grad:
                torch.autograd.backward(hidden, grads[i])
            self.embedded[i] = grads[i] = None


def layered_forward(stages: LayeredStages, micro_batches: list[Any], events: BlockEvents | None = None, *,
                    recompute: bool = False) -> LayeredStep:
    """The forward half of one layered step, under the caller's autocast: every micro-batch through layer i before layer
    i + 1, then the head. The step's ``loss`` and ``metrics`` are known on return; its ``backward()`` finishes it."""
    if not micro_batches:
        raise ValueError("an accumulation step needs at least one micro-batch, got an empty list")
    if not torch.is_grad_enabled():
        raise RuntimeError("gradient accumulation needs autograd: call it with gradients enabled, not under no_grad")
    events = events if events is not None else BlockEvents()
    m = len(micro_batches)
    step = LayeredStep(stages, events, recompute, m)
    for micro_batch in micro_batches:
        hidden, context = stages.embed(micro_batch)
        step.embedded.append(hidden)
        step.contexts.append(context)

    step.inputs.append([_boundary(hidden) for hidden in step.embedded])
    totals: list[torch.Tensor] = [torch.zeros(()) for _ in range(m)]  # detached losses per micro-batch
    for layer, block in enumerate(stages.layer_to_block):
        events.before_forward(block)
        layer_out, layer_extra, layer_rng, next_inputs = [], [], [], []
        for i in range(m):
            leaf = step.inputs[layer][i]
            if recompute:
                layer_rng.append(_rng_state(leaf))
                with torch.no_grad():
                    hidden, extra = stages.layer(layer, leaf, step.contexts[i])
            else:
                hidden, extra = stages.layer(layer, leaf, step.contexts[i])
                layer_out.append(hidden)
                layer_extra.append(extra)
            if extra is not None:
                totals[i] = totals[i].to(extra.device) + extra.detach()
            next_inputs.append(_boundary(hidden))
        events.after_forward(block)
        step.outputs.append(layer_out)
        step.extras.append(layer_extra)
        step.rng_states.append(layer_rng)
        step.inputs.append(next_inputs)

    metrics: list[dict[str, torch.Tensor]] = []
    for i in range(m):
        loss, head_metrics = stages.head(step.inputs[-1][i], step.contexts[i])
        step.head_losses.append(loss)
        totals[i] = totals[i].to(loss.device) + loss.detach()
        metrics.append({key: value.detach() for key, value in head_metrics.items()})
    step.loss = torch.stack([t.float() for t in totals]).mean()
    step.metrics = {key: torch.stack([values[key].float() for values in metrics]).mean() for key in metrics[0]}
    return step
