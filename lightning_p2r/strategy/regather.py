"""Gather an FSDP2-sharded module and its optimizer into plain host copies, and shard optimizer state back.

FSDP2 cannot change the structure of a module it manages, so delinking gathers the model into a plain host copy
(one tensor at a time), delinks that and places it afresh. The copy is a deep copy of a *meta template* taken before
sharding (an FSDP2 module cannot be copied) with every meta tensor mapped to a real one, so tied parameters stay tied.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..sharing import OptimizerStatePolicy, Perturbation, delink, optimizer_constructor_kwargs
from .optimizers import unwrapped
from .ties import find_ties, retie


def full_tensor_on_host(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor in host memory, gathered from every rank when it is a DTensor (collective: every rank of
    its mesh must call this for the same tensors in the same order)."""
    if not isinstance(tensor, DTensor):
        return tensor.detach().to("cpu", copy=True)
    local = tensor.to_local()
    mesh = tensor.device_mesh
    if local.device.type != mesh.device_type:  # an offloaded shard lives on the host; the collective runs on the mesh
        local = local.to(mesh.device_type)
    whole = DTensor.from_local(local.detach(), mesh, tensor.placements, run_check=False, shape=tensor.shape,
                               stride=tensor.stride())
    return whole.full_tensor().to("cpu")


def gather_plain_module(sharded: nn.Module, template: nn.Module) -> nn.Module:
    """A plain host copy of ``sharded`` (built from ``template``, its meta copy taken before sharding), with the live
    module's ties: a template that lost one (a tie the model re-made after the template was taken) is re-tied."""
    live_params = dict(sharded.named_parameters(remove_duplicate=False))
    live_buffers = dict(sharded.named_buffers())
    memo: dict[int, object] = {}
    for name, meta in template.named_parameters():
        if name not in live_params:
            raise ValueError(f"the sharded module has no parameter {name!r}: the template is out of date")
        live = live_params[name]
        memo[id(meta)] = nn.Parameter(full_tensor_on_host(live), requires_grad=live.requires_grad)
    for name, meta in template.named_buffers():
        memo[id(meta)] = full_tensor_on_host(live_buffers[name])
    plain = copy.deepcopy(template, memo)
    retie(plain, find_ties(sharded))
    _share_plain_attributes(sharded, plain)
    return plain


def _share_plain_attributes(live: nn.Module, copied: nn.Module) -> None:
    """Give the copy the live module's own attribute objects (a config shared with the LightningModule, say) rather
    than the template's copies from setup time, so changes the delinking makes (``config.num_unique_blocks``) reach
    everyone who holds them, as they do when an unsharded model is delinked in place."""
    for source, target in zip(live.modules(), copied.modules()):
        for key, value in list(vars(target).items()):
            if key in vars(source) and not key.startswith("_") and not isinstance(value, (torch.Tensor, nn.Module)):
                setattr(target, key, vars(source)[key])


