"""Small shared builders for the unit tests: a tiny model config, corpus, data module and trainer."""

from pathlib import Path

import lightning as L
import torch
from torch.distributed.tensor import DTensor

from lightning_p2r import TextDataModule

TINY = {"vocab_size": 256, "max_seq_len": 16, "num_layers": 2, "dim": 32, "num_heads": 4, "num_experts": 4}


def tiny_corpus(tmp_path: Path) -> str:
    path = tmp_path / "corpus.txt"
    if not path.exists():
        tmp_path.mkdir(parents=True, exist_ok=True)
        path.write_text("In the beginning was the word, and the word was tested. " * 200, encoding="utf-8")
    return str(path)


def tiny_data(tmp_path: Path, batch_size: int = 4) -> TextDataModule:
    return TextDataModule(corpus=tiny_corpus(tmp_path), tokenizer="bytes", seq_len=16, batch_size=batch_size,
                          cache_dir=str(tmp_path / "cache"))


def tiny_trainer(tmp_path: Path, **kwargs) -> L.Trainer:
    options = {"max_steps": 6, "accelerator": "cpu", "devices": 1, "logger": False, "enable_progress_bar": False,
               "enable_model_summary": False, "default_root_dir": tmp_path, "limit_val_batches": 2,
               "val_check_interval": 3, "check_val_every_n_epoch": None, "log_every_n_steps": 1}
    return L.Trainer(**(options | kwargs))


class InitialWeights(L.Callback):
    """Records the weights training starts from, for comparisons relative to how far training moved them."""

    weights: dict[str, torch.Tensor]

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A sharded parameter is gathered whole (every rank calls this hook, in the same order).
        self.weights = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().clone()
                        for k, v in pl_module.state_dict().items()}
