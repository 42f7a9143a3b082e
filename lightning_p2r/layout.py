"""The layout rulebook: what a training layout is, and which layouts can run, without torch.

A *layout* is the set of ``P2RStrategy`` options that decide where every tensor lives and when it moves: ZeRO
sharding, the tensor / expert / pipeline degrees, the micro-batch schedule, recompute, compile and offload. The
strategy's option sections, its engines and the planner all read the rules from here, so the planner cannot price a
layout the strategy would refuse, nor skip one it would run (``tests/unit/test_layout_rules.py`` checks this over
the planner's whole search space). Importing this module loads no torch and nothing else of the package.

The rules come in groups, each checked as soon as its inputs are known:

- the options one by one (when ``P2RStrategy`` is built): :func:`check_options`;
- the options together, and against the number of processes (before any process group exists):
  :func:`check_combinations`, :func:`check_devices`;
- against the model's sizes (before any parameter is placed): :func:`check_model`;
- against the batch (the planner's workload; the strategy checks each batch when it splits it): :func:`check_batch`.

:func:`check_layout` runs all that apply. Messages name the ``P2RStrategy`` keyword and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

Sharding = Literal["none", "zero1", "zero2", "zero3"]
Accumulation = Literal["standard", "layered"]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs"]
PlacementPath = Literal["local", "ddp", "fsdp", "model_parallel", "pipeline"]
FSDPMode = Literal["replicate", "zero2", "zero3"]

SHARDINGS: tuple[str, ...] = get_args(Sharding)
ACCUMULATIONS: tuple[str, ...] = get_args(Accumulation)
PIPELINE_SCHEDULES: tuple[str, ...] = get_args(PipelineSchedule)
BREADTH_FIRST: tuple[str, ...] = ("gpipe", "looped_bfs")
"""Schedules that run every micro-batch through a stage before the next stage (layered accumulation's order)."""
SINGLE_STAGE_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"P2RStrategy.{name} must be True or False, got {value!r}")


def check_degree(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"P2RStrategy.{name} must be a positive integer (1 turns it off), got {value!r}")


# ------------------------------------------------------------------------------------------ which engine, which mode
def uses_fsdp(sharding: str) -> bool:
    return sharding in ("zero2", "zero3")


def placement_path(sharding: str, world_size: int, *, offloading: bool, layered: bool, model_parallel: bool = False,
                   pipelined: bool = False) -> PlacementPath:
    """Which engine runs a job: "local" (one process, the streaming engine), "ddp" (DDP, + ZeroRedundancyOptimizer
    for zero1), "fsdp" (FSDP2 per block), "model_parallel" (tensor / expert parallel on a device mesh, FSDP2 over its
    data ranks) or "pipeline" (stages over pipeline ranks, FSDP2 over each stage's data ranks)."""
    if pipelined:
        return "pipeline"
    if model_parallel:
        return "model_parallel"
    if uses_fsdp(sharding):
        return "fsdp"
    if world_size == 1:
        return "local"
    # DDP's reducer runs inside the model's forward, which the micro-batch executor bypasses, and cannot
    # leave a block's gradient on the host: offload and layered accumulation across ranks run on FSDP2.
    return "fsdp" if offloading or layered else "ddp"


def fsdp_mode_for(sharding: str) -> FSDPMode:
    """How FSDP2 holds the parameters on the FSDP2 paths: "zero3" or "zero2" (sharded over the data ranks), or
    "replicate" for "none" and "zero1": FSDP2's HSDP with shards of one rank, so every rank holds every parameter and
    gradient whole and gradients are all-reduced (zero1 then partitions the optimizer states itself)."""
    return "replicate" if sharding in ("none", "zero1") else sharding  # type: ignore[return-value]


def reshard_after_forward(fsdp_mode: str, *, layered: bool, breadth_first_pipeline: bool) -> bool:
    """Whether an FSDP2 unit gives its gathered parameters back after its forward. Only ZeRO-3 does, and only when the
    next micro-batch does not come straight back to it: layered accumulation and breadth-first pipeline schedules run
    every micro-batch through a unit in a row, so they gather it once and reshard it after the last (explicitly)."""
    return fsdp_mode == "zero3" and not (layered or breadth_first_pipeline)


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


