"""Every byte one rank moves in one optimizer step under a layout: collectives (by kind, group and call count),
pipeline sends, and host-device copies of offloaded blocks. The same list is priced by :mod:`.step_time` and
compared, kind by kind, with what :class:`~lightning_p2r.strategy.accounting.CollectiveCounter` and the offload
telemetry count on real runs (``tests/distributed``).

Data parallelism (FSDP2 per block, plus one unit for what lies outside the blocks; DDP for "none"/zero1 on plain
data parallelism), per step:

- "none"/zero1: each gradient all-reduced once (accumulation keeps it local until the last micro-batch); zero1
  then broadcasts the updated partitions (every rank receives every parameter once). On FSDP2's replicate layout
  each unit is one all-reduce; DDP packs the gradients into buckets (:func:`ddp_bucket_calls`) and issues one per
  bucket (the bytes are the same, the calls, which price the latency, are fewer);
- zero2: each unit gathered once per micro-batch (layered accumulation: once per step), reduce-scattered once;
- zero3: each block gathered twice per micro-batch (forward, and again for backward; layered: twice per step),
  the root unit once per micro-batch;
- offloaded blocks under standard accumulation reduce-scatter after every micro-batch (their gradient goes to
  the host each time); ``reduce_every_micro_batch`` does the same for every unit.

Only parameter parts held by more than one data rank move; expert parts over the expert-data ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .cluster import Cluster
from .hf_decoder import HFDecoder
from .hf_tensor_parallel import step_collectives
from .layout import Layout, Workload
from .model import ParamSpec, PricedModel
from .share import (
    RankShare,
    block_params_of,
    data_group_size,
    held_params,
    padded_numel,
    rank_share,
    sharded_numel,
    split_shape,
)
from .traffic import StepShape, balance_loss_bytes, expert_parallel_bytes, tensor_parallel_bytes

EXPERT_DISPATCH = "expert parallel"
"""The label of the expert-parallel all-to-alls (their wait is priced apart: ``planning.framework``)."""
TENSOR_PARALLEL = "tensor parallel"
"""The label of the tensor-parallel collectives of the layers, one per kind: M6's each with the layers' sync points as
its calls; a Hugging Face decoder's with its calls and, apart, its waits (``Transfer.waits``)."""


@dataclass(frozen=True)
class Transfer:
    """One kind of traffic of one step: ``payload`` bytes in ``calls`` operations over a group of ``size`` ranks
    ``stride`` devices apart."""

    label: str
    kind: str
    """all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send, h2d or d2h."""
    payload: float
    size: int
    stride: int
    calls: int
    overlaps_compute: bool
    """Whether the engine runs it alongside compute (data parallel, offload copies), or on the critical path."""
    waits: int | None = None
    """Tensor-parallel collectives counted call by call (a Hugging Face decoder's): how many times the ranks wait for
    the slowest among these calls. None: M6's, whose every kind carries the layers' sync points as its calls."""


def step_transfers(config: PricedModel, layout: Layout, cluster: Cluster, workload: Workload, *,
                   clip_gradients: bool = False, pipeline_rank: int = 0) -> list[Transfer]:
    """What a rank at ``pipeline_rank`` moves in one step (every rank of a pipeline position moves the same)."""
    share = rank_share(config, layout, cluster, workload, pipeline_rank)
    transfers = _model_parallel(config, layout, workload, share, clip_gradients, gloo=cluster.accelerator == "cpu")
    transfers += _data_parallel(config, layout, workload, share, ddp=layout.path(cluster.devices) == "ddp")
    transfers += _pipeline(config, layout, workload, share)
    transfers += _offload(config, layout, workload, share)
    return [t for t in transfers if t.payload > 0]


ZERO1_BROADCASTS = "zero1 partitions"
"""ZeRO-1's broadcasts of each rank's updated partition after the optimizer step (``ZeroRedundancyOptimizer``): one
per parameter where the parameters are DTensors (FSDP2's replicate layout, tensor or expert parallelism), one per
rank's packed buffer over DDP's plain replicas (``strategy/replicated_zero.py``); issued together, waited together."""

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send")


