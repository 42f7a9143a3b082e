"""PseudoToReal under 2-process DDP: after delinking, the new parameters are all-reduced and ranks stay equal."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_p2r.measure.run import worker_env

WORKER = Path(__file__).with_name("ddp_delink_worker.py")


def _run(tmp_path: Path, *extra: str) -> list[dict]:
    # Without the launcher variables an earlier in-process fit leaves in this process's environment: an inherited
    # MASTER_PORT made every run of this file bind that one port, which a concurrent test's run could hold.
    result = subprocess.run([sys.executable, str(WORKER), "--out", str(tmp_path), *extra], capture_output=True,
                            text=True, timeout=240, env=worker_env(threads=1))
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_ddp_delink_keeps_ranks_identical(tmp_path: Path) -> None:
    ranks = _run(tmp_path)
    for result in ranks:
        assert result["blocks"] == 4
        assert result["ddp_params"] == result["params"]  # the reducer was rebuilt over the new parameters
        assert result["max_rank_difference"] == 0.0


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_without_rewrapping_ranks_drift_apart(tmp_path: Path) -> None:
    """The negative control: the failure the callback's re-wrap prevents is real."""
    ranks = _run(tmp_path, "--no-rewrap")
    assert ranks[0]["max_rank_difference"] > 0.0


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_ddp_growth_and_upcycling_keep_ranks_identical(tmp_path: Path) -> None:
    """Issue 30: a shallow model grown from 1 to 4 layers, its experts upcycled, under DDP: the re-wrap covers the
    new (and reshaped) parameters."""
    for result in _run(tmp_path, "--growth"):
        assert (result["blocks"], result["layers"]) == (4, 4)
        assert result["ddp_params"] == result["params"]
        assert result["max_rank_difference"] == 0.0
