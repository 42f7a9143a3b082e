"""Pipeline parallelism on 2 and 4 gloo processes against one process on the same global batch.

The runs come from the shared launches in conftest.py (configurations in mesh_configs.py). Every schedule, looped
stages, ZeRO-3 with offload under the breadth-first schedule, a pseudo model delinked mid-run, ZeRO-1 and ZeRO-3
over two data ranks per stage, and stages split by tensor parallelism (with sequence parallelism and delinking) or
expert parallelism must give one process's losses and gradient norms (clipped at 0.5) within a relative 1e-4, with
each rank holding only its stages; sharded checkpoints move between one process and two pipeline stages.
"""

import json
import re
from pathlib import Path

import pytest
from mesh_configs import PIPELINE_FOUR_PROCESSES, PIPELINE_REFERENCE_OF, PIPELINE_TWO_PROCESSES

TOLERANCE = 1e-4


def _report(runs: Path, name: str) -> dict:
    return json.loads((runs / f"{name}.json").read_text())


def _relative(values: list[float], reference: list[float]) -> float:
    assert values and len(values) <= len(reference), (values, reference)
    return max(abs(v - r) / abs(r) for v, r in zip(values, reference))


def _blocks_held(holdings: dict) -> set[int]:
    return {int(m.group(1)) for name in holdings if (m := re.match(r"transformer\.blocks\.(\d+)\.", name))}


COMPARED = [c["name"] for c in PIPELINE_TWO_PROCESSES + PIPELINE_FOUR_PROCESSES
            if "resume" not in c and "save" not in c and "forget" not in c["name"]]


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", COMPARED)
def test_every_schedule_gives_the_one_process_losses_and_gradient_norms(mesh_runs: Path, name: str) -> None:
    run = _report(mesh_runs, name)
    reference = _report(mesh_runs, PIPELINE_REFERENCE_OF.get(name, "pp_reference"))
    assert run["path"] == "pipeline"
    for key in ("losses", "grad_norms"):
        assert _relative(run[key], reference[key]) < TOLERANCE, (name, key, run[key], reference[key])


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("name", "rank_blocks"), [
    ("pp2_1f1b", [{0, 1}, {2, 3}]),  # two stages of two layers
    ("pp2_looped_bfs_v2_zero3_offload", [{0, 2}, {1, 3}]),  # four stages of one layer, looped: r, r + 2
    ("pp2_delink", [{0, 1}, {2, 3}]),  # after delinking: each rank only its own layers' new blocks
    ("pp2_looped_bfs_zero3_on_4", [{0, 2}, {0, 2}, {1, 3}, {1, 3}]),  # ranks (pipeline, data): 0, 1 hold 0 and 2
    ("pp2_tp2", [{0, 1}, {0, 1}, {2, 3}, {2, 3}]),  # ranks (pipeline, tensor)
])
def test_each_rank_holds_only_its_stages(mesh_runs: Path, name: str, rank_blocks: list[set[int]]) -> None:
    held = _report(mesh_runs, name)["held"]
    assert [_blocks_held(h) for h in held] == rank_blocks
    for rank, holdings in enumerate(held):
        first, last = 0 in rank_blocks[rank], 3 in rank_blocks[rank]
        # The embedding is tied to the head: both ends hold it (its gradients are summed between them).
        assert ("transformer.tok_embeddings.weight" in holdings) == (first or last)
        assert ("transformer.norm.weight" in holdings) == last
    if name in ("pp2_looped_bfs_zero3_on_4", "pp2_tp2"):  # ZeRO-3 over a stage's two data ranks, or split by heads
        for rank, holdings in enumerate(held):
            local, whole = holdings[f"transformer.blocks.{min(rank_blocks[rank])}.attn.qkv.weight"]
            assert local * 2 == whole


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("name", "wrapped"), [
    ("pp2_1f1b", False), ("pp2_saved", False), ("pp2_delink", False), ("pp2_zero1", False),  # a stage alone on its
    # rank, whatever the sharding
    ("pp2_looped_bfs_v2_zero3_offload", True),  # offloaded blocks keep their shards on the host through FSDP2
    ("pp2_looped_bfs_zero3_on_4", True),  # two data ranks per stage
    ("pp2_tp2", True),  # split by heads
])
def test_fsdp2_wraps_stages_only_where_it_has_work(mesh_runs: Path, name: str, wrapped: bool) -> None:
    """Layout.wraps_blocks: FSDP2 over a mesh of one rank only adds its hooks, so such stages stay plain modules
    (their losses and gradients match the one-process run in the tests above all the same)."""
    assert (_report(mesh_runs, name)["fsdp_units"] > 0) == wrapped


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("name", "reference"), [("pp2_1f1b", "pp_reference"), ("pp2_tp2", "pp_reference"),
                                                 ("pp2_looped_bfs_zero3_on_4", "pp_reference_no_balance")])
