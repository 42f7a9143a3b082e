"""Per-rank device and host memory of a layout, part by part.

Model states (between steps, what :func:`lightning_p2r.measure.memory.local_model_state_bytes` counts):

- parameters and gradients: each parameter's tensor-/expert-parallel part, then, under ZeRO-2/3, FSDP2's shard of
  it over the data ranks that hold the same part (dim 0 padded to a multiple of them); whole under "none"/zero1;
- optimizer states: ``optimizer_bytes_per_param`` per stored element, divided over those data ranks under ZeRO-1
  (``ZeroRedundancyOptimizer`` balances whole tensors, so a rank's real share may differ by a few percent);
- offloaded blocks keep all three in host memory (the default ``offload_states``).

Working memory during a step:

- gathered parameters: ZeRO-3 holds two blocks unsharded at once (the one running, the one prefetched); ZeRO-2
  keeps every block unsharded from forward to backward; the unit outside the blocks (embedding, head) stays
  gathered through the step. Unsharded gradients: one block's before its reduce-scatter, or every block's under
  standard accumulation with several micro-batches (FSDP2 accumulates them unsharded until the last);
- offload window: ``prefetch + 1`` offloaded blocks resident at once, with their gradients;
- activations (:func:`lightning_p2r.planning.model.layer_activation_elements`) of the micro-batches in flight:
  one under standard accumulation; all of them under layered accumulation, GPipe and the breadth-first pipeline;
  ``pipeline_parallel`` (the first stage's warm-up) under 1F1B, times ``1 + (p - 1) / (p v)`` interleaved. With
  recompute only each layer's input is kept, plus one layer's whole activations while it is recomputed;
- the logits and their gradient (fp32) for one micro-batch, and the pipeline's send/receive buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .cluster import Cluster
from .layout import Layout, Workload
from .model import PricedModel, as_run, layer_activation_elements
from .share import (
    RankShare,
    block_params_of,
    data_group_size,
    distinct_pipeline_ranks,
    held_params,
    rank_share,
    sharded_numel,
    split_shape,
)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one device and in its share of host memory."""

    params: float
    grads: float
    optimizer: float
    gathered: float
    """Unsharded parameters and gradients FSDP2 holds during the step."""
    offload_window: float
    activations: float
    logits: float
    pipeline_buffers: float
    host: float
    """Offloaded parameters, gradients and optimizer states of this device."""

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def device_total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "host")

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"device_total": self.device_total}


def stored_elements(config: PricedModel, layout: Layout, share: RankShare, *, blocks: set[int] | None = None,
                    outside_blocks: bool = True, optimizer: bool = False) -> float:
    """Elements this rank stores of its parameters between steps (after the tensor/expert split and the ZeRO-2/3
    shard); ``blocks`` limits it to those blocks, ``outside_blocks`` includes the root parameters. ``optimizer``:
    the elements whose optimizer state it keeps instead (ZeRO-1 divides each parameter's over the data ranks that
    hold it: the dense weights over all of them, the experts over the expert-data ranks)."""
    sharded = layout.sharding in ("zero2", "zero3")
    partitioned = optimizer and layout.sharding == "zero1"
    total = 0.0
    for param in held_params(config, share):
        if param.block is None and not outside_blocks:
            continue
        if param.block is not None and blocks is not None and param.block not in blocks:
            continue
        shape = split_shape(param, layout)
        ranks = data_group_size(param, share)
        total += sharded_numel(shape, ranks) if sharded else sharded_numel(shape, 1) / (ranks if partitioned else 1)
    return total


def unsharded_elements(config: PricedModel, layout: Layout, share: RankShare, block: int | None) -> float:
    """Elements of one block's (or, for None, the root's) tensor-/expert-parallel part, as FSDP2 gathers it."""
    params = block_params_of(config, share, block) if block is not None else [
        p for p in held_params(config, share) if p.block is None]
    total = 0
    for param in params:
        shape = split_shape(param, layout)
        ranks = data_group_size(param, share) if layout.sharding in ("zero2", "zero3") else 1
        total += sharded_numel(shape, ranks) * ranks
    return total


