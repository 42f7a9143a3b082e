import csv
import math
from pathlib import Path

from helpers import tiny_corpus

from lightning_p2r.benchmarks import offload


def test_offload_benchmark_writes_its_outputs(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LIGHTNING_P2R_CACHE", str(tmp_path / "cache"))
    result = offload.main(["--quick", "--no-peer", "--out", str(tmp_path), "--corpus", tiny_corpus(tmp_path)])
    for name in ("offload.csv", "offload_optimizer.csv", "offload.png"):
        assert (tmp_path / name).stat().st_size > 0
    rows = list(csv.DictReader((tmp_path / "offload.csv").open()))
    assert len(rows) == 5 and all(float(r["tokens_per_s"]) > 0 for r in rows)
    peaks = [float(r["peak_model_MB"]) for r in rows]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[-1]
    assert all(math.isfinite(r["step_ms"]) for r in result["optimizer"])
