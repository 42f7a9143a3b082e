"""How one training batch's forward and backward run, one step runner per mode: :class:`StandardSteps` (Lightning's
own), :class:`LayeredSteps` (every micro-batch's forward block by block in ``training_step``, their backward in
``backward``), :class:`PipelinedSteps` (the schedule runs the whole step in ``training_step``; ``backward`` hands
the gradients back). A runner returns None from ``training_step`` to skip the step (the module refused the loss).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import nn

from ..protocols import DefinesLayeredStages, ScreensLoss
from .accounting import CollectiveCounter, counting
from .layered import LayeredStep, layered_forward, split_micro_batches
from .pipeline.rank_stages import RankStages
from .sharding import stages_through_root

if TYPE_CHECKING:
    from .engines.base import Engine  # the engine gives the layered runner its events; it builds the runners


class StepRunner:
    """One accumulation mode's forward and backward, by default Lightning's own. ``lightning_step`` /
    ``lightning_backward``: Lightning's own (``Strategy``'s) for this call, which a runner may use or replace; a
    runner that replaces the backward calls ``post_backward`` after it, as Lightning's does."""

    def __init__(self, module: nn.Module, precision: Precision, counter: CollectiveCounter | None) -> None:
        self.module = module
        self.precision = precision
        self.counter = counter

    def training_step(self, batch: Any, lightning_step: Callable[[], Any]) -> Any:
        with counting(self.counter):
            return lightning_step()

    def backward(self, loss: torch.Tensor, lightning_backward: Callable[[], torch.Tensor],
                 post_backward: Callable[[torch.Tensor], None]) -> torch.Tensor:
        with counting(self.counter):
            return lightning_backward()

    def usable(self, loss: torch.Tensor) -> bool:
        """The module's non-finite loss policy, as in its own ``training_step``."""
        return not isinstance(self.module, ScreensLoss) or self.module.loss_is_usable(loss)


class StandardSteps(StepRunner):
    """Lightning's own steps: micro-batches are Lightning's ``accumulate_grad_batches``."""


class LayeredSteps(StepRunner):
    def __init__(self, module: nn.Module, precision: Precision, counter: CollectiveCounter | None, engine: Engine, *,
                 micro_batches: int, recompute: bool) -> None:
        super().__init__(module, precision, counter)
        if not isinstance(module, DefinesLayeredStages):
            raise ValueError(
                f"P2RStrategy(accumulation='layered') needs the LightningModule to define layered_stages() -> "
                f"LayeredStages (embedding, per-layer and head stages); {type(module).__name__} does not. For a "
                "decoder, CausalLMModule(model=..., parts=DecoderParts(blocks=..., embed=(...), norm=..., head=..., "
                "base=...)) defines it from the model's module names (docs/your_model.md)")
        self.engine = engine
        self.micro_batches, self.recompute = micro_batches, recompute
        self._step: LayeredStep | None = None

    def training_step(self, batch: Any, lightning_step: Callable[[], Any]) -> Any:
        micro = split_micro_batches(batch, self.micro_batches)
        with self.precision.train_step_context(), counting(self.counter):
            stages = stages_through_root(self.module.layered_stages(), self.engine.outside_blocks_root())
            events = self.engine.block_events()
            with events or contextlib.nullcontext():
                self._step = layered_forward(stages, micro, events, recompute=self.recompute)
        if stages.log_metrics is not None:
            stages.log_metrics(self._step.metrics)
        if not self.usable(self._step.loss):
            self._step = None
            return None  # Lightning skips the backward and the optimizer step
        return self._step.loss

    def backward(self, loss: torch.Tensor, lightning_backward: Callable[[], torch.Tensor],
                 post_backward: Callable[[torch.Tensor], None]) -> torch.Tensor:
        step, self._step = self._step, None
        if step is None:  # a forward outside layered_forward (none today), handled as Lightning would
            return super().backward(loss, lightning_backward, post_backward)
        loss = self.precision.pre_backward(loss, self.module)
        # The micro-batch losses are backpropagated one by one, not the returned loss: a gradient scaler (fp16)
        # must scale each of them, or the optimizer step unscales gradients that were never scaled.
        scaler = self.precision.scaler if isinstance(self.precision, MixedPrecision) else None
        with counting(self.counter), step.events or contextlib.nullcontext():
            step.backward(scale=scaler.scale if scaler is not None else None)
        loss = self.precision.post_backward(loss, self.module)
        post_backward(loss)
        return loss


class PipelinedSteps(StepRunner):
    def __init__(self, module: nn.Module, precision: Precision, counter: CollectiveCounter | None,
                 stages: RankStages, uncounted: Callable[[], Any]) -> None:
        super().__init__(module, precision, counter)
        self.stages = stages
        self.uncounted = uncounted

    def training_step(self, batch: Any, lightning_step: Callable[[], Any]) -> Any:
        with self.precision.train_step_context(), counting(self.counter):
            result = self.stages.train_step(batch, self.uncounted)
        log_metrics = self.stages.parts.stages.log_metrics
        if log_metrics is not None:
            log_metrics(result.metrics)
        if not self.usable(result.loss):
            self.stages.drop_gradients()
            return None
        return result.loss

    def backward(self, loss: torch.Tensor, lightning_backward: Callable[[], torch.Tensor],
                 post_backward: Callable[[torch.Tensor], None]) -> torch.Tensor:
        self.stages.restore_gradients()
        post_backward(loss)
        return loss
