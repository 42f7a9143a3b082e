"""Materializing a model built on the meta device: each tensor allocated once, where the placement puts it, and
filled once, with the checkpoint's value or its initial one: the model's ``initial_value(name)`` (a pure function of
its seed and the name, so independent of the placement), else the modules' ``reset_parameters()``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ..models.module_init import (
    buffers_by_rule,
    check_written,
    init_rule,
    is_module_default,
    meta_template,
    recomputes_buffers,
    values_on_twin,
)
from ..protocols import InitializesByName, InitializesModules
from .blocks import module_name
from .ties import placement_root, smallest_parameter_root


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in (*module.parameters(), *module.buffers()))


def check_no_meta_buffers(module: nn.Module) -> None:
    """Refuse buffers built on the meta device that nothing recomputes: their values (a mask, a position table) were
    computed when the module was built, and allocating them later gives uninitialized memory, silently. Buffers the
    model's own rule recomputes (Hugging Face's rotary tables, a ``reset_parameters()`` that owns buffers, the
    LightningModule's ``init_module``) are fine, and so are parameters."""
    hook = module.init_module if isinstance(module, InitializesModules) else None
    names = [f"{owner}.{name}" if owner else name for owner, sub in module.named_modules()
             for name, buffer in sub.named_buffers(recurse=False)
             if buffer.device.type == "meta" and not recomputes_buffers(module, owner, hook)]
    if names:
        raise ValueError(
            f"P2RStrategy builds the model on the meta device (no memory) and places each tensor afterwards, but "
            f"the buffers {names} were computed while it was built and cannot be recomputed there. Compute them "
            "in forward (as the package's own models compute their rotary tables), or build the model in the "
            "LightningModule's __init__ instead of configure_model (it is then built whole, eagerly)")


def allocate(module: nn.Module, device: torch.device | str, *, skip: Iterable[nn.Module] = ()) -> list[nn.Parameter]:
    """Give every meta parameter and buffer of ``module`` (outside the ``skip`` subtrees) uninitialized storage on
    ``device``; returns the parameters allocated (each once)."""
    skipped = {id(m) for tree in skip for m in tree.modules()}
    allocated: dict[int, nn.Parameter] = {}
    # to_empty swaps each tensor in place instead of giving each module a new Parameter: a parameter shared by two
    # modules (a tied LM head) stays one object, and FSDP2's references to its DTensors stay valid.
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        for submodule in (m for m in module.modules() if id(m) not in skipped):
            own = [p for p in submodule.parameters(recurse=False) if p.device.type == "meta"]
            if own or any(b.device.type == "meta" for b in submodule.buffers(recurse=False)):
                submodule.to_empty(device=device, recurse=False)
                allocated.update((id(p), p) for p in own)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    return list(allocated.values())


