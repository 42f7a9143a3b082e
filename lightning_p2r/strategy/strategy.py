"""``P2RStrategy``: Lightning hooks over the planner, one engine per parallel layout, and layered accumulation.

The hooks only decide *when*; what happens lives in the engines (``engines/``: ``local.py`` streams offloaded blocks
on one process, ``ddp.py`` runs DDP and ZeRO-1, ``fsdp.py`` runs FSDP2 for ZeRO-2/3 and the replicated layouts
across processes), ``plan.py`` (which blocks), ``materialize.py`` (placing a meta-built model), ``layered.py``
(the breadth-first accumulation executor) and ``accounting.py``. The strategy picks the engine in
``setup_environment`` (see ``engines.engine_name``), logs it at setup, and delegates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from datetime import timedelta
from typing import Any, Literal

import lightning as L
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from ..protocols import DefinesLayeredStages, InitializesByName
from ..sharing import OptimizerStatePolicy, Perturbation, find_block_sequence
from . import checkpoint as sharded_checkpoint
from .accounting import CollectiveCounter, CollectiveStats, counting
from .engines import Engine, engine_name, select_engine
from .engines.base import unwrapped
from .layered import LayeredStages, LayeredStep, layered_forward, split_micro_batches
from .materialize import check_no_meta_buffers, has_meta_tensors
from .offload import EngineEvents, OffloadEngine, OffloadStats
from .options import (
    SECTIONS,
    Accumulation,
    AccumulationConfig,
    OffloadConfig,
    OffloadState,
    ParallelConfig,
    PipelineSchedule,
    ShardingConfig,
    args_section,
)
from .parallel import ParallelDims
from .pipeline.layout import check_micro_batches
from .plan import (
    OffloadPlan,
    device_total_memory,
    parse_bytes,
    plan_for_model,
    resolve_pin_memory,
    setup_summary,
)
from .sharding import Sharding, fsdp_layout_for, stages_through_runner
from .split_optimizer import host_step_overlap_allowed, release_to_host


def oversubscription_warning(device_type: str, processes: int, cores: int) -> str | None:
    """The warning for more CPU processes than cores on this node, or None."""
    if device_type != "cpu" or processes <= cores:
        return None
    return (f"P2RStrategy: {processes} CPU processes on {cores} cores: each waits for the others at every "
            f"collective, so steps slow down many times over. Use at most --trainer.devices={cores} (and "
            "OMP_NUM_THREADS=1 per process) on this machine.")


class P2RStrategy(DDPStrategy):
    """Granular CPU offloading (M6-10T), ZeRO sharding and layered gradient accumulation (Lamy-Poirier 2021) for
    any LightningModule whose model declares a block sequence.

    The keywords are sorted into four typed, frozen sections (``strategy.sharding_config``,
    ``strategy.parallel_config``, ``strategy.accumulation_config``, ``strategy.offload_config``; see
    ``options.py``), validated when the strategy is built, and readable back under their own names
    (``strategy.sharding``). Lightning's own DDP arguments
    (accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin, process_group_backend,
    timeout) are accepted too and set by the Trainer.
    """

    strategy_name = "p2r"

    def __init__(
        self,
        sharding: Sharding = "none",
        tensor_parallel: int = 1,
        expert_parallel: int = 1,
        sequence_parallel: bool = False,
        pipeline_parallel: int = 1,
        pipeline_schedule: PipelineSchedule = "1f1b",
        stages_per_rank: int = 1,
        accumulation: Accumulation = "standard",
        micro_batches: int = 1,
        recompute: bool = False,
        reduce_every_micro_batch: bool = False,
        count_collectives: bool = False,
        offload_fraction: float | None = None,
        offload_blocks: list[int] | None = None,
        device_memory_budget: int | str | None = None,
        activation_allowance: int | str = 0,
        offload_states: list[OffloadState] | None = None,
        prefetch: int = 1,
        pin_memory: bool | Literal["auto"] = "auto",
        overlap_host_step: bool | Literal["auto"] = "auto",
        log_telemetry: bool = True,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        # Validated first, so a bad option fails before Lightning sets anything up.
        self.sharding_config = ShardingConfig(sharding=sharding, count_collectives=count_collectives)
        self.parallel_config = ParallelConfig(tensor_parallel=tensor_parallel, expert_parallel=expert_parallel,
                                              sequence_parallel=sequence_parallel,
                                              pipeline_parallel=pipeline_parallel,
                                              pipeline_schedule=pipeline_schedule, stages_per_rank=stages_per_rank)
        self.accumulation_config = AccumulationConfig(accumulation=accumulation, micro_batches=micro_batches,
                                                      recompute=recompute,
                                                      reduce_every_micro_batch=reduce_every_micro_batch,
                                                      pipelined=self.parallel_config.pipelined)
        if self.parallel_config.pipelined:
            check_micro_batches(pipeline_schedule, micro_batches, pipeline_parallel)
        self.offload_config = OffloadConfig(
            offload_fraction=offload_fraction, offload_blocks=offload_blocks,
            device_memory_budget=device_memory_budget, activation_allowance=activation_allowance,
            offload_states=offload_states, prefetch=prefetch, pin_memory=pin_memory,
            overlap_host_step=overlap_host_step, log_telemetry=log_telemetry)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment,
                         checkpoint_io=checkpoint_io or sharded_checkpoint.AtomicCheckpointIO(),
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout)
        self.collectives: CollectiveStats | None = None
        self.collectives_history: list[CollectiveStats] = []
        self._counter = CollectiveCounter() if count_collectives else None
        self._layered_step: LayeredStep | None = None
        self._pending_sharded_checkpoint: str | None = None
        # Weights of a checkpoint restored before setup: setup writes them into the tensors where they will live
        # (a state dict, or the sharded checkpoint's path), then drops them.
        self._deferred_weights: tuple[dict[str, Any] | str, bool] | None = None
        self.plan: OffloadPlan | None = None
        self.layout: Engine | None = None
        """The engine of this job's parallel layout (chosen in ``setup_environment``)."""
        self.telemetry: OffloadStats | None = None
        self.telemetry_history: list[OffloadStats] = []

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if "p2r" not in strategy_registry:
            strategy_registry.register("p2r", cls, description="lightning_p2r: granular offload (nothing offloaded "
                                       "unless configured)")
        if "p2r_offload" not in strategy_registry:
            strategy_registry.register("p2r_offload", cls, description="lightning_p2r: half the blocks offloaded "
                                       "to host memory", offload_fraction=0.5)

    # ------------------------------------------------------------------------------------------ environment
    @property
    def path(self) -> Literal["local", "ddp", "fsdp", "model_parallel", "pipeline"]:
        """The name of the engine that runs this job (see ``engines.engine_name``)."""
        return engine_name(self)  # type: ignore[return-value]

    @property
    def engine(self) -> OffloadEngine | None:
        """The streaming offload engine of a one-process job (None elsewhere, and after teardown)."""
        return self.layout.offload_engine() if self.layout is not None else None

    @property
    def offloading(self) -> bool:
        """Whether the options ask for offload (a zero fraction or an empty block list do not)."""
        return self.offload_config.offloading

    @property
    def fsdp_layout(self) -> str:
        """How FSDP2 lays the model out on the fsdp engine (see ``fsdp_layout_for`` in sharding.py)."""
        return fsdp_layout_for(self.sharding)

    @property
    @override
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @override
    def setup_environment(self) -> None:
        self.layout = select_engine(self)
        self.layout.setup_environment()

    def _check_path_options(self) -> None:
        """The checks the chosen engine makes before any process group exists."""
        select_engine(self).check_options()

    @contextlib.contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Any:
        """The model is built on the meta device (no memory anywhere): ``setup`` plans the placement from its shapes,
        then allocates each tensor once, where it will live (see ``materialize.py``). ``empty_init=False`` (a
        user who needs real values while building) keeps Lightning's behaviour: built whole on the root device."""
        if empty_init is False:
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"):
            yield

    @property
    def resolved_pin_memory(self) -> bool:
        return resolve_pin_memory(self.pin_memory, self.root_device)

    # ------------------------------------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: L.Trainer) -> None:
        warning = oversubscription_warning(self.root_device.type, self.num_processes, os.cpu_count() or 1)
        if warning:
            rank_zero_warn(warning)
        if self.accumulation == "layered" or self.parallel_config.pipelined:
            if trainer.accumulate_grad_batches != 1:
                raise ValueError(
                    f"P2RStrategy(micro_batches={self.micro_batches}, accumulation={self.accumulation!r}) splits each "
                    f"batch itself; set Trainer(accumulate_grad_batches=1), got {trainer.accumulate_grad_batches}"
                )
            # A data module that declares its batch size is checked now, before any work; other data at the first
            # batch (split_micro_batches).
            batch_size = getattr(trainer.datamodule, "batch_size", None)
            least = self.pipeline_parallel  # a pipeline needs at least one micro-batch per pipeline rank
            if isinstance(batch_size, int) and batch_size % self.micro_batches:
                raise ValueError(
                    f"P2RStrategy(micro_batches={self.micro_batches}) must divide the batch size, and the data's "
                    f"batch_size is {batch_size}: choose micro_batches among "
                    f"{[d for d in range(least, batch_size + 1) if batch_size % d == 0]} or change data.batch_size")
        if self.layout is None:
            self.layout = select_engine(self)
        check_no_meta_buffers(self.lightning_module)
        self._share_init_seed()
        self.layout.setup(trainer)
        self._log_setup()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Ranks of one tensor-parallel group read the same batch: the sampler splits the data over the
        data-parallel ranks only."""
        config = self.parallel_config
        if (config.model_parallel or config.pipelined) and self.world_size > 1:
            # Ranks are laid out (pipeline, data, tensor): a pipeline's stages and a tensor-parallel group read the
            # same batch. (Degrees that do not divide are refused at setup; the sampler is built after it.)
            dims = ParallelDims(self.world_size, self.tensor_parallel, self.expert_parallel, self.pipeline_parallel)
            return {"num_replicas": dims.data_parallel, "rank": dims.data_rank(self.global_rank)}
        return super().distributed_sampler_kwargs

    def _log_setup(self) -> None:
        if self.parallel_config.model_parallel:
            rank_zero_info("P2RStrategy " + ParallelDims(self.world_size, self.tensor_parallel,
                                                         self.expert_parallel, self.pipeline_parallel).describe())
        layout = getattr(self.layout, "stages_layout", None)
        if layout is not None:
            rank_zero_info(f"P2RStrategy pipeline: {layout.describe()}, schedule {self.pipeline_schedule}, "
                           f"{self.micro_batches} micro-batches")
        holder = self.holder_or_none()
        if holder is None:
            rank_zero_info(f"P2RStrategy: engine {self.path}, sharding {self.sharding} on {self.world_size} "
                           "process(es)")
            return
        budget = None
        if self.device_memory_budget is not None:
            budget = parse_bytes(self.device_memory_budget, total=device_total_memory(self.root_device))
        rank_zero_info(setup_summary(engine=self.path, sharding=self.sharding, world_size=self.world_size,
                                     plan=self.plan or OffloadPlan(len(holder.blocks), ()),
                                     model=self.lightning_module, blocks=holder.blocks,
                                     prefetch=self.prefetch, budget=budget))

    def _share_init_seed(self) -> None:
        """Every rank materializes its part of the same model: hand rank 0's init seed (maybe drawn from an
        unseeded generator) to the others."""
        if self.world_size > 1 and has_meta_tensors(self.lightning_module):
            holder = self.holder()
            if isinstance(holder, InitializesByName):
                holder.init_seed = self.broadcast(holder.init_seed, src=0)

    @property
    def has_deferred_weights(self) -> bool:
        """Whether a checkpoint restored before setup still waits to be written into the placed model."""
        return self._deferred_weights is not None

    def load_deferred_weights(self) -> None:
        """Write a checkpoint restored before setup into the placed tensors (no whole copy of the model)."""
        if self._deferred_weights is None:
            return
        (source, strict), self._deferred_weights = self._deferred_weights, None
        self.layout.load_weights(source, strict)

    def holder_or_none(self) -> nn.Module | None:
        try:
            return find_block_sequence(self.lightning_module)
        except ValueError:
            return None

    def holder(self) -> nn.Module:
        """The module that holds the block sequence (``blocks`` and ``layer_to_block``)."""
        try:
            return find_block_sequence(self.lightning_module)
        except ValueError as error:
            raise ValueError(f"P2RStrategy needs a model made of a block sequence: {error}") from None

    def make_plan(self, holder: nn.Module) -> OffloadPlan:
        """The offload plan for the model as it is now (also after delinking changed its blocks)."""
        return plan_for_model(self.lightning_module, holder.blocks, self.root_device,
                              offload_fraction=self.offload_fraction, offload_blocks=self.offload_blocks,
                              device_memory_budget=self.device_memory_budget,
                              activation_allowance=self.activation_allowance, prefetch=self.prefetch)

    @override
    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    @override
    def setup_optimizers(self, trainer: L.Trainer) -> None:
        super().setup_optimizers(trainer)
        self.layout.adapt_optimizers()

    def overlap_allowed(self) -> bool:
        """Stepping a block during backward must not skip anything that happens between backward and step."""
        return host_step_overlap_allowed(self.overlap_host_step, self.root_device, self.lightning_module,
                                         self.precision_plugin)

    _overlap_allowed = overlap_allowed

    # ---------------------------------------------------------------------------------------------- steps
    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Any:
        """Lightning enters this around the backward of every micro-batch but the last (standard accumulation)."""
        with self.layout.block_backward_sync():
            yield

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.layout.reshard()  # a forward outside training (a callback's loss) may have left units gathered
        if self.parallel_config.pipelined:
            return self._pipeline_training_step(args[0])
        if self.accumulation == "standard":
            with counting(self._counter):
                return super().training_step(*args, **kwargs)
        # Layered: the forward of every micro-batch runs here, their backward in ``backward`` (Lightning zeroes the
        # gradients between the two).
        module = self.lightning_module
        micro = split_micro_batches(args[0], self.micro_batches)
        with self.precision_plugin.train_step_context(), counting(self._counter):
            stages = self._layered_stages(module)
            events = self.layout.block_events()
            with events if isinstance(events, EngineEvents) else contextlib.nullcontext():
                self._layered_step = layered_forward(stages, micro, events, recompute=self.recompute)
        if stages.log_metrics is not None:
            stages.log_metrics(self._layered_step.metrics)
        usable = getattr(module, "loss_is_usable", None)  # the module's non-finite loss policy, as in training_step
        if usable is not None and not usable(self._layered_step.loss):
            self._layered_step = None
            return None  # Lightning skips the backward and the optimizer step
        return self._layered_step.loss

    def _pipeline_training_step(self, batch: Any) -> torch.Tensor | None:
        """The whole step's forward and backward run here, through the pipeline's schedule; ``backward`` then only
        hands the gradients back (see ``PipelineEngine.train_step``)."""
        module = self.lightning_module
        with self.precision_plugin.train_step_context(), counting(self._counter):
            result = self.layout.train_step(batch)
        log_metrics = self.layout.parts.stages.log_metrics
        if log_metrics is not None:
            log_metrics(result.metrics)
        usable = getattr(module, "loss_is_usable", None)
        if usable is not None and not usable(result.loss):
            self.layout.drop_gradients()
            return None
        return result.loss

    def _layered_stages(self, module: L.LightningModule) -> LayeredStages:
        if not isinstance(module, DefinesLayeredStages):
            raise ValueError(
                f"P2RStrategy(accumulation='layered') needs the LightningModule to define layered_stages() -> "
                f"LayeredStages (embedding, per-layer and head stages); {type(module).__name__} does not"
            )
        return stages_through_runner(module.layered_stages(), self.layout.stage_runner())

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.parallel_config.pipelined:
            self.layout.restore_gradients()
            self.post_backward(closure_loss)
            return closure_loss
        step, self._layered_step = self._layered_step, None
        if step is None:
            with counting(self._counter):
                return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        # The micro-batch losses are backpropagated one by one, not the returned loss: a gradient scaler (fp16)
        # must scale each of them, or the optimizer step unscales gradients that were never scaled.
        scaler = self.precision_plugin.scaler if isinstance(self.precision_plugin, MixedPrecision) else None
        with counting(self._counter):
            events = step.events
            with events if isinstance(events, EngineEvents) else contextlib.nullcontext():
                step.backward(scale=scaler.scale if scaler is not None else None)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 (Lightning's name)
        # Not counted with the step's collectives: the counts describe the training layout (docs/sharding.md).
        with self.uncounted():
            return super().reduce_boolean_decision(decision, all=all)

    @contextlib.contextmanager
    def uncounted(self) -> Any:
        """Collectives issued inside are left out of ``collectives`` (``count_collectives=True``): for a measurement's
        own communication (a callback that reduces a metric), which is not part of the training layout."""
        with self._counter.pause() if self._counter is not None else contextlib.nullcontext():
            yield

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        self.layout.post_backward()

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        with counting(self._counter):
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._record_telemetry()
        return output

    @override
    def on_validation_end(self) -> None:
        self.layout.reshard()  # layered blocks never reshard in their own forward hook: evaluation left them gathered
        super().on_validation_end()

    @override
    def on_test_end(self) -> None:
        self.layout.reshard()
        super().on_test_end()

    @override
    def on_predict_end(self) -> None:
        self.layout.reshard()
        super().on_predict_end()

    def _record_telemetry(self) -> None:
        metrics: dict[str, float] = {}
        if self._counter is not None:
            self.collectives = self._counter.take()
            self.collectives_history.append(self.collectives)
            metrics |= self.collectives.as_metrics()
        engine = self.engine
        if engine is not None:
            self.layout.update_static_bytes()
            self.telemetry = engine.take_stats()
            self.telemetry_history.append(self.telemetry)
            metrics |= self.telemetry.as_metrics()
        trainer = self.lightning_module.trainer
        if metrics and self.log_telemetry and trainer.global_step % max(trainer.log_every_n_steps, 1) == 0:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    # ------------------------------------------------------------------------------------------ delinking
    def delink_model(self, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer,
                     num_unique_blocks: int | None, optimizer_state: OptimizerStatePolicy,
                     perturb: Perturbation | None = None) -> torch.optim.Optimizer:
        """Delink the model where it lives and re-place the new blocks (the engine decides how); returns the
        optimizer over the new parameters. The caller (the ``PseudoToReal`` callback) rebinds the learning-rate
        schedulers to it: it is their one owner after delinking."""
        return self.layout.delink(pl_module, unwrapped(optimizer), num_unique_blocks, optimizer_state, perturb)

    # ----------------------------------------------------------------------------------------- checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.layout.module_state_dict()

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self.layout.optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        self.layout.save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            sharded_checkpoint.remove(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Checkpoints move between stages: a sharded (DCP) one resumes with any ``sharding`` on any number of
        processes, a single-file one on the FSDP2 engine too (its whole states are sharded on load)."""
        self._pending_sharded_checkpoint = None
        # Checked as it is read (one load): a missing, empty, corrupt or foreign file gets a clear error.
        is_file = sharded_checkpoint.check_checkpoint_location(checkpoint_path, loads_sharded=True)
        if sharded_checkpoint.is_sharded_checkpoint(checkpoint_path):
            self._pending_sharded_checkpoint = str(checkpoint_path)
            return sharded_checkpoint.load_meta(checkpoint_path)
        try:
            # weights_only unless the caller asked otherwise (Lightning's own default is a full unpickling).
            checkpoint = super().load_checkpoint(checkpoint_path,
                                                 weights_only=True if weights_only is None else weights_only)
        except Exception as error:  # noqa: BLE001 (every way a file fails to load gets the same clear message)
            if not is_file:
                raise
            raise sharded_checkpoint.unloadable(checkpoint_path, error) from error
        sharded_checkpoint.check_lightning_checkpoint(checkpoint_path, checkpoint)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        # Lightning restores the weights before setup, before the model is placed (and usually while it is still
        # on the meta device): setup writes them into the tensors where they will live.
        source = self._pending_sharded_checkpoint or checkpoint["state_dict"]
        self._deferred_weights = (source, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        for index, optimizer in enumerate(self.optimizers):
            self.layout.load_optimizer_state(index, unwrapped(optimizer), checkpoint,
                                             self._pending_sharded_checkpoint)

    # -------------------------------------------------------------------------------------------- teardown
    @override
    def teardown(self) -> None:
        release_to_host(self.optimizers, self.engine)
        if self.layout is not None:
            self.layout.teardown()
        module = self.lightning_module
        if module is not None and has_meta_tensors(module):
            # Setup stopped (a bad option) before every tensor was placed: a meta tensor cannot move to the host,
            # so the model stays where it is and only the environment is torn down.
            self.model = module
            self.cluster_environment.teardown()
            self.precision_plugin.teardown()
            self.accelerator.teardown()
            self.checkpoint_io.teardown()
            return
        super().teardown()


def _read_option(section: str, name: str) -> property:
    return property(lambda self: getattr(getattr(self, section), name),
                    doc=f"``{section}.{name}`` (read only: build a new strategy to change it).")


# The flat names users pass to the constructor read back from their sections.
for _section, _cls in SECTIONS.items():
    for _field in dataclasses.fields(_cls):
        setattr(P2RStrategy, _field.name, _read_option(_section, _field.name))
P2RStrategy.__doc__ = f"{P2RStrategy.__doc__.rstrip()}\n\n{args_section()}\n"
