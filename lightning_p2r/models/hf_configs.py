"""A Hugging Face config from a ``model_type`` and its fields, read by ``transformers`` itself (its defaults and its
own checks), with what it refuses said in one line: shared by ``CausalLMModule``, which builds the model, and the
planner, which prices it.

Two mistakes ``transformers`` lets through are refused here: an unknown ``model_type`` (its own message lists all
eight hundred types in one 12 kB line), and a misspelled field (``num_experts_per_tokk``): a config keeps any
keyword it does not know as a plain attribute, so the model trained with the field's default (every token to every
expert) and nothing said so. A field is taken as misspelled when it is none of the config's own and is within a
typo of one; other unknown keys pass as before (``rope_theta``, ``torch_dtype`` and other legacy spellings the
config converts, or an attribute the family's code reads by name, such as Qwen3-MoE's ``head_dim``)."""

from __future__ import annotations

import difflib
import inspect
from typing import Any

TYPO_CUTOFF = 0.8
"""``difflib``'s similarity above which an unknown key is a typo of a field (``num_experts_per_tokk``,
``hidden_sise``, ``n_experts`` pass it; ``rope_theta``, ``torch_dtype``, ``head_dim`` against Qwen3-MoE's fields,
``rotary_pct`` against GPT-NeoX's do not)."""


def read_hf_config(model_type: str, fields: dict[str, Any], where: str) -> Any:
    """``transformers.AutoConfig.for_model(model_type, **fields)``; a ValueError starting with ``where`` when
    ``transformers`` is missing or refuses a field, when ``model_type`` is not one of its types, or when a field is
    a misspelling of one of the config's own."""
    try:
        from transformers import CONFIG_MAPPING, AutoConfig
    except ImportError:
        raise ValueError(f"{where}: a Hugging Face model needs transformers: pip install 'lightning-p2r[hf]'") \
            from None
    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=3)
        raise ValueError(f"{where}: model_type {model_type!r} is not a model type of transformers "
                         + (f"(did you mean {' or '.join(map(repr, close))}?)" if close else
                            "(`transformers.CONFIG_MAPPING.keys()` lists them)"))
    typo = misspelled_field(CONFIG_MAPPING[model_type], fields)
    if typo is not None:
        key, field = typo
        raise ValueError(f"{where}: {key!r} is not a field of {CONFIG_MAPPING[model_type].__name__}; did you mean "
                         f"{field!r}? (transformers would keep it unused and build the model with {field}'s default)")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as error:  # transformers' checks raise ValueError, TypeError or huggingface_hub's own errors
        reason = error.__cause__ or error  # its validators wrap the reason in another error
        raise ValueError(f"{where}: {' '.join(str(reason).split())}") from None


def config_field_names(config_class: type) -> set[str]:
    """The names a Hugging Face config class takes as its own: its and its bases' constructor parameters, what a
    default instance writes out, and the aliases of its ``attribute_map`` (GPT-2's ``hidden_size`` for
    ``n_embd``)."""
    names = set(getattr(config_class, "attribute_map", None) or {})
    for klass in config_class.__mro__:
        if "__init__" in vars(klass):
            parameters = inspect.signature(klass.__init__).parameters.values()
            names |= {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    try:
        names |= set(config_class().to_dict())
    except Exception:  # a config that cannot be built with its defaults alone: its signature says enough
        pass
    return names


def misspelled_field(config_class: type, fields: dict[str, Any]) -> tuple[str, str] | None:
    """The first key of ``fields`` that is not a field of ``config_class`` but within a typo of one, with that
    field; None if there is none."""
    names = config_field_names(config_class)
    for key in fields:
        if key in names:
            continue
        close = difflib.get_close_matches(key, sorted(names), n=1, cutoff=TYPO_CUTOFF)
        if close:
            return key, close[0]
    return None
