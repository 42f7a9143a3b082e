"""How much memory one process gains while Lightning builds and places the model, and its peak over the run.

The phase starts in the callbacks' ``setup`` hook and ends at the first training batch. Lightning's
``Trainer._run`` calls, in this order: ``strategy.setup_environment`` (process group), ``prepare_data``, the
callbacks' ``setup``, the module's ``setup``, ``configure_model`` (the model is built) and ``strategy.setup`` (the
model is placed, sharded or offloaded, and the optimizers are created); so the phase covers the build and the
placement, and nothing of the training step. The growth is the phase's peak minus the memory at its start.

Host memory is resident set size (RSS) on Linux. ``/proc/self/status`` has ``VmRSS`` (now) and ``VmHWM`` (the
highest RSS so far). ``VmHWM`` covers the process's whole life, but writing ``5`` to ``/proc/self/clear_refs``
(Linux >= 4.0) resets it to the current RSS, and that is what :class:`PeakRSS` uses: the kernel raises the mark
before it unmaps any page (``munmap``, ``madvise(MADV_DONTNEED)``, ``brk`` shrinking), so a buffer that lives for
a fraction of a millisecond still counts, nothing runs beside the training, and the figure does not depend on a
sampling interval. Checked on the kernel these figures come from (6.18): after a 500 MiB tensor is freed, ``VmHWM``
still says 720 MiB; after the write it says 220 MiB, the RSS. Where the write is refused (some containers mount
``/proc`` read-only, gVisor ignores it), a daemon thread samples ``VmRSS`` every 2 ms instead: it misses a peak
shorter than that and takes the GIL 500 times a second, which is why it is the fallback and not the default.

On CUDA the probe also records ``torch.cuda.max_memory_allocated`` over the same phase (peak statistics reset
at its start) and over the run. The model's fp32 parameter bytes are ``4 * numel`` per parameter, counted from
the parameter's shape: a DTensor (FSDP2 shard) reports its global shape, and an offloaded placeholder keeps its
shape over an empty storage, so neither a shard nor an emptied storage changes the count.
"""

from __future__ import annotations

import math
import resource
import threading
from dataclasses import asdict, dataclass
from typing import Any, Literal

import lightning as L
import torch
from torch import nn

from ..layout import SHARDINGS
from ..strategy.accounting import local_bytes
from ..strategy.split_optimizer import optimizer_state_bytes

MiB = 2**20
_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
# The kernel keeps RSS in per-CPU counters folded in batches, so VmHWM can read a few pages above VmRSS right after
# a reset; a reset that left VmHWM this far above VmRSS did not happen.
_RESET_SLACK = 8 * MiB

Method = Literal["auto", "hwm", "sample"]


def _status_bytes(field: str) -> int:
    with open(_STATUS, encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    raise RuntimeError(f"{_STATUS} has no {field} line")


def rss_bytes() -> int:
    """This process's resident memory now (``VmRSS``)."""
    return _status_bytes("VmRSS")


def minor_faults() -> int:
    """This process's minor page faults so far: pages the kernel mapped in at first touch (fresh memory)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def hwm_bytes() -> int:
    """The highest resident memory of this process since it started or since the last :func:`reset_hwm`."""
    return _status_bytes("VmHWM")


def reset_hwm() -> bool:
    """Reset ``VmHWM`` to the current RSS; ``False`` where the kernel refuses or ignores the request."""
    try:
        with open(_CLEAR_REFS, "w", encoding="ascii") as clear_refs:
            clear_refs.write("5")
        return hwm_bytes() <= rss_bytes() + _RESET_SLACK
    except OSError:
        return False


class PeakRSS:
    """The peak resident memory of this process from :meth:`start` on.

    ``method="hwm"`` resets the kernel's high-water mark at :meth:`start` and reads it back; ``"sample"`` polls
    ``VmRSS`` from a thread every ``interval_s``; ``"auto"`` (the default) takes ``"hwm"`` where the reset works.
    Only one ``"hwm"`` measurement can run in a process at a time: the mark is per process.
    """

    def __init__(self, method: Method = "auto", interval_s: float = 0.002) -> None:
        if method not in ("auto", "hwm", "sample"):
            raise ValueError(f"method must be 'auto', 'hwm' or 'sample', got {method!r}")
        self.requested = method
        self.method: Literal["hwm", "sample"] | None = None
        self.interval_s = interval_s
        self.start_bytes = 0
        self._sampled_peak = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> int:
        """Begin the measurement; returns the RSS it starts from."""
        if self.requested != "sample" and reset_hwm():
            self.method = "hwm"
        elif self.requested == "hwm":
            raise RuntimeError(f"cannot reset VmHWM through {_CLEAR_REFS}; use method='sample'")
        else:
            self.method = "sample"
        self.start_bytes = self._sampled_peak = rss_bytes()
        if self.method == "sample":
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, name="PeakRSS", daemon=True)
            self._thread.start()
        return self.start_bytes

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sampled_peak = max(self._sampled_peak, rss_bytes())

    def peak(self) -> int:
        """The highest RSS since :meth:`start` (the current RSS included)."""
        if self.method is None:
            raise RuntimeError("PeakRSS.peak() before start()")
        if self.method == "hwm":
            return max(hwm_bytes(), rss_bytes(), self.start_bytes)
        self._sampled_peak = max(self._sampled_peak, rss_bytes())
        return self._sampled_peak

    def stop(self) -> int:
        """End the measurement (the sampling thread, if any); returns :meth:`peak`."""
        peak = self.peak()
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        return peak


def parameter_bytes(module: torch.nn.Module, bytes_per_element: int = 4) -> int:
    """Bytes of ``module``'s parameters at ``bytes_per_element`` each (fp32 by default), counted from their shapes.

    Shapes rather than ``numel()`` of the storage: an FSDP2 parameter is a DTensor whose shape is the global one,
    and an offloaded block's parameter is a placeholder with its shape kept over a storage resized to zero. Shared
    (tied) parameters count once, as ``module.parameters()`` yields them once.
    """
    return sum(math.prod(param.shape) for param in module.parameters()) * bytes_per_element


@dataclass
class SetupMemory:
    """What :class:`SetupMemoryProbe` measured in one process; bytes throughout, ``None`` where not measured."""

    method: str | None = None
    """How the host peak was taken: ``"hwm"`` (kernel high-water mark) or ``"sample"`` (polled VmRSS)."""
    rss_at_setup: int | None = None
    """Host RSS when the callbacks' ``setup`` hook ran, before the model was built."""
    setup_peak_rss: int | None = None
    """Highest host RSS from ``setup`` to the first training batch."""
    run_peak_rss: int | None = None
    """Highest host RSS from ``setup`` to the end of training (or the exception that ended it)."""
    param_bytes: int | None = None
    """The model's parameters at 4 bytes each, counted from their (global) shapes at the first batch."""
    cuda_at_setup: int | None = None
    """``torch.cuda.memory_allocated`` when ``setup`` ran (CUDA only)."""
    cuda_setup_peak: int | None = None
    """``torch.cuda.max_memory_allocated`` from ``setup`` to the first batch (CUDA only)."""
    cuda_run_peak: int | None = None
    """``torch.cuda.max_memory_allocated`` from ``setup`` to the end of training (CUDA only)."""

    @property
    def setup_growth(self) -> int | None:
        """Peak host RSS during setup minus the RSS at its start (never negative)."""
        if self.setup_peak_rss is None or self.rss_at_setup is None:
            return None
        return max(0, self.setup_peak_rss - self.rss_at_setup)

    @property
    def cuda_setup_growth(self) -> int | None:
        if self.cuda_setup_peak is None or self.cuda_at_setup is None:
            return None
        return max(0, self.cuda_setup_peak - self.cuda_at_setup)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"setup_growth": self.setup_growth, "cuda_setup_growth": self.cuda_setup_growth}


