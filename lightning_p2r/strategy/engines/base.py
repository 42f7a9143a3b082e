"""What an engine is given (:class:`EngineContext`) and what every engine offers the strategy (:class:`Engine`).
An engine never sees the strategy, which makes every Lightning call itself: engines are tested with a hand-made
context.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...layout import Layout
from ...sharing import OptimizerStatePolicy, Perturbation, find_block_sequence
from ..blocks import no_block_list_message
from ..checkpoint import load_model_into, load_optimizer_into
from ..compile import check_compile
from ..layered import BlockEvents
from ..offload_plan import OffloadPlan
from ..optimizers import optimizer_state_to
from ..options import AccumulationConfig, OffloadConfig, ParallelConfig, ShardingConfig, layout_of

if TYPE_CHECKING:
    from lightning.pytorch.plugins.precision import Precision

    from ..accounting import CollectiveCounter
    from ..offload import BlockStreamer
    from ..steps import StepRunner

Weights = tuple[dict[str, Any] | str, bool]
"""A checkpoint's weights for the placed model (a state dict or a sharded checkpoint's path), and strictness."""


@dataclass(frozen=True)
class EngineContext:
    """Everything an engine reads besides the module: the options, where this rank is, and the Trainer's decisions."""

    sharding: ShardingConfig
    parallel: ParallelConfig
    accumulation: AccumulationConfig
    offload: OffloadConfig
    device: torch.device
    world_size: int = 1
    global_rank: int = 0
    pin_memory: bool = False
    """``offload.pin_memory`` resolved for this device."""
    init_seed: int = 0
    """The run's seed for initial values the model does not name itself (``models.module_init``; rank 0's)."""
    weights: Weights | None = None
    """A checkpoint restored before setup, written into the placed tensors instead of initial values (the placement
    skips the initial values; the strategy loads these after placing)."""
    gradient_scaler: bool = False
    """The precision plugin scales the loss (fp16): some step runners cannot."""
    host_step_allowed: Callable[[], bool] = lambda: False
    """Whether an offloaded block may take its host optimizer step during backward right now."""
    uncounted: Callable[[], contextlib.AbstractContextManager[Any]] = field(default=contextlib.nullcontext)
    """Collectives inside are not the layout's own (metrics gathering); see ``count_collectives``."""

    @property
    def layout(self) -> Layout:
        """The options as the rulebook reads them (degrees, paths, the reshard rule)."""
        return layout_of(self.sharding, self.parallel, self.accumulation, self.offload)

    def without_weights(self) -> EngineContext:
        """This context as an engine keeps it after placing (a whole state dict must not stay alive for the run)."""
        return dataclasses.replace(self, weights=None)


@dataclass(frozen=True)
class Placed:
    """What a placement made: the offload plan, its setup log lines, and the wrapper Lightning calls instead of the
    module (DDP's, on the "ddp" path; None elsewhere)."""

    plan: OffloadPlan | None = None
    log: tuple[str, ...] = ()
    wrapper: nn.Module | None = None


def holder_of(module: nn.Module) -> nn.Module:
    """The module that holds the block sequence (``blocks`` and ``layer_to_block``)."""
    try:
        return find_block_sequence(module)
    except ValueError:
        raise ValueError(no_block_list_message(module)) from None


