"""The planner's cross-validation protocol (its pure parts: the draw, the fit, the scores) and the framework terms of
the cost model."""

import math

import pytest

from lightning_p2r.benchmarks import planner_cv
from lightning_p2r.models.config import M6Config
from lightning_p2r.planning import Cluster, Workload, estimate_step
from lightning_p2r.planning.framework import (
    FITTED,
    MEASURED,
    extra_lightning_batches,
    framework_counts,
    framework_seconds,
    hooked_module_passes,
    pipeline_stage_actions,
    tensor_parallel_module_passes,
)
from lightning_p2r.planning.layout import Layout
from lightning_p2r.planning.share import rank_share

CONFIG = M6Config(vocab_size=64, max_seq_len=16, num_layers=4, dim=16, num_heads=2, moe_layers=[], init_seed=0)
WORKLOAD = Workload(global_batch=8, seq_len=16)


def _share(layout: Layout, devices: int):
    return rank_share(CONFIG, layout, Cluster(devices=devices, devices_per_node=devices), WORKLOAD)


def test_extra_lightning_batches_count_only_the_trainers_accumulation() -> None:
    assert extra_lightning_batches(Layout(micro_batches=4)) == 3
    assert extra_lightning_batches(Layout(micro_batches=4, accumulation="layered")) == 0
    assert extra_lightning_batches(Layout(micro_batches=4, pipeline_parallel=2)) == 0


def test_hooked_modules_are_the_blocks_and_a_root_per_micro_batch_where_blocks_run_under_hooks() -> None:
    assert hooked_module_passes(Layout(), _share(Layout(), 1), 1) == 0  # plain single process
    assert hooked_module_passes(Layout(), _share(Layout(), 2), 2) == 0  # DDP
    zero3 = Layout(sharding="zero3", micro_batches=2)
    assert hooked_module_passes(zero3, _share(zero3, 2), 2) == 2 * (4 + 1)
    assert hooked_module_passes(zero3, _share(zero3, 1), 1) == 2 * (4 + 1)  # FSDP2 on one process too
    layered = Layout(accumulation="layered", micro_batches=4)
    assert hooked_module_passes(layered, _share(layered, 1), 1) == 0  # the layered executor's plain loop
    assert hooked_module_passes(layered, _share(layered, 2), 2) == 4 * 5  # layered across ranks runs on FSDP2
    offloaded = Layout(accumulation="layered", micro_batches=4, offload_fraction=0.5)
    assert hooked_module_passes(offloaded, _share(offloaded, 1), 1) == 4 * 5
    pipeline = Layout(pipeline_parallel=2, micro_batches=2)
    assert hooked_module_passes(pipeline, _share(pipeline, 2), 2) == 0  # a stage alone on its rank: plain modules
    assert hooked_module_passes(pipeline, _share(pipeline, 4), 4) == 2 * (2 + 1)  # two data ranks: the rank's blocks
    for wrapped in (Layout(pipeline_parallel=2, micro_batches=2, offload_fraction=0.5),
                    Layout(pipeline_parallel=2, micro_batches=2, tensor_parallel=2)):
        devices = 2 * wrapped.tensor_parallel
        assert hooked_module_passes(wrapped, _share(wrapped, devices), devices) == 2 * (2 + 1)


