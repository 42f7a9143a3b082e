"""The whole model's state while an :class:`~.offload.OffloadEngine` keeps some blocks in host memory.

An offloaded block's parameters in the module are device placeholders (empty between uses); their values live in
the engine's host masters, named as the LightningModule's state dict names them. These functions give the
strategy's checkpoint and accounting hooks the module's state as if nothing were offloaded. Pure functions over
the module and the engine; the strategy decides when to call them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .offload import OffloadEngine


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


def full_state_dict(module: nn.Module, engine: OffloadEngine | None) -> dict[str, Any]:
    """``module``'s state dict with every offloaded parameter's host master in place of its device placeholder."""
    state = module.state_dict()
    if engine is not None:
        for name, tensor in engine.host_tensors().items():
            state[name] = tensor.detach()
    return state


def load_full_state_dict(module: nn.Module, engine: OffloadEngine, state_dict: dict[str, Any], strict: bool) -> None:
    """Load a whole-model state dict: offloaded parameters into their host masters (then onto the device where
    the plan keeps them resident), everything else into ``module``. The module reports the offloaded names as
    missing (they were loaded into the masters instead), so ``strict`` leaves them out."""
    state = dict(state_dict)
    with torch.no_grad():
        for name, tensor in engine.host_tensors().items():
            tensor.copy_(state.pop(name))
    engine.refresh_resident_copies()
    missing, unexpected = module.load_state_dict(state, strict=False)
    offloaded = set(engine.host_tensors())
    missing = [key for key in missing if key not in offloaded]
    if strict and (missing or unexpected):
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