# ------------------------------------------------------------------------------------------ pipeline stages
@dataclass(frozen=True)
class StageCut:
    """Which rank runs which pipeline stage, and which layers a stage holds.

    Rank = pipeline_rank * ranks_per_stage + column: the ranks of one stage (its data and tensor ranks) are adjacent,
    as torchtitan orders its mesh; ranks with the same column in different stages form one pipeline. The model's
    ``num_layers`` layers are cut into ``pipeline_parallel * stages_per_rank`` stages of equal numbers of whole
    layers, looped over the pipeline ranks (Lamy-Poirier 2021, "modular pipeline parallelism"): pipeline rank r holds
    stages r, r + p, r + 2p, ... With one stage per rank this is the usual contiguous split.
    """

    world_size: int
    pipeline_parallel: int
    stages_per_rank: int
    num_layers: int

    def __post_init__(self) -> None:
        p, v = self.pipeline_parallel, self.stages_per_rank
        if self.world_size % p:
            raise ValueError(
                f"P2RStrategy(pipeline_parallel={p}) must divide the number of processes ({self.world_size}): use "
                f"pipeline_parallel in {divisors(self.world_size)} or change the devices")
        if self.num_layers % (p * v):
            raise ValueError(
                f"the model's {self.num_layers} layers cannot be cut into pipeline_parallel * stages_per_rank = {p} * "
                f"{v} = {p * v} stages of whole, equal numbers of layers: choose pipeline_parallel * stages_per_rank "
                f"among {divisors(self.num_layers)}")

    @property
    def num_stages(self) -> int:
        return self.pipeline_parallel * self.stages_per_rank

    @property
    def ranks_per_stage(self) -> int:
        """Ranks of each stage (data and tensor parallel)."""
        return self.world_size // self.pipeline_parallel

    @property
    def layers_per_stage(self) -> int:
        return self.num_layers // self.num_stages

    def pipeline_rank(self, rank: int) -> int:
        return rank // self.ranks_per_stage

    def column(self, rank: int) -> int:
        """Which pipeline ``rank`` belongs to: its place among its stage's ranks."""
        return rank % self.ranks_per_stage

    def stage_layers(self, stage: int) -> range:
        size = self.layers_per_stage
        return range(stage * size, (stage + 1) * size)

    def stages_of(self, pipeline_rank: int) -> list[int]:
        """The stages one pipeline rank holds, looped: r, r + p, r + 2p, ..."""
        return [pipeline_rank + i * self.pipeline_parallel for i in range(self.stages_per_rank)]

    def owner(self, stage: int) -> int:
        """The pipeline rank that holds ``stage``."""
        return stage % self.pipeline_parallel

    def global_ranks(self, pipeline_ranks: list[int], column: int) -> list[int]:
        """The global ranks of ``pipeline_ranks`` in pipeline ``column``."""
        return [r * self.ranks_per_stage + column for r in pipeline_ranks]

    def describe(self) -> str:
        return (f"{self.world_size} ranks = pipeline {self.pipeline_parallel} x {self.ranks_per_stage} per stage; "
                f"{self.num_stages} stages of {self.layers_per_stage} layers, {self.stages_per_rank} per rank")


def block_holders(layer_to_block: Sequence[int], cut: StageCut) -> dict[int, tuple[int, ...]]:
    """The pipeline ranks that hold each block: those whose stages run a layer of it.

    A block several layers share (M6-10T's pseudo model) is used by stages on several ranks, and each holds a
    replica; its gradient is the sum of theirs, as Megatron-LM all-reduces the embedding tied between its first and
    last stages. After delinking every block belongs to one layer, hence to one rank.
    """
    holders: dict[int, set[int]] = {}
    for stage in range(cut.num_stages):
        for layer in cut.stage_layers(stage):
            holders.setdefault(layer_to_block[layer], set()).add(cut.owner(stage))
    return {block: tuple(sorted(ranks)) for block, ranks in sorted(holders.items())}


