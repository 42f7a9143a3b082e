"""Per-block ``torch.compile`` (``P2RStrategy(compile=...)``), after the model's tensor / expert plan and recompute,
before FSDP2 wraps the block, as torchtitan does (``placement.py``).

A block's class is switched to a subclass whose ``forward`` is compiled, not its ``__call__``: the layouts' hooks
(FSDP2's gathers, the streaming engine's fetches) run eagerly around the compiled code instead of becoming guards,
a deep copy (delinking) stays compiled, and every block of a class shares one compiled function. Graph breaks are
allowed: the MoE layer reads its segment sizes on the host (docs/offload.md).
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
    """The torch.compile backend the ``compile`` option asks for: None (off), torch.compile's default ("inductor")
    for True, or the named one."""
    if option is False:
        return None
    return "inductor" if option is True else option


def check_compile(option: bool | str, *, count_collectives: bool) -> None:
    """Refuse, before any process group exists, what cannot compile (torch would fail, or silently run eagerly, at the
    first forward): a backend torch.compile does not know, and ``count_collectives=True``, whose counter is a
    ``TorchDispatchMode`` around the step, under which dynamo does not compile (nor later, in this process)."""
    backend = backend_of(option)
    if backend is None:
        return
    known = torch.compiler.list_backends(exclude_tags=())
    if backend not in known:
        raise ValueError(f"P2RStrategy(compile={option!r}): torch.compile knows no backend {backend!r}; use True "
                         f"(inductor) or one of {sorted(known)}")
    if count_collectives:
        raise ValueError(
            f"P2RStrategy(compile={option!r}, count_collectives=True): the collective counter records every "
            "operator through a TorchDispatchMode, under which torch.compile does not compile (the blocks would "
            "run eagerly); count collectives on an eager run (compile=False)")


def compiled_class(cls: type[nn.Module], backend: str) -> type[nn.Module]:
    """``cls`` with its ``forward`` compiled by ``backend`` (one class, and one compiled function, per pair)."""
    key = (cls, backend)
    if key not in _compiled_classes:
        compiled = torch.compile(cls.forward, backend=backend)

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return compiled(self, *(_settled(a) for a in args), **{k: _settled(v) for k, v in kwargs.items()})

        _compiled_classes[key] = type(f"Compiled{cls.__name__}", (CompiledForward, cls),
                                      {"forward": forward, "compile_backend": backend,
                                       "__module__": cls.__module__})
    return _compiled_classes[key]


def _settled(value: Any) -> Any:
    """``value``, or a plain copy of it when it is the result of a collective still in flight: a tensor-parallel
    layer hands its all-reduced output on as an ``AsyncCollectiveTensor`` (a subclass that waits when first used),
    and a compiled block taking one as its input gives autograd a plain gradient where the DTensor backward before
    it needs a DTensor (measured: wrong gradients, or an AttributeError in backward, with rotary positions, where
    the first block reads the embedding's output directly). The copy waits and stays on the autograd graph."""
    return value.clone() if isinstance(value, AsyncCollectiveTensor) else value


def apply_compile(option: bool | str, blocks: nn.ModuleList, indices: Iterable[int] | None = None) -> None:
    """Compile the forward of ``blocks[i]`` for each i of ``indices`` (all blocks by default) as the ``compile``
    option says. A block compiled already (placed again after delinking) is left as it is."""
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
