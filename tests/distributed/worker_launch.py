"""Starting a distributed test's worker script: one launch runs a list of configurations on N CPU processes."""

import json
import subprocess
import sys
from pathlib import Path

from lightning_p2r.measure.run import worker_env


def launch_configs(worker: Path, out: Path, devices: int, configs: list[dict], timeout: int = 420) -> None:
    """Run ``worker --out OUT --devices N --configs JSON`` (Lightning's launcher starts the other ranks by running
    it again) with one OpenMP thread per process and no inherited launcher variables; fail with its stderr."""
    result = subprocess.run([sys.executable, str(worker), "--out", str(out), "--devices", str(devices),
                             "--configs", json.dumps(configs)], capture_output=True, text=True, timeout=timeout,
                            env=worker_env(threads=1))
    assert result.returncode == 0, result.stderr[-6000:]