def check_local_sharing(layer_to_block: Sequence[int], cut: StageCut) -> None:
    """A block run by two stages of the same rank would be inside two FSDP2 roots: refused, with the fix."""
    for rank in range(cut.pipeline_parallel):
        seen: dict[int, int] = {}
        for stage in cut.stages_of(rank):
            for block in {layer_to_block[layer] for layer in cut.stage_layers(stage)}:
                if seen.setdefault(block, stage) != stage:
                    raise ValueError(
                        f"block {block} is shared by two stages of one pipeline rank: layers in stages {seen[block]} "
                        f"and {stage}, which pipeline rank {rank} both holds (stages_per_rank={cut.stages_per_rank}): "
                        "a shared (pseudo) model runs with stages_per_rank=1; loop the stages after delinking it (or "
                        "delink it further first)")


def bubble_fraction(pipeline_parallel: int, stages_per_rank: int, micro_batches: int) -> float:
    """The analytic idle share of a step, (p - 1) / (v * m + p - 1) (Narayanan et al. 2021 for interleaving,
    Lamy-Poirier 2021 for looping): each rank idles for p - 1 stage-times while filling and draining, out of
    v * m stage-times of work, with forward and backward stage costs in a fixed ratio."""
    p, v, m = pipeline_parallel, stages_per_rank, micro_batches
    return (p - 1) / (v * m + p - 1)


# ------------------------------------------------------------------------------------------ offload
def spread(count: int, num_blocks: int) -> tuple[int, ...]:
    """``count`` block indices spread evenly, the last block always among them when count > 0 (the offload plan).

    With at most half the blocks offloaded, every offloaded block follows a resident one, whose compute hides
    the offloaded block's copy; and the first block stays resident so the forward pass starts without waiting.
    """
    if count <= 0:
        return ()
    return tuple(sorted({int((i + 1) * num_blocks / count) - 1 for i in range(count)}))


def offload_count(fraction: float, num_blocks: int) -> int:
    """How many of ``num_blocks`` an ``offload_fraction`` offloads: half a block rounds up."""
    return math.floor(fraction * num_blocks + 0.5)


