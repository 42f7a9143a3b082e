"""The package's one ZeRO-1 (every ``sharding="zero1"`` layout across processes, where FSDP2 holds the model
replicated): torch's ``ZeroRedundancyOptimizer``, which cannot broadcast DTensors, runs over *views*, plain
parameters aliasing each DTensor's local storage, so stepping and broadcasting a partition updates the DTensors in
place. Checkpoints and delinking convert from and to a plain optimizer over the
module's parameters.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from ..sharing import optimizer_constructor_kwargs
from .accounting import local_tensor
from .optimizers import regrouped
from .regather import optimizer_subset, remap_optimizer


def zero_redundancy_optimizer(optimizer: torch.optim.Optimizer,
                              cls: type[ZeroRedundancyOptimizer] = ZeroRedundancyOptimizer,
                              process_group: Any = None, bucketed: bool = False) -> ZeroRedundancyOptimizer:
    """The same optimizer class, groups and settings, with its states partitioned across the ranks of
    ``process_group`` (all of them by default; ``cls``: a subclass of ``ZeroRedundancyOptimizer`` to build).
    ``bucketed``: each rank's parameters packed into one buffer, which moves in one broadcast per rank after a step
    (``parameters_as_bucket_view``); the parameters' ``data`` then point into those buffers."""
    groups = [{k: v for k, v in g.items() if k != "initial_lr"} for g in optimizer.param_groups]
    kwargs = optimizer_constructor_kwargs(optimizer)
    # The first group's settings become the constructor's defaults (ZeroRedundancyOptimizer takes one group).
    kwargs |= {k: v for k, v in groups[0].items() if k in kwargs}
    zero = cls(groups[0]["params"], optimizer_class=type(optimizer), process_group=process_group,
               parameters_as_bucket_view=bucketed, **kwargs)
    for group in groups[1:]:
        zero.add_param_group(group)
    if optimizer.state:
        zero.load_state_dict(optimizer.state_dict())
    return zero


def consolidated_state_dict(optimizer: ZeroRedundancyOptimizer, world_size: int, rank: int) -> dict[str, Any]:
    """The whole state dict of a ``ZeroRedundancyOptimizer`` on this rank, in host memory. Collective: each call of
    ``consolidate_state_dict`` hands the full state to one rank, so every rank calls it once per rank."""
    full: dict[str, Any] = {}
    for target in range(world_size):
        optimizer.consolidate_state_dict(to=target)
        if target == rank:
            full = optimizer.state_dict()
    return full


class ZeroOneOptimizer:
    """What both ZeRO-1 optimizers on FSDP2 offer the engine: plain ``views`` standing for the module's
    ``whole_params`` (the DTensor parameters), gradients linked into the views after every backward, and the whole
    state converted both ways with a plain optimizer over the module's parameters, for checkpoints and delinking:
    ``load_whole_state(optimizer)`` and ``to_module_optimizer()`` (collective)."""

    whole_params: list[nn.Parameter]
    views: list[nn.Parameter]

    def link_grads(self) -> None:
        """Point each view's gradient at the reduced DTensor gradient's local tensor (no copy)."""
        for param, view in zip(self.whole_params, self.views):
            view.grad = None if param.grad is None else local_tensor(param.grad)


def can_share_buckets(params: list[torch.Tensor]) -> bool:
    """Whether ZeRO-1 can pack ``params`` into per-rank buffers that the module's parameters then live in: plain
    tensors of one dtype (DDP's replicas). Without buckets ``ZeroRedundancyOptimizer`` broadcasts each parameter on
    its own after every step, a collective's latency per parameter; a DTensor's local storage belongs to its
    DTensor (FSDP2, tensor parallelism), which no public API can re-point, so those keep one broadcast each."""
    return bool(params) and not any(isinstance(p, DTensor) for p in params) and len({p.dtype for p in params}) == 1


