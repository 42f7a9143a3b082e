"""Every layout across processes, and ZeRO-2/3 on one, in one engine: ZeRO-2/3, the replicated layouts (``none`` and
``zero1``: DDP's reducer, or FSDP2's HSDP with shards of one rank), tensor / expert parallelism and pipeline
stages. They differ only in the steps of the one placement path they take (``placement.py``) and, for pipelines, in
the step runner. Checkpoints are torch distributed checkpoints, except where every rank holds the whole model: one
file, as DDP writes it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ...layout import check_delayed_host_step, check_fsdp_offload_states, fsdp_mode_for
from ...sharing import OptimizerStatePolicy, Perturbation
from ..accounting import local_tensor
from ..checkpoint import (
    load_full_model_state,
    load_full_optimizer_state,
    load_model_into,
    load_optimizer_into,
    save_sharded,
)
from ..layered import BlockEvents
from ..optimizers import unwrapped as unwrapped_optimizer
from ..parallel import ParallelMeshes, build_meshes
from ..parallel.clipping import ranks_holding
from ..parallel.experts import expert_dispatch
from ..pipeline.rank_stages import RankStages
from ..placement import Placement, place
from ..regather import delinked_plain_copy, optimizer_subset, release_model_state, replace_submodule, shard_optimizer
from ..replicated_zero import ZeroOneOptimizer, partition_optimizer_states, unpacked
from ..sharding import FSDPEvents, fsdp_modules, recover_from_error, reshard_all
from ..steps import PipelinedSteps, StepRunner
from .base import Engine, EngineContext, Placed, holder_of

if TYPE_CHECKING:
    from lightning.pytorch.plugins.precision import Precision

    from ..accounting import CollectiveCounter


class FSDP2Engine(Engine):
    """``path``: "fsdp" (FSDP2 on all ranks), "model_parallel" (the model's plan first) or "pipeline" (stages first)."""

    def __init__(self, path: str = "fsdp") -> None:
        super().__init__()
        self.path = path
        self.meshes: ParallelMeshes | None = None
        self.stages: RankStages | None = None
        self.placement: Placement | None = None
        self.zero_group: Any = None
        """The ranks ZeRO-1 partitions the optimizer states over (those holding the same parts of the parameters)."""
        self.expert_zero_group: Any = None
        """Under expert parallelism, ZeRO-1's group for the experts (the ranks holding the same experts)."""
        self._whole_of: dict[int, torch.Tensor] = {}
        self._holder: nn.Module | None = None

    @property
    def saves_sharded(self) -> bool:  # type: ignore[override]
        """Sharded (DCP) checkpoints, but one file where every rank holds the whole model (the replicated layouts
        without a model split), as DDP writes it: ``load_from_checkpoint`` and any other tool read it."""
        return not (self.path in ("fsdp", "ddp") and self.ctx is not None
                    and fsdp_mode_for(self.ctx.sharding.sharding) == "replicate")

    def check_options(self, ctx: EngineContext) -> None:
        """FSDP2's own rule: its CPU offload moves a unit's parameters, gradients and optimizer states together."""
        super().check_options(ctx)
        check_fsdp_offload_states(set(ctx.offload.offload_states))
        check_delayed_host_step(ctx.offload.host_step, self.path)

    def setup_environment(self, ctx: EngineContext) -> None:
        """The dense mesh and its expert twin (``parallel/mesh.py``); the stages' traffic runs over "pp"."""
        self.ctx = ctx
        dims = ctx.layout.dims(ctx.world_size)
        self.meshes = meshes = build_meshes(dims, ctx.device.type,
                                            replicate=fsdp_mode_for(ctx.sharding.sharding) == "replicate")
        if ctx.sharding.sharding == "zero1":
            # ZeRO-1 partitions over the ranks that hold the same (tensor-parallel) part of every parameter: the data
            # ranks of one tensor-parallel position (of one stage); under expert parallelism the experts over the
            # ranks holding the same experts (the expert-data ranks), a second partition (SplitZeroOptimizer).
            self.zero_group = meshes.data_group()
            if dims.expert_parallel > 1 and self.path != "pipeline":
                self.expert_zero_group = meshes.data_dims_group(meshes.experts, meshes.expert_data_dims)
        if self.path == "pipeline":
            self.stages = RankStages(ctx, meshes.dense["pp"].get_group())

    def place(self, module: nn.Module, ctx: EngineContext, *, move_module: bool = True) -> Placed:
        if self.stages is not None and ctx.gradient_scaler:
            raise ValueError("P2RStrategy(pipeline_parallel > 1) with precision='16-mixed': the pipeline's schedule "
                             "runs the backward itself, unscaled; use precision='bf16-mixed' (or 32)")
        self.ctx = ctx.without_weights()
        self._holder = holder_of(module)
        self.placement = place(module, ctx, self.meshes, self.stages, move_module=move_module)
        if self.stages is not None:
            self.stages.finish(self._holder, ctx.device)
            # The whole model exists on no rank: its forward runs through the stages (an instance attribute, removed
            # in teardown; the strategy's training step calls the stages directly).
            self._holder.forward = self.stages.forward
        log = ["P2RStrategy " + self.meshes.dims.describe()] if self.meshes.dims.model_parallel else []
        return Placed(self.placement.plan, tuple(log + ([self.stages.describe()] if self.stages is not None else [])),
                      self.placement.wrapper)

    def teardown(self, module: nn.Module | None) -> None:
        if module is not None:
            # A forward or backward that raised leaves the root gathered (plain parameters where the shards were):
            # Lightning's teardown then moves the module to the host, FSDP2 fails on them, and that error hid the
            # user's own.
            recover_from_error(module, self.outside_blocks_root())
        if self.stages is not None and module is not None:
            with contextlib.suppress(ValueError):
                vars(holder_of(module)).pop("forward", None)

    def adapt_optimizers(self, optimizers: list[torch.optim.Optimizer],
                         module: nn.Module) -> list[torch.optim.Optimizer]:
        if self.ctx.sharding.sharding == "zero1" and self._zero_one_partitions():
            # Given an expert group (expert parallelism), the experts are a second partition, over that group.
            layers = [m for m in holder_of(module).modules() if expert_dispatch(m) is not None]
            optimizers = [partition_optimizer_states(optimizers, self.zero_group, expert_group=self.expert_zero_group,
                                                     experts={id(p) for m in layers for p in m.parameters()})]
        self._whole_of = {}
        for optimizer in optimizers:  # which parameter each of ZeRO-1's views stands for (clipping counts it)
            if isinstance(optimizer, ZeroOneOptimizer):
                self._whole_of |= {id(v): p for v, p in zip(optimizer.views, optimizer.whole_params)}
        return optimizers

    def _zero_one_partitions(self) -> bool:
        """Whether ZeRO-1 has ranks to partition over: over a group of one rank (a pipeline stage or a tensor-parallel
        position alone on its data rank) it would keep every state anyway and broadcast each parameter to itself
        after every step, so the optimizer stays the plain one."""
        groups = [self.zero_group] + ([self.expert_zero_group] if self.expert_zero_group is not None else [])
        return any(dist.get_world_size(g) > 1 for g in groups)  # None: the default group, every rank

    def module_optimizer(self, optimizer: Any) -> torch.optim.Optimizer:
        """The optimizer over the module's own parameters, as checkpoints and delinking read it (collective)."""
        optimizer = unwrapped_optimizer(optimizer)
        return optimizer.to_module_optimizer() if isinstance(optimizer, ZeroOneOptimizer) else optimizer

    def step_runner(self, module: nn.Module, precision: Precision, counter: CollectiveCounter | None) -> StepRunner:
        if self.stages is None:
            return super().step_runner(module, precision, counter)
        return PipelinedSteps(module, precision, counter, self.stages, self.ctx.uncounted)

    def pipeline_runner(self) -> Any:
        return self.stages.runner if self.stages is not None else None

    def outside_blocks_root(self) -> nn.Module | None:
        return self.placement.outside_root if self.placement is not None else None

    def block_events(self) -> BlockEvents | None:
        if self.stages is not None or self.placement is None:
            return None
        return FSDPEvents(self._holder.blocks, self.outside_blocks_root(),
                          reshard_after_last=self.ctx.layout.resharding.after_last_micro_batch)

    @contextlib.contextmanager
    def no_sync(self, module: nn.Module) -> Iterator[None]:
        """Skip the gradient reduction of every unit that is not offloaded (their gradients must not stay on the
        device) until the last micro-batch, unless the options ask to reduce every micro-batch; DDP's reducer skips
        it by its own ``no_sync``."""
        wrapper = self.placement.wrapper if self.placement is not None else None
        if wrapper is not None and not self.ctx.accumulation.reduce_every_micro_batch:
            with wrapper.no_sync():
                yield
            return
        units = []
        if not self.ctx.accumulation.reduce_every_micro_batch and self.stages is None:
            blocks = holder_of(module).blocks
            offloaded = {id(m) for i in self.placement.plan.offloaded for m in blocks[i].modules()}
            units = [u for u in fsdp_modules(module) if id(u) not in offloaded]
        for unit in units:
            unit.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for unit in units:
                unit.set_requires_gradient_sync(True, recurse=False)

    def post_backward(self, optimizers: list[Any]) -> None:
        for optimizer in optimizers:
            if isinstance(optimizer, ZeroOneOptimizer):
                optimizer.link_grads()  # FSDP2 has all-reduced the gradients by now

    def reshard(self, module: nn.Module) -> None:
        reshard_all(module, self.outside_blocks_root())
        if self.stages is not None:
            for stage_module in self.stages.stage_modules:
                if isinstance(stage_module, FSDPModule):  # a stage alone on its rank is a plain module
                    stage_module.reshard()

    def grad_copies(self) -> Callable[[torch.Tensor], int] | None:
        # "fsdp" (one mesh) and "ddp" (plain tensors): torch's clipping is right
        return None if self.path in ("fsdp", "ddp") else self.copies

    def copies(self, param: torch.Tensor) -> int:
        """Ranks holding the same local part of ``param``'s gradient (a ZeRO-1 view counts as its parameter)."""
        whole = self._whole_of.get(id(param), param)
        if self.stages is not None:
            return self.stages.copies(whole)
        return ranks_holding(whole.grad)

    def delink(self, module: nn.Module, optimizer: torch.optim.Optimizer, ctx: EngineContext,
               num_unique_blocks: int | None, optimizer_state: OptimizerStatePolicy,
               perturb: Perturbation | None = None) -> tuple[torch.optim.Optimizer, Placed]:
        """FSDP2 cannot change the modules it manages: this rank's part of the model is gathered, tensor by tensor,
        into a plain host copy, delinked there, and placed afresh; the optimizer is rebuilt over the new shards."""
        if self.placement is None:
            raise RuntimeError("P2RStrategy delinks a placed model: nothing is placed yet (delink after setup)")
        root = self.placement.root
        if root is module:
            raise ValueError(
                f"P2RStrategy delinks a model on FSDP2 by rebuilding the submodule that holds its parameters; "
                f"{type(module).__name__} keeps parameters directly on the LightningModule")
        self.reshard(module)
        whole_optimizer = self.module_optimizer(optimizer)
        plain, plain_optimizer, names = delinked_plain_copy(root, self.placement.template, whole_optimizer,
                                                            num_unique_blocks, optimizer_state, perturb)
        replace_submodule(module, root, plain)
        # Free the old model's gradients and optimizer state before the new model is placed (the caller and
        # Lightning still hold the old optimizer objects until this returns).
        release_model_state(root, [whole_optimizer, optimizer])
        self.placement = None
        if self.stages is not None:
            self.stages.clear()
        del root, whole_optimizer
        placed = self.place(module, ctx, move_module=False)
        if self.stages is not None:  # this rank keeps only its own blocks' parameters
            live = {name for name, _ in plain.named_parameters()}
            kept = [(i, [p for p in g["params"] if names.get(id(p)) in live])
                    for i, g in enumerate(plain_optimizer.param_groups)]
            plain_optimizer = optimizer_subset(plain_optimizer, kept)
        return self.adapt_optimizers([shard_optimizer(plain_optimizer, names, plain)], module)[0], placed

    def save_sharded(self, checkpoint: dict[str, Any], filepath: Any, module: nn.Module, optimizers: list[Any]) -> None:
        whole = [self.module_optimizer(o) for o in optimizers]
        self.reshard(module)  # an evaluation forward (a callback's) may have left units gathered
        save_sharded(checkpoint, filepath, module, whole)

    def whole_model_state(self, module: nn.Module) -> dict[str, Any]:
        """Every rank holds each parameter whole (a DTensor with shards of one rank): its local tensor is the value
        (ZeRO-1's packed parameters over DDP copied out of their buffers: ``unpacked``)."""
        self.reshard(module)
        return unpacked({name: local_tensor(value) for name, value in module.state_dict().items()})

    def whole_optimizer_state(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> dict[str, Any]:
        """The whole state over the module's parameters (ZeRO-1's partitions gathered first: collective), numbered
        as torch numbers a plain optimizer's, with plain tensors."""
        state = self.module_optimizer(optimizer).state_dict()
        state["state"] = {index: {key: local_tensor(value) if isinstance(value, torch.Tensor) else value
                                  for key, value in entry.items()} for index, entry in state["state"].items()}
        return state

    def load_weights(self, module: nn.Module, source: dict[str, Any] | str, strict: bool) -> None:
        if isinstance(source, str):
            load_model_into(module, source)
            return
        if self.stages is not None:  # a whole model's state dict: this rank's part of it
            own = set(module.state_dict())
            source = {key: value for key, value in source.items() if key in own}
        load_full_model_state(module, source, strict)

    def load_optimizer_state(self, module: nn.Module, index: int, optimizer: torch.optim.Optimizer,
                             checkpoint: dict[str, Any], sharded_path: str | None, device: torch.device) -> None:
        """Into an optimizer over the module's own parameters, then into the partitioned one if zero1."""
        if sharded_path is None and self.stages is not None:
            raise ValueError(
                "resuming a pipeline-parallel run from a single-file checkpoint, whose optimizer state is numbered "
                "over the whole model: resume from a sharded checkpoint directory (any zero2/zero3 or pipeline run "
                "saves one); a single file's weights alone load with your LightningModule's load_from_checkpoint")
        target = self.module_optimizer(optimizer)
        if sharded_path is not None:
            load_optimizer_into(module, target, index, sharded_path)
        else:
            load_full_optimizer_state(module, target, checkpoint["optimizer_states"][index])
        if isinstance(optimizer, ZeroOneOptimizer):
            optimizer.load_whole_state(target)
