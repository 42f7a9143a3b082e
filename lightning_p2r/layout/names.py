"""The option names (from their ``Literal`` types), and the small checks every rule uses."""

from __future__ import annotations

from typing import Literal, get_args

Sharding = Literal["none", "zero1", "zero2", "zero3"]
Accumulation = Literal["standard", "layered"]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs"]
PlacementPath = Literal["local", "ddp", "fsdp", "model_parallel", "pipeline"]
FSDPMode = Literal["replicate", "zero2", "zero3"]
OffloadState = Literal["params", "grads", "optimizer"]

SHARDINGS: tuple[str, ...] = get_args(Sharding)
ACCUMULATIONS: tuple[str, ...] = get_args(Accumulation)
PIPELINE_SCHEDULES: tuple[str, ...] = get_args(PipelineSchedule)
OFFLOAD_STATES: tuple[str, ...] = get_args(OffloadState)
BREADTH_FIRST: tuple[str, ...] = ("gpipe", "looped_bfs")
"""Schedules that run every micro-batch through a stage before the next stage (layered accumulation's order)."""
SINGLE_STAGE_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")

HF_STYLES: dict[str, str] = {"colwise": "column", "rowwise": "row", "colwise_gather_output": "output",
                             "colwise_rep": "column", "rowwise_rep": "row",
                             "replicated_with_grad_allreduce": "heads", "embedding_rowwise": "vocabulary",
                             "rowwise_split_input": "row_of_whole"}
"""Hugging Face's tensor-parallel style names -> the package's split kinds (``protocols.SplitKind``), read by the
strategy (``strategy.parallel.hf_plan``) and by the planner (``planning.hf_tensor_parallel``). (The "_rep" variants
differ only in output layouts HF's own tensor parallel needs, which the package's styles already give; HF uses
"replicated_with_grad_allreduce" for the per-head norms of Qwen3's attention, which the "heads" kind runs on the
rank's heads, "embedding_rowwise" for an input embedding split by vocabulary rows, GPT-NeoX's, and
"colwise_gather_output" inside a block with "rowwise_split_input" after it for OLMo 2's attention, whose q/k norms
span all heads: "gathered_column" and "row_of_whole")."""

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"P2RStrategy.{name} must be True or False, got {value!r}")


def check_degree(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"P2RStrategy.{name} must be a positive integer (1 turns it off), got {value!r}")


def check_compile_option(value: object) -> None:
    """``compile``: True (torch's default backend, inductor), False, or a backend's name."""
    if not isinstance(value, (bool, str)) or value == "":
        raise ValueError(f"P2RStrategy.compile must be True, False or a torch.compile backend name, got {value!r}")