def parse_bytes(value: int | str, total: int | None = None, name: str = "device_memory_budget") -> int:
    """``12e9``, ``"12GB"``, ``"512MiB"`` or ``"80%"`` (of ``total``) -> bytes; errors name the option ``name``."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be bytes or a size string, got {value!r}")
    if isinstance(value, (int, float)):
        return int(value)
    text = value.strip().lower().replace(" ", "")
    if text.endswith("%"):
        if total is None:
            raise ValueError(f"{name} as a percentage needs the device's total memory")
        share = float(text[:-1])
        if not 0 < share <= 100:
            raise ValueError(f"{name} percentage must be in (0, 100], got {value!r}")
        return int(total * share / 100)
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)([kmgt]i?b|b)?", text)
    if not match:
        raise ValueError(f"{name} {value!r} is not a size: use bytes, '12GB', '512MiB' or '80%'")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def check_offload_options(*, offload_fraction: float | None, offload_blocks: Sequence[int] | None,
                          device_memory_budget: int | str | None, offload_states: Sequence[str] | None, prefetch: int,
                          pin_memory: object, overlap_host_step: object) -> set[str]:
    """Validate ``P2RStrategy``'s offload options; returns the offload states to use (all three by default)."""
    given = [n for n, v in (("offload_fraction", offload_fraction), ("offload_blocks", offload_blocks),
                            ("device_memory_budget", device_memory_budget)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"P2RStrategy takes one of offload_fraction, offload_blocks, device_memory_budget; "
                         f"got {given}")
    if offload_fraction is not None and not 0.0 <= offload_fraction <= 1.0:
        raise ValueError(f"P2RStrategy.offload_fraction must be in [0, 1], got {offload_fraction}")
    if offload_blocks is not None and any(not isinstance(i, int) or i < 0 for i in offload_blocks):
        raise ValueError(f"P2RStrategy.offload_blocks must be block indices >= 0, got {offload_blocks}")
    if device_memory_budget is not None and not isinstance(device_memory_budget, str):
        if device_memory_budget <= 0:
            raise ValueError(f"P2RStrategy.device_memory_budget must be > 0, got {device_memory_budget}")
    if isinstance(device_memory_budget, str):
        parse_bytes(device_memory_budget, total=1)  # syntax check now; the percentage base comes at setup
    states = set(offload_states or ["params", "grads", "optimizer"])
    unknown = states - {"params", "grads", "optimizer"}
    if unknown or not {"grads", "optimizer"} <= states:
        raise ValueError(
            "P2RStrategy.offload_states must include 'grads' and 'optimizer' (an offloaded block's optimizer "
            f"step runs on the host, from host gradients) and may add 'params'; got {sorted(states)}"
        )
    if prefetch < 0:
        raise ValueError(f"P2RStrategy.prefetch must be >= 0, got {prefetch}")
    if pin_memory not in (True, False, "auto"):
        raise ValueError(f"P2RStrategy.pin_memory must be True, False or 'auto', got {pin_memory!r}")
    if overlap_host_step not in (True, False, "auto"):
        raise ValueError(f"P2RStrategy.overlap_host_step must be True, False or 'auto', got {overlap_host_step!r}")
    return states


@dataclass(frozen=True)
class BlockFootprint:
    """Bytes one block needs while it is resident and trained."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int

    @property
    def total(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def streaming(self) -> int:
        """What an offloaded block occupies on the device while it runs: parameters and, in backward, gradients."""
        return self.param_bytes + self.grad_bytes


@dataclass(frozen=True)
class OffloadPlan:
    num_blocks: int
    offloaded: tuple[int, ...]

    @property
    def resident(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_blocks) if i not in self.offloaded)


def plan_offload(
    num_blocks: int,
    *,
    offload_fraction: float | None = None,
    offload_blocks: list[int] | None = None,
    budget_bytes: int | None = None,
    footprints: list[BlockFootprint] | None = None,
    other_bytes: int = 0,
    activation_bytes: int = 0,
    prefetch: int = 1,
) -> OffloadPlan:
    """Choose the offloaded blocks from exactly one of fraction, explicit list or budget."""
    given = [name for name, value in (("offload_fraction", offload_fraction), ("offload_blocks", offload_blocks),
                                      ("device_memory_budget", budget_bytes)) if value is not None]
    if len(given) > 1:
        raise ValueError(f"give one of offload_fraction, offload_blocks, device_memory_budget; got {given}")
    if offload_blocks is not None:
        bad = [i for i in offload_blocks if not 0 <= i < num_blocks]
        if bad:
            raise ValueError(f"offload_blocks {bad} are not block indices of a model with {num_blocks} blocks")
        return OffloadPlan(num_blocks, tuple(sorted(set(offload_blocks))))
    if budget_bytes is not None:
        if footprints is None:
            raise ValueError("a device_memory_budget plan needs the blocks' footprints")
        return plan_for_budget(footprints, budget_bytes, other_bytes, activation_bytes, prefetch)
    fraction = offload_fraction or 0.0
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"offload_fraction must be in [0, 1], got {fraction}")
    # Half rounds up (Python's round() would send 0.5 of one block to 0 and 0.5 of three blocks to 2).
    return OffloadPlan(num_blocks, spread(offload_count(fraction, num_blocks), num_blocks))


def device_bytes_needed(footprints: list[BlockFootprint], offloaded: tuple[int, ...], other_bytes: int,
                        activation_bytes: int, prefetch: int) -> int:
    """Model-state bytes on the device under a plan (plus the activation allowance)."""
    resident = sum(f.total for i, f in enumerate(footprints) if i not in offloaded)
    largest_streamed = max((footprints[i].streaming for i in offloaded), default=0)
    streaming = min(prefetch + 1, len(offloaded)) * largest_streamed
    return other_bytes + activation_bytes + resident + streaming


def plan_for_budget(footprints: list[BlockFootprint], budget: int, other_bytes: int, activation_bytes: int,
                     prefetch: int) -> OffloadPlan:
    num_blocks = len(footprints)
    # Try the most resident blocks first; for each count, offload an evenly spread set.
    for count in range(num_blocks + 1):
        offloaded = spread(count, num_blocks)
        if device_bytes_needed(footprints, offloaded, other_bytes, activation_bytes, prefetch) <= budget:
            return OffloadPlan(num_blocks, offloaded)
    minimum = device_bytes_needed(footprints, tuple(range(num_blocks)), other_bytes, activation_bytes, prefetch)
    raise ValueError(
        f"device_memory_budget of {budget:,} bytes is smaller than the least this model needs with every block "
        f"offloaded: {minimum:,} bytes (non-block states {other_bytes:,}, activation allowance "
        f"{activation_bytes:,}, streaming buffers for {min(prefetch + 1, num_blocks)} block(s)). Raise the "
        "budget, lower prefetch or the activation allowance, or shard the model"
    )


def check_fsdp_offload_states(offload_states: set[str]) -> None:
    """On FSDP2 an offloaded block keeps its parameter shard in host memory too (``CPUOffloadPolicy`` moves
    parameters, gradients and optimizer states together), so "params" cannot be left out."""
    if "params" not in offload_states:
        raise ValueError(
            "P2RStrategy: with sharding zero2/zero3, or offloading across processes, an offloaded block keeps its "
            "parameter shard in host memory (FSDP2's CPUOffloadPolicy); offload_states must include 'params'")


# ------------------------------------------------------------------------------------------ the layout
@dataclass(frozen=True)
class Layout:
    """One way to run a model: the ``P2RStrategy`` keywords that decide where tensors live and when they move.

    Mirrors the strategy's flat keywords, so a planned layout prints as the recipe fragment that runs it
    (:meth:`strategy_options`), and the strategy's options read back as one (``strategy.layout``).
    """

    sharding: str = "none"
    tensor_parallel: int = 1
    expert_parallel: int = 1
    pipeline_parallel: int = 1
    pipeline_schedule: str = "1f1b"
    stages_per_rank: int = 1
    sequence_parallel: bool = False
    accumulation: str = "standard"
    micro_batches: int = 1
    recompute: bool = False
    compile: bool = False
    offload_fraction: float = 0.0
    offload_blocks: tuple[int, ...] | None = None
    """Explicit block indices (of a rank's blocks) to offload instead of ``offload_fraction``."""
    reduce_every_micro_batch: bool = False

    @property
    def pipelined(self) -> bool:
        return self.pipeline_parallel > 1

    @property
    def model_parallel(self) -> bool:
        return self.tensor_parallel > 1 or self.expert_parallel > 1

    @property
    def offloading(self) -> bool:
        return bool(self.offload_fraction or self.offload_blocks)

    def data_parallel(self, devices: int) -> int:
        return devices // (self.tensor_parallel * self.pipeline_parallel)

    def dims(self, devices: int) -> ParallelDims:
        return ParallelDims(devices, self.tensor_parallel, self.expert_parallel, self.pipeline_parallel)

    def path(self, devices: int) -> PlacementPath:
        return placement_path(self.sharding, devices, offloading=self.offloading,
                              layered=self.accumulation == "layered", model_parallel=self.model_parallel,
                              pipelined=self.pipelined)

    @property
    def trainer_accumulation(self) -> int:
        """Micro-batches Lightning accumulates (``Trainer(accumulate_grad_batches=...)``): standard accumulation
        without a pipeline is the Trainer's, not the strategy's."""
        plain = self.pipeline_parallel == 1 and self.accumulation == "standard"
        return self.micro_batches if plain else 1

    def strategy_options(self) -> dict[str, Any]:
        """The ``P2RStrategy`` keywords of this layout that differ from the defaults (see ``trainer_accumulation``
        for the micro-batches of standard accumulation)."""
        defaults = Layout()
        options = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                   if getattr(self, f.name) != getattr(defaults, f.name)}
        if "offload_fraction" in options:
            options["offload_fraction"] = round(self.offload_fraction, 4)
        if "offload_blocks" in options:
            options["offload_blocks"] = list(self.offload_blocks)
        if self.trainer_accumulation > 1:
            options.pop("micro_batches")
        elif self.pipeline_parallel > 1:
            options["micro_batches"] = self.micro_batches
        return options

    def describe(self) -> str:
        parts = [self.sharding]
        for label, value in (("tp", self.tensor_parallel), ("ep", self.expert_parallel),
                             ("pp", self.pipeline_parallel)):
            if value > 1:
                parts.append(f"{label}{value}")
        if self.pipeline_parallel > 1:
            parts.append(self.pipeline_schedule + (f"/v{self.stages_per_rank}" if self.stages_per_rank > 1 else ""))
        if self.sequence_parallel:
            parts.append("sp")
        if self.micro_batches > 1:
            parts.append(f"m{self.micro_batches}")
        if self.accumulation == "layered":
            parts.append("layered")
        if self.recompute:
            parts.append("recompute")
        if self.compile:
            parts.append("compile")
        if self.offload_fraction:
            parts.append(f"offload{self.offload_fraction:g}")
        return " ".join(parts)


@dataclass(frozen=True)
class ModelShape:
    """The model sizes the rules read; None: unknown (a user's model), that rule is not checked."""

    num_layers: int
    layer_to_block: tuple[int, ...] | None = None
    """Which block each layer runs (sharing: several layers, one block)."""
    num_heads: int | None = None
    vocab_size: int | None = None
    hidden_dim: int | None = None
    """The feed-forward (and expert) hidden size tensor parallelism splits."""
    num_experts: int = 0
    moe: bool = False
    """Whether the model has MoE layers (expert parallelism splits their experts)."""
    max_seq_len: int | None = None
    rotary_positions: bool | None = None
    """Whether positions enter per head (rotary), which sequence parallelism needs."""

    @classmethod
    def of(cls, config: Any) -> ModelShape:
        """From an ``M6Config`` (or anything with its fields)."""
        return cls(num_layers=config.num_layers, layer_to_block=tuple(config.layer_to_block),
                   num_heads=config.num_heads, vocab_size=config.vocab_size, hidden_dim=config.hidden_dim,
                   num_experts=config.num_experts, moe=bool(config.moe_layers), max_seq_len=config.max_seq_len,
                   rotary_positions=config.position_embedding == "rotary")


def check_parallel_options(layout: Layout) -> None:
    """The parallel degrees, the schedule against the stages per rank, sequence parallelism's prerequisite."""
    check_bool("sequence_parallel", layout.sequence_parallel)
    if layout.sequence_parallel and layout.tensor_parallel == 1:
        raise ValueError("P2RStrategy(sequence_parallel=True) splits activations over the tensor-parallel ranks: "
                         "set tensor_parallel > 1 as well")
    for name in ("tensor_parallel", "expert_parallel", "pipeline_parallel", "stages_per_rank"):
        check_degree(name, getattr(layout, name))
    schedule, v = layout.pipeline_schedule, layout.stages_per_rank
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"P2RStrategy.pipeline_schedule must be one of {PIPELINE_SCHEDULES}, got {schedule!r}")
    if v > 1 and schedule in SINGLE_STAGE_SCHEDULES:
        raise ValueError(
            f"P2RStrategy(pipeline_schedule={schedule!r}) runs one stage per rank, got stages_per_rank={v}: use "
            "pipeline_schedule='looped_bfs' or 'interleaved_1f1b' for looped stages")
    if v == 1 and schedule == "interleaved_1f1b":
        raise ValueError("P2RStrategy(pipeline_schedule='interleaved_1f1b') interleaves several stages per rank: set "
                         "stages_per_rank > 1, or use pipeline_schedule='1f1b' for one stage per rank")
    if v > 1 and layout.pipeline_parallel == 1:
        raise ValueError(f"P2RStrategy(stages_per_rank={v}) loops stages over pipeline ranks: set "
                         "pipeline_parallel > 1 as well")


