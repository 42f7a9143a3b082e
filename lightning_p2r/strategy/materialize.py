"""Materializing a model built on the meta device: each tensor allocated once, where the placement puts it, and
filled once, with the checkpoint's value or its initial one: the model's ``initial_value(name)`` (a pure function of
its seed and the name, so independent of the placement), else the modules' ``reset_parameters()``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ..protocols import InitializesByName


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in (*module.parameters(), *module.buffers()))


def check_no_meta_buffers(module: nn.Module) -> None:
    """Refuse buffers built on the meta device: their values (a mask, a position table) were computed when the
    module was built, and allocating them later gives uninitialized memory, silently. Parameters are fine: their
    initial values come from the model or from ``reset_parameters()``."""
    names = [name for name, buffer in module.named_buffers() if buffer.device.type == "meta"]
    if names:
        raise ValueError(
            f"P2RStrategy builds the model on the meta device (no memory) and places each tensor afterwards, but "
            f"the buffers {names} were computed while it was built and cannot be recomputed there. Compute them "
            "in forward (as M6's rotary tables are), or build the model in the LightningModule's __init__ instead of "
            "configure_model (it is then built whole, eagerly)")


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


class Initializer:
    """Writes the initial values of ``root``'s parameters once they have storage: from ``values_from``'s
    ``initial_value(name)`` (an M6 model's block-sequence holder), else by their modules' ``reset_parameters()``."""

    def __init__(self, root: nn.Module, values_from: nn.Module | None) -> None:
        self.root = root
        self.values_from = values_from if isinstance(values_from, InitializesByName) else None
        self._names = ({id(p): n for n, p in self.values_from.named_parameters()}
                       if self.values_from is not None else {})

    def fill(self, params: Iterable[nn.Parameter]) -> None:
        pending = set()  # ids of the parameters left to their modules' reset_parameters()
        for param in params:
            name = self._names.get(id(param))
            if name is None:
                pending.add(id(param))
            elif isinstance(param, DTensor):
                write(param, self.values_from.initial_value(name))  # whole value, then this rank's part
            else:
                with torch.no_grad():
                    self.values_from.initial_value(name, out=param)  # in place: no temporary copy
        if not pending:
            return
        for module in self.root.modules():
            if any(id(p) in pending for p in module.parameters(recurse=False)):
                reset = getattr(module, "reset_parameters", None)
                if not callable(reset):
                    names = [n for n, p in module.named_parameters(recurse=False) if id(p) in pending]
                    raise ValueError(
                        f"{type(module).__name__} was built on the meta device, but neither the model "
                        f"(initial_value(name)) nor the module (reset_parameters()) can initialize {names}")
                with torch.no_grad():
                    reset()
