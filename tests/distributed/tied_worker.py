"""A user's model with a tied embedding and LM head, trained in a list of layouts on 1 or 2 CPU processes (gloo);
launched by test_tied.py. Every rank runs every configuration in order (Lightning's launcher re-runs this script).

The model is shaped like Hugging Face's causal LMs: the head sits beside the module holding the embedding and the
blocks (``head_outside``), or inside it (M6's shape). Each rank reads its own slice of the same global batches
(no sampler: the comparison with one process is exact). Rank 0 writes ``<name>.pt``: the loss of every step
(averaged over the data ranks), whether the tie held after setup and after training on each rank, the full trained
weights of every rank (so the test checks that replicas agree).
"""

from pathlib import Path

import lightning as L
import torch
from rank_slices import RankSlices, report, run_configs
from torch import nn

from lightning_p2r import P2RStrategy
from lightning_p2r.protocols import ParallelPlan

VOCAB, DIM, LAYERS, SEQ, GLOBAL_BATCH, STEPS = 32, 16, 4, 8, 4, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Decoder(nn.Module):
    """Embedding, blocks, final norm (and the head when it is not outside): the block-sequence contract."""

    def __init__(self, head_inside: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.layer_to_block = list(range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        if head_inside:
            self.head = nn.Linear(DIM, VOCAB, bias=False)
            self.head.weight = self.embed.weight
        self.plan_outside: dict[str, str] = {}

    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan(tuple({"up": "column", "down": "row"} for _ in self.blocks), dict(self.plan_outside))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layer_to_block:
            x = self.blocks[layer](x)
        x = self.norm(x)
        return self.head(x) if hasattr(self, "head") else x


class CausalLM(nn.Module):
    """Hugging Face's shape: ``model`` (the decoder) and ``lm_head`` beside it, tied to ``model.embed``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Decoder(head_inside=False)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.model.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(ids))


class TiedModule(L.LightningModule):
    def __init__(self, head_outside: bool, plan_outside: dict[str, str]) -> None:
        super().__init__()
        torch.manual_seed(0)  # built eagerly: the same initial weights on every rank and in the reference
        self.net = CausalLM() if head_outside else Decoder(head_inside=True)
        decoder = self.net.model if head_outside else self.net
        decoder.plan_outside = plan_outside
        self.losses: list[float] = []
        self.tied_at_start: bool | None = None

    def tie_holds(self) -> bool:
        if isinstance(self.net, CausalLM):
            return self.net.lm_head.weight is self.net.model.embed.weight
        return self.net.head.weight is self.net.embed.weight

    def on_train_start(self) -> None:
        self.tied_at_start = self.tie_holds()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.net(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def run(config: dict, out: Path, devices: int) -> None:
    L.seed_everything(0)
    module = TiedModule(config.get("head_outside", True), config.get("plan_outside", {}))
    strategy = P2RStrategy(**config.get("strategy", {})) if config.get("strategy") is not None else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        use_distributed_sampler=False, limit_val_batches=0, num_sanity_val_steps=0)
    starts = torch.randint(0, VOCAB, (STEPS * GLOBAL_BATCH, 1), generator=torch.Generator().manual_seed(1))
    trainer.fit(module, datamodule=RankSlices((starts + torch.arange(SEQ + 1)) % VOCAB, GLOBAL_BATCH))
    report(out, config["name"], trainer, module, module.losses, {"tied": [module.tied_at_start, module.tie_holds()]})


if __name__ == "__main__":
    run_configs(run)