def test_pipeline_actions_and_tensor_parallel_operators() -> None:
    assert pipeline_stage_actions(Layout()) == 0
    assert pipeline_stage_actions(Layout(pipeline_parallel=2, stages_per_rank=2, micro_batches=4,
                                         pipeline_schedule="looped_bfs")) == 16
    # Per layer the two attention projections and the FFN's two linears; the embedding and the head; three
    # forwards' worth per micro-batch.
    tp = Layout(tensor_parallel=2, micro_batches=2)
    assert tensor_parallel_module_passes(CONFIG, tp, _share(tp, 2)) == 3 * 2 * (4 * 4 + 2)
    assert tensor_parallel_module_passes(CONFIG, Layout(), _share(Layout(), 2)) == 0
    # Sequence parallelism splits the two norms too, and the final norm.
    sp = Layout(tensor_parallel=2, sequence_parallel=True)
    assert tensor_parallel_module_passes(CONFIG, sp, _share(sp, 2)) == 3 * (6 * 4 + 3)
    # An expert layer's loop runs on local shards: its DTensor calls do not grow with the experts.
    moe = {n: M6Config(vocab_size=64, max_seq_len=16, num_layers=4, dim=16, num_heads=2, num_experts=n,
                       moe_layers=[1, 3], init_seed=0) for n in (2, 16)}
    two = Cluster(devices=2, devices_per_node=2)
    passes = {n: tensor_parallel_module_passes(config, tp, rank_share(config, tp, two, WORKLOAD))
              for n, config in moe.items()}
    assert passes[2] == passes[16] == 3 * 2 * (4 * 4 + 2)
    # The second pipeline stage runs the head, not the embedding.
    pipeline = Layout(tensor_parallel=2, pipeline_parallel=2, micro_batches=2)
    last = rank_share(CONFIG, pipeline, Cluster(devices=4, devices_per_node=4), WORKLOAD, 1)
    assert tensor_parallel_module_passes(CONFIG, pipeline, last) == 3 * 2 * (4 * len(last.layers) + 1)


def test_the_fitted_counts_stretch_with_cpu_oversubscription_and_cpu_collectives_wait() -> None:
    import dataclasses

    from lightning_p2r.measure.calibrate import cpu_oversubscription

    assert cpu_oversubscription(4, 1, 2) == 2.0
    assert cpu_oversubscription(1, 1, 2) == cpu_oversubscription(2, 1, 2) == 1.0
    with pytest.raises(ValueError, match="cores"):
        cpu_oversubscription(2, 1, 0)
    with pytest.raises(ValueError, match="cpu_oversubscription"):
        Cluster(cpu_oversubscription=0.5)
    layout = Layout(sharding="zero3", micro_batches=4)
    gpu = Cluster(devices=4, devices_per_node=4)
    cpu = dataclasses.replace(gpu, overlap_collectives=False)
    shared = dataclasses.replace(cpu, cpu_oversubscription=2.0)
    on_gpu, on_cpu, oversubscribed = (framework_counts(CONFIG, layout, c, WORKLOAD) for c in (gpu, cpu, shared))
    # ZeRO-3's gathers and reductions overlap compute on GPUs; on a CPU they are waited for like the others.
    assert on_gpu["blocking_collective_overhead"] == 0 < on_cpu["blocking_collective_overhead"]
    # The measured terms were measured on the oversubscribed processes: only the fitted counts stretch.
    assert on_cpu["module_hook_overhead"] > 0
    assert oversubscribed == on_cpu | {k: 2 * v for k, v in on_cpu.items() if k in FITTED}


def test_framework_seconds_are_counts_times_the_clusters_constants_and_join_the_step() -> None:
    layout = Layout(sharding="zero3", micro_batches=2)
    plain = Cluster(devices=2, devices_per_node=2)
    fitted = Cluster(devices=2, devices_per_node=2, batch_overhead=0.01, module_hook_overhead=0.001)
    counts = framework_counts(CONFIG, layout, fitted, WORKLOAD)
    assert counts == {"batch_overhead": 1, "module_hook_overhead": 10, "stage_overhead": 0, "dtensor_overhead": 0,
                      "blocking_collective_overhead": 0, "expert_wait_overhead": 0}
    assert framework_seconds(CONFIG, layout, plain, WORKLOAD) == 0
    assert framework_seconds(CONFIG, layout, fitted, WORKLOAD) == pytest.approx(0.02)
    difference = estimate_step(CONFIG, layout, fitted, WORKLOAD).total - estimate_step(CONFIG, layout, plain,
                                                                                        WORKLOAD).total
    assert difference == pytest.approx(0.02)


