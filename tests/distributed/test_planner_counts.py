"""The planner's cost model against the model-parallel and pipeline runs' own counters (the shared ``mesh_runs``
launches): the collective bytes of the last step and the parameter elements each rank holds, predicted from the
model's config and the layout alone (``lightning_p2r.planning``), without looking at the built model."""

import json
from pathlib import Path

import pytest
from mesh_configs import FOUR_PROCESSES, PIPELINE_FOUR_PROCESSES, PIPELINE_TWO_PROCESSES, TWO_PROCESSES
from parallel_worker import GLOBAL_BATCH

from lightning_p2r import M6Config
from lightning_p2r.planning import Cluster, Workload, bytes_by_kind, step_transfers
from lightning_p2r.planning.cli import layout_from_options
from lightning_p2r.planning.memory import stored_elements
from lightning_p2r.planning.share import rank_share

RUNS = {c["name"]: (c, 2) for c in TWO_PROCESSES + PIPELINE_TWO_PROCESSES} | {
    c["name"]: (c, 4) for c in FOUR_PROCESSES + PIPELINE_FOUR_PROCESSES}
# A resumed run's last step is an ordinary step of its layout; a delinked run's last step is the real model's. The
# negative control that drops the pipeline replicas' gradient sum moves fewer bytes than its layout, on purpose.
NAMES = sorted(name for name in RUNS if name != "pp2_pseudo_forgets_replica_sum")


def _inputs(name: str, report: dict):
    config, devices = RUNS[name]
    model = M6Config(**report["model"])
    if "delink_at" in config:
        model = model.replace(num_unique_blocks=None)
    layout = layout_from_options(config.get("strategy", {}))
    # The runs are CPU processes on gloo (whose small sums the strategy gathers).
    return model, layout, Cluster(devices=devices, devices_per_node=devices, accelerator="cpu"), Workload(
        global_batch=GLOBAL_BATCH, seq_len=report["model"]["max_seq_len"])


def _pipeline_rank(layout, devices: int, rank: int) -> int:
    return rank // (devices // layout.pipeline_parallel)  # the pipeline dimension is outermost


@pytest.fixture(scope="module")
def runs(mesh_runs: Path) -> Path:
    return mesh_runs


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", NAMES)
def test_predicted_collective_bytes_equal_each_ranks_counted_bytes(runs: Path, name: str) -> None:
    from lightning_p2r.planning.transfers import COLLECTIVES

    report = json.loads((runs / f"{name}.json").read_text())
    model, layout, cluster, workload = _inputs(name, report)
    for rank, every in enumerate(report["counted_bytes"]):
        # What the model-parallel code counts besides the collectives (DTensor's autograd wrapper, the receives
        # matching the sends) is left out.
        counted = {kind: value for kind, value in every.items() if kind in COLLECTIVES}
        predicted = bytes_by_kind(step_transfers(model, layout, cluster, workload, clip_gradients=True,
                                                 pipeline_rank=_pipeline_rank(layout, cluster.devices, rank)),
                                  COLLECTIVES)
        assert counted == predicted, (name, rank, counted, predicted)


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", NAMES)
def test_predicted_parameter_elements_equal_what_each_rank_holds(runs: Path, name: str) -> None:
    report = json.loads((runs / f"{name}.json").read_text())
    model, layout, cluster, workload = _inputs(name, report)
    for rank, holdings in enumerate(report["held"]):
        share = rank_share(model, layout, cluster, workload, _pipeline_rank(layout, cluster.devices, rank))
        held = sum(local for local, _ in holdings.values())
        assert held == stored_elements(model, layout, share), (name, rank)


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [name for name in NAMES if RUNS[name][0].get("strategy", {}).get("expert_parallel")])
def test_predicted_all_to_alls_equal_each_ranks_counted_calls(runs: Path, name: str) -> None:
    """Each all-to-all is one expert-parallel wait the planner prices (``framework.expert_dispatch_calls``): five per
    MoE layer and micro-batch, eight with recompute."""
    report = json.loads((runs / f"{name}.json").read_text())
    model, layout, cluster, workload = _inputs(name, report)
    for rank, every in enumerate(report["counted_calls"]):
        predicted = sum(t.calls for t in step_transfers(
            model, layout, cluster, workload, clip_gradients=True,
            pipeline_rank=_pipeline_rank(layout, cluster.devices, rank)) if t.kind == "all_to_all")
        assert every.get("all_to_all", 0) == predicted, (name, rank, every, predicted)
