"""Two-process DDP run on CPU (gloo) that delinks mid-training; launched by test_ddp_delink.py.

Lightning's launcher starts rank 1 by re-running this script, so this file, not pytest, is what runs twice.
Each rank writes a fingerprint of its final weights and of the parameters DDP's reducer knows about.
"""

import argparse
import json
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from helpers import TINY, tiny_data  # noqa: E402

import lightning_p2r.callbacks.pseudo_to_real as p2r  # noqa: E402
from lightning_p2r import M6Config, M6LanguageModel, OptimizerConfig, PseudoToReal  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--no-rewrap", action="store_true", help="negative control: skip re-wrapping after delink")
    parser.add_argument("--growth", action="store_true",
                        help="a shallow pseudo model with shared experts: grown and upcycled at the delink step")
    args = parser.parse_args()
    if args.no_rewrap:
        p2r._rewrap = lambda trainer, pl_module: None

    L.seed_everything(5)
    growth = {"sharing": "cycle", "pseudo_depth": "shallow", "num_unique_experts": 1,
              "growth_init": "zero_outputs"} if args.growth else {}
    module = M6LanguageModel(M6Config(**(TINY | {"num_layers": 4, "num_unique_blocks": 1} | growth)),
                             OptimizerConfig(lr=1e-2, warmup_steps=1))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=6, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        limit_val_batches=0, callbacks=[PseudoToReal(delink_at_step=3)],
                        default_root_dir=args.out)
    trainer.fit(module, datamodule=tiny_data(args.out, batch_size=4))

    rank = trainer.global_rank
    ddp = trainer.strategy.model
    registered = sum(p.numel() for p in ddp.parameters() if p.requires_grad)
    flat = torch.cat([p.detach().flatten() for p in module.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(trainer.world_size)]
    torch.distributed.all_gather(gathered, flat)
    result = {
        "rank": rank,
        "blocks": len(module.transformer.blocks),
        "layers": module.transformer.num_layers,
        "params": sum(p.numel() for p in module.parameters()),
        "ddp_params": registered,
        "max_rank_difference": float((gathered[0] - gathered[1]).abs().max()),
    }
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    # Close the process group before the interpreter exits: left to exit-time destructors, gloo's threads were
    # seen to abort the process (SIGABRT, "terminate called without an active exception") after a good run.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
