"""The CLI as users run it: every recipe parses and instantiates; a short fit writes a checkpoint and a W&B run."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_p2r import M6LanguageModel, TextDataModule
from lightning_p2r.cli import P2RCLI

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def _cli(args: list[str]) -> P2RCLI:
    return P2RCLI(M6LanguageModel, TextDataModule, args=args, run=False, save_config_callback=None)


def test_there_are_recipes() -> None:
    assert {p.name for p in RECIPES} >= {"quickstart.yaml", "m6_moe_small.yaml", "dense_baseline.yaml"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_instantiates_through_lightning_cli(recipe: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # recipes write under runs/; keep that inside the test's folder
    cli = _cli(["--config", str(recipe)])
    assert isinstance(cli.model, M6LanguageModel)
    assert isinstance(cli.datamodule, TextDataModule)
    assert cli.model.config.vocab_size == cli.datamodule.vocab_size
    assert cli.model.config.max_seq_len == cli.datamodule.seq_len
    spelled = yaml.safe_load(recipe.read_text())["model"]["config"]
    for key, value in spelled.items():
        assert getattr(cli.model.config, key) == value, key


def test_dense_baseline_has_no_moe_layer(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cli = _cli(["--config", str(ROOT / "recipes" / "dense_baseline.yaml")])
    cli.model.configure_model()
    assert not any(block.is_moe for block in cli.model.transformer.blocks)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--model.config.num_experts=0", "num_experts"),
        ("--model.config.num_unique_blocks=3", "num_unique_blocks"),
        ("--model.config.attention=sparse", "attention"),
        ("--model.optimizer.lr=-1", "lr"),
        ("--data.val_fraction=1.5", "val_fraction"),
        ("--data.corpus=/nonexistent/corpus.txt", "/nonexistent/corpus.txt"),
    ],
)
def test_bad_values_fail_at_parse_time(override: str, message: str, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        _cli(["--config", str(ROOT / "recipes" / "quickstart.yaml"), override])
    assert exit_info.value.code != 0
    assert message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("content", "message"), [(b"", "empty"), (b"fine text \xff\xfe more", "UTF-8")])
def test_bad_corpus_fails_before_the_first_step(content: bytes, message: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(content)
    cli = _cli(["--config", str(ROOT / "recipes" / "quickstart.yaml"), f"--data.corpus={corpus}",
                "--data.tokenizer=bytes", "--data.vocab_size=256", "--trainer.logger=false"])
    steps = []
    cli.model.on_train_batch_start = lambda *args: steps.append(1)
    with pytest.raises(ValueError, match=message) as error:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert "corpus.txt" in str(error.value)
    assert steps == []
    assert not (tmp_path / "runs" / "quickstart" / "checkpoints").exists()


@pytest.mark.slow
def test_quickstart_fit_writes_checkpoint_and_offline_wandb_run(tmp_path: Path) -> None:
    # The console script the README runs: it passes main()'s return value to sys.exit, so this also checks the
    # exit status of a successful run is 0.
    script = shutil.which("lightning-p2r", path=str(Path(sys.executable).parent)) or shutil.which("lightning-p2r")
    assert script, "the lightning-p2r console script is not installed (pip install -e .)"
    result = subprocess.run(
        [script, "fit", "--config", str(ROOT / "recipes" / "quickstart.yaml"),
         "--trainer.max_steps=6", "--trainer.val_check_interval=3", "--trainer.limit_val_batches=2",
         "--trainer.enable_progress_bar=false", "--trainer.log_every_n_steps=1", "--data.tokenizer=bytes",
         "--data.vocab_size=256"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env=os.environ | {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "quickstart"
    assert (run_dir / "checkpoints" / "last.ckpt").exists()
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert (run_dir / "config.yaml").exists()
    metrics = (next((run_dir / "csv").glob("version_*")) / "metrics.csv").read_text()
    assert "val/loss" in metrics and "train/loss" in metrics


def test_pseudo_to_real_recipe_delinks_during_a_short_fit(tmp_path: Path, monkeypatch) -> None:
    from lightning_p2r import PseudoToReal

    monkeypatch.chdir(tmp_path)
    cli = _cli(["--config", str(ROOT / "recipes" / "pseudo_to_real.yaml"), "--trainer.logger=false",
                "--trainer.max_steps=4", "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
                "--data.tokenizer=bytes", "--data.vocab_size=256", f"--data.corpus={_small_corpus(tmp_path)}"])
    callback = next(c for c in cli.trainer.callbacks if isinstance(c, PseudoToReal))
    assert cli.model.config.num_unique_blocks == 1
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert [e.step for e in callback.events] == [1]
    assert len(cli.model.transformer.blocks) == 8
    assert (tmp_path / "runs" / "pseudo_to_real" / "checkpoints" / "last.ckpt").exists()


def _small_corpus(tmp_path: Path) -> Path:
    path = tmp_path / "small.txt"
    path.write_text("And the evening and the morning were the first day. " * 300, encoding="utf-8")
    return path
