"""Warm interpreters for the suite's processes (``server.py`` explains what a forked child reproduces and what it
cannot). :func:`start` launches the servers and writes the stand-in executable that tests get as ``sys.executable``.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

PRELOADED = ("torch", "lightning.pytorch", "lightning.pytorch.cli", "transformers", "transformers.modeling_utils",
             "wandb", "wandb.sdk.launch", "litdata", "lightning_p2r", "lightning_p2r.strategy", "lightning_p2r.module",
             "lightning_p2r.causal_lm", "lightning_p2r.cli", "lightning_p2r.data")
"""What the suite's processes import (read from what children imported after the fork: W&B and litdata by most
commands and benchmark workers; W&B's launch package by every run that starts a W&B run): a child of the server starts
with these done."""


class WarmPython:
    """Two servers (different string-hash seeds, alternate ranks) and the stand-in executable that asks them."""

    def __init__(self, folder: Path, real_python: str = sys.executable, servers: int = 2,
                 preloaded: tuple[str, ...] = PRELOADED) -> None:
        self.folder, self.real_python = folder, real_python
        self.sockets = [str(folder / f"server-{i}.sock") for i in range(servers)]
        self.executable = folder / "python"
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        self.logs = [open(folder / f"server-{i}.log", "w") for i in range(servers)]
        self.servers = [subprocess.Popen([real_python, str(HERE / "server.py"), path, str(self.executable),
                                          ",".join(preloaded)], stdin=subprocess.PIPE, stdout=log,
                                         stderr=subprocess.STDOUT, env=env, text=True)
                        for path, log in zip(self.sockets, self.logs)]
        self._write_executable()

    def _write_executable(self) -> None:
        self.executable.write_text(
            f"#!{self.real_python} -IS\n"
            f"import sys; sys.path.insert(0, {str(HERE)!r}); from client import main\n"
            f"main({self.real_python!r}, {self.sockets!r})\n", encoding="utf-8")
        self.executable.chmod(self.executable.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)

    def wait_listening(self, timeout: float = 60.0) -> None:
        """Block until every server's socket exists (it listens before importing; a client that comes early waits
        for the imports in the queue). A server that died is not waited for: its clients run the real interpreter."""
        deadline = time.monotonic() + timeout
        for path, server in zip(self.sockets, self.servers):
            while not os.path.exists(path) and server.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)

    def stop(self) -> None:
        for server in self.servers:
            server.stdin.close()
        for server in self.servers:
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
        for log in self.logs:
            log.close()
        if os.environ.get("P2R_WARM_KEEP") != "1":  # its logs list each request and whether it was forked
            shutil.rmtree(self.folder, ignore_errors=True)
