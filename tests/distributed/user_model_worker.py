"""A user's own block-sequence model that declares its parallel plan, trained on one process or under
``P2RStrategy(tensor_parallel=2)``; launched by test_user_model_plan.py. Each rank writes its losses."""

import argparse
import json
from pathlib import Path

import lightning as L
import torch
from torch import nn

from lightning_p2r import P2RStrategy
from lightning_p2r.protocols import ParallelPlan

VOCAB, DIM, HIDDEN, LAYERS, SEQ, BATCH, STEPS = 32, 16, 32, 3, 8, 4, 5


class Residual(nn.Module):
    """A block of the user's own: norm, then an MLP whose two layers tensor parallelism splits as a pair."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Stack(nn.Module):
    """Embedding, blocks, head: the block-sequence contract (``blocks``, ``layer_to_block``) plus a plan."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Residual() for _ in range(LAYERS))
        self.layer_to_block = list(range(LAYERS))
        self.out = nn.Linear(DIM, VOCAB, bias=False)

    def parallel_plan(self) -> ParallelPlan:
        block = {"up": "column", "down": "row"}
        return ParallelPlan(tuple(dict(block) for _ in self.blocks), {"embed": "vocabulary", "out": "output"})

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layer_to_block:
            x = self.blocks[layer](x)
        return self.out(x)


class UserModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []
        torch.manual_seed(0)  # built eagerly: the same initial weights on every rank and in the reference
        self.model = Stack()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tensor-parallel", type=int, default=1)
    args = parser.parse_args()
    # Counting sequences (each token's successor is the next token, mod VOCAB): learnable, so the loss falls.
    starts = torch.randint(0, VOCAB, (STEPS * BATCH, 1), generator=torch.Generator().manual_seed(1))
    data = (starts + torch.arange(SEQ + 1)) % VOCAB
    tp = args.tensor_parallel
    strategy = P2RStrategy(tensor_parallel=tp) if tp > 1 else P2RStrategy()
    module = UserModule()
    trainer = L.Trainer(accelerator="cpu", devices=tp, strategy=strategy, max_steps=STEPS, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        limit_val_batches=0, default_root_dir=args.out)
    # Tensor-parallel ranks read the same batch: the whole batch on every rank.
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=BATCH))
    split = sum(isinstance(p, torch.distributed.tensor.DTensor) for p in module.model.parameters()) if tp > 1 else 0
    report = {"losses": module.losses, "split_parameters": split}
    (args.out / f"tp{tp}.rank{trainer.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
