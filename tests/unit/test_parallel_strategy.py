"""``P2RStrategy`` is a Lightning ``ParallelStrategy`` (issue 39 item 1), not a ``DDPStrategy``: what Lightning asks of
such a strategy on one process (no process group), and Lightning's own options it keeps honouring."""

from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, ParallelStrategy
from torch import nn

from lightning_p2r import P2RStrategy

V, D = 16, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.norm = nn.BatchNorm1d(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.fc(x).transpose(1, 2)).transpose(1, 2)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.layer_to_block = [0, 1]
        self.head = nn.Linear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layer_to_block:
            x = self.blocks[layer](x)
        return self.head(x)


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Net()
        self.norms_seen: set[str] = set()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.norms_seen |= {type(m).__name__ for m in self.modules() if "BatchNorm" in type(m).__name__}
        logits = self.net(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, V), batch[:, 1:].reshape(-1))
        self.log("loss", loss, sync_dist=True)  # the strategy's reduce, a no-op on one process
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_one_process_is_a_parallel_strategy_that_is_not_distributed(tmp_path: Path) -> None:
    strategy = P2RStrategy()
    assert isinstance(strategy, ParallelStrategy) and not isinstance(strategy, DDPStrategy)
    module = Module()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=tmp_path, sync_batchnorm=True)
    data = (torch.arange(8 * 5).view(8, 5)) % V
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    assert not strategy.is_distributed and strategy.world_size == 1
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}
    assert strategy.broadcast("same", src=0) == "same"
    strategy.barrier()
    value = torch.tensor(3.0)
    assert strategy.reduce(value) is value and float(value) == 3.0
    # sync_batchnorm: synchronized BatchNorm while fitting (as Lightning's DDP converts it), plain afterwards.
    assert module.norms_seen == {"SyncBatchNorm"}
    after = {type(m).__name__ for m in module.modules() if "BatchNorm" in type(m).__name__}
    assert after and "SyncBatchNorm" not in after  # Lightning's revert gives its plain batch norm back
