"""Starting and ending a job's processes. The job's checks (``P2RStrategy.check_before_launch``) run before
Lightning's script launcher starts any other rank, so a refused layout is one message. A rank that fails writes its
error into a folder the launching process chose (``P2R_RANK_ERRORS``): rank 0 reports it once, or, if rank 0 is
blocked in a collective, an observer thread prints it and stops every rank. No rank outlives the command. Under
torchrun or SLURM each rank behaves as Lightning's own launcher does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from ..files import write_atomically

ERRORS_ENV = "P2R_RANK_ERRORS"
"""The folder where each rank started by the launcher writes its error (set by the launching process)."""


class RankFailed(RuntimeError):
    """Another rank failed first (the launching rank's own error is the consequence); the message is their errors."""


def describe(error: BaseException) -> str:
    """One line: the error's type and message (a ValueError's message is already a sentence for the user)."""
    text = str(error).strip() or repr(error)
    return text if isinstance(error, ValueError) else f"{type(error).__name__}: {text}"


def write_rank_error(folder: str | Path, rank: int, text: str) -> None:
    """A launched rank's error, for the launching process: written whole or not at all, since the launching process
    stops the other ranks as soon as its own error (often the same) is raised, which can cut a plain write short and
    left it an empty ``rank 1:`` line to report."""
    write_atomically(Path(folder, f"rank-{rank}.txt"), text)


def read_rank_errors(folder: Path) -> dict[int, str]:
    """The errors the ranks wrote, by rank (a rank stopped while writing left none: its temporary file is skipped)."""
    return {int(path.stem.split("-", 1)[1]): path.read_text(encoding="utf-8")
            for path in sorted(folder.glob("rank-*.txt"))}


def summarize(errors: dict[int, str], *, skip: str | None = None) -> list[str]:
    """One line per distinct error, with the ranks that raised it (``skip``: the text already shown)."""
    by_text: dict[str, list[int]] = {}
    for rank, text in sorted(errors.items()):
        by_text.setdefault(text, []).append(rank)
    return [f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {text}"
            for text, ranks in by_text.items() if text != skip]


def stop_processes(processes: list[subprocess.Popen], grace: float = 5.0) -> None:
    """Terminate the processes still running, kill those that ignore it for ``grace`` seconds, and wait for each."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _quiet_excepthook(kind: type[BaseException], error: BaseException, traceback: Any) -> None:
    """A launched rank's uncaught error was written for the launching process, which reports it once."""


def observe_ranks(processes: list[subprocess.Popen], errors: Path, stopped: threading.Event,
                  period: float = 1.0) -> None:
    """Until ``stopped``: when a started rank fails, print its error, stop every rank and end the command (status 1)."""
    while not stopped.wait(period):
        failed = [i + 1 for i, p in enumerate(processes) if p.poll() not in (None, 0)]
        if failed and not stopped.is_set():
            stop_processes(processes)
            lines = summarize(read_rank_errors(errors)) or [
                f"rank {rank}: exited with status {processes[rank - 1].returncode}" for rank in failed]
            sys.stderr.write("error: a rank failed, every rank was stopped:\n  " + "\n  ".join(lines) + "\n")
            sys.stderr.flush()
            shutil.rmtree(errors, ignore_errors=True)
            os._exit(1)  # the launching rank may be inside a collective that never returns


ERRORS_PREFIX = "p2r-rank-errors-"
"""The errors folder's name starts with this and the launching process's id (``<prefix><pid>-<random>``)."""


def remove_abandoned_error_folders(root: str | Path | None = None) -> list[Path]:
    """Remove the errors folders whose launching process is gone: one that was killed (by a signal, a job's time
    limit) could not remove its own, and each left an empty folder in the temporary directory. A folder whose
    process id is running (its own, or a reused id) is kept. Returns the folders removed."""
    removed = []
    for folder in Path(root or tempfile.gettempdir()).glob(f"{ERRORS_PREFIX}*-*"):
        pid = folder.name[len(ERRORS_PREFIX):].split("-", 1)[0]
        try:
            if not pid.isdigit() or not folder.is_dir() or folder.stat().st_uid != os.getuid():  # another user's
                continue
            os.kill(int(pid), 0)  # signal 0: only asks whether the process exists
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        except (OSError, OverflowError):  # gone meanwhile, another user's process, or not a process id at all
            continue
    return removed


class CheckingLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher with the job's checks before any child exists and one failure ending all ranks.
    ``check`` runs in every process before the job starts, given the Trainer and the launched function's arguments."""

    def __init__(self, check: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.check = check

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self.check(trainer, *args)
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if self.cluster_environment.creates_processes_externally:
            return self._run_as_launched_rank(function, *args, **kwargs)
        remove_abandoned_error_folders()
        errors = Path(tempfile.mkdtemp(prefix=f"{ERRORS_PREFIX}{os.getpid()}-"))
        os.environ[ERRORS_ENV] = str(errors)
        try:
            self._call_children_scripts()
        finally:
            del os.environ[ERRORS_ENV]
        stopped = threading.Event()
        if self.procs:  # one process has no other rank to observe, and stays one thread: prepare_data can fork
            threading.Thread(target=observe_ranks, args=(self.procs, errors, stopped), daemon=True,
                             name="p2r-rank-observer").start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        try:
            return function(*args, **kwargs)
        except BaseException as error:
            stopped.set()
            failed_first = any(process.poll() not in (None, 0) for process in self.procs)
            stop_processes(self.procs)
            others = summarize(read_rank_errors(errors), skip=describe(error))
            if failed_first and others and not isinstance(error, KeyboardInterrupt):
                raise RankFailed("; ".join(others) + f" (then rank 0: {describe(error)})") from error
            for line in others:
                error.add_note(line)
            raise
        finally:
            stopped.set()
            shutil.rmtree(errors, ignore_errors=True)

    def _run_as_launched_rank(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        folder = os.environ.get(ERRORS_ENV)
        _set_num_threads_if_needed(num_processes=self.num_processes)
        try:
            return function(*args, **kwargs)
        except BaseException as error:
            if folder and os.path.isdir(folder) and not isinstance(error, KeyboardInterrupt):
                write_rank_error(folder, self.cluster_environment.global_rank(), describe(error))
                sys.excepthook = _quiet_excepthook
            raise
