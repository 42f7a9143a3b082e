"""Sharded checkpoints through torch distributed checkpoint (DCP): a directory whose DCP files hold the model and
optimizer states (resharded on load: N ranks resume on M, with any ``sharding``) and ``meta.pt`` everything else
Lightning saves. It is written under a hidden name, then the checkpoint path, a symbolic link, is switched to it
atomically: an interrupted save never replaces an earlier checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..files import replaced_atomically
from .checkpoint_integrity import META_FILE, check_integrity
from .ties import find_ties

SHARDED_KEY = "lightning_p2r_sharded"


def is_sharded_checkpoint(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / META_FILE).is_file()


class AtomicCheckpointIO(TorchCheckpointIO):
    """Single-file checkpoints written under a hidden temporary name beside their destination (never matching
    ``last*.ckpt``), flushed and renamed over it: a process killed mid-save leaves the previous file intact.
    (Lightning's own temporary file in the system temp folder is copied, non-atomically, across file systems.)"""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")
        with open(partial, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        partial.replace(path)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _is_rank_zero() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def save_sharded(checkpoint: dict[str, Any], path: str | Path, module: nn.Module,
                 optimizers: list[torch.optim.Optimizer]) -> None:
    """Every rank calls this: Lightning's ``checkpoint`` with the module's and optimizers' own (sharded) states, in a
    hidden sibling directory (``.<name>.<step>``) that ``path`` links to once complete (see the module docstring)."""
    path = Path(path)
    current = path.resolve() if path.is_symlink() else None
    target = path.with_name(f".{path.name}.{checkpoint.get('global_step', 0)}")
    if current is not None and current.name == target.name:  # saved again at the same step: alternate
        target = target.with_name(target.name + "b")
    if _is_rank_zero():  # hidden state directories no link points to: left by an interrupted save
        for stale in path.parent.glob(f".{path.name}.*"):
            if stale.is_dir() and (current is None or stale.resolve() != current):
                shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    ties = every_ranks_ties(module)
    state: dict[str, Any] = {"model": without_aliases(get_model_state_dict(module), ties)}
    for index, optimizer in enumerate(optimizers):
        state[f"optimizer{index}"] = every_ranks_group_names(get_optimizer_state_dict(module, optimizer))
    dcp.save(state, checkpoint_id=str(target))
    if _is_rank_zero():
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        # Tied names stored once: read_model_state and to_single_file give the other names back from this list.
        meta[SHARDED_KEY] = {"optimizers": len(optimizers), "ties": ties}
        torch.save(meta, target / META_FILE)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)  # a checkpoint directory of an earlier version of this function: replaced
        link = path.with_name(f".{path.name}.link")
        link.unlink(missing_ok=True)
        link.symlink_to(target.name)  # relative: the checkpoint folder can be moved or copied whole
        link.replace(path)
        if current is not None:
            shutil.rmtree(current, ignore_errors=True)
    _barrier()


def every_ranks_group_names(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (keyed by parameter name) with each group listing every rank's parameters (collective): DCP stores
    rank 0's groups, and a single-file conversion of pipeline stages must number the other ranks' states too."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return state
    names = [list(group["params"]) for group in state["param_groups"]]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, names)
    if any(len(rank_names) != len(names) for rank_names in gathered):
        return state  # ranks with other groups: nothing to merge by position
    for index, group in enumerate(state["param_groups"]):
        group["params"] = list(dict.fromkeys(name for rank_names in gathered for name in rank_names[index]))
    return state


def load_meta(path: str | Path) -> dict[str, Any]:
    meta = torch.load(Path(path) / META_FILE, map_location="cpu", weights_only=True)
    # Lightning refuses to restore optimizers from a checkpoint without this key; the states come from DCP.
    meta["optimizer_states"] = [None] * meta[SHARDED_KEY]["optimizers"]
    return meta


@contextlib.contextmanager
def _one_process_dcp() -> Iterator[None]:
    """DCP warns on every load without a process group that it assumes one process: what these loads ask for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _dcp_load(state: dict[str, Any], path: str | Path) -> None:
    """``dcp.load`` of ``state`` from ``path``. A one-process run on the local engine has no process group: DCP then
    loads in one process, as asked, and its warning that it assumes so ("torch.distributed is disabled ...") is
    dropped, as ``read_model_state`` drops it; every sharded checkpoint resumed with sharding none/zero1 printed it
    until 2026-12-02."""
    if dist.is_available() and dist.is_initialized():
        dcp.load(state, checkpoint_id=str(path))
        return
    with _one_process_dcp():
        dcp.load(state, checkpoint_id=str(path), no_dist=True)


def load_model_into(module: nn.Module, path: str | Path) -> None:
    """Load the model state of a sharded checkpoint into ``module``, sharded or not (DCP reshards)."""
    state = get_model_state_dict(module)
    ties = find_ties(module)
    stored = without_aliases(state, ties)  # a tied parameter is read once, under its first name
    _dcp_load({"model": stored}, path)
    set_model_state_dict(module, with_aliases(stored, ties))


def every_ranks_ties(module: nn.Module) -> list[list[str]]:
    """The ties of every rank's part of ``module`` (collective): a pipeline's last rank holds a tied head and its
    embedding, the first rank the embedding only, and rank 0 writes the list."""
    ties = [list(tie) for tie in find_ties(module)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, ties)
        ties = sorted({tuple(tie) for rank_ties in gathered for tie in rank_ties})
        ties = [list(tie) for tie in ties]
    return ties


def stored_ties(path: str | Path) -> list[list[str]]:
    """The tied names a sharded checkpoint stores once (none in checkpoints written before ties were recorded)."""
    meta = torch.load(Path(path) / META_FILE, map_location="cpu", weights_only=True)
    return meta[SHARDED_KEY].get("ties", [])


def with_aliases(state: dict[str, Any], ties: Sequence[Sequence[str]]) -> dict[str, Any]:
    """``state`` with every name of a tie holding its first name's tensor (one tensor: torch.save stores it once)."""
    for first, *aliases in ties:
        if first in state:
            state.update((alias, state[first]) for alias in aliases)
    return state


def without_aliases(state: dict[str, Any], ties: Sequence[Sequence[str]]) -> dict[str, Any]:
    """``state`` with a tied parameter under its first name only (``ties.find_ties``): stored once, loaded tied."""
    aliases = {alias for _, *others in ties for alias in others}
    return {key: value for key, value in state.items() if key not in aliases}


def load_full_model_state(module: nn.Module, state: dict[str, Any], strict: bool) -> None:
    """Load a whole-model state dict (a single-file checkpoint) into ``module``'s shards: each rank keeps its part."""
    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True, strict=strict))


