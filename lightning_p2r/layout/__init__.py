"""The layout rulebook: what a training layout is, and which layouts can run, without torch.

A *layout* is the set of ``P2RStrategy`` options that decide where every tensor lives and when it moves: ZeRO
sharding, the tensor / expert / pipeline degrees, the micro-batch schedule, recompute, compile and offload. The
strategy's option sections, its engines and the planner all read the rules from here, so the planner cannot price a
layout the strategy would refuse, nor skip one it would run (``tests/unit/test_layout_rules.py`` checks this over
the planner's whole search space). Its modules import only the standard library and each other.

The rules come in groups, each checked as soon as its inputs are known:

- the options one by one (when ``P2RStrategy`` is built): :func:`check_options`;
- the options together, and against the number of processes (before any process group exists):
  :func:`check_combinations`, :func:`check_devices`;
- against the model's sizes (before any parameter is placed): :func:`check_model`;
- against the batch (the planner's workload; the strategy checks each batch when it splits it): :func:`check_batch`.

:func:`check_layout` runs all that apply. Messages name the ``P2RStrategy`` keyword and the fix.
"""

from .mesh import (
    FSDPMode,
    ParallelDims,
    PlacementPath,
    Resharding,
    fsdp_mode_for,
    placement_path,
    resharding,
    uses_fsdp,
)
from .names import (
    ACCUMULATIONS,
    BREADTH_FIRST,
    OFFLOAD_STATES,
    PIPELINE_SCHEDULES,
    SHARDINGS,
    SINGLE_STAGE_SCHEDULES,
    Accumulation,
    OffloadState,
    PipelineSchedule,
    Sharding,
    check_bool,
    check_compile_option,
    check_degree,
    divisors,
)
from .offload import (
    BlockFootprint,
    OffloadPlan,
    check_delayed_host_step,
    check_fsdp_offload_states,
    check_offload_options,
    device_bytes_needed,
    format_bytes,
    offload_count,
    parse_bytes,
    pin_memory_for,
    plan_for_budget,
    plan_offload,
    plan_summary,
    spread,
)
from .rules import (
    Layout,
    ModelShape,
    check_accumulation_options,
    check_batch,
    check_combinations,
    check_devices,
    check_layout,
    check_micro_batches,
    check_model,
    check_options,
    check_parallel_options,
    check_trainer,
    half_precision_warning,
    oversubscription_warning,
)
from .stages import StageCut, block_holders, bubble_fraction, check_local_sharing

__all__ = [
    "ACCUMULATIONS",
    "Accumulation",
    "BREADTH_FIRST",
    "BlockFootprint",
    "FSDPMode",
    "Layout",
    "OFFLOAD_STATES",
    "OffloadState",
    "ModelShape",
    "OffloadPlan",
    "PIPELINE_SCHEDULES",
    "ParallelDims",
    "PipelineSchedule",
    "PlacementPath",
    "Resharding",
    "SHARDINGS",
    "SINGLE_STAGE_SCHEDULES",
    "Sharding",
    "StageCut",
    "block_holders",
    "bubble_fraction",
    "check_accumulation_options",
    "check_batch",
    "check_bool",
    "check_compile_option",
    "check_combinations",
    "check_degree",
    "check_devices",
    "check_fsdp_offload_states",
    "check_layout",
    "check_local_sharing",
    "check_micro_batches",
    "check_model",
    "check_delayed_host_step",
    "check_offload_options",
    "check_options",
    "check_parallel_options",
    "check_trainer",
    "device_bytes_needed",
    "divisors",
    "format_bytes",
    "fsdp_mode_for",
    "offload_count",
    "half_precision_warning",
    "oversubscription_warning",
    "parse_bytes",
    "pin_memory_for",
    "placement_path",
    "plan_for_budget",
    "plan_offload",
    "plan_summary",
    "resharding",
    "spread",
    "uses_fsdp",
]