def check_accumulation_options(accumulation: str, micro_batches: int, recompute: bool, *,
                               pipelined: bool = False) -> None:
    """The micro-batch schedule. ``pipelined``: pipeline parallelism is on, ``micro_batches`` counts the pipeline's
    micro-batches (:func:`check_micro_batches` checks them against its degree and schedule)."""
    if accumulation not in ACCUMULATIONS:
        raise ValueError(f"P2RStrategy.accumulation must be 'standard' or 'layered', got {accumulation!r}")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"P2RStrategy.micro_batches must be an integer >= 1, got {micro_batches!r}")
    if recompute and accumulation != "layered" and not pipelined:
        raise ValueError("P2RStrategy.recompute applies to accumulation='layered' only")
    if micro_batches > 1 and accumulation != "layered" and not pipelined:
        raise ValueError("P2RStrategy.micro_batches applies to accumulation='layered' (or to pipeline_parallel > 1); "
                         "for standard (depth-first) accumulation use Trainer(accumulate_grad_batches=...)")
    check_bool("recompute", recompute)


def check_micro_batches(schedule: str, micro_batches: int, pipeline_parallel: int) -> None:
    """Enough micro-batches to fill the pipeline (and, interleaved, whole rounds of them)."""
    if micro_batches < pipeline_parallel:
        raise ValueError(
            f"P2RStrategy(micro_batches={micro_batches}) is fewer than pipeline_parallel={pipeline_parallel}: the "
            f"pipeline never fills and the ranks mostly wait. Use micro_batches >= {pipeline_parallel} (a few times "
            "more makes the bubble small)")
    if schedule == "interleaved_1f1b" and micro_batches % pipeline_parallel:
        raise ValueError(
            f"P2RStrategy(pipeline_schedule='interleaved_1f1b') runs micro-batches in rounds of pipeline_parallel="
            f"{pipeline_parallel}: micro_batches={micro_batches} must be a multiple of it")


