"""One process, nothing sharded: the one placement (``placement.py``) without FSDP2, the block streamer
(``offload.py``) keeping the planned blocks in host memory and the split optimizer (``split_optimizer.py``) stepping
them there."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...sharing import OptimizerStatePolicy, Perturbation, delink
from ..blocks import module_name
from ..checkpoint import read_optimizer_states
from ..layered import BlockEvents
from ..offload import BlockStreamer, StreamerEvents
from ..offload_plan import OffloadPlan
from ..optimizers import optimizer_state_to
from ..placement import place
from ..split_optimizer import SplitOptimizer, detach_to_host, device_optimizer_state_bytes, split_single_optimizer
from .base import Engine, EngineContext, Placed, holder_of


class LocalEngine(Engine):
    needs_process_group = False  # one process and nothing sharded

    def __init__(self) -> None:
        super().__init__()
        self.streaming: BlockStreamer | None = None
        self.optimizer: torch.optim.Optimizer | None = None  # the last one returned (host steps, telemetry read it)
        self._resident_model_bytes = 0

    def offload_streamer(self) -> BlockStreamer | None:
        return self.streaming

    def teardown(self, module: nn.Module | None) -> None:
        self.streaming = None  # release_to_host gave every offloaded parameter its values back
        self.optimizer = None

    def place(self, module: nn.Module, ctx: EngineContext) -> Placed:
        """The one placement (``placement.py``) without its FSDP2 steps: offloaded blocks materialize straight into
        host memory, where the block streamer keeps them as its masters, and the rest on the device."""
        self.ctx = ctx.without_weights()
        holder = holder_of(module)

        def stream(plan: OffloadPlan) -> None:
            self.streaming = BlockStreamer(holder, plan.offloaded, ctx.device, prefetch=ctx.offload.prefetch,
                                           pin_memory=ctx.pin_memory,
                                           block_prefixes=_block_prefixes(module, holder, plan.offloaded),
                                           offload_params="params" in ctx.offload.offload_states,
                                           delayed=ctx.offload.host_step == "delayed")

        plan = place(module, ctx, None, None, stream=stream).plan
        self.streaming.on_block_grads_ready = self._on_block_grads_ready
        self._resident_model_bytes = _resident_bytes(module, holder.blocks, self.streaming.blocks)
        return Placed(plan)

    # --------------------------------------------------------------------------------------------- optimizer
    def adapt_optimizers(self, optimizers: list[torch.optim.Optimizer],
                         module: nn.Module) -> list[torch.optim.Optimizer]:
        optimizer = self._split(optimizers)
        return [optimizer] if isinstance(optimizer, SplitOptimizer) else optimizers

    def _split(self, optimizers: list[torch.optim.Optimizer],
               carry_state_from: torch.optim.Optimizer | None = None) -> torch.optim.Optimizer:
        """Give the offloaded blocks' parameters to a host optimizer (the split optimizer), carrying the state of
        ``carry_state_from`` (after delinking) or of ``optimizers``' one."""
        if self.streaming is None or not self.streaming.blocks:
            if carry_state_from is not None:
                optimizer_state_to(carry_state_from, self.ctx.device)
            self.optimizer = optimizers[0] if optimizers else None
        else:
            self.optimizer = split_single_optimizer(optimizers, self.streaming, carry_state_from)
        self.update_static_bytes()
        return self.optimizer

    def _on_block_grads_ready(self, index: int) -> None:
        # Delayed host steps are submitted at the optimizer step, with the gradients clipped and unscaled.
        if isinstance(self.optimizer, SplitOptimizer) and not self.optimizer.delayed and self.ctx.host_step_allowed():
            self.optimizer.submit_host_step(index)

    def update_static_bytes(self) -> None:
        """Device model-state bytes that do not stream: resident parameters, their gradients, the device
        optimizer's state (which grows at the first step)."""
        if self.streaming is not None:
            self.streaming.static_device_bytes = (self._resident_model_bytes
                                                  + device_optimizer_state_bytes(self.optimizer))

    # ---------------------------------------------------------------------------------------------- training
    def block_events(self) -> BlockEvents | None:
        return StreamerEvents(self.streaming) if self.streaming is not None and self.streaming.blocks else None

    def post_backward(self, optimizers: list[Any]) -> None:
        if self.streaming is not None:
            self.streaming.finish_backward()

    # --------------------------------------------------------------------------------------------- delinking
    def delink(self, module: nn.Module, optimizer: torch.optim.Optimizer, ctx: EngineContext,
               num_unique_blocks: int | None, optimizer_state: OptimizerStatePolicy,
               perturb: Perturbation | None = None) -> tuple[torch.optim.Optimizer, Placed]:
        """Delink with the whole model in host memory (the real model may not fit on the device: that is why it was
        trained pseudo first), then re-plan: only the blocks the new plan keeps resident move back."""
        plain = detach_to_host(self.streaming, optimizer, module)
        self.streaming = None
        new_optimizer = delink(module, plain, num_unique_blocks=num_unique_blocks, optimizer_state=optimizer_state,
                               perturb=perturb)
        placed = self.place(module, ctx)
        return self._split([new_optimizer], carry_state_from=new_optimizer), placed

    # ------------------------------------------------------------------------------------------- checkpoints
    # The module's own state_dict()/load_state_dict() read and write the host masters (the block streamer's
    # state-dict hooks), so Lightning's whole-model save and the base class's load serve this layout as they are.
    def load_optimizer_state(self, module: nn.Module, index: int, optimizer: torch.optim.Optimizer,
                             checkpoint: dict[str, Any], sharded_path: str | None, device: torch.device) -> None:
        if isinstance(optimizer, SplitOptimizer):
            # The split optimizer loads a whole optimizer's state, numbered as torch numbers it: a sharded checkpoint
            # (FSDP2: zero2/zero3, tensor, expert or pipeline parallel) is gathered into that form first.
            states = checkpoint["optimizer_states"] if sharded_path is None else read_optimizer_states(sharded_path)
            optimizer.load_state_dict(states[index])  # host state stays on the host
        else:
            super().load_optimizer_state(module, index, optimizer, checkpoint, sharded_path, device)
        self.update_static_bytes()


def _block_prefixes(module: nn.Module, holder: nn.Module, indices: Any) -> dict[int, str]:
    """Each block's state-dict prefix inside ``module``: the block streamer names its host masters with them, so
    the module's own ``state_dict`` reads them under their usual names (a declared block list's own name,
    ``model.model.layers.3.``, not its ``blocks`` alias; a block that several layers share, under the first)."""
    try:
        return {index: module_name(module, holder.blocks[index]) + "." for index in indices}
    except ValueError:
        raise ValueError("the block sequence is not part of the LightningModule") from None


def _resident_bytes(module: nn.Module, blocks: nn.ModuleList, offloaded: Any) -> int:
    """Device bytes of the parameters that never stream, with the gradients of the trainable ones (counted once:
    they do not change size until the next placement)."""
    streamed = {id(p) for index in offloaded for p in blocks[index].parameters()}
    return sum(p.numel() * p.element_size() * (2 if p.requires_grad else 1) for p in module.parameters()
               if id(p) not in streamed)
