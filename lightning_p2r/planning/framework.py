"""Framework time the operator count misses: Python that runs per Lightning batch, per hooked module, per pipeline
stage action and per tensor-parallel operator, and the wait of every blocking collective for the slowest rank, on
top of the operators ``operator_overhead`` prices.

Each term is a count (a pure function of the model, the layout and the rank's share) times one constant of the
cluster file. The constants are not measured by ``lightning-p2r calibrate`` one by one: they are fitted to measured
steps by ``python -m lightning_p2r.benchmarks.planner --cross-validate``, on one half of a random sample of layouts,
and judged on the other half (docs/planning.md). Each term's assumption, in one line:

- ``batch_overhead``: standard accumulation without a pipeline is Lightning's: every micro-batch beyond the first
  repeats Lightning's per-batch loop (fetch, hooks, logging, the loss's cross-rank finiteness check, the backward
  closure), which ``step_overhead`` prices once per step.
- ``module_hook_overhead``: every FSDP2 unit (the rank's blocks and the part's root) and every block the layered
  executor or the offload engine drives runs Python hooks in forward and backward, once per micro-batch.
- ``stage_overhead``: a pipeline schedule runs each stage's forward and backward per micro-batch as a separate
  action, with its Python bookkeeping and its send and receive calls.
- ``blocking_collective_overhead``: every collective the step waits for on its critical path (tensor- and
  expert-parallel, the balance loss's reductions, pipeline sends) also waits for the slowest rank of its group to
  arrive: ranks drift apart within a step, which a microbenchmark's latency (ranks in lockstep) does not see.
- ``dtensor_overhead``: under tensor parallelism the layers' operators dispatch through DTensor (sharding
  propagation in Python), each forward and backward pass of each micro-batch: a cost per operator on top of
  ``operator_overhead``, counted with the same operator count.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..models.config import M6Config
from .cluster import Cluster
from .layout import Layout, Workload
from .model import layer_operator_launches
from .share import RankShare, rank_share
from .transfers import Transfer, step_transfers

FITTED = ("batch_overhead", "module_hook_overhead", "stage_overhead", "dtensor_overhead",
          "blocking_collective_overhead")
"""The cluster fields fitted to measured steps rather than measured one by one."""


def extra_lightning_batches(layout: Layout) -> int:
    """Lightning batches per optimizer step beyond the first (``Trainer(accumulate_grad_batches=...)``)."""
    return layout.trainer_accumulation - 1


def hooked_module_passes(layout: Layout, share: RankShare, devices: int) -> int:
    """Hooked modules times micro-batches: the rank's blocks and one root, on every path that drives blocks one by
    one (FSDP2, the layered executor, the offload engine); none under plain DDP or a plain single process."""
    path = layout.path(devices)
    if path == "ddp" or (path == "local" and layout.accumulation == "standard" and not layout.offloading):
        return 0
    return layout.micro_batches * (len(share.blocks) + 1)


def pipeline_stage_actions(layout: Layout) -> int:
    """Forward and backward actions of the rank's stages per step: two per stage and micro-batch."""
    if layout.pipeline_parallel == 1:
        return 0
    return 2 * layout.stages_per_rank * layout.micro_batches


def tensor_parallel_operator_passes(config: M6Config, layout: Layout, share: RankShare) -> int:
    """Operators the rank's layers launch per step under tensor parallelism (none without it): forward and backward
    (three forwards' worth, as ``operator_overhead`` counts them) of every micro-batch."""
    if layout.tensor_parallel == 1:
        return 0
    local_experts = config.num_experts // layout.expert_parallel
    launches = sum(layer_operator_launches(config, layer, local_experts) for layer in share.layers)
    return 3 * layout.micro_batches * launches


def blocking_collective_calls(transfers: Sequence[Transfer]) -> int:
    """Collective calls among the rank's step ``transfers`` that it waits for on its critical path (tensor- and
    expert-parallel, balance loss, pipeline sends, clipping): each also waits for the slowest rank of its group."""
    return sum(t.calls for t in transfers if not t.overlaps_compute and t.kind not in ("h2d", "d2h"))


def fitted_counts(config: M6Config, layout: Layout, cluster: Cluster, workload: Workload,
                  share: RankShare | None = None, transfers: Sequence[Transfer] | None = None) -> dict[str, float]:
    """Each ``FITTED`` constant's count for one step of the rank (pipeline rank 0 when ``share`` is not given);
    ``transfers``: the rank's step transfers when the caller has them (``estimate_step`` prices them anyway)."""
    share = share or rank_share(config, layout, cluster, workload)
    if transfers is None:
        transfers = step_transfers(config, layout, cluster, workload, pipeline_rank=share.pipeline_rank)
    return {"batch_overhead": extra_lightning_batches(layout),
            "module_hook_overhead": hooked_module_passes(layout, share, cluster.devices),
            "stage_overhead": pipeline_stage_actions(layout),
            "dtensor_overhead": tensor_parallel_operator_passes(config, layout, share),
            "blocking_collective_overhead": blocking_collective_calls(transfers)}


def framework_seconds(config: M6Config, layout: Layout, cluster: Cluster, workload: Workload,
                      share: RankShare | None = None, transfers: Sequence[Transfer] | None = None) -> float:
    """Seconds of framework time per step: each count times its cluster constant (zero in a file that has none)."""
    counts = fitted_counts(config, layout, cluster, workload, share, transfers)
    return sum(count * getattr(cluster, name) for name, count in counts.items())
