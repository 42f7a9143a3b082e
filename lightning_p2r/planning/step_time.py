"""Predicted time of one optimizer step on one rank, part by part.

- **compute**: the rank's matmul FLOPs (forward, backward at twice the forward, and one more forward of the blocks
  with recompute) at ``device_flops``; its elementwise traffic (about three times one forward's: forward, and
  backward's read and write; the blocks' once more with recompute) at ``elementwise_bandwidth``; its operator
  launches at ``operator_overhead`` each (a pipeline's per-layer checkpointing at its measured
  ``..._checkpoint_overhead`` instead of one more forward's); and its matmul calls (forward, the two gradients,
  recompute's forward) at ``matmul_overhead`` each on top: the
  fixed cost that makes a matmul of few rows reach less of ``device_flops`` (matmul efficiency by shape); and
  its tokens at ``dense_token_overhead`` / ``moe_token_overhead`` per layer, plus their ``..._width_overhead``
  times the width (per-token work the traffic terms miss); and, with the loop kernel, each micro-batch's
  stacking of the experts' weight gradients at ``moe_expert_weight_overhead`` per weight element; and in a model
  that drops, its dropouts' masks and a dropping attention's probabilities (``dropout_seconds``).
  Tensor parallelism divides the matmuls of attention, dense FFNs, experts and head; expert parallelism changes
  which rows a rank computes but not how many (balanced routing assumed).
- **bubble**: a pipeline idles ``(p - 1) / (v m + p - 1)`` of the step (every schedule offered here), so the
  step's compute stretches by ``(p - 1) / (v m)``.
- **critical-path collectives**: tensor-parallel all-reduces, expert all-to-alls, the balance loss's reductions
  and the pipeline's sends wait for each other and for compute (no overlap assumed).
- **data-parallel collectives** and **offload copies** overlap compute when the cluster says they can
  (``overlap_collectives``, ``overlap_copies``): then only what exceeds the compute, plus the last unit's
  reduce-scatter (or the first block's copy) shows; otherwise all of it.
- **overhead**: the framework's fixed cost per step, measured by ``lightning-p2r calibrate``.
- **framework**: Python time per Lightning batch beyond the first, per hooked module, per pipeline action and per
  tensor-parallel operator, each per micro-batch (:mod:`lightning_p2r.planning.framework`: fitted constants).
- **optimizer**: the device's Adam step over its resident parameters (``optimizer_seconds_per_param``) and the
  host's over offloaded ones (``host_optimizer_seconds_per_param``).
- **weight traffic**: every micro-batch reads each local weight in its forward and input-gradient matmuls (once
  more with recompute) and writes its gradient into the running sum (write, read, write): five (six) times the
  parameter bytes, per micro-batch, at the bandwidth of their working set (the weights and gradients:
  ``Cluster.memory_bandwidth_at``; on a CPU the caches hold a small model's); counted in compute. ``device_flops``
  is measured on many rows, where this traffic hides; a micro-batch of few rows pays it.

Every assumption is one line here, so a mismatch with a measured step points at the part that is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ..layout import bubble_fraction as pipeline_bubble
from .cluster import Cluster
from .framework import framework_seconds
from .hf_decoder import HFDecoder, layer_cost_scales
from .layout import Layout, Workload
from .memory import stored_elements, unsharded_elements
from .model import (
    PricedModel,
    as_run,
    embedding_dropout_elements,
    grouped_experts,
    head_elementwise_elements,
    head_forward_flops,
    layer_attention_flops,
    layer_dropout_elements,
    layer_elementwise_elements,
    layer_forward_flops,
    layer_matmuls,
    layer_operator_launches,
    looped_experts,
)
from .network import Link, collective_seconds, group_link
from .share import RankShare, distinct_pipeline_ranks, rank_share
from .transfers import EXPERT_DISPATCH, Transfer, step_transfers


@dataclass(frozen=True)
class StepEstimate:
    """Seconds of one optimizer step, by part (the exposed time of each: what the step waits for)."""

    compute: float
    bubble: float
    tensor_parallel: float
    expert_parallel: float
    pipeline_sends: float
    data_parallel: float
    offload_copies: float
    optimizer: float
    overhead: float = 0.0
    """The framework's fixed cost per step (``Cluster.step_overhead``)."""
    framework: float = 0.0
    """Framework time that grows with micro-batches, hooked modules, pipeline actions and tensor-parallel operators
    (:mod:`lightning_p2r.planning.framework`; zero with a cluster file that has no such constants)."""

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"total": self.total}


