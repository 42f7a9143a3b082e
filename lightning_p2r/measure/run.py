"""Running and timing training: worker subprocesses with a clean launcher environment, the median of timed calls,
and a short fit on random tokens (the benchmarks, the calibration and the tests share these)."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import torch

from ..models.config import M6Config
from ..module import M6LanguageModel, OptimizerConfig

if TYPE_CHECKING:
    from ..strategy import P2RStrategy


def worker_env(threads: int) -> dict[str, str]:
    """The environment of a benchmark's worker subprocess: unbuffered output, ``threads`` OpenMP threads, and none of
    the launcher variables a parent may have inherited (they would make the worker think it is a rank of our run)."""
    env = os.environ | {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)}
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def host_threads(accelerator: str, processes: int, cores: int) -> int:
    """Torch threads per training process that a timing should use to stand for a real run: on CPU each process is
    one of the planner's devices and runs one thread; beside a GPU the host's cores are shared among the processes,
    since the host work there (an offloaded block's optimizer step, copies into pinned buffers) is multi-threaded in
    a real run, and timing it on one thread would make it several times slower than the run it predicts."""
    if accelerator == "cpu":
        return 1
    return max(1, cores // max(1, processes))


def run_rank_worker(module: str, spec: dict[str, Any], timeout: int, threads: int = 1) -> list[dict[str, Any]]:
    """Run ``python -m <module> --worker <spec>`` (Lightning's launcher starts its other ranks; ``threads`` threads
    each) and collect the report each rank wrote to ``<spec["out"]>.rank<r>.json``, removing the files; fail with
    stderr."""
    command = [sys.executable, "-m", module, "--worker", json.dumps(spec)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=worker_env(threads))
    if result.returncode != 0:
        raise RuntimeError(f"{spec['name']} failed: {result.stderr[-3000:]}")
    reports = []
    for rank in range(spec["devices"]):
        path = Path(spec["out"]).with_suffix(f".rank{rank}.json")
        reports.append(json.loads(path.read_text()))
        path.unlink()
    return reports


def synchronize(device: str | torch.device) -> None:
    """Wait for queued kernels: CUDA launches are asynchronous, so a timer would otherwise see only the launch."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], *, warmup: int = 2, iters: int = 5,
                   device: str | torch.device = "cpu") -> float:
    """Median wall time of ``fn()`` over ``iters`` calls after ``warmup`` untimed ones.

    Warm-up absorbs one-off costs (allocator growth, lazy kernel selection); the median rather than the mean keeps
    one descheduled iteration on a shared machine from moving the result.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class OptimizerStepTimer(L.Callback):
    """``read()`` (default ``time.perf_counter()``) at the end of every batch that completed an optimizer step (after
    the device finished it: CUDA runs asynchronously); another reading, such as the process's page faults, is taken
    at the same points."""

    def __init__(self, read: Callable[[], float] = time.perf_counter) -> None:
        self.ends: list[float] = []
        self._step = 0
        self._read = read

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != self._step:
            self._step = trainer.global_step
            if trainer.strategy.root_device.type == "cuda":
                torch.cuda.synchronize(trainer.strategy.root_device)
            self.ends.append(self._read())


def _module_of(spec: dict[str, Any]) -> tuple[L.LightningModule, int, int]:
    """The module a spec trains (an M6 model from ``spec["model"]``, or a Hugging Face decoder from
    ``spec["hf_config"]`` through ``CausalLMModule``), its vocabulary and its longest sequence."""
    if "hf_config" in spec:
        from ..causal_lm import CausalLMModule

        module = CausalLMModule(hf_config=spec["hf_config"], optimizer=OptimizerConfig(warmup_steps=1))
        return module, spec["hf_config"]["vocab_size"], spec["seq_len"]
    config = M6Config(**spec["model"])
    return M6LanguageModel(config, OptimizerConfig(warmup_steps=1)), config.vocab_size, config.max_seq_len


def fit_on_random_tokens(spec: dict[str, Any], strategy: P2RStrategy, *, warmup: int,
                         callbacks: tuple[L.Callback, ...] = ()) -> tuple[L.Trainer, L.LightningModule, float]:
    """Train ``spec["model"]`` (an M6Config's fields; ``spec["hf_config"]``: a Hugging Face decoder's) with
    ``strategy`` on ``spec["devices"]`` processes (on ``spec["accelerator"]``, CPU by default) for ``spec["steps"]``
    steps of ``spec["global_batch"]`` random sequences, split over the data ranks; returns the trainer, the module and
    the median optimizer-step interval after ``warmup`` steps (the benchmark workers' and the calibration's). Optional
    keys: ``seq_len`` (default the model's ``max_seq_len``), ``precision`` (default "32-true") and
    ``accumulate_grad_batches`` (the Trainer's micro-batches of standard accumulation: each batch is then that share
    of a data rank's sequences)."""
    L.seed_everything(0)
    module, vocab_size, max_seq_len = _module_of(spec)
    ends = OptimizerStepTimer()
    accumulate = spec.get("accumulate_grad_batches", 1)
    trainer = L.Trainer(accelerator=spec.get("accelerator", "cpu"), devices=spec["devices"], max_steps=spec["steps"],
                        strategy=strategy, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[ends, *callbacks],
                        precision=spec.get("precision", "32-true"), accumulate_grad_batches=accumulate)
    data_ranks = spec["devices"] // (strategy.tensor_parallel * strategy.pipeline_parallel)
    seq_len = spec.get("seq_len", max_seq_len)
    data = torch.randint(0, vocab_size, (spec["steps"] * spec["global_batch"], seq_len + 1),
                         generator=torch.Generator().manual_seed(0))
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=spec["global_batch"] // data_ranks // accumulate))
    steps = [b - a for a, b in zip(ends.ends[warmup - 1:], ends.ends[warmup:])]
    return trainer, module, statistics.median(steps)


def fastest_medians(steps: dict[str, Callable[[], None]], device: torch.device, repeats: int,
                    rounds: int) -> dict[str, float]:
    """Each step's median time, the steps timed in turn ``rounds`` times, keeping each one's fastest round: a
    difference of two timings is otherwise at the mercy of one slow moment on a shared machine."""
    seconds = dict.fromkeys(steps, math.inf)
    for _ in range(rounds):
        for name, step in steps.items():
            seconds[name] = min(seconds[name], median_seconds(step, iters=repeats, device=device))
    return seconds


def core_share(fn: Callable[[], Any], threads: int) -> tuple[Any, float]:
    """``fn()``'s result and the share of its ``threads`` cores the process got while it ran: its CPU time over the
    wall time and the threads (1 when nothing else ran on the machine and every thread stayed busy)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, (time.process_time() - cpu) / max(time.perf_counter() - wall, 1e-9) / threads


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now, for a process group of this machine's own."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


