"""Gradient-norm clipping over parameters placed on several device meshes.

``torch.nn.utils.clip_grad_norm_`` stacks the per-tensor norms, and DTensors on different meshes cannot be stacked:
under tensor / expert parallelism the dense weights live on the (data, tensor) mesh, the experts on the (expert
data, expert, tensor) mesh and the norms on the data mesh alone. So the norm is taken per mesh (each a DTensor
reduction over its own ranks, made whole), the per-mesh norms combine into the global one, and every gradient is
scaled by the same factor, as on one process.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def total_grad_norm(params: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all the gradients of ``params`` together, the same on every rank (collective per mesh)."""
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for param in params:
        if param.grad is not None:
            key = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            by_mesh.setdefault(key, []).append(param.grad)
    norms = []
    # Every rank holds parameters on the same meshes, in the same order (the model's), so the per-mesh collectives
    # run in the same order everywhere.
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float().cpu())
    if not norms:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(norms, norm_type)


def clip_grad_norm_across_meshes(params: Iterable[torch.Tensor], max_norm: float,
                                 norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients of ``params`` so their total norm is at most ``max_norm``; returns the norm before."""
    params = [p for p in params if p.grad is not None]
    total = total_grad_norm(params, norm_type)
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    with torch.no_grad():
        for param in params:
            param.grad.mul_(scale.to(param.grad.device))
    return total