def load_optimizer_into(module: nn.Module, optimizer: torch.optim.Optimizer, index: int, path: str | Path) -> None:
    """Load optimizer ``index`` of a sharded checkpoint into ``optimizer``, states by parameter name; each group keeps
    this rank's parameters and takes the saved settings by position (they are stored with one rank's names)."""
    state = get_optimizer_state_dict(module, optimizer)
    own_groups = [dict(group) for group in state["param_groups"]]
    _dcp_load({f"optimizer{index}": state}, path)
    saved_groups = state["param_groups"]
    if len(saved_groups) == len(own_groups):
        state["param_groups"] = [saved | {"params": own["params"]} for saved, own in zip(saved_groups, own_groups)]
    else:
        state["param_groups"] = own_groups
    set_optimizer_state_dict(module, optimizer, state)


def load_full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Shard a single-file checkpoint's optimizer state onto ``optimizer``, keyed by name as DCP shards it."""
    names = {id(p): name for name, p in module.named_parameters()}
    ordered = [names.get(id(p)) for group in optimizer.param_groups for p in group["params"]]
    saved_groups = state["param_groups"]
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    if [len(g["params"]) for g in saved_groups] != sizes or None in ordered:
        raise ValueError("the checkpoint's optimizer groups do not match this optimizer's (another model or "
                         "optimizer configuration?)")
    name_of_index = {index: ordered[position] for position, index in
                     enumerate(i for group in saved_groups for i in group["params"])}
    by_name = {"state": {name_of_index[index]: value for index, value in state["state"].items()},
               "param_groups": [group | {"params": [name_of_index[i] for i in group["params"]]}
                                for group in saved_groups]}
    set_optimizer_state_dict(module, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def remove(path: str | Path) -> None:
    path = Path(path)
    if path.is_symlink():  # a sharded checkpoint: the link and the directory it points to
        target = path.resolve()
        path.unlink()
        shutil.rmtree(target, ignore_errors=True)
    elif path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def read_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The model state of the sharded checkpoint ``path`` (any layout) as whole CPU tensors, with no process group."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not is_sharded_checkpoint(path):
        raise ValueError(f"{path} is not a sharded checkpoint (a directory with {META_FILE} and DCP files)")
    reader = FileSystemReader(str(path))
    prefix = "model."  # save_sharded stores the module's state under "model" (DCP flattens the nested keys)
    state = {key[len(prefix):]: torch.empty(item.size, dtype=item.properties.dtype)
             for key, item in reader.read_metadata().state_dict_metadata.items()
             if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)}
    with _one_process_dcp():
        dcp.load({"model": state}, storage_reader=reader, no_dist=True)
    return with_aliases(state, stored_ties(path))


