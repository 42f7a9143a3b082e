"""Runs a list of tensor / expert parallel configurations on 1, 2 or 4 CPU processes (gloo); launched by
test_parallel.py.

Lightning's launcher starts the other ranks by re-running this script, so every rank runs every configuration in
the same order. Rank 0 writes ``<name>.json`` for each: the loss of every step (averaged over the ranks: each
data-parallel rank's loss is its own batch's, tensor-parallel ranks repeat theirs), the gradient norm before each
optimizer step (taken over every mesh the parameters live on), the full trained weights (``<name>.pt``), what
each rank holds of the parameters, the bytes of each collective kind in the last step on every rank, and how often
compiled code ran (``compile``; see tests/unit/compiled_runs.py).
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from compiled_runs import fresh, runs  # noqa: E402
from helpers import TINY, tiny_data  # noqa: E402
from rank_slices import run_configs  # noqa: E402

from lightning_p2r import M6Config, M6LanguageModel, OptimizerConfig, P2RStrategy, PseudoToReal  # noqa: E402
from lightning_p2r.measure.collectives import data_parallel_parts  # noqa: E402
from lightning_p2r.strategy.parallel.clipping import total_grad_norm  # noqa: E402
from lightning_p2r.strategy.parallel.experts import expert_dispatch  # noqa: E402

# Rotary positions, dense and banded (window 4) attention alternating, every layer MoE with M6-T prototyping
# (2 prototypes of top-1), dropless (so routing does not depend on how the batch is split), 4 experts, a large
# balance-loss weight (so an error in its cross-rank reduction shows in the loss), fp32, no dropout, a constant LR
# after warmup (resumed runs with a longer max_steps follow the same schedule).
MODEL = TINY | {"num_layers": 2, "dim": 32, "num_heads": 4, "moe_layers": [0, 1], "num_experts": 4,
                "num_prototypes": 2, "moe_top_k": 1, "capacity_factor": None, "router_aux_loss_coef": 0.5,
                "dropout": 0.0, "attention": "alternating", "sparse_window": 4}
GLOBAL_BATCH = 8


class Record(L.Callback):
    """Per step: the loss averaged over the ranks, and the gradient norm (the same on every rank)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        copies = trainer.strategy.engine.grad_copies()  # pipeline replicas are counted once
        with trainer.strategy.uncounted():  # this callback's own collective, not the layout's
            self.grad_norms.append(float(total_grad_norm(pl_module.parameters(), copies=copies)))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, *args) -> None:
        loss = outputs["loss"].detach().clone()
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        self.losses.append(float(loss))


class ForgetExpertGradientScale(L.Callback):
    """Negative control: the experts' gradients summed over the expert group instead of averaged (the bug the
    gradient scale prevents). Adam hides a constant factor, so only the gradient norms and clipping show it."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for module in pl_module.modules():
            if expert_dispatch(module) is not None:
                expert_dispatch(module).gradient_scale = 1.0


class ForgetReplicaSum(L.Callback):
    """Negative control: each pipeline rank keeps its own part of a replicated parameter's gradient (the shared
    block of a pseudo model) instead of the sum over the ranks that hold it."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.strategy.engine.stages._replicas = []


def held(module: torch.nn.Module) -> dict[str, list[int]]:
    """Per parameter: (elements this rank holds, elements of the whole parameter)."""
    return {name: [(p.to_local() if isinstance(p, DTensor) else p).numel(), p.numel()]
            for name, p in module.named_parameters()}


def run(config: dict, out: Path, devices: int) -> None:
    L.seed_everything(0)
    model = MODEL | config.get("model", {})
    module = M6LanguageModel(M6Config(**model, init_seed=7), OptimizerConfig(lr=1e-2, warmup_steps=1,
                                                                             min_lr_ratio=1.0))
    record = Record()
    callbacks = [record]
    if config.get("forget_expert_gradient_scale"):
        callbacks.append(ForgetExpertGradientScale())
    if config.get("forget_replica_sum"):
        callbacks.append(ForgetReplicaSum())
    if "delink_at" in config:
        callbacks.append(PseudoToReal(delink_at_step=config["delink_at"]))
    options = config.get("strategy", {})
    if options.get("compile"):
        fresh()  # compiled from scratch, as in a new process; counted from zero
    # A compiled run counts no collectives: the counter is a dispatch mode, under which nothing compiles (refused).
    strategy = P2RStrategy(count_collectives=not options.get("compile"), **options)
    trainer = L.Trainer(accelerator=config.get("accelerator", "cpu"), devices=devices, strategy=strategy,
                        max_steps=config.get("steps", 3),
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, limit_val_batches=2 if config.get("validate") else 0,
                        val_check_interval=config.get("steps", 3), check_val_every_n_epoch=None,
                        num_sanity_val_steps=0,
                        gradient_clip_val=0.5, callbacks=callbacks, default_root_dir=out / config["name"])
    data_ranks = devices // (strategy.tensor_parallel * strategy.pipeline_parallel)
    resume = out / config["resume"] if "resume" in config else None
    trainer.fit(module, datamodule=tiny_data(out, batch_size=GLOBAL_BATCH // data_ranks), ckpt_path=resume)
    if "save" in config:
        trainer.save_checkpoint(out / config["save"])
    holdings = [None] * trainer.world_size
    local = held(module)
    if dist.is_initialized():
        dist.all_gather_object(holdings, local)
    else:
        holdings = [local]
    # The collectives of the last step (bytes per kind, each rank's own), and what FSDP2 reduces over the data ranks.
    counted = [None] * trainer.world_size
    last = strategy.collectives_history[-1] if strategy.collectives_history else None
    local_counts = (dict(last.bytes), dict(last.calls)) if last is not None else ({}, {})
    if dist.is_initialized():
        dist.all_gather_object(counted, local_counts)
    else:
        counted = [local_counts]
    counted, calls = [c[0] for c in counted], [c[1] for c in counted]
    block_bytes, root_bytes = data_parallel_parts(module) if strategy.path == "model_parallel" else (0, 0)
    weights = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.global_rank == 0:
        torch.save({k: v.float() for k, v in weights.items()}, out / f"{config['name']}.pt")
        report = {"losses": record.losses, "grad_norms": record.grad_norms, "held": holdings,
                  "val_loss": float(trainer.callback_metrics["val/loss"]) if config.get("validate") else None,
                  "path": strategy.path, "blocks": len(module.transformer.blocks), "counted_bytes": counted,
                  "counted_calls": calls, "optimizer": type(trainer.strategy.optimizers[0]).__name__,
                  "block_bytes": block_bytes, "root_bytes": root_bytes, "fsdp_mode": strategy.fsdp_mode,
                  "model": MODEL | config.get("model", {}), "devices": trainer.world_size,
                  "compiled_runs": runs["compiled"],
                  "fsdp_units": sum(isinstance(m, FSDPModule) for m in module.modules())}
        (out / f"{config['name']}.json").write_text(json.dumps(report))
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    run_configs(run)
