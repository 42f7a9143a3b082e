"""One process, nothing sharded: the streaming engine (``offload.py``) keeps the planned blocks in host memory and
the split optimizer (``split_optimizer.py``) steps them there."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn

from ...sharing import OptimizerStatePolicy, Perturbation, delink, rebind_scheduler
from ..host_state import blocks_prefix, resident_model_bytes
from ..layered import BlockEvents
from ..materialize import Initializer, allocate, has_meta_tensors
from ..offload import EngineEvents, OffloadEngine
from ..optimizers import optimizer_state_to
from ..split_optimizer import (
    SplitOptimizer,
    detach_to_host,
    device_optimizer_state_bytes,
    split_single_optimizer,
)
from .base import Engine


class LocalEngine(Engine):
    name = "local"

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy)
        self.streaming: OffloadEngine | None = None
        self._resident_model_bytes = 0

    def setup_environment(self) -> None:
        strategy = self.strategy
        strategy.accelerator.setup_device(strategy.root_device)
        strategy.set_world_ranks()  # one process and nothing sharded: no process group is needed

    def offload_engine(self) -> OffloadEngine | None:
        return self.streaming

    def teardown(self) -> None:
        self.streaming = None  # release_to_host gave every offloaded parameter its values back

    def setup(self, trainer: L.Trainer) -> None:
        strategy = self.strategy
        strategy.accelerator.setup(trainer)
        strategy.model = strategy.precision_plugin.convert_module(strategy.model)
        self.attach()
        if trainer.state.fn == TrainerFn.FITTING:
            strategy.setup_optimizers(trainer)
        strategy.setup_precision_plugin()

    def attach(self) -> None:
        """Plan (from the shapes alone: the model may still be on the meta device), materialize offloaded blocks
        straight into host memory, where the streaming engine keeps them as its masters, and the rest on the
        device."""
        strategy = self.strategy
        holder = strategy.holder()
        strategy.plan = plan = strategy.make_plan(holder)
        module = strategy.lightning_module
        lazy = has_meta_tensors(module)
        initializer = Initializer(module, holder) if lazy else None
        fill = lazy and not strategy.has_deferred_weights
        if lazy:
            for index in plan.offloaded:
                params = allocate(holder.blocks[index], "cpu")
                if fill:
                    initializer.fill(params)
        self.streaming = OffloadEngine(holder, plan.offloaded, strategy.root_device, prefetch=strategy.prefetch,
                                       pin_memory=strategy.resolved_pin_memory,
                                       param_prefix=blocks_prefix(module, holder),
                                       offload_params="params" in strategy.offload_states)
        if lazy:
            params = allocate(module, strategy.root_device)
            if fill:
                initializer.fill(params)
        strategy.model.to(strategy.root_device)  # the offloaded blocks' parameters are empty device placeholders
        strategy.load_deferred_weights()
        self.streaming.on_block_grads_ready = self._on_block_grads_ready
        self._resident_model_bytes = resident_model_bytes(module, holder.blocks, self.streaming.blocks)

    # --------------------------------------------------------------------------------------------- optimizer
    def adapt_optimizers(self) -> None:
        self.split_optimizer(rebind_schedulers=True)

    def split_optimizer(self, carry_state_from: torch.optim.Optimizer | None = None, *,
                        rebind_schedulers: bool) -> None:
        """Give the offloaded blocks' parameters to a host optimizer (the split optimizer), carrying the state of
        ``carry_state_from`` (after delinking) or of the strategy's optimizer."""
        strategy = self.strategy
        if self.streaming is None or not self.streaming.blocks:
            if carry_state_from is not None:
                optimizer_state_to(carry_state_from, strategy.root_device)
            self.update_static_bytes()
            return
        split = split_single_optimizer(strategy.optimizers, self.streaming, carry_state_from)
        if rebind_schedulers:
            for config in strategy.lr_scheduler_configs:
                config.scheduler = rebind_scheduler(config.scheduler, split)
        strategy.optimizers = [split]
        self.update_static_bytes()

    def _on_block_grads_ready(self, index: int) -> None:
        strategy = self.strategy
        optimizer = strategy.optimizers[0] if strategy.optimizers else None
        if (isinstance(optimizer, SplitOptimizer) and strategy.lightning_module.trainer.training
                and strategy.overlap_allowed()):
            optimizer.submit_host_step(index)

    def update_static_bytes(self) -> None:
        """Device model-state bytes that do not stream: resident parameters, their gradients, the device
        optimizer's state (which grows at the first step)."""
        if self.streaming is None:
            return
        optimizer = self.strategy.optimizers[0] if self.strategy.optimizers else None
        self.streaming.static_device_bytes = self._resident_model_bytes + device_optimizer_state_bytes(optimizer)

    # ---------------------------------------------------------------------------------------------- training
    def block_events(self) -> BlockEvents | None:
        if self.streaming is not None and self.streaming.blocks:
            return EngineEvents(self.streaming)
        return None

    def post_backward(self) -> None:
        if self.streaming is not None:
            self.streaming.finish_backward()

    # --------------------------------------------------------------------------------------------- delinking
    def delink(self, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer, num_unique_blocks: int | None,
               optimizer_state: OptimizerStatePolicy, perturb: Perturbation | None = None) -> torch.optim.Optimizer:
        """Delink with the whole model in host memory, then re-plan and re-offload: the real model may not fit
        on the device (that is why it was trained pseudo first), so the copies are made on the host and only the
        blocks the new plan keeps resident move back."""
        strategy = self.strategy
        plain = detach_to_host(self.streaming, optimizer, strategy.lightning_module)
        self.streaming = None
        new_optimizer = delink(pl_module, plain, num_unique_blocks=num_unique_blocks, optimizer_state=optimizer_state,
                               perturb=perturb)
        self.attach()
        strategy.optimizers = [new_optimizer]
        self.split_optimizer(carry_state_from=new_optimizer, rebind_schedulers=False)
        return strategy.optimizers[0]

    # ------------------------------------------------------------------------------------------- checkpoints
    # The module's own state_dict()/load_state_dict() read and write the host masters (the streaming engine's
    # state-dict hooks), so the base class's whole-model save and load serve this layout as they are.
    def load_optimizer_state(self, index: int, optimizer: torch.optim.Optimizer, checkpoint: dict[str, Any],
                             sharded_path: str | None) -> None:
        if isinstance(optimizer, SplitOptimizer):
            if sharded_path is not None:
                raise ValueError(
                    f"{sharded_path} is a sharded checkpoint; a one-process run with offloaded blocks resumes it "
                    "with P2RStrategy(sharding='zero2' or 'zero3') (FSDP2 on one process, the same offload plan)")
            optimizer.load_state_dict(checkpoint["optimizer_states"][index])  # host state stays on the host
        else:
            super().load_optimizer_state(index, optimizer, checkpoint, sharded_path)
        self.update_static_bytes()