def local_part(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """The part of ``full`` (the whole tensor) that ``like``'s rank holds, for FSDP2's dim-0 shards and replicas
    (``torch.chunk`` semantics: the last ranks may hold less, or nothing)."""
    mesh, part = like.device_mesh, full
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("this rank is not part of the parameter's device mesh")
    for mesh_dim, placement in enumerate(like.placements):
        if isinstance(placement, Shard):
            chunks = torch.chunk(part, mesh.size(mesh_dim), dim=placement.dim)
            index = coordinate[mesh_dim]
            part = chunks[index] if index < len(chunks) else part.narrow(placement.dim, 0, 0)
        elif not isinstance(placement, Replicate):
            raise ValueError(f"cannot place an initial value for placement {placement}")
    return part


@torch.no_grad()
def write(param: DTensor, full: torch.Tensor) -> None:
    """Copy this rank's part of the whole value ``full`` into ``param``."""
    local = param.to_local()
    if all(type(p) in (Shard, Replicate) for p in param.placements):
        local.copy_(local_part(full, param).to(local.dtype))
    else:
        # FSDP2 over a tensor-parallel dimension of the same tensor dimension (a strided shard): DTensor cuts
        # this rank's part itself, locally, since every rank holds the whole value (src_data_rank=None).
        mesh = param.device_mesh
        part = distribute_tensor(full.to(mesh.device_type), mesh, param.placements, src_data_rank=None)
        local.copy_(part.to_local().to(local.dtype))


def ambiguous_tied_inits(root: nn.Module, hook=None) -> list[str]:
    """A one-line note for each parameter registered under several names (a tied embedding and head) whose modules
    would initialize it by different ``reset_parameters()`` (an ``nn.Embedding``'s N(0, 1) and an ``nn.Linear``'s
    uniform bound): built in place, it takes its first name's; an eager build gives it the init of whichever module
    created it, which the meta-built model cannot tell. None when the model's own rule covers both (the
    LightningModule's ``init_module``, Hugging Face's ``_init_weights``), which is the same for every module kind."""
    names: dict[int, list[str]] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    notes = []
    for tied in (group for group in names.values() if len(group) > 1):
        owners = [name.rpartition(".")[0] for name in tied]
        kinds = {type(root.get_submodule(owner)).__name__ for owner in owners}
        rules = {init_rule(root, owner, hook) for owner in owners}
        if len(kinds) > 1 and any(is_module_default(rule) for rule in rules):
            first = type(root.get_submodule(owners[0])).__name__
            notes.append(f"the tied parameter {' = '.join(tied)} is initialized by {first}.reset_parameters() (its "
                         f"first name's module; the model was built on the meta device). Built eagerly, it would "
                         f"hold what the model's constructor left in it: the init of whichever of {sorted(kinds)} "
                         "created it, or the constructor's own. To choose, give the LightningModule an "
                         "init_module(module) method, or load weights")
    return notes


KNOWN_INIT_PACKAGES = ("torch", "transformers", "litgpt", "lightning_p2r")
"""Packages whose models built eagerly hold their modules' ``reset_parameters()`` values, or whose in-place build
takes the model's rule (Hugging Face's ``_init_weights``, the package's own models' ``initial_value``): a model of
theirs built in place gets what an eager build has. A model defined elsewhere may initialize itself in its
constructor, which the meta device runs without writing anything."""


def default_init_note(root: nn.Module, hook=None) -> str | None:
    """A one-line note when a user's own model (its class defined outside :data:`KNOWN_INIT_PACKAGES`) built on the
    meta device has modules whose values will come from their ``reset_parameters()`` (torch's per-kind defaults):
    whatever init its constructor ran (``self.apply(my_init)``, ``nn.init.*`` calls) ran on the meta device and wrote
    nothing, so the model would start from other values than its eager build, silently. None when the
    LightningModule's ``init_module`` or Hugging Face's rule covers every module, or the model is a known library's."""
    # The model's own class, not the one FSDP2 or a wrapper of torch.distributed's derives from it.
    model_class = next(cls for cls in type(root).__mro__ if not cls.__module__.startswith("torch.distributed"))
    if hook is not None or model_class.__module__.split(".")[0] in KNOWN_INIT_PACKAGES:
        return None
    kinds: dict[str, int] = {}
    for name, module in root.named_modules():
        if next(module.parameters(recurse=False), None) is not None and is_module_default(init_rule(root, name)):
            kinds[type(module).__name__] = kinds.get(type(module).__name__, 0) + 1
    if not kinds:
        return None
    counted = ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items(), key=lambda item: -item[1]))
    return (f"{model_class.__name__} was built on the meta device: its modules ({counted}) take the values of their "
            "reset_parameters() (torch's defaults per module kind). An init its constructor runs (self.apply(...), "
            "nn.init calls) ran on the meta device and wrote nothing. If the model initializes itself otherwise, give "
            "the LightningModule an init_module(module) method that does it per module (docs/your_model.md, 'Built "
            "in place'), or build the model in __init__ instead of configure_model")