class Engine:
    """How one kind of layout places the model, syncs gradients, checkpoints and delinks (defaults: the whole model)."""

    needs_process_group = True
    """Whether the strategy must start torch.distributed for this engine."""
    saves_sharded = False
    """Whether checkpoints are torch distributed checkpoints written by every rank (else Lightning's single file)."""

    def __init__(self) -> None:
        self.ctx: EngineContext | None = None
        """The context of the latest placement (without the checkpoint's weights)."""

    def check_options(self, ctx: EngineContext) -> None:
        """Refuse option combinations this engine cannot run, before any process group exists."""
        check_compile(ctx.accumulation.compile, count_collectives=ctx.sharding.count_collectives)

    def setup_environment(self, ctx: EngineContext) -> None:
        """After the process group exists: build the device meshes and groups this engine needs."""

    def place(self, module: nn.Module, ctx: EngineContext) -> Placed:
        """Materialize ``module`` where the layout puts each tensor, with initial values unless ``ctx.weights`` will be
        loaded into it (the strategy then calls ``load_weights``, the one place a checkpoint's weights are written)."""
        raise NotImplementedError

    def adapt_optimizers(self, optimizers: list[torch.optim.Optimizer],
                         module: nn.Module) -> list[torch.optim.Optimizer]:
        """The optimizers the layout steps, given ``configure_optimizers``'s (the strategy rebinds their schedulers)."""
        return optimizers

    def teardown(self, module: nn.Module | None) -> None:
        """After training: leave the module ordinary (it may be saved or used after ``fit``)."""

    def block_events(self) -> BlockEvents | None:
        """What layered accumulation calls around each block (fetches, gathers, reductions)."""
        return None

    @contextlib.contextmanager
    def no_sync(self, module: nn.Module) -> Iterator[None]:
        """Around the backward of every micro-batch but the last (standard accumulation)."""
        yield

    def post_backward(self, optimizers: list[Any]) -> None:
        """After the backward of every micro-batch."""

    def reshard(self, module: nn.Module) -> None:
        """Gathered parameters back to their shards (after evaluation, before a checkpoint)."""

    def outside_blocks_root(self) -> nn.Module | None:
        """The module the embedding and head stages must run through (layered accumulation), if any."""
        return None

    def step_runner(self, module: nn.Module, precision: Precision, counter: CollectiveCounter | None) -> StepRunner:
        """How each training batch's forward and backward run under this layout (``steps.py``)."""
        from ..steps import LayeredSteps, StandardSteps  # the step runners build on the engine interface

        if self.ctx.accumulation.accumulation == "layered":
            return LayeredSteps(module, precision, counter, self, micro_batches=self.ctx.accumulation.micro_batches,
                                recompute=self.ctx.accumulation.recompute)
        return StandardSteps(module, precision, counter)

    def pipeline_runner(self) -> Any:
        """The pipeline schedule's runner (its timeline feeds the pipeline benchmark), or None without stages."""
        return None

    def offload_streamer(self) -> BlockStreamer | None:
        """The block streamer (one process only), for telemetry; else None."""
        return None

    def update_static_bytes(self) -> None:
        """Refresh the device bytes the block streamer's telemetry counts as static (one process only)."""

    def grad_copies(self) -> Callable[[torch.Tensor], int] | None:
        """How many ranks hold the same local part of a parameter's gradient (None: torch's clipping is right)."""
        return None

    def delink(self, module: nn.Module, optimizer: torch.optim.Optimizer, ctx: EngineContext,
               num_unique_blocks: int | None, optimizer_state: OptimizerStatePolicy,
               perturb: Perturbation | None = None) -> tuple[torch.optim.Optimizer, Placed]:
        """Delink the model in place and re-place the new blocks; returns the new optimizer and what is placed now."""
        raise NotImplementedError

    def save_sharded(self, checkpoint: dict[str, Any], filepath: Any, module: nn.Module, optimizers: list[Any]) -> None:
        """Write a sharded checkpoint (engines with ``saves_sharded``)."""
        raise NotImplementedError

    def whole_model_state(self, module: nn.Module) -> dict[str, Any]:
        """The model's state dict for a single-file checkpoint (engines without ``saves_sharded``)."""
        return module.state_dict()

    def whole_optimizer_state(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> dict[str, Any]:
        """An optimizer's state dict for a single-file checkpoint, numbered as torch numbers it (all ranks call it)."""
        return optimizer.state_dict()

    def load_weights(self, module: nn.Module, source: dict[str, Any] | str, strict: bool) -> None:
        """Write a checkpoint's weights into the model, whole on every rank (offloaded blocks' hooks write masters)."""
        if isinstance(source, str):
            load_model_into(module, source)
        else:
            module.load_state_dict(source, strict=strict)

    def load_optimizer_state(self, module: nn.Module, index: int, optimizer: torch.optim.Optimizer,
                             checkpoint: dict[str, Any], sharded_path: str | None, device: torch.device) -> None:
        """Restore optimizer ``index`` from a checkpoint (whole-model layouts, like ``load_weights``)."""
        if sharded_path is not None:
            load_optimizer_into(module, optimizer, index, sharded_path)
        else:
            optimizer.load_state_dict(checkpoint["optimizer_states"][index])
            optimizer_state_to(optimizer, device)
