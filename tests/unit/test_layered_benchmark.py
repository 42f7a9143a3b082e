import csv
from pathlib import Path

import pytest

from lightning_p2r.benchmarks import layered
from lightning_p2r.benchmarks.layered import COLUMNS

pytestmark = pytest.mark.slow  # runs the benchmark end to end (the README tier skips it)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_layered_benchmark_writes_its_outputs_and_counts(tmp_path: Path) -> None:
    result = layered.main(["--quick", "--out", str(tmp_path), "--micro-batches", "1", "2", "--steps", "3"])
    for name in ("layered.csv", "layered.png"):
        assert (tmp_path / name).stat().st_size > 0
    rows = list(csv.DictReader((tmp_path / "layered.csv").open()))
    assert [(r["mode"], int(r["m"])) for r in rows] == [("standard", 1), ("standard", 2), ("layered", 1),
                                                        ("layered", 2)]
    assert all(column in rows[0] for column in COLUMNS)
    by = {(r["mode"], r["m"]): r for r in result["rows"]}
    assert all(r["tokens_per_s"] > 0 and r["collective_calls"] > 0 and r["h2d_param_bytes"] > 0
               for r in result["rows"])
    for column in ("all_gather_calls", "reduce_scatter_calls", "collective_calls", "collective_bytes",
                   "h2d_param_bytes"):
        assert by[("layered", 2)][column] == by[("layered", 1)][column], column
    # Standard accumulation gathers every block again for each micro-batch, but reduces once per step (the
    # non-final micro-batches skip the reduce-scatter).
    for column in ("all_gather_calls", "h2d_param_bytes"):
        assert by[("standard", 2)][column] == 2 * by[("standard", 1)][column], column
    assert by[("standard", 2)]["reduce_scatter_calls"] == by[("standard", 1)]["reduce_scatter_calls"]
    assert [r["m"] for r in result["ratios"]] == [1, 2]
    assert 0.5 < result["ratios"][1]["collective_calls layered/standard"] < 1.0
