"""The CLI as users run it: every recipe parses and instantiates; a short fit writes a checkpoint and a W&B run."""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from unittest import mock

import pytest
import yaml

from lightning_p2r import M6LanguageModel, TextDataModule
from lightning_p2r.cli import P2RCLI

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
# Recipes for another LightningModule (a `model.class_path`): the CLI runs them in subclass mode.
OTHER_MODEL_RECIPES = [p for p in RECIPES if "class_path" in (yaml.safe_load(p.read_text()).get("model") or {})]
M6_RECIPES = [p for p in RECIPES if p not in OTHER_MODEL_RECIPES]


def _cli(args: list[str]) -> P2RCLI:
    return P2RCLI(M6LanguageModel, TextDataModule, args=args, run=False, save_config_callback=None)


def test_there_are_recipes() -> None:
    assert {p.name for p in RECIPES} >= {"quickstart.yaml", "m6_moe_small.yaml", "dense_baseline.yaml"}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", M6_RECIPES, ids=lambda p: p.name)
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


@pytest.mark.parametrize("recipe", OTHER_MODEL_RECIPES, ids=lambda p: p.name)
def test_a_recipe_naming_its_model_class_instantiates_it_with_the_datas_vocabulary(recipe: Path, tmp_path: Path,
                                                                                    monkeypatch) -> None:
    from lightning.pytorch import LightningModule

    from lightning_p2r import CausalLMModule
    from lightning_p2r.cli.recipe_files import names_model_class

    monkeypatch.chdir(tmp_path)
    assert names_model_class(["fit", "--config", str(recipe)])
    cli = P2RCLI(LightningModule, TextDataModule, subclass_mode_model=True, args=["--config", str(recipe)], run=False,
                 save_config_callback=None)
    assert isinstance(cli.model, CausalLMModule)
    assert cli.model.hf_config["vocab_size"] == cli.datamodule.vocab_size  # linked from the data
    spelled = yaml.safe_load(recipe.read_text())["model"]["init_args"]["hf_config"]
    assert {k: cli.model.hf_config[k] for k in spelled} == spelled


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
@pytest.mark.slow
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


def test_the_console_script_is_the_command_line() -> None:
    """The ``lightning-p2r`` the README runs is installed and exits as ``main()`` does: 0 for help, 2 (the usage
    error) for an unknown command. Training through it is the next test's, by ``python -m lightning_p2r.cli``
    (the same ``main()``), which the suite's warm interpreters start without importing torch again."""
    script = shutil.which("lightning-p2r", path=sysconfig.get_path("scripts")) or shutil.which("lightning-p2r")
    assert script, "the lightning-p2r console script is not installed (pip install -e .)"
    shown = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "usage: lightning-p2r COMMAND" in shown.stdout
    wrong = subprocess.run([script, "fitt"], capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 2 and "did you mean 'fit'?" in wrong.stderr


@pytest.mark.slow
def test_quickstart_fit_writes_checkpoint_and_offline_wandb_run(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lightning_p2r.cli", "fit", "--config", str(ROOT / "recipes" / "quickstart.yaml"),
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


def _small_corpus(tmp_path: Path) -> Path:
    path = tmp_path / "small.txt"
    path.write_text("And the evening and the morning were the first day. " * 300, encoding="utf-8")
    return path


def _fit_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["fit", "--config", str(ROOT / "recipes" / "quickstart.yaml"), "--trainer.max_steps=2",
            "--trainer.log_every_n_steps=1",
            "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false", "--data.tokenizer=bytes",
            "--data.vocab_size=256", f"--data.corpus={_small_corpus(tmp_path)}", *extra]


@pytest.mark.slow
def test_a_runs_config_reused_under_another_root_writes_there(tmp_path: Path, monkeypatch) -> None:
    """The saved config.yaml held the checkpoint folder the CLI filled from the first run's root: reused with
    another --trainer.default_root_dir (as docs/generation.md suggests reusing it), the new run's checkpoints went
    into the first run's folder (a new-user audit). It keeps the folders as the recipe gave them."""
    from lightning_p2r.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    with mock.patch.dict(os.environ):
        main(_fit_args(tmp_path, "--trainer.default_root_dir=first", "--trainer.logger=false"))
        saved = yaml.safe_load((tmp_path / "first" / "config.yaml").read_text())
        dirpaths = [callback["init_args"].get("dirpath") for callback in saved["trainer"]["callbacks"]
                    if callback["class_path"].endswith("ModelCheckpoint")]
        assert dirpaths == [None]
        main(["fit", "--config", str(tmp_path / "first" / "config.yaml"), "--trainer.default_root_dir=second",
              "--trainer.max_steps=1"])
    assert (tmp_path / "second" / "checkpoints" / "last.ckpt").is_file()
    assert sorted(p.name for p in (tmp_path / "first" / "checkpoints").iterdir()) == ["last.ckpt"]


@pytest.mark.slow
def test_outputs_follow_the_root_dir_and_a_failing_call_leaves_the_run_alone(tmp_path: Path, monkeypatch,
                                                                             capsys) -> None:
    from lightning_p2r.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    # wandb.init in this process exports its service's address (WANDB_SERVICE...): restore the environment after,
    # or later subprocess tests would talk to this process's W&B service.
    with mock.patch.dict(os.environ):
        main(_fit_args(tmp_path, "--trainer.default_root_dir=elsewhere/run"))
    run = tmp_path / "elsewhere" / "run"
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert (run / "config.yaml").is_file() and list((run / "wandb").glob("offline-run-*"))
    assert list((run / "csv").glob("version_*/metrics.csv"))
    assert not (tmp_path / "runs").exists()  # nothing under the recipe's own root
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and "wandb" not in p.parts}

    # A call that fails in setup (micro-batches that do not divide the batch) must not touch the run's files.
    with pytest.raises(BaseException):  # noqa: B017 (a ValueError from setup, or SystemExit from the parser)
        main(_fit_args(tmp_path, "--trainer.default_root_dir=elsewhere/run", "--model.config.num_heads=5"))
    with pytest.raises(BaseException):  # noqa: B017
        main(_fit_args(tmp_path, "--trainer.default_root_dir=elsewhere/run",
                       "--trainer.strategy=lightning_p2r.P2RStrategy", "--trainer.strategy.accumulation=layered",
                       "--trainer.strategy.micro_batches=5"))
    after = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and "wandb" not in p.parts}
    assert after == before


