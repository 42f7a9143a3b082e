"""How the GPU script and the step profile turn raw timestamps into per-step figures."""

import math
from pathlib import Path

import pytest

from lightning_p2r.benchmarks.gpu import _median_step
from lightning_p2r.benchmarks.step_profile import merged_length


def test_median_step_counts_optimizer_steps_not_batches() -> None:
    # Batch ends of 4 accumulated batches per optimizer step: steps end at 4, 8, 12, 16 (and are 4 s apart), the
    # batches inside them 1 s apart. After one warm-up step the median step is 4 s, not 1 s.
    ends = [float(t) for t in range(1, 17)]
    assert _median_step(ends, warmup=1, batches_per_step=4) == 4.0
    assert _median_step(ends, warmup=1) == 1.0
    assert _median_step([0.0, 1.0, 3.0, 6.0, 10.0], warmup=1) == 3.0


def test_merged_length_counts_overlaps_once() -> None:
    assert merged_length([]) == 0.0
    assert merged_length([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0
    assert merged_length([(5.0, 6.0), (0.0, 10.0), (2.0, 3.0)]) == 10.0


@pytest.mark.slow
def test_step_profile_reports_per_step_totals_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_p2r.benchmarks import step_profile

    totals = step_profile.main(["--device", "cpu", "--out", str(tmp_path), "--layers", "1", "--dim", "32",
                                "--heads", "2", "--experts", "4", "--top-k", "1", "--seq-len", "16", "--batch", "2",
                                "--micro-batches", "2", "--vocab", "64", "--offload-fraction", "0"])
    assert totals["wall_ms"] > 0 and totals["aten_ops"] > 0 and math.isclose(totals["device_busy_ms"], 0.0)
    rows = (tmp_path / "step_profile.csv").read_text().splitlines()
    assert rows[0].startswith("wall_ms,") and rows[1].split(",")[6] == "(step)"
    assert any("aten::mm" in row or "aten::_grouped_mm" in row or "aten::addmm" in row for row in rows)
    assert "by self_host_ms" in capsys.readouterr().out