def to_single_file(source: str | Path, destination: str | Path) -> dict[str, Any]:
    """Write the sharded checkpoint ``source`` as one Lightning checkpoint file (any strategy loads it), its folder
    created and the file renamed into place once written, and return it; the optimizer states are numbered as torch
    numbers them."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    source, destination = Path(source), Path(destination)
    if not source.exists():
        raise ValueError(f"{source} does not exist: pass a sharded checkpoint directory (a P2RStrategy run's "
                         "checkpoints/last.ckpt with sharding zero2 or zero3)")
    if not is_sharded_checkpoint(source):
        raise ValueError(f"{source} is not a sharded checkpoint (a directory with {META_FILE} and DCP files)")
    checkpoint = {k: v for k, v in torch.load(source / META_FILE, map_location="cpu", weights_only=True).items()
                  if k != SHARDED_KEY}
    # The temporary file is claimed before the shards are read: a folder that cannot be made or written fails at
    # once, as an OSError naming it (torch.save's own error for a missing folder was a RuntimeError).
    with replaced_atomically(destination) as partial:
        dcp_to_torch_save(source, partial)
        states = torch.load(partial, map_location="cpu", weights_only=True)
        checkpoint["state_dict"] = with_aliases(states["model"], stored_ties(source))
        checkpoint["optimizer_states"] = numbered_optimizer_states(states)
        torch.save(checkpoint, partial)
    return checkpoint


def read_optimizer_states(path: str | Path) -> list[dict[str, Any]]:
    """Every optimizer state of the sharded checkpoint ``path`` (any layout) whole, on the CPU, numbered as a
    single-file checkpoint holds it, read with no process group: for an optimizer that loads only that form (a
    one-process run's, split between device and host around offloaded blocks). DCP gathers the shards into a
    temporary file (in ``TMPDIR``), read back and removed."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory(prefix="lightning-p2r-") as folder:
        whole = Path(folder) / "states.pt"
        with _one_process_dcp():
            dcp_to_torch_save(path, whole)
        return numbered_optimizer_states(torch.load(whole, map_location="cpu", weights_only=True))


def numbered_optimizer_states(states: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``optimizer{i}`` entries of a sharded checkpoint's whole states, in order, numbered as torch numbers them."""
    optimizers = sorted((k for k in states if k.startswith("optimizer")), key=lambda k: int(k[len("optimizer"):]))
    return [optimizer_state_by_number(states[k]) for k in optimizers]


def optimizer_state_by_number(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name (DCP's form) numbered as torch numbers it (groups' order)."""
    number = {name: i for i, name in enumerate(name for group in state["param_groups"] for name in group["params"])}
    return {"state": {number[name]: value for name, value in state["state"].items()},
            "param_groups": [group | {"params": [number[name] for name in group["params"]]}
                             for group in state["param_groups"]]}


# Values of ckpt_path that Lightning resolves itself (to a file it found), not paths.
_SPECIAL_PATHS = ("last", "best", "hpc", "registry")


def check_checkpoint_path(path: str | Path, loads_sharded: bool, integrity: bool = True) -> None:
    """Raise a ``ValueError`` naming the problem and the fix if ``path`` cannot be resumed from: missing, empty or
    corrupt (truncated, a shard missing, bytes that fail their checksums: ``checkpoint_integrity``), a directory that
    is no sharded checkpoint, or a sharded one a strategy cannot read (``loads_sharded``). ``integrity``: read every
    byte against its checksum (False where a later step does, as ``P2RStrategy.load_checkpoint`` with its ranks)."""
    if not check_checkpoint_location(path, loads_sharded):
        if integrity and is_sharded_checkpoint(path):
            check_integrity(path)  # every shard present and whole, every item's checksum
        return
    try:
        # mmap: only the pickled index is read here, not the tensors.
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # noqa: BLE001 (every way a file fails to load gets the same clear message)
        raise unloadable(path, error) from error
    check_lightning_checkpoint(path, checkpoint)
    if integrity:
        check_integrity(path)  # the tensors' bytes: torch.load does not read their checksums


def check_checkpoint_location(path: str | Path, loads_sharded: bool) -> bool:
    """The checks that need no load: True for a file still to read, False for a sharded checkpoint or a ckpt name."""
    if str(path) in _SPECIAL_PATHS or str(path).startswith("registry:"):
        return False
    path = Path(path)
    if not path.exists():
        raise ValueError(f"checkpoint {path} does not exist (for the newest of a run, pass --ckpt_path last)")
    if path.is_dir():
        if not is_sharded_checkpoint(path):
            raise ValueError(f"checkpoint {path} is a directory but not a sharded checkpoint (no {META_FILE}): pass "
                             "a checkpoint file or a sharded checkpoint directory")
        if not loads_sharded:
            raise ValueError(
                f"checkpoint {path} is a sharded checkpoint (torch distributed checkpoint, written by P2RStrategy "
                "with zero2/zero3): load it with strategy lightning_p2r.P2RStrategy (any sharding, any number of "
                f"processes), or write a single file any strategy loads: lightning-p2r convert-checkpoint {path} "
                f"{path.with_suffix('')}-single.ckpt")
        return False
    if path.stat().st_size == 0:
        raise ValueError(f"checkpoint {path} is empty (0 bytes; an interrupted copy?): use another checkpoint")
    return True


def unloadable(path: str | Path, error: Exception) -> ValueError:
    """The clear error for a checkpoint file that ``torch.load`` refused."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if "weights_only" in str(error) or "Unsupported global" in str(error):
        reason = ("it holds Python objects that a weights-only load refuses (checkpoints are loaded with "
                  "weights_only=True, for safety)")
    else:
        reason = _not_an_archive(path) or f"it is truncated or not a torch checkpoint ({type(error).__name__}: " \
                                          f"{first_line})"
    return ValueError(f"checkpoint {path} cannot be loaded: {reason}")


def _not_an_archive(path: str | Path) -> str | None:
    """Why a file that is no ``torch.save`` zip archive is not a checkpoint, read off its first bytes; None for one
    that starts as an archive. torch's own error for a text file given as a checkpoint asked to save it again "with
    _use_new_zipfile_serialization=True" (its memory-mapped load's hint)."""
    try:
        with open(path, "rb") as file:
            head = file.read(8)
    except OSError:
        return None
    if head.startswith(b"PK\x03\x04"):
        return None
    if head.startswith(b"\x80"):
        return ("it was saved in torch's legacy format (torch.save(..., _use_new_zipfile_serialization=False)), which "
                "cannot be loaded memory-mapped: load it with torch.load and save it again with torch.save")
    return (f"it is not a torch checkpoint: torch.save writes a zip archive, and this file starts with {head!r}")


def check_lightning_checkpoint(path: str | Path, checkpoint: Any) -> None:
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ValueError(f"checkpoint {path} is not a Lightning checkpoint (no 'state_dict' entry)")
