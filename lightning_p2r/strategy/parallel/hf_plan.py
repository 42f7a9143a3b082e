"""A Hugging Face model's own tensor- and expert-parallel plans as a :class:`~lightning_p2r.protocols.ParallelPlan`
(issue 38, item 5). HF configs carry ``base_model_tp_plan`` (patterns such as ``"layers.*.self_attn.q_proj":
"colwise"``, relative to the base model), the causal-LM classes a ``_tp_plan`` for the head (``"lm_head":
"colwise_gather_output"``), and MoE configs a ``base_model_ep_plan`` (the expert module, "ep_dispatch_experts", and
its stacked weights, "grouped_gemm"). The strategy reads them rather than asking the user for a plan.

HF's attention reshapes its projections with ``view(..., -1, head_dim)``, so a rank's share of the q/k/v columns is
read as its share of the heads: the head counts follow the split, and per-head norms (Qwen3's q_norm and k_norm,
"replicated_with_grad_allreduce") run whole on them. Stacked experts (Mixtral, Qwen3-MoE: "moe_tp_experts" on the
expert module, gate and up packed in one tensor, "packed_colwise") are taken from the expert plan under tensor
parallelism too: packed weights cannot be cut by hidden unit into contiguous shards, so the tensor-parallel ranks
split them by expert (``experts.py``), and the module routing to them is the plan's "expert" layer. Any other style
is refused in one line naming the module.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from ...layout.names import HF_STYLES
from ...protocols import ParallelPlan, SplitKind, StackedExperts
from ..blocks import block_list_name, block_names, module_name


def hf_tp_plan(holder: nn.Module) -> dict[str, str] | None:
    """``holder``'s Hugging Face plan by module name relative to ``holder`` (the base model's patterns prefixed by its
    name, the class's head entries), or None when it declares none."""
    return _hf_patterns(holder, "base_model_tp_plan", "_tp_plan")


def hf_ep_plan(holder: nn.Module) -> dict[str, str] | None:
    """``holder``'s Hugging Face expert-parallel plan (``base_model_ep_plan``: the expert modules,
    "ep_dispatch_experts", and their stacked weights, "grouped_gemm") by name relative to ``holder``, or None."""
    return _hf_patterns(holder, "base_model_ep_plan", None)


def _hf_patterns(holder: nn.Module, base_attribute: str, class_attribute: str | None) -> dict[str, str] | None:
    patterns: dict[str, str] = {}
    for name, module in holder.named_modules():
        config = getattr(module, "config", None)
        base = getattr(config, base_attribute, None) if config is not None else None
        own = getattr(type(module), class_attribute, None) if class_attribute else None
        prefix = f"{name}." if name else ""
        if isinstance(base, dict) and base and getattr(module, "base_model_prefix", None) is not None:
            # A PreTrainedModel: its base model's patterns are relative to the base model (itself, or the child
            # called ``base_model_prefix``).
            base_name = module.base_model_prefix
            inner = prefix + (f"{base_name}." if hasattr(module, base_name) and getattr(module, base_name)
                              is not module else "")
            patterns.update({inner + pattern: style for pattern, style in base.items()
                             if inner + pattern not in patterns})
        if isinstance(own, dict):
            patterns.update({prefix + pattern: style for pattern, style in own.items()})
        if patterns:
            break  # the outermost PreTrainedModel's plan covers its submodels
    return patterns or None


