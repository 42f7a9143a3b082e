"""Three engines behind one interface (:class:`~.base.Engine`), one per placement path of the rulebook: ``local``
(one process, the streaming offload engine), ``ddp`` (DDP, + ZeroRedundancyOptimizer for zero1) and ``fsdp2``."""

from __future__ import annotations

from .base import Engine, EngineContext, Placed
from .ddp import DDPEngine
from .fsdp2 import FSDP2Engine
from .local import LocalEngine


def engine_for(path: str) -> Engine:
    """The engine of a placement path ("local", "ddp", "fsdp", "model_parallel" or "pipeline")."""
    if path == "local":
        return LocalEngine()
    if path == "ddp":
        return DDPEngine()
    return FSDP2Engine(path)


__all__ = ["DDPEngine", "Engine", "EngineContext", "FSDP2Engine", "LocalEngine", "Placed", "engine_for"]
