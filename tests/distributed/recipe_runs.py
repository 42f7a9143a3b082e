"""Running a recipe through the command line, as a user does, and reading what it printed. The command runs as
``python -m lightning_p2r.cli`` (what the ``lightning-p2r`` console script calls), so that under the suite's warm
interpreters it starts without importing; test_cli.py runs the console script itself."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from lightning_p2r.console.known_warnings import ALLOWED_IN_RECIPE_RUNS

ROOT = Path(__file__).resolve().parents[2]

# Python's warning lines ("path.py:12: UserWarning: ..." or, with Lightning's format, "path.py:12: ..."), W&B's
# warnings and Lightning's tips.
_WARNING_LINE = re.compile(r"^\S+\.py:\d+: |Warning: |^wandb: WARNING|Tip: ", re.MULTILINE)


def clean_env(tmp_path: Path) -> dict[str, str]:
    env = os.environ | {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "OMP_NUM_THREADS": "1",
                        "PYTHONUNBUFFERED": "1"}
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT", "PYTHONWARNINGS"):
        env.pop(key, None)
    return env


def run_command(args: list[str], tmp_path: Path, timeout: int = 360) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lightning_p2r.cli", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=timeout, env=clean_env(tmp_path))


def unexpected_warnings(output: str) -> list[str]:
    """The warning lines of ``output`` that the documented allow-list does not name."""
    lines = [line for line in output.replace("\r", "\n").splitlines() if _WARNING_LINE.search(line)]
    return [line for line in lines if not any(re.search(allowed, line) for allowed in ALLOWED_IN_RECIPE_RUNS)]