def remap_optimizer(optimizer: torch.optim.Optimizer, target_of: Callable[[torch.Tensor], torch.Tensor],
                    convert: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.optim.Optimizer:
    """An optimizer of the same class, settings and groups over other parameters (``target_of`` maps each of
    ``optimizer``'s parameters to its counterpart), each state tensor passed through ``convert(value, target)``.
    States are visited in group order and key order, the same on every rank, so ``convert`` may be collective."""
    groups = [{k: v for k, v in group.items() if k != "params"} | {"params": [target_of(p) for p in group["params"]]}
              for group in optimizer.param_groups]
    result = type(optimizer)(groups, **optimizer_constructor_kwargs(optimizer))
    for param in [p for group in optimizer.param_groups for p in group["params"] if optimizer.state.get(p)]:
        target = target_of(param)
        result.state[target] = {key: convert(value, target) if isinstance(value, torch.Tensor) else value
                                for key, value in sorted(optimizer.state[param].items())}
    return result


def optimizer_subset(optimizer: torch.optim.Optimizer, kept: list[tuple[int, list[Any]]]) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class over some of its parameters (``kept``: group index, parameters), with
    their state and their groups' settings."""
    groups = [{k: v for k, v in optimizer.param_groups[i].items() if k != "params"} | {"params": params}
              for i, params in kept]
    subset = type(optimizer)(groups, **optimizer_constructor_kwargs(optimizer))
    subset.state.update({p: optimizer.state[p] for _, params in kept for p in params if p in optimizer.state})
    return subset


def gather_plain_optimizer(optimizer: torch.optim.Optimizer, sharded: nn.Module,
                           plain: nn.Module) -> torch.optim.Optimizer:
    """An optimizer of the same class, groups and hyperparameters over ``plain``'s parameters, with the whole
    (gathered) state of ``optimizer``, which optimizes ``sharded``."""
    name_of = {id(p): name for name, p in sharded.named_parameters()}
    plain_params = dict(plain.named_parameters())
    if any(id(p) not in name_of for group in optimizer.param_groups for p in group["params"]):
        raise ValueError("the optimizer holds parameters outside the sharded module; delinking a sharded model "
                         "needs every optimized parameter under it")
    return remap_optimizer(optimizer, lambda p: plain_params[name_of[id(p)]],
                           lambda value, _: full_tensor_on_host(value))


def delinked_plain_copy(sharded: nn.Module, template: nn.Module, optimizer: torch.optim.Optimizer,
                        num_unique_blocks: int | None, optimizer_state: OptimizerStatePolicy,
                        perturb: Perturbation | None = None) -> tuple[nn.Module, torch.optim.Optimizer, dict[int, str]]:
    """Gather ``sharded`` (and ``optimizer``, over it) into plain host copies and delink those (collective). Returns the
    delinked module, its optimizer, and each parameter's name by ``id`` (sharding replaces the parameters, so
    :func:`shard_optimizer` finds the new ones by name)."""
    plain = gather_plain_module(sharded, template)
    plain_optimizer = delink(plain, gather_plain_optimizer(optimizer, sharded, plain),
                             num_unique_blocks=num_unique_blocks, optimizer_state=optimizer_state, perturb=perturb)
    return plain, plain_optimizer, {id(p): name for name, p in plain.named_parameters()}


def shard_optimizer(plain_optimizer: torch.optim.Optimizer, names: dict[int, str],
                    sharded: nn.Module) -> torch.optim.Optimizer:
    """The optimizer ``plain_optimizer`` describes, over the parameters of ``sharded`` (``names`` maps the id of
    each plain parameter to its name, recorded before sharding replaced the parameters)."""
    live = dict(sharded.named_parameters())

    def shard(value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Per-element states laid out as their parameter (this rank's shard, on its device); scalars (Adam's step)
        as they are."""
        if value.shape != target.shape or value.dim() == 0:
            return value
        if not isinstance(target, DTensor):
            return value.to(target.device)
        mesh = target.device_mesh
        # Every rank holds the whole tensor, so each cuts its own shard without communicating (src_data_rank=None).
        local = distribute_tensor(value.to(mesh.device_type), mesh, target.placements, src_data_rank=None).to_local()
        return DTensor.from_local(local.to(target.to_local().device), mesh, target.placements, run_check=False,
                                  shape=target.shape, stride=target.stride())

    return remap_optimizer(plain_optimizer, lambda p: live[names[id(p)]], shard)


def replace_submodule(root: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Put ``new`` wherever ``root`` (or one of its submodules) holds ``old``."""
    # Every name, aliases included (two attributes holding one module): each must point to the new module.
    names = [name for name, module in root.named_modules(remove_duplicate=False) if module is old and name]
    for name in names:
        parent_name, _, attribute = name.rpartition(".")
        setattr(root.get_submodule(parent_name), attribute, new)
    if not names:
        raise ValueError(f"{type(old).__name__} is not a submodule of {type(root).__name__}")


def release_optimizer(optimizer: object) -> None:
    """Drop an optimizer's state and parameter references (it is being replaced), so their memory can go before the
    replacement is built even while someone still holds the object. Handles Lightning's and ZeRO's wrappers."""
    optimizer = unwrapped(optimizer)  # behind Lightning's LightningOptimizer
    for inner in (optimizer, getattr(optimizer, "optim", None)):  # ZeroRedundancyOptimizer's partition optimizer
        if isinstance(inner, torch.optim.Optimizer):
            inner.state.clear()
            for group in inner.param_groups:
                group["params"] = []
    for attribute in ("views", "whole_params"):  # ReplicatedZeroOptimizer's aliases of the parameters
        if isinstance(getattr(optimizer, attribute, None), list):
            getattr(optimizer, attribute).clear()
    for part in getattr(optimizer, "parts", ()):  # SplitZeroOptimizer's two partitioned optimizers
        release_optimizer(part)


def release_model_state(module: nn.Module, optimizers: list[object]) -> None:
    """Drop ``module``'s gradients and every optimizer's state and references (see :func:`release_optimizer`)."""
    for optimizer in {id(o): o for o in optimizers}.values():
        release_optimizer(optimizer)
    for param in module.parameters():
        param.grad = None
