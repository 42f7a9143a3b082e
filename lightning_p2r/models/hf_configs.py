"""A Hugging Face config from a ``model_type`` and its fields, read by ``transformers`` itself (its defaults and its
own checks), with what it refuses said in one line: shared by ``CausalLMModule``, which builds the model, and the
planner, which prices it."""

from __future__ import annotations

from typing import Any


def read_hf_config(model_type: str, fields: dict[str, Any], where: str) -> Any:
    """``transformers.AutoConfig.for_model(model_type, **fields)``; a ValueError starting with ``where`` when
    ``transformers`` is missing or refuses a field."""
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ValueError(f"{where}: a Hugging Face model needs transformers: pip install 'lightning-p2r[hf]'") \
            from None
    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as error:  # transformers' checks raise ValueError, TypeError or huggingface_hub's own errors
        reason = error.__cause__ or error  # its validators wrap the reason in another error
        raise ValueError(f"{where}: {' '.join(str(reason).split())}") from None
