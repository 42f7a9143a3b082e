"""Expert parallelism (DeepSpeed-MoE, M6-10T) and tensor-parallel experts, applied from outside to whatever expert
modules a model declares (``protocols.StackedExperts``: the package's own, a user's and Hugging Face's alike;
docs/parallelism.md). The MoE layer routes its own tokens (routing and drops are one process's); :class:`ExpertDispatch`
becomes the expert module's ``forward``: it sends each assignment to the rank holding its expert, runs the module's own
``forward`` on this rank's experts there, and sends the outputs back.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from ...protocols import StackedExperts
from ..accounting import local_tensor
from .differentiable import all_to_all


def owned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, copied when it is a view (``DTensor.to_local`` returns one): FSDP2 warns about a view leaving a unit
    with a gradient (an in-place op on it would skip the unit's pre-backward hook)."""
    return tensor.clone() if tensor._base is not None and torch.is_grad_enabled() else tensor


def copy_to_tensor_parallel(x: torch.Tensor, tp_mesh: Any) -> torch.Tensor:
    """Megatron's f: identity forward; the backward sums the ranks' partial input gradients."""
    return DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def reduce_from_tensor_parallel(x: torch.Tensor, tp_mesh: Any) -> torch.Tensor:
    """Megatron's g: all-reduce the partial outputs forward; the backward passes the (replicated) gradient on."""
    partial = DTensor.from_local(x, tp_mesh, [Partial()], run_check=False)
    return partial.redistribute(tp_mesh, [Replicate()]).to_local()


def rank_splits(counts: list[int], ranks: int) -> list[int]:
    """Rows for each expert-parallel rank, from the rows per global expert (rank j holds the j-th slice of them)."""
    per_rank = len(counts) // ranks
    return [sum(counts[j * per_rank:(j + 1) * per_rank]) for j in range(ranks)]


