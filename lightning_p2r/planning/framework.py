"""Framework time the operator count misses: Python that runs per Lightning batch, per hooked module, per pipeline
stage action and per tensor-parallel operator, and the wait of every blocking collective for the slowest rank, on
top of the operators ``operator_overhead`` prices.

Each term is a count (a pure function of the model, the layout and the rank's share) times one constant of the
cluster file. ``batch_overhead`` and ``module_hook_overhead`` (``MEASURED``) are measured by ``lightning-p2r
calibrate`` (a ``Trainer`` stepping a tiny model with and without accumulation; a stack of tiny blocks with and
without FSDP2). The others (``FITTED``) cannot be isolated by a microbenchmark: they are fitted to measured steps,
by ``lightning-p2r calibrate`` on the user's machine (a handful of timed probe layouts,
:mod:`lightning_p2r.measure.fit_terms`) and by ``python -m lightning_p2r.benchmarks.planner --cross-validate`` on one
half of a random sample of layouts, judged on the other half (docs/planning.md). Each term's assumption, in one line:

- ``batch_overhead`` (measured): standard accumulation without a pipeline is Lightning's: every micro-batch beyond
  the first repeats Lightning's per-batch loop (fetch, hooks, logging, the backward closure; the loss's cross-rank
  finiteness check runs once per step since 2026-11-30), which ``step_overhead`` prices once per step.
- ``module_hook_overhead`` (measured): every FSDP2 unit (the rank's blocks and the part's root) and every block the
  block streamer drives runs Python hooks in forward and backward, once per micro-batch (the layered executor on
  one process without offload is a plain loop over the blocks: none), at the cost FSDP2's hooks have on a stack of
  tiny blocks.
- ``stage_overhead``: a pipeline schedule runs each stage's forward and backward per micro-batch as a separate
  action, with its Python bookkeeping and its send and receive calls.
- ``blocking_collective_overhead``: every other collective the step waits for on its critical path (tensor
  parallel, the balance loss's reductions, pipeline sends, clipping, and the data-parallel ones on a cluster that
  does not overlap them with compute) also waits for the slowest rank of its group to arrive: ranks drift apart
  over the compute between two collectives, which a microbenchmark's latency (ranks in lockstep) does not see.
  Under sequence parallelism a tensor-parallel sync point is a reduce-scatter and, after only a norm and a residual
  add on the rank's share of the sequence, an all-gather: the ranks reach the second in step, so the pair waits
  once.
- ``expert_wait_overhead``: every expert-parallel all-to-all waits for the rank whose experts received the most
  tokens: dropless routing gives the ranks unequal expert work, which equal microbenchmark payloads do not see.
- ``dtensor_overhead``: under tensor parallelism each module the parallel plan splits converts its input and
  output to and from DTensor and dispatches its weight's operator through DTensor (sharding propagation in Python),
  each forward and backward pass of each micro-batch: a cost per split module's pass. The operators between those
  modules (attention, the router, the experts' loop on local shards) run on plain tensors; counting every operator
  (as until 2026-11-29) made a 16-expert layer's loop look like hundreds of DTensor calls.

Under a pipeline, the per-micro-batch terms (hooked modules, stage actions, DTensor passes, the waits of the
collectives inside a stage's forward or backward: tensor parallel, pipeline sends, the balance loss, the expert
all-to-alls) are part of a stage-time, and a stage-time is what the pipeline's fill and drain idle for: their counts
stretch by ``1 / (1 - idle)``, as the compute does (``bubble_fraction``). Counting them once left a pipeline of two
micro-batches 17-28% short on a 2-vCPU machine (the bubble there is a third of the step; 2026-11-29). Not on a CPU
running more training threads than cores (``cpu_oversubscription`` above 1): there a rank idle in the fill or drain
gives its core to the others, and stretching the counts made the stored cross-validation's 4-process pipelines worse
(largest held-out error 31.9% -> 40.5%); without it the stored samples score as before. Two parts are not stretched
yet: the in-stage collectives' own seconds (priced as transfers, not counted here), and the data-parallel gathers
and reduce-scatters that FSDP2 repeats per micro-batch inside a pipeline's stages (labelled data parallel, so
counted once per call, unstretched).

On a CPU-only machine running more training threads than cores the fitted counts stretch by
``Cluster.cpu_oversubscription`` (measured by ``calibrate``): each count is Python work of one process, which then
gets only that share of a core. The measured terms were measured in every process at once, so their constants
already include it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..layout import bubble_fraction
from .cluster import FITTED_TERMS, Cluster
from .hf_decoder import HFDecoder
from .hf_tensor_parallel import module_passes as hf_module_passes
from .layout import Layout, Workload
from .model import PricedModel
from .share import RankShare, rank_share
from .transfers import EXPERT_DISPATCH, TENSOR_PARALLEL, ZERO1_BROADCASTS, Transfer, step_transfers

MEASURED = ("batch_overhead", "module_hook_overhead")
"""The framework terms ``calibrate`` measures."""
FITTED = FITTED_TERMS
"""The cluster fields fitted to measured steps rather than measured one by one."""
TERMS = (*MEASURED, *FITTED)
"""Every framework term: the measured ones and the fitted ones."""


def extra_lightning_batches(layout: Layout) -> int:
    """Lightning batches per optimizer step beyond the first (``Trainer(accumulate_grad_batches=...)``)."""
    return layout.trainer_accumulation - 1


def hooked_module_passes(layout: Layout, share: RankShare, devices: int) -> int:
    """Hooked modules times micro-batches: the rank's blocks and one root, on every path that runs them under hooks
    (FSDP2's units, on one process too with ZeRO-2/3; the block streamer's fetches and gradient copies); none under
    DDP's reducer, on one process without offload, where the layered executor is a plain loop over the blocks, nor
    in a pipeline stage alone on its rank (plain modules: ``Layout.wraps_blocks``)."""
    streamed = layout.path(devices) == "local" and layout.offloading
    if not (layout.wraps_blocks(devices) or streamed):
        return 0
    return layout.micro_batches * (len(share.blocks) + 1)


def pipeline_stage_actions(layout: Layout) -> int:
    """Forward and backward actions of the rank's stages per step: two per stage and micro-batch."""
    if layout.pipeline_parallel == 1:
        return 0
    return 2 * layout.stages_per_rank * layout.micro_batches


