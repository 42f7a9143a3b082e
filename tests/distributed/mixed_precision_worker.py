"""Models trained a few steps under ``bf16-mixed`` or ``bf16-true`` with tensor parallelism or ZeRO on 2 CPU
processes (gloo), counting the last step's collectives (``P2RStrategy(count_collectives=True)``); launched by
test_mixed_precision_counts.py. Rank 0 writes ``<name>.json``: each rank's bytes and calls by kind."""

import json
from pathlib import Path

import torch.distributed as dist
from rank_slices import run_configs

from lightning_p2r import P2RStrategy
from lightning_p2r.measure.run import fit_on_random_tokens


def run(config: dict, out: Path, devices: int) -> None:
    spec = {"devices": devices, "steps": 2, "global_batch": config["global_batch"], "precision": config["precision"],
            "seq_len": config["seq_len"]} | ({"hf_config": config["hf_config"]} if "hf_config" in config
                                              else {"model": config["model"]})
    strategy = P2RStrategy(count_collectives=True, log_telemetry=False, **config["strategy"])
    trainer, _, _ = fit_on_random_tokens(spec, strategy, warmup=1)
    last = strategy.collectives_history[-1]
    counted = [None] * trainer.world_size
    dist.all_gather_object(counted, {"bytes": dict(last.bytes), "calls": dict(last.calls)})
    if trainer.global_rank == 0:
        (out / f"{config['name']}.json").write_text(json.dumps(counted))
    dist.barrier()


if __name__ == "__main__":
    run_configs(run)
