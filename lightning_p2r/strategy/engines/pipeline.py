"""Modular pipeline parallelism (Lamy-Poirier 2021): the model cut by depth into stages of whole layers, looped over
the pipeline ranks, run by ``torch.distributed.pipelining``; FSDP2 over each stage's data-parallel ranks.

Each rank keeps only what its stages use: the other blocks (and the embedding or head, where another rank holds
them) are replaced by :class:`~..pipeline.stage.AbsentModule` while the model is still on the meta device, so no
rank ever allocates them. A parameter used by stages on several ranks (the block a pseudo model shares between all
its layers, an embedding tied to the head) is a replica on each of them and its gradient is all-reduced among
them after the step. See docs/parallelism.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ...protocols import DefinesPipelineStages, PipelineParts
from ...sharing import OptimizerStatePolicy, Perturbation, optimizer_constructor_kwargs
from ..materialize import has_meta_tensors
from ..parallel import build_meshes
from ..parallel.clipping import replicas_on_mesh
from ..pipeline.layout import PipelineLayout, block_holders, check_local_sharing, check_micro_batches
from ..pipeline.runner import BREADTH_FIRST, PipelineRunner, PipelineStepResult
from ..pipeline.stage import PipelineStageModule, keep_only
from ..plan import OffloadPlan, plan_for_model
from ..regather import delinked_plain_copy, meta_template, release_model_state, replace_submodule, shard_optimizer
from ..replicated_zero import partition_optimizer_states
from ..sharding import fsdp_modules, smallest_parameter_root
from .base import Engine
from .fsdp import FSDPEngine
from .model_parallel import ModelParallelEngine


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class PipelineEngine(ModelParallelEngine):
    name = "pipeline"

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy)
        self.stages_layout: PipelineLayout | None = None
        self.pipeline_group: dist.ProcessGroup | None = None
        self.pipeline: PipelineRunner | None = None
        self.stage_modules: list[PipelineStageModule] = []
        self.parts: PipelineParts | None = None
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._replicas: list[tuple[dist.ProcessGroup, list[nn.Parameter]]] = []
        self._holders_of: dict[int, int] = {}
        self._outside_ranks: dict[str, tuple[int, ...]] | None = None
        self._stashed: list[tuple[nn.Parameter, torch.Tensor | None]] = []
        self._stage_params: list[nn.Parameter] = []
        """This rank's parameters, once (a block a stage's layers share appears once), set where they are placed."""

    @property
    def breadth_first(self) -> bool:
        return self.strategy.pipeline_schedule in BREADTH_FIRST

    # ------------------------------------------------------------------------------------------ lifecycle
    def check_options(self) -> None:
        FSDPEngine.check_options(self)
        strategy = self.strategy
        if self.replicated_zero and self.dims.model_parallel:
            raise ValueError(
                "P2RStrategy(sharding='zero1') with tensor_parallel or expert_parallel: ZeRO-1's partitioned optimizer "
                "does not take parameters split over a device mesh; use sharding='zero2' or 'zero3'")
        if strategy.accumulation == "layered" and not self.breadth_first:
            raise ValueError(
                f"P2RStrategy(accumulation='layered', pipeline_schedule={strategy.pipeline_schedule!r}): across "
                "pipeline stages, layered accumulation is the breadth-first schedule itself; use pipeline_schedule="
                "'looped_bfs' (or 'gpipe' with one stage per rank)")
        if strategy.reduce_every_micro_batch:
            raise ValueError("P2RStrategy(reduce_every_micro_batch=True) does not apply with pipeline_parallel > 1: "
                             "the schedule reduces each stage's gradients once, after its last micro-batch")
        self.dims  # noqa: B018  (validates the degrees against the number of processes)

    def setup_environment(self) -> None:
        """One mesh ``(pipeline, data..., tensor)`` (and its expert twin, see ``parallel/mesh.py``): the stages'
        point-to-point traffic runs over its "pp" dimension, FSDP2 over the data dimensions of each stage."""
        self.check_options()
        Engine.setup_environment(self)
        self.meshes = build_meshes(self.dims, self.strategy.root_device.type, replicate=self.layout == "replicate")
        self.mesh = self.meshes.data
        self.pipeline_group = self.meshes.dense["pp"].get_group()
        if self.replicated_zero:  # ZeRO-1 partitions the optimizer states over the ranks holding the same stages
            self.zero_group = self.meshes.data_group()

    def parallelize(self, holder: nn.Module) -> None:
        if self.dims.model_parallel:
            super().parallelize(holder)

    def setup(self, trainer: L.Trainer) -> None:
        plugin = self.strategy.precision_plugin
        if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
            raise ValueError("P2RStrategy(pipeline_parallel > 1) with precision='16-mixed': the pipeline's schedule "
                             "runs the backward itself, where a gradient scaler cannot scale the loss; use "
                             "precision='bf16-mixed' (or 32)")
        # Lightning's clipping goes through the model-parallel engine's norm over all ranks, with this engine's
        # ``copies``: each pipeline replica and tensor-parallel slice counted once.
        super().setup(trainer)

    def teardown(self) -> None:
        holder = self.strategy.holder_or_none()
        if holder is not None:
            vars(holder).pop("forward", None)
        super().teardown()

    # ------------------------------------------------------------------------------------------- placement
    def _pipeline_parts(self) -> PipelineParts:
        module = self.strategy.lightning_module
        if not isinstance(module, DefinesPipelineStages):
            raise ValueError(
                f"P2RStrategy(pipeline_parallel > 1) needs the LightningModule to define pipeline_parts() -> "
                f"PipelineParts (see lightning_p2r.protocols); {type(module).__name__} does not")
        return module.pipeline_parts()

    def shard(self, *, move_module: bool = True) -> None:
        """Cut the model into this rank's stages, drop what other ranks hold, split (tensor / expert parallel) and
        shard (FSDP2) each block and each stage over the stage's ranks, then allocate this rank's shards."""
        strategy = self.strategy
        module = strategy.lightning_module
        holder = strategy.holder()
        parts = self._pipeline_parts()
        layer_to_block = list(holder.layer_to_block)
        layout = PipelineLayout(strategy.world_size, strategy.pipeline_parallel, strategy.stages_per_rank,
                                len(layer_to_block))
        check_local_sharing(layer_to_block, layout)
        check_micro_batches(strategy.pipeline_schedule, strategy.micro_batches, strategy.pipeline_parallel)
        self.stages_layout, self.parts = layout, parts
        stages = layout.stages_of(layout.pipeline_rank(strategy.global_rank))
        last = layout.num_stages - 1
        embed, head = list(parts.embed_modules), self._with_tied(holder, list(parts.head_modules))
        ranks_of = self._pipeline_ranks_of(holder, layer_to_block, embed, head)
        mine = {layer_to_block[layer] for stage in stages for layer in layout.stage_layers(stage)}
        keep_only(holder, mine, (embed if 0 in stages else []) + (head if last in stages else []))

        strategy.plan = self._offload_plan(holder, mine)
        root = smallest_parameter_root(module)
        self.sharded_root, self._root_template = root, meta_template(root)
        self.parallelize(holder)  # tensor / expert parallelism of this rank's part, before FSDP2 shards it
        lazy = has_meta_tensors(module)
        if move_module and not lazy:
            module.to(strategy.root_device)
        self.stage_modules = [PipelineStageModule(parts, holder.blocks, layout.stage_layers(s), first=s == 0,
                                                  last=s == last, embed_modules=embed, head_modules=head,
                                                  recompute=strategy.recompute)
                              for s in stages]
        self._shard_stages(holder, mine)
        if lazy:
            self._materialize_shards(holder)  # the other ranks' blocks are stand-ins: nothing to allocate
        else:
            strategy.load_deferred_weights()

        self._stage_params = list({id(p): p for m in self.stage_modules for p in m.parameters()}.values())
        params = dict(holder.named_parameters())
        self._holders_of = {id(p): len(ranks_of[name]) for name, p in params.items()}
        replicas: dict[tuple[int, ...], list[nn.Parameter]] = {}
        for name, p in params.items():
            if len(ranks_of[name]) > 1:
                replicas.setdefault(ranks_of[name], []).append(p)
        self._replicas = [(self._groups[ranks], group) for ranks, group in sorted(replicas.items())]
        self.pipeline = PipelineRunner(self.stage_modules, stages, layout.num_stages, strategy.root_device,
                                       self.pipeline_group, strategy.pipeline_schedule, strategy.micro_batches, parts)
        # The whole model exists on no rank: its forward runs through the stages (an instance attribute, removed in
        # teardown; the strategy's training step calls the stages directly).
        holder.forward = self._pipelined_forward

    def _pipeline_ranks_of(self, holder: nn.Module, layer_to_block: list[int], embed: list[nn.Module],
                           head: list[nn.Module]) -> dict[str, tuple[int, ...]]:
        """The pipeline ranks holding each parameter (by its name in the holder, which sharding keeps), and a
        process group for every set of several. Collective (groups are created on every rank)."""
        layout = self.stages_layout
        if self._outside_ranks is None:
            # Known once, before anything is dropped: delinking changes only the blocks.
            self._outside_ranks = {}
            names = {id(p): n for n, p in holder.named_parameters()}
            for modules, stage in ((embed, 0), (head, layout.num_stages - 1)):
                for param in (p for m in modules for p in m.parameters()):
                    held = set(self._outside_ranks.get(names[id(param)], ())) | {layout.owner(stage)}
                    self._outside_ranks[names[id(param)]] = tuple(sorted(held))
        holders = block_holders(layer_to_block, layout)
        self._create_groups([r for r in [*holders.values(), *self._outside_ranks.values()] if len(r) > 1])
        ranks_of = dict(self._outside_ranks)
        for block, ranks in holders.items():
            for name, _ in holder.blocks[block].named_parameters():
                ranks_of[f"blocks.{block}.{name}"] = ranks
        return ranks_of

    def _offload_plan(self, holder: nn.Module, mine: set[int]) -> OffloadPlan:
        """The offload options applied to this rank's own blocks (a fraction or a budget is this rank's share;
        ``offload_blocks`` names blocks by their index in the model)."""
        strategy = self.strategy
        own = sorted(mine)
        chosen = strategy.offload_blocks
        local = plan_for_model(strategy.lightning_module, nn.ModuleList([holder.blocks[i] for i in own]),
                               strategy.root_device, offload_fraction=strategy.offload_fraction,
                               offload_blocks=None if chosen is None else [own.index(i) for i in chosen if i in mine],
                               device_memory_budget=strategy.device_memory_budget,
                               activation_allowance=strategy.activation_allowance, prefetch=strategy.prefetch)
        return OffloadPlan(len(holder.blocks), tuple(own[i] for i in local.offloaded))

    def _shard_stages(self, holder: nn.Module, mine: set[int]) -> None:
        """``fully_shard`` this rank's blocks (offloaded ones keep their shards on the host), then each stage module
        as the root of its blocks."""
        strategy = self.strategy
        offloaded = set(strategy.plan.offloaded)
        # Breadth-first schedules run every micro-batch through a stage in a row: zero3 gathers its blocks once for
        # them all and reshards after the last (as layered accumulation does); depth-first ones reshard each time.
        per_micro_batch = self.layout == "zero3" and not self.breadth_first
        for index in sorted(mine):
            policy = (CPUOffloadPolicy(pin_memory=strategy.resolved_pin_memory) if index in offloaded
                      else OffloadPolicy())
            fully_shard(holder.blocks[index], mesh=self.mesh, reshard_after_forward=per_micro_batch,
                        offload_policy=policy)
        for stage_module in self.stage_modules:
            fully_shard(stage_module, mesh=self.mesh, reshard_after_forward=False)
            if self.layout == "zero3" and self.breadth_first:
                stage_module.after_last_forward = _reshard_blocks

    @staticmethod
    def _with_tied(holder: nn.Module, modules: list[nn.Module]) -> list[nn.Module]:
        """``modules`` and any other module outside the blocks holding a parameter of theirs (a tied embedding), so
        the stage's FSDP2 root manages every module that holds the shared tensor."""
        shared = {id(p) for m in modules for p in m.parameters()}
        extra = [child for child in holder.children() if child is not holder.blocks and not any(
            child is m for m in modules) and any(id(p) in shared for p in child.parameters())]
        return modules + extra

    def _create_groups(self, rank_sets: list[tuple[int, ...]]) -> None:
        """One process group per set of pipeline ranks sharing replicas and per pipeline (column of the mesh); every
        rank creates every group, in the same order (``new_group`` is collective)."""
        layout = self.stages_layout
        for ranks in sorted(set(rank_sets) - set(self._groups)):
            for column in range(layout.ranks_per_stage):
                group = dist.new_group(layout.global_ranks(list(ranks), column))
                if layout.column(self.strategy.global_rank) == column:
                    self._groups[ranks] = group

    def copies(self, param: torch.Tensor) -> int:
        """Ranks holding the same local part of ``param``'s gradient: its mesh's replicas times its pipeline
        replicas (ZeRO-1's optimizer steps plain views of the parameters: their parameter's count)."""
        whole = self._whole_of.get(id(param), param)
        grad = whole.grad
        # A parameter on a sub-mesh of its stage (a norm weight on the data ranks only) is repeated on the stage's
        # other tensor-parallel slices, which its placements do not show; the pipeline slices hold other stages.
        slices = (self.strategy.world_size // grad.device_mesh.size() // self.strategy.pipeline_parallel
                  if isinstance(grad, DTensor) else 1)
        return replicas_on_mesh(grad) * slices * self._holders_of.get(id(whole), 1)

    # ---------------------------------------------------------------------------------------------- training
    def block_events(self) -> None:
        return None

    def stage_runner(self) -> None:
        return None

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        yield

    def train_step(self, batch: torch.Tensor) -> PipelineStepResult:
        """Forward and backward of every micro-batch through the pipeline; replicas' gradients summed; the step's
        loss and metrics on every rank. The gradients are then held aside until :meth:`restore_gradients`, because
        Lightning zeroes them between ``training_step`` and ``backward``."""
        params = self._stage_params
        for param in params:  # the last step's gradients (Lightning zeroes them after training_step, too late here)
            param.grad = None
        self.pipeline.train_step(batch)
        for group, replicas in self._replicas:
            sum_over(group, [_local(p.grad) for p in replicas if p.grad is not None])
        with self.strategy.uncounted():  # metrics, not the training layout
            result = self.pipeline.gather_step()
        self._stashed = [(p, p.grad) for p in params]
        for param, _ in self._stashed:
            param.grad = None
        return result

    def restore_gradients(self) -> None:
        for param, grad in self._stashed:
            param.grad = grad
        self._stashed = []

    def drop_gradients(self) -> None:
        """A skipped step (non-finite loss): forget the held gradients."""
        self._stashed = []

    def _pipelined_forward(self, inputs: torch.Tensor) -> Any:
        """The model's forward on a pipelined rank (validation, test, predict, a callback's loss): the inputs run
        through every stage, forward only and without gradient, and the output built from the last stage's logits
        reaches every rank of the pipeline. Collective over the pipeline's ranks, which all read the same batch."""
        layout, strategy = self.stages_layout, self.strategy
        logits = self.pipeline.evaluate(self.parts.window(inputs))
        source = layout.global_ranks([layout.owner(layout.num_stages - 1)], layout.column(strategy.global_rank))[0]
        meta = [(tuple(logits.shape), logits.dtype) if logits is not None else None]
        dist.broadcast_object_list(meta, src=source, group=self.pipeline_group)
        if logits is None:
            shape, dtype = meta[0]
            logits = torch.empty(shape, dtype=dtype, device=strategy.root_device)
        dist.broadcast(logits, src=source, group=self.pipeline_group)
        return self.parts.output(logits)

    def reshard(self) -> None:
        super().reshard()
        for stage_module in self.stage_modules:
            stage_module.reshard()

    # --------------------------------------------------------------------------------------------- delinking
    def delink(self, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer, num_unique_blocks: int | None,
               optimizer_state: OptimizerStatePolicy, perturb: Perturbation | None = None) -> torch.optim.Optimizer:
        """Gather this rank's part into a plain host copy, delink it (the copies of a shared block start from this
        rank's replica, equal on every rank), keep the new blocks of this rank's layers and shard them afresh."""
        strategy = self.strategy
        root = self.sharded_root
        self.reshard()
        optimizer = self.module_optimizer(optimizer)
        plain, plain_optimizer, names = delinked_plain_copy(root, self._root_template, optimizer, num_unique_blocks,
                                                            optimizer_state, perturb)
        replace_submodule(pl_module, root, plain)
        release_model_state(root, [optimizer, *strategy.optimizers])
        strategy.optimizers, self.sharded_root, self.pipeline, self.stage_modules = [], None, None, []
        del root, optimizer
        self.shard(move_module=False)
        live = {names_key for names_key, _ in plain.named_parameters()}
        kept = _only_parameters(plain_optimizer, {pid for pid, name in names.items() if name in live})
        strategy.optimizers = [shard_optimizer(kept, names, plain)]
        if self.replicated_zero:
            # The caller rebinds the LR schedulers (one owner): none are handed over here.
            strategy.optimizers = partition_optimizer_states(strategy.optimizers, [], self.zero_group)
            self._map_views()
        return strategy.optimizers[0]

    # ------------------------------------------------------------------------------------------- checkpoints
    def load_optimizer_state(self, index: int, optimizer: torch.optim.Optimizer, checkpoint: dict[str, Any],
                             sharded_path: str | None) -> None:
        if sharded_path is None:
            raise ValueError(
                "resuming a pipeline-parallel run from a single-file checkpoint: its optimizer state is numbered over "
                "the whole model's parameters, which no pipeline rank holds. Resume from a sharded (torch distributed "
                "checkpoint) directory, which any sharding='zero2'/'zero3' or pipeline run saves and which reshards "
                "across pipeline degrees; a single file's weights alone load with M6LanguageModel.load_from_checkpoint")
        super().load_optimizer_state(index, optimizer, checkpoint, sharded_path)

    def load_weights(self, source: dict[str, Any] | str, strict: bool) -> None:
        if isinstance(source, dict):  # a whole model's state dict: this rank's part of it
            own = set(self.strategy.lightning_module.state_dict())
            source = {key: value for key, value in source.items() if key in own}
        super().load_weights(source, strict)


