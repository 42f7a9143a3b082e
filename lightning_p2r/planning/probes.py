"""The tiny M6 models ``calibrate`` times a layer's fixed and per-token costs on: the planner counts their operators
too, to price a Hugging Face layer against them (``hf_decoder``), so they live beside the cost model."""

from __future__ import annotations

from ..models.config import M6Config

LAYER_PROBE = {"vocab_size": 64, "max_seq_len": 32, "dim": 16, "num_heads": 2, "moe_top_k": 1,
               "capacity_factor": None, "init_seed": 0}
"""The model whose layers ``layer_overheads`` times: small enough that FLOPs and traffic are negligible."""


def probe_config(layers: int, experts: int, width: int = LAYER_PROBE["dim"]) -> M6Config:
    """``LAYER_PROBE`` with ``layers`` layers, all MoE with ``experts`` experts (0: dense), at ``width`` (heads
    of 8)."""
    moe = {"num_experts": experts, "moe_layers": None} if experts else {"moe_layers": []}
    return M6Config(**LAYER_PROBE | {"dim": width, "num_heads": width // 8}, num_layers=layers, **moe)