def check_options(layout: Layout) -> None:
    """Each option on its own, and the pipeline's micro-batches (the strategy checks these when it is built)."""
    if layout.sharding not in SHARDINGS:
        raise ValueError(f"P2RStrategy.sharding must be one of {SHARDINGS}, got {layout.sharding!r}")
    check_parallel_options(layout)
    # A layout's micro-batches under plain standard accumulation are the Trainer's ``accumulate_grad_batches``
    # (``Layout.trainer_accumulation``), which the strategy's ``micro_batches`` keyword refuses to stand for.
    strategy_micro_batches = layout.micro_batches if layout.trainer_accumulation == 1 else 1
    check_accumulation_options(layout.accumulation, strategy_micro_batches, layout.recompute,
                               pipelined=layout.pipelined)
    for name in ("compile", "reduce_every_micro_batch"):
        check_bool(name, getattr(layout, name))
    if not 0.0 <= layout.offload_fraction <= 1.0:
        raise ValueError(f"P2RStrategy.offload_fraction must be in [0, 1], got {layout.offload_fraction}")
    if not layout.pipelined:
        return
    check_micro_batches(layout.pipeline_schedule, layout.micro_batches, layout.pipeline_parallel)


def check_combinations(layout: Layout) -> None:
    """Options that each are valid but do not go together (the strategy checks them when it chooses its engine,
    before any process group exists)."""
    if not layout.pipelined:
        return
    if layout.sharding == "zero1" and layout.model_parallel:
        raise ValueError(
            "P2RStrategy(sharding='zero1') with tensor_parallel or expert_parallel inside pipeline stages: ZeRO-1's "
            "partitioned optimizer does not take parameters split over a device mesh there; use sharding='zero2' or "
            "'zero3'")
    if layout.accumulation == "layered" and layout.pipeline_schedule not in BREADTH_FIRST:
        raise ValueError(
            f"P2RStrategy(accumulation='layered', pipeline_schedule={layout.pipeline_schedule!r}): across pipeline "
            "stages, layered accumulation is the breadth-first schedule itself; use pipeline_schedule='looped_bfs' "
            "(or 'gpipe' with one stage per rank)")
    if layout.reduce_every_micro_batch:
        raise ValueError("P2RStrategy(reduce_every_micro_batch=True) does not apply with pipeline_parallel > 1: "
                         "the schedule reduces each stage's gradients once, after its last micro-batch")


