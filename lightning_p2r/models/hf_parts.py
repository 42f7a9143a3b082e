"""Where a Hugging Face decoder keeps its parts, found from the conventions every ``PreTrainedModel`` follows, for a
family without a ready declaration (Gemma, Phi, OLMo, GPT-NeoX, Granite, DeepSeek-V3, ...).

- the blocks: the one ``nn.ModuleList`` whose entries are all of the classes ``_no_split_modules`` names (the
  classes Hugging Face itself never splits across devices);
- the base: the module holding that list (its forward embeds the tokens and runs the blocks);
- the embedding stage's modules: ``get_input_embeddings()`` and the base's other modules with parameters registered
  before the blocks (learned positions, Bloom's embedding norm);
- the final norm: the base's one norm registered after the blocks (or its only norm); the head:
  ``get_output_embeddings()``;
- the residual branches' last projections: the entries the model's own tensor-parallel plan splits by row.

Layered accumulation and pipelines run a decoder as stages: the embedding (the base's own forward, stopped at the
first block), each block, then the logits. Where the parts were found here, the logits come from the causal LM's own
forward with its base standing in (``DecoderParts.logits_from="forward"``), so whatever it does after its head
(Gemma 2's soft-capping, Cohere's and Granite's logit scales) runs as in any other layout. A module the base runs
besides its embeddings, blocks and norms (OPT's ``project_in`` and ``project_out``) has no known stage: such a model
is ``unstageable``, and those two layouts refuse it in one line; every other layout runs the model's own forward and
needs none of this.

Nothing here imports torch's distributed parts or the package's decoders module (which builds the declaration).
"""

from __future__ import annotations

from typing import Any

from torch import nn

ROW_STYLES = ("rowwise", "rowwise_rep", "rowwise_split_input", "local_rowwise", "grouped_gemm")
"""Styles of a Hugging Face tensor-parallel plan whose module's output is a residual branch's (split by row)."""


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def _is_embedding(module: nn.Module) -> bool:
    return isinstance(module, nn.Embedding) or "embedding" in type(module).__name__.lower()


def of_classes(module: nn.Module, names: set[str]) -> bool:
    """Whether ``module``'s class, or a class it derives from, is named in ``names``: the MRO, since FSDP2 swaps a
    sharded module's class for a subclass (FSDPGemmaDecoderLayer)."""
    return bool(names.intersection(cls.__name__ for cls in type(module).__mro__))


def block_list_name(model: nn.Module) -> str | None:
    """The dotted name of the one module list whose entries are all of the model's ``_no_split_modules`` classes
    (parameterless entries aside: another pipeline rank's blocks standing in)."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    if not classes:
        return None
    found = [name for name, module in model.named_modules()
             if isinstance(module, nn.ModuleList) and any(of_classes(entry, classes) for entry in module)
             and all(of_classes(entry, classes) or not _holds_parameters(entry) for entry in module)]
    return found[0] if len(found) == 1 else None


def _name_of(model: nn.Module, module: nn.Module | None) -> str | None:
    if module is None:
        return None
    return next((name for name, candidate in model.named_modules() if candidate is module), None)


def residual_outputs_of(model: nn.Module) -> tuple[str, ...]:
    """Endings of the parameter names of the residual branches' last projections: the model's own tensor-parallel
    plan splits exactly those by row (``"layers.*.self_attn.o_proj": "rowwise"``)."""
    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    endings: list[str] = []
    for key, style in plan.items():
        if style not in ROW_STYLES:
            continue
        last = key.rsplit(".", 1)[-1]
        endings += [f"{last}.weight", f"{last}.bias"] if last != "*" else []
        if ".experts." in f".{key}." or key.endswith("experts"):
            endings.append(f"experts.{last}" if last != "experts" else "experts")
    return tuple(dict.fromkeys(endings))


def find_parts(model: nn.Module) -> dict[str, Any] | None:
    """The keyword arguments of a ``DecoderParts`` for a Hugging Face decoder, or None where its conventions do not
    show them (no ``_no_split_modules``, several or no block lists, no final norm, no output embeddings)."""
    blocks = block_list_name(model)
    head = _name_of(model, getattr(model, "get_output_embeddings", lambda: None)())
    embedding = _name_of(model, getattr(model, "get_input_embeddings", lambda: None)())
    if blocks is None or not head or not embedding:
        return None
    base, _, list_attribute = blocks.rpartition(".")
    prefix = f"{base}." if base else ""
    children = [(f"{prefix}{name}", child) for name, child in model.get_submodule(base).named_children()
                if name != list_attribute]
    # Registration order mostly follows the forward (OPT registers its layers last): it only breaks ties.
    position = [name for name, _ in model.get_submodule(base).named_children()].index(list_attribute)
    norms = [name for name, child in children if _is_norm(child)]
    after = [name for index, (name, child) in enumerate(children) if index >= position and _is_norm(child)]
    final = after if len(after) == 1 else norms
    if len(final) != 1:
        return None
    norm = final[0]
    holding = [(index, name, child) for index, (name, child) in enumerate(children)
               if name != norm and _holds_parameters(child)]
    # The embedding stage's modules: the token embedding first, then the other embeddings (learned positions) and
    # norms registered before the blocks (Bloom's embedding norm).
    embed = [embedding] + [name for index, name, child in holding if name != embedding
                           and (_is_embedding(child) or (_is_norm(child) and index < position))]
    others = [name for _, name, _ in holding if name not in embed]
    unstageable = (f"its base also runs {others}, at places in its forward the stages cannot tell (before the first "
                   f"block or after the final norm {norm!r})" if others else "")
    return {"blocks": blocks, "embed": tuple(embed), "norm": norm, "head": head, "base": base,
            "logits_from": "forward" if base else "head", "residual_outputs": residual_outputs_of(model),
            "unstageable": unstageable}
