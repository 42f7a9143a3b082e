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


def meta_template(module: nn.Module) -> nn.Module:
    """A copy of ``module``'s structure on the meta device (no memory), parameters and buffers included."""
    memo: dict[int, object] = {id(buffer): torch.empty_like(buffer, device="meta") for buffer in module.buffers()}
    for param in module.parameters():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    return copy.deepcopy(module, memo)


def rule_ancestors(tree: nn.Module, name: str, rule: ModuleInit | None) -> list[nn.Module]:
    """The modules of ``tree`` above module ``name`` that Hugging Face's rule also runs on, deepest first, up to the
    ``PreTrainedModel`` whose ``_init_weights`` it is. Transformers initializes a model by applying ``_init_weights``
    to every module, children before parents, and a parent's branch may write a child's tensors (Qwen3-Next's sparse
    MoE block draws its router's weight; the router's own branch writes nothing): a module's values are what its own
    call and then its ancestors' calls leave. Empty for any other rule (``reset_parameters()`` is the module's own;
    a LightningModule's ``init_module`` is called on each module owning tensors, as documented)."""
    owner = getattr(rule, "__self__", None)
    if owner is None or getattr(rule, "__name__", "") != "_init_weights" or not is_hf_pretrained(owner):
        return []
    if is_hf_pretrained(tree.get_submodule(name)):
        return []  # the owner itself: nothing above it belongs to its rule
    parts = name.split(".") if name else []
    ancestors = []
    for depth in range(len(parts) - 1, -1, -1):
        ancestors.append(tree.get_submodule(".".join(parts[:depth])))
        if is_hf_pretrained(ancestors[-1]):  # the nearest PreTrainedModel, whose rule this is (as in init_rule)
            return ancestors
    return []


@torch.no_grad()
def initialize_module(rule: ModuleInit, module: nn.Module, seed: int, name: str,
                      ancestors: list[nn.Module] = ()) -> None:
    """Run ``rule`` on ``module``, then on its ``ancestors`` (:func:`rule_ancestors`), from the stream seeded by
    (``seed``, ``name``); the global stream is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(module_seed(seed, name))
        rule(module)
        for ancestor in ancestors:
            rule(ancestor)


@torch.no_grad()
def values_on_twin(rule: ModuleInit, template: nn.Module, name: str, seed: int, seed_name: str, keys: list[str],
                   consume: Callable[[dict[str, torch.Tensor], list[str]], None]) -> None:
    """Compute the values ``rule`` gives module ``name``'s own tensors ``keys`` on its twin in ``template`` (a
    :func:`meta_template` of the tree) and pass them to ``consume`` with the keys the rule left unwritten (see
    :func:`mark_unwritten`). Only the twin's own tensors get host storage, every other module stays on the meta
    device, so a rule run on an ancestor writes this module's tensors only; the storage is freed after ``consume``."""
    twin = template.get_submodule(name)
    twin.to_empty(device="cpu", recurse=False)
    try:
        mark_unwritten({key: getattr(twin, key) for key in keys})
        initialize_module(rule, twin, seed, seed_name, rule_ancestors(template, name, rule))
        values = {key: getattr(twin, key) for key in keys}  # after the rule: litgpt's rebinds its cos and sin
        consume(values, unwritten_keys(values))
    finally:
        twin.to_empty(device="meta", recurse=False)  # the template stays free (delinking copies it)


def initialize_by_module(root: nn.Module, seed: int, hook: ModuleInit | None = None) -> None:
    """Initialize every module of ``root`` owning parameters or buffers, in place (an eager build): the values a build
    in place gives for the same ``seed``, computed the same way (:func:`values_on_twin`). A tensor the rule does not
    write keeps the value its constructor gave it; a module nothing can initialize is refused by name."""
    template = meta_template(root)
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
        _copy_from_twin(rule, template, module, name, seed)
    # A tied parameter keeps the values of its first name's module (what a build in place gives it, whichever module
    # it materializes first): that module runs again, from the same stream, so its other values do not change.
    first_names: dict[int, str] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        first_names.setdefault(id(param), name)
    tied = {first_names[id(p)] for n, p in root.named_parameters(remove_duplicate=False) if first_names[id(p)] != n}
    for owner in sorted({name.rpartition(".")[0] for name in tied}):
        _copy_from_twin(init_rule(root, owner, hook), template, root.get_submodule(owner), owner, seed)


def _copy_from_twin(rule: ModuleInit, template: nn.Module, module: nn.Module, name: str, seed: int) -> None:
    """An eager build's module takes what its rule writes; what the rule leaves, its constructor's value."""
    keys = [key for key, _ in module.named_parameters(recurse=False)] + [
        key for key, _ in module.named_buffers(recurse=False)]

    def copy_written(values: dict[str, torch.Tensor], unwritten: list[str]) -> None:
        for key, value in values.items():
            if key in unwritten:
                continue
            tensor = getattr(module, key)
            if tensor.shape == value.shape:
                tensor.copy_(value.to(tensor.dtype))
            else:  # a buffer the rule rebuilt at another size (litgpt's cos and sin follow the block size)
                module._buffers[key] = value.detach().clone().to(tensor.dtype)

    values_on_twin(rule, template, name, seed, name, keys, copy_written)


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


def unwritten_keys(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The tensors still holding what :func:`mark_unwritten` filled them with."""
    unwritten = []
    for key, tensor in tensors.items():
        value = _unwritten_value(tensor)
        if tensor.numel() and value is not None and (
                bool(torch.isnan(tensor).any()) if isinstance(value, float) else bool((tensor == value).all())):
            unwritten.append(key)
    return unwritten


def check_written(module: nn.Module, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Refuse tensors the model's rule left as :func:`mark_unwritten` filled them: allocated on the meta device's
    say-so, they would hold no value at all, silently."""
    unwritten = unwritten_keys(tensors)
    if unwritten:
        raise ValueError(
            f"the model was built on the meta device and its tensors are given their values by its own rule, but "
            f"the rule of {type(module).__name__} ({name or 'the model'}) did not write {unwritten}. Give the "
            "LightningModule an init_module(module) method that writes them (a buffer may also be computed in "
            "forward), or build the model in the LightningModule's __init__ instead of configure_model (it is then "
            "built whole, eagerly)")


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
