"""DDP (``sharding="none"``) and DDP + ``ZeroRedundancyOptimizer`` (``"zero1"``) across processes: every rank holds
the whole model, gradients are all-reduced by DDP's reducer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from ...sharing import OptimizerStatePolicy, Perturbation, delink, rebind_scheduler
from ..materialize import has_meta_tensors
from ..sharding import consolidated_plain_optimizer, zero_redundancy_optimizer
from .base import Engine


class DDPEngine(Engine):
    name = "ddp"

    def setup(self, trainer: L.Trainer) -> None:
        strategy = self.strategy
        if has_meta_tensors(strategy.lightning_module):
            self.materialize_whole(strategy.root_device)  # every rank holds the whole model
        else:
            strategy.load_deferred_weights()
        DDPStrategy.setup(strategy, trainer)  # to the device, DDP wrap, optimizers
        if trainer.state.fn == TrainerFn.FITTING and strategy.sharding == "zero1":
            strategy.optimizers = [zero_redundancy_optimizer(opt) for opt in strategy.optimizers]
            for config in strategy.lr_scheduler_configs:
                config.scheduler = rebind_scheduler(config.scheduler, strategy.optimizers[0])

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        with DDPStrategy.block_backward_sync(self.strategy):  # DDP's no_sync
            yield

    def delink(self, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer, num_unique_blocks: int | None,
               optimizer_state: OptimizerStatePolicy, perturb: Perturbation | None = None) -> torch.optim.Optimizer:
        """Every rank delinks the same way; the optimizer state is gathered first (ZeRO-1 partitions it), and DDP
        is rebuilt over the new parameters (the old reducer would silently skip them)."""
        strategy = self.strategy
        plain = consolidated_plain_optimizer(optimizer, strategy.world_size, strategy.global_rank)
        new_optimizer = delink(pl_module, plain, num_unique_blocks=num_unique_blocks, optimizer_state=optimizer_state,
                               perturb=perturb)
        strategy.model = pl_module
        strategy.configure_ddp()
        if strategy.sharding == "zero1":
            new_optimizer = zero_redundancy_optimizer(new_optimizer)
        strategy.optimizers = [new_optimizer]
        return new_optimizer
