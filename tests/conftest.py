import os

import pytest
import torch

# Two cores: keep torch from oversubscribing them when pytest runs several things.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _offline_wandb(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    # Nothing in the suite may reach the network or write outside its temp dir.
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("LIGHTNING_P2R_CACHE", str(tmp_path / "cache"))