def compute_seconds(config: PricedModel, layout: Layout, cluster: Cluster, workload: Workload,
                    share: RankShare) -> float:
    tokens = share.sequences * workload.seq_len
    tp = layout.tensor_parallel
    attention = sum(layer_attention_flops(config, layer, workload.seq_len) for layer in share.layers)
    blocks = sum(layer_forward_flops(config, layer, workload.seq_len) for layer in share.layers) - attention
    head = head_forward_flops(config) if share.last_stage else 0.0
    passes = 4 if layout.recompute else 3  # forward, backward (twice the launches), recompute
    flops = tokens * (blocks + head) / tp * 3 + (tokens * blocks / tp if layout.recompute else 0.0)
    attention_flops = tokens * attention / tp * passes
    elementwise = sum(layer_elementwise_elements(config, layer) for layer in share.layers)
    # A micro-batch's activation tensor (tokens x width) decides whether the caches hold it (on a CPU).
    activation_bytes = tokens / layout.micro_batches * config.dim * workload.activation_bytes
    elementwise_seconds = (passes * tokens * elementwise * workload.activation_bytes
                           / cluster.elementwise_bandwidth_at(activation_bytes))
    if share.last_stage:  # the loss's log-softmax over the rank's share of the vocabulary (loss parallel)
        logits_bytes = tokens / layout.micro_batches * config.vocab_size / tp * workload.activation_bytes
        elementwise_seconds += (3 * tokens * head_elementwise_elements(config) / tp * workload.activation_bytes
                                / cluster.elementwise_bandwidth_at(logits_bytes))
    local_experts = config.num_experts // layout.expert_parallel
    grouped = grouped_experts(config, cluster.accelerator, workload.precision)
    forward_fixed = fixed_layer_seconds(config, share, cluster, local_experts, grouped)
    recompute_fixed = (recompute_fixed_seconds(config, layout, share, cluster, local_experts, grouped, forward_fixed)
                       if layout.recompute else 0.0)
    launch_seconds = layout.micro_batches * (3 * forward_fixed + recompute_fixed)
    matmuls = sum(layer_matmuls(config, layer, local_experts, grouped=grouped)
                  for layer in share.layers) + int(share.last_stage)
    matmul_seconds = passes * layout.micro_batches * matmuls * cluster.matmul_overhead
    local_params = sum(unsharded_elements(config, layout, share, block) for block in (*share.blocks, None))
    # Per micro-batch every local weight is read by its forward and its input-gradient matmul (once more under
    # recompute), and its gradient written and added to the running sum (read and write): the matmuls' weight
    # traffic, which ``device_flops`` (measured on many rows) hides but a micro-batch of few rows pays.
    # The weights and their gradients are the working set: a CPU's caches hold a small model's, faster than memory.
    weight_passes = 2 + (1 if layout.recompute else 0) + 3
    weight_bytes = local_params * workload.param_bytes
    accumulation_seconds = (layout.micro_batches * weight_passes * weight_bytes
                            / cluster.memory_bandwidth_at(2 * weight_bytes))
    attention_rate = cluster.attention_flops_at(workload.seq_len, config.head_dim)
    # Per-token work the traffic terms miss (measured on the model's own layers at two widths), per token a layer
    # passes (forward, backward at twice, recompute's forward); tensor parallelism leaves a rank every token.
    dense_token, moe_token = token_costs(config, cluster)
    row_seconds = tokens * passes / 3 * sum(moe_token if config.is_moe_layer(layer) else dense_token
                                            for layer in share.layers)
    # The loop kernel's backward stacks each expert's weight gradients, per micro-batch (tensor parallelism splits
    # the experts' hidden units).
    looped = 0 if grouped else sum(looped_experts(config, local_experts) for layer in share.layers
                                   if config.is_moe_layer(layer))
    expert_weights = looped * 2 * config.dim * config.routed_hidden_dim / tp
    stacking_seconds = layout.micro_batches * expert_weights * cluster.moe_expert_weight_overhead
    return (flops / cluster.device_flops + attention_flops / attention_rate + elementwise_seconds +
            launch_seconds + matmul_seconds + accumulation_seconds + row_seconds + stacking_seconds +
            dropout_seconds(config, layout, cluster, workload, share))


def dropout_seconds(config: PricedModel, layout: Layout, cluster: Cluster, workload: Workload,
                    share: RankShare) -> float:
    """The rank's dropouts in training (their random masks: ``Cluster.dropout_element_overhead`` per element, forward
    and backward, a third more under recompute's second forward), and a dropping attention's materialized
    probabilities (``attention_dropout_element_overhead``). Tensor parallelism leaves each rank the whole hidden
    states (split by position under sequence parallelism) and its share of the heads."""
    tokens = share.sequences * workload.seq_len
    passes = (4 if layout.recompute else 3) / 3  # the layers' forward again under recompute
    tp = layout.tensor_parallel
    hidden, probabilities = layer_dropout_elements(config, workload.seq_len)
    layers = len(share.layers)
    in_layers = tokens * passes * layers * (hidden / (tp if layout.sequence_parallel else 1)
                                            * cluster.dropout_element_overhead
                                            + probabilities / tp * cluster.attention_dropout_element_overhead)
    # The embeddings' dropout runs once, on the whole sequence (cut to the rank's positions at the first block).
    embedding = tokens * embedding_dropout_elements(config) * cluster.dropout_element_overhead
    return in_layers + (embedding if share.first_stage else 0.0)


