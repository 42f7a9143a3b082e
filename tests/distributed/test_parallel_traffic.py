"""The bytes each collective moves under tensor and expert parallelism, counted on 2 gloo processes, equal the
formulas of ``lightning_p2r.strategy.parallel.traffic`` (the parallel benchmark's --quick run)."""

from pathlib import Path

import pytest

from lightning_p2r.benchmarks import parallel


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_counted_bytes_equal_the_formulas(tmp_path: Path) -> None:
    result = parallel.main(["--quick", "--layouts", "tp2,ep2", "--out", str(tmp_path)])
    assert result["mismatched"] == []
    rows = {r["layout"]: r for r in result["rows"]}
    assert rows["tp2"]["all_reduce_bytes"] > 0 and rows["tp2"]["all_gather_bytes"] > 0
    assert rows["ep2"]["all_to_all_bytes"] > 0
    assert (tmp_path / "parallel.csv").is_file() and (tmp_path / "parallel.png").is_file()
