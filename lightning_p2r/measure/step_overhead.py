"""What a training step costs beyond its model's work, for ``lightning-p2r calibrate``: a ``Trainer`` with
``P2RStrategy`` stepping a model too small to matter, in a process of its own
(``python -m lightning_p2r.measure.step_overhead``), with one Lightning batch per step and with several.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..models.config import M6Config
from ..planning.cluster import Cluster
from .run import worker_env

STEP_OVERHEAD_MODEL = {"vocab_size": 64, "max_seq_len": 8, "num_layers": 1, "dim": 16, "num_heads": 2,
                       "moe_layers": [], "init_seed": 0}


ACCUMULATED_BATCHES = 4
"""Lightning batches per step of the run that measures ``batch_overhead``."""


def step_overhead(processes: int, threads: int, quick: bool, accumulate: int = 1) -> float:
    """Seconds a training step costs beyond its model's work: a ``Trainer`` with ``P2RStrategy`` on ``processes``
    ranks stepping a model too small to matter (hooks, logging, the loss's cross-rank check, the launcher's
    processes sharing the machine), the median optimizer-step interval after warm-up. ``accumulate``: Lightning
    batches per step (``accumulate_grad_batches``), each of the same size as the single batch's."""
    import json
    import subprocess
    import sys
    import tempfile

    steps = 8 if quick else 30
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "overhead.json")
        spec = {"processes": processes, "threads": threads, "steps": steps, "out": out, "accumulate": accumulate}
        result = subprocess.run([sys.executable, "-m", "lightning_p2r.measure.step_overhead", json.dumps(spec)],
                                capture_output=True, text=True, env=worker_env(threads),
                                timeout=600)
        if result.returncode != 0:
            raise RuntimeError(f"the step-overhead run failed: {result.stderr[-2000:]}")
        with open(out, encoding="utf-8") as file:
            return float(json.load(file)["step_s"])


def _overhead_worker(spec: dict[str, Any]) -> None:
    import json

    from ..strategy import P2RStrategy
    from .run import fit_on_random_tokens

    torch.set_num_threads(spec["threads"])
    accumulate = spec.get("accumulate", 1)
    run = {"model": STEP_OVERHEAD_MODEL, "devices": spec["processes"], "steps": spec["steps"],
           "global_batch": 2 * spec["processes"] * accumulate, "accumulate_grad_batches": accumulate,
           "accelerator": "auto"}
    trainer, _, step_s = fit_on_random_tokens(run, P2RStrategy(), warmup=min(5, spec["steps"] // 2))
    if trainer.global_rank == 0:
        with open(spec["out"], "w", encoding="utf-8") as file:
            json.dump({"step_s": step_s}, file)


def batch_call_overhead(one_batch_s: float, accumulated_s: float, batches: int, modelled_extra_s: float) -> float:
    """Seconds per Lightning batch beyond the first: the step of ``batches`` accumulated batches (``accumulated_s``)
    less the step of one (``one_batch_s``) and the model work the cost model prices for the added batches
    (``modelled_extra_s``), over the added batches; never below 0 (timing noise)."""
    if batches < 2:
        raise ValueError(f"the added batches' cost needs at least 2 batches per step, got {batches}")
    return max(accumulated_s - one_batch_s - modelled_extra_s, 0.0) / (batches - 1)


def modelled_added_batches(cluster: Cluster, batches: int) -> float:
    """Seconds the cost model prices for the step-overhead model's ``batches - 1`` added batches (with the
    framework terms at their values in ``cluster``, 0 in a fresh calibration)."""
    from ..planning import Workload, estimate_step
    from ..planning.layout import Layout

    config = M6Config(**STEP_OVERHEAD_MODEL)
    seq_len = config.max_seq_len

    def step(micro_batches: int) -> float:
        workload = Workload(global_batch=2 * cluster.devices * micro_batches, seq_len=seq_len)
        return estimate_step(config, Layout(micro_batches=micro_batches), cluster, workload).total

    return step(batches) - step(1)




if __name__ == "__main__":
    import json
    import sys

    _overhead_worker(json.loads(sys.argv[1]))
