"""Loaders that stream windows of a prepared directory (``prepare-data``) with litdata.

Memory does not grow with the corpus: litdata reads the chunks it needs and drops them. The training loader is
litdata's ``StreamingDataLoader``, whose ``state_dict`` Lightning stores in its checkpoints and restores on resume,
so a resumed run continues with exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .prepared import Manifest, PreparedDataError, require_litdata


def collate_long(windows: list[torch.Tensor]) -> torch.Tensor:
    """Stack windows into one batch of int64 ids (chunks store the narrowest dtype; embeddings want int64)."""
    return torch.stack(windows).long()


def check_windows(manifest: Manifest, directory: str | Path, seq_len: int, batch_size: int, replicas: int) -> None:
    """Refuse, before training, a prepared corpus too small for one batch per data-parallel rank (training) or one
    window per rank (validation)."""
    window = seq_len + 1
    needs = {"train": batch_size * replicas, "val": replicas}
    for split, need in needs.items():
        have = manifest.splits[split]["tokens"] // window
        if have < need:
            raise PreparedDataError(
                f"the {split} split of {directory} has {manifest.splits[split]['tokens']} tokens, {have} windows of "
                f"seq_len + 1 = {window}, fewer than the {need} one step needs ({replicas} data-parallel rank(s)"
                f"{f' x batch_size {batch_size}' if split == 'train' else ''}): lower seq_len or batch_size, or "
                "prepare a larger corpus")


def streaming_loader(directory: str | Path, split: str, seq_len: int, batch_size: int, *, shuffle: bool, seed: int,
                     num_workers: int, replicas: int, rank: int) -> Any:
    """A ``StreamingDataLoader`` of ``seq_len + 1``-token windows of ``directory/split`` for data-parallel rank
    ``rank`` of ``replicas``. Training drops the ragged tail so every rank runs the same number of steps."""
    litdata = require_litdata()
    from litdata.utilities.env import _DistributedEnv

    dataset = litdata.StreamingDataset(str(Path(directory).expanduser() / split), shuffle=shuffle, seed=seed,
                                       item_loader=litdata.TokensLoader(block_size=seq_len + 1),
                                       drop_last=shuffle or replicas > 1)
    # litdata takes every torch.distributed rank for a data-parallel replica. Under tensor or pipeline parallelism
    # the ranks of one group must read the same batch, so the strategy's data-parallel ranks replace its guess
    # (a private attribute: litdata has no public way to name the replicas).
    dataset.distributed_env = _DistributedEnv(replicas, rank, 1)
    return litdata.StreamingDataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                                       collate_fn=collate_long, drop_last=shuffle or replicas > 1)
