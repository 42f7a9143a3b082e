"""Sharded checkpoints through torch distributed checkpoint (DCP).

A sharded checkpoint is a directory: DCP's files hold the model and optimizer states (each rank writes its own
shards; DCP reshards on load, so a checkpoint of N ranks resumes on M, with any ``sharding``), and ``meta.pt``
holds everything else Lightning saves (loops, callbacks, hyperparameters), written by rank 0 and read with
``weights_only=True``. The directory is written under a temporary name and renamed once complete, so an
interrupted save never replaces an earlier checkpoint with a partial one.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer

META_FILE = "meta.pt"
SHARDED_KEY = "lightning_p2r_sharded"


def is_sharded_checkpoint(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / META_FILE).is_file()


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _is_rank_zero() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def save_sharded(checkpoint: dict[str, Any], path: str | Path, module: nn.Module,
                 optimizers: list[torch.optim.Optimizer]) -> None:
    """Every rank calls this. ``checkpoint`` is Lightning's dict; its model and optimizer entries are replaced by
    the module's and optimizers' own (sharded) states."""
    path = Path(path)
    staging = path.with_name(path.name + ".partial")
    if _is_rank_zero() and staging.exists():
        shutil.rmtree(staging)
    _barrier()
    state: dict[str, Any] = {"model": get_model_state_dict(module)}
    for index, optimizer in enumerate(optimizers):
        state[f"optimizer{index}"] = get_optimizer_state_dict(module, optimizer)
    dcp.save(state, checkpoint_id=str(staging))
    if _is_rank_zero():
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        meta[SHARDED_KEY] = {"optimizers": len(optimizers)}
        torch.save(meta, staging / META_FILE)
        if path.exists():
            previous = path.with_name(path.name + ".previous")
            path.rename(previous)
            staging.rename(path)
            remove(previous)
        else:
            staging.rename(path)
    _barrier()


def load_meta(path: str | Path) -> dict[str, Any]:
    meta = torch.load(Path(path) / META_FILE, map_location="cpu", weights_only=True)
    # Lightning refuses to restore optimizers from a checkpoint without this key; the states come from DCP.
    meta["optimizer_states"] = [None] * meta[SHARDED_KEY]["optimizers"]
    return meta


def load_model_into(module: nn.Module, path: str | Path) -> None:
    """Load the model state of a sharded checkpoint into ``module``, sharded or not (DCP reshards)."""
    state = get_model_state_dict(module)
    dcp.load({"model": state}, checkpoint_id=str(path))
    set_model_state_dict(module, state)


def load_full_model_state(module: nn.Module, state: dict[str, Any], strict: bool) -> None:
    """Load a whole-model state dict (a single-file checkpoint) into ``module``'s shards: each rank keeps its part."""
    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True, strict=strict))


def load_optimizer_into(module: nn.Module, optimizer: torch.optim.Optimizer, index: int, path: str | Path) -> None:
    state = get_optimizer_state_dict(module, optimizer)
    dcp.load({f"optimizer{index}": state}, checkpoint_id=str(path))
    set_optimizer_state_dict(module, optimizer, state)


def load_optimizer_into_replicated(module: nn.Module, optimizer: torch.optim.Optimizer, index: int,
                                   path: str | Path) -> None:
    """Load a sharded checkpoint's optimizer state where every rank holds the whole model: into a plain optimizer,
    or into a ``ZeroRedundancyOptimizer``, which takes the whole state and keeps its own partition."""
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        load_optimizer_into(module, optimizer, index, path)
        return
    # The same groups (each carries its hyperparameters) over the same parameters, as one plain optimizer.
    whole = type(optimizer.optim)([dict(group) for group in optimizer.param_groups])
    load_optimizer_into(module, whole, index, path)
    optimizer.load_state_dict(whole.state_dict())


def full_optimizer_state_by_name(module: nn.Module, optimizer: torch.optim.Optimizer,
                                 state: dict[str, Any]) -> dict[str, Any]:
    """A whole optimizer state dict of torch's own format (parameters numbered in ``optimizer``'s group order, as
    Lightning's single-file checkpoints store it) keyed by parameter name instead, the form DCP's
    ``set_optimizer_state_dict(..., full_state_dict=True)`` shards onto any layout."""
    names = {id(p): name for name, p in module.named_parameters()}
    ordered = [names.get(id(p)) for group in optimizer.param_groups for p in group["params"]]
    saved_groups = state["param_groups"]
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    if [len(g["params"]) for g in saved_groups] != sizes or None in ordered:
        raise ValueError("the checkpoint's optimizer groups do not match this optimizer's (another model or "
                         "optimizer configuration?)")
    name_of_index = {index: ordered[position] for position, index in
                     enumerate(i for group in saved_groups for i in group["params"])}
    return {"state": {name_of_index[index]: value for index, value in state["state"].items()},
            "param_groups": [group | {"params": [name_of_index[i] for i in group["params"]]}
                             for group in saved_groups]}


def load_full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Shard a single-file checkpoint's whole optimizer state onto ``optimizer`` (over FSDP2 shards)."""
    set_optimizer_state_dict(module, optimizer, full_optimizer_state_by_name(module, optimizer, state),
                             options=StateDictOptions(full_state_dict=True))


def remove(path: str | Path) -> None:
    path = Path(path)
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
