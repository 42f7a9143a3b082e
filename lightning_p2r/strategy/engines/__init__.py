"""One engine per parallel layout, behind one interface (:class:`~.base.Engine`).

``P2RStrategy`` picks one at setup from the options and the number of processes (``select_engine``), logs the
choice and delegates every layout-dependent step to it: placing the model, syncing gradients, saving and loading,
delinking.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..sharding import execution_path
from .base import Engine
from .ddp import DDPEngine
from .fsdp import FSDPEngine
from .local import LocalEngine
from .model_parallel import ModelParallelEngine
from .pipeline import PipelineEngine

if TYPE_CHECKING:
    from ..strategy import P2RStrategy

ENGINES: dict[str, type[Engine]] = {"local": LocalEngine, "ddp": DDPEngine, "fsdp": FSDPEngine,
                                 "model_parallel": ModelParallelEngine, "pipeline": PipelineEngine}


def engine_name(strategy: P2RStrategy) -> str:
    """Which engine runs a job (see ``execution_path``)."""
    return execution_path(strategy.sharding, strategy.world_size, offloading=strategy.offloading,
                          layered=strategy.accumulation == "layered",
                          model_parallel=strategy.parallel_config.model_parallel,
                          pipelined=strategy.parallel_config.pipelined)


def select_engine(strategy: P2RStrategy) -> Engine:
    return ENGINES[engine_name(strategy)](strategy)


__all__ = ["ENGINES", "DDPEngine", "Engine", "FSDPEngine", "LocalEngine", "ModelParallelEngine", "PipelineEngine",
           "engine_name", "select_engine"]
