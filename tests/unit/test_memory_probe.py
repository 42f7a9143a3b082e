"""The setup memory probe shared by the capacity benchmark: what it counts as parameters, and that a peak during
setup shows up in its growth whichever way the host peak is taken (kernel high-water mark or sampled RSS)."""

from __future__ import annotations

import time

import lightning as L
import pytest
import torch

from lightning_p2r import M6Config, M6LanguageModel, OptimizerConfig, P2RStrategy
from lightning_p2r.measure.memory import MiB, PeakRSS, SetupMemoryProbe, parameter_bytes, reset_hwm
from lightning_p2r.strategy.host_allocator import MMAP_THRESHOLD

SPIKE_BYTES = 320 * MiB
# Above the size from which a process whose strategy keeps freed host memory (P2RStrategy(host_allocator="auto") on a
# CPU, strategy/host_allocator.py) still maps an allocation on its own: in a test process that trained before, a
# smaller spike may land in heap memory an earlier test freed and kept, already resident, and not grow the RSS.
assert SPIKE_BYTES > MMAP_THRESHOLD


class SpikeInConfigureModel(L.LightningModule):
    """A tiny model whose ``configure_model`` touches a 320 MiB buffer and frees it before setup ends."""

    def __init__(self) -> None:
        super().__init__()
        self.layer: torch.nn.Linear | None = None

    def configure_model(self) -> None:
        if self.layer is not None:
            return
        spike = torch.ones(SPIKE_BYTES // 4)  # ones, not empty: untouched pages are not resident
        time.sleep(0.05)  # long enough for the 2 ms sampler to see it as well as the kernel's mark
        del spike
        self.layer = torch.nn.Linear(8, 8)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class EmptyStorages(L.Callback):
    """Counts the parameters whose storage is empty at the first batch, when the probe counts parameter bytes."""

    count = 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object,
                             batch_idx: int) -> None:
        if batch_idx == 0:
            self.count = sum(p.untyped_storage().size() == 0 for p in pl_module.parameters())


def _fit(module: L.LightningModule, probe: SetupMemoryProbe, data: torch.Tensor,
         extra_callbacks: list[L.Callback] | None = None, **trainer_options) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False,
                        callbacks=[probe, *(extra_callbacks or [])], **trainer_options)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    return trainer


@pytest.mark.parametrize("method", ["hwm", "sample"])
def test_a_transient_buffer_during_setup_shows_in_the_growth(method: str) -> None:
    if method == "hwm" and not reset_hwm():
        pytest.skip("this kernel does not reset VmHWM through /proc/self/clear_refs")
    probe = SetupMemoryProbe(method=method)
    module = SpikeInConfigureModel()
    trainer = _fit(module, probe, torch.randn(8, 8))
    result = probe.result
    assert trainer.global_step == 2 and result.method == method
    assert result.setup_growth is not None and result.setup_growth >= 0.9 * SPIKE_BYTES
    assert result.param_bytes == sum(p.numel() * 4 for p in module.parameters()) == (64 + 8) * 4
    assert result.run_peak_rss >= result.setup_peak_rss >= result.rss_at_setup > 0
    assert result.cuda_setup_peak is None  # a CPU run records no device figures


def test_growth_is_non_negative_and_offloaded_placeholders_count_by_shape() -> None:
    config = M6Config(vocab_size=64, max_seq_len=8, num_layers=2, dim=32, num_heads=4, moe_layers=[])
    reference = M6LanguageModel(config, OptimizerConfig(warmup_steps=1))
    reference.configure_model()
    expected = sum(p.numel() * 4 for p in reference.parameters())
    probe, placeholders = SetupMemoryProbe(), EmptyStorages()
    module = M6LanguageModel(config, OptimizerConfig(warmup_steps=1))
    _fit(module, probe, torch.randint(0, 64, (4, 9)), strategy=P2RStrategy(offload_fraction=1.0),
         extra_callbacks=[placeholders])
    assert probe.result.setup_growth is not None and probe.result.setup_growth >= 0
    # Every block is offloaded: when the probe counted, its parameters were placeholders over empty storages.
    assert placeholders.count > 0
    assert probe.result.param_bytes == expected == parameter_bytes(module)


def test_parameter_bytes_counts_a_shared_parameter_once_and_an_empty_storage_by_shape() -> None:
    tied = torch.nn.Linear(4, 6, bias=False)
    model = torch.nn.ModuleDict({"a": tied, "b": tied, "c": torch.nn.Linear(6, 2)})
    model["c"].weight.data.untyped_storage().resize_(0)
    assert parameter_bytes(model) == (24 + 12 + 2) * 4
    assert parameter_bytes(model, bytes_per_element=2) == (24 + 12 + 2) * 2


def test_peak_rss_rejects_an_unknown_method_and_a_peak_before_start() -> None:
    with pytest.raises(ValueError, match="method"):
        PeakRSS("vmpeak")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="before start"):
        PeakRSS().peak()