def token_costs(config: PricedModel, cluster: Cluster) -> tuple[float, float]:
    """Seconds per token a dense and an MoE layer pay beyond their priced traffic, at the model's width: measured on
    M6's layers, or on Hugging Face's for a Hugging Face model where the file has them (``hf_layer_overheads`` marks
    a calibration that timed them)."""
    prefix = "hf_" if isinstance(config, HFDecoder) and cluster.hf_layer_overheads else ""

    def at_width(kind: str) -> float:
        return (getattr(cluster, f"{prefix}{kind}_token_overhead")
                + getattr(cluster, f"{prefix}{kind}_token_width_overhead") * config.dim)

    return at_width("dense"), at_width("moe")


def fixed_layer_seconds(config: PricedModel, share: RankShare, cluster: Cluster, local_experts: int,
                        grouped: bool) -> float:
    """Seconds of fixed cost of one forward pass (a third of a forward and backward) of the rank's layers and the
    embedding and head, at any size. With the layer costs ``calibrate`` measures on the model's own code, those;
    otherwise each layer's operators times ``operator_overhead``. The embedding and head count 10 operators. A Hugging
    Face layer costs the measured M6 layer's cost times the ratio of their operators (:func:`operator_scales`)."""
    if cluster.dense_layer_overhead <= 0:
        launches = sum(layer_operator_launches(config, layer, local_experts, grouped=grouped) for layer in share.layers)
        return (launches + 10) * cluster.operator_overhead
    experts = 0 if grouped else looped_experts(config, local_experts)
    dense, moe = operator_scales(config, cluster)
    layers = sum(moe * cluster.moe_layer_overhead + experts * cluster.moe_expert_overhead if config.is_moe_layer(layer)
                 else dense * cluster.dense_layer_overhead for layer in share.layers)
    return layers / 3 + 10 * cluster.operator_overhead


def operator_scales(config: PricedModel, cluster: Cluster) -> tuple[float, float]:
    """Factors on the measured fixed costs of a dense and an MoE layer: 1 for the M6 layers ``calibrate`` timed; for a
    Hugging Face layer, what ``hf_decoder.layer_cost_scales`` finds from its operators and the timed families."""
    if isinstance(config, HFDecoder):
        return layer_cost_scales(config, cluster)
    return 1.0, 1.0


def recompute_fixed_seconds(config: PricedModel, layout: Layout, share: RankShare, cluster: Cluster, local_experts: int,
                            grouped: bool, forward_fixed: float) -> float:
    """Seconds of fixed cost recompute adds to one micro-batch: a pipeline stage checkpoints each layer, which with
    the costs ``calibrate`` measures on that call (``Cluster.dense_checkpoint_overhead`` and the MoE pair) costs those
    per layer; layered accumulation's executor (a first forward without a graph, no hooks), or a file without them,
    one more forward's fixed cost (``forward_fixed``)."""
    if layout.pipeline_parallel <= 1 or cluster.dense_checkpoint_overhead <= 0:
        return forward_fixed
    experts = 0 if grouped else looped_experts(config, local_experts)
    dense, moe = operator_scales(config, cluster)
    return sum(moe * cluster.moe_checkpoint_overhead + experts * cluster.moe_expert_checkpoint_overhead
               if config.is_moe_layer(layer) else dense * cluster.dense_checkpoint_overhead for layer in share.layers)


def transfer_seconds(transfer: Transfer, cluster: Cluster) -> float:
    """The transfer's time on its link; FSDP2's gathers and reduce-scatters also copy their whole buffer in and out
    of the flat communication buffer once (read and write, at ``memory_bandwidth_at`` one call's buffer)."""
    if transfer.kind in ("h2d", "d2h"):
        return transfer.payload / cluster.host_device_bandwidth + transfer.calls * cluster.host_device_latency
    link = group_link(cluster, transfer.size, transfer.stride)
    link = Link(link.bandwidth * cluster.collective_factors.get(transfer.kind, 1.0), link.latency)
    seconds = collective_seconds(transfer.kind, transfer.payload, transfer.size, link, transfer.calls)
    if transfer.label.startswith("data parallel") and transfer.kind in ("all_gather", "reduce_scatter"):
        seconds += 2 * transfer.payload / cluster.memory_bandwidth_at(2 * transfer.payload / max(transfer.calls, 1))
    return seconds


