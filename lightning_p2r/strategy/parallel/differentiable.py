"""The two differentiable collectives expert parallelism needs, over torch.distributed's public collectives:
torch.distributed.nn.functional is deprecated in torch 2.13, its replacement private, and both return views, which
FSDP2 warns about when they leave a unit.

A small sum over a gloo group (the balance loss's few bytes per MoE layer and micro-batch) is an all-gather and a
local sum: gloo's all-reduce of a few dozen elements took 1.1-2.0 ms per call on a 2-vCPU machine, its all-gather
0.3-0.6 ms (2026-11-30, docs/benchmarks.md "Fewer and cheaper small collectives"). Every rank sums the same
gathered rows in the same order, so the ranks agree bit for bit, and on two ranks the sum is the all-reduce's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        # The rows travel back the way they came: what was sent to rank j is the gradient rank j returns.
        dist.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


GATHERED_SUM_BYTES = 64 << 10
"""Sums over a gloo group up to this size are gathered and added locally (see the module docstring)."""
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13


def gathers_to_sum(tensor: torch.Tensor, group: Any) -> bool:
    """Whether :func:`sum_over` sums ``tensor`` over ``group`` by an all-gather: a small tensor on gloo."""
    return (tensor.numel() * tensor.element_size() <= GATHERED_SUM_BYTES
            and dist.get_backend(group) == dist.Backend.GLOO)


def sum_over(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """``tensor`` summed over ``group``, in a new tensor (not differentiable: :func:`all_reduce_sum` is)."""
    if gathers_to_sum(tensor, group):
        ranks = dist.get_world_size(group)
        rows = tensor.new_empty(ranks * tensor.numel())  # gloo gathers into the inputs' concatenation
        _gather_into(rows, tensor.reshape(-1).contiguous(), group=group)
        return rows.view(ranks, *tensor.shape).sum(dim=0)
    out = tensor.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return sum_over(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # Every rank's output depends on every rank's input: the input's gradient sums the ranks' gradients.
        return sum_over(grad, ctx.group), None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    """Rows of ``x`` sent over ``group`` (``in_splits[j]`` to rank j, ``out_splits[j]`` from it); backward: reversed."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def all_reduce_sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of ``x`` over ``group``, differentiable (backward sums the ranks' gradients)."""
    return _AllReduceSum.apply(x, group)