@pytest.mark.slow
def test_ckpt_path_last_resumes_the_newest_run_and_overrides_are_refused(tmp_path: Path, monkeypatch,
                                                                         capsys) -> None:
    import torch

    from lightning_p2r.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    main(_fit_args(tmp_path, "--trainer.logger=false"))
    main(_fit_args(tmp_path, "--trainer.logger=false", "--trainer.max_steps=3"))  # a second run, same root
    checkpoints = tmp_path / "runs" / "quickstart" / "checkpoints"
    assert {p.name for p in checkpoints.glob("last*.ckpt")} == {"last.ckpt", "last-v1.ckpt"}
    newest = torch.load(checkpoints / "last-v1.ckpt", weights_only=True)["global_step"]
    assert newest == 3

    cli = P2RCLI(M6LanguageModel, TextDataModule, run=False, args=_fit_args(
        tmp_path, "--trainer.logger=false", "--trainer.max_steps=5")[1:])
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path="last")
    assert cli.trainer.global_step == 5  # resumed at 3 (the newest), not at 2
    import warnings

    with warnings.catch_warnings(record=True) as caught:  # resuming writes into its own, non-empty folder
        warnings.simplefilter("always")
        main(_fit_args(tmp_path, "--trainer.logger=false", "--trainer.max_steps=6", "--ckpt_path=last"))
    assert not [w for w in caught if "exists and is not empty" in str(w.message)]

    with pytest.raises(SystemExit):
        main(_fit_args(tmp_path, "--trainer.logger=false", "--model.config.num_layers=6",
                       "--model.optimizer.lr=0.01", f"--ckpt_path={checkpoints / 'last.ckpt'}"))
    err = capsys.readouterr().err
    assert "model.config.num_layers=6 (the checkpoint has 4)" in err
    assert "model.optimizer.lr=0.01 (the checkpoint has 0.003)" in err
    assert "drop these options" in err


@pytest.mark.slow
def test_resuming_with_other_options_through_the_python_api_is_refused(tmp_path: Path, monkeypatch) -> None:
    from lightning_p2r.cli import main

    monkeypatch.chdir(tmp_path)
    main(_fit_args(tmp_path, "--trainer.logger=false"))
    cli = P2RCLI(M6LanguageModel, TextDataModule, run=False, args=_fit_args(
        tmp_path, "--trainer.logger=false", "--trainer.max_steps=4", "--model.config.dropout=0.3")[1:])
    with pytest.raises(ValueError, match=r"model.config.dropout=0.3 \(the checkpoint has 0.0\)"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path="last")


@pytest.mark.parametrize("name", ["lightning_p2r.P2RStrategy", "p2r"])
def test_the_strategy_by_class_path_or_name_with_no_init_args_uses_its_defaults(name: str, tmp_path: Path,
                                                                                monkeypatch) -> None:
    from lightning_p2r import P2RStrategy

    monkeypatch.chdir(tmp_path)
    cli = _cli(["--config", str(ROOT / "recipes" / "quickstart.yaml"), f"--trainer.strategy={name}",
                "--trainer.logger=false"])
    assert isinstance(cli.trainer.strategy, P2RStrategy)
    assert cli.trainer.strategy.sharding == "none" and cli.trainer.strategy.offload_fraction is None


