"""Unit tests for lightning_p2r.data: corpus loading, tokenizers, windowing and the TextDataModule."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lightning_p2r.data import (
    BPETokenizer,
    ByteTokenizer,
    TextDataModule,
    TextTokenizer,
    build_tokenizer,
    load_corpus,
    pack_sequences,
    split_train_val,
)

SMALL_TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.\n"
    "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.\n\n"
) * 60 + "Café, naïve, Œuvre — 東京 🙂\n"


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(SMALL_TEXT, encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------- pack / split


def test_pack_sequences_shape_and_shift() -> None:
    ids = torch.arange(103)
    windows = pack_sequences(ids, seq_len=10)
    assert windows.shape == (10, 11)  # (103 - 1) // 10 windows; the 2-token tail is dropped
    assert windows.dtype == torch.long
    assert torch.equal(windows[0], torch.arange(11))
    for i in range(windows.shape[0] - 1):
        assert windows[i, -1] == windows[i + 1, 0]


def test_pack_sequences_exact_fit_and_too_short() -> None:
    assert pack_sequences(torch.arange(5, dtype=torch.int32), seq_len=4).shape == (1, 5)
    with pytest.raises(ValueError, match="seq_len"):
        pack_sequences(torch.arange(4), seq_len=4)


def test_split_train_val_contiguous_and_deterministic() -> None:
    ids = torch.arange(1000)
    train, val = split_train_val(ids, 0.1)
    assert train.numel() == 900 and val.numel() == 100
    assert torch.equal(torch.cat([train, val]), ids)
    assert int(train[-1]) + 1 == int(val[0])
    train2, val2 = split_train_val(ids, 0.1)
    assert torch.equal(train, train2) and torch.equal(val, val2)
    with pytest.raises(ValueError, match="val_fraction"):
        split_train_val(ids, 1.0)


# ----------------------------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    assert isinstance(tok, TextTokenizer)
    text = "héllo wörld 東京 🙂"
    ids = tok.encode(text)
    assert tok.vocab_size == 256 and max(ids) < 256
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(ids[:-1]).endswith("\ufffd")  # a cut multi-byte character is replaced, not raised


@pytest.fixture(scope="module")
def small_bpe() -> BPETokenizer:
    return BPETokenizer.train(SMALL_TEXT, vocab_size=512)


def test_bpe_round_trip_and_range(small_bpe: BPETokenizer) -> None:
    assert isinstance(small_bpe, TextTokenizer)
    assert small_bpe.vocab_size == 512
    ids = small_bpe.encode(SMALL_TEXT)
    assert max(ids) < 512
    assert len(ids) < len(SMALL_TEXT.encode("utf-8")) / 2  # merges actually compress the repeated text
    assert small_bpe.decode(ids) == SMALL_TEXT
    unseen = "Zyx qwv ĳ ∑ 𝔘 <|endoftext|> end"
    assert small_bpe.decode(small_bpe.encode(unseen)) == unseen


def test_bpe_save_load(small_bpe: BPETokenizer, tmp_path: Path) -> None:
    path = tmp_path / "sub" / "tok.json"
    path.parent.mkdir()
    small_bpe.save(path)
    assert [p.name for p in path.parent.iterdir()] == ["tok.json"]  # no temp file left behind
    loaded = BPETokenizer.load(path, vocab_size=512)
    assert loaded.vocab_size == 512
    assert loaded.encode(SMALL_TEXT) == small_bpe.encode(SMALL_TEXT)


def test_build_tokenizer_caches_bpe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = build_tokenizer("bpe", 512, SMALL_TEXT, tmp_path)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1

    def no_training(*args: object, **kwargs: object) -> BPETokenizer:
        raise AssertionError("build_tokenizer retrained although a cached tokenizer exists")

    monkeypatch.setattr(BPETokenizer, "train", no_training)
    second = build_tokenizer("bpe", 512, SMALL_TEXT, tmp_path)
    assert second.encode(SMALL_TEXT) == first.encode(SMALL_TEXT)
    monkeypatch.undo()
    # A different size (or text) is a different cache key, so it trains a new file.
    build_tokenizer("bpe", 600, SMALL_TEXT, tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_build_tokenizer_bytes(tmp_path: Path) -> None:
    assert isinstance(build_tokenizer("bytes", 256, "x", tmp_path), ByteTokenizer)
    with pytest.raises(ValueError, match="256"):
        build_tokenizer("bytes", 512, "x", tmp_path)


# ---------------------------------------------------------------------------------------------- load_corpus


def test_load_corpus_kjv() -> None:
    text = load_corpus("kjv")
    assert len(text) > 1_000_000
    start = text.index("In the beginning God created")
    assert "1. " not in text[max(0, start - 5) : start + 200]
    assert "\n" in text


def test_load_corpus_file_and_folder(tmp_path: Path, text_file: Path) -> None:
    assert load_corpus(str(text_file)) == SMALL_TEXT
    folder = tmp_path / "books"
    (folder / "nested").mkdir(parents=True)
    (folder / "b.txt").write_text("second", encoding="utf-8")
    (folder / "a.txt").write_text("first", encoding="utf-8")
    (folder / "nested" / "c.txt").write_text("third", encoding="utf-8")
    (folder / "skip.md").write_text("not text", encoding="utf-8")
    assert load_corpus(str(folder)) == "first\n\nsecond\n\nthird"


def test_load_corpus_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        load_corpus(str(missing))
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\t\n", encoding="utf-8")
    with pytest.raises(ValueError, match="empty"):
        load_corpus(str(empty))
    no_txt = tmp_path / "no_txt"
    no_txt.mkdir()
    (no_txt / "notes.md").write_text("hello", encoding="utf-8")
    with pytest.raises(ValueError, match="no \\*.txt"):
        load_corpus(str(no_txt))
    bad = tmp_path / "latin.txt"
    bad.write_bytes(b"ok\xff\xfe")
    with pytest.raises(ValueError, match=r"latin\.txt.*offset 2"):
        load_corpus(str(bad))


# -------------------------------------------------------------------------------------------- data module


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"seq_len": 0}, "seq_len"),
        ({"batch_size": 0}, "batch_size"),
        ({"val_fraction": 0.0}, "val_fraction"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"num_workers": -1}, "num_workers"),
        ({"tokenizer": "words"}, "tokenizer"),
        ({"tokenizer": "bytes", "vocab_size": 300}, "vocab_size"),
        ({"tokenizer": "bpe", "vocab_size": 256}, "vocab_size"),
    ],
)
def test_datamodule_rejects_bad_arguments(kwargs: dict[str, object], name: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=name):
        TextDataModule(cache_dir=str(tmp_path), **kwargs)  # type: ignore[arg-type]


def test_datamodule_missing_corpus(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        TextDataModule(corpus=str(tmp_path / "missing.txt"), cache_dir=str(tmp_path))


def test_datamodule_resolves_vocab_and_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_P2R_CACHE", str(tmp_path / "env_cache"))
    dm = TextDataModule()
    assert dm.vocab_size == 4096
    assert dm.cache_dir == tmp_path / "env_cache"
    assert dm.hparams["tokenizer"] == "bpe"
    assert TextDataModule(tokenizer="bytes", cache_dir=str(tmp_path)).vocab_size == 256
    assert not (tmp_path / "env_cache").exists()  # __init__ does no I/O


def _first_batches(dm: TextDataModule, n: int = 3) -> list[torch.Tensor]:
    it = iter(dm.train_dataloader())
    return [next(it) for _ in range(n)]


def test_datamodule_end_to_end_bytes(text_file: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    dm = TextDataModule(corpus=str(text_file), tokenizer="bytes", seq_len=32, batch_size=4, cache_dir=str(cache))
    dm.prepare_data()
    assert len(list(cache.glob("ids-*.npy"))) == 1
    dm.setup("fit")
    assert isinstance(dm.tokenizer, ByteTokenizer)

    batches = _first_batches(dm)
    for batch in batches:
        assert isinstance(batch, torch.Tensor)
        assert batch.shape == (4, 33) and batch.dtype == torch.long
        assert int(batch.max()) < dm.vocab_size and int(batch.min()) >= 0
    assert len(dm.train_dataloader()) == dm.train_windows.shape[0] // 4  # partial batch dropped

    val = [b for b in dm.val_dataloader()]
    assert all(torch.equal(a, b) for a, b in zip(val, dm.val_dataloader()))
    assert torch.equal(torch.cat(val), dm.val_windows)
    # Validation starts at the last val_fraction of the byte stream (default 0.05), right after the training part.
    raw = SMALL_TEXT.encode("utf-8")
    cut = len(raw) - round(len(raw) * 0.05)
    assert bytes(dm.val_windows[0].tolist()) == raw[cut : cut + 33]

    # Same seed -> same shuffle in a fresh module reading the cache (as another process would).
    dm2 = TextDataModule(corpus=str(text_file), tokenizer="bytes", seq_len=32, batch_size=4, cache_dir=str(cache))
    dm2.setup("fit")
    assert all(torch.equal(a, b) for a, b in zip(batches, _first_batches(dm2)))
    dm3 = TextDataModule(
        corpus=str(text_file), tokenizer="bytes", seq_len=32, batch_size=4, cache_dir=str(cache), seed=7
    )
    dm3.setup("fit")
    assert not all(torch.equal(a, b) for a, b in zip(batches, _first_batches(dm3)))
    for loader in (dm.test_dataloader(), dm.predict_dataloader()):
        assert torch.equal(next(iter(loader)), val[0])


def test_datamodule_bpe_small(text_file: Path, tmp_path: Path) -> None:
    dm = TextDataModule(
        corpus=str(text_file), tokenizer="bpe", vocab_size=512, seq_len=16, batch_size=2, cache_dir=str(tmp_path)
    )
    dm.setup("fit")  # without prepare_data: setup builds the caches itself
    assert isinstance(dm.tokenizer, BPETokenizer)
    batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (2, 17) and int(batch.max()) < 512
    assert len(list(tmp_path.glob("bpe-*.json"))) == 1 and len(list(tmp_path.glob("ids-*.npy"))) == 1


def test_datamodule_validation_too_short(tmp_path: Path) -> None:
    path = tmp_path / "tiny.txt"
    path.write_text("a" * 200, encoding="utf-8")
    dm = TextDataModule(
        corpus=str(path),
        tokenizer="bytes",
        seq_len=64,
        batch_size=1,
        val_fraction=0.1,
        cache_dir=str(tmp_path / "cache"),
    )
    with pytest.raises(ValueError, match="seq_len.*val_fraction"):
        dm.setup("fit")


def test_datamodule_kjv_bytes(tmp_path: Path) -> None:
    dm = TextDataModule(corpus="kjv", tokenizer="bytes", seq_len=64, batch_size=8, cache_dir=str(tmp_path))
    dm.prepare_data()
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (8, 65) and batch.dtype == torch.long
    assert dm.train_windows.shape[0] > 10_000 and dm.val_windows.shape[0] > 100
    assert os.path.getsize(next(tmp_path.glob("ids-*.npy"))) < 5_000_000  # one byte per token, not int64


def test_epoch_shuffle_sampler_is_a_function_of_seed_and_epoch_and_resumes() -> None:
    from lightning_p2r.data import EpochShuffleSampler

    sampler = EpochShuffleSampler(20, seed=3)
    first = list(sampler)
    assert sorted(first) == list(range(20)) and list(sampler) == first
    sampler.set_epoch(1)
    second = list(sampler)
    assert second != first
    sampler.resume(epoch=0, num_samples_done=8)
    assert list(sampler) == first[8:]
    assert list(sampler) == first  # the skip applies to one iteration only


def test_epoch_shuffle_sampler_splits_the_epoch_across_ranks() -> None:
    from lightning_p2r.data import EpochShuffleSampler

    whole = list(EpochShuffleSampler(21, seed=4))
    ranks = [list(EpochShuffleSampler(21, seed=4, num_replicas=2, rank=r)) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 10
    assert not set(ranks[0]) & set(ranks[1])
    assert ranks[0] == whole[0:20:2] and ranks[1] == whole[1:20:2]


def test_resume_keeps_the_epoch_correction_for_later_epochs() -> None:
    from lightning_p2r.data import EpochShuffleSampler

    reference = EpochShuffleSampler(12, seed=1)
    epochs = []
    for epoch in range(3):
        reference.set_epoch(epoch)
        epochs.append(list(reference))
    resumed = EpochShuffleSampler(12, seed=1)
    resumed.set_epoch(1)  # Lightning is one epoch ahead after a run stopped by max_steps
    resumed.resume(epoch=0, num_samples_done=5)
    assert list(resumed) == epochs[0][5:]
    resumed.set_epoch(2)
    assert list(resumed) == epochs[1]  # not epoch 2's order: no epoch is skipped


def test_resume_on_two_ranks_skips_per_rank_samples() -> None:
    from lightning_p2r.data import EpochShuffleSampler

    for rank in (0, 1):
        full = list(EpochShuffleSampler(20, seed=2, num_replicas=2, rank=rank))
        resumed = EpochShuffleSampler(20, seed=2, num_replicas=2, rank=rank)
        resumed.resume(epoch=0, num_samples_done=4)
        assert list(resumed) == full[4:]
