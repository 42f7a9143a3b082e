"""Runs a list of P2RStrategy configurations on 1 or 2 CPU processes (gloo); launched by test_sharding.py.

Lightning's launcher starts rank 1 by re-running this script, so both ranks run every configuration in the same
order. For each configuration rank 0 writes ``<name>.pt`` (the full trained weights, gathered) and every rank
adds what it measured (model-state bytes, collectives per step) to ``<name>.rank<r>.json``.
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from helpers import TINY, InitialWeights, tiny_data  # noqa: E402

from lightning_p2r import M6Config, M6LanguageModel, OptimizerConfig, P2RStrategy, PseudoToReal  # noqa: E402
from lightning_p2r.measure.memory import local_model_state_bytes  # noqa: E402

# Dense layers: the balance loss of an MoE layer is not additive across ranks, so it would not match one process.
# A constant LR after warmup: resumed runs with a longer max_steps then follow the same schedule.
MODEL = TINY | {"num_layers": 4, "dim": 64, "moe_layers": [], "vocab_size": 256}  # the byte tokenizer has 256 ids


class Probe(L.Callback):
    """Model-state bytes after the last step; whether block parameters are gathered between forward and backward."""

    def __init__(self) -> None:
        self.bytes = None
        self.gathered_before_backward = None

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        blocks = pl_module.transformer.blocks
        self.gathered_before_backward = sum(p.numel() * p.element_size() for p in blocks.parameters()
                                            if not isinstance(p, DTensor))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        optimizer = trainer.strategy.optimizers[0]
        self.bytes = vars(local_model_state_bytes(pl_module, optimizer))


class Corrupt(L.Callback):
    """A deliberately wrong run, for the negative controls: at optimizer step ``step`` either zero one block's
    gradients (that step's gradient dropped) or forget one block's optimizer state (Adam restarts its moments)."""

    def __init__(self, kind: str, step: int, block: int) -> None:
        self.kind, self.step, self.block = kind, step, block

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        if trainer.global_step != self.step:
            return
        params = list(pl_module.transformer.blocks[self.block].parameters())
        optimizer = trainer.optimizers[0]
        for param in params:
            if self.kind == "drop_grad":
                param.grad.zero_()
            elif self.kind == "reset_state":
                optimizer.state.pop(param, None)
            else:
                raise ValueError(self.kind)


def full_weights(module: L.LightningModule, strategy: P2RStrategy) -> dict[str, torch.Tensor]:
    if strategy.path == "fsdp":
        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().clone() for k, v in strategy.lightning_module_state_dict().items()}


def run(config: dict, out: Path, devices: int) -> None:
    L.seed_everything(7)
    model = MODEL | config.get("model", {})
    optimizer = OptimizerConfig(lr=1e-2, warmup_steps=1, weight_decay=0.1, min_lr_ratio=1.0)
    module = M6LanguageModel(M6Config(**model), optimizer)
    if config.get("eager"):
        module.configure_model()  # built whole, here, before the strategy could build it on the meta device
    probe = Probe()
    callbacks = [probe]
    if "delink_at" in config:
        callbacks.append(PseudoToReal(delink_at_step=config["delink_at"]))
    if "delink_auto" in config:
        callbacks.append(PseudoToReal(auto=True, **config["delink_auto"]))
    if "delink_schedule" in config:
        callbacks.append(PseudoToReal(schedule={int(k): v for k, v in config["delink_schedule"].items()}))
    if "corrupt" in config:
        callbacks.append(Corrupt(**config["corrupt"]))
    initial = InitialWeights() if config.get("save_initial") else None
    if initial is not None:
        callbacks.append(initial)
    strategy = P2RStrategy(**config.get("strategy", {}))
    checkpointing = "save" in config
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=config.get("steps", 3),
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=checkpointing, limit_val_batches=config.get("val_batches", 0),
                        num_sanity_val_steps=0, accumulate_grad_batches=config.get("accumulate", 1),
                        callbacks=callbacks, default_root_dir=out / config["name"])
    batch_size = config.get("batch_size", 8) // devices
    resume = out / config["resume"] if "resume" in config else None
    trainer.fit(module, datamodule=tiny_data(out, batch_size=batch_size), ckpt_path=resume)
    if checkpointing:
        trainer.save_checkpoint(out / config["save"])
    weights = full_weights(module, strategy)
    rank = trainer.global_rank
    if rank == 0:
        torch.save({k: v.float() for k, v in weights.items()}, out / f"{config['name']}.pt")
        if initial is not None:
            torch.save(initial.weights, out / f"{config['name']}.initial.pt")
    report = {
        "path": strategy.path,
        "world_size": trainer.world_size,
        "bytes": probe.bytes,
        "gathered_before_backward": probe.gathered_before_backward,
        "param_bytes": sum(v.numel() * v.element_size() for v in weights.values()),
        "collectives": [{"calls": dict(c.calls), "bytes": dict(c.bytes)} for c in strategy.collectives_history],
        "blocks": len(module.transformer.blocks),
        "offloaded": sorted(strategy.plan.offloaded) if strategy.plan is not None else [],
        "delinks": [event.blocks_after for c in callbacks if isinstance(c, PseudoToReal) for event in c.events],
        "delink_steps": [event.step for c in callbacks if isinstance(c, PseudoToReal) for event in c.events],
        "agreement": [c.agreement for c in callbacks if isinstance(c, PseudoToReal)],
        "global_step": trainer.global_step,
        "offload": dataclasses.asdict(strategy.telemetry) if strategy.telemetry is not None else None,
    }
    (out / f"{config['name']}.rank{rank}.json").write_text(json.dumps(report))
    if dist.is_initialized():
        dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--configs", type=str, required=True, help="JSON list of configurations")
    args = parser.parse_args()
    for config in json.loads(args.configs):
        run(config, args.out, args.devices)


if __name__ == "__main__":
    main()
