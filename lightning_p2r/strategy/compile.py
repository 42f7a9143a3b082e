"""Per-block ``torch.compile`` (``P2RStrategy(compile=...)``), before FSDP2 wraps the block (``placement.py``).
A block's class is switched to a subclass whose ``forward`` is compiled, not its ``__call__``: the layouts' hooks
(FSDP2's gathers, the block streamer's fetches) run eagerly around the compiled code instead of becoming guards,
a deep copy (delinking) stays compiled, and every block of a class shares one compiled function (docs/offload.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

_compiled_classes: dict[tuple[type, str], type] = {}


class CompiledForward:
    """Marks a block class whose ``forward`` is compiled (made by :func:`compiled_class`)."""

    compile_backend: str


def backend_of(option: bool | str) -> str | None:
    """The torch.compile backend the ``compile`` option asks for: None (off), "inductor" (True) or the named one."""
    if option is False:
        return None
    return "inductor" if option is True else option


def check_compile(option: bool | str, *, count_collectives: bool) -> None:
    """Refuse, before any process group exists, what would fail or silently run eagerly at the first forward: an
    unknown backend, and ``count_collectives=True`` (dynamo does not compile under its ``TorchDispatchMode``)."""
    backend = backend_of(option)
    if backend is None:
        return
    known = torch.compiler.list_backends(exclude_tags=())
    if backend not in known:
        raise ValueError(f"P2RStrategy(compile={option!r}): torch.compile knows no backend {backend!r}; use True "
                         f"(inductor) or one of {sorted(known)}")
    if count_collectives:
        raise ValueError(f"P2RStrategy(compile={option!r}, count_collectives=True): the counter is a dispatch mode, "
                         "under which torch.compile does not compile; count collectives on an eager run")


def compiled_class(cls: type[nn.Module], backend: str) -> type[nn.Module]:
    """``cls`` with its ``forward`` compiled by ``backend`` (one class, and one compiled function, per pair)."""
    key = (cls, backend)
    if key not in _compiled_classes:
        compiled = torch.compile(cls.forward, backend=backend)

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return compiled(self, *(_settled(a) for a in args), **{k: _settled(v) for k, v in kwargs.items()})

        _compiled_classes[key] = type(f"Compiled{cls.__name__}", (CompiledForward, cls),
                                      {"forward": forward, "compile_backend": backend, "__module__": cls.__module__})
    return _compiled_classes[key]


def _settled(value: Any) -> Any:
    """``value``, or a plain copy of it (which waits, on the autograd graph) when it is an ``AsyncCollectiveTensor``,
    a tensor-parallel layer's all-reduced output still in flight: a compiled block taking one gives autograd a plain
    gradient where the DTensor backward before it needs a DTensor (measured: wrong gradients, with rotary positions)."""
    return value.clone() if isinstance(value, AsyncCollectiveTensor) else value


def apply_compile(option: bool | str, blocks: nn.ModuleList, indices: Iterable[int] | None = None) -> None:
    """Compile the forward of ``blocks[i]`` for each i of ``indices`` (default all), unless compiled already."""
    backend = backend_of(option)
    if backend is None:
        return
    for index in range(len(blocks)) if indices is None else indices:
        block = blocks[index]
        if not isinstance(block, CompiledForward):
            block.__class__ = compiled_class(type(block), backend)


def is_compiled(block: nn.Module) -> bool:
    """Whether ``block``'s forward runs compiled."""
    return isinstance(block, CompiledForward)
