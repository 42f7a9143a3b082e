"""Gradient-norm clipping over parameters placed on several device meshes, which ``clip_grad_norm_`` cannot stack.
Each rank sums ``|g|^p`` over its local parts, each divided by the number of ranks holding the same part, and one
all-reduce over all ranks gives the global sum (DTensor would run one all-reduce per mesh dimension in sequence).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from ..accounting import local_tensor


def ranks_holding(grad: torch.Tensor) -> int:
    """How many ranks hold the same local part of ``grad`` (all of them for a plain tensor)."""
    if not isinstance(grad, DTensor):
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    mesh = grad.device_mesh
    replicated = math.prod(mesh.size(i) for i, placement in enumerate(grad.placements)
                           if isinstance(placement, Replicate))
    # A parameter on a sub-mesh (a norm weight on the data ranks only) is repeated on each of the other slices of
    # the world (the tensor-parallel ranks), which its own placements do not show.
    return replicated * dist.get_world_size() // mesh.size()


def total_grad_norm(params: Iterable[torch.Tensor], norm_type: float = 2.0,
                    copies: Callable[[torch.Tensor], int] | None = None) -> torch.Tensor:
    """The ``norm_type`` norm of all the gradients of ``params``, the same on every rank (collective, any order).
    ``copies(param)``: the ranks holding the same local part of its gradient, where the layout knows better than the
    mesh (pipeline stages). Each group of parts (by device and holders) is reduced by one fused kernel."""
    inf = math.isinf(norm_type)
    groups: dict[tuple[torch.device, int], list[torch.Tensor]] = {}
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        part = local_tensor(grad).detach()
        if part.numel():
            held = 1 if inf else copies(param) if copies is not None else ranks_holding(grad)
            groups.setdefault((part.device, held), []).append(part)
    # NCCL reduces device tensors only (an offloaded gradient lives on the host).
    distributed = dist.is_available() and dist.is_initialized()
    nccl = distributed and dist.get_backend() == "nccl"
    where = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    local = torch.zeros((), dtype=torch.float64, device=where)
    for (_, held), parts in groups.items():
        # A low-precision gradient's own norm is reduced into fp32 first (torch's fused norm would round it to the
        # gradient's dtype, bf16's 3 digits); the group norms are summed in fp64.
        wide = [part if part.dtype.itemsize >= 4 else torch.linalg.vector_norm(part, norm_type, dtype=torch.float32)
                for part in parts]
        norm = get_total_norm(wide, norm_type).to(where, torch.float64)
        local = torch.maximum(local, norm) if inf else local + norm.pow(norm_type) / held
    if distributed:
        dist.all_reduce(local, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
    return (local if inf else local.pow(1.0 / norm_type)).float().cpu()


def clip_grad_norm_across_meshes(params: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                                 copies: Callable[[torch.Tensor], int] | None = None) -> torch.Tensor:
    """Scale the gradients of ``params`` so their total norm is at most ``max_norm``; returns the norm before."""
    params = [p for p in params if p.grad is not None]
    total = total_grad_norm(params, norm_type, copies)
    # By gradient device and mesh: torch's clipping scales each call's gradients with one fused kernel, which takes
    # DTensors of one mesh only.
    grouped: dict[tuple[torch.device, int | None], list[torch.Tensor]] = {}
    for param in params:
        mesh = id(param.grad.device_mesh) if isinstance(param.grad, DTensor) else None
        grouped.setdefault((param.grad.device, mesh), []).append(param)
    for group in grouped.values():
        clip_grads_with_norm_(group, max_norm, total.to(group[0].grad.device))
    return total
