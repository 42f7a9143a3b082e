"""Pipeline stages: which rank holds which stage and layers, which blocks each holds, and the bubble."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .names import divisors


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
