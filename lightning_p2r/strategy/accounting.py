"""Counting what a training step holds and moves: local tensor bytes, and the collectives it issues. A dispatch
mode sees each ``c10d`` op (FSDP2, DDP, ``ZeroRedundancyOptimizer``) with its tensors, so the counts and bytes are
observed, not derived from a model of what the engines should do.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, the whole tensor otherwise."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank stores for ``tensor`` (its local part)."""
    local = local_tensor(tensor)
    return local.numel() * local.element_size()


# The payload of a collective: the whole (unsharded) buffer for gathers and scatters, the sum for list ops.
_GATHER_SCATTER = ("allgather", "reduce_scatter", "_allgather_base", "_reduce_scatter_base")


@dataclass
class CollectiveStats:
    """Collectives issued during one optimizer step (all of its micro-batches)."""

    calls: Counter = field(default_factory=Counter)  # per kind (all_gather, reduce_scatter, all_reduce, ...)
    # Payload bytes per kind: the full buffer a gather or scatter assembles or splits, the tensors reduced or sent.
    bytes: Counter = field(default_factory=Counter)

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def as_metrics(self, prefix: str = "comm/") -> dict[str, float]:
        metrics = {f"{prefix}calls": float(self.total_calls), f"{prefix}bytes": float(self.total_bytes)}
        for kind in self.calls:
            metrics[f"{prefix}{kind}_calls"] = float(self.calls[kind])
            metrics[f"{prefix}{kind}_bytes"] = float(self.bytes[kind])
        return metrics


def collective_payload(namespace: str, name: str, args: Any, kwargs: dict[str, Any]) -> tuple[str, int]:
    """The kind of a collective op and its payload in bytes (see :class:`CollectiveStats`). Process-group ("c10d")
    ops carry their input and output tensors; functional ones (DTensor's redistributions) only their input, so a
    functional gather's payload is its input times the group size. An all-to-all's payload is what this rank sends."""
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    sizes = [t.numel() * t.element_size() for t in tensors]
    kind = _kind(name)
    if kind == "all_to_all":
        if namespace == "_c10d_functional":
            return kind, sizes[0]  # (input, split sizes, group)
        if name.startswith("alltoall_base"):
            return kind, sizes[1]  # (output, input, ...)
        return kind, sum(sizes[len(sizes) // 2:])  # (outputs, inputs, ...)
    if namespace == "_c10d_functional":
        return kind, sizes[0] * (int(args[1]) if kind == "all_gather" else 1)
    return kind, max(sizes, default=0) if name.startswith(_GATHER_SCATTER) else sum(sizes)


def _kind(op_name: str) -> str:
    name = op_name.strip("_").split(".")[0].rstrip("_")
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all"):
        if name.replace("_", "").startswith(kind.replace("_", "")):  # c10d spells allgather, functional all_gather
            return kind
    return name


class CollectiveCounter(TorchDispatchMode):
    """Enter around the code of a step (re-entering later in the same step is fine); ``take()`` ends the record."""

    def __init__(self) -> None:
        super().__init__()
        self.stats = CollectiveStats()
        self.active = False
        self.paused = False

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Leave out the collectives inside: bookkeeping that is not part of the training layout (the ranks'
        agreement on whether a loss is finite)."""
        self.paused, before = True, self.paused
        try:
            yield
        finally:
            self.paused = before

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.paused and func.namespace in ("c10d", "_c10d_functional") and not func.__name__.startswith(
                ("wait", "barrier")):
            kind, payload = collective_payload(func.namespace, func.__name__, args, kwargs or {})
            self.stats.calls[kind] += 1
            self.stats.bytes[kind] += payload
        return func(*args, **(kwargs or {}))

    def take(self) -> CollectiveStats:
        stats, self.stats = self.stats, CollectiveStats()
        return stats


@contextlib.contextmanager
def counting(counter: CollectiveCounter | None) -> Iterator[None]:
    """Count the collectives inside when a counter is given. Re-entrant: Lightning's closure runs training_step and
    backward inside optimizer_step, and each of them counts."""
    if counter is None or counter.active:
        yield
        return
    counter.active = True
    try:
        with counter:
            yield
    finally:
        counter.active = False
