"""One training run for the crash-safety tests, in its own process so it can be killed with SIGKILL.

    python crash_worker.py '<json spec>'

spec: ``root`` (folder), ``sharded`` (ZeRO-3 on one process: sharded checkpoints; else single files),
``max_steps``, ``resume`` (pass ckpt_path="last"), and ``kill``: None, or where to die with SIGKILL at optimizer
step ``kill_at``: "step" (after that step's backward), "save" (halfway through writing that step's checkpoint) or
"swap" (sharded only: the new checkpoint complete, just before it replaces the previous one). A run that ends
writes its final weights to ``<root>/final.pt``.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
from pathlib import Path

import lightning as L
import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).parent))
from helpers import TINY, tiny_data  # noqa: E402

from lightning_p2r import M6Config, M6LanguageModel, OptimizerConfig, P2RStrategy  # noqa: E402
from lightning_p2r.strategy import checkpoint as sharded_checkpoint  # noqa: E402


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KillAfterBackward(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step == self.step:
            _die()


def _kill_during_saves(trainer_box: list[L.Trainer], step: int, where: str) -> None:
    """Patch the writers so the save of optimizer step ``step`` dies at ``where``."""
    def due() -> bool:
        return trainer_box[0].global_step == step

    if where == "save":
        real_save = torch.save

        def half_written_save(obj, f, *args, **kwargs):  # a single file: half its bytes reach the disk
            if due() and not isinstance(f, io.BytesIO):
                buffer = io.BytesIO()
                real_save(obj, buffer, *args, **kwargs)
                f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
                f.flush()
                _die()
            return real_save(obj, f, *args, **kwargs)
        torch.save = half_written_save

        real_dcp_save = sharded_checkpoint.dcp.save

        def half_written_dcp_save(state, checkpoint_id):  # sharded: the model's files written, no metadata
            if due():
                real_dcp_save({"model": state["model"]}, checkpoint_id=checkpoint_id)
                _die()
            return real_dcp_save(state, checkpoint_id=checkpoint_id)
        sharded_checkpoint.dcp.save = half_written_dcp_save
    elif where == "swap":
        real_replace = Path.replace

        def replace_then_die(self, target):
            if due() and self.name.endswith(".link"):
                _die()
            return real_replace(self, target)
        Path.replace = replace_then_die


def main(spec: dict) -> None:
    torch.set_num_threads(1)
    root = Path(spec["root"])
    L.seed_everything(0)
    module = M6LanguageModel(M6Config(**(TINY | {"moe_layers": [], "init_seed": 0})),
                             OptimizerConfig(lr=1e-2, warmup_steps=1))
    callbacks: list[L.Callback] = [L.pytorch.callbacks.ModelCheckpoint(
        dirpath=root / "checkpoints", save_last=True, save_top_k=0, every_n_train_steps=1)]
    if spec.get("kill") == "step":
        callbacks.append(KillAfterBackward(spec["kill_at"]))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=spec["max_steps"], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=root, callbacks=callbacks,
                        strategy=P2RStrategy(sharding="zero3" if spec["sharded"] else "none"))
    if spec.get("kill") in ("save", "swap"):
        _kill_during_saves([trainer], spec["kill_at"], spec["kill"])
    trainer.fit(module, datamodule=tiny_data(root / "data"), ckpt_path="last" if spec.get("resume") else None)
    state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
             for k, v in trainer.strategy.lightning_module_state_dict().items()}
    torch.save({"global_step": trainer.global_step, "state_dict": state}, root / "final.pt")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
