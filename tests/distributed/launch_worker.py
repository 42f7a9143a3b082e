"""A two-process job in which some ranks fail, launched by test_launch.py through Lightning's script launcher (it
starts rank 1 by running this file again). ``--fail`` says which ranks raise and where: ``rank1-train`` (rank 1
at the start of training, while rank 0 goes on into the step's collectives) or ``all-setup`` (every rank in setup,
with the same error). ``--marker`` only tags the processes so the test can look for survivors."""

import argparse
import sys
from pathlib import Path

import lightning as L

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from helpers import TINY, tiny_data, tiny_trainer  # noqa: E402

from lightning_p2r import M6Config, M6LanguageModel, P2RStrategy  # noqa: E402


class Fail(L.Callback):
    def __init__(self, where: str) -> None:
        self.where = where

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.where == "all-setup":
            raise ValueError("the test's refusal on every rank")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.where == "rank1-train" and trainer.global_rank == 1:
            raise RuntimeError("rank 1 failed on its own")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--fail", choices=["rank1-train", "all-setup"], required=True)
    parser.add_argument("--marker", required=True)
    args = parser.parse_args()
    trainer = tiny_trainer(args.out, devices=2, strategy=P2RStrategy(sharding="zero3"), max_steps=50,
                           callbacks=[Fail(args.fail)], limit_val_batches=0)
    trainer.fit(M6LanguageModel(M6Config(**TINY)), datamodule=tiny_data(args.out))


if __name__ == "__main__":
    main()
