"""How the ranks split: which engine places a layout, how FSDP2 holds it, and the mesh arithmetic."""

from __future__ import annotations

from dataclasses import dataclass

from .names import FSDPMode, PlacementPath, divisors


# ------------------------------------------------------------------------------------------ which engine, which mode
def uses_fsdp(sharding: str) -> bool:
    return sharding in ("zero2", "zero3")


def placement_path(sharding: str, world_size: int, *, offloading: bool, layered: bool, model_parallel: bool = False,
                   pipelined: bool = False) -> PlacementPath:
    """Which steps of the one placement a job takes: "local" (one process and nothing sharded: the block streamer),
    "ddp" (replicated across processes by DDP's reducer: "none"/"zero1" with nothing offloaded and standard
    accumulation), "fsdp" (FSDP2 per block: sharded, or its replicate layout), "model_parallel" (tensor / expert
    parallel on a device mesh, FSDP2 over its data ranks) or "pipeline" (stages over pipeline ranks, FSDP2 over each
    stage's data ranks)."""
    if pipelined:
        return "pipeline"
    if model_parallel:
        return "model_parallel"
    if uses_fsdp(sharding):
        return "fsdp"
    if world_size == 1:
        return "local"
    # DDP's reducer runs inside the model's forward, which the micro-batch executor bypasses, and cannot leave a
    # block's gradient on the host: offload and layered accumulation across ranks take FSDP2's replicate layout.
    # Otherwise the reducer: its bucketed all-reduces overlap the backward (FSDP2's replicate layout measured
    # 1.2-1.45x its step time, docs/benchmarks.md).
    return "fsdp" if offloading or layered else "ddp"


def fsdp_mode_for(sharding: str) -> FSDPMode:
    """How FSDP2 holds the parameters on the FSDP2 paths: "zero3" or "zero2" (sharded over the data ranks), or
    "replicate" for "none" and "zero1": FSDP2's HSDP with shards of one rank, so every rank holds every parameter and
    gradient whole and gradients are all-reduced (zero1 then partitions the optimizer states itself)."""
    return "replicate" if sharding in ("none", "zero1") else sharding  # type: ignore[return-value]


@dataclass(frozen=True)
class Resharding:
    """When the FSDP2 units of the blocks give their gathered parameters back after a forward: the one reshard rule
    of every FSDP2 path (placement, layered accumulation's events, pipeline stages) and of the planner's gathers.

    Only ZeRO-3 reshards. Layered accumulation and breadth-first pipeline schedules run every micro-batch through a
    unit in a row, so they gather it once and reshard it after the last micro-batch; otherwise each unit reshards
    after each of its forwards. A block's units all follow one rule: its experts' unit (expert parallelism) too.
    """

    after_each_forward: bool
    """FSDP2's own ``reshard_after_forward`` for every unit of the blocks (a part's root never reshards)."""
    after_last_micro_batch: bool
    """The schedule reshards every unit of a block after the last micro-batch's forward through it."""


def resharding(fsdp_mode: str, *, consecutive_micro_batches: bool) -> Resharding:
    """``consecutive_micro_batches``: the schedule runs every micro-batch through a unit in a row (layered
    accumulation, breadth-first pipeline schedules)."""
    zero3 = fsdp_mode == "zero3"
    return Resharding(zero3 and not consecutive_micro_batches, zero3 and consecutive_micro_batches)


# ------------------------------------------------------------------------------------------ degrees and meshes
@dataclass(frozen=True)
class ParallelDims:
    """How ``world_size`` ranks split into pipeline, data (expert data x expert) and tensor parallel groups.

    Ranks are laid out ``(pipeline, data, tensor)``: tensor-parallel ranks adjacent (on a node they share the fastest
    links, as Megatron-LM places them), each pipeline stage's ranks adjacent. Expert parallelism borrows ranks from
    the data dimension (DeepSpeed-MoE, torchtitan): the ``dp`` data ranks are read as ``(dp / ep, ep)``.
    """

    world_size: int
    tensor_parallel: int = 1
    expert_parallel: int = 1
    pipeline_parallel: int = 1
    """Pipeline ranks (the outermost dimension: each stage has world / pipeline_parallel ranks)."""

    def __post_init__(self) -> None:
        for name in ("world_size", "tensor_parallel", "expert_parallel", "pipeline_parallel"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"P2RStrategy.{name} must be a positive integer, got {value!r}")
        if self.world_size % self.pipeline_parallel:
            raise ValueError(
                f"P2RStrategy(pipeline_parallel={self.pipeline_parallel}) must divide the number of processes "
                f"({self.world_size}): use pipeline_parallel in {divisors(self.world_size)} or change the devices")
        stage_ranks = self.world_size // self.pipeline_parallel
        if stage_ranks % self.tensor_parallel:
            where = (f"processes / pipeline_parallel = {stage_ranks}" if self.pipeline_parallel > 1 else
                     f"the number of processes ({self.world_size})")
            raise ValueError(
                f"P2RStrategy(tensor_parallel={self.tensor_parallel}) must divide {where}: use tensor_parallel in "
                f"{divisors(stage_ranks)} or change the devices")
        if self.data_parallel % self.expert_parallel:
            over = ("tensor_parallel" if self.pipeline_parallel == 1 else "(tensor_parallel x pipeline_parallel)")
            raise ValueError(
                f"P2RStrategy(expert_parallel={self.expert_parallel}) borrows ranks from the data-parallel dimension, "
                f"so it must divide processes / {over} = {self.world_size} / "
                f"{self.tensor_parallel * self.pipeline_parallel} = {self.data_parallel}: use expert_parallel in "
                f"{divisors(self.data_parallel)}")

    @property
    def data_parallel(self) -> int:
        """Ranks that see different batches (expert-parallel ranks included)."""
        return self.world_size // (self.tensor_parallel * self.pipeline_parallel)

    @property
    def expert_data_parallel(self) -> int:
        """Ranks that hold the same experts (and see different batches)."""
        return self.data_parallel // self.expert_parallel

    @property
    def model_parallel(self) -> bool:
        return self.tensor_parallel > 1 or self.expert_parallel > 1

    def data_rank(self, rank: int) -> int:
        """The data-parallel index of global ``rank`` (which share of the batch it reads)."""
        return rank // self.tensor_parallel % self.data_parallel

    def describe(self) -> str:
        """One line for the setup log."""
        pipeline = f"pipeline {self.pipeline_parallel} x " if self.pipeline_parallel > 1 else ""
        return (f"mesh: {self.world_size} ranks = {pipeline}data {self.data_parallel} (of which expert "
                f"{self.expert_parallel} x expert-data {self.expert_data_parallel}) x tensor {self.tensor_parallel}")
