"""The job's process group, through torch.distributed's public API: started from Lightning's cluster environment
(its launcher, torchrun or SLURM decide the ranks), and the collectives Lightning asks a strategy for (a barrier,
broadcasting an object, reducing a logged value)."""

from __future__ import annotations

import atexit
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_info


def started() -> bool:
    return dist.is_available() and dist.is_initialized()


def default_backend(device: torch.device) -> str:
    """NCCL for CUDA devices, gloo for the host (torch's own pairing)."""
    return "nccl" if device.type == "cuda" else "gloo"


def start_process_group(environment: ClusterEnvironment, backend: str, timeout: timedelta | None,
                        device: torch.device) -> None:
    """Join the job's process group (once per process: a second call returns)."""
    if started():
        return
    os.environ["MASTER_ADDR"] = environment.main_address
    os.environ["MASTER_PORT"] = str(environment.main_port)
    kwargs: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
    if device.type != "cpu":
        kwargs["device_id"] = device  # binds NCCL's communicators to this rank's device up front
    dist.init_process_group(backend, rank=environment.global_rank(), world_size=environment.world_size(), **kwargs)
    if backend == "nccl":  # torch warns about an NCCL group left alive at exit
        atexit.register(stop_process_group)
    rank_zero_info(f"P2RStrategy: {environment.world_size()} processes joined ({backend})")


def stop_process_group() -> None:
    if started():
        dist.destroy_process_group()


def wait_for_every_rank(device: torch.device) -> None:
    if not started():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not started():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


def reduce_in_place(tensor: torch.Tensor, group: Any = None, reduce_op: Any = "mean") -> torch.Tensor:
    """All-reduce ``tensor`` in place over ``group`` (every rank by default), as Lightning's own strategies do for a
    logged value: ``reduce_op`` a ``ReduceOp`` or its name; "mean"/"avg" sums and divides where the backend (gloo)
    has no average."""
    if not started():
        return tensor
    group = dist.group.WORLD if group is None else group
    divide = False
    op = reduce_op
    if reduce_op is None:
        op = dist.ReduceOp.SUM
    elif isinstance(reduce_op, str):
        name = "avg" if reduce_op.lower() == "mean" else reduce_op.lower()
        if name == "avg" and dist.get_backend(group) == "gloo":
            op, divide = dist.ReduceOp.SUM, True
        else:
            op = getattr(dist.ReduceOp, name.upper())
    # No barrier first (Lightning's ``_sync_ddp`` has one): the all-reduce itself waits for every rank, and on
    # CUDA it is ordered after the work that produced ``tensor``; a barrier was one more blocking round trip per
    # call, and the loss's finiteness check calls this every micro-batch.
    dist.all_reduce(tensor, op=op, group=group)
    if not divide:
        return tensor
    size = dist.get_world_size(group)
    return tensor.copy_(tensor / size) if not torch.is_floating_point(tensor) else tensor.div_(size)