def expert_major_order(received: torch.Tensor) -> torch.Tensor:
    """The permutation that turns rows received source-major (for each source rank, its rows for each local
    expert, ``received[s, e]`` of them) into expert-major order (every source's rows for expert 0, then for 1...)."""
    sources, experts = received.shape
    pieces = torch.arange(int(received.sum())).split(received.reshape(-1).tolist())  # source-major, as received
    return torch.cat([pieces[s * experts + e] for e in range(experts) for s in range(sources)])


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``scale`` in backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class ExpertDispatch:
    """The ``forward`` of an expert module split over expert-parallel ranks (by expert) and tensor-parallel ranks (by
    hidden unit, or by expert where the weights declare no hidden-unit dimension). It runs the module's own
    ``forward`` on a stand-in that holds this rank's experts as plain tensors (``DTensor`` indexing would gather
    them), so any module declared as :class:`StackedExperts` can be split."""

    def __init__(self, module: nn.Module, declared: StackedExperts, expert_group: Any, tp_mesh: Any,
                 local_experts: int) -> None:
        self.declared, self.expert_group, self.tp_mesh = declared, expert_group, tp_mesh
        self.tp_experts_from = None
        """Under tensor parallelism by expert: the first of this rank's experts among its expert-parallel rank's."""
        if tp_mesh is not None and declared.splits_by_expert_over_tensor_parallel:
            self.tp_experts_from = tp_mesh.get_local_rank() * local_experts
        self.gradient_scale = 1.0 / dist.get_world_size(expert_group) if expert_group is not None else 1.0
        """1 / expert_parallel: through the all-to-all an expert's gradient sums its expert group's tokens, while
        FSDP2 averages it only over the ranks holding the same expert. (FSDP2's ``set_gradient_divide_factor``
        would do it in the reduction, but needs a reduce op gloo lacks.)"""
        self.module = module
        self.local_experts = local_experts
        """How many of the module's experts this rank holds and runs."""
        self.exchanged_experts = local_experts * (tp_mesh.size() if self.tp_experts_from is not None else 1)
        """How many experts the expert-parallel exchange sends this rank's group rows for: its own, or, split by
        expert over tensor parallelism too, those of every tensor-parallel rank beside it."""
        # The stand-in: the module's attributes, its own parameter table (filled at each call, the declared weights
        # as local tensors), and this rank's number of experts.
        self._stand_in = copy.copy(module)
        self._stand_in._parameters = {}
        for name in declared.counts:
            setattr(self._stand_in, name, local_experts)
        self._forward = type(module).forward

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.declared.call == "sorted":
            return self._sorted(*args, **kwargs)
        return self._top_k(*args, **kwargs)

    # -------------------------------------------------------------------------------------------- the two calls
    def _sorted(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: (rows, dim) sorted by global expert, ``counts[e]`` rows for expert e, rows past their sum dropped ->
        (rows, dim) in the same order, dropped rows zero."""
        if self.expert_group is None:
            return owned(self._local(x, counts, None))
        total = int(counts.sum())
        out = self._exchange(x[:total], counts, None)
        if total < x.shape[0]:  # the dropped rows past the kept ones: zero, as the experts give them
            out = torch.cat([out, out.new_zeros(x.shape[0] - total, out.shape[1])])
        return out

    def _top_k(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden (tokens, dim), each token's experts and gate weights (tokens, k) -> (tokens, dim): the gate-weighted
        sum of its experts' outputs."""
        if self.expert_group is None:
            return owned(self._local(hidden, top_k_index, top_k_weights))
        experts = top_k_index.reshape(-1)
        order = torch.argsort(experts, stable=True)  # assignments sorted by expert
        token_of = order // top_k_index.shape[1]
        counts = torch.bincount(experts, minlength=dist.get_world_size(self.expert_group) * self.exchanged_experts)
        out = self._exchange(hidden.index_select(0, token_of), counts, top_k_weights.reshape(-1)[order])
        return torch.zeros_like(hidden).index_add(0, token_of, out.to(hidden.dtype))

    # ------------------------------------------------------------------------------------------------ the parts
    def _exchange(self, rows: torch.Tensor, counts: torch.Tensor, gates: torch.Tensor | None) -> torch.Tensor:
        """Rows sorted by global expert (``counts`` per expert; ``gates``: each row's gate weight, "top_k") to their
        experts' ranks, through the local experts, and back -> one output row per input row, in the same order."""
        group = self.expert_group
        ranks, local_experts = dist.get_world_size(group), self.exchanged_experts
        device = rows.device
        # The counts first (each rank learns how many rows it receives for each of its experts from each source).
        # The all-to-all takes its splits as host integers: the one place an expert-parallel layer syncs.
        send = counts.to(dtype=torch.long)
        received = torch.empty(ranks * local_experts, dtype=torch.long, device=device)
        dist.all_to_all_single(received, send, group=group)
        received = received.cpu().view(ranks, local_experts)  # (source rank, local expert)
        send_splits = rank_splits(send.tolist(), ranks)
        recv_splits = received.sum(dim=1).tolist()
        payload = rows if gates is None else torch.cat([rows, gates.to(rows.dtype).unsqueeze(-1)], dim=-1)
        moved = all_to_all(payload, recv_splits, send_splits, group)
        order = expert_major_order(received).to(device)
        moved = moved.index_select(0, order)
        local_counts = received.sum(dim=0).to(device)
        if gates is None:
            out = self._local(moved, local_counts, None)
        else:  # each received row is one assignment: its local expert, and its gate weight as a (rows, 1) top-1
            index = torch.repeat_interleave(torch.arange(local_experts, device=device), local_counts).unsqueeze(-1)
            out = self._local(moved[:, :-1], index, moved[:, -1:])
        out = out.index_select(0, torch.argsort(order))  # source-major again, as the rows arrived
        return all_to_all(out, send_splits, recv_splits, group)

    def _local(self, x: torch.Tensor, index: torch.Tensor, gates: torch.Tensor | None) -> torch.Tensor:
        """The module's own forward over this rank's experts (inputs whole on every tensor-parallel rank; the
        partial outputs of a hidden-unit split summed)."""
        # The module's parameters as they are now (FSDP2 swaps them around each call), the declared ones local.
        table = dict(self.module._parameters)
        for name in self.declared.weights:
            weight = local_tensor(table[name])
            table[name] = _ScaleGradient.apply(weight, self.gradient_scale) if self.gradient_scale != 1.0 else weight
        self._stand_in._parameters = table
        if self.tp_mesh is not None:
            x = copy_to_tensor_parallel(x, self.tp_mesh)
            gates = copy_to_tensor_parallel(gates, self.tp_mesh) if gates is not None else None
        try:
            if gates is None:
                out = self._forward(self._stand_in, x, index)
            elif self.tp_experts_from is not None:
                out = self._own_experts_only(x, index, gates)
            else:
                out = self._forward(self._stand_in, x, index, gates)
        finally:  # the stand-in keeps no activation-bearing tensors between calls
            self._stand_in._parameters = {}
        if self.tp_mesh is not None:
            out = reduce_from_tensor_parallel(out, self.tp_mesh)
        return out


    def _own_experts_only(self, x: torch.Tensor, index: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """Tensor parallelism by expert ("top_k"): of the (tokens, k) assignments to the expert-parallel rank's
        experts, run those of this tensor-parallel rank's share as top-1 rows -> this rank's partial output per
        token (zero for the others' experts), which the caller sums over the ranks."""
        k = index.shape[1]
        flat = index.reshape(-1)
        first = self.tp_experts_from
        # Which assignments are this rank's: a host-side count, as the expert-parallel exchange's split sizes are.
        mine = torch.nonzero((flat >= first) & (flat < first + self.local_experts)).squeeze(1)
        token = torch.div(mine, k, rounding_mode="floor")
        rows = self._forward(self._stand_in, x.index_select(0, token), (flat.index_select(0, mine) - first)
                             .unsqueeze(1), gates.reshape(-1).index_select(0, mine).unsqueeze(1))
        return torch.zeros_like(x).index_add(0, token, rows.to(x.dtype))


def expert_dispatch(module: nn.Module) -> ExpertDispatch | None:
    """The :class:`ExpertDispatch` a split expert module runs, or None."""
    found = vars(module).get("forward")
    return found if isinstance(found, ExpertDispatch) else None


def parallelize_experts(module: nn.Module, declared: StackedExperts, *, expert_tensor_mesh: Any, expert_group: Any,
                        tp_mesh: Any) -> None:
    """Split one declared expert module (groups None: off): its stacked weights become DTensors on the ("ep", "tp")
    mesh, by expert and by hidden unit (or by expert on both), and its ``forward`` an :class:`ExpertDispatch`."""
    ranks = dist.get_world_size(expert_group) if expert_group is not None else 1
    first = getattr(module, next(iter(declared.weights)))
    # Tensor parallelism splits every expert's hidden units, or, where a weight declares none (gate and up packed),
    # gives each tensor-parallel rank whole experts: a share of its expert-parallel rank's (Shard(0) on both).
    by_expert = tp_mesh is not None and declared.splits_by_expert_over_tensor_parallel
    for name, hidden_dim in declared.weights.items():
        param = getattr(module, name)
        inner = Shard(0) if by_expert else Shard(hidden_dim) if hidden_dim is not None else Replicate()
        placed = distribute_tensor(param.data, expert_tensor_mesh, [Shard(0), inner], src_data_rank=None)
        setattr(module, name, nn.Parameter(placed, requires_grad=param.requires_grad))
    local = first.shape[0] // ranks // (tp_mesh.size() if by_expert else 1)
    dispatch = ExpertDispatch(module, declared, expert_group, tp_mesh, local)
    vars(module)["forward"] = dispatch  # an instance attribute: nn.Module.__call__ runs it, hooks included
