"""The whole model's state while an :class:`~.offload.OffloadEngine` keeps some blocks in host memory.

An offloaded block's parameters in the module are device placeholders (empty between uses); their values live in
the engine's host masters, named as the LightningModule's state dict names them (the module's own ``state_dict``
and ``load_state_dict`` read and write them through the engine's hooks). These functions name the masters and
count the resident bytes for the strategy's accounting.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def blocks_prefix(module: nn.Module, holder: nn.Module) -> str:
    """The state-dict prefix of the blocks of ``holder`` (the block sequence) inside ``module``: the engine names
    its host masters with it, so they match the module's own state dict."""
    for name, candidate in module.named_modules():
        if candidate is holder:
            return f"{name}.blocks." if name else "blocks."
    raise ValueError("the block sequence is not part of the LightningModule")


def resident_model_bytes(module: nn.Module, blocks: nn.ModuleList, offloaded: Any) -> int:
    """Device bytes of the parameters that never stream (outside the ``offloaded`` block indices), with the
    gradients of the trainable ones. They do not change size until the next re-plan, so they are counted once."""
    streamed = {id(p) for index in offloaded for p in blocks[index].parameters()}
    resident = [p for p in module.parameters() if id(p) not in streamed]
    return sum(p.numel() * p.element_size() * (2 if p.requires_grad else 1) for p in resident)