def bubble_fraction(layout: Layout) -> float:
    return pipeline_bubble(layout.pipeline_parallel, layout.stages_per_rank, layout.micro_batches)


def estimate_step(config: PricedModel, layout: Layout, cluster: Cluster, workload: Workload, *,
                  clip_gradients: bool = False, pipeline_rank: int | None = None) -> StepEstimate:
    """One rank's step; ``pipeline_rank`` None: the slowest pipeline rank (a pipeline steps at its pace)."""
    config = as_run(config)  # a shallow pseudo model is priced as the layers it runs (issue 30)
    if pipeline_rank is None:
        return max((estimate_step(config, layout, cluster, workload, clip_gradients=clip_gradients,
                                  pipeline_rank=rank) for rank in distinct_pipeline_ranks(config, layout)),
                   key=lambda estimate: estimate.total)
    share = rank_share(config, layout, cluster, workload, pipeline_rank)
    compute = compute_seconds(config, layout, cluster, workload, share)
    idle = bubble_fraction(layout)
    bubble = compute * idle / (1 - idle)  # the step's compute is the busy (1 - idle) share of the pipeline's time
    parts = {"tensor parallel": 0.0, "expert parallel": 0.0, "pipeline": 0.0, "data": 0.0, "copies": 0.0}
    last_unit = {"data": 0.0, "copies": 0.0}
    transfers = step_transfers(config, layout, cluster, workload, clip_gradients=clip_gradients,
                               pipeline_rank=pipeline_rank)
    for transfer in transfers:
        seconds = transfer_seconds(transfer, cluster)
        if transfer.label in (EXPERT_DISPATCH, "balance loss"):
            parts["expert parallel"] += seconds
        elif transfer.label == "pipeline":
            parts["pipeline"] += seconds
        elif transfer.kind in ("h2d", "d2h"):
            parts["copies"] += seconds
            last_unit["copies"] = max(last_unit["copies"], seconds / max(transfer.calls, 1))
        elif transfer.overlaps_compute:
            parts["data"] += seconds
            last_unit["data"] = max(last_unit["data"], seconds / max(transfer.calls, 1))
        else:
            parts["tensor parallel"] += seconds
    data, copies = parts["data"], parts["copies"]
    if cluster.overlap_collectives:
        data = max(data - compute, 0.0) + min(last_unit["data"], data)
    if cluster.overlap_copies:
        copies = max(copies - compute, 0.0) + min(last_unit["copies"], copies)
    return StepEstimate(compute=compute, bubble=bubble, tensor_parallel=parts["tensor parallel"],
                        expert_parallel=parts["expert parallel"], pipeline_sends=parts["pipeline"],
                        data_parallel=data, offload_copies=copies,
                        optimizer=_optimizer_seconds(config, layout, cluster, workload, share),
                        overhead=cluster.step_overhead,
                        framework=framework_seconds(config, layout, cluster, workload, share, transfers))


def _optimizer_seconds(config: PricedModel, layout: Layout, cluster: Cluster, workload: Workload,
                       share: RankShare) -> float:
    offloaded = set(share.offloaded)
    resident = stored_elements(config, layout, share, blocks=set(share.blocks) - offloaded, optimizer=True)
    host = stored_elements(config, layout, share, blocks=offloaded, outside_blocks=False)
    device = resident * cluster.optimizer_seconds_per_param
    return device + host * cluster.host_optimizer_seconds_per_param


def fitted_step_range(config: PricedModel, layout: Layout, cluster: Cluster, workload: Workload,
                      predicted: float | None = None) -> tuple[float, float]:
    """The step ``estimate_step`` predicts with every fitted term at the low end, and at the high end, of its range
    over the fits that left one probe out (``Cluster.fitted_spread``): how far the prediction moves with what the
    calibration's own timings leave undetermined. A layout that counts no fitted term, or a file without a spread,
    gives the prediction twice. A fitted value may lie outside its leave-one-out range (the fit is non-negative least
    squares), so the range is widened to hold the prediction itself (``predicted``, when the caller has it already).
    Not a bound on the measured step: the machine's speed moves too."""
    ends = []
    for end in (0, 1):
        at_end = {term: spread[end] for term, spread in cluster.fitted_spread.items()}
        ends.append(estimate_step(config, layout, replace(cluster, **at_end), workload).total)
    step = estimate_step(config, layout, cluster, workload).total if predicted is None else predicted
    return min(ends[0], step), max(ends[1], step)
