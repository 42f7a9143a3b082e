"""Tokens per second, model TFLOP/s per device and MFU, logged as training runs (issue 40 item 4).

``Throughput`` measures wall-clock over a window of training batches (the device drained once per window, not per
step), counts the tokens each batch carried and the model FLOPs they cost (:mod:`lightning_p2r.measure.throughput`:
3x the forward's matmuls over the active parameters, plus attention) and logs, per device:

- ``perf/tokens_per_s``: tokens every data-parallel rank processed together, per second;
- ``perf/tflops_per_device``: model TFLOP/s one device did. Ranks that split one model (tensor, pipeline parallelism)
  share the same tokens' work, so a layout's figure is the global model FLOPs divided by the device count;
- ``perf/mfu``: that over the device's peak (the table in ``measure/throughput.py``, or ``peak_tflops=`` given),
  logged only when a peak is known (a CPU has none in the table).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import lightning as L
import torch

from lightning_p2r.measure.throughput import peak_tflops, training_flops_per_token


def tokens_in(batch: Any) -> int:
    """Tokens in a language-model batch: a (batch, seq + 1) window tensor counts batch x seq (the last position is
    only a target); a mapping with ``input_ids`` counts its elements; a list or tuple its first element's."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] * (batch.shape[1] - 1) if batch.dim() == 2 else batch.numel()
    if isinstance(batch, dict) and "input_ids" in batch:
        return batch["input_ids"].numel()
    if isinstance(batch, (list, tuple)) and batch:
        return tokens_in(batch[0])
    raise ValueError(f"Throughput cannot count the tokens of a {type(batch).__name__} batch: pass tokens_fn=")


def _sequence_length(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[-1] - 1 if batch.dim() == 2 else batch.shape[-1]
    if isinstance(batch, dict):
        return batch["input_ids"].shape[-1]
    return _sequence_length(batch[0])


def forward_flops_per_token(module: L.LightningModule, seq_len: int) -> float:
    """The module's own count when it has one (``forward_flops_per_token(seq_len)``), else 2 FLOPs per weight of
    every matrix a token passes through (attention scores not counted: a floor). A matrix counts once per place it
    is registered, so a block shared by several layers counts once per layer and a head tied to the embedding
    counts as the head (a lookup costs nothing); stacked expert weights (3-D, or under an ``experts`` module) count
    the routed fraction ``num_experts_per_tok / num_local_experts`` the model's ``config`` names (Hugging Face)."""
    own = getattr(module, "forward_flops_per_token", None)
    if callable(own):
        return float(own(seq_len))
    routed = _routed_fraction(module)
    total = 0.0
    for name, child in module.named_modules(remove_duplicate=False):
        if isinstance(child, torch.nn.Embedding):
            continue
        expert = "experts" in name.split(".")
        for parameter in child.parameters(recurse=False):
            if parameter.dim() >= 2:
                total += parameter.numel() * (routed if expert or parameter.dim() == 3 else 1.0)
    return 2.0 * total


def _routed_fraction(module: torch.nn.Module) -> float:
    """top-k over the experts, from the first Hugging Face style ``config`` found (1 when there is none)."""
    for child in module.modules():
        config = getattr(child, "config", None)
        top_k = getattr(config, "num_experts_per_tok", None)
        experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
        if isinstance(top_k, int) and isinstance(experts, int) and experts > 0:
            return min(1.0, top_k / experts)
    return 1.0


def _compute_dtype(trainer: L.Trainer) -> torch.dtype:
    precision = str(trainer.precision)
    return torch.bfloat16 if "16" in precision else torch.float32


def _data_parallel_size(trainer: L.Trainer) -> int:
    layout = getattr(trainer.strategy, "layout", None)
    if layout is not None and hasattr(layout, "data_parallel"):
        return layout.data_parallel(trainer.world_size)
    return trainer.world_size


class Throughput(L.Callback):
    """Log ``perf/tokens_per_s``, ``perf/tflops_per_device`` and ``perf/mfu`` every ``window`` training batches.

    ``peak_tflops`` overrides the device table (a figure ``lightning-p2r calibrate`` measured, or an accelerator the
    table lacks); ``tokens_fn`` counts a batch's tokens when :func:`tokens_in` cannot.
    """

    def __init__(self, window: int = 20, *, peak_tflops: float | None = None,
                 tokens_fn: Callable[[Any], int] | None = None, prog_bar: bool = True) -> None:
        if window < 1:
            raise ValueError(f"Throughput(window=...) must be at least 1, got {window!r}")
        self.window = window
        self.peak = peak_tflops
        self.tokens_fn = tokens_fn or tokens_in
        self.prog_bar = prog_bar
        self._start: float | None = None
        self._elapsed = 0.0
        self._tokens = 0
        self._flops = 0.0
        self._batches = 0
        self._flops_per_token: dict[int, float] = {}
        self.last: dict[str, float] = {}
        """The last window's figures (also logged)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.peak is None and trainer.strategy.root_device.type == "cuda":
            self.peak = peak_tflops(torch.cuda.get_device_name(trainer.strategy.root_device), _compute_dtype(trainer))
        self._reset()

    def _reset(self) -> None:
        self._start, self._elapsed, self._tokens, self._flops, self._batches = None, 0.0, 0, 0.0, 0
        self._flops_per_token.clear()  # counted again each window: delinking or growth changes the model

    def _drain(self, trainer: L.Trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._start is None:  # a window opens or resumes: what ran before (setup, validation) is left out
            self._drain(trainer)
            self._start = time.perf_counter()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A validation run inside a window pauses its clock (its batches are not training tokens)."""
        if self._start is not None:  # only a training window sets it
            self._drain(trainer)
            self._elapsed += time.perf_counter() - self._start
            self._start = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        tokens = self.tokens_fn(batch)
        seq_len = _sequence_length(batch)
        if seq_len not in self._flops_per_token:
            self._flops_per_token[seq_len] = training_flops_per_token(forward_flops_per_token(pl_module, seq_len))
        self._tokens += tokens
        self._flops += tokens * self._flops_per_token[seq_len]
        self._batches += 1
        if self._batches < self.window:
            return
        self._drain(trainer)
        seconds = self._elapsed + time.perf_counter() - self._start
        data_parallel, devices = _data_parallel_size(trainer), trainer.world_size
        # This rank's tokens stand for its data-parallel group's; every device shares the global work evenly.
        global_tokens_per_s = self._tokens * data_parallel / seconds
        tflops = self._flops * data_parallel / devices / seconds / 1e12
        self.last = {"perf/tokens_per_s": global_tokens_per_s, "perf/tflops_per_device": tflops}
        if self.peak:
            self.last["perf/mfu"] = tflops / self.peak
        for name, value in self.last.items():
            on_bar = self.prog_bar and name != "perf/tflops_per_device"
            pl_module.log(name, value, on_step=True, on_epoch=False, prog_bar=on_bar, rank_zero_only=True)
        self._reset()