def check_devices(layout: Layout, devices: int, *, accelerator: bool = True) -> ParallelDims:
    """The degrees against the number of processes; ``accelerator``: the processes drive accelerators (the
    planner's clusters do; a CPU-only run does not)."""
    dims = layout.dims(devices)
    if (layout.sharding == "zero1" and layout.offloading and accelerator
            and layout.path(devices) not in ("local", "ddp")):
        raise ValueError(
            "P2RStrategy(sharding='zero1') with offloaded blocks across processes on an accelerator: "
            "ZeroRedundancyOptimizer broadcasts its partitions through the accelerator's process group, which "
            "cannot send host-resident tensors; use sharding='zero2' (optimizer states and gradients sharded)")
    return dims


def check_model(layout: Layout, model: ModelShape, devices: int | None = None) -> None:
    """Refuse a model these degrees cannot split, naming the numbers."""
    tp, ep = layout.tensor_parallel, layout.expert_parallel
    if model.num_heads is not None and model.num_heads % tp:
        raise ValueError(f"P2RStrategy(tensor_parallel={tp}) splits attention by heads: M6Config.num_heads="
                         f"{model.num_heads} must be divisible by it (use tensor_parallel in "
                         f"{divisors(model.num_heads)})")
    if model.vocab_size is not None and model.vocab_size % tp:
        raise ValueError(f"P2RStrategy(tensor_parallel={tp}) splits the embedding and output by vocabulary: "
                         f"M6Config.vocab_size={model.vocab_size} must be divisible by it")
    if model.hidden_dim is not None and model.hidden_dim % tp:
        raise ValueError(f"P2RStrategy(tensor_parallel={tp}) splits the feed-forward layers and experts by hidden "
                         f"units: M6Config.hidden_dim={model.hidden_dim} must be divisible by it (use "
                         f"tensor_parallel in {divisors(model.hidden_dim)})")
    if ep > 1 and not model.moe:
        raise ValueError(f"P2RStrategy(expert_parallel={ep}) needs MoE layers, and the model has none "
                         "(M6Config.moe_layers is empty)")
    if ep > 1 and model.num_experts % ep:
        raise ValueError(f"P2RStrategy(expert_parallel={ep}) gives each expert-parallel rank num_experts / "
                         f"expert_parallel experts: M6Config.num_experts={model.num_experts} must be divisible by it "
                         f"(use expert_parallel in {divisors(model.num_experts)})")
    if layout.sequence_parallel and model.rotary_positions is False:
        raise ValueError("P2RStrategy(sequence_parallel=True) needs M6Config.position_embedding='rotary': learned "
                         "positions are added to the whole sequence, which no rank holds")
    if layout.sequence_parallel and model.max_seq_len is not None and model.max_seq_len % tp:
        raise ValueError(f"P2RStrategy(sequence_parallel=True) splits sequences over tensor_parallel={tp} ranks: "
                         f"M6Config.max_seq_len={model.max_seq_len} must be divisible by it (and so must every "
                         "batch's sequence length)")
    if layout.pipelined:
        cut = StageCut(devices or layout.pipeline_parallel, layout.pipeline_parallel, layout.stages_per_rank,
                       model.num_layers)
        if model.layer_to_block is not None:
            check_local_sharing(model.layer_to_block, cut)


def check_batch(layout: Layout, sequences: int) -> None:
    """``sequences`` per data-parallel rank per optimizer step against the micro-batches that split them."""
    if sequences % layout.micro_batches:
        raise ValueError(f"P2RStrategy(micro_batches={layout.micro_batches}) must divide the {sequences} sequences "
                         "per data-parallel rank")


def check_layout(layout: Layout, devices: int | None = None, model: ModelShape | None = None,
                 sequences: int | None = None, *, accelerator: bool = True) -> None:
    """Every rule that applies to what is known: the options, and the devices, the model's sizes and the sequences
    per data-parallel rank when given. Raises ValueError naming the first reason the layout cannot run."""
    check_options(layout)
    check_combinations(layout)
    if devices is not None:
        check_devices(layout, devices, accelerator=accelerator)
    if model is not None:
        check_model(layout, model, devices)
    if sequences is not None:
        check_batch(layout, sequences)
