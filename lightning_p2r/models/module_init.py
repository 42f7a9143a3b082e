"""Initial values for a model that does not name them itself (a Hugging Face or litgpt model, a user's own), the same
whatever the layout: each module is initialized by the model's own rule, from a random stream seeded by the run's
seed and the module's name (issue 38, item 3).

The model's own rule is, in order: a LightningModule's ``init_module(module)`` (the user's hook), Hugging Face's
``_init_weights(module)`` of the nearest ``PreTrainedModel`` above it (which also recomputes rotary tables), or the
module's ``reset_parameters()``. Seeding per module makes a module's values independent of where the others live
and of the order they are materialized in: an eager build initialized by :func:`initialize_by_module` and a build in
place (on the meta device, each tensor materialized on its own rank, ``strategy/materialize.py``) hold the same
values, bit for bit, and so do replicas on different ranks.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Callable

import torch
from torch import nn

ModuleInit = Callable[[nn.Module], None]


def module_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed for the module called ``name`` (crc32 is the same in every process, unlike ``hash``)."""
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def _owns_state(module: nn.Module) -> bool:
    return next(module.parameters(recurse=False), None) is not None or next(module.buffers(recurse=False),
                                                                            None) is not None


def init_rule(root: nn.Module, name: str, hook: ModuleInit | None = None) -> ModuleInit | None:
    """How the module ``name`` of ``root`` is initialized (see the module docstring), or None when nothing knows."""
    if hook is not None:
        return hook
    parts = name.split(".") if name else []
    # The nearest Hugging Face PreTrainedModel at or above the module (it knows its own submodules' init). Only
    # transformers' own: another library's ``_init_weights`` (litgpt's) may cover some module kinds only.
    for depth in range(len(parts), -1, -1):
        owner = root.get_submodule(".".join(parts[:depth]))
        if is_hf_pretrained(owner):
            return owner._init_weights
    module = root.get_submodule(name)
    # Called on the module it is given (a host twin of this one, when built in place), not bound to this one.
    return _reset_parameters if callable(getattr(module, "reset_parameters", None)) else None


def _reset_parameters(module: nn.Module) -> None:
    module.reset_parameters()


def is_module_default(rule: ModuleInit | None) -> bool:
    """Whether ``rule`` (from :func:`init_rule`) is the module's own ``reset_parameters()``, which differs by module
    kind, rather than a model-wide rule."""
    return rule is _reset_parameters


