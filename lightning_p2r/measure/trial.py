"""Measured trials of planned layouts: ``lightning-p2r plan --trial K`` runs each of the K best layouts that fit this
machine for a few optimizer steps (the recipe's model and batch, random tokens, no checkpoint, no logger) and puts
the measured step beside the predicted one.

A layout runs in a fresh worker process (Lightning's launcher starts its other ranks), one thread per process on
CPU, as the planner benchmark runs its layouts, and on GPUs the host's cores shared among the processes (the host
optimizer of an offloaded block runs on them) (:func:`~lightning_p2r.measure.run.run_rank_worker`); the measured step is
rank 0's median optimizer-step interval after the warm-up steps. The prediction is only comparable when the cluster
file describes this machine (``lightning-p2r calibrate``); otherwise the trial still ranks the layouts by what they
measure here.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..planning.hf_decoder import HFDecoder
from ..planning.layout import Layout, Workload
from ..planning.model import PricedModel

WARMUP = 2
"""Optimizer steps a trial runs before it starts timing (first-step allocations, lazy initialization)."""


def machine_devices() -> tuple[str, int]:
    """(accelerator, devices) this machine can run a trial on: its CUDA GPUs, or one CPU process per core."""
    import torch

    if torch.cuda.is_available():
        return "cuda", torch.cuda.device_count()
    return "cpu", os.cpu_count() or 1


def trial_refusal(trials: int, devices: int, accelerator: str, available: int) -> str | None:
    """Why ``--trial trials`` cannot run layouts of ``devices`` devices on this machine (None when it can)."""
    if trials < 1:
        return f"--trial must be >= 1 (the number of best layouts to run), got {trials}"
    if devices > available:
        unit = "GPUs" if accelerator == "cuda" else "CPU cores (one training process each)"
        return (f"--trial: the layouts need {devices} devices and this machine has {available} {unit}; "
                f"plan with --devices {available} or fewer to run trials here")
    return None


def trial_spec(config: PricedModel, layout: Layout, workload: Workload, *, devices: int, steps: int,
               accelerator: str, out: str) -> dict[str, Any]:
    """The worker spec that trains ``config`` with ``layout`` on ``devices`` processes (see
    :func:`~lightning_p2r.measure.run.fit_on_random_tokens`): the Trainer accumulates the micro-batches of standard
    accumulation without a pipeline (``Layout.trainer_accumulation``), the strategy everything else."""
    from .run import host_threads, usable_cores

    model = ({"hf_config": config.hf_config() | {"vocab_size": config.vocab_size}} if isinstance(config, HFDecoder)
             else {"model": asdict(config)})
    return {"name": layout.describe(), **model, "devices": devices, "steps": steps,
            "threads": host_threads(accelerator, devices, usable_cores()),
            "global_batch": workload.global_batch, "seq_len": workload.seq_len, "precision": workload.precision,
            "accumulate_grad_batches": layout.trainer_accumulation, "strategy": layout.strategy_options(),
            "accelerator": accelerator, "out": out}


def run_trial(spec: dict[str, Any], timeout: int = 1800) -> float:
    """Seconds per optimizer step of ``spec`` measured in a worker process (rank 0's median after warm-up)."""
    from .run import run_rank_worker

    return run_rank_worker("lightning_p2r.measure.trial", spec, timeout, spec["threads"])[0]["step_s"]


TRIAL_FAILURES = (RuntimeError, subprocess.TimeoutExpired)
"""What :func:`run_trial` raises when a layout cannot run here: its worker failed, or ran past the timeout."""


def failure_reason(error: BaseException) -> str:
    """The first line of a failed trial's message (its worker's traceback follows), for a one-line warning."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def run_trials(config: PricedModel, layouts: list[tuple[Layout, float]], workload: Workload, *, devices: int,
               steps: int, accelerator: str, rounds: int = 1) -> list[dict[str, Any]]:
    """Measure each (layout, predicted seconds); rows in the given order with ``measured_s`` and the prediction's
    error relative to the measurement. With ``rounds`` above one the layouts run in turn that many times (1, 2, ...,
    K, then 1, 2, ... again), so that a machine drifting between runs slows every layout alike, and ``measured_s``
    is the median of each layout's rounds (``measured_min_s`` / ``measured_max_s`` their range)."""
    loads: list[list[float]] = [[] for _ in layouts]  # the machine's load right after each run
    with tempfile.TemporaryDirectory() as folder:
        def timed(index: int, round_: int) -> float:
            (layout, predicted), rank = layouts[index], index + 1
            spec = trial_spec(config, layout, workload, devices=devices, steps=steps, accelerator=accelerator,
                              out=str(Path(folder) / f"trial{rank}_round{round_}"))
            measured = run_trial(spec)
            loads[index].append(_load())
            of_rounds = f" (round {round_}/{rounds})" if rounds > 1 else ""
            print(f"trial {rank}/{len(layouts)}{of_rounds}: {layout.describe()}: measured {measured:.4g} s, "
                  f"predicted {predicted:.4g} s", flush=True)
            return measured

        times = in_turn(len(layouts), rounds, timed)
    return [trial_row(rank, layout, predicted, measured, max(load))
            for rank, ((layout, predicted), measured, load) in enumerate(zip(layouts, times, loads), 1)]


def in_turn(count: int, rounds: int, timed: Callable[[int, int], float]) -> list[list[float]]:
    """``timed(index, round)`` for indices 0 to ``count`` - 1, ``rounds`` times in turn (every index once, then
    again; rounds numbered from 1), so that a machine drifting between runs slows every index alike; each index's
    timings in round order."""
    times: list[list[float]] = [[] for _ in range(count)]
    for round_ in range(1, rounds + 1):
        for index in range(count):
            times[index].append(timed(index, round_))
    return times


def trial_row(rank: int, layout: Layout, predicted: float, measured: list[float], load: float) -> dict[str, Any]:
    """One layout's row from its measured rounds: their median, and their range when there are several; ``load``
    the highest 1-minute load average seen after them."""
    median = statistics.median(measured)
    row = {"rank": rank, "layout": layout.describe(), "predicted_s": predicted, "measured_s": median,
           "error_pct": 100 * (predicted - median) / median, "load_avg_1m": load}
    if len(measured) > 1:
        row |= {"measured_min_s": min(measured), "measured_max_s": max(measured)}
    return row


def _load() -> float:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else float("nan")


def _worker(spec: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from ..strategy import P2RStrategy
    from .run import fit_on_random_tokens

    torch.set_num_threads(spec["threads"])
    trainer, _, step_s = fit_on_random_tokens(spec, P2RStrategy(**spec["strategy"]),
                                              warmup=min(WARMUP, spec["steps"] - 1))
    Path(spec["out"]).with_suffix(f".rank{trainer.global_rank}.json").write_text(json.dumps({"step_s": step_s}))
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(json.loads(sys.argv[2]))
