"""data.prepared as a list of prepared directories: mixed by data.prepared_weights, one validation loader each,
exact resume, refusals, and prepare-data --tokenizer_from so that BPE directories can be mixed."""

import math
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import RecordBatches

from lightning_p2r import M6Config, M6LanguageModel, TextDataModule
from lightning_p2r.cli import main as cli_main
from lightning_p2r.data.prepared import PreparedDataError, prepare_data, read_manifest

pytest.importorskip("litdata", reason="litdata is installed by the README's second pip step (--no-deps)")

TINY = {"vocab_size": 256, "max_seq_len": 16, "num_layers": 2, "dim": 32, "num_heads": 4, "num_experts": 4}
QUIET = {"log": lambda line: None}


def _write(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _letters(folder: Path, lines: int = 400) -> Path:
    return _write(folder / "letters.txt", [f"the word was tested, and the test was {'good ' * (i % 5)}fine"
                                           for i in range(lines)])


def _digits(folder: Path, lines: int = 300) -> Path:
    return _write(folder / "digits.txt", [" ".join(str(i * 7919 + j) for j in range(6)) for i in range(lines)])


@pytest.fixture(scope="module")
def two_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("list")
    letters, digits = root / "letters", root / "digits"
    prepare_data(str(_letters(root / "src")), letters, tokenizer="bytes", val_fraction=0.1, **QUIET)
    prepare_data(str(_digits(root / "src")), digits, tokenizer="bytes", val_fraction=0.1, **QUIET)
    return str(letters), str(digits)


def _digit_share(data: TextDataModule, batches: int = 100) -> float:
    """Windows of the digits directory are mostly digits and spaces; the letters directory has none."""
    windows = torch.cat([batch for _, batch in zip(range(batches), data.train_dataloader())])
    return ((windows >= ord("0")) & (windows <= ord("9"))).float().mean(dim=1).gt(0.5).float().mean().item()


def test_a_list_of_directories_is_mixed_by_its_weights(two_dirs: tuple[str, str]) -> None:
    letters, digits = two_dirs
    data = TextDataModule(prepared=[letters, digits], prepared_weights=[1, 3], seq_len=16, batch_size=4)
    assert data.mixture == pytest.approx({"letters": 0.25, "digits": 0.75}) and data.vocab_size == 256
    assert data.eval_streams == ["letters", "digits"]
    assert abs(_digit_share(data) - 0.75) < 0.08  # 400 windows drawn
    # By default each directory is drawn in proportion to its training tokens, as if the corpora were one.
    tokens = {Path(d).name: read_manifest(d).splits["train"]["tokens"] for d in two_dirs}
    default = TextDataModule(prepared=[letters, digits], seq_len=16, batch_size=4)
    assert default.mixture == pytest.approx({name: n / sum(tokens.values()) for name, n in tokens.items()})
    assert abs(_digit_share(default) - default.mixture["digits"]) < 0.08
    only_letters = TextDataModule(prepared=[letters, digits], prepared_weights=[1.0, 0.0], seq_len=16, batch_size=4)
    assert _digit_share(only_letters, 30) == 0.0  # weighted zero: validated, never drawn


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_list_trains_validates_per_directory_and_resumes_exactly(two_dirs: tuple[str, str], tmp_path: Path,
                                                                  num_workers: int) -> None:
    # Lightning reads a mixture's loader (no length) one batch ahead: the checkpoint must hold the batch trained on.
    def run(max_steps: int, ckpt_path: Path | None = None) -> tuple[M6LanguageModel, RecordBatches, L.Trainer]:
        L.seed_everything(3)
        model, batches = M6LanguageModel(M6Config(**TINY)), RecordBatches()
        trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, callbacks=[batches],
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                            default_root_dir=tmp_path, limit_val_batches=2, limit_test_batches=2,
                            val_check_interval=3, log_every_n_steps=1)
        data = TextDataModule(prepared=list(two_dirs), prepared_weights=[1, 1], seq_len=16, batch_size=4, seed=5,
                              num_workers=num_workers)
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path, weights_only=True if ckpt_path else None)
        return model, batches, trainer

    straight, all_batches, trainer = run(6)
    assert {"val/loss/letters", "val/bpb/digits", "val/loss", "data/mixture/letters",
            "data/mixture/digits"} <= set(trainer.callback_metrics)
    assert {"test/loss/letters", "test/loss/digits"} <= set(trainer.test(straight, datamodule=trainer.datamodule,
                                                                         verbose=False)[0])
    _, first, trainer = run(3)
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    resumed, rest, _ = run(6, tmp_path / "mid.ckpt")
    assert [b.tolist() for b in first.seen + rest.seen] == [b.tolist() for b in all_batches.seen]
    for (name, a), b in zip(resumed.state_dict().items(), straight.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(("options", "message"), [
    ({"prepared_weights": [-1.0, 1.0]}, r"data.prepared_weights=\[-1.0, 1.0\]: -1.0 is not a finite number >= 0"),
    ({"prepared_weights": [math.nan, 1.0]}, r"data.prepared_weights=\[nan, 1.0\]: nan is not a finite number"),
    ({"prepared_weights": [0, 0]}, r"data.prepared_weights=\[0, 0\]: no weight is above zero.*e.g. \[3, 1\]"),
    ({"prepared_weights": [1.0]}, r"data.prepared_weights=\[1.0\] has 1 weight\(s\) for the 2 directories of "
                                  "data.prepared: give one per directory"),
    ({"languages": ["en"]}, "data.languages chooses among the languages of one multilingual directory, and "
                            "data.prepared is a list: weigh its directories with data.prepared_weights"),
    ({"language_weights": {"en": 1}}, "data.language_weights chooses among .* data.prepared is a list"),
    ({"corpus": "kjv"}, "data.corpus=kjv prepares one directory, and data.prepared lists 2: prepare each"),
    ({"vocab_size": 4096}, "data.vocab_size=4096 but .*letters was prepared with vocab_size 256"),
])
def test_bad_options_with_a_list_are_refused_in_one_line(two_dirs: tuple[str, str], options, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        TextDataModule(prepared=list(two_dirs), **options)
    assert "\n" not in str(error.value)


def test_lists_that_cannot_be_mixed_are_refused(two_dirs: tuple[str, str], tmp_path: Path) -> None:
    letters, digits = two_dirs
    with pytest.raises(ValueError, match=r"data.prepared_weights=\[1, 1\] weighs the directories of a list in "
                                         "data.prepared, which is"):
        TextDataModule(prepared=letters, prepared_weights=[1, 1])
    with pytest.raises(ValueError, match="data.prepared is an empty list"):
        TextDataModule(prepared=[])
    twin = tmp_path / "other" / "letters"
    prepare_data(str(_letters(tmp_path / "src", 300)), twin, tokenizer="bytes", **QUIET)
    with pytest.raises(ValueError, match="lists two directories named 'letters' .* rename one"):
        TextDataModule(prepared=[letters, str(twin)])
    with pytest.raises(PreparedDataError, match="does not exist"):
        TextDataModule(prepared=[letters, str(tmp_path / "missing")])
    bpe = tmp_path / "bpe"
    prepare_data(str(_digits(tmp_path / "src", 600)), bpe, tokenizer="bpe", vocab_size=512, **QUIET)
    with pytest.raises(ValueError, match=rf"mixes {letters} \(tokenizer 'bytes', vocab_size 256\) and {bpe} "
                                         rf"\(tokenizer 'bpe', vocab_size 512\): prepare {bpe} again with "
                                         f"`lightning-p2r prepare-data --tokenizer_from {letters}"):
        TextDataModule(prepared=[letters, str(bpe)])


def test_bpe_directories_mix_once_one_borrows_the_others_tokenizer(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    first, second = tmp_path / "letters-bpe", tmp_path / "digits-bpe"
    prepare_data(str(_letters(tmp_path / "src", 600)), first, tokenizer="bpe", vocab_size=512, **QUIET)
    digits = _digits(tmp_path / "src", 600)
    prepare_data(str(digits), second, tokenizer="bpe", vocab_size=512, **QUIET)
    with pytest.raises(ValueError, match=f"mixes {first} and {second}, whose bpe tokenizers differ .* prepare "
                                         f"{second} again with `lightning-p2r prepare-data --tokenizer_from {first}"):
        TextDataModule(prepared=[str(first), str(second)])
    cli_main(["prepare-data", "--source", str(digits), "--out", str(second), "--tokenizer_from", str(first),
              "--overwrite"])
    assert "vocab 512" in capsys.readouterr().out
    data = TextDataModule(prepared=[str(first), str(second)], seq_len=16, batch_size=4)
    assert data.vocab_size == 512 and data.tokenizer_kind == "bpe" and set(data.mixture) == {first.name, second.name}
