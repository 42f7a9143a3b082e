"""``P2RStrategy`` and the pure pieces it is made of."""

from ..layout import BlockFootprint, OffloadPlan, plan_offload
from .offload import OffloadEngine, OffloadStats
from .split_optimizer import SplitOptimizer
from .strategy import P2RStrategy

__all__ = ["BlockFootprint", "OffloadEngine", "OffloadPlan", "OffloadStats", "P2RStrategy", "SplitOptimizer",
           "plan_offload"]