def test_a_mistyped_option_gets_one_short_error_with_a_suggestion(tmp_path: Path, monkeypatch, capsys) -> None:
    from lightning_p2r.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(ROOT / "recipes" / "quickstart.yaml"), "--trainer.max_stpes=3"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 3, err  # usage line, --help tip, the error; not the whole option list
    assert "unrecognized arguments: --trainer.max_stpes=3" in err[-1]
    assert "--trainer.max_steps" in err[-1]


@pytest.mark.parametrize(("typed", "meant"), [
    ("--strategy.sharding=zero3", "--trainer.strategy.sharding"),  # P2RStrategy's keyword, outside its section
    ("--model.lr=0.01", "--model.optimizer.lr"),
    ("--lr=0.01", "--model.optimizer.lr"),
    ("--num_layers=8", "--model.config.num_layers"),
])
def test_an_option_in_the_wrong_section_is_named_where_it_lives(tmp_path: Path, monkeypatch, capsys, typed: str,
                                                                 meant: str) -> None:
    from lightning_p2r.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(ROOT / "recipes" / "quickstart.yaml"), typed])
    assert f"(did you mean: {typed.split('=')[0]} -> {meant}?)" in capsys.readouterr().err


def test_a_mistyped_strategy_option_is_named_with_the_closest_one(tmp_path: Path, monkeypatch, capsys) -> None:
    from lightning_p2r.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(ROOT / "recipes" / "zero3_pseudo_to_real.yaml"),
              "--trainer.strategy.init_args.shardng=zero3"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: trainer.strategy: option 'shardng' is not accepted (did you mean 'sharding'?)" in err


def test_a_mistyped_precision_lists_the_values_and_the_nearest(tmp_path: Path, monkeypatch, capsys) -> None:
    """jsonargparse named only the last of the option's types it tried: "Expected a <class 'NoneType'>"."""
    from lightning_p2r.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(ROOT / "recipes" / "zero3_pseudo_to_real.yaml"), "--trainer.precision=bf17-mixed"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: trainer.precision: expected one of ") and "'bf16-true', 'bf16-mixed'" in err
    assert err.endswith("got 'bf17-mixed' (did you mean 'bf16-mixed'?)")


def test_strategy_options_on_a_recipe_without_a_strategy_class_say_what_to_add(tmp_path: Path, monkeypatch,
                                                                               capsys) -> None:
    from lightning_p2r.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(ROOT / "recipes" / "quickstart.yaml"),
              "--trainer.strategy.init_args.sharding=zero3"])
    assert "pass --trainer.strategy=lightning_p2r.P2RStrategy before" in capsys.readouterr().err


def test_scoring_last_where_the_run_has_no_last_checkpoint_is_refused(tmp_path: Path) -> None:
    """`validate --ckpt_path last` in a folder without last*.ckpt printed the untrained model's val/loss (7.64 for a
    2048-token vocabulary) with status 0 and only Lightning's warning; fit keeps Lightning's meaning (start afresh)."""
    from lightning_p2r.cli.fit import missing_last_problem

    folder = tmp_path / "checkpoints"
    problem = missing_last_problem("validate", "last", [folder])
    assert problem == (f"--ckpt_path last: there is no last*.ckpt in {folder}, and validate would run the untrained "
                       "model: pass the run's --trainer.default_root_dir, or a checkpoint path")
    assert "no checkpoint folder (the recipe has no ModelCheckpoint)" in missing_last_problem("predict", "last", [])
    assert missing_last_problem("fit", "last", [folder]) is None
    assert missing_last_problem("test", str(tmp_path / "x.ckpt"), [folder]) is None
    folder.mkdir()
    (folder / "epoch=0.ckpt").write_bytes(b"")
    assert missing_last_problem("test", "last", [folder]) is not None  # only last*.ckpt is what "last" names
    (folder / "last-v1.ckpt").write_bytes(b"")
    assert missing_last_problem("test", "last", [folder]) is None


def test_an_unknown_strategy_name_gets_the_closest_ones() -> None:
    """Lightning refused `--trainer.strategy=P2RStrategy` (the class without its module) with a few example names
    and its documentation's address, nothing pointing to lightning_p2r.P2RStrategy."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_p2r.cli.fit import unknown_strategy_problem

    registered = StrategyRegistry.available_strategies()
    assert unknown_strategy_problem("P2RStrategy", registered).startswith(
        "--trainer.strategy: 'P2RStrategy' is no strategy Lightning has registered: did you mean "
        "lightning_p2r.P2RStrategy or p2r? (")
    assert "is not an importable Strategy class: did you mean lightning_p2r.P2RStrategy" in unknown_strategy_problem(
        "lightning_p2r.P2RStrategi", registered)
    assert "did you mean ddp?" in unknown_strategy_problem("dpp", registered)
    for accepted in ("auto", "p2r", "DDP", "fsdp"):
        assert unknown_strategy_problem(accepted, registered) is None
