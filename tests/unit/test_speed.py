"""The machine's present speed: the reference step ``calibrate`` records and ``plan`` times again, and the cluster
priced at that speed (``planning.cluster.at_speed``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from lightning_p2r import M6Config
from lightning_p2r.layout import Layout
from lightning_p2r.planning import Cluster, Workload, estimate_step
from lightning_p2r.planning.cluster import HOST_TIMES, at_speed, load_cluster

STORED = Path(__file__).parents[2] / "docs" / "benchmarks"
MOE = M6Config(vocab_size=128, max_seq_len=64, num_layers=4, dim=64, num_heads=8, num_experts=8, moe_layers=[1, 3],
               moe_top_k=2)
WORK = Workload(global_batch=8, seq_len=64)
LAYOUTS = [Layout(), Layout(offload_fraction=1.0), Layout(sharding="zero3", micro_batches=4),
           Layout(sharding="zero1", pipeline_parallel=2, pipeline_schedule="interleaved_1f1b", stages_per_rank=2,
                  micro_batches=4),
           Layout(sharding="zero2", tensor_parallel=2, sequence_parallel=True, micro_batches=2),
           Layout(sharding="zero1", expert_parallel=2, micro_batches=4, accumulation="layered")]


def _calibrated(processes: int) -> Cluster:
    """A file ``lightning-p2r calibrate`` wrote on a 2-core CPU machine (fitted terms and their spread included)."""
    return load_cluster(STORED / f"planner_user_xeon_seed151_cluster-{processes}.yaml")


@pytest.mark.parametrize("ratio", [0.8, 1.25])
def test_a_cpu_clusters_every_step_scales_by_the_speed_ratio(ratio) -> None:
    for processes, layouts in ((1, LAYOUTS[:2]), (2, LAYOUTS[2:])):
        calibrated = _calibrated(processes)
        slower = at_speed(calibrated, ratio)
        for layout in layouts:
            before = estimate_step(MOE, layout, calibrated, WORK)
            after = estimate_step(MOE, layout, slower, WORK)
            assert after.total == pytest.approx(ratio * before.total, rel=1e-9), layout.describe()
        assert (slower.device_memory, slower.host_memory_per_node) == (calibrated.device_memory,
                                                                       calibrated.host_memory_per_node)
        assert slower.fitted_spread.keys() == calibrated.fitted_spread.keys()
        for name, (low, high) in slower.fitted_spread.items():
            assert (low, high) == pytest.approx([ratio * v for v in calibrated.fitted_spread[name]])


def test_beside_gpus_only_the_hosts_fixed_costs_move() -> None:
    gpus = Cluster(devices=8, devices_per_node=8, operator_overhead=5e-6, step_overhead=2e-3, stage_overhead=1e-4,
                   reference_step_seconds=0.01)
    slower = at_speed(gpus, 1.5)
    changed = {f.name for f in dataclasses.fields(Cluster) if getattr(slower, f.name) != getattr(gpus, f.name)}
    assert changed <= {*HOST_TIMES, "reference_step_seconds"}
    assert {"operator_overhead", "step_overhead", "stage_overhead", "reference_step_seconds"} <= changed
    assert slower.device_flops == gpus.device_flops and slower.intra_node_bandwidth == gpus.intra_node_bandwidth
    big = M6Config(vocab_size=32000, max_seq_len=1024, num_layers=8, dim=1024, num_heads=16, moe_layers=[])
    work = Workload(global_batch=64, seq_len=1024, precision="bf16-mixed")
    layout = Layout(sharding="zero3", micro_batches=2)
    before, after = (estimate_step(big, layout, c, work).total for c in (gpus, slower))
    assert before < after < 1.5 * before


def test_a_multi_node_cpu_clusters_network_does_not_move() -> None:
    nodes = Cluster(accelerator="cpu", devices=4, devices_per_node=2, inter_node_bandwidth=1e9,
                    inter_node_latency=2e-5)
    slower = at_speed(nodes, 2.0)
    assert (slower.inter_node_bandwidth, slower.inter_node_latency) == (1e9, 2e-5)
    assert slower.intra_node_bandwidth == nodes.intra_node_bandwidth / 2


@pytest.mark.parametrize("ratio", [0.0, -1.0, float("nan"), float("inf")])
def test_a_ratio_that_is_not_a_speed_is_refused(ratio) -> None:
    with pytest.raises(ValueError, match="speed ratio"):
        at_speed(Cluster(), ratio)


def test_a_file_names_its_reference_step_and_machine_or_is_refused(tmp_path) -> None:
    from lightning_p2r.planning.cluster import write_cluster

    cluster = dataclasses.replace(_calibrated(1), reference_step_seconds=0.0142, calibrated_on="box / a CPU")
    write_cluster(cluster, tmp_path / "c.yaml")
    assert load_cluster(tmp_path / "c.yaml") == cluster
    with pytest.raises(ValueError, match="calibrated_on must be a string"):
        Cluster(calibrated_on=3)
    with pytest.raises(ValueError, match="reference_step_seconds"):
        Cluster(reference_step_seconds=-1.0)


RECIPES = Path(__file__).parents[2] / "recipes"


def _plan_csv(tmp_path: Path, cluster_file: Path, *options: str) -> dict[str, float]:
    """``plan`` on the quickstart with ``cluster_file``: each fitting layout's step."""
    import csv

    from lightning_p2r.cli import main

    out = tmp_path / "plan.csv"
    main(["plan", "--cluster", str(cluster_file), "--config", str(RECIPES / "quickstart.yaml"), "--csv", str(out),
          *options])
    return {row["layout"]: float(row["step_s"]) for row in csv.DictReader(out.open())}


