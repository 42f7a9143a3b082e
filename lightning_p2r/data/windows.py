"""Fixed windows of ``seq_len + 1`` tokens from one id stream, the train/validation split, and the samplers and
loaders that resume mid-epoch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

# ------------------------------------------------------------------------------------------------- windows


def pack_sequences(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Cut a 1-D id stream into rows of ``seq_len + 1`` tokens with stride ``seq_len``.

    Consecutive rows share one token, so every token except the first is a target exactly once. The ragged tail
    that does not fill a row is dropped. Returns a ``(num_windows, seq_len + 1)`` long tensor.
    """
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if ids.numel() < seq_len + 1:
        raise ValueError(f"Need at least seq_len + 1 = {seq_len + 1} tokens to make one window, got {ids.numel()}")
    # unfold gives a strided view; contiguous() copies it so each row is independent of the original stream.
    return ids.long().unfold(0, seq_len + 1, seq_len).contiguous()


def split_train_val(ids: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a 1-D id stream into (train, val): the last ``val_fraction`` of the tokens is validation.

    A contiguous cut (rather than shuffled windows) keeps validation text disjoint from training text.
    """
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be strictly between 0 and 1, got {val_fraction}")
    n_val = round(ids.numel() * val_fraction)
    cut = ids.numel() - n_val
    return ids[:cut], ids[cut:]


class _Rows(Dataset[torch.Tensor]):
    """Index rows of a 2-D tensor, so the default collate stacks a batch into one tensor."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return self.rows.shape[0]

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.rows[index]


class EpochShuffleSampler(DistributedSampler):
    """Shuffled order that is a pure function of (seed, epoch), split across ranks, able to resume mid-epoch.

    A resumed run must see the batches the interrupted one had not reached yet, in the same order; a
    ``RandomSampler`` with a generator cannot give that, because the generator's state is not checkpointed.
    Lightning calls ``set_epoch`` at every epoch start. Each of ``num_replicas`` ranks takes every
    ``num_replicas``-th index of the epoch's permutation (the tail that does not divide evenly is left out, so
    ranks run the same number of steps). Being a ``DistributedSampler``, Lightning uses it as it is instead of
    wrapping it, so resuming and epoch seeding keep working under DDP and the package's strategy.
    """

    def __init__(self, num_samples: int, seed: int, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(range(num_samples), num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed,
                         drop_last=True)
        self.total_samples = num_samples
        self._skip = 0
        self._resume_epoch: int | None = None
        self._epoch_offset = 0
        self.last_epoch = 0

    def resume(self, epoch: int, num_samples_done: int) -> None:
        """Make the next iteration replay ``epoch``'s order without this rank's first ``num_samples_done`` indices.

        The epoch is stored rather than taken from ``set_epoch``: a run stopped by ``max_steps`` counts its
        unfinished epoch as processed, so Lightning's epoch number after such a resume is one ahead.
        """
        self._resume_epoch, self._skip = epoch, num_samples_done

    def __iter__(self) -> Iterator[int]:
        if self._resume_epoch is not None:
            # Keep the correction for every later epoch too, or the resumed run would skip one epoch's order.
            self._epoch_offset = self._resume_epoch - self.epoch
        epoch = self.epoch + self._epoch_offset
        generator = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(self.total_samples, generator=generator).tolist()
        mine = order[self.rank:self.num_samples * self.num_replicas:self.num_replicas]
        start = self._skip
        self._skip, self._resume_epoch, self.last_epoch = 0, None, epoch
        return iter(mine[start:])

    def __len__(self) -> int:
        return self.num_samples


class _ResumableLoader(DataLoader):
    """The training loader, declared resumable to Lightning (``state_dict``/``load_state_dict``).

    The position lives in :class:`TextDataModule`'s own state, which Lightning restores before the loader is built:
    the sampler then starts at the next unseen batch. Without these methods Lightning warns on every mid-epoch
    resume that the order may be unreliable, which here it is not (tested bit-identical to an uninterrupted run).
    """

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass
