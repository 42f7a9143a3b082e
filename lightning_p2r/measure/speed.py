"""How fast this machine runs now against when it was calibrated: a short reference step timed by ``calibrate`` and
again by ``plan``.

A 2-core cloud machine's speed moves by 10-30% within an hour (its neighbours, its clock): on the draws in
docs/benchmarks.md one-process steps priced with a calibration made 20-50 minutes earlier came out 17-47% off, and
within 5-21% with one made right after. Calibrating takes minutes; the reference step takes under a second, so
``plan`` re-times it and prices the run at the machine's present speed (:func:`lightning_p2r.planning.cluster.
at_speed`).

The reference is one training-like step of each of the two kinds of work a step is made of: a small M6 model's
forward and backward (dense and MoE layers: dispatch, autograd, Python, the work the layer costs measure) and a
512 x 512 matmul's (the work the FLOP and bandwidth rates measure), on one thread of one process, the sum of their
medians, each the fastest of three rounds.
"""

from __future__ import annotations

import math
import platform
from pathlib import Path

import torch

from ..models.config import M6Config
from ..planning.cluster import Cluster
from ..strategy.host_allocator import retain_freed_host_memory, wants_retained
from .run import median_seconds

REFERENCE_MODEL = {"vocab_size": 256, "max_seq_len": 64, "dim": 64, "num_heads": 8, "num_layers": 2,
                   "num_experts": 4, "moe_layers": [1], "moe_top_k": 1, "capacity_factor": None, "init_seed": 0}
"""The reference step's model: one dense and one MoE layer of width 64, 4 sequences of 64 tokens."""
REFERENCE_SEQUENCES = 4
REFERENCE_MATMUL = 512


def reference_step_seconds(device: torch.device | str = "cpu", *, rounds: int = 3, iters: int = 9) -> float:
    """Seconds of the reference step (the module docstring) on ``device``, in this process, on one thread: the
    model's and the matmul's medians of ``iters`` calls, each the fastest of ``rounds`` rounds timed in turn."""
    from ..models.transformer import M6Transformer

    device = torch.device(device)
    if wants_retained("auto", device.type):  # allocate as a training process under the default does
        retain_freed_host_memory()
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        generator = torch.Generator().manual_seed(0)
        config = M6Config(**REFERENCE_MODEL)
        model = M6Transformer(config).to(device)
        tokens = torch.randint(0, config.vocab_size, (REFERENCE_SEQUENCES, config.max_seq_len),
                               generator=generator).to(device)
        size = REFERENCE_MATMUL
        x = torch.randn(size, size, generator=generator).to(device).requires_grad_()
        weight = torch.randn(size, size, generator=generator).to(device).requires_grad_()

        def model_step() -> None:
            out = model(tokens)
            (out.logits.float().mean() + out.aux_loss + out.z_loss).backward()

        def matmul_step() -> None:
            torch.nn.functional.linear(x, weight).sum().backward()

        best = {"model": float("inf"), "matmul": float("inf")}
        for _ in range(rounds):
            for name, step in (("model", model_step), ("matmul", matmul_step)):
                best[name] = min(best[name], median_seconds(step, iters=iters, device=device))
        return best["model"] + best["matmul"]
    finally:
        torch.set_num_threads(previous)


def machine_name(accelerator: str) -> str:
    """The machine a calibration describes, as ``plan`` compares it: the host's name and its processor (CPU) or
    first GPU. A file calibrated elsewhere (a cluster's compute node, planned from a login node) is not re-timed."""
    if accelerator == "cuda" and torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    else:
        device = cpu_name()
    return f"{platform.node()} / {device}"


def cpu_name() -> str:
    """The processor's marketing name (platform.processor() is empty on most Linux builds; /proc/cpuinfo has it)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


RECALIBRATE_BEYOND = 0.15
"""A speed this far from the calibration's (either way) gets the advice to calibrate again: the ratio scales every
constant alike, while a machine's constants need not all have moved alike."""


def present_speed(cluster: Cluster) -> tuple[float | None, str]:
    """How many times slower (above 1) this machine runs the reference step now than when ``cluster`` was
    calibrated, with a line saying so; None where it cannot be re-timed: with the reason for a file calibrated on
    another machine, and no line for one without a reference step (written by hand, or before 2026-11-30)."""
    if cluster.reference_step_seconds <= 0:
        return None, ""
    here = machine_name(cluster.accelerator)
    if cluster.calibrated_on != here:
        return None, (f"speed check: {cluster.name} was calibrated on {cluster.calibrated_on or 'an unnamed machine'}, "
                      f"this is {here}: not re-timed")
    device = "cuda" if cluster.accelerator == "cuda" else "cpu"
    now = reference_step_seconds(device)
    ratio = now / cluster.reference_step_seconds
    pace = (f"{ratio:.2f}x slower" if ratio >= 1.005 else f"{1 / ratio:.2f}x faster" if ratio <= 0.995
            else "at the same speed")
    line = (f"speed check: the reference step took {1e3 * now:.3g} ms, {1e3 * cluster.reference_step_seconds:.3g} ms "
            f"when {cluster.name} was calibrated: this machine runs {pace} now, and the steps below are priced at its "
            "present speed (--no-speed-check: at the file's)")
    if abs(math.log(ratio)) > math.log(1 + RECALIBRATE_BEYOND):
        line += "; that far off, calibrate again (`lightning-p2r calibrate`) for constants measured at today's speed"
    return ratio, line
