import os
import sys
from pathlib import Path

import pytest
import torch
import tqdm

# One intra-op thread in every test process, and in every process a test starts (they inherit the variable). The
# suite's tensors have a few thousand elements: a second OpenMP thread costs more than it saves (two test files took
# 51 s at two threads, 39 s at one), and an idle OpenMP thread spins at its barrier, taking the core another process
# needs. Set in the environment, not only in torch: Lightning's launcher (P2RStrategy's too) sets the threads to
# cores / processes whenever OMP_NUM_THREADS is unset, which gave a pytest-xdist worker two spinning threads after its
# first fit (the whole quick tier took 7 min 46 s with `-n 2` that way, against 3 min 15 s in one process).
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)
# No tqdm monitor thread (it only retunes slow bars): a process with a second thread prepares data through a spawned
# helper, seconds per prepare_data call, where one thread forks litdata's workers in milliseconds
# (lightning_p2r.data.prepared.token_writer, which counts every OS thread; the helper path has its own test in
# test_prepared_data).
tqdm.tqdm.monitor_interval = 0
# pytest-xdist's channel is a thread of every worker, so a worker prepares data through that helper: one per worker
# process, kept (docs/data.md), instead of one per preparation (about 40 of them, seconds each).
os.environ["LIGHTNING_P2R_KEEP_PREPARE_HELPER"] = "1"


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _offline_wandb(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    # Nothing in the suite may reach the network or write outside its temp dir.
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb"))
    monkeypatch.setenv("LIGHTNING_P2R_CACHE", str(tmp_path / "cache"))


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """A one-process run on the FSDP2 path (zero2/zero3) initializes torch.distributed and Lightning leaves it up,
    with MASTER_PORT, WORLD_SIZE and friends exported; a later test that initializes its own group, or starts
    worker processes that inherit the environment, would fail or hang. Each test ends with neither."""
    environment = dict(os.environ)
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if os.environ != environment:
        os.environ.clear()
        os.environ.update(environment)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Everything under tests/distributed launches several processes: marked so, for the README's tier
    (``-m "not slow and not distributed"``) to leave it to CI's second command."""
    here = Path(__file__).parent / "distributed"
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(pytest.mark.distributed)


def pytest_collection_finish(session: pytest.Session) -> None:
    """A selection that launches processes (the ``slow`` and ``distributed`` tests) gets warm interpreters: each
    Python process the tests start (workers, Lightning's other ranks, ``python -m lightning_p2r.cli``) is forked
    from a server that has imported torch, Lightning and the package already, instead of spending 5-12 s importing
    them (``tests/warm_python/``). ``P2R_FRESH_PROCESSES=1`` runs every process fresh instead."""
    if os.environ.get("P2R_FRESH_PROCESSES") == "1" or not sys.platform.startswith("linux") or not any(
            item.get_closest_marker("distributed") or item.get_closest_marker("slow") for item in session.items):
        return
    import tempfile

    from warm_python import WarmPython

    warm = WarmPython(Path(tempfile.mkdtemp(prefix="p2r-warm-")))
    real_python, sys.executable = sys.executable, str(warm.executable)
    warm.wait_listening()

    def stop() -> None:
        sys.executable = real_python
        warm.stop()

    session.config.add_cleanup(stop)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``pytest -n 2`` (pytest-xdist, optional): whole files to each worker, as ``--dist loadfile`` does (a file's
    module-scoped runs happen once), with the files of the shared model-parallel runs kept together
    (``suite_scheduling.py``)."""
    from suite_scheduling import by_file_shared_runs_together

    return by_file_shared_runs_together(config, log)
