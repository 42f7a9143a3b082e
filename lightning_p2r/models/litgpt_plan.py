"""litgpt's ``GPT`` declared for tensor parallelism (Megatron-LM), the way Hugging Face models declare theirs in
their configs: the strategy reads the plan and applies it from outside (``strategy/parallel/``).

litgpt packs the queries, keys and values of an attention in one ``qkv`` linear, one part after another, and its
attention reads the head counts from its config rather than from the tensors' shapes. The plan says both: ``qkv`` is
a "packed_column" layer with the three parts' sizes (each rank computes its heads' share of every part), and once the
plan is applied each attention gets a config with the rank's head counts. The MLP's first linears split by column, its
``proj`` and the attention's ``proj`` by row, the embedding by vocabulary and the head by its outputs. An MoE MLP
(``LLaMAMoE``) is an "expert" layer: its router whole, each expert (and shared expert) split like a dense MLP. Under
sequence parallelism the attention and the MLP gather the sequence at their entry (litgpt's attention reshapes by the
length it is given) and the norms run on the rank's positions, as the strategy does for Hugging Face decoders.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from ..protocols import DeclaredPlan, ParallelPlan, SplitKind

MLP_PLANS: dict[str, dict[str, SplitKind]] = {
    "GptNeoxMLP": {"mlp.fc": "column", "mlp.proj": "row"},
    "LLaMAMLP": {"mlp.fc_1": "column", "mlp.fc_2": "column", "mlp.proj": "row"},
    "GemmaMLP": {"mlp.fc_1": "column", "mlp.fc_2": "column", "mlp.proj": "row"},
}
"""litgpt's MLP classes (``config.mlp_class_name``) by how their linears split."""


def declare_litgpt_plan(model: nn.Module) -> None:
    """Give a litgpt ``GPT`` the ``parallel_plan()`` it lacks (``protocols.DeclaresParallelPlan``), as an instance
    attribute: ``CausalLMModule`` does it for the model it builds or is given."""
    DeclaredPlan.attach(model, litgpt_parallel_plan)  # a deep copy of the model (growth builds one) gets its own


def _mlp_entries(block: nn.Module, config: Any) -> dict[str, SplitKind]:
    """How a block's MLP splits: a dense MLP by column and row; litgpt's MoE (``LLaMAMoE``: a router and a list of
    ``LLaMAMLP`` experts, maybe shared ones) as an "expert" layer whose experts each split by hidden unit, the
    router whole (every rank routes the same tokens the same way)."""
    mlp = getattr(block, "mlp", None)
    name = type(mlp).__name__ if mlp is not None else config.mlp_class_name  # (a pipeline stage's stand-in block)
    if name in MLP_PLANS:
        return dict(MLP_PLANS[name])
    if name != "LLaMAMoE":
        raise ValueError(f"the parallel plan of litgpt's GPT cannot split its {name} (its MLP class): the package "
                         f"splits {sorted(MLP_PLANS)} and LLaMAMoE; use tensor_parallel=1 for this model (sharding, "
                         "offload, layered accumulation and pipelines work)")
    experts = [f"mlp.experts.{i}" for i in range(len(mlp.experts) if mlp is not None else config.n_expert)]
    if mlp is not None and getattr(mlp, "shared_experts", None) is not None:
        experts.append("mlp.shared_experts")
    entries: dict[str, SplitKind] = {"mlp": "expert"}
    for expert in experts:
        entries |= {f"{expert}.fc_1": "column", f"{expert}.fc_2": "column", f"{expert}.proj": "row"}
    return entries


def litgpt_parallel_plan(model: nn.Module) -> ParallelPlan:
    """The tensor-parallel plan of a litgpt ``GPT``; refuses, in one line naming the field, parts it cannot split
    yet."""
    config: Any = model.config
    if config.norm_qk:
        raise ValueError("the parallel plan of litgpt's GPT cannot split an attention with norm_qk=True yet (its query "
                         "and key norms); use tensor_parallel=1 for this model")
    sizes = {"n_head": config.n_head, "n_query_groups": config.n_query_groups,
             "intermediate_size": config.intermediate_size, "padded_vocab_size": config.padded_vocab_size}
    if config.mlp_class_name == "LLaMAMoE":
        sizes["moe_intermediate_size"] = config.moe_intermediate_size
    # The declared block list (the strategy's alias: a pseudo model's unique blocks), else the model's layers.
    blocks = getattr(model, "blocks", None) or model.transformer.h
    attention: dict[str, SplitKind] = {"attn.qkv": "packed_column", "attn.proj": "row"}
    query, key_value = config.n_head * config.head_size, config.n_query_groups * config.head_size

    def rank_head_counts(degree: int) -> None:
        # litgpt's attention views its q, k and v by these counts: each rank holds 1/degree of the heads.
        local = dataclasses.replace(config, n_head=config.n_head // degree,
                                    n_query_groups=config.n_query_groups // degree)
        for block in blocks:
            if next(block.parameters(), None) is not None:  # a pipeline stage's stand-in has no attention to set
                block.attn.config = local

    # Sequence parallelism as for Hugging Face decoders (litgpt's attention reshapes by the length it is given): the
    # strategy adds the "gather" and "sequence" entries.
    return ParallelPlan(tuple(attention | _mlp_entries(block, config) for block in blocks),
                        {"transformer.wte": "vocabulary", "lm_head": "output"},
                        packed={"attn.qkv": (query, key_value, key_value)}, gathers_for_sequence_parallel=True,
                        divisible=sizes, on_tensor_parallel=rank_head_counts)
