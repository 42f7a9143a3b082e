import csv
from pathlib import Path

import pytest

from lightning_p2r.benchmarks import capacity

pytestmark = pytest.mark.slow  # runs the benchmark end to end (the README tier skips it)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_capacity_benchmark_writes_its_outputs(tmp_path: Path) -> None:
    result = capacity.main(["--quick", "--out", str(tmp_path), "--layouts", "none", "zero3", "--layers", "1",
                            "--memory-limit", "64GiB"])
    for name in ("capacity.csv", "capacity.png"):
        assert (tmp_path / name).stat().st_size > 0
    rows = list(csv.DictReader((tmp_path / "capacity.csv").open()))
    assert [(r["layout"], r["rank"]) for r in rows] == [("none", "0"), ("zero3", "0"), ("zero3", "1")]
    assert all(r["steps"] == 2 and r["fits"] and r["setup_growth_MiB"] >= 0 and r["peak_MiB"] > 0
               for r in result["rows"])
    assert [s["largest_layers"] for s in result["summary"]] == [1, 1]
    # A limit below what a Python process with torch holds: nothing fits, and the summary says so.
    tight = capacity._summary([dict(r, fits=False) for r in result["rows"]], ["none", "zero3"], 1)
    assert [s["largest_layers"] for s in tight] == [None, None]
