"""What one rank holds and runs under a layout: its layers and blocks, the parameters outside the blocks it holds,
the elements of each parameter it stores, and which blocks it offloads. Ranks differ only by pipeline position
(the first stage holds the embedding, the last the final norm and the head, and a tied head's embedding too), so a
layout is priced per pipeline rank and the slowest / fullest rank decides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..layout import offload_count, spread
from .cluster import Cluster
from .layout import Layout, Workload
from .model import ParamSpec, PricedModel, all_params


@dataclass(frozen=True)
class RankShare:
    """One rank's part of the model and of the batch."""

    pipeline_rank: int
    layers: tuple[int, ...]
    """The layers this rank runs (its stages', in model order)."""
    first_stage: bool
    last_stage: bool
    blocks: tuple[int, ...]
    """The unique blocks those layers use."""
    offloaded: tuple[int, ...]
    """Blocks (of ``blocks``) kept in host memory."""
    data_parallel: int
    expert_data_parallel: int
    sequences: int
    """Sequences this rank's data shard trains per step."""
    micro_sequences: int
    """Sequences per micro-batch."""


def rank_share(config: PricedModel, layout: Layout, cluster: Cluster, workload: Workload,
               pipeline_rank: int = 0) -> RankShare:
    pp, v = layout.pipeline_parallel, layout.stages_per_rank
    if not 0 <= pipeline_rank < pp:
        raise ValueError(f"pipeline_rank must be in [0, {pp}), got {pipeline_rank}")
    layers = rank_layers(config, layout, pipeline_rank)
    mapping = config.layer_to_block
    blocks = tuple(sorted({mapping[layer] for layer in layers}))
    dp = layout.data_parallel(cluster.devices)
    # The offload plan's own rule (half a block rounds up; the last block always among them).
    if layout.offload_blocks is None:
        offloaded = tuple(blocks[i] for i in spread(offload_count(layout.offload_fraction, len(blocks)), len(blocks)))
    else:  # named by their index in the model, as the strategy reads them
        offloaded = tuple(i for i in sorted(set(layout.offload_blocks)) if i in blocks)
    sequences = workload.global_batch // dp
    return RankShare(pipeline_rank, layers, pipeline_rank == 0, pipeline_rank == (pp * v - 1) % pp, blocks,
                     offloaded, dp, dp // layout.expert_parallel, sequences, sequences // layout.micro_batches)


def split_shape(param: ParamSpec, layout: Layout) -> tuple[int, ...]:
    """The shape of this rank's tensor-/expert-parallel part of ``param`` (before data-parallel sharding)."""
    shape = list(param.shape)
    if param.tensor_dim is not None and layout.tensor_parallel > 1:
        shape[param.tensor_dim] //= layout.tensor_parallel
    if param.owner == "expert" and layout.expert_parallel > 1:
        shape[0] //= layout.expert_parallel
    return tuple(shape)


def data_group_size(param: ParamSpec, share: RankShare) -> int:
    """The data ranks that hold the same part of ``param`` (FSDP2 shards it over them)."""
    return share.expert_data_parallel if param.owner == "expert" else share.data_parallel


def sharded_numel(shape: tuple[int, ...], ranks: int) -> int:
    """Elements of one rank's FSDP2 shard: dim 0 padded to a multiple of ``ranks`` and cut evenly."""
    if not shape:
        return 1
    return math.ceil(shape[0] / ranks) * math.prod(shape[1:])


def padded_numel(shape: tuple[int, ...], ranks: int) -> int:
    """Elements FSDP2 gathers or reduce-scatters for a parameter of ``shape`` over ``ranks``."""
    return sharded_numel(shape, ranks) * ranks


def held_params(config: PricedModel, share: RankShare) -> list[ParamSpec]:
    """The parameters this rank holds: its blocks', and those of the end stages it runs."""
    blocks = set(share.blocks)
    return [p for p in all_params(config) if (p.block in blocks if p.block is not None else holds_root(config, share,
                                                                                                         p.name))]


def holds_root(config: PricedModel, share: RankShare, name: str) -> bool:
    """Whether this rank holds the parameter ``name`` from outside the blocks: the embedding (and learned positions)
    on the first stage, the final norm and head on the last; a tied head keeps the embedding on both."""
    if name.startswith(("tok_embeddings", "pos_embeddings")):
        return share.first_stage or (name.startswith("tok_") and config.tie_embeddings and share.last_stage)
    return share.last_stage


def block_params_of(config: PricedModel, share: RankShare, block: int) -> list[ParamSpec]:
    key = repr(config)
    if key not in _BY_BLOCK:
        grouped: dict[int | None, list[ParamSpec]] = {}
        for param in all_params(config):
            grouped.setdefault(param.block, []).append(param)
        _BY_BLOCK[key] = grouped
    return _BY_BLOCK[key].get(block, [])


_BY_BLOCK: dict[str, dict[int | None, list[ParamSpec]]] = {}


def rank_layers(config: PricedModel, layout: Layout, pipeline_rank: int) -> tuple[int, ...]:
    """The layers of the stages a pipeline rank holds (looped: stages r, r + p, ...), in model order."""
    pp, v = layout.pipeline_parallel, layout.stages_per_rank
    per_stage = config.num_layers // (pp * v)
    return tuple(layer for stage in range(pipeline_rank, pp * v, pp)
                 for layer in range(stage * per_stage, (stage + 1) * per_stage))


def distinct_pipeline_ranks(config: PricedModel, layout: Layout) -> list[int]:
    """One pipeline rank per kind: ranks whose layers have the same kinds (MoE or dense, banded or not), the same
    end-stage roles and the same block sharing cost the same, so a layout is priced once per kind."""
    pp, v = layout.pipeline_parallel, layout.stages_per_rank
    mapping = config.layer_to_block
    kinds: dict[tuple, int] = {}
    for rank in range(pp):
        layers = rank_layers(config, layout, rank)
        signature = (tuple((config.is_moe_layer(layer), config.attention_window(layer)) for layer in layers),
                     rank == 0, rank == (pp * v - 1) % pp, len({mapping[layer] for layer in layers}))
        kinds.setdefault(signature, rank)
    return sorted(kinds.values())
