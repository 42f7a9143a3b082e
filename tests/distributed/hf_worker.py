"""Hugging Face models (tiny configs, random weights) trained by ``CausalLMModule`` in a list of layouts on 1 or 2
CPU processes (gloo); launched by test_hf_layouts.py. Every rank runs every configuration in order.

Each rank reads its own slice of the same global batches (no sampler), so a run compares exactly with one process.
Rank 0 writes ``<name>.json``: the loss of every step (averaged over the ranks that compute different ones), every
rank's whole weights after training, whether the tied head stayed tied, and each rank's parameter elements held
(a model built in place holds only its share).
"""

import argparse
import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from hf_models import Losses, causal_lm, windows  # noqa: E402

from lightning_p2r import P2RStrategy  # noqa: E402

GLOBAL_BATCH, STEPS = 4, 4


class RankSlices(L.LightningDataModule):
    """Rank r of n data ranks reads rows [r * B/n, (r + 1) * B/n) of each global batch of B rows."""

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = windows(rows=GLOBAL_BATCH * STEPS)
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
        ranks, rank = kwargs["num_replicas"], kwargs["rank"]
        per_rank = GLOBAL_BATCH // ranks
        rows = [b * GLOBAL_BATCH + rank * per_rank + i for b in range(STEPS) for i in range(per_rank)]
        return torch.utils.data.DataLoader(data[rows], batch_size=per_rank)


def run(config: dict, out: Path, devices: int) -> None:
    L.seed_everything(0)
    family = config["family"]
    module = causal_lm(family, optimizer={"lr": 1e-2, "warmup_steps": 0}, init_seed=3)
    options = config.get("strategy")
    strategy = P2RStrategy(**options) if options is not None else "auto"
    losses = Losses()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        use_distributed_sampler=False, limit_val_batches=0, num_sanity_val_steps=0,
                        callbacks=[losses])
    trainer.fit(module, datamodule=RankSlices())
    step_losses = torch.tensor(losses.losses)
    if dist.is_initialized():
        # Data ranks hold their own rows' losses, tensor-parallel ranks repeat theirs: the mean over every rank is
        # the global batch's. Pipeline ranks other than the last report the step's loss too (the strategy returns it).
        dist.all_reduce(step_losses)
        step_losses /= dist.get_world_size()
    weights = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    model = module.model
    tied = None
    head = model.lm_head
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else model.transformer.wte
    if getattr(model.config, "tie_word_embeddings", False) and hasattr(head, "weight") and hasattr(embedding,
                                                                                                   "weight"):
        tied = head.weight is embedding.weight  # (a pipeline rank holds one end only: its replica is checked)
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in module.parameters())
    local = {"weights": {k: v.detach().float().flatten().tolist() for k, v in weights.items()}, "tied": tied,
             "held": held, "total": sum(p.numel() for p in module.parameters())}
    everyone = [None] * devices
    if dist.is_initialized():
        dist.all_gather_object(everyone, local)
    else:
        everyone = [local]
    if trainer.global_rank == 0:
        (out / f"{config['name']}.json").write_text(json.dumps({"losses": step_losses.tolist(), "ranks": everyone}))
    if dist.is_initialized():
        dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--configs", type=str, required=True, help="JSON list of configurations")
    args = parser.parse_args()
    for config in json.loads(args.configs):
        run(config, args.out, args.devices)


if __name__ == "__main__":
    main()