def plan_from_hf(holder: nn.Module, tensor_parallel: int, expert_parallel: int = 1) -> ParallelPlan:
    """The :class:`ParallelPlan` of ``holder``'s HF plans; refuses styles, modules and sizes it cannot split."""
    splits_experts = expert_parallel > 1 or (tensor_parallel > 1 and hf_ep_plan(holder) is not None)
    experts = _experts_from_hf(holder) if splits_experts else {}
    if tensor_parallel == 1:  # expert parallelism alone: the experts, nothing else split
        return ParallelPlan(tuple({} for _ in holder.blocks), {}, experts=experts)
    patterns = hf_tp_plan(holder)
    if patterns is None:
        raise ValueError(f"P2RStrategy(tensor_parallel={tensor_parallel}) splits a model by its plan: "
                         f"{type(holder).__name__} has neither parallel_plan() nor a Hugging Face base_model_tp_plan "
                         "(GPT-2 has none: CausalLMModule declares the package's, as lightning_p2r.models.gpt2_plan."
                         "declare_gpt2_plan(model) does); declare a lightning_p2r.protocols.ParallelPlan, or use "
                         "sharding/offload/pipeline_parallel instead")
    blocks_name = block_list_name(holder)
    names = block_names(holder)  # a pseudo model's unique block i may sit at another layer than i
    per_block: list[dict[str, SplitKind]] = [{} for _ in holder.blocks]
    outside: dict[str, SplitKind] = {}
    # The expert modules and their weights split as the expert plan says (above), not by their tensor-parallel styles.
    expert_patterns = [f"{blocks_name}.*.{name}" if blocks_name else f"*.{name}" for name in experts]
    for pattern, style in patterns.items():
        if any(pattern == inner or pattern.startswith(inner + ".") for inner in expert_patterns):
            continue
        parts = pattern.split(".")
        if blocks_name and pattern.startswith(blocks_name + ".*."):
            inner = pattern[len(blocks_name) + 3:]
            targets = [(index, f"{names[index]}.{inner}") for index in range(len(holder.blocks))]
        elif "*" in parts:
            raise ValueError(f"the Hugging Face plan of {type(holder).__name__} names {pattern!r} outside its "
                             f"block list {blocks_name!r}; tensor parallelism cannot place it")
        else:
            targets = [(None, pattern)]
        for index, name in targets:
            try:
                module = holder.get_submodule(name)
            except AttributeError:
                continue  # a pattern for a variant this model does not have (a dense FFN in an all-MoE model)
            if next(module.parameters(), None) is None:
                continue  # a pipeline stage's stand-in for another rank's block
            kind = _kind(name, style, module, holder)
            if kind == "output" and index is not None:  # inside a block: gathered for the block's next layers
                kind = "gathered_column"
            if index is None:
                outside[name] = kind
            else:
                per_block[index][name[len(names[index]) + 1:]] = kind
    _mark_expert_layers(holder, per_block, experts)
    # A head tied to the input embedding (GPT-2, Llama 3.2, ...) splits it too, by vocabulary: one sharded weight.
    for name in [name for name, kind in outside.items() if kind == "output"]:
        weight = getattr(holder.get_submodule(name), "weight", None)
        for other, module in holder.named_modules():
            if isinstance(module, nn.Embedding) and module.weight is weight and other not in outside:
                outside[other] = "vocabulary"
    # ... also on a pipeline rank holding the embedding without the head (another stage's): the model's config says
    # the two are tied, and both ends must split alike for the stages to sum the tied gradient.
    config: Any = getattr(holder, "config", None)
    get_embedding = getattr(holder, "get_input_embeddings", None)
    splits_head = any(HF_STYLES.get(style) == "output" for style in patterns.values())
    if getattr(config, "tie_word_embeddings", False) and callable(get_embedding) and splits_head:
        embedding = get_embedding()
        if isinstance(embedding, nn.Embedding) and next(embedding.parameters(), None) is not None:
            name = module_name(holder, embedding)
            outside.setdefault(name, "vocabulary")
    _check_sizes(holder, tensor_parallel)
    return with_sequence_parallel_entries(holder, ParallelPlan(tuple(per_block), outside, experts=experts))


def _mark_expert_layers(holder: nn.Module, per_block: list[dict[str, SplitKind]],
                        experts: dict[str, StackedExperts]) -> None:
    """The module holding each expert module (HF's sparse MoE block: the router and the experts) is the plan's
    "expert" layer: whole on every tensor-parallel rank, and given the whole sequence under sequence parallelism."""
    for entries, block in zip(per_block, holder.blocks):
        names = {name for name, _ in block.named_modules()}
        for name in experts:
            layer = name.rpartition(".")[0]
            if name in names and layer:
                entries[layer] = "expert"


def _is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Norm") and next(module.parameters(), None) is not None


def with_sequence_parallel_entries(holder: nn.Module, plan: ParallelPlan) -> ParallelPlan:
    """``plan`` with what sequence parallelism needs beyond it (a Hugging Face plan, and a plan declaring
    ``gathers_for_sequence_parallel``, have nothing for it): a block's own norms and the final norm run on the rank's
    positions ("sequence"), and the modules holding the column layers (the attention, the MLP) gather the sequence at
    their entry ("gather"), since their attention reshapes by the length it is given. Both kinds do nothing without
    sequence parallelism."""
    per_block = [dict(entries) for entries in plan.blocks]
    outside = dict(plan.outside)
    for entries, block in zip(per_block, holder.blocks):
        experts = [name for name, kind in entries.items() if kind == "expert"]  # whole sequence already
        columns = [name for name, kind in entries.items() if kind in ("column", "packed_column", "gathered_column")
                   and not any(name.startswith(outer + ".") for outer in experts)]
        if not columns:
            continue
        for name in sorted({name.rpartition(".")[0] for name in columns} - {""}):
            entries[name] = "gather"
        for name, child in block.named_children():
            if _is_norm(child):
                entries[name] = "sequence"
    if any("gather" in entries.values() for entries in per_block):
        inside = {id(m) for block in holder.blocks for m in block.modules()}
        for name, module in holder.named_modules():
            if id(module) not in inside and _is_norm(module) and name not in outside:
                outside[name] = "sequence"
    return dataclasses.replace(plan, blocks=tuple(per_block), outside=outside)