def test_validation_runs_through_the_pipeline(mesh_runs: Path, name: str, reference: str) -> None:
    run, ref = _report(mesh_runs, name), _report(mesh_runs, reference)
    assert abs(run["val_loss"] - ref["val_loss"]) / ref["val_loss"] < TOLERANCE


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_checkpoints_reshard_between_one_process_and_two_stages(mesh_runs: Path) -> None:
    """Saved after 2 steps on one process (ZeRO-2: a sharded checkpoint) and resumed on two pipeline stages of two
    data ranks each, and saved on two stages and resumed on one process or on two stages again: each continues with
    the uninterrupted run's steps 3 and 4 (the optimizer's group settings reach every stage, though the checkpoint
    stores them with rank 0's parameter names)."""
    for name, reference_name in (("pp2_zero3_resumes_one_process", "pp_reference_no_balance"),
                                 ("one_process_resumes_pp2", "pp_reference"), ("pp2_resumes_pp2", "pp_reference")):
        reference = _report(mesh_runs, reference_name)["losses"]
        resumed = _report(mesh_runs, name)["losses"]
        assert len(resumed) == 2, name
        assert _relative(resumed, reference[2:]) < TOLERANCE, (name, resumed, reference)


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_a_replica_without_the_summed_gradient_fails_the_comparison(mesh_runs: Path) -> None:
    """Negative control: in a pseudo model every stage runs the shared block; if each rank kept only its own stages'
    part of that block's gradient, the norms (and the clipped steps) would differ from one process's."""
    run = _report(mesh_runs, "pp2_pseudo_forgets_replica_sum")
    reference = _report(mesh_runs, "pp_reference_delink")  # pseudo for its first two steps
    assert _relative(run["grad_norms"], reference["grad_norms"]) > 100 * TOLERANCE


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_breadth_first_gathers_each_block_once_per_direction(mesh_runs: Path) -> None:
    """ZeRO-3 on two data ranks per stage, 2 micro-batches, counted in the last step. The looped breadth-first
    schedule runs both micro-batches through a stage in a row: each of a rank's 2 blocks (one per stage) is gathered
    once for their forwards and once for their backwards, plus one gather of the stage root that holds the embedding
    or head: 5. The depth-first 1F1B gathers each of its 2 blocks for every micro-batch's forward and once for the
    backwards: 2 x (2 + 1) + 1 = 7. Both reduce-scatter each unit's gradient once per step."""
    breadth = _report(mesh_runs, "pp2_looped_bfs_zero3_on_4")["counted_calls"]
    depth = _report(mesh_runs, "pp2_zero3_resumes_one_process")["counted_calls"]
    assert [rank["all_gather"] for rank in breadth] == [5] * 4
    assert [rank["all_gather"] for rank in depth] == [7] * 4
    assert [rank["reduce_scatter"] for rank in breadth] == [3] * 4  # 2 blocks + the root with parameters
    assert [rank["reduce_scatter"] for rank in depth] == [3] * 4


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_zero1_partitions_only_over_more_than_one_rank(mesh_runs: Path) -> None:
    """Over a group of one rank ZeRO-1 would keep every state anyway and broadcast each parameter to itself after
    every step (test_planner_counts checks that no broadcast is made): the optimizer stays the plain one."""
    assert _report(mesh_runs, "pp2_zero1")["optimizer"] == "AdamW"
    assert _report(mesh_runs, "pp2_zero1_on_4")["optimizer"] == "ReplicatedZeroOptimizer"