def test_fsdp2_hooks_are_measured_per_hooked_module_and_micro_batch() -> None:
    import torch

    from lightning_p2r.measure.collective_probes import one_process_hooks
    from lightning_p2r.measure.module_hooks import hook_call_overhead

    assert "module_hook_overhead" in MEASURED and "module_hook_overhead" not in FITTED
    # 13 hooked modules x 4 micro-batches took 52 ms more than the plain stack: 1 ms each.
    assert hook_call_overhead(0.010, 0.062, 13, 4) == pytest.approx(1e-3)
    assert hook_call_overhead(0.010, 0.009, 13, 4) == 0.0  # noise never makes it negative
    with pytest.raises(ValueError, match="hooked_modules"):
        hook_call_overhead(0.01, 0.02, 0, 4)
    # The microbenchmark itself, on one process (a process group of its own for the while): a cost per module, far
    # less than a second (it is a difference of two timings floored at 0, so a busy machine may read it as 0).
    seconds = one_process_hooks(torch.device("cpu"), quick=True)
    assert 0 <= seconds < 0.05


def test_spearman_and_the_nonnegative_fit() -> None:
    assert planner_cv.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1)
    assert planner_cv.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1)
    assert planner_cv.spearman([1, 2, 2], [1, 2, 3]) == pytest.approx(math.sqrt(3) / 2)
    assert math.isnan(planner_cv.spearman([1, 2], [1, 2]))
    # residual = 2 * x0 (x1 would need a negative coefficient: the fit leaves it at zero)
    features = [[1, 1], [2, 0], [3, 2], [4, 1]]
    coefficients = planner_cv.fit_nonnegative(features, [2.0 * f[0] for f in features])
    assert coefficients == pytest.approx([2.0, 0.0])
    assert planner_cv.fit_nonnegative([[1.0], [2.0]], [-1.0, -2.0]) == [0.0]


def test_the_draw_is_seeded_split_in_halves_and_from_the_planners_space() -> None:
    first, again = planner_cv.sample_layouts(3), planner_cv.sample_layouts(3)
    assert [(d["model"], d["processes"], d["layout"], d["half"]) for d in first] == \
        [(d["model"], d["processes"], d["layout"], d["half"]) for d in again]
    assert len(first) >= 16 and {d["processes"] for d in first} == {1, 2, 4}
    assert {d["model"] for d in first} == set(planner_cv.MODELS)
    halves = [d["half"] for d in first]
    assert abs(halves.count("A") - halves.count("B")) <= 1
    for d in first:
        assert d["layout"] in planner_cv.layout_pool(d["model"], d["processes"])
        assert planner_cv.layout_of(planner_cv.layout_options(d["layout"])) == d["layout"]
    for seed in range(4):  # every model-parallel dimension drawn twice or more is in both halves
        draw = planner_cv.sample_layouts(seed)
        for dimension in ("tp", "ep", "pp"):
            halves = [d["half"] for d in draw if dimension in planner_cv.parallel_kind(d["layout"])]
            if len(halves) >= 2:
                assert set(halves) == {"A", "B"}, (seed, dimension, halves)


def test_the_parallel_kind_names_the_model_parallel_dimensions() -> None:
    assert planner_cv.parallel_kind(Layout(sharding="zero3", micro_batches=4)) == "data"
    assert planner_cv.parallel_kind(Layout(tensor_parallel=2, pipeline_parallel=2)) == "tp+pp"
    assert planner_cv.parallel_kind(Layout(expert_parallel=2)) == "ep"


def test_cross_validation_scores_only_the_held_out_half() -> None:
    rows = []
    for i in range(8):
        measured = 0.1 * (i + 1)
        rows.append({"model": "dense" if i % 2 else "moe", "processes": 1, "half": "AB"[i % 2],
                     "measured_s": measured, "base_s": measured - 0.05 * (i % 3),
                     "feature_stage_overhead": 0, "feature_dtensor_overhead": i % 3,
                     "feature_blocking_collective_overhead": 0, "feature_expert_wait_overhead": 0})
    result = planner_cv.cross_validate(rows)
    assert result["no fitted terms, half A"]["max_abs_error_pct"] > 10  # the base model misses the DTensor term
    for direction in ("fit A, test B", "fit B, test A"):
        scores = result[direction]
        assert scores["coefficients"]["dtensor_overhead"] == pytest.approx(0.05)
        assert scores["max_abs_error_pct"] == pytest.approx(0, abs=1e-6)
        assert scores["worst_best_regret_pct"] == pytest.approx(0)
    assert {r["fitted_on"] for r in rows if r["half"] == "A"} == {"B"}
    planner_cv.print_scores(result | {"passes": {"layouts": 8, "median_pct": 1.0, "max_pct": 2.0}})
    two_passes = [{"model": "dense", "processes": 1, "layout": "none", "pass1_s": 0.2, "pass2_s": 0.1}]
    assert planner_cv.passes_spread(two_passes) == {"layouts": 1, "median_pct": 100.0, "max_pct": 100.0}
    assert planner_cv.passes_spread(rows) == {}


