"""prepare-data (litdata chunks + manifest) and training that streams them: content, re-runs, refusals, resume."""

import json
import os
import random
import string
import subprocess
import sys
from collections import Counter
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import RecordBatches

from lightning_p2r import M6Config, M6LanguageModel, TextDataModule
from lightning_p2r.cli import main as cli_main
from lightning_p2r.data import BPETokenizer, ByteTokenizer
from lightning_p2r.data.prepared import PreparedDataError, cut_pieces, open_corpus, prepare_data, read_manifest
from lightning_p2r.data.streaming import streaming_loader

pytest.importorskip("litdata", reason="litdata is installed by the README's second pip step (--no-deps)")

TINY = {"vocab_size": 256, "max_seq_len": 16, "num_layers": 2, "dim": 32, "num_heads": 4, "num_experts": 4}
QUIET = {"log": lambda line: None}


def _corpus(folder: Path, lines: int = 400) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "corpus.txt"
    path.write_text("".join(f"Line {i}: the word was tested, and the test was {'good' * (i % 5)}.\n"
                            for i in range(lines)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def prepared_bytes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("prepared")
    source = _corpus(root / "src")
    out = root / "bytes"
    prepare_data(str(source), out, tokenizer="bytes", val_fraction=0.1, piece_bytes=4096, **QUIET)
    return source, out


def _read_split(out: Path, split: str, seq_len: int = 16) -> list[torch.Tensor]:
    loader = streaming_loader(out, split, seq_len, 1, shuffle=False, seed=0, num_workers=0, replicas=1, rank=0)
    return [batch[0] for batch in loader]


def test_prepared_tokens_are_the_corpus_bytes_split_at_a_line_end(prepared_bytes: tuple[Path, Path]) -> None:
    source, out = prepared_bytes
    text = source.read_bytes()
    manifest = read_manifest(out)
    train, val = manifest.splits["train"], manifest.splits["val"]
    assert train["bytes"] + val["bytes"] == len(text)
    assert train["tokens"] == train["bytes"] and val["tokens"] == val["bytes"]  # one token per byte
    assert text[train["bytes"] - 1:train["bytes"]] == b"\n"  # the cut falls at a line end
    assert abs(val["bytes"] / len(text) - 0.1) < 0.01
    # The streamed windows are the stream itself, in order, without its ragged tail.
    windows = torch.cat(_read_split(out, "val")).tolist()
    assert bytes(windows) == text[train["bytes"]:][:len(windows)]
    assert len(windows) == val["tokens"] // 17 * 17


def test_pieces_cover_the_corpus_once_at_line_ends(tmp_path: Path) -> None:
    folder = tmp_path / "folder"
    for name, lines in (("b.txt", 37), ("a.txt", 120), ("c.txt", 3)):
        _corpus(folder / name.removesuffix(".txt"), lines).rename(folder / name)
    corpus, _ = open_corpus(str(folder))
    pieces = cut_pieces(corpus, 0.2, 1024)
    seen = {part.name: [] for part in corpus.parts}
    for split in ("train", "val"):
        for piece in pieces[split]:
            seen[piece.part.name].append((piece.start, piece.end))
            assert piece.end == piece.part.size or corpus.read(piece.part, piece.end - 1, piece.end) == b"\n"
    for part in corpus.parts:
        spans = sorted(seen[part.name])
        assert spans[0][0] == 0 and spans[-1][1] == part.size
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert [Path(p.name).name for p in corpus.parts] == ["a.txt", "b.txt", "c.txt"]


@pytest.mark.parametrize(("text", "after"), [
    ("And the evening and the morning were the first day. " * 300, b" "),  # one long line: cut after a space
    ("\u592a\u521d\u6709\u9053\uff0c\u9053\u4e0e\u795e\u540c\u5728" * 600, None),  # no space either
])
def test_text_without_line_ends_still_splits_between_characters(tmp_path: Path, text: str, after: bytes | None
                                                                 ) -> None:
    source = tmp_path / "one_line.txt"
    source.write_text(text, encoding="utf-8")
    corpus, _ = open_corpus(str(source))
    pieces = cut_pieces(corpus, 0.05, 4096)
    data = source.read_bytes()
    cuts = [piece.end for piece in pieces["train"]] + [piece.start for piece in pieces["val"]]
    assert pieces["val"] and len(pieces["train"]) > 1 and abs(pieces["val"][0].start / len(data) - 0.95) < 0.01
    for cut in cuts:
        data[:cut].decode("utf-8")  # every cut falls between characters
        if after is not None and cut < len(data):
            assert data[cut - 1:cut] == after


def test_bpe_prepared_ids_match_the_saved_tokenizer(tmp_path: Path) -> None:
    source = _corpus(tmp_path / "src", 600)
    manifest = prepare_data(str(source), tmp_path / "bpe", tokenizer="bpe", vocab_size=512, val_fraction=0.1,
                            num_workers=2, piece_bytes=2048, **QUIET)
    tokenizer = BPETokenizer.load(tmp_path / "bpe" / "tokenizer.json", 512)
    text = source.read_text()
    val_text = text[manifest.splits["train"]["bytes"]:]
    expected = [i for line in val_text.splitlines(keepends=True) for i in tokenizer.encode(line)]
    assert manifest.splits["val"]["tokens"] == len(expected)
    # Two workers write their pieces to chunks of their own, so the stream holds the pieces' ids in chunk order.
    windows = torch.cat(_read_split(tmp_path / "bpe", "val")).tolist()
    assert not Counter(windows) - Counter(expected) and len(expected) - len(windows) < 17
    assert max(windows) < 512


def test_a_rerun_is_a_no_op_and_other_inputs_are_refused_or_rebuilt(tmp_path: Path) -> None:
    source = _corpus(tmp_path / "src")
    out = tmp_path / "out"
    prepare_data(str(source), out, tokenizer="bytes", **QUIET)
    stamp = (out / "manifest.json").stat().st_mtime_ns
    lines: list[str] = []
    prepare_data(str(source), out, tokenizer="bytes", log=lines.append)
    assert "nothing to do" in lines[0] and (out / "manifest.json").stat().st_mtime_ns == stamp
    source.write_text(source.read_text() + "One more line.\n")
    with pytest.raises(PreparedDataError, match="source_sha256 differ.*--overwrite"):
        prepare_data(str(source), out, tokenizer="bytes", **QUIET)
    assert (out / "manifest.json").stat().st_mtime_ns == stamp  # the refused run touched nothing
    with pytest.raises(PreparedDataError, match="val_fraction differ"):
        prepare_data(str(source), out, tokenizer="bytes", val_fraction=0.2, **QUIET)
    rebuilt = prepare_data(str(source), out, tokenizer="bytes", overwrite=True, **QUIET)
    assert sum(s["bytes"] for s in rebuilt.splits.values()) == source.stat().st_size
    assert not out.with_name("out.partial").exists()


def test_half_written_and_foreign_directories_are_refused(tmp_path: Path) -> None:
    half = tmp_path / "half"
    (half / "train").mkdir(parents=True)
    with pytest.raises(PreparedDataError, match="no manifest.json"):
        read_manifest(half)
    with pytest.raises(PreparedDataError, match="is a folder prepare-data did not write"):
        prepare_data(str(_corpus(tmp_path / "src")), half, tokenizer="bytes", **QUIET)
    tmp_path.joinpath("gone.partial").mkdir()
    with pytest.raises(PreparedDataError, match="half-written"):
        read_manifest(tmp_path / "gone")
    with pytest.raises(ValueError, match="prepare-data"):
        TextDataModule(prepared=str(half))


def test_fit_words_a_refused_prepared_folder_with_its_own_options(tmp_path: Path) -> None:
    """A new-user audit: fit with ``data.prepared`` naming a folder of the user's, a file, or the corpus's own folder
    was refused naming prepare-data's ``--out`` and ``--overwrite``, which fit does not take."""
    source = _corpus(tmp_path / "src")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    (tmp_path / "file.txt").write_text("mine")
    for prepared, refusal in ((notes, r"data.prepared .*notes is a folder prepare-data did not write"),
                              (tmp_path / "file.txt", r"data.prepared .*file.txt is a file"),
                              (source.parent, r"data.prepared .*src holds data.corpus")):
        data = TextDataModule(corpus=str(source), prepared=str(prepared), tokenizer="bytes", seq_len=16, batch_size=4)
        with pytest.raises(PreparedDataError, match=refusal) as refused:
            data.prepare_data()
        assert "--data.prepared" in str(refused.value)
        assert "--out" not in str(refused.value) and "--overwrite" not in str(refused.value)
    assert (notes / "todo.txt").read_text() == "mine" and (tmp_path / "file.txt").read_text() == "mine"


def test_a_damaged_prepared_directory_names_the_command_that_rebuilds_it(tmp_path: Path) -> None:
    out = tmp_path / "prepared"
    prepare_data(str(_corpus(tmp_path / "src")), out, tokenizer="bytes", **QUIET)
    (out / "train" / "index.json").unlink()
    with pytest.raises(PreparedDataError, match=r"has no index.json: run .*prepare-data .*--overwrite`") as refused:
        read_manifest(out)
    # The command it names runs: a damaged directory is rebuilt only with --overwrite.
    with pytest.raises(PreparedDataError, match="not complete: pass --overwrite"):
        prepare_data(str(_corpus(tmp_path / "src")), out, tokenizer="bytes", **QUIET)
    assert "--overwrite" in str(refused.value)
    prepare_data(str(_corpus(tmp_path / "src")), out, tokenizer="bytes", overwrite=True, **QUIET)
    assert read_manifest(out).tokenizer == "bytes"


def _digest(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def test_overwrite_replaces_only_what_prepare_data_wrote(tmp_path: Path) -> None:
    """A new-user audit: ``--out`` naming the source folder with ``--overwrite`` replaced the corpus with its own
    prepared output; a run folder given as ``--out`` went the same way; a no-op run deleted a user's folder named
    ``OUT.previous``; a file as ``--out``, and ``--out .``, ended in tracebacks."""
    source = _corpus(tmp_path / "src")
    before = _digest(source.parent)
    with pytest.raises(PreparedDataError, match=r"holds the corpus it would read .*choose an --out outside"):
        prepare_data(str(source.parent), source.parent, tokenizer="bytes", overwrite=True, **QUIET)
    with pytest.raises(PreparedDataError, match=r"holds the corpus it would read"):
        prepare_data(str(source), source.parent, tokenizer="bytes", overwrite=True, **QUIET)
    assert _digest(source.parent) == before
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"weights")
    with pytest.raises(PreparedDataError, match=r"is a folder prepare-data did not write \(no manifest.json\), and "
                                                r"not empty: it replaces only prepared directories, even with"):
        prepare_data(str(source), run, tokenizer="bytes", overwrite=True, **QUIET)
    assert (run / "checkpoints" / "last.ckpt").read_bytes() == b"weights"
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(PreparedDataError, match=r"notes.txt is a file: prepare-data writes a directory"):
        prepare_data(str(source), tmp_path / "notes.txt", tokenizer="bytes", overwrite=True, **QUIET)
    assert (tmp_path / "notes.txt").read_text() == "mine"

    out = tmp_path / "prepared"
    prepare_data(str(source), out, tokenizer="bytes", **QUIET)
    kept = tmp_path / "prepared.previous"
    kept.mkdir()
    (kept / "keep.txt").write_text("precious")
    prepare_data(str(source), out, tokenizer="bytes", **QUIET)  # already prepared: nothing to do
    assert (kept / "keep.txt").read_text() == "precious"
    with pytest.raises(PreparedDataError, match=r"prepared.previous is in the way: prepare-data keeps the old"):
        prepare_data(str(source), out, tokenizer="bytes", val_fraction=0.2, overwrite=True, **QUIET)
    assert (kept / "keep.txt").read_text() == "precious" and read_manifest(out).val_fraction == 0.05
    kept.rename(tmp_path / "mine")
    prepare_data(str(source), out, tokenizer="bytes", val_fraction=0.2, overwrite=True, **QUIET)  # a real rebuild
    assert read_manifest(out).val_fraction == 0.2 and not kept.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    prepare_data(str(source), empty, tokenizer="bytes", **QUIET)  # an empty folder is taken
    assert read_manifest(empty).tokenizer == "bytes"


def test_bad_sources_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\u00e9\n".encode("latin-1") * 10)
    with pytest.raises(PreparedDataError, match=r"latin.txt is not valid UTF-8 \(byte offset 3\)"):
        prepare_data(str(latin), tmp_path / "out", tokenizer="bytes", **QUIET)
    with pytest.raises(PreparedDataError, match="does not exist"):
        prepare_data(str(tmp_path / "nope.txt"), tmp_path / "out", tokenizer="bytes", **QUIET)
    with pytest.raises(PreparedDataError, match="vocab_size 256"):
        prepare_data(str(latin), tmp_path / "out", tokenizer="bytes", vocab_size=300, **QUIET)
    with pytest.raises(PreparedDataError, match="too small"):
        prepare_data(["one line only"], tmp_path / "out", tokenizer="bytes", **QUIET)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_documents_from_python_are_a_source(tmp_path: Path) -> None:
    documents = [f"Document {i}.\nIt has two lines.\n" for i in range(200)]
    manifest = prepare_data(iter(documents), tmp_path / "docs", tokenizer="bytes", **QUIET)
    assert manifest.source == "documents"
    assert sum(s["bytes"] for s in manifest.splits.values()) == len("\n\n".join(documents).encode())


def test_the_data_module_takes_the_prepared_vocabulary_and_refuses_another(prepared_bytes) -> None:
    _, out = prepared_bytes
    data = TextDataModule(prepared=str(out), seq_len=16, batch_size=4)
    assert data.vocab_size == 256 and data.tokenizer_kind == "bytes"
    assert isinstance(data.load_tokenizer(), ByteTokenizer)
    with pytest.raises(ValueError, match="data.vocab_size=4096 but .* vocab_size 256"):
        TextDataModule(prepared=str(out), vocab_size=4096)
    with pytest.raises(ValueError, match="data.tokenizer='bpe' but .* tokenizer 'bytes'"):
        TextDataModule(prepared=str(out), tokenizer="bpe")


def test_a_corpus_too_small_for_a_step_is_refused_at_setup(prepared_bytes, tmp_path: Path) -> None:
    _, out = prepared_bytes
    data = TextDataModule(prepared=str(out), seq_len=16, batch_size=10_000)
    with pytest.raises(PreparedDataError, match="train split .* fewer than the 10000 one step needs"):
        data.setup("fit")


def _trainer(root: Path, max_steps: int) -> L.Trainer:
    return L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=root, limit_val_batches=2, val_check_interval=100,
                     enable_checkpointing=False)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_resumed_stream_continues_with_the_batches_of_an_uninterrupted_run(prepared_bytes, tmp_path: Path,
                                                                            num_workers: int) -> None:
    _, out = prepared_bytes

    def run(max_steps: int, ckpt_path: Path | None = None) -> tuple[M6LanguageModel, RecordBatches, L.Trainer]:
        L.seed_everything(3)
        model, batches = M6LanguageModel(M6Config(**TINY)), RecordBatches()
        trainer = _trainer(tmp_path, max_steps)
        trainer.callbacks.append(batches)
        data = TextDataModule(prepared=str(out), seq_len=16, batch_size=4, num_workers=num_workers, seed=5)
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path, weights_only=True if ckpt_path else None)
        return model, batches, trainer

    straight, all_batches, _ = run(8)
    assert all(b.dtype == torch.long and b.shape == (4, 17) for b in all_batches.seen)
    _, first, trainer = run(3)
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    resumed, rest, _ = run(8, tmp_path / "mid.ckpt")
    assert [b.tolist() for b in first.seen + rest.seen] == [b.tolist() for b in all_batches.seen]
    for (name, a), b in zip(resumed.state_dict().items(), straight.state_dict().values()):
        assert torch.equal(a, b), name


