"""The planner's GPU terms (issue 41 item 2): the expert kernel a cluster's device runs, counted as that kernel's
matmul calls and launches; the cluster's accelerator field; and the two benchmarks that measure the planner on a
device (compute by shape, a seeded draw of models and one-device layouts)."""

import csv
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lightning_p2r.benchmarks import compute_shapes, planner_draw
from lightning_p2r.models.config import M6Config
from lightning_p2r.planning.cluster import Cluster, cluster_from_dict
from lightning_p2r.planning.layout import Layout, Workload, check_layout
from lightning_p2r.planning.model import grouped_experts, layer_matmuls, layer_operator_launches
from lightning_p2r.planning.step_time import estimate_step

MOE = M6Config(vocab_size=512, max_seq_len=64, num_layers=4, dim=64, num_heads=4, num_experts=16, moe_top_k=2)
DENSE = replace(MOE, moe_layers=[])


@pytest.mark.parametrize(("kernel", "accelerator", "precision", "grouped"), [
    ("auto", "cuda", "bf16-mixed", True), ("auto", "cuda", "32-true", False), ("auto", "cpu", "bf16-mixed", False),
    ("grouped", "cpu", "32-true", True), ("loop", "cuda", "bf16-mixed", False)])
def test_the_expert_kernel_is_the_one_the_layer_picks(kernel, accelerator, precision, grouped) -> None:
    assert grouped_experts(replace(MOE, expert_kernel=kernel), accelerator, precision) is grouped


def test_grouped_experts_are_two_matmul_calls_whatever_the_number_of_experts() -> None:
    layer = 0
    assert MOE.is_moe_layer(layer)
    loop_calls = layer_matmuls(MOE, layer)
    assert loop_calls == 3 + 2 * 16 and layer_matmuls(MOE, layer, 4) == 3 + 2 * 4
    assert layer_matmuls(MOE, layer, grouped=True) == layer_matmuls(replace(MOE, num_experts=64), layer,
                                                                    grouped=True) == 5
    assert layer_operator_launches(MOE, layer, grouped=True) < layer_operator_launches(MOE, layer)
    assert layer_matmuls(DENSE, layer, grouped=True) == layer_matmuls(DENSE, layer) == 4


def test_a_gpu_cluster_prices_an_moe_model_in_bf16_on_the_grouped_kernel() -> None:
    gpu = Cluster(devices=1, devices_per_node=1, matmul_overhead=1e-4)
    work = Workload(global_batch=8, seq_len=64, precision="bf16-mixed")
    grouped = estimate_step(MOE, Layout(), gpu, work).compute
    looped = estimate_step(replace(MOE, expert_kernel="loop"), Layout(), gpu, work).compute
    assert grouped < looped
    # Nothing changes for a dense model, for fp32, or on a CPU cluster.
    cpu = replace(gpu, accelerator="cpu")
    assert estimate_step(MOE, Layout(), cpu, work).compute == pytest.approx(looped)
    fp32 = replace(work, precision="32-true")
    assert estimate_step(MOE, Layout(), gpu, fp32).compute == estimate_step(
        replace(MOE, expert_kernel="loop"), Layout(), gpu, fp32).compute
    assert estimate_step(DENSE, Layout(), gpu, work).compute == estimate_step(DENSE, Layout(), cpu, work).compute


def test_the_cluster_names_a_wrong_accelerator() -> None:
    assert cluster_from_dict({"accelerator": "cpu"}).accelerator == "cpu"
    assert Cluster().accelerator == "cuda"  # files written before the field describe GPUs
    with pytest.raises(ValueError, match=r"the file: Cluster.accelerator must be one of \['cuda', 'cpu'\], got 'tpu'"):
        cluster_from_dict({"accelerator": "tpu"}, source="the file")


def test_compute_shapes_times_every_kind_and_counts_the_planners_flops(tmp_path: Path) -> None:
    rows = compute_shapes.main(["--quick", "--device", "cpu", "--out", str(tmp_path)])
    assert {row["kind"] for row in rows} == {"linear", "experts", "attention"}
    assert all(row["seconds"] > 0 and row["tflops"] > 0 for row in rows)
    with (tmp_path / "compute_shapes.csv").open() as file:
        assert len(list(csv.DictReader(file))) == len(rows)
    assert (tmp_path / "compute_shapes.png").stat().st_size > 0
    linear = {"kind": "linear", "rows": 8, "inner": 16, "outer": 32}
    assert compute_shapes.row_flops(linear) == 3 * 2 * 8 * 16 * 32
    assert compute_shapes.row_flops(linear | {"kind": "experts"}) == 2 * compute_shapes.row_flops(linear)
    attention = {"kind": "attention", "rows": 64, "inner": 16, "outer": 32}
    assert compute_shapes.row_flops(attention) == 3 * 2 * 2 * 64 * (16 + 1) / 2 * 32


