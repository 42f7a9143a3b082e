"""How a multi-process job starts and ends (issue 27): a layout the strategy refuses is refused in the launching
process, before any other rank exists, as one line; a rank that fails ends every rank, and the command returns only
after all of them exited, with one message."""

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from recipe_runs import ROOT, clean_env, run_command

WORKER = Path(__file__).with_name("launch_worker.py")


def _alive_with(marker: str) -> list[int]:
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    alive.append(int(entry.name))
            except OSError:
                continue
    return alive


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_refused_layout_is_one_line_from_the_launching_process(tmp_path: Path) -> None:
    result = run_command(["fit", "--config", str(ROOT / "recipes" / "tp_ep_moe.yaml"), "--trainer.devices=3",
                          "--trainer.accelerator=cpu"], tmp_path, timeout=100)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: P2RStrategy(tensor_parallel=2) must divide the number of processes (3): use "
                      "tensor_parallel in [1, 3] or change the devices"]
    output = result.stdout + result.stderr
    assert "Traceback" not in output
    assert "Initializing distributed" not in output and "[rank: 1]" not in output  # no other rank ever started


def _run_worker(tmp_path: Path, fail: str) -> tuple[subprocess.CompletedProcess[str], str]:
    marker = f"p2r-launch-test-{uuid.uuid4().hex}"
    result = subprocess.run([sys.executable, str(WORKER), "--out", str(tmp_path), "--fail", fail, "--marker", marker],
                            capture_output=True, text=True, timeout=150, env=clean_env(tmp_path))
    return result, marker


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_a_rank_failing_alone_ends_every_rank_with_one_message(tmp_path: Path) -> None:
    start = time.monotonic()
    result, marker = _run_worker(tmp_path, "rank1-train")
    assert result.returncode != 0
    assert time.monotonic() - start < 120  # not the collectives' 30-minute timeout
    # Reported once, by the launching process: by its observer, or (when rank 0's collective fails first because
    # its peer went away) as rank 0's error naming rank 1's; the failing rank prints no traceback of its own.
    assert result.stderr.count("rank 1: RuntimeError: rank 1 failed on its own") == 1, result.stderr[-3000:]
    assert result.stderr.count("Traceback") <= 1
    assert _alive_with(marker) == []


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_the_same_error_on_every_rank_is_reported_once(tmp_path: Path) -> None:
    result, marker = _run_worker(tmp_path, "all-setup")
    assert result.returncode != 0
    assert result.stderr.count("Traceback") == 1, result.stderr[-3000:]  # rank 0's, not one per rank
    assert result.stderr.count("ValueError: the test's refusal on every rank") == 1
    assert _alive_with(marker) == []
