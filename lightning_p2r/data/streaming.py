"""Loaders that stream windows of a prepared directory (``prepare-data``) with litdata.

Memory does not grow with the corpus: litdata reads the chunks it needs and drops them. The training loader is
litdata's ``StreamingDataLoader``, whose ``state_dict`` Lightning stores in its checkpoints and restores on resume,
so a resumed run continues with exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

from collections.abc import Callable
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


def mixture_weights(tokens: dict[str, int], alpha: float) -> dict[str, float]:
    """mGPT / XLM language sampling: language l is drawn with probability proportional to ``n_l ** alpha`` (its
    training tokens): alpha 1 samples as the corpus is, alpha 0 uniformly; small alphas up-sample small languages."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"data.language_alpha must be between 0 and 1 (0 uniform, 1 as the corpus is), got {alpha}")
    if not tokens or any(count <= 0 for count in tokens.values()):
        raise ValueError(f"every language needs training tokens to be sampled, got {tokens}")
    raw = {code: count**alpha for code, count in tokens.items()}
    total = sum(raw.values())
    return {code: value / total for code, value in raw.items()}


def streaming_loader(directory: str | Path, split: str | dict[str, str], seq_len: int, batch_size: int, *,
                     shuffle: bool, seed: int, num_workers: int, replicas: int, rank: int,
                     weights: dict[str, float] | None = None, consumed: Callable[[], int | None] | None = None) -> Any:
    """A ``StreamingDataLoader`` of ``seq_len + 1``-token windows of ``directory/split`` for data-parallel rank
    ``rank`` of ``replicas``. Training drops the ragged tail so every rank runs the same number of steps.

    ``split`` may map names (languages) to split folders, joined onto ``directory`` (an absolute folder stands as it
    is): training then draws each window's folder by ``weights`` (and an epoch ends when one of them runs out),
    validation reads every folder to its end. ``consumed`` counts the batches of the epoch training has taken: a
    training mixture's checkpointed state is then the one after that batch (``mixture_loader.py`` says why).
    """
    litdata = require_litdata()
    from litdata.utilities.env import _DistributedEnv

    folders = {"": split} if isinstance(split, str) else split
    datasets = []
    for folder in folders.values():
        # Resolved here, so that neither the loader nor its worker processes depend on the working directory.
        # item_shuffle_window=0: a full permutation of each chunk's windows. litdata's default (blocks of 256
        # consecutive windows) filled each batch with one passage of the corpus, and the quickstart's validation
        # loss at step 99 came out 0.5 above the in-memory path's.
        dataset = litdata.StreamingDataset(str((Path(directory).expanduser() / folder).resolve()), shuffle=shuffle,
                                           seed=seed, item_shuffle_window=0,
                                           item_loader=litdata.TokensLoader(block_size=seq_len + 1),
                                           drop_last=shuffle or replicas > 1)
        # litdata takes every torch.distributed rank for a data-parallel replica. Under tensor or pipeline
        # parallelism the ranks of one group must read the same batch, so the strategy's data-parallel ranks
        # replace its guess (a private attribute: litdata has no public way to name the replicas).
        dataset.distributed_env = _DistributedEnv(replicas, rank, 1)
        datasets.append(dataset)
    loader_options = {"batch_size": batch_size, "num_workers": num_workers, "collate_fn": collate_long,
                      "drop_last": shuffle or replicas > 1}
    if len(datasets) == 1:
        return litdata.StreamingDataLoader(datasets[0], **loader_options)
    probabilities = [weights[code] for code in folders] if shuffle and weights else None
    combined = litdata.CombinedStreamingDataset(datasets, seed=seed, weights=probabilities,
                                                iterate_over_all=not shuffle)
    if not shuffle:
        return litdata.StreamingDataLoader(combined, **loader_options)
    from .mixture_loader import MixtureLoader

    return MixtureLoader(combined, parts=datasets, consumed=consumed, **loader_options)