def estimate_memory(config: PricedModel, layout: Layout, cluster: Cluster, workload: Workload,
                    pipeline_rank: int | None = None) -> MemoryEstimate:
    """One rank's memory; ``pipeline_rank`` None: the pipeline rank with the largest device total."""
    config = as_run(config)  # a shallow pseudo model is priced as the layers it runs (issue 30)
    if pipeline_rank is None:
        return max((estimate_memory(config, layout, cluster, workload, rank)
                    for rank in distinct_pipeline_ranks(config, layout)), key=lambda estimate: estimate.device_total)
    share = rank_share(config, layout, cluster, workload, pipeline_rank)
    pb, ob = workload.param_bytes, workload.optimizer_bytes_per_param
    offloaded = set(share.offloaded)
    resident_blocks = set(share.blocks) - offloaded
    resident = stored_elements(config, layout, share, blocks=resident_blocks)
    host = stored_elements(config, layout, share, blocks=offloaded, outside_blocks=False)
    params, grads = resident * pb, resident * pb
    optimizer = stored_elements(config, layout, share, blocks=resident_blocks, optimizer=True) * ob

    unsharded = {block: unsharded_elements(config, layout, share, block) for block in share.blocks}
    largest = max(unsharded.values(), default=0)
    root = unsharded_elements(config, layout, share, None)
    gathered = 0.0
    if layout.sharding in ("zero2", "zero3") and layout.wraps_blocks(cluster.devices):  # else nothing gathers
        on_device = [unsharded[b] for b in resident_blocks]
        params_gathered = (min(2, len(on_device)) * largest if layout.sharding == "zero3" else sum(on_device))
        keeps_all_grads = layout.accumulation == "standard" and layout.micro_batches > 1
        grads_gathered = sum(on_device) if keeps_all_grads else largest
        gathered = (params_gathered + grads_gathered + 2 * root) * pb
    window = min(len(offloaded), 2) * largest * 2 * pb  # prefetch 1: two blocks' parameters and gradients

    activations = _activation_bytes(config, layout, workload, share)
    micro_tokens = share.micro_sequences * workload.seq_len
    logits = micro_tokens * config.vocab_size / layout.tensor_parallel * 4 * 2 if share.last_stage else 0.0
    buffers = 0.0
    if layout.pipeline_parallel > 1:
        buffers = 2 * 2 * micro_tokens * config.dim * workload.activation_bytes * layout.stages_per_rank
    return MemoryEstimate(params=params, grads=grads, optimizer=optimizer, gathered=gathered,
                          offload_window=window, activations=activations, logits=logits,
                          pipeline_buffers=buffers, host=host * (2 * pb + ob))


def micro_batches_in_flight(layout: Layout) -> float:
    """Micro-batches whose activations the rank holds at its peak."""
    m, p, v = layout.micro_batches, layout.pipeline_parallel, layout.stages_per_rank
    if p == 1:
        return m if layout.accumulation == "layered" else 1
    if layout.pipeline_schedule in ("gpipe", "looped_bfs"):
        return m
    if layout.pipeline_schedule == "interleaved_1f1b":
        return min(m, p) * (1 + (p - 1) / (p * v))
    return min(m, p)


def _activation_bytes(config: PricedModel, layout: Layout, workload: Workload, share: RankShare) -> float:
    micro_tokens = share.micro_sequences * workload.seq_len
    if layout.sequence_parallel:
        micro_tokens_replicated = micro_tokens / layout.tensor_parallel
    else:
        micro_tokens_replicated = micro_tokens
    per_layer = [micro_tokens * layer_activation_elements(config, layer, tensor_parallel=layout.tensor_parallel,
                                                          sequence_parallel=layout.sequence_parallel)
                 for layer in share.layers]
    in_flight = micro_batches_in_flight(layout)  # through all of the rank's layers
    if layout.recompute:
        boundaries = micro_tokens_replicated * config.dim * len(share.layers)
        elements = in_flight * boundaries + max(per_layer, default=0)
    else:
        elements = in_flight * sum(per_layer)
    return elements * workload.activation_bytes
