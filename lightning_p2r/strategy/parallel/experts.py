"""Expert parallelism (DeepSpeed-MoE, M6-10T) and tensor-parallel experts, applied to an M6 MoE layer from outside
(docs/parallelism.md). The layer routes its own tokens (routing and drops are one process's); :class:`ParallelExperts`
sends each row to its expert's rank and back, and :class:`ParallelMoE` balances over every data rank's tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from ...models.moe import Experts, MoEFeedForward, balance_loss_from_means, expert_mlps
from ..accounting import local_tensor
from .differentiable import all_reduce_sum, all_to_all


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


class ParallelExperts(Experts):
    """:class:`Experts` split over expert-parallel ranks (by expert) and tensor-parallel ranks (by hidden unit)."""

    expert_group: Any
    """The all-to-all's process group (None without expert parallelism)."""
    tp_mesh: Any
    """The tensor-parallel mesh (None without tensor parallelism)."""
    gradient_scale: float
    """1 / expert_parallel: through the all-to-all an expert's gradient sums its expert group's tokens, while FSDP2
    averages it only over the ranks holding the same expert. (FSDP2's ``set_gradient_divide_factor`` would do it in
    the reduction, but needs a reduce op gloo lacks.)"""

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: (rows, dim) sorted by global expert, ``counts[e]`` rows for expert e, rows past their sum dropped ->
        (rows, dim) in the same order, dropped rows zero."""
        w_in, w_out = local_tensor(self.w_in), local_tensor(self.w_out)
        if self.gradient_scale != 1.0:
            w_in, w_out = (_ScaleGradient.apply(w, self.gradient_scale) for w in (w_in, w_out))
        if self.expert_group is None:
            return owned(self._compute(x, counts, w_in, w_out))
        ranks = dist.get_world_size(self.expert_group)
        local_experts = w_in.shape[0]
        device = x.device
        # The counts first (each rank learns how many rows it receives for each of its experts from each source).
        # The all-to-all takes its splits as host integers: the one place an expert-parallel layer syncs.
        send = counts.to(dtype=torch.long)
        received = torch.empty(ranks * local_experts, dtype=torch.long, device=device)
        dist.all_to_all_single(received, send, group=self.expert_group)
        counts_list = send.tolist()
        received = received.cpu().view(ranks, local_experts)  # (source rank, local expert)
        send_splits = rank_splits(counts_list, ranks)
        recv_splits = received.sum(dim=1).tolist()
        total = sum(counts_list)
        rows = all_to_all(x[:total], recv_splits, send_splits, self.expert_group)
        order = expert_major_order(received).to(device)
        # The received counts feed the expert kernel as they are (grouped GEMM offsets, or the loop's segments).
        out = self._compute(rows.index_select(0, order), received.sum(dim=0).to(device), w_in, w_out)
        out = out.index_select(0, torch.argsort(order))  # source-major again, as the rows arrived
        out = all_to_all(out, send_splits, recv_splits, self.expert_group)
        if total < x.shape[0]:  # the dropped rows past the kept ones: zero, as the experts give them
            out = torch.cat([out, out.new_zeros(x.shape[0] - total, out.shape[1])])
        return out

    def _compute(self, x: torch.Tensor, counts: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor
                 ) -> torch.Tensor:
        if self.tp_mesh is not None:
            x = copy_to_tensor_parallel(x, self.tp_mesh)
        out = expert_mlps(x, counts, w_in, w_out, kernel=self.kernel)
        if self.tp_mesh is not None:
            out = reduce_from_tensor_parallel(out, self.tp_mesh)
        return out


class ParallelMoE(MoEFeedForward):
    """:class:`MoEFeedForward` whose load-balancing loss counts every data-parallel rank's tokens."""

    data_group: Any
    """The process group of the ranks that see different batches (None: this process's tokens only)."""

    def balance_loss(self, probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.data_group is None:
            return super().balance_loss(probs, counts)
        counts = counts.clone()
        dist.all_reduce(counts, group=self.data_group)  # not differentiable: the fractions are counts
        tokens = torch.tensor([float(probs.shape[0])], device=probs.device)
        dist.all_reduce(tokens, group=self.data_group)
        # Summed with a differentiable all-reduce: its backward sums every rank's gradient for this rank's
        # probabilities, which the data-parallel gradient average then divides back to one process's gradient.
        prob_sum = all_reduce_sum(probs.sum(dim=0), self.data_group)
        return balance_loss_from_means(prob_sum / tokens, counts)


def parallelize_experts(moe: MoEFeedForward, *, expert_tensor_mesh: Any, expert_group: Any, tp_mesh: Any,
                        data_group: Any) -> None:
    """Switch one MoE layer to :class:`ParallelMoE`, its experts to :class:`ParallelExperts` (groups None: off)."""
    experts = moe.experts
    for name, hidden_dim in (("w_in", 2), ("w_out", 1)):
        param = getattr(experts, name)
        placed = distribute_tensor(param.data, expert_tensor_mesh, [Shard(0), Shard(hidden_dim)], src_data_rank=None)
        setattr(experts, name, nn.Parameter(placed, requires_grad=param.requires_grad))
    experts.__class__ = ParallelExperts
    experts.expert_group, experts.tp_mesh = expert_group, tp_mesh
    experts.gradient_scale = 1.0 / dist.get_world_size(expert_group) if expert_group is not None else 1.0
    moe.__class__ = ParallelMoE
    moe.data_group = data_group
