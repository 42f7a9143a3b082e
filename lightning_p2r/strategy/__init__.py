"""``P2RStrategy`` and the pure pieces it is made of."""

from .offload import OffloadEngine, OffloadStats
from .plan import BlockFootprint, OffloadPlan, plan_offload
from .split_optimizer import SplitOptimizer
from .strategy import P2RStrategy

__all__ = ["BlockFootprint", "OffloadEngine", "OffloadPlan", "OffloadStats", "P2RStrategy", "SplitOptimizer",
           "plan_offload"]
