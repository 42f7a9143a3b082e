"""The training loader of a mixture (languages, or listed prepared directories), resumable at the batch training
reached rather than the batch the loader reached.

Lightning reads a loader without a length one batch ahead, to know when the epoch ends; a mixture's
``CombinedStreamingDataset`` has no length (its epoch ends when one part runs out), so by the time a checkpoint is
written litdata's loader has counted one batch more than training consumed, and a resumed run would skip that
batch. This loader keeps the window counts it had after each of its last few batches and, asked for its state,
gives the one of the batch training consumed last (as the data module counts them); litdata's own state otherwise.
The parts' states are rebuilt from those counts: without loader workers the combined dataset would report its live
iterator's counts instead, one batch ahead too.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from copy import deepcopy
from typing import Any

from litdata import StreamingDataLoader, StreamingDataset

_KEPT = 8  # batches of state kept: Lightning reads one ahead; a few more cost nothing


class MixtureLoader(StreamingDataLoader):
    """A ``StreamingDataLoader`` of a ``CombinedStreamingDataset`` of ``parts`` whose ``state_dict`` is the state
    after the ``consumed()``-th batch of the epoch."""

    def __init__(self, *args: Any, parts: list[StreamingDataset], consumed: Callable[[], int | None] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._parts, self._consumed = parts, consumed
        self._after_batch: deque[tuple[int, dict[int, list[int]], int]] = deque(maxlen=_KEPT)

    def __iter__(self) -> Iterator[Any]:
        self._after_batch.clear()
        for batch in super().__iter__():
            counts = deepcopy(self._num_samples_yielded_wrapper)
            windows = sum(sum(per_part) for per_part in counts.values())
            self._after_batch.append((windows, counts, self._latest_worker_idx))
            yield batch

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        consumed = self._consumed() if self._consumed is not None else None
        kept = [entry for entry in self._after_batch if consumed is not None and entry[0] == consumed * self.batch_size]
        if not kept:
            return state
        _, counts, worker = kept[-1]
        per_part = [sum(column) for column in zip(*counts.values())]  # each part's windows, over the workers
        state["dataset"] = {str(i): part.state_dict(num_samples_yielded=windows, num_workers=self.num_workers,
                                                    batch_size=self.batch_size)
                            for i, (part, windows) in enumerate(zip(self._parts, per_part))}
        state["num_samples_yielded"], state["latest_worker_idx"] = counts, worker
        return state
