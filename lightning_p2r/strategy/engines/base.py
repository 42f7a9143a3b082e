"""The interface every parallel layout implements, and what the layouts share."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from ...sharing import OptimizerStatePolicy, Perturbation
from .. import checkpoint as sharded_checkpoint
from ..layered import BlockEvents
from ..materialize import Initializer, allocate
from ..optimizers import optimizer_state_to, unwrapped  # noqa: F401  (engines import unwrapped from here)

if TYPE_CHECKING:
    from ..strategy import P2RStrategy


class Engine:
    """How one layout places the model, syncs gradients, checkpoints and delinks.

    The strategy owns the options, Lightning's hooks, accumulation and telemetry, and calls these methods at the
    points the docstrings name; an engine reads the strategy's options and writes the strategy's ``model``,
    ``optimizers`` and ``plan``. The defaults are what a layout without sharding does.
    """

    name = "base"

    def __init__(self, strategy: P2RStrategy) -> None:
        self.strategy = strategy

    # ------------------------------------------------------------------------------------------ lifecycle
    def check_options(self) -> None:
        """Refuse option combinations this layout cannot run, before any process group exists."""

    def setup_environment(self) -> None:
        """``Strategy.setup_environment``: the device, the ranks and the process group (if any)."""
        DDPStrategy.setup_environment(self.strategy)

    def setup(self, trainer: L.Trainer) -> None:
        """``Strategy.setup``: materialize and place the model, wrap it, build the optimizers."""
        raise NotImplementedError

    def adapt_optimizers(self) -> None:
        """After Lightning built the optimizers from ``configure_optimizers`` (in ``setup_optimizers``)."""

    def offload_engine(self) -> Any:
        """The streaming offload engine (one process only), else None."""
        return None

    def teardown(self) -> None:
        """After training: leave the module ordinary (it may be saved or used after ``fit``)."""

    def update_static_bytes(self) -> None:
        """Refresh the device bytes the streaming engine's telemetry counts as static (one process only)."""

    # ------------------------------------------------------------------------------------------- training
    def block_events(self) -> BlockEvents | None:
        """What layered accumulation calls around each block (fetches, gathers, reductions)."""
        return None

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Around the backward of every micro-batch but the last (standard accumulation)."""
        yield

    def post_backward(self) -> None:
        """After the backward of every micro-batch."""

    def reshard(self) -> None:
        """Gathered parameters back to their shards (after evaluation, before a checkpoint)."""

    def stage_runner(self) -> nn.Module | None:
        """The module the embedding and head stages must run through (layered accumulation), if any."""
        return None

    # ------------------------------------------------------------------------------------------ delinking
    def delink(self, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer, num_unique_blocks: int | None,
               optimizer_state: OptimizerStatePolicy, perturb: Perturbation | None = None) -> torch.optim.Optimizer:
        """Delink the model in place and return the optimizer over the new parameters (the caller rebinds the
        learning-rate schedulers to it)."""
        raise NotImplementedError

    # ---------------------------------------------------------------------------------------- checkpoints
    def module_state_dict(self) -> dict[str, Any]:
        return DDPStrategy.lightning_module_state_dict(self.strategy)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return DDPStrategy.optimizer_state(self.strategy, optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        DDPStrategy.save_checkpoint(self.strategy, checkpoint, filepath, storage_options)

    def load_weights(self, source: dict[str, Any] | str, strict: bool) -> None:
        """Write a checkpoint's weights (a state dict, or a sharded checkpoint's path) into the placed model. This
        default serves layouts where every rank holds the whole model (an offloaded block's state-dict hooks write
        its host masters)."""
        module = self.strategy.lightning_module
        if isinstance(source, str):
            sharded_checkpoint.load_model_into(module, source)
        else:
            module.load_state_dict(source, strict=strict)

    def load_optimizer_state(self, index: int, optimizer: torch.optim.Optimizer, checkpoint: dict[str, Any],
                             sharded_path: str | None) -> None:
        """Restore optimizer ``index`` from a checkpoint (whole-model layouts, like ``load_weights``)."""
        if sharded_path is not None:
            sharded_checkpoint.load_optimizer_into_replicated(self.strategy.lightning_module, optimizer, index,
                                                              sharded_path)
        else:
            optimizer.load_state_dict(checkpoint["optimizer_states"][index])
            optimizer_state_to(optimizer, self.strategy.root_device)

    # --------------------------------------------------------------------------------------------- shared
    def materialize_whole(self, device: torch.device) -> None:
        """Allocate every meta tensor of the model on ``device`` and fill it (initial values, or the checkpoint's
        weights restored before setup)."""
        strategy = self.strategy
        module = strategy.lightning_module
        initializer = Initializer(module, strategy.holder_or_none())
        params = allocate(module, device)
        if not strategy.has_deferred_weights:
            initializer.fill(params)
        strategy.load_deferred_weights()
