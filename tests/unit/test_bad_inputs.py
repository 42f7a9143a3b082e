"""A catalogue of wrong configurations and inputs, as a new user makes them (issue 13 item 16).

Each case asserts a clear error that names the option (or file) and what to do instead, raised before training
starts, and that no file of an earlier run changed. Python API cases build the object; CLI cases run the console
entry point next to an earlier run's files; checkpoint and data cases go through ``Trainer.fit``.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers import TINY, flip_inside_largest_item, flip_inside_largest_record, tiny_data, tiny_trainer

from lightning_p2r import M6Config, M6LanguageModel, OptimizerConfig, P2RStrategy, TextDataModule, delink
from lightning_p2r.cli import main
from lightning_p2r.strategy.checkpoint import check_checkpoint_path

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "recipes" / "quickstart.yaml")
DENSE = TINY | {"moe_layers": []}

# ---------------------------------------------------------------------------------------------- Python API
API_CASES: list[tuple[str, Callable[[], Any], str]] = [
    ("no experts", lambda: M6Config(num_experts=0), r"M6Config.num_experts must be >= 1"),
    ("heads not dividing dim", lambda: M6Config(dim=30, num_heads=4), r"num_heads \(4\) must divide dim \(30\)"),
    ("unique blocks not dividing depth", lambda: M6Config(num_layers=4, num_unique_blocks=3),
     r"num_unique_blocks \(3\) must divide num_layers \(4\)"),
    ("top-k above experts per prototype", lambda: M6Config(num_experts=4, num_prototypes=2, moe_top_k=3),
     r"moe_top_k \(3\) must be <= experts per prototype \(2\)"),
    ("prototypes not dividing experts", lambda: M6Config(num_prototypes=3, num_experts=4),
     r"num_prototypes \(3\) must divide num_experts \(4\)"),
    ("zero capacity", lambda: M6Config(capacity_factor=0), r"capacity_factor must be > 0 or None \(dropless\)"),
    ("dropout of 1.5", lambda: M6Config(dropout=1.5), r"dropout must be in \[0, 1\)"),
    ("unknown attention", lambda: M6Config(attention="sparse"),
     r"attention must be one of \['dense', 'alternating', 'local'\]"),
    ("window of 0", lambda: M6Config(sparse_window=0), r"sparse_window must be >= 1"),
    ("empty vocabulary", lambda: M6Config(vocab_size=0), r"vocab_size must be >= 1"),
    ("MoE layer past the depth", lambda: M6Config(num_layers=4, moe_layers=[9]),
     r"moe_layers has layer indices outside \[0, 4\): \[9\]"),
    ("negative jitter", lambda: M6Config(router_jitter=-1), r"router_jitter must be >= 0.0"),
    ("jitter that can flip the router input", lambda: M6Config(router_jitter=1.5),
     r"router_jitter must be in \[0, 1\)"),
    ("negative init seed", lambda: M6Config(init_seed=-1), r"init_seed must be a non-negative integer or None"),
    ("unknown positions", lambda: M6Config(position_embedding="alibi"),
     r"position_embedding must be one of \['rotary', 'learned'\]"),
    ("negative lr", lambda: OptimizerConfig(lr=-1), r"OptimizerConfig.lr must be >= 0"),
    ("beta of 1.2", lambda: OptimizerConfig(betas=(1.2, 0.9)), r"betas must be two values in \[0, 1\)"),
    ("negative weight decay", lambda: OptimizerConfig(weight_decay=-1), r"weight_decay must be >= 0"),
    ("min lr ratio of 2", lambda: OptimizerConfig(min_lr_ratio=2), r"min_lr_ratio must be in \[0, 1\]"),
    ("negative warmup", lambda: OptimizerConfig(warmup_steps=-3), r"warmup_steps must be >= 0"),
    ("ZeRO stage 4", lambda: P2RStrategy(sharding="zero4"),
     r"sharding must be one of \('none', 'zero1', 'zero2', 'zero3'\)"),
    ("offload 150%", lambda: P2RStrategy(offload_fraction=1.5), r"offload_fraction must be in \[0, 1\]"),
    ("unknown accumulation", lambda: P2RStrategy(accumulation="wide"),
     r"accumulation must be 'standard' or 'layered'"),
    ("no micro-batches", lambda: P2RStrategy(accumulation="layered", micro_batches=0),
     r"micro_batches must be an integer >= 1"),
    ("micro-batches without layered", lambda: P2RStrategy(micro_batches=2),
     r"micro_batches applies to accumulation='layered'.*accumulate_grad_batches"),
    ("negative block index", lambda: P2RStrategy(offload_blocks=[-1]), r"offload_blocks must be block indices >= 0"),
    ("two offload selectors", lambda: P2RStrategy(offload_fraction=0.5, offload_blocks=[0]),
     r"takes one of offload_fraction, offload_blocks, device_memory_budget"),
    ("recompute without layered", lambda: P2RStrategy(recompute=True), r"recompute applies to accumulation='layered'"),
    ("negative budget", lambda: P2RStrategy(device_memory_budget=-5), r"device_memory_budget must be > 0"),
    ("zero budget as a size", lambda: P2RStrategy(device_memory_budget="0GB"), r"device_memory_budget must be > 0"),
    # A number is bytes: 0.5 read as 0 bytes at setup, "smaller than the least this model needs".
    ("a share for the budget", lambda: P2RStrategy(device_memory_budget=0.5),
     r"device_memory_budget=0.5 is bytes, less than one: .* write '50%', .* offload_fraction=0.5"),
    ("a share for the budget, as a string", lambda: P2RStrategy(device_memory_budget="0.25"),
     r"device_memory_budget='0.25' is bytes, less than one: .* write '25%'"),
    ("a budget in bits or bytes", lambda: P2RStrategy(device_memory_budget="12Gb"),
     r"device_memory_budget '12Gb' is ambiguous, bits to some readers and bytes to others: write '12GB'"),
    ("a budget in lowercase", lambda: P2RStrategy(device_memory_budget="512mib"),
     r"device_memory_budget '512mib' is ambiguous.*write '512MiB'"),
    ("an allowance in bits or bytes", lambda: P2RStrategy(device_memory_budget="8GB", activation_allowance="1 gb"),
     r"activation_allowance '1 gb' is ambiguous.*write '1GB'"),
    ("an infinite budget", lambda: P2RStrategy(device_memory_budget=float("inf")),
     r"device_memory_budget must be a finite number of bytes, got inf"),
    ("negative activation allowance",
     lambda: P2RStrategy(device_memory_budget="8GB", activation_allowance=-1), r"activation_allowance must be >= 0"),
    ("activation allowance as a percentage",
     lambda: P2RStrategy(device_memory_budget="8GB", activation_allowance="10%"), r"activation_allowance .*percentage"),
    ("activation allowance not a size",
     lambda: P2RStrategy(device_memory_budget="8GB", activation_allowance="lots"), r"activation_allowance 'lots'"),
    ("activation allowance without a budget", lambda: P2RStrategy(activation_allowance="2GB"),
     r"activation_allowance='2GB' reserves part of device_memory_budget.*no device_memory_budget"),
    # A value of another type than the option's (a new-user audit): named with the type, before any comparison.
    ("a word for the offload share", lambda: P2RStrategy(offload_fraction="half"),
     r"offload_fraction must be a number or None, got 'half' \(str\)"),
    ("True for the offload share", lambda: P2RStrategy(offload_fraction=True),
     r"offload_fraction must be a number or None, got True \(bool\)"),
    ("a fractional prefetch", lambda: P2RStrategy(prefetch=1.5), r"prefetch must be an integer, got 1.5 \(float\)"),
    ("True as a block index", lambda: P2RStrategy(offload_blocks=[True]),
     r"offload_blocks must be a list of integers or None, got \[True\]"),
    ("blocks as one string", lambda: P2RStrategy(offload_blocks="0,1"),
     r"offload_blocks must be block indices >= 0, got '0,1'"),
    ("1 for pinned memory", lambda: P2RStrategy(pin_memory=1), r"pin_memory must be True, False or 'auto', got 1"),
    ("unknown tokenizer", lambda: TextDataModule(tokenizer="wordpiece"), r"tokenizer must be one of 'bpe', 'bytes'"),
    ("bytes with 300 ids", lambda: TextDataModule(tokenizer="bytes", vocab_size=300),
     r"vocab_size must be 256 \(or None\) with tokenizer='bytes'"),
    ("BPE below 512", lambda: TextDataModule(tokenizer="bpe", vocab_size=100),
     r"vocab_size must be >= 512 with tokenizer='bpe'"),
    ("sequence of 0", lambda: TextDataModule(seq_len=0), r"seq_len must be an integer >= 1"),
    ("batch of 0", lambda: TextDataModule(batch_size=0), r"batch_size must be an integer >= 1"),
    ("no validation split", lambda: TextDataModule(val_fraction=0), r"val_fraction must be strictly between 0 and 1"),
    ("negative workers", lambda: TextDataModule(num_workers=-1), r"num_workers must be an integer >= 0"),
    ("a batch of True", lambda: TextDataModule(batch_size=True), r"batch_size must be an integer >= 1, got True"),
    ("a fractional sequence", lambda: TextDataModule(seq_len=64.5), r"seq_len must be an integer >= 1, got 64.5"),
    ("negative data seed", lambda: TextDataModule(seed=-1), r"data.seed must be an integer between 0 and 4294967295"),
    ("data seed past 32 bits", lambda: TextDataModule(seed=2**32), r"data.seed must be an integer between 0 and"),
    ("missing corpus", lambda: TextDataModule(corpus="/nonexistent/corpus.txt"),
     r"/nonexistent/corpus.txt does not exist. Pass corpus='kjv'"),
    ("delink before the model is built",
     lambda: delink(M6LanguageModel(M6Config(**(DENSE | {"num_unique_blocks": 1})))),
     r"call model.configure_model\(\) first"),
]


def test_the_type_check_takes_what_the_options_took_before_it() -> None:
    """Byte sizes as floats (``parse_bytes`` reads 12e9) and block indices as any sequence of integers."""
    strategy = P2RStrategy(device_memory_budget=40e9, activation_allowance=2e9, offload_states=("grads", "optimizer"))
    assert strategy.offload_config.device_memory_budget == 40e9
    assert P2RStrategy(offload_blocks=range(2)).offload_config.offload_blocks == range(2)
    assert P2RStrategy(offload_blocks=(0, 1)).offload_config.offload_blocks == (0, 1)


@pytest.mark.parametrize(("build", "message"), [case[1:] for case in API_CASES], ids=[case[0] for case in API_CASES])
def test_python_api_refuses_with_a_message_naming_the_option(build: Callable[[], Any], message: str) -> None:
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        build()


# --------------------------------------------------------------------------------------------------- the CLI
def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An earlier run of the quickstart recipe in <root>/runs/quickstart: config, checkpoint and CSV logs."""
    root = tmp_path_factory.mktemp("earlier")
    corpus = root / "corpus.txt"
    corpus.write_text("And the evening and the morning were the first day. " * 300, encoding="utf-8")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        patch.setenv("LIGHTNING_P2R_CACHE", str(root / "cache"))
        main(["fit", "--config", QUICKSTART, "--trainer.max_steps=2", "--trainer.limit_val_batches=0",
              "--trainer.enable_progress_bar=false", "--trainer.logger=false", "--data.tokenizer=bytes",
              "--data.vocab_size=256",
              f"--data.corpus={corpus}"])
        # A sharded checkpoint too (ZeRO-3 on one process) and things that are not checkpoints.
        module = M6LanguageModel(M6Config(**DENSE), OptimizerConfig(warmup_steps=1))
        trainer = tiny_trainer(root / "sharded_run", strategy=P2RStrategy(sharding="zero3"), max_steps=1,
                               limit_val_batches=0)
        trainer.fit(module, datamodule=tiny_data(root / "sharded_run"))
        trainer.save_checkpoint(root / "sharded.ckpt")
    (root / "empty.ckpt").write_bytes(b"")
    (root / "corrupt.ckpt").write_bytes(b"PK\x03\x04 this is not a zip archive" * 10)
    good = (root / "runs" / "quickstart" / "checkpoints" / "last.ckpt").read_bytes()
    (root / "truncated.ckpt").write_bytes(good[: len(good) // 2])
    (root / "not_a_checkpoint").mkdir()
    torch.save([1, 2, 3], root / "a_list.ckpt")
    # Damaged copies that load without a word: bytes flipped inside a tensor, a shard lost.
    (root / "flipped.ckpt").write_bytes(good)
    flip_inside_largest_record(root / "flipped.ckpt")
    shutil.copytree(root / "sharded.ckpt", root / "sharded_flipped.ckpt")
    flip_inside_largest_item(root / "sharded_flipped.ckpt")
    shutil.copytree(root / "sharded.ckpt", root / "sharded_shard_lost.ckpt")
    next((root / "sharded_shard_lost.ckpt").glob("*.distcp")).unlink()
    return root


CLI_CASES: list[tuple[str, list[str], str]] = [
    ("typo in an option", ["--trainer.max_stpes=3"], r"did you mean: --trainer.max_stpes -> --trainer.max_steps"),
    ("a truncated option name", ["--model.config.num_expert=8"],
     r"unrecognized arguments: --model.config.num_expert=8 .*-> --model.config.num_experts"),
    ("heads not dividing dim", ["--model.config.num_heads=5"], r"num_heads \(5\) must divide dim \(128\)"),
    ("unknown ZeRO stage", ["--trainer.strategy=lightning_p2r.P2RStrategy", "--trainer.strategy.sharding=zero4"],
     r"trainer.strategy.sharding: expected one of \['none', 'zero1', 'zero2', 'zero3'\]. Got value: zero4"),
    ("offload 200%", ["--trainer.strategy=lightning_p2r.P2RStrategy", "--trainer.strategy.offload_fraction=2"],
     r"P2RStrategy.offload_fraction must be in \[0, 1\], got 2.0"),
    ("a word for the offload share", ["--trainer.strategy=lightning_p2r.P2RStrategy",
                                      "--trainer.strategy.offload_fraction=half"],
     r"trainer.strategy.offload_fraction: expected a number or null, got 'half'$"),
    ("a string for an integer", ["--model.config.dim=abc"], r"model.config.dim: expected a <class 'int'>"),
    ("missing corpus", ["--data.corpus=/nonexistent/corpus.txt"], r"/nonexistent/corpus.txt does not exist"),
    ("BPE vocabulary too small", ["--data.tokenizer=bpe", "--data.vocab_size=100"], r"vocab_size must be >= 512"),
    ("negative lr", ["--model.optimizer.lr=-1"], r"OptimizerConfig.lr must be >= 0"),
    ("missing checkpoint", ["--ckpt_path=missing.ckpt"], r"missing.ckpt does not exist.*--ckpt_path last"),
    ("empty checkpoint", ["--ckpt_path={root}/empty.ckpt"], r"empty.ckpt is empty \(0 bytes"),
    ("corrupt checkpoint", ["--ckpt_path={root}/corrupt.ckpt"], r"corrupt.ckpt cannot be loaded: it is truncated"),
    ("truncated checkpoint", ["--ckpt_path={root}/truncated.ckpt"], r"truncated.ckpt cannot be loaded"),
    ("a list saved as a checkpoint", ["--ckpt_path={root}/a_list.ckpt"], r"is not a Lightning checkpoint"),
    ("a checkpoint with flipped bytes", ["--ckpt_path={root}/flipped.ckpt"],
     r"flipped.ckpt is damaged: record .* fails its check \(Bad CRC-32.*use another checkpoint"),
    ("a sharded checkpoint with flipped bytes", ["--trainer.strategy=lightning_p2r.P2RStrategy",
                                                 "--ckpt_path={root}/sharded_flipped.ckpt"],
     r"sharded_flipped.ckpt is damaged: __0_0.distcp, item .* fails its check"),
    ("a sharded checkpoint with a shard lost", ["--trainer.strategy=lightning_p2r.P2RStrategy",
                                                "--ckpt_path={root}/sharded_shard_lost.ckpt"],
     r"sharded_shard_lost.ckpt is damaged: __0_0.distcp is missing"),
    ("a folder that is no checkpoint", ["--ckpt_path={root}/not_a_checkpoint"],
     r"is a directory but not a sharded checkpoint"),
    ("a sharded checkpoint without P2RStrategy", ["--ckpt_path={root}/sharded.ckpt"],
     r"sharded checkpoint.*strategy lightning_p2r.P2RStrategy.*lightning-p2r convert-checkpoint"),
    ("resume with another depth", ["--ckpt_path={root}/runs/quickstart/checkpoints/last.ckpt",
                                   "--model.config.num_layers=6"],
     r"model.config.num_layers=6 \(the checkpoint has 4\).*drop these options"),
    ("resume the newest run with another depth", ["--ckpt_path=last", "--model.config.num_layers=6"],
     r"model.config.num_layers=6 \(the checkpoint has 4\).*drop these options"),
    # Trainer options Lightning takes and then fails on at the first batch, or runs as another value.
    ("no batch per optimizer step", ["--trainer.accumulate_grad_batches=0"],
     r"--trainer.accumulate_grad_batches must be an integer >= 1 .*got 0"),
    ("validation every 0 batches", ["--trainer.val_check_interval=0"],
     r"--trainer.val_check_interval must be > 0 .*--trainer.limit_val_batches=0"),
    ("validation every 0 epochs", ["--trainer.check_val_every_n_epoch=0"],
     r"--trainer.check_val_every_n_epoch must be an integer >= 1 or null"),
    ("a negative clipping norm", ["--trainer.gradient_clip_val=-1.0"],
     r"--trainer.gradient_clip_val must be >= 0 .*would train unclipped"),
    # Lightning's own refusal of a Trainer option (a MisconfigurationException, no ValueError).
    ("negative max steps", ["--trainer.max_steps=-5"], r"`max_steps` must be a non-negative integer or -1"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("extra", "message"), [case[1:] for case in CLI_CASES], ids=[case[0] for case in CLI_CASES])
def test_the_cli_refuses_in_one_message_and_leaves_the_earlier_run_alone(
        extra: list[str], message: str, earlier_run: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(earlier_run)
    monkeypatch.setenv("LIGHTNING_P2R_CACHE", str(earlier_run / "cache"))
    before = _digest(earlier_run / "runs")
    args = ["fit", "--config", QUICKSTART, "--trainer.max_steps=4", "--trainer.logger=false",
            "--data.tokenizer=bytes", "--data.vocab_size=256", f"--data.corpus={earlier_run / 'corpus.txt'}"]
    with pytest.raises(SystemExit) as exit_info:
        main(args + [item.format(root=earlier_run) for item in extra])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: ")
    assert re.search(message, error), error
    assert _digest(earlier_run / "runs") == before


@pytest.mark.slow
def test_a_resume_past_a_schedule_ending_at_rate_zero_is_refused_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A resumed run's global_step is the checkpoint's: a refusal before this command's first batch (here the
    schedule check at train start) is still the user's input, one line and status 2, not a traceback."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LIGHTNING_P2R_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("And the evening and the morning were the first day. " * 300, encoding="utf-8")
    args = ["fit", "--config", QUICKSTART, "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
            "--trainer.logger=false", "--data.tokenizer=bytes", "--data.vocab_size=256", f"--data.corpus={corpus}",
            "--model.optimizer.warmup_steps=0", "--model.optimizer.min_lr_ratio=0"]
    main(args + ["--trainer.max_steps=2"])
    before = _digest(tmp_path / "runs")
    with pytest.raises(SystemExit) as exit_info:
        main(args + ["--trainer.max_steps=4", "--ckpt_path=last"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: this run goes to step 4") and "learning rate 0, training nothing" in error
    assert _digest(tmp_path / "runs") == before


# ------------------------------------------------------------------------------ checkpoints and data in fit
def _fit_refused(tmp_path: Path, message: str, *, config: dict | None = None, data: TextDataModule | None = None,
                 strategy: P2RStrategy | None = None, ckpt_path: Any = None,
                 trainer_options: dict[str, Any] | None = None) -> None:
    module = M6LanguageModel(M6Config(**(config or DENSE)), OptimizerConfig(warmup_steps=1))
    steps: list[int] = []
    module.on_train_batch_start = lambda *args: steps.append(1)
    trainer = tiny_trainer(tmp_path, strategy=strategy or P2RStrategy(), max_steps=2, limit_val_batches=0,
                           **(trainer_options or {}))
    with pytest.raises(ValueError, match=message):
        trainer.fit(module, datamodule=data or tiny_data(tmp_path), ckpt_path=ckpt_path)
    assert steps == []  # refused before the first batch


class _NotAllowed:
    """A custom class a weights-only load refuses."""


FIT_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("tokenizer larger than the embedding", {"config": DENSE | {"vocab_size": 64}},
     r"tokenizer has 256 ids but M6Config.vocab_size is 64.*Set model.config.vocab_size to at least 256"),
    ("micro-batches not dividing the batch", {"strategy": "layered3"},
     r"micro_batches=3\) must divide the batch size.*choose micro_batches among \[1, 2, 4\]"),
    ("empty checkpoint through P2RStrategy", {"ckpt_path": "empty.ckpt"}, r"empty.ckpt is empty"),
    ("checkpoint holding a custom class", {"ckpt_path": "custom.ckpt"},
     r"custom.ckpt cannot be loaded: it holds Python objects that a weights-only load refuses"),
    ("checkpoint with flipped bytes through P2RStrategy", {"ckpt_path": "flipped.ckpt"},
     r"flipped.ckpt is damaged: record .* fails its check"),
    ("no batch per optimizer step through the Trainer", {"trainer_options": {"accumulate_grad_batches": 0}},
     r"Trainer\(accumulate_grad_batches=...\) must be an integer >= 1 .*got 0"),
]


@pytest.mark.parametrize(("case", "message"), [case[1:] for case in FIT_CASES], ids=[case[0] for case in FIT_CASES])
def test_fit_refuses_before_the_first_batch(case: dict[str, Any], message: str, tmp_path: Path) -> None:
    (tmp_path / "empty.ckpt").write_bytes(b"")
    torch.save({"state_dict": {}, "thing": _NotAllowed()}, tmp_path / "custom.ckpt")
    torch.save({"state_dict": {"w": torch.randn(256, 64)}}, tmp_path / "flipped.ckpt")
    flip_inside_largest_record(tmp_path / "flipped.ckpt")
    strategy = P2RStrategy(accumulation="layered", micro_batches=3) if case.get("strategy") == "layered3" else None
    ckpt_path = tmp_path / case["ckpt_path"] if "ckpt_path" in case else None
    _fit_refused(tmp_path, message, config=case.get("config"), strategy=strategy, ckpt_path=ckpt_path,
                 trainer_options=case.get("trainer_options"))


def test_the_catalogue_has_at_least_forty_cases() -> None:
    assert len(API_CASES) + len(CLI_CASES) + len(FIT_CASES) >= 40


def test_a_sharded_checkpoint_converts_to_a_file_any_strategy_resumes(earlier_run: Path, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    single = tmp_path / "single.ckpt"
    main(["convert-checkpoint", str(earlier_run / "sharded.ckpt"), str(single)])
    assert "wrote" in capsys.readouterr().out
    check_checkpoint_path(single, loads_sharded=False)
    with pytest.raises(SystemExit):  # no silent overwrite
        main(["convert-checkpoint", str(earlier_run / "sharded.ckpt"), str(single)])

    # Plain Lightning (no P2RStrategy) resumes it: the weights are the sharded checkpoint's, and training goes on.
    expected = M6LanguageModel(M6Config(**DENSE), OptimizerConfig(warmup_steps=1))
    reference = tiny_trainer(tmp_path / "reference", strategy=P2RStrategy(), max_steps=1, limit_val_batches=0)
    reference.fit(expected, datamodule=tiny_data(tmp_path), ckpt_path=earlier_run / "sharded.ckpt")
    L.seed_everything(0)
    module = M6LanguageModel(M6Config(**DENSE), OptimizerConfig(warmup_steps=1))
    trainer = tiny_trainer(tmp_path / "plain", max_steps=2, limit_val_batches=0)
    trainer.fit(module, datamodule=tiny_data(tmp_path), ckpt_path=single)
    assert trainer.global_step == 2
    loaded = torch.load(single, weights_only=True)
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(loaded["state_dict"][name], value, atol=0, rtol=0)
    assert len(loaded["optimizer_states"][0]["state"]) == len(list(module.parameters()))


@pytest.mark.parametrize("command", [["convert-checkpoint"], ["convert", "--to", "checkpoint"]],
                         ids=["convert-checkpoint", "convert --to checkpoint"])
def test_a_checkpoint_conversion_makes_missing_folders_and_names_an_unwritable_one(
        command: list[str], earlier_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A new-user audit: a destination in a missing folder ended in torch's ``RuntimeError: Parent directory ...
    does not exist`` traceback (``--to hf``/``safetensors`` made the folder), one that cannot be made in a
    FileNotFoundError traceback."""
    single = tmp_path / "no3" / "x" / "out.ckpt"
    main([*command, str(earlier_run / "sharded.ckpt"), str(single)])
    assert "wrote" in capsys.readouterr().out
    check_checkpoint_path(single, loads_sharded=False)
    assert [p.name for p in single.parent.iterdir()] == ["out.ckpt"]  # the temporary file renamed, none left
    with pytest.raises(SystemExit) as exit_info:
        main([*command, str(earlier_run / "sharded.ckpt"), "/proc/x/out.ckpt"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(r"error: cannot write /proc/x/out.ckpt \(.*/proc/x\): choose a destination", error), error


@pytest.mark.parametrize("command", [["convert-checkpoint"], ["convert", "--to", "checkpoint"],
                                     ["convert", "--to", "hf"], ["convert", "--to", "safetensors"]],
                         ids=["convert-checkpoint", "to checkpoint", "to hf", "to safetensors"])
def test_a_conversion_of_a_missing_source_says_it_does_not_exist(
        command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """It said the path "is not a sharded checkpoint", or hinted at ``--ckpt_path last``, an option fit takes and
    convert does not (a new-user audit)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "nope.ckpt", "out"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(r"error: (checkpoint )?nope.ckpt does not exist: pass a .*checkpoint", error), error
    assert "--ckpt_path" not in error and "not a sharded" not in error
    assert list(tmp_path.iterdir()) == []


def test_more_cpu_processes_than_cores_is_warned_about() -> None:
    from lightning_p2r.layout import oversubscription_warning

    assert oversubscription_warning("cpu", 4, 2) is not None and "--trainer.devices=2" in oversubscription_warning(
        "cpu", 4, 2)
    assert oversubscription_warning("cpu", 2, 2) is None
    assert oversubscription_warning("cuda", 8, 2) is None


def test_fp16_weights_without_loss_scaling_are_warned_about(tmp_path: Path) -> None:
    from lightning_p2r.layout import half_precision_warning

    for trains in ("bf16-true", "16-mixed", "bf16-mixed", "32-true"):
        assert half_precision_warning(trains) is None
    module = M6LanguageModel(M6Config(**DENSE), OptimizerConfig(warmup_steps=1))
    trainer = tiny_trainer(tmp_path, max_steps=1, limit_val_batches=0, precision="16-true", strategy=P2RStrategy())
    with pytest.warns(UserWarning, match=r"precision='16-true' keeps weights, gradients and AdamW's moments in fp16 "
                                         r"with no loss scaling.*Use 'bf16-true'"):
        trainer.fit(module, datamodule=tiny_data(tmp_path))
    assert trainer.global_step == 1  # a warning: Lightning runs the precision it was asked for


def test_a_warmup_as_long_as_the_run_is_warned_about(tmp_path: Path) -> None:
    module = M6LanguageModel(M6Config(**DENSE), OptimizerConfig(warmup_steps=50))
    trainer = tiny_trainer(tmp_path, max_steps=3, limit_val_batches=0)
    with pytest.warns(UserWarning, match=r"warmup_steps=50 is not shorter than the run \(3 optimizer steps\)"):
        trainer.fit(module, datamodule=tiny_data(tmp_path))
    assert trainer.global_step == 3  # a warning, not a failure
