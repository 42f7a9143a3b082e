"""The workload a layout runs, and the planner's check of a layout: the strategy's own rulebook
(``lightning_p2r.layout``: ``Layout`` and its rules live there, so the planner never prices a layout the strategy
refuses), plus what only a planned workload has (its global batch over the data ranks)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from .. import layout as rules
from ..layout import BREADTH_FIRST, SHARDINGS, Layout, ModelShape
from ..layout import PIPELINE_SCHEDULES as SCHEDULES
from .cluster import Cluster
from .hf_decoder import HFDecoder
from .model import PricedModel, as_run

Precision = Literal["32-true", "bf16-mixed", "bf16-true"]
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
__all__ = ["BREADTH_FIRST", "PRECISIONS", "SCHEDULES", "SHARDINGS", "Layout", "Precision", "Workload", "check_layout"]


@dataclass(frozen=True)
class Workload:
    """What one optimizer step trains."""

    global_batch: int
    """Sequences per optimizer step, over all data-parallel ranks."""
    seq_len: int
    """Tokens per sequence."""
    precision: Precision = "32-true"
    """"32-true": fp32 everywhere. "bf16-mixed": matmuls and their outputs bf16 under autocast; parameters,
    gradients, the residual stream and a norm's output stay fp32, and so do the collectives that move them (a row
    layer's output sums, and M6's experts' output rows, move bf16), as the package runs it. "bf16-true": Lightning
    casts the module to bf16, so parameters, gradients, AdamW's moments and every activation are bf16 and everything
    moves 2 bytes an element."""
    optimizer_bytes_per_param: int | None = None
    """Optimizer state per parameter. None: AdamW's two moments at the parameters' width (8 bytes, 4 under
    "bf16-true")."""
    param_bytes: int | None = None
    """Bytes of a stored parameter, of its gradient, and of what FSDP2 / DDP move per element. None: the
    precision's (4: the package keeps fp32 parameters under "bf16-mixed"; 2 under "bf16-true"). A projection of
    another framework's bf16 parameters under mixed precision sets 2."""

    def __post_init__(self) -> None:
        for name in ("global_batch", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Workload.{name} must be a positive integer, got {value!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"Workload.precision must be one of {', '.join(map(repr, PRECISIONS))}, got "
                             f"{self.precision!r}")
        if self.param_bytes is None:  # a frozen dataclass: the derived defaults are written once, here
            object.__setattr__(self, "param_bytes", 2 if self.precision == "bf16-true" else 4)
        if self.param_bytes not in (2, 4):
            raise ValueError(f"Workload.param_bytes must be 2 or 4, got {self.param_bytes}")
        if self.precision == "bf16-true" and self.param_bytes != 2:
            raise ValueError(f"Workload.param_bytes={self.param_bytes} under 'bf16-true', whose parameters are bf16 "
                             "(2 bytes)")
        if self.optimizer_bytes_per_param is None:
            object.__setattr__(self, "optimizer_bytes_per_param", 2 * self.param_bytes)
        if self.optimizer_bytes_per_param < 0:
            raise ValueError(f"Workload.optimizer_bytes_per_param must be >= 0, got {self.optimizer_bytes_per_param}")

    @property
    def activation_bytes(self) -> int:
        return 4 if self.precision == "32-true" else 2

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq_len


def model_shape(config: PricedModel) -> ModelShape:
    """The sizes the strategy's rules read. A Hugging Face model's key/value heads are split by tensor parallelism
    too (``strategy/parallel/hf_plan.py`` checks them); its sequences are not bound to ``max_position_embeddings``
    and every family runs sequence parallelism (the workload's length is checked below)."""
    shape = ModelShape.of(as_run(config))
    if isinstance(config, HFDecoder):
        return dataclasses.replace(shape, num_kv_heads=config.num_kv_heads, max_seq_len=None, rotary_positions=None)
    return shape


def check_layout(layout: Layout, config: PricedModel, cluster: Cluster, workload: Workload) -> None:
    """Raise ValueError naming the first reason ``layout`` cannot run ``config`` on ``cluster``: the strategy's own
    rules (``lightning_p2r.layout.check_layout``), then the workload's global batch over the data ranks."""
    rules.check_layout(layout, cluster.devices, model_shape(config))
    dp = layout.data_parallel(cluster.devices)
    if workload.global_batch % dp:
        raise ValueError(f"the global batch ({workload.global_batch}) must split evenly over the {dp} data-parallel "
                         "ranks")
    rules.check_batch(layout, workload.global_batch // dp)
    if layout.sequence_parallel and workload.seq_len % layout.tensor_parallel:
        raise ValueError(f"sequence_parallel: tensor_parallel ({layout.tensor_parallel}) must divide seq_len "
                         f"({workload.seq_len})")