def tensor_parallel_module_passes(config: PricedModel, layout: Layout, share: RankShare) -> int:
    """Calls through DTensor per step under tensor parallelism (none without it): forward and backward (three
    forwards' worth) of every micro-batch through each module the model's parallel plan splits. The parallel styles
    wrap a module's input and output (``from_local`` / ``to_local``, a redistribution) and dispatch its weight's
    operator through DTensor; everything between them (attention, norms without sequence parallelism, the router, the
    experts' loop on their local shards) runs on plain tensors. Per M6 layer: the attention's two projections and the
    FFN's two linears, or an expert layer's entry and exit; sequence parallelism adds the two norms and an expert
    layer's gather and cut. A Hugging Face layer: each module its family's plan splits (q, k, v and o apart),
    counted by ``planning.hf_tensor_parallel.module_passes``. Outside the layers: the embedding and the head where
    the rank runs them (and the final norm under sequence parallelism). Recompute runs the layers' modules forward
    once more (four forwards' worth)."""
    if layout.tensor_parallel == 1:
        return 0
    if isinstance(config, HFDecoder):  # each projection its own module (planning.hf_tensor_parallel)
        in_layers, ends = hf_module_passes(config, list(share.layers), sequence_parallel=layout.sequence_parallel,
                                           first_stage=share.first_stage, last_stage=share.last_stage)
    else:
        layers = len(share.layers)
        in_layers = 4 * layers
        ends = int(share.first_stage) + int(share.last_stage)
        if layout.sequence_parallel:
            moe_layers = sum(config.is_moe_layer(layer) for layer in share.layers)
            in_layers += 2 * layers + 2 * moe_layers
            ends += int(share.last_stage)
    return layout.micro_batches * ((4 if layout.recompute else 3) * in_layers + 3 * ends)


def _blocking(transfer: Transfer, overlap_collectives: bool) -> bool:
    return transfer.kind not in ("h2d", "d2h") and not (transfer.overlaps_compute and overlap_collectives)


def blocking_collective_calls(transfers: Sequence[Transfer], overlap_collectives: bool = True) -> int:
    """Waits for the slowest rank among the rank's step ``transfers``: every collective call it waits for on its
    critical path, other than the expert-parallel all-to-alls (tensor parallel, balance loss, pipeline sends,
    clipping, and the data-parallel ones on a cluster that does not ``overlap_collectives``), except that the
    tensor-parallel collectives wait once per sync point (``TENSOR_PARALLEL``'s calls of one kind; sequence
    parallelism's reduce-scatter and all-gather of one point wait once, see the module docstring)."""
    blocking = [t for t in transfers if _blocking(t, overlap_collectives) and t.label != EXPERT_DISPATCH]
    tensor_parallel = [t for t in blocking if t.label == TENSOR_PARALLEL]
    # A Hugging Face decoder's collectives say their waits (``Transfer.waits``); M6's kinds each carry the sync points.
    sync_points = (max((t.calls for t in tensor_parallel if t.waits is None), default=0)
                   + sum(t.waits for t in tensor_parallel if t.waits is not None))
    # ZeRO-1's broadcasts are issued together and waited for together: the ranks meet once.
    zero1 = int(any(t.label == ZERO1_BROADCASTS for t in blocking))
    return sync_points + zero1 + sum(t.calls for t in blocking if t.label not in (TENSOR_PARALLEL, ZERO1_BROADCASTS))


