"""Run a rank's pipeline stages with ``torch.distributed.pipelining``'s schedules, and bring a step's losses and
metrics to every rank. ``PipelineStage`` keeps the shapes it learned from its first micro-batch, so a batch of another
shape (an epoch's shorter last batch; evaluation) gets stages and a schedule of its own, kept for the next such batch.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from ...protocols import PipelineParts
from .stage import PipelineStageModule, stage_output_loss


def schedule_class(name: str) -> type:
    """Torch's schedule class for an option name (torch matches "interleaved1f1b" to its "Interleaved1F1B")."""
    return get_schedule_class(name.replace("_", ""))


@dataclass(frozen=True)
class StageEvent:
    """One stage's forward or backward of one micro-batch on this rank (``time.perf_counter`` seconds)."""

    stage: int
    kind: str
    """"forward" or "backward"."""
    micro_batch: int
    start: float
    end: float


class TimedPipelineStage(PipelineStage):
    """A ``PipelineStage`` that records when it computes (its inputs have arrived): the pipeline benchmark's bubble."""

    def __init__(self, *args: Any, events: list[StageEvent], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.events = events

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        self.events.append(StageEvent(self.stage_index, "forward", fwd_chunk_id, start, time.perf_counter()))
        return output

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        output = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        self.events.append(StageEvent(self.stage_index, "backward", bwd_chunk_id, start, time.perf_counter()))
        return output


@dataclass
class PipelineStepResult:
    loss: torch.Tensor
    """The step's loss (mean over micro-batches of each one's total loss), the same on every rank."""
    metrics: dict[str, torch.Tensor]
    """The mean over micro-batches of the model's per-micro-batch metrics, the same on every rank."""


@dataclass(eq=False)
class PipelineRunner:
    """The stages this rank holds (looped: stage indices r, r + p, ...) and the schedules that run them."""

    modules: list[PipelineStageModule]
    stage_indices: list[int]
    num_stages: int
    device: torch.device
    group: dist.ProcessGroup
    schedule_name: str
    micro_batches: int
    parts: PipelineParts
    timeline: list[StageEvent] | None = None
    """Set to a list to record every stage computation of the training steps (and ``step_spans``)."""
    step_spans: list[tuple[float, float]] = field(default_factory=list)
    _schedules: dict[tuple[Any, ...], Any] = field(default_factory=dict, init=False)

    def _schedule(self, training: bool, micro_batches: int, shape: tuple[int, ...]) -> Any:
        """The schedule for batches of ``shape``; tells the stage modules whether it is new (see ``begin``)."""
        key = (training, micro_batches, shape)
        for module in self.modules:
            module.begin(computes_loss=training, micro_batches=micro_batches, infers_shapes=key not in self._schedules)
        if key not in self._schedules:
            timed = {"events": self.timeline} if training and self.timeline is not None else {}
            cls_stage = TimedPipelineStage if timed else PipelineStage
            stages = [cls_stage(module, index, self.num_stages, self.device, group=self.group, **timed)
                      for module, index in zip(self.modules, self.stage_indices)]
            # Evaluation runs forward only: GPipe (one stage per rank) or looped breadth-first (several).
            name = self.schedule_name if training else ("gpipe" if len(stages) == 1 else "looped_bfs")
            cls = schedule_class(name)
            single = issubclass(cls, PipelineScheduleSingle)
            self._schedules[key] = cls(stages[0] if single else stages, micro_batches,
                                       loss_fn=stage_output_loss if training else None)
        return self._schedules[key]

    def train_step(self, batch: torch.Tensor) -> None:
        """Forward and backward of every micro-batch; the gradients, divided by the micro-batches, stay in place."""
        schedule = self._schedule(True, self.micro_batches, tuple(batch.shape))
        if self.timeline is not None:
            dist.barrier(group=self.group)  # the ranks start the step together, so their idle times compare
        start = time.perf_counter()
        # The batch is the targets too: the last stage's forward computes the loss from the window itself.
        schedule.step(tokens=batch, target=batch, return_outputs=False)
        if self.timeline is not None:
            self.step_spans.append((start, time.perf_counter()))

    def evaluate(self, batch: torch.Tensor) -> torch.Tensor | None:
        """The logits of ``batch`` on the rank that holds the last stage (None on the others)."""
        parts = self.micro_batches if batch.shape[0] % self.micro_batches == 0 else 1
        schedule = self._schedule(False, parts, tuple(batch.shape))
        with torch.no_grad():
            return schedule.step(tokens=batch)

    def gather_step(self) -> PipelineStepResult:
        """The step's loss and metrics on every rank, from the micro-batch losses and every stage's router records."""
        local_losses = [float(loss) for module in self.modules for loss in module.step_losses()]
        records: list[dict[str, Any]] = []
        for micro_batch in range(self.micro_batches):
            merged: dict[str, Any] = {}
            for module in self.modules:
                for key, value in self.parts.records(module.step_contexts()[micro_batch]).items():
                    merged.setdefault(key, {}).update(_to_host(value))
            records.append(merged)
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, (local_losses, records), group=self.group)
        losses = next(item[0] for item in gathered if item[0])
        per_micro_batch = []
        for micro_batch in range(self.micro_batches):
            context = self.modules[0].step_contexts()[micro_batch]
            for _, rank_records in gathered:
                self.parts.absorb(context, _from_host(rank_records[micro_batch]))
            per_micro_batch.append(self.parts.metrics(torch.tensor(losses[micro_batch]), context))
        metrics = {key: torch.stack([m[key].float() for m in per_micro_batch]).mean() for key in per_micro_batch[0]}
        return PipelineStepResult(loss=metrics["loss"], metrics=metrics)


@dataclass(frozen=True)
class HostArray:
    """A tensor of a step's records as it crosses the ranks: a NumPy array and the tensor's dtype. ``all_gather_object``
    pickles what it sends, and a torch tensor costs about 80 us to pickle and load again (its storage is rebuilt),
    an array a few: an MoE pipeline's records are a few tensors per micro-batch and MoE layer (a 6-layer, 8-expert
    model at 8 micro-batches: 20 ms of a 180 ms step on a 2-core CPU, 1 ms as arrays)."""

    values: Any
    dtype: torch.dtype


def _to_host(value: Any) -> Any:
    """``value`` (dicts, dataclasses of tensors) with each tensor a :class:`HostArray` of its detached host copy, to
    pickle; dtypes NumPy lacks (bfloat16, float8) travel as float32, which holds them exactly."""
    def packed(tensor: torch.Tensor) -> HostArray:
        tensor = tensor.detach().cpu()
        try:
            return HostArray(tensor.numpy(), tensor.dtype)
        except TypeError:  # no NumPy dtype for it
            return HostArray(tensor.float().numpy(), tensor.dtype)

    return _map_leaves(value, torch.Tensor, packed)


def _from_host(value: Any) -> Any:
    """``value`` as :func:`_to_host` received it, each :class:`HostArray` a host tensor of its dtype again."""
    return _map_leaves(value, HostArray, lambda array: torch.from_numpy(array.values).to(array.dtype))


def _map_leaves(value: Any, leaf_type: type, leaf: Any) -> Any:
    """``value`` with ``leaf`` applied to each ``leaf_type`` inside it, through dicts and dataclasses (rebuilt)."""
    if isinstance(value, leaf_type):
        return leaf(value)
    if isinstance(value, dict):
        return {key: _map_leaves(item, leaf_type, leaf) for key, item in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _map_leaves(getattr(value, f.name), leaf_type, leaf)
                                             for f in dataclasses.fields(value) if f.init})
    return value
