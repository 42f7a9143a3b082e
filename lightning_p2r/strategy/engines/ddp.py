"""DDP (``sharding="none"``) and DDP + ``ZeroRedundancyOptimizer`` (``"zero1"``): every rank holds the whole model.
The strategy wraps it with Lightning's DDP (``wraps_ddp``); this engine materializes it and partitions the states."""

from __future__ import annotations

import torch
from torch import nn

from ...sharing import OptimizerStatePolicy, Perturbation, delink
from ..compile import apply_compile
from ..materialize import Initializer, allocate, has_meta_tensors
from ..sharding import consolidated_plain_optimizer, zero_redundancy_optimizer
from .base import Engine, EngineContext, Placed, holder_of


class DDPEngine(Engine):
    wraps_ddp = True

    def place(self, module: nn.Module, ctx: EngineContext) -> Placed:
        self.ctx = ctx.without_weights()
        holder = holder_of(module)
        if has_meta_tensors(module):  # every rank holds the whole model
            initializer = Initializer(module, holder, seed=ctx.init_seed)
            params = allocate(module, ctx.device)
            if ctx.weights is None:
                initializer.fill(params)
            initializer.finish()
        if ctx.weights is not None:
            self.load_weights(module, *ctx.weights)
        apply_compile(ctx.accumulation.compile, holder.blocks)
        return Placed()

    def adapt_optimizers(self, optimizers: list[torch.optim.Optimizer],
                         module: nn.Module) -> list[torch.optim.Optimizer]:
        if self.ctx.sharding.sharding != "zero1":
            return optimizers
        return [zero_redundancy_optimizer(opt) for opt in optimizers]

    def delink(self, module: nn.Module, optimizer: torch.optim.Optimizer, ctx: EngineContext,
               num_unique_blocks: int | None, optimizer_state: OptimizerStatePolicy,
               perturb: Perturbation | None = None) -> tuple[torch.optim.Optimizer, Placed]:
        """Every rank delinks the same way; the optimizer state is gathered first (ZeRO-1 partitions it). The
        strategy then rebuilds DDP over the new parameters (the old reducer would silently skip them)."""
        plain = consolidated_plain_optimizer(optimizer, ctx.world_size, ctx.global_rank)
        new_optimizer = delink(module, plain, num_unique_blocks=num_unique_blocks, optimizer_state=optimizer_state,
                               perturb=perturb)
        return self.adapt_optimizers([new_optimizer], module)[0], Placed()