def test_prepare_data_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = _corpus(tmp_path / "src")
    cli_main(["prepare-data", "--source", str(source), "--out", str(tmp_path / "out"), "--tokenizer", "bytes"])
    assert "train" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["tokenizer"] == "bytes"
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["prepare-data", "--source", str(tmp_path / "missing"), "--out", str(tmp_path / "o2")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("lightning-p2r prepare-data: error: corpus") and "does not exist" in error
    assert not os.path.exists(tmp_path / "o2")


def test_a_run_prepares_its_directory_once_and_refuses_another_corpus(tmp_path: Path) -> None:
    source, other = _corpus(tmp_path / "a"), _corpus(tmp_path / "b", lines=300)
    out = tmp_path / "prepared"

    def fit(corpus: Path | None) -> L.Trainer:
        data = TextDataModule(corpus=corpus and str(corpus), prepared=str(out), tokenizer="bytes", seq_len=16,
                              batch_size=4)
        model = M6LanguageModel(M6Config(**TINY))
        trainer = _trainer(tmp_path / "run", 2)
        trainer.fit(model, datamodule=data)
        return trainer

    assert fit(source).global_step == 2
    assert read_manifest(out).source == str(source)
    stamp = (out / "manifest.json").stat().st_mtime_ns
    assert fit(source).global_step == 2 and (out / "manifest.json").stat().st_mtime_ns == stamp  # prepared once
    with pytest.raises(PreparedDataError, match="prepared from other inputs .*source_sha256") as refused:
        fit(other)
    assert (out / "manifest.json").stat().st_mtime_ns == stamp
    # Worded for fit (a new-user audit: it said to pass --overwrite or choose another --out, prepare-data's flags).
    assert "--data.corpus null" in str(refused.value) and "--data.prepared" in str(refused.value)
    assert "--overwrite" not in str(refused.value) and "--out" not in str(refused.value)
    assert fit(None).global_step == 2  # the first fix it names: the directory as it is
    with pytest.raises(ValueError, match="does not exist.*prepare-data"):
        TextDataModule(prepared=str(tmp_path / "never-prepared"))
    with pytest.raises(ValueError, match="bible-multi' is streamed"):
        TextDataModule(corpus="bible-multi")


def test_language_weights_on_a_single_corpus_directory_are_refused(prepared_bytes) -> None:
    _, out = prepared_bytes
    with pytest.raises(ValueError, match=r"data.language_weights=\{'en': 1\} but .* holds one corpus, not languages: "
                                         "drop data.language_weights") as error:
        TextDataModule(prepared=str(out), language_weights={"en": 1})
    assert "\n" not in str(error.value)


def test_a_tokenizer_borrowed_from_another_directory_is_one_of_the_inputs(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    prepare_data(str(_corpus(tmp_path / "a", 600)), first, tokenizer="bpe", vocab_size=512, **QUIET)
    other = tmp_path / "other.txt"
    other.write_text("".join(f"{i * 7919} {i * 104729} and more digits {i}\n" for i in range(600)))
    manifest = prepare_data(str(other), second, tokenizer_from=first, **QUIET)  # kind and vocabulary come with it
    assert (manifest.tokenizer, manifest.vocab_size, manifest.tokenizer_borrowed) == ("bpe", 512, True)
    assert manifest.tokenizer_sha256 == read_manifest(first).tokenizer_sha256
    assert (second / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()
    lines: list[str] = []
    prepare_data(str(other), second, tokenizer_from=first, log=lines.append)
    assert "nothing to do" in lines[0]
    with pytest.raises(PreparedDataError, match="tokenizer_borrowed, tokenizer_sha256 differ"):
        prepare_data(str(other), second, tokenizer="bpe", vocab_size=512, **QUIET)  # would train a tokenizer of its own
    with pytest.raises(PreparedDataError, match=f"vocab_size 1024 but --tokenizer_from {first} has vocab_size 512"):
        prepare_data(str(other), tmp_path / "third", vocab_size=1024, tokenizer_from=first, **QUIET)
    with pytest.raises(PreparedDataError, match=f"tokenizer 'bytes' but --tokenizer_from {first} has tokenizer 'bpe'"):
        prepare_data(str(other), tmp_path / "third", tokenizer="bytes", tokenizer_from=first, **QUIET)
    with pytest.raises(PreparedDataError, match="does not exist"):
        prepare_data(str(other), tmp_path / "third", tokenizer_from=tmp_path / "nowhere", **QUIET)
    assert not (tmp_path / "third").exists()


def _first_batch(data: TextDataModule) -> torch.Tensor:
    data.prepare_data()
    data.setup("fit")
    return next(iter(data.train_dataloader()))


def test_a_relative_prepared_path_streams_from_the_working_directory(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _corpus(tmp_path / "src")
    options = {"tokenizer": "bytes", "seq_len": 16, "batch_size": 2}
    single = _first_batch(TextDataModule(corpus="src/corpus.txt", prepared="runs/data/one", **options))
    listed = _first_batch(TextDataModule(prepared=["runs/data/one"], seq_len=16, batch_size=2))
    assert single.shape == listed.shape == (2, 17)


def test_auto_prepares_into_the_cache_by_inputs_and_rebuilds_a_changed_corpus(tmp_path: Path) -> None:
    source = _corpus(tmp_path / "src")
    options = {"corpus": str(source), "prepared": "auto", "tokenizer": "bytes", "seq_len": 16, "batch_size": 2,
               "cache_dir": str(tmp_path / "cache")}
    data = TextDataModule(**options)
    _first_batch(data)
    folder = Path(data.prepared)
    assert folder.parent == tmp_path / "cache" / "prepared" and folder.name.startswith("corpus-bytes256-")
    first = read_manifest(folder)
    # Other settings get their own directory: an override never meets (or is refused by) another run's data.
    other = TextDataModule(**options | {"val_fraction": 0.2})
    assert Path(other.prepared) != folder
    # The same inputs reuse the directory; a changed corpus rebuilds it where a named directory would refuse.
    assert TextDataModule(**options).prepared == data.prepared
    source.write_text(source.read_text(encoding="utf-8") * 2, encoding="utf-8")
    _first_batch(TextDataModule(**options))
    rebuilt = read_manifest(folder)
    assert rebuilt.splits["train"]["bytes"] > first.splits["train"]["bytes"]


def test_the_quickstart_recipe_streams_prepared_data() -> None:
    import yaml

    recipe = yaml.safe_load((Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml").read_text())
    assert recipe["data"]["prepared"] == "auto" and recipe["data"]["corpus"] == "kjv"


def test_a_shuffled_batch_draws_from_the_whole_split(tmp_path: Path) -> None:
    """litdata's default shuffles blocks of 256 consecutive windows, so one batch came from one passage; the
    loader asks for a full permutation of each chunk instead."""
    rng = random.Random(0)  # random letters: every 16-byte window is unique, so its content gives its position
    source = tmp_path / "random.txt"
    source.write_text("".join("".join(rng.choices(string.ascii_lowercase, k=60)) + "\n" for _ in range(2000)))
    out = tmp_path / "bytes"
    prepare_data(str(source), out, tokenizer="bytes", **QUIET)
    ordered = torch.stack(_read_split(out, "train", seq_len=15))  # 16-token windows, in order
    position = {tuple(row.tolist()): index for index, row in enumerate(ordered)}
    assert len(position) == len(ordered) > 4 * 256
    loader = streaming_loader(out, "train", 15, 16, shuffle=True, seed=0, num_workers=0, replicas=1, rank=0)
    spreads = []
    for _, batch in zip(range(5), loader):
        indexes = [position[tuple(row.tolist())] for row in batch]
        spreads.append(max(indexes) - min(indexes))
    assert min(spreads) > 256, spreads


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux lists a process's threads in /proc")
def test_a_thread_the_threading_module_never_saw_counts_too() -> None:
    """pytest-xdist's channel to its controller runs in a thread started through ``_thread``, which
    ``threading.active_count()`` does not count: a worker forked litdata's workers beside it, and one of them hung
    (likely on stdin's lock, which that thread holds while it reads). The count token_writer decides by sees every
    thread."""
    import _thread
    import threading
    import time

    from lightning_p2r.data.prepared import threads_in_process

    before, known = threads_in_process(), threading.active_count()
    started, release = _thread.allocate_lock(), _thread.allocate_lock()
    started.acquire()
    release.acquire()

    def hold() -> None:
        started.release()
        release.acquire()

    _thread.start_new_thread(hold, ())
    started.acquire()
    try:
        assert threading.active_count() == known  # invisible to threading
        assert threads_in_process() == before + 1
    finally:
        release.release()
    deadline = time.monotonic() + 10
    while threads_in_process() != before and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.parametrize("keep", ["0", "1"], ids=["helper_per_call", "helper_kept"])
def test_a_process_running_other_threads_prepares_the_same_chunks_through_a_clean_helper(tmp_path: Path,
                                                                                         keep: str) -> None:
    """A process with live threads must not fork litdata's workers itself (a child can inherit a held lock and
    hang): it hands the work to one spawned helper, which forks them. Run in a fresh process so that the exit is
    seen too: the chunks are byte-identical to a one-thread run's, and nothing is reported at shutdown (workers
    started by spawn or forkserver directly left semaphores the resource tracker warned about)."""
    source = _corpus(tmp_path / "src")
    script = tmp_path / "run.py"  # a file: the spawned helper imports it again, under its main guard
    script.write_text(f"""
import multiprocessing, os, threading
from lightning_p2r.data import prepared

real, real_in = prepared._optimize_forked, prepared._optimize_forked_in


def spy(*args, **kwargs):  # module level: the helper finds it by name
    print("optimize in", os.getpid(), flush=True)
    return real(*args, **kwargs)


def spy_in(*args, **kwargs):  # what a helper is handed
    print("optimize in", os.getpid(), flush=True)
    return real_in(*args, **kwargs)


if __name__ == "__main__":
    prepared._optimize_forked, prepared._optimize_forked_in = spy, spy_in
    quiet = dict(tokenizer="bytes", piece_bytes=4096, num_workers=2, log=lambda line: None)
    print("main", os.getpid(), flush=True)
    prepared.prepare_data({str(source)!r}, {str(tmp_path / "alone")!r}, **quiet)
    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()
    print("threaded", flush=True)
    prepared.prepare_data({str(source)!r}, {str(tmp_path / "threaded")!r}, **quiet)
    stop.set()
    assert multiprocessing.get_start_method() == multiprocessing.get_all_start_methods()[0]  # the default still
""")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                            env=os.environ | {"LIGHTNING_P2R_KEEP_PREPARE_HELPER": keep})
    assert result.returncode == 0, result.stderr[-3000:]
    before, after = result.stdout.split("threaded\n")
    main_pid = before.split()[1]
    assert {line.split()[-1] for line in before.splitlines()[1:]} == {main_pid}  # one thread: forked here
    helpers = {line.split()[-1] for line in after.splitlines()}
    assert len(helpers) == 1 and main_pid not in helpers  # threads: every call in one helper process
    assert "resource_tracker" not in result.stderr and "leaked" not in result.stderr, result.stderr[-2000:]
    for split in ("train", "val"):
        alone = sorted((tmp_path / "alone" / split).glob("chunk-*.bin"))
        threaded = sorted((tmp_path / "threaded" / split).glob("chunk-*.bin"))
        assert alone and [p.read_bytes() for p in alone] == [p.read_bytes() for p in threaded]


@pytest.mark.slow
def test_a_kept_helper_that_died_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LIGHTNING_P2R_KEEP_PREPARE_HELPER=1 (set for the suite): a kept helper killed between two preparations (out of
    memory, say) is replaced by the next one, which still writes its directory."""
    import signal
    import threading
    import time
    from concurrent.futures.process import BrokenProcessPool

    from lightning_p2r.data import prepared

    monkeypatch.setenv(prepared.KEEP_HELPER_ENV, "1")
    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()  # a second thread: the helper path
    try:
        helper = prepared._helper_kept_for_the_process()
        os.kill(helper.submit(os.getpid).result(), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the pool has seen its process die
            try:
                helper.submit(os.getpid).result()
            except BrokenProcessPool:
                break
            time.sleep(0.05)
        prepare_data(str(_corpus(tmp_path / "src")), tmp_path / "out", tokenizer="bytes", piece_bytes=4096,
                     num_workers=1, log=lambda line: None)
    finally:
        stop.set()
    assert read_manifest(tmp_path / "out").splits["train"]["tokens"] > 0
    assert prepared._helper_kept_for_the_process() is not helper


@pytest.mark.slow
def test_preparing_leaves_no_working_folder_in_the_machines_temporary_directory(tmp_path: Path) -> None:
    """litdata's working folders default to <tmp>/chunks and <tmp>/data, shared by every run on the machine: each
    optimize call emptied them first, and they stayed behind (owned by the first user). Each preparation now has
    its own, removed after it; the prepared directory is the same."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    source = _corpus(tmp_path / "src")
    code = ("from lightning_p2r.data.prepared import prepare_data\n"
            f"prepare_data({str(source)!r}, {str(tmp_path / 'out')!r}, tokenizer='bytes', val_fraction=0.1, "
            "piece_bytes=4096, log=lambda line: None)\n")
    env = os.environ | {"TMPDIR": str(temporary), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_manifest(tmp_path / "out").splits["train"]["tokens"] > 0
    assert sorted(p.name for p in temporary.iterdir()) == []
