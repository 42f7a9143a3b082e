"""Two engines behind one interface (:class:`~.base.Engine`): ``local`` (one process, nothing sharded: the block
streamer) and ``fsdp2`` (every layout across processes, DDP's reducer on the "ddp" path, and ZeRO-2/3 on one), by
the rulebook's placement path."""

from __future__ import annotations

from .base import Engine, EngineContext, Placed
from .fsdp2 import FSDP2Engine
from .local import LocalEngine


def engine_for(path: str) -> Engine:
    """The engine of a placement path ("local", "ddp", "fsdp", "model_parallel" or "pipeline")."""
    if path == "local":
        return LocalEngine()
    return FSDP2Engine(path)


__all__ = ["Engine", "EngineContext", "FSDP2Engine", "LocalEngine", "Placed", "engine_for"]
