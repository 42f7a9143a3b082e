"""``P2RStrategy(host_step="delayed")`` (issue 40 item 5, DeepSpeed's delayed parameter update): an offloaded block's
host update from step t's gradients reaches the model after step t+1, so step t+2 computes with it. Checked against
a plain loop that applies that rule by hand, with clipping; a checkpoint resumes exactly; bad uses are refused."""

from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

from lightning_p2r import P2RStrategy

V, D, LAYERS, STEPS, BATCH, SEQ = 24, 16, 4, 6, 4, 6
OFFLOADED = (1, 2)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Stack(nn.Module):
    """The block-sequence contract (``blocks``, ``layer_to_block``) around an embedding and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.layer_to_block = list(range(LAYERS))
        self.head = nn.Linear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layer_to_block:
            x = self.blocks[layer](x)
        return self.head(x)


def loss_of(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, V), batch[:, 1:].reshape(-1))


def optimizer_for(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.3, momentum=0.9, weight_decay=0.01)


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Stack()
        self.losses: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = loss_of(self.model, batch)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer_for(self.parameters())


def batches(steps: int = STEPS) -> torch.Tensor:
    starts = torch.randint(0, V, (steps * BATCH, 1), generator=torch.Generator().manual_seed(1))
    return (starts + torch.arange(SEQ + 1)) % V


def fit(tmp_path: Path, strategy: P2RStrategy, clip: float | None = None, steps: int = STEPS,
        epoch: int = STEPS, ckpt_path: Path | None = None, **trainer: object) -> tuple[Module, L.Trainer]:
    """``epoch``: batches per epoch (a run resumed at an epoch's end reads what an uninterrupted one reads)."""
    module = Module()
    run = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                    gradient_clip_val=clip, **trainer)
    run.fit(module, torch.utils.data.DataLoader(batches(epoch), batch_size=BATCH), ckpt_path=ckpt_path)
    return module, run


def delayed_by_hand(clip: float | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The rule, on one device with no offload: the offloaded blocks' parameters have masters with their own
    optimizer; each step publishes the masters' previous update into the model, then steps the masters."""
    model = Stack()
    offloaded = {id(p) for i in OFFLOADED for p in model.blocks[i].parameters()}
    resident = [p for p in model.parameters() if id(p) not in offloaded]
    pairs = [(p, nn.Parameter(p.detach().clone())) for p in model.parameters() if id(p) in offloaded]
    device_opt, host_opt = optimizer_for(resident), optimizer_for([m for _, m in pairs])
    losses = []
    for batch in batches().split(BATCH):
        for p in model.parameters():
            p.grad = None
        loss = loss_of(model, batch)
        losses.append(float(loss.detach()))
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        with torch.no_grad():
            for param, master in pairs:
                param.copy_(master)  # the update of the previous step reaches the model now
                master.grad = param.grad.clone()
        host_opt.step()  # this step's update, which the model gets after the next step
        device_opt.step()
    with torch.no_grad():  # the end of training publishes the last update
        for param, master in pairs:
            param.copy_(master)
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("clip", [None, 0.5], ids=["no_clip", "clip"])
def test_delayed_host_steps_follow_the_rule(tmp_path: Path, clip: float | None) -> None:
    expected_losses, expected_weights = delayed_by_hand(clip)
    module, _ = fit(tmp_path, P2RStrategy(offload_blocks=list(OFFLOADED), host_step="delayed"), clip,
                    enable_checkpointing=False)
    assert module.losses == pytest.approx(expected_losses, rel=1e-5, abs=1e-6)
    for name, value in module.model.state_dict().items():
        torch.testing.assert_close(value, expected_weights[name], rtol=1e-5, atol=1e-6, msg=name)
    # Not the exact update: the comparison separates the two.
    exact, _ = fit(tmp_path, P2RStrategy(offload_blocks=list(OFFLOADED)), clip, enable_checkpointing=False)
    assert exact.losses[0] == pytest.approx(module.losses[0], rel=1e-6)  # the second step computes with stale blocks
    assert exact.losses[1:] != pytest.approx(module.losses[1:], rel=1e-6)


@pytest.mark.parametrize("offload_states", [None, ["grads", "optimizer"]], ids=["streamed", "resident_params"])
def test_a_checkpoint_with_a_pending_update_resumes_exactly(tmp_path: Path, offload_states: list | None) -> None:
    def strategy() -> P2RStrategy:
        return P2RStrategy(offload_blocks=list(OFFLOADED), host_step="delayed", offload_states=offload_states)

    whole, _ = fit(tmp_path / "whole", strategy(), epoch=3, enable_checkpointing=False)
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    fit(tmp_path / "first", strategy(), steps=3, epoch=3, callbacks=[saver])
    saved = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    checkpoint = torch.load(saved, weights_only=True)
    assert checkpoint["optimizer_states"][0]["delayed_params"]  # the update of step 3, not yet the model's
    resumed, _ = fit(tmp_path / "resumed", strategy(), epoch=3, ckpt_path=saved, enable_checkpointing=False)
    assert resumed.losses == whole.losses[3:]
    for name, value in resumed.model.state_dict().items():
        torch.testing.assert_close(value, whole.model.state_dict()[name], rtol=0, atol=0, msg=name)


def test_delayed_host_steps_are_refused_where_they_cannot_run(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nothing is offloaded"):
        P2RStrategy(host_step="delayed")
    with pytest.raises(ValueError, match="host_step must be one of"):
        P2RStrategy(offload_fraction=0.5, host_step="late")
    with pytest.raises(ValueError, match="FSDP2's CPU offload"):
        fit(tmp_path, P2RStrategy(sharding="zero3", offload_fraction=0.5, host_step="delayed"), steps=1,
            enable_checkpointing=False)