def bytes_by_kind(transfers: list[Transfer], kinds: tuple[str, ...] | None = None) -> dict[str, float]:
    """Bytes per kind (only ``kinds`` when given: ``COLLECTIVES`` for what the collective counter sees)."""
    totals: dict[str, float] = {}
    for transfer in transfers:
        if kinds is not None and transfer.kind not in kinds:
            continue
        totals[transfer.kind] = totals.get(transfer.kind, 0.0) + transfer.payload
    return totals


def _model_parallel(config: PricedModel, layout: Layout, workload: Workload, share: RankShare,
                    clip_gradients: bool, gloo: bool) -> list[Transfer]:
    tp, ep, m = layout.tensor_parallel, layout.expert_parallel, layout.micro_batches
    # Clipping by norm sums the squares over the ranks that hold different parts: the tensor / expert ranks and the
    # pipeline ranks (one 8-byte all-reduce; its group's size only prices its latency).
    clipping = [Transfer("gradient clipping", "all_reduce", 8.0, tp * ep * layout.pipeline_parallel, 1, 1, False)]
    if tp == 1 and ep == 1:
        return clipping if clip_gradients and layout.pipeline_parallel > 1 else []
    layers = len(share.layers)
    moe_layers = sum(config.is_moe_layer(layer) for layer in share.layers)
    shape = StepShape(tokens=share.sequences * workload.seq_len, dim=config.dim, vocab_size=config.vocab_size,
                      num_layers=layers, moe_layers=moe_layers, num_experts=config.num_experts,
                      assignments_per_token=config.num_prototypes * config.moe_top_k,
                      element_bytes=workload.activation_bytes, num_blocks=len(share.blocks),
                      residual_bytes=max(workload.param_bytes, workload.activation_bytes))
    # Recompute runs the layers' forward twice (layered accumulation's first pass and the pipeline stage's
    # checkpoints alike), and with it every collective a layer's forward issues.
    forwards = 2 if layout.recompute else 1
    transfers = []
    hf = isinstance(config, HFDecoder)
    if tp > 1 and hf:
        # Each projection split apart, each collective counted (planning.hf_tensor_parallel).
        issued = step_collectives(config, list(share.layers), tokens=shape.tokens, micro_batches=m,
                                  element_bytes=shape.element_bytes, residual_bytes=shape.stream_bytes,
                                  sequence_parallel=layout.sequence_parallel, forward_passes=forwards,
                                  first_stage=share.first_stage, last_stage=share.last_stage, expert_parallel=ep)
        transfers += [Transfer(TENSOR_PARALLEL, kind, payload, tp, 1, issued.calls[kind], False,
                               waits=issued.waits[kind]) for kind, payload in issued.payload.items()]
    else:
        for kind, payload in tensor_parallel_bytes(shape, tp, sequence_parallel=layout.sequence_parallel,
                                                   first_stage=share.first_stage, last_stage=share.last_stage,
                                                   forward_passes=forwards).items():
            # Per layer two sync points in forward (attention, FFN or experts) and two in backward; three at the
            # ends.
            transfers.append(Transfer(TENSOR_PARALLEL, kind, payload, tp, 1, m * (2 * (forwards + 1) * layers + 3),
                                      False))
    # A Hugging Face MoE's rows go out with their gate weight and come back at the hidden states' width
    # (strategy/parallel/experts.py); M6's come back from experts computed in the activations' dtype.
    for kind, payload in expert_parallel_bytes(shape, ep, m, forward_passes=forwards,
                                               rows_back_bytes=shape.stream_bytes if hf else None,
                                               sent_columns=1 if hf else 0).items():
        # Per layer three all-to-alls in forward (counts, rows out, rows back) and two in backward.
        transfers.append(Transfer(EXPERT_DISPATCH, kind, payload, ep, tp, m * moe_layers * (3 * forwards + 2), False))
    data = share.data_parallel
    # M6's balance loss pools the routing of every data rank; a Hugging Face MoE's is each rank's own (none moves).
    pooled = {} if hf else balance_loss_bytes(shape, data, forward_passes=forwards, gloo=gloo)
    for kind, payload in pooled.items():
        # Per layer one all-reduce in forward (the probabilities' sums, counts and tokens, packed) and one in backward.
        transfers.append(Transfer("balance loss", kind, m * payload, data, tp, m * moe_layers * (forwards + 1), False))
    return transfers + (clipping if clip_gradients else [])