def test_plan_prices_at_the_speed_the_reference_step_runs_at_now(tmp_path, capsys, monkeypatch) -> None:
    """A file calibrated on this machine is re-timed: the reference step taking 1.3x its recorded time makes every
    step 1.3x; --no-speed-check, a file from another machine (which says so) and one without a reference step (a
    hand-written file: nothing to say) are priced as they are."""
    from lightning_p2r.measure import speed
    from lightning_p2r.planning.cluster import write_cluster

    here = dataclasses.replace(_calibrated(1), reference_step_seconds=0.010, calibrated_on=speed.machine_name("cpu"))
    write_cluster(here, tmp_path / "here.yaml")
    monkeypatch.setattr(speed, "reference_step_seconds", lambda device="cpu": 0.013)
    unchecked = _plan_csv(tmp_path, tmp_path / "here.yaml", "--no-speed-check")
    assert "speed check" not in capsys.readouterr().out
    checked = _plan_csv(tmp_path, tmp_path / "here.yaml")
    out = capsys.readouterr().out
    assert "took 13 ms, 10 ms when" in out and "1.30x slower now" in out and "calibrate again" in out
    assert checked.keys() == unchecked.keys()
    assert all(checked[name] == pytest.approx(1.3 * unchecked[name], rel=2e-3) for name in checked)  # 3 digits

    elsewhere = dataclasses.replace(here, calibrated_on="another-host / another CPU")
    write_cluster(elsewhere, tmp_path / "elsewhere.yaml")
    as_filed = _plan_csv(tmp_path, tmp_path / "elsewhere.yaml")
    assert "calibrated on another-host / another CPU, this is" in capsys.readouterr().out
    assert as_filed == unchecked
    write_cluster(dataclasses.replace(here, reference_step_seconds=0.0), tmp_path / "old.yaml")
    as_filed = _plan_csv(tmp_path, tmp_path / "old.yaml")
    assert "speed check" not in capsys.readouterr().out and as_filed == unchecked


def test_a_small_drift_is_priced_without_the_advice_to_calibrate_again(monkeypatch) -> None:
    from lightning_p2r.measure import speed

    here = Cluster(accelerator="cpu", reference_step_seconds=0.010, calibrated_on=speed.machine_name("cpu"))
    monkeypatch.setattr(speed, "reference_step_seconds", lambda device="cpu": 0.0095)
    ratio, line = speed.present_speed(here)
    assert ratio == pytest.approx(0.95) and "1.05x faster now" in line and "calibrate again" not in line


def test_calibrate_says_when_the_machines_speed_moved_while_it_measured() -> None:
    from lightning_p2r.measure.calibrate import speed_moved

    assert speed_moved(0.010, 0.0108) is None and speed_moved(0.010, 0.0092) is None
    assert "+25%" in speed_moved(0.010, 0.0125) and "calibrate again" in speed_moved(0.010, 0.0125)
    assert "-20%" in speed_moved(0.010, 0.008)


def test_the_reference_step_is_a_short_repeatable_timing() -> None:
    from lightning_p2r.measure.speed import reference_step_seconds

    first, second = reference_step_seconds(rounds=1, iters=3), reference_step_seconds(rounds=1, iters=3)
    assert 1e-4 < first < 1.0 and 1e-4 < second < 1.0
    assert 0.25 < first / second < 4  # the same work: a loose bound, a shared test machine's timings move


def test_the_draw_prices_each_row_at_the_speed_it_ran_at(tmp_path) -> None:
    """``planner_draw --speed-check``: the reference step is timed before every run, a row keeps its median, and the
    row is priced at (that / the file's reference) x the file's speed, the file's own prediction kept beside it; the
    summary scores both."""
    from lightning_p2r.benchmarks import planner_draw
    from lightning_p2r.planning.cluster import write_cluster

    items = planner_draw.draw(5, 3, gpu=False)
    references = iter([0.011, 0.012, 0.013, 0.015, 0.016, 0.020])  # round 1: rows 0-2, round 2: rows 0-2
    rows = planner_draw.measure_rows(items, lambda item: 0.05, rounds=2, reference=lambda: next(references))
    assert [row["reference_s"] for row in rows] == pytest.approx([0.013, 0.014, 0.0165])
    cluster = dataclasses.replace(_calibrated(1), reference_step_seconds=0.010)
    write_cluster(cluster, tmp_path / "one.yaml")
    planner_draw.predict(rows, [load_cluster(tmp_path / "one.yaml")])
    for row, item in zip(rows, items):
        file_step = estimate_step(item.config, item.layout, cluster, item.workload).total
        assert row["predicted_file_s"] == pytest.approx(file_step)
        assert row["speed_ratio"] == pytest.approx(row["reference_s"] / 0.010)
        assert row["predicted_s"] == pytest.approx(row["speed_ratio"] * file_step)
        assert row["predicted_low_s"] <= row["predicted_s"] <= row["predicted_high_s"]
    result = planner_draw.summary(rows)
    assert result["speed_ratio_range"] == pytest.approx([1.3, 1.65])
    at_file = result["at_the_files_speed"]
    assert at_file["count"] == 3 and "at_the_files_speed" not in at_file
    assert at_file["max_abs_error_pct"] == pytest.approx(max(abs(r["error_file_pct"]) for r in rows))
    # Re-predicted from its CSV (strings), and without a reference step in the file: the file's own prediction only.
    planner_draw.write_rows(rows, tmp_path / "draw.csv")
    planner_draw.predict(stored := planner_draw.main(["--measured", str(tmp_path / "draw.csv"), "--cluster",
                                                       str(tmp_path / "one.yaml"), "--out", str(tmp_path / "o")]),
                         [dataclasses.replace(cluster, reference_step_seconds=0.0)])
    assert all("speed_ratio" not in row for row in stored)
    assert "at_the_files_speed" not in planner_draw.summary(stored)