def test_the_draw_is_seeded_runnable_and_varied() -> None:
    first, again, other = (planner_draw.draw(seed, 24, gpu=True) for seed in (3, 3, 4))
    assert first == again and first != other
    one_device = Cluster(devices=1, devices_per_node=1)
    for item in first:
        check_layout(item.layout, item.config, one_device, item.workload)
    assert len({(d.config.dim, d.config.num_layers, d.config.num_experts, d.workload.seq_len) for d in first}) > 12
    assert {d.layout.offload_fraction for d in first} >= {0.0, 0.5, 1.0}
    assert any(d.config.moe_layers == [] for d in first) and any(d.config.moe_layers != [] for d in first)


def test_a_stored_draw_is_predicted_again_from_its_csv(tmp_path: Path) -> None:
    items = planner_draw.draw(5, 3, gpu=False)
    rows = [planner_draw.row_of(i, item) | {"measured_s": 0.05, "status": "ok"} for i, item in enumerate(items)]
    planner_draw.write_rows(rows, tmp_path / "in" / "planner_draw.csv")
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("accelerator: cpu\ndevices: 1\ndevices_per_node: 1\ndevice_memory: 24GB\ndevice_flops: 1e11\n")
    out = planner_draw.main(["--measured", str(tmp_path / "in" / "planner_draw.csv"), "--cluster", str(cluster),
                             "--out", str(tmp_path / "out")])
    for row, item in zip(out, items):
        assert planner_draw.draw_of_row(row) == item
        expected = estimate_step(item.config, item.layout, cluster_from_dict(
            {"accelerator": "cpu", "devices": 1, "devices_per_node": 1, "device_memory": "24GB",
             "device_flops": 1e11}), item.workload).total
        assert float(row["predicted_s"]) == pytest.approx(expected)
        assert float(row["error_pct"]) == pytest.approx(100 * (expected - 0.05) / 0.05)


def test_the_summary_reports_errors_and_rank_correlation() -> None:
    rows = [{"measured_s": m, "predicted_s": p, "error_pct": 100 * (p - m) / m}
            for m, p in ((1.0, 1.1), (2.0, 1.8), (3.0, 3.3), (4.0, 4.0))]
    result = planner_draw.summary(rows)
    assert result["count"] == 4 and result["max_abs_error_pct"] == pytest.approx(10)
    assert result["median_abs_error_pct"] == pytest.approx(10)
    assert result["spearman"] == pytest.approx(1.0)
    assert planner_draw.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert "median_rounds_spread_pct" not in result  # one round each: no spread to report
    rounds = [r | {"rounds": 3, "measured_min_s": 0.9 * r["measured_s"], "measured_max_s": r["measured_s"] * s}
              for r, s in zip(rows, (1.1, 1.2, 1.3, 1.4))]
    spread = planner_draw.summary(rounds)
    assert spread["median_rounds_spread_pct"] == pytest.approx(35)
    assert spread["max_rounds_spread_pct"] == pytest.approx(50)


def test_the_summary_counts_the_rows_measured_within_their_fitted_range() -> None:
    """Rows whose prediction moves with the fitted terms (low < high) are counted, and those whose measured step
    lies inside [low, high]; a row that counts no fitted term (low == high) is left out."""
    rows = [{"measured_s": m, "predicted_s": p, "error_pct": 100 * (p - m) / m, "predicted_low_s": lo,
             "predicted_high_s": hi}
            for m, p, lo, hi in ((1.0, 1.1, 0.9, 1.3), (2.0, 1.8, 1.7, 1.9), (3.0, 3.3, 3.3, 3.3),
                                 (4.0, 4.0, 3.5, 4.5))]
    result = planner_draw.summary(rows)
    assert (result["rows_with_fitted_range"], result["measured_within_fitted_range"]) == (3, 2)
    assert "rows_with_fitted_range" not in planner_draw.summary([{k: v for k, v in r.items() if "_low" not in k}
                                                                  for r in rows])


def test_a_several_process_draw_takes_layouts_from_the_planners_space_and_reports_per_count(tmp_path: Path) -> None:
    from lightning_p2r.planning.search import candidate_layouts

    items = planner_draw.draw(7, 10, gpu=False, processes=2)
    assert items == planner_draw.draw(7, 10, gpu=False, processes=2)
    two = Cluster(accelerator="cpu", devices=2, devices_per_node=2)
    for item in items:
        assert item.processes == 2 and item.layout in set(candidate_layouts(item.config, two, item.workload))
    assert len({item.layout.describe() for item in items}) > 5
    # The one-process draw of a seed is what it was before several process counts existed.
    assert all(item.processes == 1 for item in planner_draw.draw(7, 3, gpu=False))
    rows = [planner_draw.row_of(i, item) | {"measured_s": 0.05, "status": "ok"}
            for i, item in enumerate(planner_draw.draw(7, 2, gpu=False) + items[:2])]
    planner_draw.write_rows(rows, tmp_path / "in" / "planner_draw.csv")
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("accelerator: cpu\ndevices: 1\ndevices_per_node: 1\ndevice_memory: 24GB\ndevice_flops: 1e11\n")
    out = planner_draw.main(["--measured", str(tmp_path / "in" / "planner_draw.csv"), "--cluster", str(cluster),
                             "--out", str(tmp_path / "out")])
    for row, item in zip(out[2:], items):
        assert planner_draw.draw_of_row(row) == item  # the process count round-trips through the CSV
        predicted = estimate_step(item.config, item.layout, cluster_from_dict(
            {"accelerator": "cpu", "devices": 2, "devices_per_node": 1, "device_memory": "24GB",
             "device_flops": 1e11}), item.workload).total
        assert float(row["predicted_s"]) == pytest.approx(predicted)
    assert set(planner_draw.summary(out)["by_processes"]) == {1, 2}


