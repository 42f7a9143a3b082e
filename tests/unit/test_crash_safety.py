"""Crash safety (issue 13 item 15): a run killed with SIGKILL during a training step, or in the middle of writing a
checkpoint (single file or sharded), resumes with ``ckpt_path="last"`` from the last complete checkpoint and ends
with weights bit-identical to a run that was never interrupted; nothing half-written is ever loaded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # each kills and relaunches a training process (the README tier skips it)

WORKER = Path(__file__).with_name("crash_worker.py")
STEPS = 5


def _run(spec: dict) -> subprocess.CompletedProcess:
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT", "RANK"):
        env.pop(key, None)
    return subprocess.run([sys.executable, str(WORKER), json.dumps(spec)], capture_output=True, text=True,
                          timeout=240, env=env)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, dict]:
    finals = {}
    for sharded in (False, True):
        root = tmp_path_factory.mktemp(f"uninterrupted_{sharded}")
        result = _run({"root": str(root), "sharded": sharded, "max_steps": STEPS})
        assert result.returncode == 0, result.stderr[-3000:]
        finals[sharded] = torch.load(root / "final.pt", weights_only=True)
    return finals


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("sharded", "kill"), [(False, "step"), (False, "save"), (True, "step"), (True, "save"),
                                               (True, "swap")],
                         ids=["file-step", "file-save", "sharded-step", "sharded-save", "sharded-swap"])
def test_a_killed_run_resumes_from_its_last_complete_checkpoint_to_the_same_weights(
        sharded: bool, kill: str, tmp_path: Path, uninterrupted: dict[bool, dict]) -> None:
    spec = {"root": str(tmp_path), "sharded": sharded, "max_steps": STEPS, "kill": kill, "kill_at": 3}
    killed = _run(spec)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    checkpoints = tmp_path / "checkpoints"
    visible = sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith("."))
    assert visible == ["last.ckpt"]  # whatever was half-written is hidden, never a candidate for "last"
    resumed = _run(spec | {"kill": None, "resume": True})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # The complete checkpoint it resumed from: step 3 after a kill mid-step or mid-swap, step 2 when the save of
    # step 3 was cut.
    restored = "Restored all states from the checkpoint" in resumed.stdout + resumed.stderr
    assert restored
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    expected = uninterrupted[sharded]
    assert final["global_step"] == expected["global_step"] == STEPS
    for name, value in expected["state_dict"].items():
        assert torch.equal(final["state_dict"][name], value), name
    leftovers = [p.name for p in checkpoints.iterdir() if p.name.startswith(".") and p.is_dir()]
    assert len(leftovers) <= 1  # the next save removed what the killed one left (the live target remains)
