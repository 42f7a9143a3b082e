"""What an offloaded block's copies cost inside training on a CPU-only machine, fitted by ``lightning-p2r calibrate``.

On a CPU the "device" is host memory, and the block streamer's copy to it lands in storage that was freed when the
block was released and is allocated again for the next fetch. The C allocator often hands that storage back to the
kernel and gets fresh pages the next time: every 4 KiB of the copy then takes a page fault and the zeroing of a page.
On a 2-vCPU AMD EPYC a 64 MiB copy into a buffer that is reused (what ``host_device_copy`` times) ran at 22.7 GB/s,
into fresh pages at 2.3 GB/s, and an offloaded 4-layer MoE of width 96 took 8,000 to 10,900 more minor page faults
per step (33-45 MB of pages) than the same model resident, and 15-24 ms more than with the allocator told to keep
what is freed (2026-11-30, ``python -m lightning_p2r.benchmarks.offload_pages``). Which copies fault depends on the
allocator's history, so no microbenchmark stands for it: ``calibrate`` trains a model with every block offloaded
and the same model resident (:func:`copy_probe_layouts`), in turn, and reads the bandwidth the step's copies ran at
from the difference (:func:`fitted_copy_bandwidth`). On CUDA the copies come from pinned buffers into the caching
allocator's memory and overlap the compute: the pinned copy's own timing stands there, and nothing is fitted.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from pathlib import Path
from typing import Any

from ..models.config import M6Config
from ..planning.cluster import Cluster
from ..planning.layout import Layout, Workload

COPY_PROBE_MODEL: dict[str, Any] = {"vocab_size": 256, "max_seq_len": 64, "num_layers": 4, "dim": 96,
                                    "num_heads": 4, "num_experts": 8, "moe_top_k": 1, "moe_layers": None,
                                    "capacity_factor": None, "init_seed": 0}
"""Blocks of a few MB (8 experts of width 96: 2.5 MB of parameters each), as the models trained on such a machine
have: the copies of the fit's small probe model (0.6 MB blocks) ran at 14 GB/s, of this one at 7 GB/s, of a
6-layer model of width 64 with 16 experts (2.2 MB blocks) at 7 GB/s."""
COPY_PROBE_BATCH = 16
"""Sequences per step and data-parallel rank of the copy probes."""
COPY_PROBE_MICRO_BATCHES = 4
"""Micro-batches per step: each fetches every offloaded block twice (forward, backward), so the copies are a share of
the step that timing noise does not hide."""
COPY_PROBE_STEPS = 10
"""Optimizer steps per copy probe (``--quick``: 6), two of them warm-up."""
COPY_PROBE_ROUNDS = 3
"""Times the pair is timed, in turn (``--quick``: 1): the fit reads the median of the rounds' differences. On a
2-vCPU machine one probe's step moved by 10-20% between rounds a minute apart, a difference of two such timings
more (one calibration's two rounds gave 8 and 42 ms)."""


def copy_probe_workload(devices: int = 1) -> tuple[M6Config, Workload]:
    """The copy probes' model and workload on ``devices`` data-parallel processes (each its ``COPY_PROBE_BATCH``)."""
    config = M6Config(**COPY_PROBE_MODEL)
    return config, Workload(global_batch=COPY_PROBE_BATCH * devices, seq_len=config.max_seq_len)


def copy_probe_layouts() -> tuple[Layout, Layout]:
    """The resident layout and the same with every block offloaded."""
    resident = Layout(micro_batches=COPY_PROBE_MICRO_BATCHES)
    return resident, dataclasses.replace(resident, offload_fraction=1.0)


def copied_bytes(config: M6Config, layout: Layout, cluster: Cluster, workload: Workload) -> float:
    """Bytes one step of ``layout`` copies between host and device (the planner's h2d and d2h transfers)."""
    from ..planning.transfers import step_transfers

    return sum(transfer.payload for transfer in step_transfers(config, layout, cluster, workload)
               if transfer.kind in ("h2d", "d2h"))


def fitted_copy_bandwidth(cluster: Cluster, resident_s: float, offloaded_s: float) -> float | None:
    """The bandwidth the offloaded probe's copies ran at: the measured difference between the offloaded and the
    resident step, less what the cost model prices for that difference apart from the copies' bytes (the host
    optimizer, the streamer's hooks, each copy's latency), over the bytes copied. Never above ``cluster``'s measured
    copy bandwidth (the copies cannot run faster inside training than alone); None when the difference leaves
    nothing for the bytes (timing noise): the measured bandwidth then stands. For a CPU cluster, whose copies do not
    overlap compute."""
    from ..planning.step_time import estimate_step

    config, workload = copy_probe_workload(cluster.devices)
    resident, offloaded = copy_probe_layouts()
    copied = copied_bytes(config, offloaded, cluster, workload)
    # On a CPU the copies do not overlap compute (Cluster.overlap_copies is False there): the priced step holds
    # their bytes at the measured bandwidth, taken out here.
    priced_apart = (estimate_step(config, offloaded, cluster, workload).total - copied / cluster.host_device_bandwidth
                    - estimate_step(config, resident, cluster, workload).total)
    left = offloaded_s - resident_s - priced_apart
    if left <= 0:
        return None
    return min(copied / left, cluster.host_device_bandwidth)


def fit_copy_bandwidth(cluster: Cluster, *, quick: bool = False, threads: int | None = None,
                       rounds: int | None = None, log: Any = print) -> tuple[Cluster, str]:
    """Time :func:`copy_probe_layouts` on ``cluster.devices`` processes of this machine, ``rounds`` times in turn
    (``COPY_PROBE_ROUNDS``; ``quick``: once), and return ``cluster`` with ``host_device_bandwidth`` fitted from the
    resident probe's median and the median of the rounds' differences (on CPU only; unchanged on CUDA), and a line
    for the cluster file's header saying what was measured. A probe that fails leaves ``cluster`` as it is, with the
    reason in that line: the rest of the calibration is not lost to it."""
    from .trial import TRIAL_FAILURES, failure_reason, in_turn, run_trial, trial_spec

    if cluster.accelerator != "cpu":
        return cluster, ""
    config, workload = copy_probe_workload(cluster.devices)
    layouts = copy_probe_layouts()
    steps = 6 if quick else COPY_PROBE_STEPS
    rounds = rounds or (1 if quick else COPY_PROBE_ROUNDS)
    with tempfile.TemporaryDirectory() as folder:
        def timed(index: int, round_: int) -> float:
            spec = trial_spec(config, layouts[index], workload, devices=cluster.devices, steps=steps,
                              accelerator="cpu", out=str(Path(folder) / f"copies{index}_{round_}"))
            spec["threads"] = threads or spec["threads"]
            measured = run_trial(spec)
            log(f"copy probe {layouts[index].describe()} (round {round_}/{rounds}): {measured * 1e3:.1f} ms per step")
            return measured

        try:
            times = in_turn(len(layouts), rounds, timed)
        except TRIAL_FAILURES as error:  # keep the minutes already measured
            reason = failure_reason(error)
            log(f"warning: the offload copy probes failed ({reason}); the copy alone's bandwidth stands")
            return cluster, (f"host_device_bandwidth: the copy alone ({cluster.host_device_bandwidth / 1e9:.1f} GB/s); "
                             f"the offload copy probes failed: {reason}")
    # The rounds are paired (each offloaded timing right after its resident one): their differences drift less.
    resident_s = statistics.median(times[0])
    offloaded_s = resident_s + statistics.median(off - on for on, off in zip(*times))
    measured = cluster.host_device_bandwidth
    fitted = fitted_copy_bandwidth(cluster, resident_s, offloaded_s)
    timings = (f"{layouts[0].describe()} {resident_s * 1e3:.1f} ms, {layouts[1].describe()} {offloaded_s * 1e3:.1f} "
               f"ms per step")
    if fitted is None:
        return cluster, (f"host_device_bandwidth: the copy alone ({measured / 1e9:.1f} GB/s); the offloaded probe "
                         f"cost no more than priced without it ({timings})")
    return (dataclasses.replace(cluster, host_device_bandwidth=fitted),
            f"host_device_bandwidth: {fitted / 1e9:.1f} GB/s inside training, from an offloaded and a resident probe "
            f"({timings}); the copy alone ran at {measured / 1e9:.1f} GB/s")