DDP_FIRST_BUCKET_BYTES = 1 << 20
"""DDP's first gradient bucket (torch's default: small, so the first all-reduce starts early in backward)."""
DDP_BUCKET_BYTES = 25 << 20
"""DDP's other buckets (``bucket_cap_mb=25``, torch's and Lightning's default)."""


def ddp_bucket_calls(gradient_bytes: float) -> int:
    """All-reduce calls DDP issues for ``gradient_bytes`` of gradients per step: one per bucket, the first of
    ``DDP_FIRST_BUCKET_BYTES`` and the others of ``DDP_BUCKET_BYTES`` (a bucket closes at whole parameters, which
    this ignores)."""
    if gradient_bytes <= 0:
        return 0
    return 1 + math.ceil(max(0.0, gradient_bytes - DDP_FIRST_BUCKET_BYTES) / DDP_BUCKET_BYTES)


def _data_parallel(config: PricedModel, layout: Layout, workload: Workload, share: RankShare,
                   ddp: bool = False) -> list[Transfer]:
    m = layout.micro_batches
    once = layout.accumulation == "layered"
    pb = workload.param_bytes
    units: list[tuple[int | None, list]] = [(None, [p for p in held_params(config, share) if p.block is None])]
    units += [(block, block_params_of(config, share, block)) for block in share.blocks]
    transfers = []
    for block, params in units:
        # A unit's dense and expert parts move over different groups (data ranks, expert-data ranks).
        for owner in ("dense", "expert"):
            group = [p for p in params if (p.owner == "expert") == (owner == "expert")]
            if not group:
                continue
            size = data_group_size(group[0], share)
            if size == 1:
                continue
            stride = layout.tensor_parallel * (layout.expert_parallel if owner == "expert" else 1)
            sharded = layout.sharding in ("zero2", "zero3")
            payload = pb * sum(padded_numel(split_shape(p, layout), size if sharded else 1) for p in group)
            label = "data parallel" if block is not None else "data parallel (embedding, head)"
            offloaded = block in share.offloaded
            if not sharded:
                transfers.append(Transfer(label, "all_reduce", payload, size, stride, 1, True))
                if layout.sharding == "zero1":  # one broadcast per parameter (DDP's path: see _ddp_buckets)
                    transfers.append(Transfer(ZERO1_BROADCASTS, "broadcast", payload, size, stride, len(group), True))
                continue
            gathers = _gathers_per_step(layout, block is not None)
            reduces = m if ((offloaded or layout.reduce_every_micro_batch) and not once) else 1
            transfers.append(Transfer(label, "all_gather", gathers * payload, size, stride, gathers, True))
            transfers.append(Transfer(label, "reduce_scatter", reduces * payload, size, stride, reduces, True))
    if ddp:
        transfers = _ddp_buckets(transfers)
    return transfers + _replica_sums(config, layout, workload, share)


def _ddp_buckets(transfers: list[Transfer]) -> list[Transfer]:
    """The per-unit gradient all-reduces of ``transfers`` as DDP issues them, the same bytes in one call per bucket;
    and ZeRO-1's per-parameter broadcasts as it issues them over DDP's plain replicas, one packed buffer per rank."""
    reduces = [t for t in transfers if t.kind == "all_reduce"]
    if not reduces:
        return transfers
    payload = sum(t.payload for t in reduces)
    bucketed = [Transfer("data parallel", "all_reduce", payload, reduces[0].size, reduces[0].stride,
                         ddp_bucket_calls(payload), True)]
    # ZeRO-1 over DDP's plain replicas packs each rank's parameters into one buffer: a broadcast per rank.
    broadcasts = [t for t in transfers if t.label == ZERO1_BROADCASTS]
    if broadcasts:
        size = broadcasts[0].size
        bucketed.append(Transfer(ZERO1_BROADCASTS, "broadcast", sum(t.payload for t in broadcasts), size,
                                 broadcasts[0].stride, size, True))
    return bucketed + [t for t in transfers if t.kind != "all_reduce" and t.label != ZERO1_BROADCASTS]


