"""A model three times larger than the device trains with offload, and setup never puts it on the device.

Skipped without a GPU. The device is capped at 8 GiB with ``torch.cuda.set_per_process_memory_fraction``; the model's
fp32 parameters, gradients and AdamW states (16 bytes per parameter) are at least 24 GiB. With every block offloaded
the device holds the non-block parameters and the streaming window, and setup (built on the meta device, offloaded
blocks materialized straight into host memory) allocates no more than what the plan keeps resident.
"""

import sys
from pathlib import Path

import lightning as L
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from lightning_p2r import M6Config, M6LanguageModel, OptimizerConfig, P2RStrategy  # noqa: E402
from lightning_p2r.strategy.offload_plan import block_footprints  # noqa: E402

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CAP = 8 * 2**30
BIG = {"vocab_size": 4096, "max_seq_len": 128, "num_layers": 8, "dim": 4096, "num_heads": 32, "moe_layers": []}


class SetupPeak(L.Callback):
    """Device bytes allocated from the start of setup to the first step, and after each step."""

    def setup(self, trainer, pl_module, stage) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.start = torch.cuda.memory_allocated()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            self.setup_peak = torch.cuda.max_memory_allocated() - self.start


@pytest.mark.timeout(1800)
def test_model_three_times_the_device_trains_with_offload(tmp_path: Path) -> None:
    torch.cuda.set_per_process_memory_fraction(CAP / torch.cuda.get_device_properties(0).total_memory)
    try:
        L.seed_everything(0)
        module = M6LanguageModel(M6Config(**BIG), OptimizerConfig(lr=1e-4, warmup_steps=1))
        probe = SetupPeak()
        strategy = P2RStrategy(offload_fraction=1.0, prefetch=1)
        data = torch.randint(0, BIG["vocab_size"], (8, BIG["max_seq_len"] + 1))
        trainer = L.Trainer(accelerator="cuda", devices=1, strategy=strategy, max_steps=2, logger=False,
                            enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                            callbacks=[probe], default_root_dir=tmp_path)
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=1))
        params = sum(p.numel() for p in module.parameters())
        assert params * 16 >= 3 * CAP, f"the model ({params:,} parameters) is not 3x the cap"
        assert trainer.global_step == 2
        holder = module.transformer
        in_blocks = {id(p) for p in holder.blocks.parameters()}
        resident = sum(p.numel() * 4 for p in module.parameters() if id(p) not in in_blocks)
        window = (strategy.prefetch + 1) * max(f.streaming for f in block_footprints(holder.blocks))
        assert probe.setup_peak <= resident + window, (probe.setup_peak, resident, window)
        assert torch.isfinite(torch.stack([p.detach().float().norm() for p in module.parameters()])).all()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