def test_a_several_process_draw_can_give_a_share_of_its_layouts_recompute_or_offload() -> None:
    """``memory_savers``: the variants ``plan`` tries when a layout does not fit, drawn on a roomy machine too (where
    the search never picks them), each runnable and otherwise one of the planner's layouts; 0 keeps the old draw."""
    from lightning_p2r.planning.search import candidate_layouts

    plain = planner_draw.draw(7, 10, gpu=False, processes=2)
    assert planner_draw.draw(7, 10, gpu=False, processes=2, memory_savers=0.0) == plain
    items = planner_draw.draw(7, 24, gpu=False, processes=2, memory_savers=0.5)
    assert items == planner_draw.draw(7, 24, gpu=False, processes=2, memory_savers=0.5)
    two = Cluster(accelerator="cpu", devices=2, devices_per_node=2)
    saving = [item for item in items if item.layout.recompute or item.layout.offload_fraction > 0]
    assert 4 <= len(saving) < len(items)
    assert any(item.layout.recompute and item.layout.pipeline_parallel > 1 for item in items)
    for item in saving:
        check_layout(item.layout, item.config, two, item.workload)
        bare = replace(item.layout, recompute=False, offload_fraction=0.0)
        assert bare in set(candidate_layouts(item.config, two, item.workload))
    rows = [planner_draw.row_of(i, item) | {"measured_s": 0.05 * (i + 1), "predicted_s": 0.055 * (i + 1),
                                            "error_pct": 10.0} for i, item in enumerate(items)]
    result = planner_draw.summary(rows)
    assert result["memory_savers"]["count"] == len(saving)
    assert "memory_savers" not in planner_draw.summary([row for row, item in zip(rows, items) if item not in saving])
    with pytest.raises(SystemExit):
        planner_draw.main(["--memory-savers", "1.5", "--count", "1"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compute_shapes_on_cuda_runs_the_grouped_kernel(tmp_path: Path) -> None:
    rows = compute_shapes.measure_shapes(torch.device("cuda"), quick=True)
    assert all(row["seconds"] > 0 for row in rows)


def test_rounds_run_the_whole_draw_in_turn_and_each_row_keeps_its_median() -> None:
    """``--rounds``: every draw runs once before any runs again; a row's step is the median of its rounds, with their
    range; a failing draw is recorded once and not run again; past the budget, rows keep what they measured."""
    items = planner_draw.draw(5, 3, gpu=False)
    order: list[int] = []
    slow = iter([0.30, 0.10, 0.50, 0.11, 0.12, 0.90])  # draw 0: 0.30, 0.50, 0.12; draw 1: 0.10, 0.11, 0.90

    def timer(item):
        index = items.index(item)
        order.append(index)
        if index == 2:
            raise RuntimeError("out of memory\nmore")
        return next(slow)

    written = []
    rows = planner_draw.measure_rows(items, timer, rounds=3, after_each=lambda rows: written.append(len(rows)))
    assert order == [0, 1, 2, 0, 1, 0, 1]
    assert [r["rounds"] for r in rows[:2]] == [3, 3]
    assert rows[0]["measured_s"] == pytest.approx(0.30) and rows[0]["measured_min_s"] == pytest.approx(0.12)
    assert rows[1]["measured_s"] == pytest.approx(0.11) and rows[1]["measured_max_s"] == pytest.approx(0.90)
    assert rows[2]["status"] == "failed: RuntimeError: out of memory" and "measured_s" not in rows[2]
    assert written == [3] * 6
    past = planner_draw.measure_rows(items[:2], lambda item: 0.2, rounds=2, budget_s=-1.0)
    assert [row["status"] for row in past] == ["skipped: past --budget-s -1.0"] * 2
    # The run says what the budget left out, beside its summary; nothing when the whole draw ran.
    assert "2 of 2 draws not measured, 0 measured in fewer than 2 rounds" in planner_draw.budget_note(past, 2)
    cut = [rows[0] | {"rounds": 1}, rows[1], rows[2]]  # one row with one round of three; the failed one is not "short"
    assert "0 of 3 draws not measured, 1 measured in fewer than 3 rounds" in planner_draw.budget_note(cut, 3)
    assert planner_draw.budget_note(rows, 3) is None
    with pytest.raises(SystemExit):
        planner_draw.main(["--rounds", "0"])
