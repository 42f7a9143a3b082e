"""Two-process training that streams a prepared directory, straight and stopped-then-resumed; launched by
test_streaming.py. Each rank writes the batches it trained on, so the test can compare ranks and runs."""

import argparse
import json
from pathlib import Path

import lightning as L

from lightning_p2r import M6Config, M6LanguageModel, OptimizerConfig, P2RStrategy, TextDataModule

MODEL = {"vocab_size": 256, "max_seq_len": 16, "num_layers": 2, "dim": 32, "num_heads": 4, "num_experts": 4}


class Batches(L.Callback):
    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append(batch[:, :4].reshape(-1).tolist())


def fit(config: dict, out: Path, devices: int, steps: int, resume: Path | None = None) -> tuple[L.Trainer, Batches]:
    L.seed_everything(0)
    module = M6LanguageModel(M6Config(**MODEL), OptimizerConfig(lr=1e-2, warmup_steps=1))
    batches = Batches()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=P2RStrategy(**config.get("strategy", {})),
                        max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, limit_val_batches=0, callbacks=[batches],
                        default_root_dir=out / config["name"])
    data = TextDataModule(prepared=config["prepared"], seq_len=16, batch_size=2, num_workers=config.get("workers", 0))
    trainer.fit(module, datamodule=data, ckpt_path=resume)
    return trainer, batches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--configs", required=True)
    args = parser.parse_args()
    for config in json.loads(args.configs):
        _, straight = fit(config, args.out, args.devices, 6)
        trainer, first = fit(config, args.out, args.devices, 3)
        checkpoint = args.out / f"{config['name']}.ckpt"
        trainer.save_checkpoint(checkpoint)
        trainer, rest = fit(config, args.out, args.devices, 6, resume=checkpoint)
        sampler = trainer.strategy.distributed_sampler_kwargs  # what the data module handed litdata
        report = {"straight": straight.seen, "resumed": first.seen + rest.seen,
                  "replicas": [sampler["num_replicas"], sampler["rank"]]}
        (args.out / f"{config['name']}-rank{trainer.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