def test_projection_bands_come_from_the_held_out_errors(tmp_path) -> None:
    import json

    from lightning_p2r.benchmarks.projections import band, cross_validated_bands, with_bands

    assert band(10.0, 25) == pytest.approx((8.0, 10 / 0.75))
    assert band(10.0, 100)[1] == math.inf
    path = tmp_path / "scores.json"
    assert cross_validated_bands(path) == {}
    path.write_text(json.dumps({"no fitted terms, half A": {"median_abs_error_pct": 50, "max_abs_error_pct": 90},
                                "fit A, test B": {"median_abs_error_pct": 12, "max_abs_error_pct": 30},
                                "fit B, test A": {"median_abs_error_pct": 15, "max_abs_error_pct": 25}}))
    bands = cross_validated_bands(path)
    assert bands == {"typical": 15, "worst": 30}
    other = tmp_path / "planner_cv_seed0" / "scores.json"
    other.parent.mkdir()
    other.write_text(json.dumps({"fit A, test B": {"median_abs_error_pct": 11, "max_abs_error_pct": 45}}))
    assert cross_validated_bands([path, other, tmp_path / "absent.json"]) == {"typical": 15, "worst": 45}
    rows = [{"step_s": 10.0}, {"layout": "none fits"}]
    with_bands(rows, bands)
    assert rows[0]["step_s_worst_band"] == "7.69-14.3" and "step_s_typical_band" not in rows[1]


def test_the_projections_read_every_stored_cross_validation(tmp_path) -> None:
    from lightning_p2r.benchmarks.projections import stored_cross_validations

    (tmp_path / "planner_cv_seed0_24").mkdir()
    (tmp_path / "planner_cv_seed0_24" / "planner_cv_scores.json").write_text("{}")
    assert stored_cross_validations(tmp_path) == [tmp_path / "planner_cv_scores.json",
                                                  tmp_path / "planner_cv_seed0_24" / "planner_cv_scores.json"]


def test_repeatability_compares_the_same_layouts_of_two_runs() -> None:
    now = [{"model": "dense", "processes": 1, "layout": "none", "measured_s": 0.2},
           {"model": "moe", "processes": 2, "layout": "tp2", "measured_s": 0.3}]
    earlier = [{"model": "dense", "processes": "1", "layout": "none", "measured_s": "0.1"},
               {"model": "moe", "processes": "2", "layout": "tp2", "measured_s": "0.3"},
               {"model": "deep", "processes": "4", "layout": "pp2", "measured_s": "nan"}]
    assert planner_cv.repeatability(now, earlier) == {"layouts": 2, "median_pct": 50.0, "max_pct": 100.0}
    assert planner_cv.repeatability(now, []) == {}


def test_best_of_keeps_the_faster_of_each_calibrated_constant() -> None:
    slow = Cluster(devices=2, devices_per_node=2, device_flops=1e10, operator_overhead=2e-5, intra_node_latency=1e-4)
    fast = Cluster(devices=2, devices_per_node=2, device_flops=2e10, operator_overhead=3e-5, intra_node_latency=5e-5)
    best = planner_cv.best_of(slow, fast)
    assert (best.device_flops, best.operator_overhead, best.intra_node_latency) == (2e10, 2e-5, 5e-5)
    assert best.devices == 2 and best.overlap_collectives == slow.overlap_collectives
