"""Hugging Face models (tiny configs, random weights) trained by ``CausalLMModule`` in a list of layouts on 1 or 2
CPU processes (gloo); launched by test_hf_layouts.py. Every rank runs every configuration in order.

Each rank reads its own slice of the same global batches (no sampler), so a run compares exactly with one process.
Rank 0 writes ``<name>.pt``: the loss of every step (averaged over the ranks that compute different ones), every
rank's whole weights after training, whether the tied head stayed tied, and each rank's parameter elements held
(a model built in place holds only its share). A one-process reference also records the value each tensor started
training from (``initial``), against which the test measures how far training moved it.
"""

import sys
from pathlib import Path

import lightning as L
import torch
from rank_slices import RankSlices, report, run_configs
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from hf_models import Losses, causal_lm, windows  # noqa: E402

from lightning_p2r import P2RStrategy, PseudoToReal  # noqa: E402
from lightning_p2r.strategy.parallel.experts import expert_dispatch  # noqa: E402

GLOBAL_BATCH, STEPS = 4, 4


class StartingValues(L.Callback):
    """Each tensor's value when it first takes part in a step: at step 0, or, for the layers growth adds, the value
    it was grown with. A one-process run only (its full state dict is the module's own)."""

    def __init__(self) -> None:
        self.values: dict[str, torch.Tensor] = {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        for name, value in get_model_state_dict(pl_module).items():
            if name not in self.values:
                self.values[name] = value.detach().float().flatten().clone()


def run(config: dict, out: Path, devices: int) -> None:
    L.seed_everything(0)
    family = config["family"]
    module = causal_lm(family, optimizer={"lr": 1e-2, "warmup_steps": 0} | config.get("optimizer", {}), init_seed=3,
                       own_module=config.get("own_module", False), **config.get("module", {}))
    options = config.get("strategy")
    # Tensor-parallel runs count their collectives, for the planner's count (test_hf_layouts).
    counting = options is not None and options.get("tensor_parallel", 1) > 1
    strategy = P2RStrategy(count_collectives=counting, **options) if options is not None else "auto"
    losses, starting = Losses(), StartingValues()
    steps = config.get("steps", STEPS)
    # "accumulate": n plain micro-batches per step, each 1/n of the global batch (a reference for layouts whose
    # ranks or micro-batches each compute a loss over their own rows, as a router's load-balancing loss does).
    accumulate = config.get("accumulate", 1)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                        accumulate_grad_batches=accumulate,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        use_distributed_sampler=False, limit_val_batches=0, num_sanity_val_steps=0,
                        # After PseudoToReal, which grows the model at the start of its step.
                        callbacks=[losses] + ([PseudoToReal(delink_at_step=config["delink_at"])]
                                              if "delink_at" in config else []) + ([starting] if devices == 1 else []))
    # "batches": fewer batches than steps, read again in order (one batch: the same one at every step).
    data = RankSlices(windows(rows=GLOBAL_BATCH * config.get("batches", steps)), GLOBAL_BATCH // accumulate)
    trainer.fit(module, datamodule=data, ckpt_path=out / config["resume"] if "resume" in config else None)
    if "save" in config:
        trainer.save_checkpoint(out / config["save"])
    model = module.model
    head = model.lm_head
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else model.transformer.wte
    tied = None
    # (a user's own decoder has no config: NanoGPT ties its head by construction)
    ties = getattr(getattr(model, "config", None), "tie_word_embeddings", family == "nanogpt")
    if ties and hasattr(head, "weight") and hasattr(embedding, "weight"):
        tied = head.weight is embedding.weight  # (a pipeline rank holds one end only: its replica is checked)
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in module.parameters())
    # The experts each rank runs, per MoE layer (fewer than the layer has where expert parallelism split it).
    experts_held = [expert_dispatch(m).local_experts if expert_dispatch(m) else
                    len(m) if isinstance(m, torch.nn.ModuleList) else m.num_experts  # (litgpt's: a list)
                    for name, m in model.named_modules() if name.endswith("mlp.experts")]
    local = {"tied": tied, "held": held, "experts_held": experts_held,
             "token_loss": type(getattr(module, "token_loss", None)).__name__}
    if counting and strategy.collectives_history:  # the last step's collectives, by kind
        last = strategy.collectives_history[-1]
        local["collective_bytes"], local["collective_calls"] = dict(last.bytes), dict(last.calls)
    # A plain Trainer reports each micro-batch's loss divided by their count: a step's loss is their sum.
    step_losses = [sum(losses.losses[i:i + accumulate]) for i in range(0, len(losses.losses), accumulate)]
    report(out, config["name"], trainer, module, step_losses, local | ({"initial": starting.values}
                                                                          if devices == 1 else {}))


if __name__ == "__main__":
    run_configs(run)
