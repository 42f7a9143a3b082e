"""Modular pipeline parallelism's part of placement (Lamy-Poirier 2021) and the pipelined step (docs/parallelism.md).

Each rank keeps only what its stages use: the rest is replaced by :class:`~.stage.AbsentModule` while the model is
still on the meta device, so no rank ever allocates it. A parameter used by stages on several ranks (a pseudo model's
shared block, an embedding tied to the head) is a replica on each, its gradient all-reduced among them after the step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ...layout import StageCut, block_holders, check_local_sharing
from ...protocols import DefinesPipelineStages, PipelineParts
from ..accounting import local_tensor
from ..blocks import block_names
from ..parallel.clipping import ranks_holding
from .runner import PipelineRunner, PipelineStepResult
from .stage import PipelineStageModule, keep_only

if TYPE_CHECKING:
    from ..engines.base import EngineContext


def pipeline_parts(module: nn.Module) -> PipelineParts:
    if not isinstance(module, DefinesPipelineStages):
        raise ValueError(
            f"P2RStrategy(pipeline_parallel > 1) needs the LightningModule to define pipeline_parts() -> "
            f"PipelineParts (see lightning_p2r.protocols); {type(module).__name__} does not. For a decoder, "
            "CausalLMModule(model=..., parts=DecoderParts(blocks=..., embed=(...), norm=..., head=..., base=...)) "
            "defines it from the model's module names (docs/your_model.md)")
    return module.pipeline_parts()


class RankStages:
    """This rank's stages of one job, cut at every placement (delinking re-cuts), and the replicas' process groups."""

    def __init__(self, ctx: EngineContext, group: dist.ProcessGroup) -> None:
        p, a = ctx.parallel, ctx.accumulation
        self.world_size, self.global_rank = ctx.world_size, ctx.global_rank
        self.pipeline_parallel, self.stages_per_rank = p.pipeline_parallel, p.stages_per_rank
        self.schedule, self.micro_batches, self.recompute = p.pipeline_schedule, a.micro_batches, a.recompute
        self.group = group
        """The pipeline's process group (the "pp" dimension of the mesh)."""
        self.sharding, self.wrapped = ctx.sharding.sharding, ctx.layout.wraps_blocks(ctx.world_size)
        self.cut: StageCut | None = None
        self.parts: PipelineParts | None = None
        self._embed: list[nn.Module] = []
        self._head: list[nn.Module] = []
        """The modules the first and last stages hold besides their blocks (set where the model is cut)."""
        self.stage_modules: list[PipelineStageModule] = []
        self.runner: PipelineRunner | None = None
        self.params: list[nn.Parameter] = []
        """This rank's parameters, once (a block a stage's layers share appears once)."""
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._replicas: list[tuple[dist.ProcessGroup, list[nn.Parameter]]] = []
        self._holders_of: dict[int, int] = {}
        self._outside_ranks: dict[str, tuple[int, ...]] | None = None
        self._ranks_of: dict[str, tuple[int, ...]] = {}
        self._stashed: list[tuple[nn.Parameter, torch.Tensor | None]] = []

    def keep_own(self, module: nn.Module, holder: nn.Module) -> set[int]:
        """Cut the model into stages, drop what other ranks hold and return this rank's blocks (collective)."""
        parts = pipeline_parts(module)
        layer_to_block = list(holder.layer_to_block)
        cut = StageCut(self.world_size, self.pipeline_parallel, self.stages_per_rank, len(layer_to_block))
        check_local_sharing(layer_to_block, cut)  # again after delinking (the strategy checked it at setup)
        self.cut, self.parts = cut, parts
        self._embed, self._head = list(parts.embed_modules), _with_tied(holder, list(parts.head_modules))
        self._ranks_of = self._pipeline_ranks_of(holder, layer_to_block)
        stages = self.stages
        mine = {layer_to_block[layer] for stage in stages for layer in cut.stage_layers(stage)}
        kept = (self._embed if 0 in stages else []) + (self._head if cut.num_stages - 1 in stages else [])
        keep_only(holder, mine, kept)
        return mine

    @property
    def stages(self) -> list[int]:
        return self.cut.stages_of(self.cut.pipeline_rank(self.global_rank))

    def build_stage_modules(self, holder: nn.Module) -> list[PipelineStageModule]:
        """One module per stage of this rank (the FSDP2 root of its blocks where FSDP2 wraps them); recompute
        checkpoints each layer."""
        cut, last = self.cut, self.cut.num_stages - 1
        self.stage_modules = [PipelineStageModule(self.parts, holder.blocks, cut.stage_layers(s), first=s == 0,
                                                  last=s == last, embed_modules=self._embed, head_modules=self._head,
                                                  recompute=self.recompute)
                              for s in self.stages]
        return self.stage_modules

    def finish(self, holder: nn.Module, device: torch.device) -> None:
        """After the stages are sharded and materialized: the replica groups and the schedule's runner."""
        self.params = list({id(p): p for m in self.stage_modules for p in m.parameters()}.values())
        params = dict(holder.named_parameters())
        self._holders_of = {id(p): len(self._ranks_of[name]) for name, p in params.items()}
        replicas: dict[tuple[int, ...], list[nn.Parameter]] = {}
        for name, p in params.items():
            if len(self._ranks_of[name]) > 1:
                replicas.setdefault(self._ranks_of[name], []).append(p)
        self._replicas = [(self._groups[ranks], group) for ranks, group in sorted(replicas.items())]
        self.runner = PipelineRunner(self.stage_modules, self.stages, self.cut.num_stages, device, self.group,
                                     self.schedule, self.micro_batches, self.parts)

    def clear(self) -> None:
        """Before a re-placement (delinking): forget the stage modules and the runner."""
        self.stage_modules, self.runner = [], None

    def _pipeline_ranks_of(self, holder: nn.Module, layer_to_block: list[int]) -> dict[str, tuple[int, ...]]:
        """The pipeline ranks holding each parameter (by name), and a process group per set of several (collective)."""
        cut = self.cut
        if self._outside_ranks is None:
            # Known once, before anything is dropped: delinking changes only the blocks.
            self._outside_ranks = {}
            names = {id(p): n for n, p in holder.named_parameters()}
            for modules, stage in ((self._embed, 0), (self._head, cut.num_stages - 1)):
                for param in (p for m in modules for p in m.parameters()):
                    held = set(self._outside_ranks.get(names[id(param)], ())) | {cut.owner(stage)}
                    self._outside_ranks[names[id(param)]] = tuple(sorted(held))
        holders = block_holders(layer_to_block, cut)
        # One process group per set of several pipeline ranks and per pipeline (column of the mesh); every rank
        # creates every group, in the same order (``new_group`` is collective).
        shared = {r for r in [*holders.values(), *self._outside_ranks.values()] if len(r) > 1}
        for ranks in sorted(shared - set(self._groups)):
            for column in range(cut.ranks_per_stage):
                group = dist.new_group(cut.global_ranks(list(ranks), column))
                if cut.column(self.global_rank) == column:
                    self._groups[ranks] = group
        ranks_of = dict(self._outside_ranks)
        # Each block by the model's own name (a pseudo model's shared block: the first layer running it, the name
        # named_parameters gives its tensors).
        names = block_names(holder)
        for block, ranks in holders.items():
            for name, _ in holder.blocks[block].named_parameters():
                ranks_of[f"{names[block]}.{name}"] = ranks
        return ranks_of

    def copies(self, whole: torch.Tensor) -> int:
        """Ranks holding the same local part of ``whole``'s gradient: those within its pipeline (the other pipeline
        slices of the world hold other stages) times the pipeline ranks holding a replica of it."""
        grad = whole.grad
        within = ranks_holding(grad) // self.pipeline_parallel if isinstance(grad, DTensor) else 1
        return within * self._holders_of.get(id(whole), 1)

    def train_step(self, batch: torch.Tensor, uncounted: Any) -> PipelineStepResult:
        """Forward and backward of every micro-batch; replicas' gradients summed, then held aside until
        :meth:`restore_gradients` (Lightning zeroes them before ``backward``); the step's loss and metrics."""
        for param in self.params:  # the last step's gradients (Lightning zeroes them after training_step, too late)
            param.grad = None
        self.runner.train_step(batch)
        for group, replicas in self._replicas:
            sum_over(group, [local_tensor(p.grad) for p in replicas if p.grad is not None])
        with uncounted():  # metrics, not the training layout
            result = self.runner.gather_step()
        self._stashed = [(p, p.grad) for p in self.params]
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

    def forward(self, inputs: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """The model's forward on a pipelined rank (evaluation, a callback's loss), without gradient: the output built
        from the last stage's logits reaches every rank of the pipeline (collective; all read the same batch). The
        token ids come positionally or as ``input_ids`` (a Hugging Face model's call; its other keywords, such as
        ``use_cache``, do not apply to a pipelined evaluation)."""
        if inputs is None:
            inputs = kwargs["input_ids"]
        cut = self.cut
        logits = self.runner.evaluate(self.parts.window(inputs))
        source = cut.global_ranks([cut.owner(cut.num_stages - 1)], cut.column(self.global_rank))[0]
        meta = [(tuple(logits.shape), logits.dtype) if logits is not None else None]
        dist.broadcast_object_list(meta, src=source, group=self.group)
        if logits is None:
            shape, dtype = meta[0]
            logits = torch.empty(shape, dtype=dtype, device=self.runner.device)
        dist.broadcast(logits, src=source, group=self.group)
        return self.parts.output(logits)

    def describe(self) -> str:
        plain = "" if self.wrapped else (
            f"; each stage alone on its rank: plain modules, no FSDP2 (sharding={self.sharding!r} has no data ranks to "
            "shard over)" if self.sharding in ("zero2", "zero3") else "; each stage alone on its rank: plain modules")
        return (f"P2RStrategy pipeline: {self.cut.describe()}, schedule {self.schedule}, {self.micro_batches} "
                f"micro-batches{plain}")


def _with_tied(holder: nn.Module, modules: list[nn.Module]) -> list[nn.Module]:
    """``modules`` and any other module outside the blocks sharing a parameter with them (a tied embedding)."""
    shared = {id(p) for m in modules for p in m.parameters()}
    inside = {id(m) for m in holder.blocks.modules()} | {id(m) for module in modules for m in module.modules()}
    extra = [m for m in holder.modules() if m is not holder and id(m) not in inside
             and any(id(p) in shared for p in m.parameters(recurse=False))]
    return modules + extra


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
