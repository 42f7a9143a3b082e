"""Small shared builders for the unit tests: a tiny model config, corpus, data module and trainer."""

import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.distributed.tensor import DTensor

from lightning_p2r import TextDataModule
from lightning_p2r.strategy.layered import BlockEvents, LayeredStages, layered_forward

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


@dataclass
class AccumulationResult:
    loss: torch.Tensor
    """Detached mean of the micro-batch losses (head loss plus the layers' extra losses)."""
    metrics: dict[str, torch.Tensor]
    """Mean over micro-batches of the head metrics."""


def run_layered(stages: LayeredStages, micro_batches: list[Any], events: BlockEvents | None = None, *,
                recompute: bool = False) -> AccumulationResult:
    """One optimizer step's forward and backward through the strategy's layered executor (``layered_forward``, then
    the step's ``backward``): the gradients accumulated into ``.grad`` must equal :func:`run_depth_first`'s on the
    same micro-batches (up to summation order)."""
    step = layered_forward(stages, micro_batches, events, recompute=recompute)
    step.backward()
    return AccumulationResult(step.loss, step.metrics)


def run_depth_first(loss_fn: Callable[[Any], tuple[torch.Tensor, dict[str, torch.Tensor]]],
                    micro_batches: list[Any]) -> AccumulationResult:
    """Standard gradient accumulation, the reference: forward and backward of ``loss / m`` for one micro-batch after
    another; ``loss_fn`` maps a micro-batch to (loss, metrics)."""
    m = len(micro_batches)
    losses, metrics = [], []
    for micro_batch in micro_batches:
        loss, loss_metrics = loss_fn(micro_batch)
        (loss / m).backward()
        losses.append(loss.detach().float())
        metrics.append({key: value.detach() for key, value in loss_metrics.items()})
    return AccumulationResult(torch.stack(losses).mean(), {
        key: torch.stack([torch.as_tensor(m[key]).detach().float() for m in metrics]).mean() for key in metrics[0]})


class RecordBatches(L.Callback):
    """Keeps a copy of every training batch, in order: what a resumed run is compared on."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append(batch.clone())


def flip_inside_largest_record(path: Path) -> None:
    """Invert 16 bytes in the middle of the largest record of the zip archive ``path`` (a tensor's data)."""
    with zipfile.ZipFile(path) as archive:
        info = max(archive.infolist(), key=lambda record: record.compress_size)
    with path.open("r+b") as stream:
        stream.seek(info.header_offset + 26)
        name_length, extra_length = (int.from_bytes(stream.read(2), "little") for _ in range(2))
        _flip(stream, info.header_offset + 30 + name_length + extra_length + info.compress_size // 2)


def flip_inside_largest_item(folder: Path) -> str:
    """Invert 16 bytes in the middle of the largest item of the DCP checkpoint in ``folder``; its shard's name."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    storage = FileSystemReader(str(folder)).read_metadata().storage_data
    info = max(storage.values(), key=lambda item: item.length)
    with (folder / info.relative_path).open("r+b") as stream:
        _flip(stream, info.offset + info.length // 2)
    return info.relative_path


def _flip(stream, position: int) -> None:
    stream.seek(position)
    data = stream.read(16)
    stream.seek(position)
    stream.write(bytes(255 - byte for byte in data))
