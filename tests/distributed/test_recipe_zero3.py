"""recipes/zero3_pseudo_to_real.yaml end to end through `python -m lightning_p2r.cli` on 2 CPU processes: LightningCLI,
Lightning's launcher, ZeRO-3 with offload and layered accumulation, a delink mid-run, a sharded checkpoint and an
offline W&B run."""

import csv
from pathlib import Path

import pytest
from recipe_runs import run_command, unexpected_warnings

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_zero3_pseudo_to_real_recipe_runs_on_two_processes(tmp_path: Path, recipe_cache: Path) -> None:
    result = run_command(
        ["fit", "--config", str(ROOT / "recipes" / "zero3_pseudo_to_real.yaml"), "--trainer.max_steps=8",
         "--trainer.val_check_interval=4", "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false",
         "--trainer.log_every_n_steps=1", "--trainer.accelerator=cpu", "--data.tokenizer=bytes",
         "--data.vocab_size=256", "--model.optimizer.warmup_steps=1"], tmp_path, cache=recipe_cache)
    assert result.returncode == 0, result.stderr[-4000:]
    run_dir = tmp_path / "runs" / "zero3_pseudo_to_real"
    assert (run_dir / "checkpoints" / "last.ckpt" / "meta.pt").is_file()  # a sharded (DCP) checkpoint
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    rows = list(csv.DictReader((next((run_dir / "csv").glob("version_*")) / "metrics.csv").open()))
    delinks = [row for row in rows if row.get("p2r/blocks_after")]
    assert [(float(r["p2r/blocks_before"]), float(r["p2r/blocks_after"]), float(r["p2r/step"])) for r in delinks] \
        == [(1.0, 8.0, 2.0)]  # delink_at_fraction 0.25 of 8 steps
    assert any(row.get("val/loss") for row in rows)
    assert unexpected_warnings(result.stdout + result.stderr) == []  # quiet, as every recipe (issue 27)