class SetupMemoryProbe(L.Callback):
    """A callback that measures, in its own process, the memory growth while the model is built and placed.

    Add it to the Trainer; after ``fit`` its :attr:`result` holds the figures (see :class:`SetupMemory`). Each rank
    measures itself: a multi-process run gives one result per rank.
    """

    def __init__(self, method: Method = "auto", interval_s: float = 0.002) -> None:
        self.result = SetupMemory()
        self._host = PeakRSS(method, interval_s)
        self._device: torch.device | None = None
        self._started = self._setup_done = self._finished = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._started:  # a second fit/validate on the same Trainer: the first setup is the one measured
            return
        self._started = True
        device = trainer.strategy.root_device
        if device.type == "cuda":
            self._device = device
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.result.cuda_at_setup = torch.cuda.memory_allocated(device)
        self.result.rss_at_setup = self._host.start()
        self.result.method = self._host.method

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._setup_done or not self._started:
            return
        self._setup_done = True
        self.result.setup_peak_rss = self._host.peak()
        if self._device is not None:
            self.result.cuda_setup_peak = torch.cuda.max_memory_allocated(self._device)
        self.result.param_bytes = parameter_bytes(pl_module)

    def _finish(self) -> None:
        if self._finished or not self._started:
            return
        self._finished = True
        self.result.run_peak_rss = self._host.stop()
        if self._device is not None:
            torch.cuda.synchronize(self._device)
            self.result.cuda_run_peak = torch.cuda.max_memory_allocated(self._device)

    # on_train_end runs before the strategy's teardown, which on CUDA moves the model to the host and would add a
    # host copy to a peak that training never needed.
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._finish()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._finish()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._finish()  # a run that stopped before training started still stops the sampling thread


# ------------------------------------------------------------------------------------------ model-state bytes
@dataclass
class ModelStateBytes:
    """Model-state bytes held by this rank (local shards only)."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def local_model_state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> ModelStateBytes:
    """What this rank stores of the parameters, gradients and optimizer states (a ZeroRedundancyOptimizer only
    holds state for its own partition, FSDP2 only local shards)."""
    params = list(module.parameters())
    # A ZeroRedundancyOptimizer keeps its partition's state in an inner optimizer.
    inner = getattr(optimizer, "optim", optimizer)
    return ModelStateBytes(params=sum(local_bytes(p) for p in params),
                           grads=sum(local_bytes(p.grad) for p in params if p.grad is not None),
                           optimizer=optimizer_state_bytes(inner))


def zero_formula_bytes(sharding: str, *, param_bytes: int, state_bytes_per_param_byte: float,
                       world_size: int) -> ModelStateBytes:
    """Per-rank model-state bytes the ZeRO paper's accounting predicts for ``param_bytes`` of parameters (with
    gradients of the same size) and optimizer states of ``state_bytes_per_param_byte`` times that (2 for Adam),
    counted between steps, when zero2 holds only its shard as FSDP2 does."""
    n = world_size
    states = param_bytes * state_bytes_per_param_byte
    if sharding == "none":
        return ModelStateBytes(param_bytes, param_bytes, int(states))
    if sharding == "zero1":
        return ModelStateBytes(param_bytes, param_bytes, int(states / n))
    if sharding in ("zero2", "zero3"):
        return ModelStateBytes(int(param_bytes / n), int(param_bytes / n), int(states / n))
    raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
