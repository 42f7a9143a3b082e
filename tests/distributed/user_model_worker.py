"""A user's own block-sequence model that declares its parallel plan, trained on one process or under
``P2RStrategy(tensor_parallel=2)``, or (``--experts``) a user's own MoE whose plan declares its stacked experts,
under ``P2RStrategy(expert_parallel=2)``, or (``--data-parallel 2 --seed-per-rank``) built eagerly with another
seed on each rank and replicated; launched by test_user_model_plan.py. Each rank writes its losses."""

import argparse
import json
import os
from pathlib import Path

import lightning as L
import torch
from rank_slices import RankSlices
from torch import nn

from lightning_p2r import P2RStrategy
from lightning_p2r.protocols import ParallelPlan, StackedExperts
from lightning_p2r.strategy.parallel.experts import expert_dispatch

VOCAB, DIM, HIDDEN, LAYERS, SEQ, BATCH, STEPS, EXPERTS = 32, 16, 32, 3, 8, 4, 5, 4


class Residual(nn.Module):
    """A block of the user's own: norm, then an MLP whose two layers tensor parallelism splits as a pair."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class UserExperts(nn.Module):
    """The user's experts: stacked weights (experts first), called with each token's top-k experts and gates."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = EXPERTS
        self.w_up = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) * DIM**-0.5)
        self.w_down = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) * HIDDEN**-0.5)

    def forward(self, hidden: torch.Tensor, index: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for expert in range(self.num_experts):
            token, slot = torch.where(index == expert)
            rows = torch.relu(hidden[token] @ self.w_up[expert]) @ self.w_down[expert]
            out = out.index_add(0, token, rows * gates[token, slot].unsqueeze(-1))
        return out


class MoEResidual(nn.Module):
    """A block with a top-2 MoE layer of the user's own."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = UserExperts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(x).reshape(-1, DIM)
        gates, index = self.router(hidden).softmax(dim=-1).topk(2, dim=-1)
        return x + self.experts(hidden, index, gates).view_as(x)


class Stack(nn.Module):
    """Embedding, blocks, head: the block-sequence contract (``blocks``, ``layer_to_block``) plus a plan."""

    def __init__(self, experts: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList((MoEResidual() if experts else Residual()) for _ in range(LAYERS))
        self.layer_to_block = list(range(LAYERS))
        self.out = nn.Linear(DIM, VOCAB, bias=False)
        self.with_experts = experts

    def parallel_plan(self) -> ParallelPlan:
        if self.with_experts:  # the experts' stacked weights, with where their hidden units lie
            declared = StackedExperts({"w_up": 2, "w_down": 1}, call="top_k")
            return ParallelPlan(tuple({} for _ in self.blocks), {}, experts={"experts": declared})
        block = {"up": "column", "down": "row"}
        return ParallelPlan(tuple(dict(block) for _ in self.blocks), {"embed": "vocabulary", "out": "output"})

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layer_to_block:
            x = self.blocks[layer](x)
        return self.out(x)


class UserModule(L.LightningModule):
    def __init__(self, experts: bool = False, seed: int = 0) -> None:
        super().__init__()
        self.losses: list[float] = []
        torch.manual_seed(seed)  # built eagerly: the same initial weights on every rank and in the reference
        self.model = Stack(experts)

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
    parser.add_argument("--expert-parallel", type=int, default=1)
    parser.add_argument("--experts", action="store_true", help="MoE blocks of the user's own")
    parser.add_argument("--data-parallel", type=int, default=1, help="replicated data-parallel ranks")
    parser.add_argument("--sharding", default="none")
    parser.add_argument("--seed-per-rank", action="store_true",
                        help="each rank builds its model from its own seed (as a script without seed_everything)")
    args = parser.parse_args()
    # Counting sequences (each token's successor is the next token, mod VOCAB): learnable, so the loss falls.
    starts = torch.randint(0, VOCAB, (STEPS * BATCH, 1), generator=torch.Generator().manual_seed(1))
    data = (starts + torch.arange(SEQ + 1)) % VOCAB
    tp, ep, dp = args.tensor_parallel, args.expert_parallel, args.data_parallel
    strategy = P2RStrategy(tensor_parallel=tp, expert_parallel=ep, sharding=args.sharding)
    # Lightning's launcher sets LOCAL_RANK in the processes it starts (rank 0 is the launching one).
    seed = int(os.environ.get("LOCAL_RANK", "0")) if args.seed_per_rank else 0
    module = UserModule(args.experts, seed)
    trainer = L.Trainer(accelerator="cpu", devices=tp * ep * dp, strategy=strategy, max_steps=STEPS, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        limit_val_batches=0, default_root_dir=args.out, use_distributed_sampler=False)
    # Tensor-parallel ranks read the same batch (the whole batch on every rank); expert-parallel ranks are data
    # ranks, each reading its share of the batch.
    trainer.fit(module, datamodule=RankSlices(data, BATCH))
    split = sum(isinstance(p, torch.distributed.tensor.DTensor) for p in module.model.parameters()) if tp > 1 else 0
    # The experts each rank holds, per MoE layer (a share where expert parallelism split the layer).
    experts = [expert_dispatch(m).local_experts if expert_dispatch(m) else m.num_experts
               for m in module.model.modules() if isinstance(m, UserExperts)]
    weights = [float(local.double().sum()) for local in (getattr(p, "_local_tensor", p) for p in module.parameters())]
    report = {"losses": module.losses, "split_parameters": split, "experts_held": experts, "weights": weights}
    (args.out / f"tp{tp}.ep{ep}.dp{dp}.rank{trainer.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