def _gathers_per_step(layout: Layout, is_block: bool) -> int:
    """How often FSDP2 gathers one unit in a step (see the module docstring; the unit outside the blocks stays
    gathered from its forward to its backward)."""
    m, zero3 = layout.micro_batches, layout.sharding == "zero3"
    if layout.pipeline_parallel > 1:
        # A pipeline's stages stay gathered from their first forward to their last backward (zero2); under zero3
        # (the rulebook's reshard rule) a breadth-first schedule gathers each block, experts included, once per
        # direction, a depth-first one before each forward and once for the backwards (kept until the last).
        if not (zero3 and is_block):
            return 1
        return m + 1 if layout.resharding.after_each_forward else 2
    passes = 1 if layout.accumulation == "layered" else m
    return passes * (2 if zero3 and is_block else 1)


def _replica_sums(config: PricedModel, layout: Layout, workload: Workload, share: RankShare) -> list[Transfer]:
    """Parameters several pipeline ranks hold (a tied embedding on the end stages, a pseudo model's shared blocks):
    their gradients (a rank's ZeRO-2/3 shard of them) are all-reduced over those ranks once per step."""
    pp = layout.pipeline_parallel
    if pp == 1:
        return []
    sharded = layout.sharding in ("zero2", "zero3")

    def stored(params: list[ParamSpec]) -> int:
        return sum(sharded_numel(split_shape(p, layout), data_group_size(p, share) if sharded else 1)
                   for p in params)

    stride = layout.tensor_parallel * share.data_parallel
    transfers = []
    embedding = [p for p in held_params(config, share) if p.name == "tok_embeddings.weight"]
    if config.tie_embeddings and embedding:
        transfers.append(Transfer("pipeline replicas", "all_reduce", stored(embedding) * workload.param_bytes, 2,
                                  stride * (pp - 1), 1, True))
    for block in share.blocks:
        holders = len({_stage_rank(config, layout, layer) for layer in config.layers_of_block(block)})
        if holders > 1:
            transfers.append(Transfer("pipeline replicas", "all_reduce",
                                      stored(block_params_of(config, share, block)) * workload.param_bytes, holders,
                                      stride, 1, True))
    return transfers


def _stage_rank(config: PricedModel, layout: Layout, layer: int) -> int:
    per_stage = config.num_layers // (layout.pipeline_parallel * layout.stages_per_rank)
    return (layer // per_stage) % layout.pipeline_parallel


def _pipeline(config: PricedModel, layout: Layout, workload: Workload, share: RankShare) -> list[Transfer]:
    """Each of the rank's stages sends every micro-batch's hidden states forward (unless it is the last stage) and
    their gradient back (unless it is stage 0). The residual stream has the parameters' precision (autocast keeps it
    fp32 over fp32 parameters)."""
    pp, v, m = layout.pipeline_parallel, layout.stages_per_rank, layout.micro_batches
    if pp == 1:
        return []
    tokens = share.micro_sequences * workload.seq_len
    if layout.sequence_parallel:
        tokens //= layout.tensor_parallel
    per_send = tokens * config.dim * workload.param_bytes
    stages = range(share.pipeline_rank, pp * v, pp)
    sends = m * sum((stage < pp * v - 1) + (stage > 0) for stage in stages)
    return [Transfer("pipeline", "send", sends * per_send, 2, layout.tensor_parallel * share.data_parallel, sends,
                     False)]


def _offload(config: PricedModel, layout: Layout, workload: Workload, share: RankShare) -> list[Transfer]:
    """Each offloaded block visits the device in forward and again in backward, per micro-batch (layered
    accumulation: once per step); its gradient goes back after each micro-batch's backward (layered: once)."""
    if not share.offloaded:
        return []
    passes = 1 if layout.accumulation == "layered" else layout.micro_batches
    sharded = layout.sharding in ("zero2", "zero3")
    elements = 0
    for block in share.offloaded:
        for param in block_params_of(config, share, block):
            shape = split_shape(param, layout)
            size = data_group_size(param, share) if sharded else 1
            elements += padded_numel(shape, size) // size
    copy = elements * workload.param_bytes
    fetches = 2 * passes * len(share.offloaded)
    return [Transfer("offload parameters", "h2d", 2 * passes * copy, 1, 1, fetches, True),
            Transfer("offload gradients", "d2h", passes * copy, 1, 1, passes * len(share.offloaded), True)]
