"""``P2RStrategy``: Lightning hooks over the planner, the streaming engine, ZeRO sharding and layered accumulation.

The hooks only decide *when*; what happens lives in ``plan.py`` (which blocks), ``offload.py`` (moving them on one
process), ``split_optimizer.py`` (stepping them where they live), ``sharding.py`` (ZeRO stages on DDP and FSDP2),
``replicated_zero.py`` (ZeRO-1 on FSDP2), ``layered.py`` (the breadth-first accumulation executor),
``regather.py`` (delinking a sharded model), ``checkpoint.py`` (sharded checkpoints) and ``accounting.py``.

Three execution paths, chosen from ``sharding``, the number of processes, offload and accumulation:

- *local*: one process, "none" or "zero1" (nothing to shard): the streaming engine offloads blocks.
- *ddp*: several processes, "none" or "zero1", no offload, standard accumulation: DDP (+ ZeroRedundancyOptimizer).
- *fsdp*: "zero2"/"zero3" on any number of processes, or "none"/"zero1" across processes with offload or layered
  accumulation (a replicated FSDP2 layout): FSDP2 per block, ``CPUOffloadPolicy`` for offloaded ones.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Literal

import lightning as L
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from ..sharing import OptimizerStatePolicy, delink, find_block_sequence, rebind_scheduler
from . import checkpoint as sharded_checkpoint
from .accounting import CollectiveCounter, CollectiveStats, counting
from .host_state import blocks_prefix, full_state_dict, load_full_state_dict, resident_model_bytes
from .layered import LayeredStages, LayeredStep, check_accumulation_options, layered_forward, split_micro_batches
from .materialize import Initializer, allocate, has_meta_tensors
from .offload import EngineEvents, OffloadEngine, OffloadStats
from .plan import (
    OffloadPlan,
    check_fsdp_offload_states,
    check_offload_options,
    device_total_memory,
    parse_bytes,
    plan_for_model,
    resolve_pin_memory,
    setup_summary,
)
from .regather import delinked_plain_copy, meta_template, release_model_state, replace_submodule, shard_optimizer
from .replicated_zero import ReplicatedZeroOptimizer, partition_optimizer_states, to_module_optimizer
from .sharding import (
    SHARDINGS,
    FSDPEvents,
    Sharding,
    consolidated_plain_optimizer,
    device_mesh,
    execution_path,
    fsdp_layout_for,
    fsdp_modules,
    reshard_all,
    shard_blocks,
    shard_rest,
    smallest_parameter_root,
    stages_through_runner,
    zero_redundancy_optimizer,
)
from .split_optimizer import (
    SplitOptimizer,
    detach_to_host,
    device_optimizer_state_bytes,
    host_step_overlap_allowed,
    release_to_host,
    split_single_optimizer,
)

OffloadState = Literal["params", "grads", "optimizer"]
Accumulation = Literal["standard", "layered"]


class P2RStrategy(DDPStrategy):
    """Granular CPU offloading (M6-10T), ZeRO sharding and layered gradient accumulation (Lamy-Poirier 2021) for
    any LightningModule whose model declares a block sequence.

    Give at most one of ``offload_fraction``, ``offload_blocks`` and ``device_memory_budget``; none keeps every
    block on the device.

    Args:
        sharding: "none" (replicated, DDP), "zero1" (optimizer states sharded: DDP + ZeroRedundancyOptimizer),
            "zero2" (+ gradients: FSDP2 without resharding after forward) or "zero3" (+ parameters: FSDP2). On one
            process "none" and "zero1" are the same thing; "zero2"/"zero3" then still run FSDP2 (on a group of one),
            so their checkpoints and layouts match a multi-process run.
        accumulation: "standard" (depth-first: each micro-batch runs forward and backward through the whole model)
            or "layered" (breadth-first: every micro-batch passes block i before block i+1, so each offloaded or
            sharded block is fetched and its gradient reduced once per optimizer step).
        micro_batches: layered only: the micro-batches each training batch is split into (the batch size must
            divide), all accumulated into one optimizer step; Lightning's ``accumulate_grad_batches`` must then be 1.
            Standard accumulation is Lightning's own ``accumulate_grad_batches``.
        recompute: layered only: keep just each block's input per micro-batch and recompute the block's interior
            in backward (activation checkpointing at block granularity).
        reduce_every_micro_batch: standard accumulation on FSDP2 (zero2/zero3, or offload/layered across ranks):
            reduce(-scatter) the gradients after every micro-batch, which keeps only gradient shards between
            micro-batches (ZeRO-2's memory) at the cost of one reduction per unit per micro-batch. False (the
            default) reduces once, after the last micro-batch, as DDP's ``no_sync`` does: each unit then holds its
            whole unsharded gradient between micro-batches. Offloaded units always reduce every micro-batch (their
            gradients must not stay on the device).
        count_collectives: record the collectives (calls and bytes, per kind) of every optimizer step in
            ``strategy.collectives``; costs a Python call per operator, so it is for measurements.
        offload_fraction: share of the blocks kept in host memory, spread evenly through the depth.
        offload_blocks: explicit block indices to keep in host memory.
        device_memory_budget: bytes (or "12GB", "512MiB", "80%" of the device) for model states on the device;
            the planner keeps as many blocks resident as fit.
        activation_allowance: bytes (or a size string) the budget reserves for activations.
        offload_states: what offloaded blocks keep on the host: always "grads" and "optimizer" (their optimizer
            step runs on the host), and "params" unless the parameters should stay resident on the device.
        prefetch: offloaded blocks copied in ahead of use (in forward and in backward order).
        pin_memory: page-locked host buffers for asynchronous copies; "auto" pins only when an accelerator exists
            (CPU-only torch cannot pin memory).
        overlap_host_step: run an offloaded block's host optimizer step as soon as its gradients reach the host,
            while the device computes the backward of earlier blocks. Used only where it cannot change the result:
            no gradient clipping, no gradient scaler, no gradient accumulation. "auto" turns it on only with an
            accelerator: on a CPU-only machine the host step would compete with the backward for the same cores
            (measured: 476 ms instead of 345 ms per step on 2 cores).
        log_telemetry: log the offload statistics (``offload/*``) through the Trainer's loggers.
    """

    strategy_name = "p2r"

    def __init__(
        self,
        sharding: Sharding = "none",
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
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout)
        if sharding not in SHARDINGS:
            raise ValueError(f"P2RStrategy.sharding must be one of {SHARDINGS}, got {sharding!r}")
        check_accumulation_options(accumulation, micro_batches, recompute)
        self.sharding, self.accumulation, self.micro_batches = sharding, accumulation, micro_batches
        self.recompute, self.count_collectives = recompute, count_collectives
        self.reduce_every_micro_batch = reduce_every_micro_batch
        self.collectives: CollectiveStats | None = None
        self.collectives_history: list[CollectiveStats] = []
        self._counter = CollectiveCounter() if count_collectives else None
        self._stage_runner: nn.Module | None = None
        self._mesh: Any = None
        self._layered_step: LayeredStep | None = None
        self._pending_sharded_checkpoint: str | None = None
        # Weights of a checkpoint restored before setup into a model still on the meta device: setup writes them
        # into the tensors where they will live (a state dict, or the sharded checkpoint's path), then drops them.
        self._deferred_weights: tuple[dict[str, Any] | str, bool] | None = None
        self._sharded_root: nn.Module | None = None
        self._root_template: nn.Module | None = None
        states = check_offload_options(
            offload_fraction=offload_fraction, offload_blocks=offload_blocks, device_memory_budget=device_memory_budget,
            offload_states=offload_states, prefetch=prefetch, pin_memory=pin_memory,
            overlap_host_step=overlap_host_step)
        self.offload_fraction, self.offload_blocks = offload_fraction, offload_blocks
        self.device_memory_budget, self.activation_allowance = device_memory_budget, activation_allowance
        self.offload_states, self.prefetch, self.pin_memory = states, prefetch, pin_memory
        self.overlap_host_step, self.log_telemetry = overlap_host_step, log_telemetry
        self.plan: OffloadPlan | None = None
        self.engine: OffloadEngine | None = None
        self.telemetry: OffloadStats | None = None
        self.telemetry_history: list[OffloadStats] = []
        self._resident_model_bytes = 0

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
    def path(self) -> Literal["local", "ddp", "fsdp"]:
        """Which engine runs this job (see the module docstring and ``execution_path``)."""
        return execution_path(self.sharding, self.world_size, offloading=self.offloading,
                              layered=self.accumulation == "layered")

    @property
    def offloading(self) -> bool:
        """Whether the options ask for offload (a zero fraction or an empty block list do not)."""
        return bool(self.offload_fraction or self.offload_blocks or self.device_memory_budget is not None)

    @property
    def fsdp_layout(self) -> str:
        """How FSDP2 lays the model out on the fsdp path (see ``fsdp_layout_for`` in sharding.py)."""
        return fsdp_layout_for(self.sharding)

    @property
    @override
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @override
    def setup_environment(self) -> None:
        if self.path == "local":
            self.accelerator.setup_device(self.root_device)
            self.set_world_ranks()  # one process and nothing sharded: no process group is needed
            return
        self._check_path_options()
        super().setup_environment()  # DDPStrategy: device, ranks, process group (gloo on CPU, NCCL on CUDA)
        if self.path == "fsdp":
            self._mesh = device_mesh(self.fsdp_layout, self.root_device.type, self.world_size)

    def _check_path_options(self) -> None:
        if self.path == "fsdp":
            check_fsdp_offload_states(self.offload_states)
        if self._replicated_zero and self.offloading and self.root_device.type != "cpu":
            raise ValueError(
                "P2RStrategy(sharding='zero1') with offloaded blocks across processes on an accelerator: "
                "ZeroRedundancyOptimizer broadcasts its partitions through the accelerator's process group, which "
                "cannot send host-resident tensors; use sharding='zero2' (optimizer states and gradients sharded)")

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
        if self.accumulation == "layered":
            if trainer.accumulate_grad_batches != 1:
                raise ValueError(
                    f"P2RStrategy(micro_batches={self.micro_batches}, accumulation={self.accumulation!r}) splits each "
                    f"batch itself; set Trainer(accumulate_grad_batches=1), got {trainer.accumulate_grad_batches}"
                )
        self._share_init_seed()
        if self.path == "ddp":
            return self._setup_ddp(trainer)
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        if self.path == "fsdp":
            self._shard()
        else:
            self._attach()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self._log_setup()

    def _log_setup(self) -> None:
        holder = self._holder_or_none()
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
            holder = self._holder()
            if hasattr(holder, "init_seed"):
                holder.init_seed = self.broadcast(holder.init_seed, src=0)

    def _setup_ddp(self, trainer: L.Trainer) -> None:
        module = self.lightning_module
        if has_meta_tensors(module):  # every rank holds the whole model: allocate it on the device, fill it
            initializer = Initializer(module, self._holder_or_none())
            params = allocate(module, self.root_device)
            if self._deferred_weights is None:
                initializer.fill(params)
            self._load_deferred_weights()
        super().setup(trainer)  # DDPStrategy: to the device, DDP wrap, optimizers
        self._log_setup()
        if trainer.state.fn == TrainerFn.FITTING and self.sharding == "zero1":
            self.optimizers = [zero_redundancy_optimizer(opt) for opt in self.optimizers]
            for config in self.lr_scheduler_configs:
                config.scheduler = rebind_scheduler(config.scheduler, self.optimizers[0])

    def _shard(self, *, move_module: bool = True) -> None:
        """Apply FSDP2 (zero2/zero3) after the model exists; offloaded blocks keep their shard on the host.

        ``move_module=False`` leaves the moving to FSDP2, which brings each unit's states to the device as it
        shards them (one block at a time), for a model too large to move whole (after delinking).
        """
        holder = self._holder()
        self.plan = self.make_plan(holder)
        module = self.lightning_module
        root = smallest_parameter_root(module)
        self._sharded_root, self._root_template = root, meta_template(root)
        lazy = has_meta_tensors(module)
        if move_module and not lazy:
            module.to(self.root_device)
        layered = self.accumulation == "layered"
        shard_blocks(holder.blocks, mesh=self._mesh, sharding=self.fsdp_layout, offloaded=self.plan.offloaded,
                     layered=layered, pin_memory=self.resolved_pin_memory)
        self._stage_runner = shard_rest(root, holder.blocks, mesh=self._mesh, layered=layered)
        if lazy:
            self._materialize_shards(holder)
        if self._stage_runner is not None:
            # The model's own forward (evaluation, a callback measuring a loss) reads the embedding and head
            # outside the runner: gather them first. Training calls the stages through the runner instead.
            runner = self._stage_runner
            root.register_forward_pre_hook(lambda *_: runner.unshard())

    def _materialize_shards(self, holder: nn.Module) -> None:
        """After ``fully_shard`` on the meta model: each unit in turn gets storage for this rank's shards only (an
        offloaded block's in host memory, as FSDP2's CPU offload keeps them) and its values, so the peak is the
        shards plus one whole tensor being cut."""
        module = self.lightning_module
        initializer = Initializer(module, holder)  # after fully_shard: the parameters are DTensors now
        fill = self._deferred_weights is None
        for index, block in enumerate(holder.blocks):
            params = allocate(block, "cpu" if index in self.plan.offloaded else self.root_device)
            if fill:
                initializer.fill(params)
        params = allocate(module, self.root_device, skip=[holder.blocks])
        if fill:
            initializer.fill(params)
        self._load_deferred_weights()

    def _load_deferred_weights(self) -> None:
        """Write a checkpoint restored before setup into the placed tensors (no whole copy of the model)."""
        if self._deferred_weights is None:
            return
        (source, strict), self._deferred_weights = self._deferred_weights, None
        module = self.lightning_module
        if isinstance(source, str):
            sharded_checkpoint.load_model_into(module, source)
        elif self.path == "fsdp":
            sharded_checkpoint.load_full_model_state(module, source, strict)
        elif self.engine is not None and self.engine.blocks:
            load_full_state_dict(module, self.engine, source, strict)
        else:
            module.load_state_dict(source, strict=strict)

    def _holder_or_none(self) -> nn.Module | None:
        try:
            return find_block_sequence(self.lightning_module)
        except ValueError:
            return None

    def _holder(self) -> nn.Module:
        module = self.lightning_module
        try:
            return find_block_sequence(module)
        except ValueError as error:
            raise ValueError(f"P2RStrategy needs a model made of a block sequence: {error}") from None

    def make_plan(self, holder: nn.Module) -> OffloadPlan:
        """The offload plan for the model as it is now (also after delinking changed its blocks)."""
        return plan_for_model(self.lightning_module, holder.blocks, self.root_device,
                              offload_fraction=self.offload_fraction, offload_blocks=self.offload_blocks,
                              device_memory_budget=self.device_memory_budget,
                              activation_allowance=self.activation_allowance, prefetch=self.prefetch)

    def _attach(self) -> None:
        holder = self._holder()
        self.plan = self.make_plan(holder)  # from the shapes alone: the model may still be on the meta device
        module = self.lightning_module
        lazy = has_meta_tensors(module)
        initializer = Initializer(module, holder) if lazy else None
        fill = lazy and self._deferred_weights is None
        offloaded = [holder.blocks[i] for i in self.plan.offloaded]
        if lazy:  # offloaded blocks straight into host memory: the engine keeps these tensors as its masters
            for block in offloaded:
                params = allocate(block, "cpu")
                if fill:
                    initializer.fill(params)
        prefix = blocks_prefix(module, holder)
        pin = self.resolved_pin_memory
        self.engine = OffloadEngine(holder, self.plan.offloaded, self.root_device, prefetch=self.prefetch,
                                    pin_memory=pin, param_prefix=prefix,
                                    offload_params="params" in self.offload_states)
        if lazy:
            params = allocate(module, self.root_device)
            if fill:
                initializer.fill(params)
        self.model_to_device()  # the offloaded blocks' parameters are already empty device placeholders
        self._load_deferred_weights()
        self.engine.on_block_grads_ready = self._on_block_grads_ready
        self._resident_model_bytes = resident_model_bytes(self.lightning_module, holder.blocks, self.engine.blocks)

    @override
    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    @override
    def setup_optimizers(self, trainer: L.Trainer) -> None:
        super().setup_optimizers(trainer)
        if self._replicated_zero:
            self.optimizers = partition_optimizer_states(self.optimizers, self.lr_scheduler_configs)
        self._split_optimizer()

    @property
    def _replicated_zero(self) -> bool:
        """ZeRO-1 on FSDP2's replicate layout (offload or layered accumulation across ranks)."""
        return self.path == "fsdp" and self.sharding == "zero1"

    def _module_optimizer(self, optimizer: Any) -> torch.optim.Optimizer:
        """The optimizer over the module's own parameters, as checkpoints and delinking read it (collective)."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # behind Lightning's wrapper
        if isinstance(optimizer, ReplicatedZeroOptimizer):
            return to_module_optimizer(optimizer, self.world_size, self.global_rank)
        return optimizer

    def _split_optimizer(self, carry_state_from: torch.optim.Optimizer | None = None) -> None:
        if self.engine is None or not self.engine.blocks:
            if carry_state_from is not None:
                _optimizer_to_device(carry_state_from, self.root_device)
            self._update_static_bytes()
            return
        split = split_single_optimizer(self.optimizers, self.engine, carry_state_from)
        for config in self.lr_scheduler_configs:
            config.scheduler = rebind_scheduler(config.scheduler, split)
        self.optimizers = [split]
        self._update_static_bytes()

    def _overlap_allowed(self) -> bool:
        """Stepping a block during backward must not skip anything that happens between backward and step."""
        return host_step_overlap_allowed(self.overlap_host_step, self.root_device, self.lightning_module,
                                         self.precision_plugin)

    def _on_block_grads_ready(self, index: int) -> None:
        optimizer = self.optimizers[0] if self.optimizers else None
        if isinstance(optimizer, SplitOptimizer) and self.lightning_module.trainer.training and self._overlap_allowed():
            optimizer.submit_host_step(index)

    # ---------------------------------------------------------------------------------------------- steps
    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Any:
        """Lightning enters this around the backward of every micro-batch but the last (standard accumulation)."""
        if self.path != "fsdp" or self.reduce_every_micro_batch:
            with super().block_backward_sync():  # DDP's no_sync on the ddp path
                yield
            return
        holder = self._holder()
        offloaded = {id(m) for i in self.plan.offloaded for m in holder.blocks[i].modules()}
        units = [u for u in fsdp_modules(self.lightning_module) if id(u) not in offloaded]
        for unit in units:
            unit.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for unit in units:
                unit.set_requires_gradient_sync(True, recurse=False)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._reshard_all()  # a forward outside training (a callback's loss) may have left units gathered
        if self.accumulation == "standard":
            with counting(self._counter):
                return super().training_step(*args, **kwargs)
        # Layered: the forward of every micro-batch runs here, their backward in ``backward`` (Lightning zeroes the
        # gradients between the two).
        module = self.lightning_module
        micro = split_micro_batches(args[0], self.micro_batches)
        with self.precision_plugin.train_step_context(), counting(self._counter):
            stages = self._layered_stages(module)
            events = self._block_events()
            with events if isinstance(events, EngineEvents) else contextlib.nullcontext():
                self._layered_step = layered_forward(stages, micro, events, recompute=self.recompute)
        if stages.log_metrics is not None:
            stages.log_metrics(self._layered_step.metrics)
        return self._layered_step.loss

    def _layered_stages(self, module: L.LightningModule) -> LayeredStages:
        if not callable(getattr(module, "layered_stages", None)):
            raise ValueError(
                f"P2RStrategy(accumulation='layered') needs the LightningModule to define layered_stages() -> "
                f"LayeredStages (embedding, per-layer and head stages); {type(module).__name__} does not"
            )
        return stages_through_runner(module.layered_stages(), self._stage_runner)

    def _block_events(self) -> Any:
        if self.path == "fsdp":
            return FSDPEvents(self._holder().blocks, self._stage_runner,
                              reshard_after_forward=self.fsdp_layout == "zero3")
        if self.engine is not None and self.engine.blocks:
            return EngineEvents(self.engine)
        return None

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        step, self._layered_step = self._layered_step, None
        if step is None:
            with counting(self._counter):
                return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        with counting(self._counter):
            events = step.events
            with events if isinstance(events, EngineEvents) else contextlib.nullcontext():
                step.backward()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if self.engine is not None:
            self.engine.finish_backward()
        for optimizer in self.optimizers:
            if isinstance(optimizer, ReplicatedZeroOptimizer):
                optimizer.link_grads()  # FSDP2 has all-reduced the gradients by now

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        with counting(self._counter):
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._record_telemetry()
        return output

    @override
    def on_validation_end(self) -> None:
        self._reshard_all()  # layered blocks never reshard in their own forward hook: evaluation left them gathered
        super().on_validation_end()

    @override
    def on_test_end(self) -> None:
        self._reshard_all()
        super().on_test_end()

    @override
    def on_predict_end(self) -> None:
        self._reshard_all()
        super().on_predict_end()

    def _reshard_all(self) -> None:
        """Every FSDP2 unit back to its shards (the stage runner is not inside the LightningModule)."""
        if self.path == "fsdp":
            reshard_all(self.lightning_module, self._stage_runner)

    def _update_static_bytes(self) -> None:
        """Device model-state bytes that do not stream: resident parameters, their gradients, the device
        optimizer's state (which grows at the first step)."""
        if self.engine is None:
            return
        optimizer = self.optimizers[0] if self.optimizers else None
        self.engine.static_device_bytes = self._resident_model_bytes + device_optimizer_state_bytes(optimizer)

    def _record_telemetry(self) -> None:
        metrics: dict[str, float] = {}
        if self._counter is not None:
            self.collectives = self._counter.take()
            self.collectives_history.append(self.collectives)
            metrics |= self.collectives.as_metrics()
        if self.engine is not None:
            self._update_static_bytes()
            self.telemetry = self.engine.take_stats()
            self.telemetry_history.append(self.telemetry)
            metrics |= self.telemetry.as_metrics()
        trainer = self.lightning_module.trainer
        if metrics and self.log_telemetry and trainer.global_step % max(trainer.log_every_n_steps, 1) == 0:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    # ------------------------------------------------------------------------------------------ delinking
    def delink_model(self, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer,
                     num_unique_blocks: int | None, optimizer_state: OptimizerStatePolicy) -> torch.optim.Optimizer:
        """Delink with the whole model gathered in host memory, then re-plan and re-offload.

        The real model may not fit on the device (that is why it was trained pseudo first), so the copies are
        made on the host, where memory is plentiful, and only the blocks the new plan keeps resident move back.
        """
        if self.path == "fsdp":
            return self._delink_sharded(pl_module, optimizer, num_unique_blocks, optimizer_state)
        if self.path == "ddp":
            return self._delink_replicated(pl_module, optimizer, num_unique_blocks, optimizer_state)
        plain = detach_to_host(self.engine, optimizer, self.lightning_module)
        self.engine = None
        new_optimizer = delink(pl_module, plain, num_unique_blocks=num_unique_blocks,
                               optimizer_state=optimizer_state)
        self._attach()
        self.optimizers = [new_optimizer]
        self._split_optimizer(carry_state_from=new_optimizer)
        return self.optimizers[0]

    def _delink_replicated(self, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer,
                           num_unique_blocks: int | None,
                           optimizer_state: OptimizerStatePolicy) -> torch.optim.Optimizer:
        """DDP / ZeRO-1: every rank holds the whole model, so every rank delinks the same way; the optimizer state
        is gathered first (ZeRO-1 partitions it), and DDP is rebuilt over the new parameters (the old reducer
        would silently skip them)."""
        plain = consolidated_plain_optimizer(optimizer, self.world_size, self.global_rank)
        new_optimizer = delink(pl_module, plain, num_unique_blocks=num_unique_blocks, optimizer_state=optimizer_state)
        self.model = pl_module
        self.configure_ddp()
        if self.sharding == "zero1":
            new_optimizer = zero_redundancy_optimizer(new_optimizer)
        self.optimizers = [new_optimizer]
        return new_optimizer

    def _delink_sharded(self, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer,
                        num_unique_blocks: int | None,
                        optimizer_state: OptimizerStatePolicy) -> torch.optim.Optimizer:
        """zero2/zero3: FSDP2 cannot change the modules it manages, so the model is gathered into a plain host copy
        (tensor by tensor), delinked there like any other model, and the copy replaces the sharded one and is
        sharded afresh (a new plan places the new blocks); the optimizer is rebuilt over the new shards."""
        root = self._sharded_root
        if root is None or root is pl_module:
            raise ValueError(
                f"P2RStrategy delinks a model on FSDP2 by rebuilding the submodule that holds its parameters; "
                f"{type(pl_module).__name__} keeps parameters directly on the LightningModule"
            )
        self._reshard_all()
        optimizer = self._module_optimizer(optimizer)
        plain, plain_optimizer, names = delinked_plain_copy(root, self._root_template, optimizer, num_unique_blocks,
                                                            optimizer_state)
        replace_submodule(pl_module, root, plain)
        # Free the old model's gradients and optimizer state before the new model is sharded (the caller and
        # Lightning still hold the old optimizer objects until this returns).
        release_model_state(root, [optimizer, *self.optimizers])
        self.optimizers, self._stage_runner, self._sharded_root = [], None, None
        del root, optimizer
        self._shard(move_module=False)
        self.optimizers = [shard_optimizer(plain_optimizer, names, plain)]
        if self._replicated_zero:
            self.optimizers = partition_optimizer_states(self.optimizers, self.lr_scheduler_configs)
        return self.optimizers[0]

    # ----------------------------------------------------------------------------------------- checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.path == "fsdp":
            return {}  # save_checkpoint writes the shards through DCP
        return full_state_dict(self.lightning_module, self.engine)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if self.path == "fsdp":
            return {}
        return super().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self.path != "fsdp":
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        optimizers = [self._module_optimizer(o) for o in self.optimizers]
        self._reshard_all()  # an evaluation forward (a callback's) may have left units gathered
        sharded_checkpoint.save_sharded(checkpoint, filepath, self.lightning_module, optimizers)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            sharded_checkpoint.remove(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Checkpoints move between stages: a sharded (DCP) one resumes with any ``sharding`` on any number of
        processes, a single-file one on the FSDP2 path too (its whole states are sharded on load)."""
        self._pending_sharded_checkpoint = None
        if sharded_checkpoint.is_sharded_checkpoint(checkpoint_path):
            self._pending_sharded_checkpoint = str(checkpoint_path)
            return sharded_checkpoint.load_meta(checkpoint_path)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if has_meta_tensors(self.lightning_module):
            # Lightning restores the weights before setup, while the model is still on the meta device: setup
            # writes them into the tensors where they will live.
            source = self._pending_sharded_checkpoint or checkpoint["state_dict"]
            self._deferred_weights = (source, strict)
            return
        # A model built eagerly: load into the plain module, which setup then places.
        if self._pending_sharded_checkpoint is not None:
            sharded_checkpoint.load_model_into(self.lightning_module, self._pending_sharded_checkpoint)
            return
        if self.engine is None or not self.engine.blocks:
            return super().load_model_state_dict(checkpoint, strict=strict)
        load_full_state_dict(self.lightning_module, self.engine, checkpoint["state_dict"], strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        module, pending = self.lightning_module, self._pending_sharded_checkpoint
        for index, optimizer in enumerate(self.optimizers):
            if isinstance(optimizer, LightningOptimizer):
                optimizer = optimizer._optimizer
            if self.path == "fsdp":
                # Into an optimizer over the module's own parameters, then into the partitioned one if zero1.
                target = self._module_optimizer(optimizer)
                if pending is not None:
                    sharded_checkpoint.load_optimizer_into(module, target, index, pending)
                else:
                    sharded_checkpoint.load_full_optimizer_state(module, target, checkpoint["optimizer_states"][index])
                if isinstance(optimizer, ReplicatedZeroOptimizer):
                    optimizer.load_whole_state(target)
            elif pending is not None:
                if isinstance(optimizer, SplitOptimizer):
                    raise ValueError(
                        f"{pending} is a sharded checkpoint; a one-process run with offloaded blocks resumes it with "
                        "P2RStrategy(sharding='zero2' or 'zero3') (FSDP2 on one process, the same offload plan)")
                sharded_checkpoint.load_optimizer_into_replicated(module, optimizer, index, pending)
            else:
                optimizer.load_state_dict(checkpoint["optimizer_states"][index])
                if not isinstance(optimizer, SplitOptimizer):  # a split optimizer keeps host state on the host
                    _optimizer_to_device(optimizer, self.root_device)
        self._update_static_bytes()

    # -------------------------------------------------------------------------------------------- teardown
    @override
    def teardown(self) -> None:
        release_to_host(self.optimizers, self.engine)
        self.engine = None
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