HIDDEN_DIM_OF_STYLE = {"colwise": 1, "rowwise": 2}
"""Where an HF stacked expert weight (experts x out x in, applied as ``F.linear``) keeps its hidden units, by its
tensor-parallel style: the output rows of the first matmul ("colwise"), the input columns of the second
("rowwise"). Gate and up packed in one tensor ("packed_colwise") cannot be split contiguously: None (tensor
parallelism then splits the module's experts by expert)."""


def _experts_from_hf(holder: nn.Module) -> dict[str, StackedExperts]:
    """The expert modules of ``holder``'s HF expert-parallel plan, by name inside a block; refused in one line when
    the model has none or names them outside its blocks."""
    patterns = hf_ep_plan(holder)
    if patterns is None:
        raise ValueError(f"expert parallelism splits declared expert modules: {type(holder).__name__} has neither "
                         "parallel_plan() nor a Hugging Face base_model_ep_plan; declare a lightning_p2r.protocols."
                         "ParallelPlan with StackedExperts, or use expert_parallel=1")
    blocks_name = block_list_name(holder)
    block_prefix = f"{blocks_name}.*." if blocks_name else "*."
    tp_styles = hf_tp_plan(holder) or {}
    found: dict[str, StackedExperts] = {}
    for pattern, style in patterns.items():
        if style != "ep_dispatch_experts":
            continue
        if not pattern.startswith(block_prefix):
            raise ValueError(f"the Hugging Face expert plan of {type(holder).__name__} names {pattern!r} outside its "
                             f"block list {blocks_name!r}; expert parallelism cannot place it")
        weights = {key[len(pattern) + 1:]: HIDDEN_DIM_OF_STYLE.get(tp_styles.get(key, ""))
                   for key, kind in patterns.items() if kind == "grouped_gemm" and key.startswith(pattern + ".")}
        found[pattern[len(block_prefix):]] = StackedExperts(weights, call="top_k")
    if not found:
        raise ValueError(f"the Hugging Face expert plan of {type(holder).__name__} names no expert module "
                         "('ep_dispatch_experts'); use expert_parallel=1")
    return found


def _kind(name: str, style: str, module: nn.Module, holder: nn.Module) -> SplitKind:
    kind = HF_STYLES.get(style)
    if kind is None:
        raise ValueError(f"tensor parallelism cannot split {type(holder).__name__}'s {name} ({type(module).__name__},"
                         f" Hugging Face style {style!r}): the package splits {sorted(HF_STYLES)}; use "
                         "expert_parallel=1 and tensor_parallel=1 for this model (sharding, offload, layered "
                         "accumulation and pipelines work), or declare a ParallelPlan")
    check_splittable(f"{type(holder).__name__}'s {name}", module, kind)
    return kind


def check_splittable(what: str, module: nn.Module, kind: SplitKind, transposed: bool = False) -> None:
    """Refuse, in one line, a plan entry torch's styles cannot split: a linear kind on a module that is not an
    ``nn.Linear`` (GPT-2's ``Conv1D`` stores its weight transposed: a plan declares it in ``ParallelPlan.transposed``),
    a vocabulary kind on one that is not an ``nn.Embedding``."""
    if transposed and kind in ("column", "row", "packed_column"):
        weight = getattr(module, "weight", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
            raise ValueError(f"tensor parallelism cannot split {what} as a transposed {kind!r} layer: it has no 2-D "
                             "weight")
        return
    if kind in ("column", "row", "output", "packed_column", "gathered_column", "row_of_whole") and not isinstance(
            module, nn.Linear):
        raise ValueError(f"tensor parallelism cannot split {what} as {kind!r}: it is a {type(module).__name__}, not "
                         "an nn.Linear (a Conv1D stores its weight as in x out); leave it out of the plan")
    if kind == "vocabulary" and not isinstance(module, nn.Embedding):
        raise ValueError(f"tensor parallelism cannot split {what} by vocabulary: it is a {type(module).__name__}, "
                         "not an nn.Embedding")


def _check_sizes(holder: nn.Module, tensor_parallel: int) -> None:
    """Heads (query and key/value) and hidden widths must divide by the degree, so each rank holds whole heads."""
    config: Any = getattr(holder, "config", None)
    sizes = {name: getattr(config, name, None) for name in ("num_attention_heads", "num_key_value_heads",
                                                            "intermediate_size", "vocab_size")}
    bad = {name: value for name, value in sizes.items() if isinstance(value, int) and value % tensor_parallel}
    if bad:
        raise ValueError(f"tensor_parallel={tensor_parallel} must divide {type(holder).__name__}'s "
                         + ", ".join(f"{name}={value}" for name, value in bad.items()))