def is_hf_pretrained(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face ``transformers.PreTrainedModel`` (checked without importing it)."""
    return any(cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.")
               for cls in type(module).__mro__)


@torch.no_grad()
def initialize_module(rule: ModuleInit, module: nn.Module, seed: int, name: str) -> None:
    """Run ``rule`` on ``module`` from the stream seeded by (``seed``, ``name``); the global stream is left as it
    was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(module_seed(seed, name))
        rule(module)


def initialize_by_module(root: nn.Module, seed: int, hook: ModuleInit | None = None) -> None:
    """Initialize every module of ``root`` owning parameters or buffers, in place (an eager build): the values a build
    in place gives for the same ``seed``. A module nothing can initialize is refused by name."""
    for name, module in root.named_modules():
        if not _owns_state(module):
            continue
        rule = init_rule(root, name, hook)
        if rule is None:
            if next(module.parameters(recurse=False), None) is None:
                continue  # buffers only, none of them computed by an init rule: kept as built
            raise ValueError(f"{type(module).__name__} ({name or 'the model'}) has parameters that nothing can "
                             "initialize: give the LightningModule an init_module(module) method, or the module a "
                             "reset_parameters()")
        initialize_module(rule, module, seed, name)
    # A tied parameter keeps the values of its first name's module (what a build in place gives it, whichever module
    # it materializes first): that module runs again, from the same stream, so its other values do not change.
    first_names: dict[int, str] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        first_names.setdefault(id(param), name)
    tied = {first_names[id(p)] for n, p in root.named_parameters(remove_duplicate=False) if first_names[id(p)] != n}
    for owner in sorted({name.rpartition(".")[0] for name in tied}):
        initialize_module(init_rule(root, owner, hook), root.get_submodule(owner), seed, owner)


def recomputes_buffers(root: nn.Module, name: str, hook: ModuleInit | None = None) -> bool:
    """Whether the model's own rule rewrites the buffers of module ``name`` (a rotary table built at construction):
    Hugging Face's ``_init_weights`` (since transformers 5 it initializes the non-persistent buffers too, because
    ``from_pretrained`` builds on the meta device: rotary tables, Gemma's embedding scale), any module's
    ``reset_parameters()`` that owns buffers (litgpt's ``GPT`` recomputes its ``cos``/``sin`` there), or the user's
    hook. Materializing checks that the rule did write them (``strategy.materialize``)."""
    module = root.get_submodule(name)
    if hook is not None:
        return True
    rule = init_rule(root, name)
    if rule is None:
        return False
    if is_hf_pretrained(getattr(rule, "__self__", None) or module):
        return True
    return callable(getattr(module, "reset_parameters", None))


def _unwritten_value(tensor: torch.Tensor) -> float | int | None:
    if tensor.is_floating_point() or tensor.is_complex():
        return float("nan")
    return None if tensor.dtype == torch.bool else torch.iinfo(tensor.dtype).min


@torch.no_grad()
def mark_unwritten(buffers: dict[str, torch.Tensor]) -> None:
    """Fill fresh buffers with a value no initialization writes (NaN; the integer type's minimum), so that
    :func:`check_written` can tell whether the model's rule wrote them."""
    for tensor in buffers.values():
        value = _unwritten_value(tensor)
        if value is not None:
            tensor.fill_(value)


def check_written(module: nn.Module, name: str, buffers: dict[str, torch.Tensor]) -> None:
    """Refuse buffers the model's rule left as :func:`mark_unwritten` filled them: allocated on the meta device's
    say-so, they would hold no value at all, silently."""
    unwritten = []
    for key, tensor in buffers.items():
        value = _unwritten_value(tensor)
        if tensor.numel() and value is not None and (
                bool(torch.isnan(tensor).any()) if isinstance(value, float) else bool((tensor == value).all())):
            unwritten.append(key)
    if unwritten:
        raise ValueError(
            f"the model was built on the meta device and its buffers are recomputed by its own rule, but "
            f"the rule of {type(module).__name__} ({name or 'the model'}) did not write {unwritten}. Compute them in "
            "forward, give the LightningModule an init_module(module) method that writes them, or build the model "
            "in the LightningModule's __init__ instead of configure_model (it is then built whole, eagerly)")


def buffers_by_rule(rule: ModuleInit, module: nn.Module, seed: int, name: str) -> dict[str, torch.Tensor]:
    """``module``'s own buffers as ``rule`` computes them (seeded by ``seed`` and ``name``), on the host, checked
    written (:func:`check_written`). The rule runs on a twin that leaves out every module the original refers to (its
    children, an alias such as a declared ``blocks``: FSDP2's units refuse a copy) and keeps the original's
    parameters on the meta device (an embedding's rule would redraw its weight: Gemma's scaled embedding owns a
    buffer too)."""
    referred = [*module.children(), *(value for value in vars(module).values() if isinstance(value, nn.Module))]
    memo: dict[int, object] = {id(other): None for other in referred}
    memo |= {id(p): torch.empty_like(p, device="meta") for p in module.parameters(recurse=False)}
    memo |= {id(b): torch.empty_like(b, device="cpu") for b in module.buffers(recurse=False)}
    twin = copy.deepcopy(module, memo)
    mark_unwritten(dict(twin.named_buffers(recurse=False)))
    initialize_module(rule, twin, seed, name)
    buffers = dict(twin.named_buffers(recurse=False))  # after the rule: litgpt's rebinds cos and sin to new tensors
    check_written(module, name, buffers)
    return buffers


def recompute_buffers(root: nn.Module, name: str, hook: ModuleInit | None = None) -> None:
    """Give module ``name``'s buffers that are on the meta device their values by the model's rule, on the host,
    leaving its parameters as they are (:func:`buffers_by_rule`)."""
    module = root.get_submodule(name)
    rule = init_rule(root, name, hook)
    if rule is None:
        raise ValueError(f"nothing computes the buffers of {type(module).__name__} ({name or 'the model'}), which "
                         "were built on the meta device")
    for key, buffer in buffers_by_rule(rule, module, 0, name).items():
        if module._buffers[key].device.type == "meta":
            module._buffers[key] = buffer
