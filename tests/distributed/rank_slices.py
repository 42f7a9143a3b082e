"""What the users'-model workers (tied_worker.py, hf_worker.py) share: every rank reads its own slice of the same
global batches (so a run compares exactly with one process), the step losses and every rank's whole weights are
gathered, and rank 0 writes one file per configuration. parallel_worker.py reads its configurations through
:func:`run_configs` too."""

import argparse
import functools
import json
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


class RankSlices(L.LightningDataModule):
    """Rank r of n data ranks reads rows [r * B/n, (r + 1) * B/n) of each global batch of B rows of ``data``."""

    def __init__(self, data: torch.Tensor, global_batch: int) -> None:
        super().__init__()
        self.data, self.global_batch = data, global_batch

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
        ranks, rank = kwargs["num_replicas"], kwargs["rank"]
        per_rank = self.global_batch // ranks
        steps = len(self.data) // self.global_batch
        rows = [b * self.global_batch + rank * per_rank + i for b in range(steps) for i in range(per_rank)]
        return torch.utils.data.DataLoader(self.data[rows], batch_size=per_rank)


def report(out: Path, name: str, trainer: L.Trainer, module: L.LightningModule, losses: list[float],
           local: dict) -> None:
    """Rank 0 writes ``<name>.pt`` (:func:`read_report`): the step losses averaged over the ranks (each data rank's
    are its own rows', tensor-parallel and pipeline ranks repeat theirs) and every rank's ``local`` record plus its
    whole weights (a replica that trained apart differs between ranks), as flat fp32 tensors: a pickled tensor is
    copied as bytes where a JSON list of floats costs a Python object per element. Collective."""
    step_losses = torch.tensor(losses)
    if dist.is_initialized():
        dist.all_reduce(step_losses)
        step_losses /= dist.get_world_size()
    # cpu_offload=False: with it, full state dicts reach rank 0 only, and the other ranks' replicas are not compared.
    weights = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    local = local | {"weights": {k: v.detach().float().flatten().clone() for k, v in weights.items()}}
    everyone = [None] * trainer.world_size
    if dist.is_initialized():
        dist.all_gather_object(everyone, local)
    else:
        everyone = [local]
    if trainer.global_rank == 0:
        torch.save({"losses": step_losses.tolist(), "ranks": everyone}, out / f"{name}.pt")
    if dist.is_initialized():
        dist.barrier()


@functools.cache
def read_report(out: Path, name: str) -> dict:
    """What :func:`report` wrote for configuration ``name``; read once (a reference is compared with every layout
    of its model), so callers must not change it."""
    return torch.load(out / f"{name}.pt", weights_only=True)


def run_configs(run: Callable[[dict, Path, int], None]) -> None:
    """``worker --out OUT --devices N --configs JSON``: every configuration in order (on every rank)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--configs", type=str, required=True, help="JSON list of configurations")
    args = parser.parse_args()
    for config in json.loads(args.configs):
        run(config, args.out, args.devices)
