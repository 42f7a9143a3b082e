"""Hugging Face's GPT-2 declared for tensor parallelism: its config carries no plan (``base_model_tp_plan``), since its
``Conv1D`` layers store their weights in x out, which torch's styles do not split. The package's plan says so
(``ParallelPlan.transposed``), and the strategy splits those layers along their other dimension.

GPT-2's attention packs the queries, keys and values in one ``c_attn`` (a "packed_column" layer, as litgpt's
``qkv``) and splits its output by ``split_size``, an attribute: once the plan is applied, each attention gets the
rank's. It reshapes by ``-1`` heads, so the head count follows the split. The MLP's ``c_fc`` splits by column, the two
``c_proj`` by row, the embedding by vocabulary and the tied head by its outputs. Under sequence parallelism the
attention and the MLP gather the sequence at their entry and their row layers reduce-scatter it, the blocks' norms run
on the rank's positions, and the final norm gathers it whole, because ``GPT2Model.forward`` reshapes that norm's
output by the whole sequence length.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..protocols import DeclaredPlan, ParallelPlan, SplitKind

BLOCK_PLAN: dict[str, SplitKind] = {"attn.c_attn": "packed_column", "attn.c_proj": "row", "mlp.c_fc": "column",
                                    "mlp.c_proj": "row"}
"""How each GPT-2 block's ``Conv1D`` layers split."""


def declare_gpt2_plan(model: nn.Module) -> None:
    """Give a Hugging Face GPT-2 the ``parallel_plan()`` it lacks (``protocols.DeclaresParallelPlan``), as an instance
    attribute: ``CausalLMModule`` does it for the model it builds or is given."""
    DeclaredPlan.attach(model, gpt2_parallel_plan)  # a deep copy of the model (growth builds one) gets its own


def gpt2_parallel_plan(model: nn.Module) -> ParallelPlan:
    """The tensor-parallel plan of a Hugging Face ``GPT2LMHeadModel``."""
    config: Any = model.config
    if getattr(config, "add_cross_attention", False):
        raise ValueError("the parallel plan of GPT-2 does not split its cross-attention (add_cross_attention=True); "
                         "use tensor_parallel=1 for this model")
    width = config.n_embd
    inner = config.n_inner or 4 * width
    # The declared block list (the strategy's alias: a pseudo model's unique blocks), else the model's layers.
    blocks = getattr(model, "blocks", None) or model.transformer.h

    def rank_split_size(degree: int) -> None:
        # GPT-2's attention splits c_attn's output into q, k and v by this width: the rank's share of each.
        for block in blocks:
            if next(block.parameters(), None) is not None:  # a pipeline stage's stand-in has no attention to set
                block.attn.split_size = width // degree
                block.attn.num_heads = config.n_head // degree

    # Sequence parallelism as for litgpt (the strategy adds "gather" at the attention and the MLP, "sequence" at the
    # blocks' norms), but the final norm gathers: the model views its output by the whole length.
    return ParallelPlan(tuple(dict(BLOCK_PLAN) for _ in blocks),
                        {"transformer.wte": "vocabulary", "transformer.ln_f": "gather", "lm_head": "output"},
                        gathers_for_sequence_parallel=True,
                        packed={"attn.c_attn": (width, width, width)}, transposed=frozenset(BLOCK_PLAN),
                        divisible={"n_head": config.n_head, "n_inner": inner, "vocab_size": config.vocab_size},
                        on_tensor_parallel=rank_split_size)