def sum_over(group: dist.ProcessGroup, tensors: list[torch.Tensor]) -> None:
    """All-reduce (sum) ``tensors`` in place over ``group``: one flat all-reduce per dtype (the replicas of a pseudo
    model's block are many small tensors), on the group's device (an offloaded block's gradient lives on the host
    on one rank and maybe not on another, and NCCL reduces device tensors only)."""
    device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl"
              else torch.device("cpu"))
    buckets: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        buckets.setdefault(tensor.dtype, []).append(tensor)
    for dtype in sorted(buckets, key=str):  # the same order on every rank
        bucket = buckets[dtype]
        flat = torch.cat([t.reshape(-1).to(device) for t in bucket])
        dist.all_reduce(flat, group=group)
        for tensor, part in zip(bucket, flat.split([t.numel() for t in bucket])):
            tensor.copy_(part.view_as(tensor))


def _reshard_blocks(stage_module: nn.Module) -> None:
    for block in stage_module.owned:
        for unit in fsdp_modules(block):
            unit.reshard()


def _only_parameters(optimizer: torch.optim.Optimizer, keep: set[int]) -> torch.optim.Optimizer:
    """``optimizer`` over the parameters in ``keep`` (by id) only, with their state."""
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": [p for p in g["params"] if id(p) in keep]}
              for g in optimizer.param_groups]
    result = type(optimizer)(groups, **optimizer_constructor_kwargs(optimizer))
    for param, state in optimizer.state.items():
        if id(param) in keep:
            result.state[param] = state
    return result
