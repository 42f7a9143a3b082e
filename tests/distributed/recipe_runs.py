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


def clean_env(tmp_path: Path, cache: Path | None = None) -> dict[str, str]:
    env = os.environ | {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "OMP_NUM_THREADS": "1",
                        "PYTHONUNBUFFERED": "1"}
    if cache is not None:
        env["LIGHTNING_P2R_CACHE"] = str(cache)
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT", "PYTHONWARNINGS"):
        env.pop(key, None)
    return env


def run_command(args: list[str], tmp_path: Path, timeout: int = 360,
                cache: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m lightning_p2r.cli ARGS`` in ``tmp_path``. ``cache``: the package's cache folder (tokenizers and
    prepared corpora, keyed by their inputs), shared by the recipe runs of a session (the ``recipe_cache`` fixture)
    so that the KJV's BPE tokenizer is trained and its corpus prepared once, not by every run (about 6 s each);
    without it, the test's own empty cache."""
    return subprocess.run([sys.executable, "-m", "lightning_p2r.cli", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=timeout, env=clean_env(tmp_path, cache))


def unexpected_warnings(output: str) -> list[str]:
    """The warning lines of ``output`` that the documented allow-list does not name."""
    lines = [line for line in output.replace("\r", "\n").splitlines() if _WARNING_LINE.search(line)]
    return [line for line in lines if not any(re.search(allowed, line) for allowed in ALLOWED_IN_RECIPE_RUNS)]