class Initializer:
    """Writes the initial values of a model's parameters (and computed buffers) once they have storage: from
    ``values_from``'s ``initial_value(name)`` (a holder that names its own initial values: ``InitializesByName``), else
    by the model's own rule for each module (``models.module_init``: the LightningModule's ``init_module``, Hugging
    Face's ``_init_weights``, ``reset_parameters()``), seeded by ``seed`` and the module's name, so every layout and
    every replica gets the values an eager build initialized by ``initialize_by_module`` has.

    The rule runs on a *twin* of each module: the module as it was on the meta device (``template``: a copy of the
    root taken before placement; made here where the parameters are still whole), given host storage for its own
    tensors only; each rank then copies its part of every whole value. The peak is one module's whole tensors. A
    tied parameter takes the values its first name's module gives it, whichever module is materialized first.
    Seeds follow module names from ``module`` (the LightningModule): an eager build is initialized by
    ``initialize_by_module(module, seed)`` on the same root.
    """

    def __init__(self, module: nn.Module, values_from: nn.Module | None, *, seed: int = 0,
                 template: nn.Module | None = None) -> None:
        # Placement passes the block holder as values_from: the root is the one it shards (ties.placement_root)
        self.root = placement_root(module, values_from) if values_from is not None else smallest_parameter_root(module)
        # Seeds follow names from the LightningModule, which do not change with what a rank holds (a pipeline rank
        # without the head has a deeper root).
        prefix = module_name(module, self.root)
        self._prefix = prefix + "." if prefix else ""
        self.values_from = values_from if isinstance(values_from, InitializesByName) else None
        self._names = ({id(p): n for n, p in self.values_from.named_parameters()}
                       if self.values_from is not None else {})
        self.seed = seed
        self.hook = module.init_module if isinstance(module, InitializesModules) else None
        self._template = template
        self._owner = {id(p): name.rpartition(".")[0] for name, p in self.root.named_parameters()}
        # Buffers still on the meta device (a rotary table computed at construction): recomputed by ``finish``, also
        # when a checkpoint gives the parameters (computed buffers are not persistent).
        self._computed = [name for name, m in self.root.named_modules()
                          if any(b.device.type == "meta" for b in m.buffers(recurse=False))]
        # ... and those of modules above the root, by their names from the LightningModule: a pipeline rank without
        # the head has a root below the module holding litgpt's cos/sin tables. They own buffers only (the root
        # holds every parameter).
        inside = {id(m) for m in self.root.modules()}
        self._module = module
        self._computed_above = [name for name, m in module.named_modules() if id(m) not in inside
                                and any(b.device.type == "meta" for b in m.buffers(recurse=False))]

    def template(self) -> nn.Module:
        if self._template is None:
            self._template = meta_template(self.root)
        return self._template

    def fill(self, params: Iterable[nn.Parameter]) -> None:
        pending = set()  # ids of the parameters left to their modules' own rule
        for param in params:
            name = self._names.get(id(param))
            if name is None:
                pending.add(id(param))
            elif isinstance(param, DTensor):
                write(param, self.values_from.initial_value(name))  # whole value, then this rank's part
            else:
                with torch.no_grad():
                    self.values_from.initial_value(name, out=param)  # in place: no temporary copy
        modules = {self._owner[i] for i in pending if i in self._owner}
        for name in sorted(modules):
            module = self.root.get_submodule(name)
            own = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) in pending
                   and self._owner[id(p)] == name]
            self._from_twin(name, own, [])

    def finish(self) -> None:
        """Recompute the buffers that were on the meta device, by the model's rule, once they have storage."""
        for name in self._computed:
            module = self.root.get_submodule(name)
            self._from_twin(name, [], list(module.named_buffers(recurse=False)))
        for name in self._computed_above:
            self._buffers_from_twin(name)

    def _buffers_from_twin(self, name: str) -> None:
        """A module above the root: its rule runs on a twin holding the module's own buffers only
        (:func:`buffers_by_rule`), seeded by its name from the LightningModule."""
        module = self._module.get_submodule(name)
        rule = init_rule(self._module, name, self.hook)
        if rule is None:
            return  # buffers no rule computes: check_no_meta_buffers refused them before placement
        with torch.no_grad():
            for key, value in buffers_by_rule(rule, module, self.seed, name).items():
                tensor = module._buffers[key]
                tensor.copy_(value.to(tensor.dtype))

    def _from_twin(self, name: str, params: list[tuple[str, torch.Tensor]],
                   buffers: list[tuple[str, torch.Tensor]]) -> None:
        rule = init_rule(self.root, name, self.hook)
        if rule is None:
            module = self.root.get_submodule(name)
            raise ValueError(
                f"{type(module).__name__} ({name or 'the model'}) was built on the meta device, but neither the "
                f"model (initial_value(name), _init_weights) nor the module (reset_parameters()) can initialize "
                f"{[n for n, _ in params]}: give the LightningModule an init_module(module) method")
        module = self.root.get_submodule(name)

        def write_values(values: dict[str, torch.Tensor], unwritten: list[str]) -> None:
            # Built on the meta device, a tensor the rule did not write would hold no value at all, silently.
            check_written(module, name, {key: values[key] for key in unwritten})
            for key, tensor in params + buffers:
                if isinstance(tensor, DTensor):
                    write(tensor, values[key])
                else:
                    tensor.copy_(values[key].to(tensor.dtype))

        keys = [key for key, _ in params + buffers]
        values_on_twin(rule, self.template(), name, self.seed, self._prefix + name, keys, write_values)
