"""CUDA checks of the block streamer: real host<->device copies on a side stream, pinned buffers, memory drop.

Skipped without a GPU. Run them on a CUDA machine with ``python -m pytest tests/gpu -q``. Offloaded blocks step on
the host (CPU AdamW), resident ones on the device (CUDA AdamW): different kernels, so the comparison with resident
training uses the trained-alike bound of tests/unit/equivalence.py, not bit equality.
"""

import sys
from pathlib import Path

import lightning as L
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from equivalence import assert_trained_alike  # noqa: E402
from helpers import TINY, InitialWeights, tiny_data  # noqa: E402

from lightning_p2r import M6Config, M6LanguageModel, OptimizerConfig, P2RStrategy  # noqa: E402

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _fit(tmp_path: Path, strategy, precision: str = "32-true", callbacks=(), accumulate: int = 1):
    L.seed_everything(3)
    module = M6LanguageModel(M6Config(**(TINY | {"num_layers": 6, "dim": 64})), OptimizerConfig(warmup_steps=1))
    trainer = L.Trainer(accelerator="cuda", devices=1, strategy=strategy, max_steps=4, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, limit_val_batches=0,
                        precision=precision, default_root_dir=tmp_path,
                        callbacks=list(callbacks), accumulate_grad_batches=accumulate)
    torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, datamodule=tiny_data(tmp_path))
    return module, trainer, torch.cuda.max_memory_allocated()


def test_cuda_offload_matches_resident_training_and_uses_less_memory(tmp_path: Path) -> None:
    initial = InitialWeights()
    reference, _, resident_peak = _fit(tmp_path / "ref", P2RStrategy(), callbacks=[initial])
    offloaded, trainer, offload_peak = _fit(tmp_path / "off", P2RStrategy(offload_fraction=1.0))
    assert_trained_alike(offloaded.state_dict(), reference.state_dict(), initial.weights, name="cuda offload")
    assert offload_peak < resident_peak
    stats = trainer.strategy.telemetry_history[-1]
    assert stats.peak_resident_offloaded_blocks <= 2 and stats.h2d_bytes > 0


def test_cuda_offload_accumulates_micro_batches_through_pinned_memory(tmp_path: Path) -> None:
    """Standard accumulation: the later micro-batches' gradients are added on the host through a pinned landing
    buffer (not a fresh pageable tensor each): still the resident run's training, and the buffer is pinned."""
    landings = []

    class Inspect(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            landings.append(dict(trainer.strategy.streamer._grad_landing))

    initial = InitialWeights()
    reference, _, _ = _fit(tmp_path / "ref", P2RStrategy(), callbacks=[initial], accumulate=2)
    offloaded, _, _ = _fit(tmp_path / "off", P2RStrategy(offload_fraction=1.0), callbacks=[Inspect()], accumulate=2)
    assert_trained_alike(offloaded.state_dict(), reference.state_dict(), initial.weights, name="cuda offload mb2")
    assert landings[-1] and all(buffer.is_pinned() for buffer in landings[-1].values())


def test_cuda_pins_host_buffers_by_default(tmp_path: Path) -> None:
    strategy = P2RStrategy(offload_fraction=0.5)
    pinned = []

    class Inspect(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            for block in trainer.strategy.streamer.blocks.values():
                pinned.extend(t.is_pinned() for t in (*block.host, *block.host_grads) if t is not None)

    L.seed_everything(3)
    module = M6LanguageModel(M6Config(**(TINY | {"num_layers": 4})), OptimizerConfig(warmup_steps=1))
    trainer = L.Trainer(accelerator="cuda", devices=1, strategy=strategy, max_steps=2, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, limit_val_batches=0,
                        default_root_dir=tmp_path, callbacks=[Inspect()])
    trainer.fit(module, datamodule=tiny_data(tmp_path))
    assert strategy.context().pin_memory is True
    assert pinned and all(pinned)


def test_cuda_bf16_mixed_offload_runs(tmp_path: Path) -> None:
    module, trainer, _ = _fit(tmp_path, P2RStrategy(offload_fraction=0.5), precision="bf16-mixed")
    assert all(torch.isfinite(p).all() for p in module.parameters())


@pytest.mark.parametrize("clip", [None, 0.5], ids=["no_clip", "clip"])
def test_cuda_delayed_host_steps_follow_the_rule(tmp_path: Path, clip: float | None) -> None:
    """The delayed host step on a real copy stream, pinned published copies and a host thread: the same losses and
    weights as the rule applied by hand on the CPU (tests/unit/test_delayed_host_step.py), so no asynchronous copy
    reads a published copy while the next update overwrites it."""
    import test_delayed_host_step as rule

    expected_losses, expected_weights = rule.delayed_by_hand(clip)
    module = rule.Module()
    trainer = L.Trainer(accelerator="cuda", devices=1, max_steps=rule.STEPS, logger=False,
                        strategy=P2RStrategy(offload_blocks=list(rule.OFFLOADED), host_step="delayed"),
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=tmp_path, gradient_clip_val=clip)
    trainer.fit(module, torch.utils.data.DataLoader(rule.batches(), batch_size=rule.BATCH))
    assert trainer.strategy.context().pin_memory is True
    assert module.losses == pytest.approx(expected_losses, rel=1e-4, abs=1e-5)
    for name, value in module.model.state_dict().items():
        torch.testing.assert_close(value.cpu(), expected_weights[name], rtol=1e-4, atol=1e-5, msg=name)
