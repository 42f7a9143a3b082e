"""``P2RStrategy``: Lightning's hooks over one engine (``engines/``) and one step runner (``steps.py``). The hooks
decide *when*; the engines, given an :class:`~.engines.EngineContext`, decide what (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import warnings
from datetime import timedelta
from typing import Any, Literal

import lightning as L
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utilities_rank_zero_only
from torch import nn
from typing_extensions import override

from ..layout import (
    Accumulation,
    Layout,
    ModelShape,
    PipelineSchedule,
    PlacementPath,
    Sharding,
    check_layout,
    check_micro_batches,
    check_trainer,
    fsdp_mode_for,
    half_precision_warning,
    oversubscription_warning,
    pin_memory_for,
    plan_summary,
)
from ..protocols import InitializesByName, ModelSizes, StatesShape, StatesSizes
from ..sharing import OptimizerStatePolicy, Perturbation, find_block_sequence, rebind_scheduler
from .accounting import CollectiveCounter, CollectiveStats, counting
from .blocks import BlockCallCheck, DeclaredBlocks, declare_blocks, named_block_list
from .checkpoint import (
    AtomicCheckpointIO,
    check_checkpoint_location,
    check_lightning_checkpoint,
    is_sharded_checkpoint,
    load_meta,
    unloadable,
)
from .checkpoint import (
    remove as remove_checkpoint_files,
)
from .checkpoint_integrity import check_integrity_on_ranks
from .engines import Engine, EngineContext, Placed, engine_for
from .engines.base import Weights, holder_of
from .host_allocator import AllocatorChoice, HostAllocator, retain_freed_host_memory, wants_retained
from .launch import CheckingLauncher
from .materialize import check_no_meta_buffers, has_meta_tensors
from .offload import BlockStreamer, OffloadStats
from .offload_plan import OffloadPlan, block_footprints, device_total_memory, outside_blocks_bytes, parse_bytes
from .optimizers import unwrapped
from .options import (
    OPTION_NAMES,
    SECTIONS,
    AccumulationConfig,
    ModelConfig,
    OffloadConfig,
    OffloadState,
    ParallelConfig,
    ShardingConfig,
    args_section,
    build_sections,
    layout_of,
)
from .parallel.clipping import clip_grad_norm_across_meshes
from .process_group import (
    broadcast_object,
    default_backend,
    reduce_in_place,
    start_process_group,
    wait_for_every_rank,
)
from .split_optimizer import host_step_overlap_allowed, release_to_host
from .steps import StepRunner


class P2RStrategy(ParallelStrategy):
    """Granular CPU offloading (M6-10T), ZeRO sharding and layered gradient accumulation (Lamy-Poirier 2021) for
    any LightningModule whose model declares a block sequence.

    The keywords are sorted into four typed, frozen sections (``strategy.sharding_config``, ``parallel_config``,
    ``accumulation_config``, ``offload_config``; see ``options.py``), validated when the strategy is built, and
    readable back under their own names (``strategy.sharding``). The arguments Lightning's parallel strategies take
    (accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin, process_group_backend,
    timeout) are accepted too and set by the Trainer.

    A ``ParallelStrategy``, not a ``DDPStrategy``: data-parallel replication is a step of the one placement
    (``placement.py``: DDP's reducer or FSDP2's replicate layout), and on one process Lightning leaves
    the training loader's sampler as it is (it replaces it with a ``DistributedSampler`` only for a distributed job).
    """

    strategy_name = "p2r"

    def __init__(
        self,
        # ---- options: generated from strategy/options.py by `python -m lightning_p2r.cli.docs` ----
        sharding: Sharding = "none",
        count_collectives: bool = False,
        tensor_parallel: int = 1,
        expert_parallel: int = 1,
        sequence_parallel: bool = False,
        pipeline_parallel: int = 1,
        pipeline_schedule: PipelineSchedule = "1f1b",
        stages_per_rank: int = 1,
        accumulation: Accumulation = "standard",
        micro_batches: int = 1,
        recompute: bool = False,
        compile: bool | str = False,  # noqa: A002 (the option's name, as torch's)
        reduce_every_micro_batch: bool = False,
        offload_fraction: float | None = None,
        offload_blocks: list[int] | None = None,
        device_memory_budget: int | float | str | None = None,
        activation_allowance: int | float | str = 0,
        offload_states: list[OffloadState] | None = None,
        prefetch: int = 1,
        pin_memory: bool | Literal["auto"] = "auto",
        overlap_host_step: bool | Literal["auto"] = "auto",
        host_step: Literal["exact", "delayed"] = "exact",
        log_telemetry: bool = True,
        host_allocator: HostAllocator = "auto",
        blocks: str | None = None,
        # ---- end of the generated options ----
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        # Validated first, so a bad option fails before Lightning sets anything up: each section is built from the
        # keywords of its fields (declared once, in strategy/options.py; the signature above is generated from them).
        options = {name: value for name, value in locals().items() if name in OPTION_NAMES}
        sections = build_sections(options)
        self.sharding_config: ShardingConfig = sections["sharding_config"]
        self.parallel_config: ParallelConfig = sections["parallel_config"]
        self.accumulation_config: AccumulationConfig = sections["accumulation_config"]
        self.offload_config: OffloadConfig = sections["offload_config"]
        self.model_config: ModelConfig = sections["model_config"]
        if pipeline_parallel > 1:  # the one option rule across sections (each section checked itself)
            check_micro_batches(pipeline_schedule, micro_batches, pipeline_parallel)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin,
                         checkpoint_io=checkpoint_io or AtomicCheckpointIO())
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.collectives: CollectiveStats | None = None
        self.collectives_history: list[CollectiveStats] = []
        self._counter = CollectiveCounter() if count_collectives else None
        self._pending_sharded_checkpoint: str | None = None
        # Weights of a checkpoint restored before setup: setup writes them where they will live, then drops them.
        self._deferred_weights: Weights | None = None
        self.plan: OffloadPlan | None = None
        self.engine: Engine | None = None
        """The engine that places the model for this job's layout (chosen in ``setup_environment``)."""
        self.steps: StepRunner | None = None
        """How each training batch's forward and backward run (chosen in ``setup``)."""
        self.telemetry: OffloadStats | None = None
        self.telemetry_history: list[OffloadStats] = []
        self._block_check: BlockCallCheck | None = None
        """Checks, in the first training step, that the model runs the block list the strategy declared."""
        self.block_declaration: DeclaredBlocks | None = None
        """Where the strategy found the model's block list, when it declared it (None: the model declares its own)."""
        self._init_seed = 0
        """The seed of initial values the model does not name itself (rank 0's; set in ``setup``)."""

    # ------------------------------------------------------------------------------ where this process is
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:  # set by the Trainer (``num_nodes``)
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Processes on this node (one per device)."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def set_world_ranks(self) -> None:
        """This process's rank and the job's size, from the node, the devices and the cluster environment."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # Lightning's rank-zero utilities (and those of lightning_utilities, which Lightning's loggers use) read it.
        rank_zero_only.rank = utilities_rank_zero_only.rank = self.global_rank

    @property
    def path(self) -> PlacementPath:
        """Which placement path runs this job: "local" (one process and nothing sharded: the block streamer), or one
        of the FSDP2 engine's "ddp" (replicas synced by DDP's reducer), "fsdp" (every rank holds a shard or, with
        offload or layered accumulation, a replica of every block), "model_parallel" (tensor / expert parallel
        first) and "pipeline" (stages first)."""
        return self.layout.path(self.world_size)

    @property
    def layout(self) -> Layout:
        """The options as the layout rulebook reads them (``lightning_p2r.layout``; the planner prints the same)."""
        return layout_of(self.sharding_config, self.parallel_config, self.accumulation_config, self.offload_config)

    @property
    def streamer(self) -> BlockStreamer | None:
        """The block streamer of a one-process job (None elsewhere, and after teardown)."""
        return self.engine.offload_streamer() if self.engine is not None else None

    @property
    def fsdp_mode(self) -> str:
        """How FSDP2 lays out the data-parallel ranks: "zero3", "zero2" or "replicate" (see ``fsdp_mode_for``)."""
        return fsdp_mode_for(self.sharding)

    @property
    def is_distributed(self) -> bool:
        """Lightning reads it to decide whether the loaders get a ``DistributedSampler``: only across processes."""
        return self.world_size > 1

    def context(self, weights: Weights | None = None) -> EngineContext:
        """What the engine is given: the options, where this rank is, and the decisions that need the Trainer."""
        # Before the Trainer gave the strategy its devices (option checks), the host stands in.
        device = self.root_device if self.parallel_devices is not None else torch.device("cpu")
        return EngineContext(
            sharding=self.sharding_config, parallel=self.parallel_config, accumulation=self.accumulation_config,
            offload=self.offload_config, device=device, world_size=self.world_size,
            global_rank=self.global_rank, pin_memory=pin_memory_for(self.pin_memory, device.type),
            weights=weights, init_seed=self._init_seed,
            gradient_scaler=isinstance(self.precision_plugin, MixedPrecision)
            and self.precision_plugin.scaler is not None,
            host_step_allowed=self._host_step_allowed, uncounted=self.uncounted)

    def overlap_allowed(self) -> bool:
        """Stepping a block during backward must not skip anything that happens between backward and step."""
        return host_step_overlap_allowed(self.overlap_host_step, self.root_device, self.lightning_module,
                                         self.precision_plugin)

    def _host_step_allowed(self) -> bool:
        return self.lightning_module.trainer.training and self.overlap_allowed()

    @override
    def _configure_launcher(self) -> None:
        # Lightning's script launcher, with this job's checks before any other rank starts (launch.py).
        self._launcher = CheckingLauncher(self.check_before_launch, self.cluster_environment, self.num_processes,
                                          self.num_nodes)

    def check_before_launch(self, trainer: L.Trainer | None, *launch_args: Any) -> None:
        """What the options, the model, the data's batch size and the number of processes decide, checked before any
        other rank exists (each rank checks again). ``launch_args``: the Trainer entry point's (module, data module)."""
        self.set_world_ranks()  # the number of processes, known from the Trainer's devices and nodes
        self._check_path_options()
        module = next((a for a in launch_args if isinstance(a, L.LightningModule)), None)
        self.check_model_sizes(module)
        datamodule = next((a for a in launch_args if isinstance(a, L.LightningDataModule)), None)
        if trainer is not None:
            check_trainer(self.layout, trainer.accumulate_grad_batches, getattr(datamodule, "batch_size", None))

    @override
    def setup_environment(self) -> None:
        self._check_path_options()  # before any process group exists; chooses the engine
        super().setup_environment()  # the accelerator's device
        self.set_world_ranks()
        self._keep_freed_host_memory()
        if self.engine.needs_process_group:
            reset_seed()  # the seed_everything seed again on every rank, as Lightning's DDP does before joining
            backend = self._process_group_backend or default_backend(self.root_device)
            self._process_group_backend = backend
            start_process_group(self.cluster_environment, backend, self._timeout, self.root_device)
        self.engine.setup_environment(self.context())

    def _keep_freed_host_memory(self) -> None:
        """``host_allocator``: this process's malloc keeps what it frees, before the model is built (host_allocator.py).
        A process-wide setting, made once per training process, never undone (a later fit finds it made)."""
        self.host_allocator_choice: AllocatorChoice | None = None
        if wants_retained(self.offload_config.host_allocator, self.root_device.type):
            self.host_allocator_choice = retain_freed_host_memory()
            rank_zero_info(f"P2RStrategy host_allocator: {self.host_allocator_choice.reason}")

    def _check_path_options(self) -> None:
        """The layout's rules, then the chosen engine's, against the number of processes (before any process group)."""
        ctx = self.context()
        check_layout(self.layout, self.world_size, accelerator=ctx.device.type != "cpu")
        self.engine = engine_for(self.path)
        self.engine.check_options(ctx)

    @contextlib.contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Any:
        """The model is built on the meta device: ``setup`` allocates each tensor once, where it will live
        (``materialize.py``). ``empty_init=False`` keeps Lightning's behaviour: built whole on the root device."""
        if empty_init is False:
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"):
            yield

    @override
    def setup(self, trainer: L.Trainer) -> None:
        warning = oversubscription_warning(self.root_device.type, self.num_processes, os.cpu_count() or 1)
        if warning:
            rank_zero_warn(warning)
        plugin = self.precision_plugin
        warning = isinstance(plugin, HalfPrecision) and half_precision_warning(plugin.precision)
        if warning:
            rank_zero_warn(warning)
        # A data module that declares its batch size is checked now, before any work; other data at its first batch.
        check_trainer(self.layout, trainer.accumulate_grad_batches, getattr(trainer.datamodule, "batch_size", None))
        if self._layer_sync is not None and trainer.state.fn == TrainerFn.FITTING:
            # Trainer(sync_batchnorm=True): BatchNorm layers synchronized across ranks, as Lightning's DDP does.
            self.model = self._layer_sync.apply(self.model)
        module = self.lightning_module
        named_by = type(module).__name__ if self.model_config.blocks is None else ""
        declared = declare_blocks(module, *named_block_list(module, self.model_config.blocks),  # by its own name
                                  named_by=named_by)
        self.block_declaration = declared
        if declared is not None:
            rank_zero_info(declared.describe())
        try:
            holder = find_block_sequence(module)
        except ValueError:  # refused, by name, when the engine places the model
            holder = None
        self.check_model_sizes(holder)
        check_no_meta_buffers(module)
        self._share_init_seed()
        weights, self._deferred_weights = self._deferred_weights, None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        placed = self.engine.place(module, self.context(weights))
        if placed.wrapper is not None:  # the "ddp" path: Lightning calls DDP's wrapper (its forward redirection)
            self.model = placed.wrapper
        if weights is not None:  # the one place a checkpoint's weights are written into a placed model
            self.engine.load_weights(module, *weights)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self.plan = placed.plan
        self._use_layout_clipping()
        self.steps = self.engine.step_runner(module, self.precision_plugin, self._counter)
        # Only where the model's own forward runs the blocks (layered accumulation and pipelines call them directly).
        own_forward = self.accumulation == "standard" and self.pipeline_parallel == 1
        self._block_check = BlockCallCheck(holder_of(module)) if declared is not None and own_forward else None
        self._log_setup(placed)

    def check_model_sizes(self, holder: nn.Module | None) -> None:
        """The layout's rules against the sizes a model states (``StatesSizes``, or a module's ``StatesShape``),
        before it is placed."""
        shape = None
        if isinstance(holder, StatesSizes) and isinstance(holder.config, ModelSizes):
            shape = ModelShape.of(holder.config)
        elif isinstance(holder, StatesShape):
            shape = holder.model_shape()
        if shape is not None:
            check_layout(self.layout, self.world_size, shape, accelerator=self.context().device.type != "cpu")

    def _use_layout_clipping(self) -> None:
        """Lightning clips through the precision plugin with torch's clip_grad_norm_, which cannot combine norms on
        different meshes: this job's plugin instance gets the mesh-aware norm (the plugin offers no strategy hook)."""
        copies = self.engine.grad_copies()
        if copies is None:
            return
        plugin = self.precision_plugin
        plugin.clip_grad_by_norm = lambda optimizer, clip_val: clip_grad_norm_across_meshes(  # type: ignore[method-assign]
            plugin.main_params(optimizer), clip_val, copies=copies)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Each rank reads its own batches; ranks of one tensor-parallel group or pipeline read the same batch
        (``Layout.sampler_ranks``)."""
        ranks = self.layout.sampler_ranks(self.world_size, self.global_rank)
        if ranks is None:
            return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}
        return {"num_replicas": ranks[0], "rank": ranks[1]}

    # ------------------------------------------------------------------------------ collectives Lightning asks for
    @override
    def barrier(self, name: str | None = None) -> None:
        wait_for_every_rank(self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return broadcast_object(obj, src)

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """A logged value reduced over the ranks (``self.log(..., sync_dist=True)``); not a tensor: as it is."""
        return reduce_in_place(tensor, group, reduce_op) if isinstance(tensor, torch.Tensor) else tensor

    @override
    def model_to_device(self) -> None:
        # The placement puts every tensor where it lives (setup); Lightning calls this only for a model it set up.
        self.model.to(self.root_device)

    def _log_setup(self, placed: Placed) -> None:
        for line in placed.log:
            rank_zero_info(line)
        holder = holder_of(self.lightning_module)
        budget = None
        if self.device_memory_budget is not None:
            budget = parse_bytes(self.device_memory_budget, total=device_total_memory(self.root_device))
        rank_zero_info(plan_summary(engine=self.path, sharding=self.sharding, world_size=self.world_size,
                                    plan=self.plan or OffloadPlan(len(holder.blocks), ()),
                                    footprints=block_footprints(holder.blocks),
                                    other_bytes=outside_blocks_bytes(self.lightning_module, holder.blocks),
                                    prefetch=self.prefetch, budget=budget))

    def _share_init_seed(self) -> None:
        """Hand rank 0's init seeds (maybe unseeded) to the others: every rank materializes its part of one model. The
        model's own (an ``InitializesByName`` holder's ``init_seed``), and the run's for the modules it does not name
        (the LightningModule's ``init_seed`` if it has one, else the global seed Lightning's ``seed_everything``
        set)."""
        module = self.lightning_module
        seed = getattr(module, "init_seed", None)
        self._init_seed = int(seed) if isinstance(seed, int) else torch.initial_seed()
        if self.world_size > 1 and has_meta_tensors(module):
            self._init_seed = self.broadcast(self._init_seed, src=0)
            holder = holder_of(module)
            if isinstance(holder, InitializesByName):
                holder.init_seed = self.broadcast(holder.init_seed, src=0)

    @override
    def setup_optimizers(self, trainer: L.Trainer) -> None:
        super().setup_optimizers(trainer)
        optimizers = self.engine.adapt_optimizers(list(self.optimizers), self.lightning_module)
        # A replaced optimizer takes over its LR schedulers (their one owner).
        for old, new in zip(self.optimizers, optimizers):
            if unwrapped(old) is not new:
                for config in self.lr_scheduler_configs:
                    if config.scheduler.optimizer is unwrapped(old):
                        config.scheduler = rebind_scheduler(config.scheduler, new)
        self.optimizers = optimizers

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Any:
        """Lightning enters this around the backward of every micro-batch but the last (standard accumulation)."""
        with self.engine.no_sync(self.lightning_module):
            yield

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # A forward outside training (a callback's loss) may have left units gathered.
        self.engine.reshard(self.lightning_module)
        check, self._block_check = self._block_check, None
        with check.recording() if check is not None else contextlib.nullcontext():
            result = self.steps.training_step(args[0], lambda: super(P2RStrategy, self).training_step(*args, **kwargs))
        if check is not None:  # a declared block list the model's forward does not run in order: refused now
            check.check()
        return result

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.steps.backward(
            closure_loss, lambda: super(P2RStrategy, self).backward(closure_loss, optimizer, *args, **kwargs),
            self.post_backward)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 (Lightning's name)
        # Not counted with the step's collectives: the counts describe the training layout (docs/sharding.md).
        with self.uncounted():
            return super().reduce_boolean_decision(decision, all=all)

    @contextlib.contextmanager
    def uncounted(self) -> Any:
        """Collectives issued inside (a callback reducing a metric) are left out of ``collectives``: not the layout."""
        with self._counter.pause() if self._counter is not None else contextlib.nullcontext():
            yield

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        self.engine.post_backward(self.optimizers)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        with counting(self._counter):
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._record_telemetry()
        return output

    @override
    def on_validation_end(self) -> None:
        self.engine.reshard(self.lightning_module)  # layered blocks never reshard in their own forward hook
        super().on_validation_end()

    @override
    def on_test_end(self) -> None:
        self.engine.reshard(self.lightning_module)
        super().on_test_end()

    @override
    def on_predict_end(self) -> None:
        self.engine.reshard(self.lightning_module)
        super().on_predict_end()

    def _record_telemetry(self) -> None:
        metrics: dict[str, float] = {}
        if self._counter is not None:
            self.collectives = self._counter.take()
            self.collectives_history.append(self.collectives)
            metrics |= self.collectives.as_metrics()
        streamer = self.streamer
        if streamer is not None:
            self.engine.update_static_bytes()
            self.telemetry = streamer.take_stats()
            self.telemetry_history.append(self.telemetry)
            metrics |= self.telemetry.as_metrics()
        trainer = self.lightning_module.trainer
        if metrics and self.log_telemetry and trainer.global_step % max(trainer.log_every_n_steps, 1) == 0:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def delink_model(self, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer,
                     num_unique_blocks: int | None, optimizer_state: OptimizerStatePolicy,
                     perturb: Perturbation | None = None) -> torch.optim.Optimizer:
        """Delink the model where it lives and re-place the new blocks (the engine decides how); returns the optimizer
        over the new parameters, to which the caller (``PseudoToReal``) rebinds the learning-rate schedulers."""
        new_optimizer, placed = self.engine.delink(pl_module, unwrapped(optimizer), self.context(), num_unique_blocks,
                                                   optimizer_state, perturb)
        self.model = placed.wrapper if placed.wrapper is not None else pl_module  # a new wrapper on the "ddp" path
        self.optimizers = [new_optimizer]
        self.plan = placed.plan
        return new_optimizer

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.engine.saves_sharded:
            return {}  # DCP writes the shards
        return self.engine.whole_model_state(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if self.engine.saves_sharded:
            return {}
        return self.engine.whole_optimizer_state(unwrapped(optimizer), self.lightning_module)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self.engine.saves_sharded:
            self.engine.save_sharded(checkpoint, filepath, self.lightning_module, self.optimizers)
        else:
            super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            remove_checkpoint_files(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded (DCP) checkpoint resumes with any ``sharding`` and processes; a single file on FSDP2 too."""
        self._pending_sharded_checkpoint = None
        # Checked as it is read (one load): a missing, empty, corrupt or foreign file gets a clear error.
        is_file = check_checkpoint_location(checkpoint_path, loads_sharded=True)
        if is_sharded_checkpoint(checkpoint_path):
            check_integrity_on_ranks(checkpoint_path)  # its bytes against their checksums, split over the ranks
            self._pending_sharded_checkpoint = str(checkpoint_path)
            return load_meta(checkpoint_path)
        try:
            # weights_only unless the caller asked otherwise (Lightning's own default is a full unpickling).
            checkpoint = super().load_checkpoint(checkpoint_path,
                                                 weights_only=True if weights_only is None else weights_only)
        except Exception as error:  # noqa: BLE001 (every way a file fails to load gets the same clear message)
            if not is_file:
                raise
            raise unloadable(checkpoint_path, error) from error
        check_lightning_checkpoint(checkpoint_path, checkpoint)
        if is_file:  # (after the load, which names a truncated or foreign file; every rank got this far alike)
            check_integrity_on_ranks(checkpoint_path)  # torch.load read no checksum
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
            self.engine.load_optimizer_state(self.lightning_module, index, unwrapped(optimizer), checkpoint,
                                             self._pending_sharded_checkpoint, self.root_device)

    @override
    def teardown(self) -> None:
        release_to_host(self.optimizers, self.streamer)
        if self.model is not None and self.model is not self.lightning_module:
            self.model = self.lightning_module  # DDP's wrapper off, as Lightning's DDP does at teardown
        if self.engine is not None:
            self.engine.teardown(self.lightning_module)
        vars(self.precision_plugin).pop("clip_grad_by_norm", None)  # the class's method again
        module = self.lightning_module
        if self._layer_sync is not None and module is not None and module._trainer is not None \
                and module.trainer.state.fn == TrainerFn.FITTING:
            self.model = self._layer_sync.revert(self.model)  # plain BatchNorm again after fitting, as under DDP
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
        handling = sys.exc_info()[1]  # Lightning tears down inside its ``except`` when a step raised
        try:
            super().teardown()  # the environment, then the model and optimizer states to the host
        except Exception as error:
            if handling is None:
                raise
            # Raised here, this error would be what the user reads, not the one that stopped the run.
            warnings.warn(f"P2RStrategy: after the run stopped on {type(handling).__name__}, teardown could not move "
                          f"the model to the host ({type(error).__name__}: {error})", stacklevel=2)


def _read_option(section: str, name: str) -> property:
    return property(lambda self: getattr(getattr(self, section), name),
                    doc=f"``{section}.{name}`` (read only: build a new strategy to change it).")


# The flat names users pass to the constructor read back from their sections.
for _section, _cls in SECTIONS.items():
    for _field in dataclasses.fields(_cls):
        setattr(P2RStrategy, _field.name, _read_option(_section, _field.name))
P2RStrategy.__doc__ = f"{P2RStrategy.__doc__.rstrip()}\n\n{args_section()}\n"