IN_STAGE_LABELS = (TENSOR_PARALLEL, EXPERT_DISPATCH, "pipeline", "balance loss")
"""Transfers made inside a stage's forward or backward, once per micro-batch. The others are counted once per call:
clipping and the pipeline replicas' reductions run once per step, after the schedule; so do most data-parallel
ones, but not the gathers and reduce-scatters FSDP2 repeats per micro-batch (see the module docstring)."""


def pipeline_stretch(layout: Layout) -> float:
    """How much longer a pipeline rank's step is than its own stage-times: ``1 / (1 - idle)``, with idle the
    schedule's fill-and-drain share (1 without a pipeline)."""
    idle = bubble_fraction(layout.pipeline_parallel, layout.stages_per_rank, layout.micro_batches)
    return 1.0 / (1.0 - idle)


def expert_dispatch_calls(transfers: Sequence[Transfer]) -> int:
    """The expert-parallel all-to-all calls among the rank's step ``transfers``: each waits for the rank with the
    most routed tokens."""
    return sum(t.calls for t in transfers if _blocking(t, True) and t.label == EXPERT_DISPATCH)


def framework_counts(config: PricedModel, layout: Layout, cluster: Cluster, workload: Workload,
                     share: RankShare | None = None, transfers: Sequence[Transfer] | None = None) -> dict[str, float]:
    """Each ``TERMS`` constant's count for one step of the rank (pipeline rank 0 when ``share`` is not given);
    ``transfers``: the rank's step transfers when the caller has them (``estimate_step`` prices them anyway).

    The fitted terms are Python time of one process at a core of its own: on a machine running more training
    threads than it has cores (``Cluster.cpu_oversubscription``), each process gets that share of a core, and their
    counts stretch by it. The ``MEASURED`` terms are measured on the same processes, so they already include it.
    Under a pipeline the per-micro-batch counts also stretch by :func:`pipeline_stretch` (see the module docstring)."""
    share = share or rank_share(config, layout, cluster, workload)
    if transfers is None:
        transfers = step_transfers(config, layout, cluster, workload, pipeline_rank=share.pipeline_rank)
    in_stage = [t for t in transfers if t.label in IN_STAGE_LABELS]
    per_step = [t for t in transfers if t.label not in IN_STAGE_LABELS]
    overlap = cluster.overlap_collectives
    # The stage-time terms repeat in the pipeline's idle time, on a machine where an idle rank's core stays idle.
    in_stage_stretch = pipeline_stretch(layout) if cluster.cpu_oversubscription <= 1 else 1.0
    fitted = {"stage_overhead": in_stage_stretch * pipeline_stage_actions(layout),
              "dtensor_overhead": in_stage_stretch * tensor_parallel_module_passes(config, layout, share),
              "blocking_collective_overhead": (in_stage_stretch * blocking_collective_calls(in_stage, overlap)
                                               + blocking_collective_calls(per_step, overlap)),
              "expert_wait_overhead": in_stage_stretch * expert_dispatch_calls(transfers)}
    stretch = cluster.cpu_oversubscription
    measured = {"batch_overhead": extra_lightning_batches(layout),
                "module_hook_overhead": in_stage_stretch * hooked_module_passes(layout, share, cluster.devices)}
    return measured | {k: v * stretch for k, v in fitted.items()}


def framework_seconds(config: PricedModel, layout: Layout, cluster: Cluster, workload: Workload,
                      share: RankShare | None = None, transfers: Sequence[Transfer] | None = None) -> float:
    """Seconds of framework time per step: each count times its cluster constant (zero in a file that has none)."""
    counts = framework_counts(config, layout, cluster, workload, share, transfers)
    return sum(count * getattr(cluster, name) for name, count in counts.items())


HOW_TO_GET = {**{term: "measured by `lightning-p2r calibrate`" for term in MEASURED},
              **{term: "fitted by `lightning-p2r calibrate` with --processes 2 or more (from timed probe layouts)"
                 for term in FITTED}}
"""Where a cluster file's value of each term comes from (the planner's warning names it)."""


def missing_terms(config: PricedModel, layouts: Sequence[Layout], cluster: Cluster,
                  workload: Workload) -> dict[str, int]:
    """The terms ``cluster`` leaves at zero that ``layouts`` count, with how many of them count each: their
    predictions leave that time out (a file from before ``calibrate`` measured it, or a fitted term never fitted
    on this machine), so they come out short."""
    missing: dict[str, int] = {}
    for layout in layouts:
        for name, count in framework_counts(config, layout, cluster, workload).items():
            if count > 0 and getattr(cluster, name) == 0 and name not in cluster.fitted_spread:
                missing[name] = missing.get(name, 0) + 1
    return {name: missing[name] for name in TERMS if name in missing}
