"""Count the operations that make the host wait for the device (issue 40: the MoE path must have none).

On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` is the authoritative check: it raises at the synchronizing call.
On a CPU nothing synchronizes, so :class:`HostSyncCounter` records the operations that *would*: reading a value on the
host (``.item()``, ``.tolist()``, printing), and the operators whose output size depends on data (``nonzero``,
boolean-mask indexing, ``masked_select``, ``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``).
A path that runs with zero counts on CPU makes none of those calls on a GPU either.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SYNCING_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "_unique", "unique_dim", "unique_consecutive",
                "bincount", "masked_scatter")


def _op_name(func: Any) -> str:
    return str(func).split(".")[1] if str(func).startswith("aten.") else str(func)


def _is_mask(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype in (torch.bool, torch.uint8)


class HostSyncCounter(TorchDispatchMode):
    """Context manager: ``counts`` maps each synchronizing operation seen to how often it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self._tolist: Any = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = _op_name(func)
        if name in _SYNCING_OPS:
            self.counts[name] += 1
        elif name == "index" and any(_is_mask(index) for index in (args[1] if len(args) > 1 else ())):
            self.counts["boolean index"] += 1
        elif name == "repeat_interleave" and (kwargs or {}).get("output_size") is None and len(args) == 1:
            self.counts["repeat_interleave"] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> HostSyncCounter:
        # tolist reads the data directly on CPU, without passing the dispatcher: count it at the Python level.
        self._tolist = torch.Tensor.tolist
        counts, original = self.counts, self._tolist

        def counted_tolist(tensor: torch.Tensor) -> Any:
            counts["tolist"] += 1
            return original(tensor)
        torch.Tensor.tolist = counted_tolist
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.tolist = self._tolist
        super().__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.counts.values())