def unpacked(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each tensor that is a view into a larger buffer (a parameter living in ZeRO-1's packed
    partitions) copied into its own host storage, so a checkpoint's tensors are independent, as every other layout
    writes them: safetensors and Hugging Face's ``save_pretrained`` refuse tensors that share a buffer. A tensor
    under two names (a tie) stays one tensor. Host memory, not the device's: a checkpoint must not need a second copy
    of the model where memory is tight."""
    copies: dict[tuple[Any, ...], torch.Tensor] = {}
    result = {}
    for name, value in state.items():
        if isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() > value.numel() * value.element_size():
            where = (value.data_ptr(), tuple(value.shape), tuple(value.stride()), value.dtype)
            if where not in copies:
                copies[where] = value.detach().to("cpu", copy=True)
            value = copies[where]
        result[name] = value
    return result


class ReplicatedZeroOptimizer(ZeroOneOptimizer, ZeroRedundancyOptimizer):
    """A ``ZeroRedundancyOptimizer`` over views of replicated DTensor parameters (build it with :meth:`wrap`), whose
    ``zero_grad`` clears the DTensor gradients too."""

    group_extras: list[dict[str, Any]]
    zero_group: Any

    @classmethod
    def wrap(cls, optimizer: torch.optim.Optimizer, process_group: Any = None) -> ReplicatedZeroOptimizer:
        """The same optimizer class, groups, settings and (whole) state, partitioned across the ranks of
        ``process_group`` (all by default), which must hold the same local part of every parameter (FSDP2's replicate
        layout, over the data ranks of one tensor-parallel position)."""
        whole = [p for group in optimizer.param_groups for p in group["params"]]
        views = {id(p): nn.Parameter(local_tensor(p).detach(), requires_grad=p.requires_grad) for p in whole}
        plain = remap_optimizer(optimizer, lambda p: views[id(p)], lambda value, _: local_tensor(value))
        bucketed = can_share_buckets(whole)
        zero = zero_redundancy_optimizer(plain, cls=cls, process_group=process_group, bucketed=bucketed)
        if bucketed:
            # The module's parameters move into the buckets their views now live in, as ZeRO moved the views:
            # by ``data``, which keeps each parameter's gradient accumulator (the hooks DDP's reducer fires on).
            for param in whole:
                param.data = views[id(param)].data
        zero.zero_group = process_group
        zero.whole_params = whole
        zero.views = [views[id(p)] for p in whole]
        # Group entries the partitioned optimizer does not keep (a scheduler's "initial_lr"), so a checkpoint of
        # this optimizer has the groups of the user's (and loads into any stage's optimizer).
        zero.group_extras = [{k: v for k, v in g.items() if k not in z} for g, z in zip(plain.param_groups,
                                                                                           zero.param_groups)]
        return zero

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for param in getattr(self, "whole_params", ()):  # the parent's constructor may call this before wrap() ends
            param.grad = None

    def load_whole_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Take the whole state and group settings of ``optimizer``, over the DTensor parameters in the same order."""
        index = {id(p): i for i, p in enumerate(self.whole_params)}
        state = {index[id(p)]: {k: local_tensor(v).clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                 for p, s in optimizer.state.items()}
        groups = regrouped(optimizer.param_groups)
        self.load_state_dict({"state": state, "param_groups": groups})
        self.group_extras = [{k: v for k, v in g.items() if k not in mine} for g, mine in zip(groups,
                                                                                               self.param_groups)]

    def to_module_optimizer(self) -> torch.optim.Optimizer:
        """A plain optimizer over the module's parameters with the whole state (collective, see below)."""
        return to_module_optimizer(self, dist.get_world_size(self.zero_group), dist.get_rank(self.zero_group))


def to_module_optimizer(optimizer: ReplicatedZeroOptimizer, world_size: int, rank: int) -> torch.optim.Optimizer:
    """A plain optimizer of the same class, settings and groups over the module's DTensor parameters, with the whole
    state gathered into host memory. Collective over the optimizer's process group (``world_size``, ``rank``)."""
    full = consolidated_state_dict(optimizer, world_size, rank)
    params = optimizer.whole_params  # numbered as the views are, in group order
    groups = [extras | {k: v for k, v in g.items() if k != "params"} | {"params": [params[i] for i in g["params"]]}
              for g, extras in zip(full["param_groups"], optimizer.group_extras)]
    result = type(optimizer.optim)(groups, **optimizer_constructor_kwargs(optimizer.optim))
    for i, state in full["state"].items():
        result.state[params[i]] = {k: _like(params[i], v) for k, v in state.items()}
    return result


def _like(param: torch.Tensor, value: Any) -> Any:
    """A state tensor of a view laid out as its DTensor parameter (the parameter's local part, on its mesh), so a
    sharded checkpoint stores it whole like the parameter; other values (Adam's step count) as they are."""
    if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.shape == param.to_local().shape \
            and value.dim() > 0:
        return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return value


def partition_optimizer_states(optimizers: list[torch.optim.Optimizer], process_group: Any = None, *,
                               expert_group: Any = None, experts: set[int] | None = None) -> torch.optim.Optimizer:
    """The strategy's one optimizer as a :class:`ReplicatedZeroOptimizer` over ``process_group`` (all ranks by default),
    or, given ``expert_group``, a :class:`SplitZeroOptimizer` partitioning the ``experts`` (ids) over it."""
    if len(optimizers) != 1:
        raise ValueError(f"P2RStrategy(sharding='zero1') on FSDP2 supports one optimizer, got {len(optimizers)}")
    if expert_group is not None:
        return SplitZeroOptimizer.wrap(optimizers[0], process_group, expert_group, experts or set())
    return ReplicatedZeroOptimizer.wrap(optimizers[0], process_group)


class _LinkedGroup(dict):
    """One of the user's parameter groups spread over two partitioned optimizers (dense weights, experts): its
    ``params`` are both parts' views, and a setting written to it (a scheduler's learning rate) is written to both
    parts' groups, which their ``step`` reads."""

    def __init__(self, parts: list[dict[str, Any]]) -> None:
        super().__init__({k: v for k, v in parts[0].items() if k != "params"})
        self.parts = parts
        dict.__setitem__(self, "params", [p for part in parts for p in part["params"]])

    def __setitem__(self, key: str, value: Any) -> None:
        dict.__setitem__(self, key, value)
        if key != "params":
            for part in self.parts:
                part[key] = value


class SplitZeroOptimizer(ZeroOneOptimizer, torch.optim.Optimizer):
    """ZeRO-1 under expert parallelism: the dense weights are held alike by every data rank, the experts only by the
    ranks holding the same experts, so two :class:`ReplicatedZeroOptimizer` partition them over two groups behind the
    one optimizer Lightning steps. Its ``param_groups`` are the user's groups (a scheduler drives both parts through
    them). Build it with :meth:`wrap`."""

    @classmethod
    def wrap(cls, optimizer: torch.optim.Optimizer, dense_group: Any, expert_group: Any,
             experts: set[int]) -> SplitZeroOptimizer:
        """``experts``: ids of the parameters partitioned over ``expert_group`` (the rest over ``dense_group``)."""
        parts, slots = [], []
        for expert_part, group in ((False, dense_group), (True, expert_group)):
            kept = [(i, [p for p in g["params"] if (id(p) in experts) == expert_part])
                    for i, g in enumerate(optimizer.param_groups)]
            kept = [(i, params) for i, params in kept if params]
            if not kept:
                continue
            subset = optimizer_subset(optimizer, kept)
            parts.append(ReplicatedZeroOptimizer.wrap(subset, group))
            slots.append([i for i, _ in kept])
        zero = cls.__new__(cls)
        torch.optim.Optimizer.__init__(zero, [v for part in parts for v in part.views], dict(optimizer.defaults))
        zero.parts, zero.slots = parts, slots
        zero.order = [list(g["params"]) for g in optimizer.param_groups]  # the user's parameters, in order
        zero.param_groups = [_LinkedGroup([part.param_groups[slot.index(i)] for part, slot in zip(parts, slots)
                                           if i in slot]) for i in range(len(optimizer.param_groups))]
        return zero

    @property
    def whole_params(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.whole_params]

    @property
    def views(self) -> list[nn.Parameter]:
        return [v for part in self.parts for v in part.views]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts:
            part.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in getattr(self, "parts", ()):
            part.zero_grad(set_to_none)

    def load_whole_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Take the whole state and settings of ``optimizer``, over the module's parameters in the user's groups."""
        for part, slot in zip(self.parts, self.slots):
            mine = {id(p) for p in part.whole_params}
            kept = [(i, [p for p in optimizer.param_groups[i]["params"] if id(p) in mine]) for i in slot]
            part.load_whole_state(optimizer_subset(optimizer, kept))

    def to_module_optimizer(self) -> torch.optim.Optimizer:
        """One plain optimizer over the module's parameters in the user's groups and order, with the whole state
        (collective over both parts' process groups)."""
        plains = [part.to_module_optimizer() for part in self.parts]
        settings = {}
        for plain, slot in zip(plains, self.slots):
            for index, group in zip(slot, plain.param_groups):
                settings.setdefault(index, {k: v for k, v in group.items() if k != "params"})
        first = plains[0]
        result = type(first)([settings[i] | {"params": list(params)} for i, params in enumerate(self.order)],
                             **optimizer_constructor_kwargs(first))
        for plain in plains:
            result.state.update(plain.state)
        return result
