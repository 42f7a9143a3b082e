"""``prepare-data``: a corpus tokenized once into litdata chunks that training streams, with a manifest.

A prepared directory holds ``train/`` and ``val/`` (litdata's ``index.json`` and ``chunk-*.bin`` files of token ids),
``tokenizer.json`` (for BPE) and ``manifest.json``, written last: a directory without a manifest is half-written.
Everything is first written to ``<out>.partial`` and renamed into place, so a crash mid-way never leaves a directory
that looks complete, and a re-run over an existing directory either finds the same inputs (a no-op) or refuses.
An ``--overwrite`` run moves the old copy aside to ``<out>.previous`` just before the new one is renamed in, and
deletes it after: a crash between the two renames leaves no ``<out>``, and the next run puts the old copy back.

The corpus is one byte stream (a file, the sorted ``*.txt`` files of a folder one after another as they are, with no
separator added, unlike the in-memory path's blank line; the bundled
KJV, or documents handed in from Python); its last ``val_fraction`` of bytes, cut at a line end, is validation, as
in the in-memory path. The stream is cut into pieces of about ``piece_bytes`` at line ends, and litdata's
``optimize`` encodes the pieces in parallel workers; each worker reads its own byte range, so a large corpus is
never held whole in memory.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..files import write_atomically
from .corpus import load_corpus
from .tokenizer import BPETokenizer, ByteTokenizer, TextTokenizer, TokenizerKind

MANIFEST = "manifest.json"
FORMAT = 1
_BLOCK = 8 << 20
_LITDATA_HINT = ("litdata is not installed: run `pip install -c constraints.txt --no-deps litdata==0.2.76` (without "
                 "--no-deps pip also installs torchvision, whose CUDA build breaks `import lightning` on a CPU torch)")


class PreparedDataError(ValueError):
    """A refused ``prepare-data`` input or prepared directory, reported as one line naming it. ``in_fit``: the same
    refusal worded for a training run (``data.prepared``, ``data.corpus``), where the message names prepare-data's
    own flags (``--out``, ``--overwrite``), which ``fit`` does not have."""

    def __init__(self, message: str, *, in_fit: str | None = None) -> None:
        super().__init__(message)
        self.in_fit = in_fit


class PreparedFromOtherInputs(PreparedDataError):
    """``out`` holds a prepared directory of other inputs (``changed``, the manifest's names): worded for
    prepare-data (``--overwrite``, ``--out``); the data module words the fix for fit instead."""

    def __init__(self, out: Path, changed: list[str]) -> None:
        super().__init__(f"{out} was prepared from other inputs ({', '.join(changed)} differ): pass --overwrite to "
                         "rebuild it, or choose another --out")
        self.out, self.changed = out, changed


def require_litdata() -> Any:
    try:
        import litdata
    except ImportError as exc:
        raise PreparedDataError(_LITDATA_HINT) from exc
    return litdata


LITDATA_WORKING_FOLDERS = {"DATA_OPTIMIZER_CACHE_FOLDER": "chunks", "DATA_OPTIMIZER_DATA_CACHE_FOLDER": "data"}
"""The variables naming ``litdata.optimize``'s working folders, and the names it gives them under the temporary
directory by default."""


def _optimize_forked(fn: Any, inputs: list[Any], output_dir: str, num_workers: int, **options: Any) -> None:
    """``litdata.optimize`` into a token-chunk directory with forked workers (call it from a one-thread process).
    litdata sets the start method for the whole process (``force=True``): the caller's is put back afterwards."""
    import multiprocessing

    litdata = require_litdata()
    before = multiprocessing.get_start_method(allow_none=True)
    # litdata's working folders default to <tmp>/chunks and <tmp>/data, shared by every run on the machine: each
    # optimize call empties them as it starts (a concurrent run merges its index there), and they stay behind,
    # owned by the first user. This call gets its own, removed after it, unless the user chose them.
    with tempfile.TemporaryDirectory(prefix="p2r-litdata-") as working:
        chosen = {name: os.path.join(working, sub) for name, sub in LITDATA_WORKING_FOLDERS.items()
                  if name not in os.environ}
        os.environ.update(chosen)
        try:
            litdata.optimize(fn=fn, inputs=inputs, output_dir=output_dir, num_workers=num_workers, chunk_bytes="64MB",
                             item_loader=litdata.TokensLoader(), verbose=False, start_method="fork", **options)
        finally:
            multiprocessing.set_start_method(before, force=True)
            for name in chosen:
                os.environ.pop(name, None)


def _optimize_forked_in(folder: str, *args: Any, **options: Any) -> None:
    """:func:`_optimize_forked` in the helper, from the caller's working folder (a helper kept for the process
    started in another one, and the inputs may name files relative to it)."""
    os.chdir(folder)
    _optimize_forked(*args, **options)


def threads_in_process() -> int:
    """Threads this process runs: every OS thread where Linux lists them (``threading`` does not see threads started
    through ``_thread``, as pytest-xdist's channel to its controller is), else those ``threading`` knows."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


KEEP_HELPER_ENV = "LIGHTNING_P2R_KEEP_PREPARE_HELPER"
"""Set to 1: a process keeps its clean helper (:func:`token_writer`) once started, for its later calls, instead of
starting one per call (a few seconds each): for a process that prepares many directories, as the test suite does."""

_kept_helper: Any = None


def _new_helper() -> Any:
    """A one-process pool started with ``spawn``: a fresh interpreter, one thread."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))


def _helper_kept_for_the_process() -> Any:
    """The process's kept helper, started on first use (again after :func:`_forget_kept_helper`)."""
    global _kept_helper
    if _kept_helper is None:
        import atexit

        _kept_helper = _new_helper()
        # Shut down while the interpreter is whole: left to its weakref callback at exit, the pool's manager thread
        # finds its modules torn down and prints "Exception ignored ... 'NoneType' object has no attribute 'util'".
        atexit.register(_kept_helper.shutdown)
    return _kept_helper


def _forget_kept_helper() -> None:
    """Drop a kept helper that broke: the next call starts another."""
    global _kept_helper
    _kept_helper = None


@contextmanager
def token_writer() -> Iterator[Callable[..., None]]:
    """A function running ``litdata.optimize`` calls (arguments as :func:`_optimize_forked`), its workers forked
    only from a process with one thread.

    Forking starts workers in milliseconds but deadlocks when the parent runs other threads (a logger's event loop,
    tqdm's monitor, a training run's data threads, pytest-xdist's channel reading stdin): a child inherits a lock
    another thread held, and the parent waits on its queue forever (seen in the test suite beside pytest-xdist's
    channel thread, which reads stdin: the child closing stdin is the likely lock). So a one-thread process (the
    ``prepare-data`` command) forks its workers itself; any other hands the calls to a helper started with ``spawn``
    (a fresh interpreter, one thread: a few seconds per call of this function), which forks them. litdata's workers
    started by ``spawn`` or ``forkserver`` directly cost 2 to 8 s per call and leave semaphores the resource tracker
    reports at exit.

    The helper is shut down when the ``with`` block ends (an idle interpreter holding torch, about 150 MB, would
    otherwise sit beside the training run), unless ``LIGHTNING_P2R_KEEP_PREPARE_HELPER=1`` keeps one per process.
    """
    from concurrent.futures.process import BrokenProcessPool

    keep = os.environ.get(KEEP_HELPER_ENV) == "1"
    helper: Any = None

    def write(fn: Any, inputs: list[Any], output_dir: str, num_workers: int, **options: Any) -> None:
        nonlocal helper
        if helper is None and threads_in_process() == 1:
            _optimize_forked(fn, inputs, output_dir, num_workers, **options)
            return
        if helper is None:
            helper = _helper_kept_for_the_process() if keep else _new_helper()
        call = (_optimize_forked_in, os.getcwd(), fn, inputs, output_dir, num_workers)
        try:
            future = helper.submit(*call, **options)
        except BrokenProcessPool:  # a kept helper died after an earlier call (killed, out of memory): nothing of
            if not keep:           # this call ran yet, so another helper can take it
                raise
            _forget_kept_helper()
            helper = _helper_kept_for_the_process()
            future = helper.submit(*call, **options)
        try:
            future.result()
        except BrokenProcessPool:  # it died during this call: report it; the next call starts another helper
            if keep:
                _forget_kept_helper()
            raise

    try:
        yield write
    finally:
        if helper is not None and not keep:
            helper.shutdown()


def optimize_tokens(fn: Any, inputs: list[Any], output_dir: str, num_workers: int, **options: Any) -> None:
    """One ``litdata.optimize`` call through :func:`token_writer`."""
    with token_writer() as write:
        write(fn, inputs, output_dir, num_workers, **options)


# ---------------------------------------------------------------------------------------------- the corpus stream


@dataclass(frozen=True)
class Part:
    """One file of the stream (``path``), or the in-memory text of a named source (``path`` is None)."""

    name: str
    size: int
    path: str | None = None


class Corpus:
    """The corpus as one byte stream made of parts; ``read(part, start, end)`` returns that part's byte range."""

    def __init__(self, name: str, parts: list[Part], texts: dict[str, bytes] | None = None) -> None:
        self.name, self.parts, self._texts = name, parts, texts or {}

    @property
    def size(self) -> int:
        return sum(part.size for part in self.parts)

    def read(self, part: Part, start: int, end: int) -> bytes:
        if part.path is None:
            return self._texts[part.name][start:end]
        with open(part.path, "rb") as f:
            f.seek(start)
            return f.read(end - start)


def _checked_file(path: Path) -> tuple[Part, str]:
    """A file part and its SHA-256, read once in blocks; a non-UTF-8 byte is refused with its offset."""
    digest, decoder, offset = hashlib.sha256(), codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            try:
                decoder.decode(block)
            except UnicodeDecodeError as exc:
                raise PreparedDataError(
                    f"{path} is not valid UTF-8 (byte offset {offset + exc.start}): re-save it as UTF-8 "
                    "(e.g. `iconv -f latin1 -t utf-8`) or leave it out of the corpus") from exc
            digest.update(block)
            offset += len(block)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as exc:
        raise PreparedDataError(f"{path} is not valid UTF-8: it ends inside a multi-byte character") from exc
    return Part(str(path), offset, str(path)), digest.hexdigest()


def open_corpus(source: str | Iterable[str]) -> tuple[Corpus, str]:
    """The corpus of ``source`` ('kjv', a UTF-8 file, a folder of ``*.txt`` files, or an iterable of documents)
    and the SHA-256 of its content, which the manifest records."""
    if not isinstance(source, str) or source == "kjv":
        name = "kjv" if source == "kjv" else "documents"
        if name == "kjv":
            text = load_corpus("kjv").encode("utf-8")
        else:
            text = b"\n\n".join(document.encode("utf-8") for document in source)
        if not text.strip():
            raise PreparedDataError("the documents handed to prepare_data are empty")
        return Corpus(name, [Part(name, len(text))], {name: text}), hashlib.sha256(text).hexdigest()
    path = Path(source).expanduser()
    if not path.exists():
        raise PreparedDataError(f"corpus {path} does not exist: pass 'kjv', a UTF-8 .txt file or a folder of them")
    files = sorted(p for p in path.rglob("*.txt") if p.is_file()) if path.is_dir() else [path]
    if not files:
        raise PreparedDataError(f"corpus folder {path} holds no *.txt file")
    parts, digest = [], hashlib.sha256()
    for file in files:
        part, file_digest = _checked_file(file)
        parts.append(part)
        digest.update(f"{file.relative_to(path) if path.is_dir() else file.name}\0{file_digest}\0".encode())
    corpus = Corpus(str(path), parts)
    if corpus.size == 0:
        raise PreparedDataError(f"corpus {path} is empty")
    return corpus, digest.hexdigest()


MIN_SPLIT_BYTES = 64
"""The least validation text a prepared corpus holds out: about one window of a small model."""
LINE_SEARCH_BYTES = 1 << 16
"""How far past a cut point a line end is looked for before the cut falls back to a space, then to a character
boundary: text without line ends (one long line) still splits, and pieces stay near their size."""


def _line_end_after(corpus: Corpus, part: Part, offset: int) -> int:
    """The first offset at or after ``offset`` that starts a line of ``part``; failing one within
    ``LINE_SEARCH_BYTES``, the first that follows a space, else the first UTF-8 character boundary (or the part's
    end)."""
    if offset <= 0:
        return 0
    if offset >= part.size:
        return part.size
    block = corpus.read(part, offset - 1, min(part.size, offset - 1 + LINE_SEARCH_BYTES))
    for separator in (b"\n", b" "):
        found = block.find(separator)
        if found >= 0:
            return offset + found
    # No space either: cut before the first byte that starts a character (not a UTF-8 continuation byte).
    starts = [i for i, byte in enumerate(block[1:], 1) if byte & 0xC0 != 0x80]
    return offset - 1 + starts[0] if starts else min(part.size, offset - 1 + len(block))


@dataclass(frozen=True)
class Piece:
    """A byte range of one part: the unit a litdata worker encodes."""

    part: Part
    start: int
    end: int


def cut_pieces(corpus: Corpus, val_fraction: float, piece_bytes: int) -> dict[str, list[Piece]]:
    """Train and validation pieces: the stream's last ``val_fraction`` of bytes (cut at a line end, see
    :func:`_line_end_after` for text without one) is validation, and each split is cut at line ends into pieces of
    about ``piece_bytes``."""
    cut_at, before = round(corpus.size * (1.0 - val_fraction)), 0
    ranges: dict[str, list[tuple[Part, int, int]]] = {"train": [], "val": []}
    for part in corpus.parts:
        local = min(max(cut_at - before, 0), part.size)
        local = _line_end_after(corpus, part, local) if 0 < local < part.size else local
        if local > 0:
            ranges["train"].append((part, 0, local))
        if local < part.size:
            ranges["val"].append((part, local, part.size))
        before += part.size
    return {split: [piece for part, start, end in spans for piece in _pieces_of(corpus, part, piece_bytes, start, end)]
            for split, spans in ranges.items()}


def _pieces_of(corpus: Corpus, part: Part, piece_bytes: int, start: int = 0, end: int | None = None) -> list[Piece]:
    """``part``'s bytes from ``start`` to ``end`` cut at line ends into pieces of about ``piece_bytes``."""
    end = part.size if end is None else end
    pieces = []
    while start < end:
        stop = min(end, _line_end_after(corpus, part, start + piece_bytes))
        pieces.append(Piece(part, start, stop if stop > start else end))
        start = pieces[-1].end
    return pieces


# -------------------------------------------------------------------------------------------------- encoding


@dataclass(frozen=True)
class _EncodeJob:
    """Everything a litdata worker needs to encode one piece; picklable so it crosses into worker processes. A
    file piece is read by the worker (``path``, ``start``, ``end``); an in-memory piece travels as its ``data``."""

    path: str | None
    start: int
    end: int
    data: bytes | None
    tokenizer_path: str | None
    vocab_size: int

    def text(self) -> str:
        if self.data is not None:
            return self.data.decode("utf-8")
        with open(self.path, "rb") as f:  # type: ignore[arg-type]
            f.seek(self.start)
            return f.read(self.end - self.start).decode("utf-8")


_TOKENIZERS: dict[str | None, TextTokenizer] = {}


def _tokenizer_for(path: str | None, vocab_size: int) -> TextTokenizer:
    """Each worker loads the tokenizer once, not once per piece."""
    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = ByteTokenizer() if path is None else BPETokenizer.load(path, vocab_size)
    return _TOKENIZERS[path]


def token_dtype(vocab_size: int) -> torch.dtype:
    """The narrowest dtype litdata stores that holds every id (halves the chunks of a BPE corpus against int32)."""
    return torch.uint8 if vocab_size <= 1 << 8 else torch.int16 if vocab_size <= 1 << 15 else torch.int32


def encode_piece(job: _EncodeJob) -> Iterator[torch.Tensor]:
    """litdata's ``optimize`` function: the token ids of one piece, as one tensor."""
    text = job.text()
    tokenizer = _tokenizer_for(job.tokenizer_path, job.vocab_size)
    if isinstance(tokenizer, BPETokenizer):
        ids = [i for row in tokenizer.encode_batch(text.splitlines(keepends=True)) for i in row]
    else:
        ids = tokenizer.encode(text)
    if ids:
        yield torch.tensor(ids, dtype=token_dtype(job.vocab_size))


# -------------------------------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class Manifest:
    """What a prepared directory holds and was made from; ``manifest.json`` on disk."""

    tokenizer: TokenizerKind
    vocab_size: int
    tokenizer_sha256: str
    source: str
    source_sha256: str
    val_fraction: float
    splits: dict[str, dict[str, int]]
    """Per split: ``tokens`` and ``bytes`` (of UTF-8 text), the second for bits per byte."""
    languages: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    """A multilingual corpus's counts per language and split (its data is under ``<language>/<split>``)."""
    format: int = FORMAT
    tokenizer_borrowed: bool = False
    """The tokenizer was copied from another prepared directory (``--tokenizer_from``), not trained on this corpus:
    its ``tokenizer_sha256`` is then one of the inputs."""

    def split_dirs(self, split: str) -> dict[str, str]:
        """Where a split's chunks are, per language ("" for a single-language corpus), relative to the directory."""
        if not self.languages:
            return {"": split}
        return {code: f"{code}/{split}" for code, splits in self.languages.items() if split in splits}

    def inputs(self) -> dict[str, Any]:
        """The fields that decide the content: equal inputs mean a re-run would write the same tokens (the trained
        tokenizer follows from them, so a re-run can tell without training it)."""
        derived = ("splits", "languages", "source") + (() if self.tokenizer_borrowed else ("tokenizer_sha256",))
        return {k: v for k, v in asdict(self).items() if k not in derived}


def read_manifest(directory: str | Path) -> Manifest:
    """The manifest of a prepared directory, refusing one that is missing, half-written or of another format."""
    directory = Path(directory).expanduser()
    hint = f"run `lightning-p2r prepare-data --source SOURCE --out {directory}`"
    # A directory that exists but is damaged is rebuilt only with --overwrite (prepare-data refuses it otherwise).
    again = f"run `lightning-p2r prepare-data --source SOURCE --out {directory} --overwrite`"
    if not directory.is_dir():
        partial, previous = _sibling(directory, ".partial"), _sibling(directory, ".previous")
        state = (" (an earlier prepare-data --overwrite stopped while replacing it; its old copy is in "
                 f"{previous.name}, and re-running prepare-data puts it back first)" if previous.exists() else
                 " (a half-written .partial copy exists: an earlier prepare-data stopped)" if partial.exists() else "")
        raise PreparedDataError(f"prepared data {directory} does not exist{state}: {hint}")
    path = directory / MANIFEST
    if not path.is_file():
        raise PreparedDataError(f"{directory} has no {MANIFEST}, so it is not a (complete) prepared directory: {hint}")
    try:
        raw = json.loads(path.read_text())
        manifest = Manifest(**raw)
    except (ValueError, TypeError) as exc:
        raise PreparedDataError(f"{path} is not a manifest this version reads ({exc}): {again}") from exc
    if manifest.format != FORMAT:
        raise PreparedDataError(f"{path} has format {manifest.format}, this version reads {FORMAT}: {again}")
    for split in manifest.splits:
        for where in manifest.split_dirs(split).values():
            if not (directory / where / "index.json").is_file():
                raise PreparedDataError(f"{directory / where} has no index.json: {again}")
    return manifest


def _sibling(directory: Path, suffix: str) -> Path:
    return directory.with_name(directory.name + suffix)


def _check_out(out: Path, source: str | Iterable[str], overwrite: bool) -> None:
    """Refuse an ``out`` whose replacement would destroy what prepare-data did not write: a file, a folder that is
    not empty and holds no manifest (``--overwrite`` replaces prepared directories only: it once replaced a run
    folder, and the corpus itself when ``--out`` named it), a folder holding the corpus read, or, where a rebuild
    may replace ``out``, a folder of the user's in the way of the copy it keeps meanwhile (``OUT.previous``).
    Documents handed from Python (an iterable) are no path: not looked at here."""
    if isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        if path.exists() and (path.resolve() == out or out in path.resolve().parents):
            raise PreparedDataError(f"--out {out} holds the corpus it would read ({source}): preparing it would "
                                    "replace its own source; choose an --out outside the source",
                                    in_fit=f"data.prepared {out} holds data.corpus ({source}): preparing into it "
                                    "would replace the corpus; choose a --data.prepared folder outside it")
    if out.exists() and not out.is_dir():  # (out is resolved: a link is its target)
        raise PreparedDataError(f"--out {out} is a file: prepare-data writes a directory; choose another --out",
                                in_fit=f"data.prepared {out} is a file: a prepared corpus is a directory; choose "
                                "another --data.prepared folder")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise PreparedDataError(f"--out {out} is a folder prepare-data did not write (no {MANIFEST}), and not empty: "
                                "it replaces only prepared directories, even with --overwrite; choose another --out, "
                                "or empty that folder yourself",
                                in_fit=f"data.prepared {out} is a folder prepare-data did not write (no {MANIFEST}) "
                                "and not empty: choose another --data.prepared folder (fit prepares data.corpus into "
                                "it), or empty that folder yourself")
    previous = _sibling(out, ".previous")
    if overwrite and previous.exists() and not (previous / MANIFEST).is_file():
        raise PreparedDataError(f"{previous} is in the way: prepare-data keeps the old {out.name} there while it "
                                "replaces it; move or rename that folder")


def _recover(out: Path) -> None:
    """Undo what a prepare-data killed while replacing ``out`` left: the old copy is put back if the new one never
    arrived, and deleted if it did. Only a prepared directory (its manifest) is taken for that copy: a folder of
    that name the user keeps is left alone."""
    previous = _sibling(out, ".previous")
    if not (previous / MANIFEST).is_file():
        return
    if out.exists():
        _remove_prepared(previous)
    else:
        os.replace(previous, out)


def _remove_prepared(directory: Path) -> None:
    """Delete a prepared directory, its manifest last: one stopped half way still says it is prepare-data's."""
    for child in directory.iterdir():
        if child.name != MANIFEST:
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    (directory / MANIFEST).unlink(missing_ok=True)
    directory.rmdir()


def load_prepared_tokenizer(directory: str | Path, manifest: Manifest) -> TextTokenizer:
    if manifest.tokenizer == "bytes":
        return ByteTokenizer()
    return BPETokenizer.load(Path(directory).expanduser() / "tokenizer.json", manifest.vocab_size)


# --------------------------------------------------------------------------------------------------- prepare


def _train_tokenizer(corpus: Corpus, pieces: list[Piece], kind: TokenizerKind, vocab_size: int,
                     sample_bytes: int) -> TextTokenizer:
    """Raw bytes, or a BPE trained on up to ``sample_bytes`` of training text taken evenly across the pieces."""
    if kind == "bytes":
        return ByteTokenizer()
    step = max(1, -(-sum(p.end - p.start for p in pieces) // sample_bytes))
    sample = "".join(corpus.read(p.part, p.start, p.end).decode("utf-8") for p in pieces[::step])
    return BPETokenizer.train(sample, vocab_size)


def _check_options(kind: str, vocab_size: int, val_fraction: float, num_workers: int, piece_bytes: int) -> None:
    if kind not in ("bpe", "bytes"):
        raise PreparedDataError(f"tokenizer must be 'bpe' or 'bytes', got {kind!r}")
    if kind == "bytes" and vocab_size != 256:
        raise PreparedDataError(f"tokenizer 'bytes' has vocab_size 256, got {vocab_size}")
    if kind == "bpe" and not 512 <= vocab_size <= 1 << 31:
        raise PreparedDataError(f"vocab_size must be at least 512 for tokenizer 'bpe', got {vocab_size}")
    if not 0.0 < val_fraction < 1.0:
        raise PreparedDataError(f"val_fraction must be strictly between 0 and 1, got {val_fraction}")
    if num_workers < 1:
        raise PreparedDataError(f"num_workers must be at least 1, got {num_workers}")
    if piece_bytes < 1024:
        raise PreparedDataError(f"piece_bytes must be at least 1024, got {piece_bytes}")


def _tokenizer_sha(tok: TextTokenizer) -> str:
    return hashlib.sha256(tok.to_json().encode() if isinstance(tok, BPETokenizer) else b"bytes").hexdigest()


@dataclass(frozen=True)
class _Borrowed:
    """The tokenizer of another prepared directory (``tokenizer_from``)."""

    tokenizer: TextTokenizer
    kind: TokenizerKind
    vocab_size: int
    sha256: str


def _borrowed_tokenizer(directory: str | Path | None, kind: str | None, vocab_size: int | None) -> _Borrowed | None:
    """``tokenizer_from``'s tokenizer; an explicit ``tokenizer`` or ``vocab_size`` must be the one it has."""
    if directory is None:
        return None
    manifest = read_manifest(directory)
    for option, wanted, has in (("tokenizer", kind, manifest.tokenizer), ("vocab_size", vocab_size,
                                                                             manifest.vocab_size)):
        if wanted is not None and wanted != has:
            raise PreparedDataError(f"{option} {wanted!r} but --tokenizer_from {directory} has {option} {has!r}: drop "
                                    f"--{option} (the borrowed tokenizer decides it)")
    tok = load_prepared_tokenizer(directory, manifest)
    return _Borrowed(tok, manifest.tokenizer, manifest.vocab_size, _tokenizer_sha(tok))


def _split_tokens(directory: Path) -> int:
    index = json.loads((directory / "index.json").read_text())
    return sum(int(chunk["dim"]) for chunk in index["chunks"])


def _bible_streams(languages: list[str], piece_bytes: int) -> tuple[Corpus, str, dict[str, dict[str, list[Piece]]]]:
    """bible-multi as one in-memory part per (language, split), its hash, and its pieces per language and split."""
    from .bible_multi import SPLITS as BIBLE_SPLITS
    from .bible_multi import check_languages, read_texts

    try:
        texts = read_texts(check_languages(languages))
    except (ValueError, ImportError) as error:
        raise PreparedDataError(str(error)) from None
    data = {f"{code}/{split}": text.encode() for code, splits in texts.items() for split, text in splits.items()}
    corpus = Corpus("bible-multi", [Part(name, len(text)) for name, text in data.items()], data)
    digest = hashlib.sha256(b"".join(name.encode() + b"\0" + text for name, text in data.items())).hexdigest()
    streams = {code: {split: _pieces_of(corpus, corpus.parts[i * len(BIBLE_SPLITS) + j], piece_bytes)
                      for j, split in enumerate(BIBLE_SPLITS)} for i, code in enumerate(texts)}
    return corpus, digest, streams


def _balanced_sample(streams: dict[str, dict[str, list[Piece]]]) -> list[Piece]:
    """Training pieces for the tokenizer with every language equally represented: as many pieces from each
    language, taken evenly across its text (a language with more text does not get more merges)."""
    per_language = min(len(splits["train"]) for splits in streams.values())
    sample = []
    for splits in streams.values():
        train = splits["train"]
        step = len(train) / per_language
        sample += [train[int(i * step)] for i in range(per_language)]
    return sample


def prepare_data(source: str | Iterable[str], out: str | Path, tokenizer: TokenizerKind | None = None,
                 vocab_size: int | None = None, val_fraction: float = 0.05, num_workers: int = 1,
                 piece_bytes: int = 1 << 20, sample_bytes: int = 64 << 20, overwrite: bool = False,
                 languages: list[str] | None = None, log: Any = print,
                 tokenizer_from: str | Path | None = None) -> Manifest:
    """Tokenize ``source`` into the prepared directory ``out`` and return its manifest (see the module docstring).

    ``source='bible-multi'`` writes one ``<language>/{train,val,test}`` per language of ``languages`` (default all)
    with its book split (``bible_multi.py``; ``val_fraction`` does not apply) and one tokenizer trained on a
    language-balanced sample. Re-running with the same inputs returns the existing manifest without writing; other
    inputs over an existing directory are refused unless ``overwrite``, which rebuilds it (never mixes old chunks
    with new ones). ``tokenizer`` is 'bpe' unless given; ``tokenizer_from``, another prepared directory, gives the
    tokenizer instead of training one (its kind and vocabulary too), so that the two directories can be mixed.
    """
    borrowed = _borrowed_tokenizer(tokenizer_from, tokenizer, vocab_size)
    if borrowed is not None:
        tokenizer, vocab_size = borrowed.kind, borrowed.vocab_size
    tokenizer = tokenizer or "bpe"
    vocab_size = vocab_size if vocab_size is not None else (4096 if tokenizer == "bpe" else 256)
    _check_options(tokenizer, vocab_size, val_fraction, num_workers, piece_bytes)
    require_litdata()  # refused before any work when missing
    out = Path(out).expanduser().resolve()  # ("." has no name to put a sibling beside)
    _check_out(out, source, overwrite)
    _recover(out)
    if source == "bible-multi":
        from .bible_multi import TRANSLATIONS

        languages = list(TRANSLATIONS) if languages is None else languages
        corpus, source_sha, streams = _bible_streams(languages, piece_bytes)
        val_fraction, sample = 0.0, _balanced_sample(streams)
    else:
        if languages is not None:
            raise PreparedDataError("languages apply to the bible-multi corpus only")
        corpus, source_sha = open_corpus(source)
        streams = {"": cut_pieces(corpus, val_fraction, piece_bytes)}
        sample = streams[""]["train"]
        held_out = sum(piece.end - piece.start for piece in streams[""]["val"])
        if held_out < MIN_SPLIT_BYTES or not streams[""]["train"]:
            raise PreparedDataError(f"corpus {corpus.name} ({corpus.size} bytes) is too small to hold out "
                                    f"val_fraction={val_fraction} ({held_out} bytes, under {MIN_SPLIT_BYTES}): use "
                                    "a larger corpus or a larger val_fraction")
    existing = None
    if out.exists() and any(out.iterdir()):  # (an empty folder is taken as none)
        try:
            existing = read_manifest(out)
        except PreparedDataError:
            if not overwrite:  # (a folder prepare-data did not write was refused by _check_out, overwrite or not)
                raise PreparedDataError(f"{out} is a prepared directory that is not complete: pass --overwrite to "
                                        "rebuild it, or choose another --out") from None
    wanted = Manifest(tokenizer, vocab_size, borrowed.sha256 if borrowed else "", corpus.name, source_sha,
                      val_fraction, {}, tokenizer_borrowed=borrowed is not None)
    if existing is not None:
        if existing.inputs() == wanted.inputs():
            log(f"{out} is already prepared from these inputs: nothing to do")
            return existing
        if not overwrite:
            before, now = existing.inputs(), wanted.inputs()
            changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
            raise PreparedFromOtherInputs(out, changed)
    tok = borrowed.tokenizer if borrowed else _train_tokenizer(corpus, sample, tokenizer, vocab_size, sample_bytes)
    tokenizer_sha = _tokenizer_sha(tok)
    partial = _sibling(out, ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # what a stopped run left
    partial.mkdir(parents=True)
    tokenizer_path = None
    if isinstance(tok, BPETokenizer):
        tokenizer_path = str(partial / "tokenizer.json")
        tok.save(tokenizer_path)
    counts: dict[str, dict[str, dict[str, int]]] = {}
    with token_writer() as write:  # one helper process for every split, where one is needed
        for language, pieces in streams.items():
            counts[language] = {}
            for split, split_pieces in pieces.items():
                target = partial / language / split
                jobs = [_EncodeJob(p.part.path, p.start, p.end,
                                   None if p.part.path else corpus.read(p.part, p.start, p.end), tokenizer_path,
                                   vocab_size) for p in split_pieces]
                workers = min(num_workers, len(jobs))
                log(f"{language + '/' if language else ''}{split}: encoding {len(jobs)} pieces of {corpus.name} "
                    f"with {workers} worker(s)")
                write(encode_piece, jobs, str(target), workers, reorder_files=False, keep_data_ordered=True)
                counts[language][split] = {"tokens": _split_tokens(target),
                                           "bytes": sum(p.end - p.start for p in split_pieces)}
    totals = {split: {key: sum(c[split][key] for c in counts.values()) for key in ("tokens", "bytes")}
              for split in next(iter(counts.values()))}
    manifest = Manifest(tokenizer, vocab_size, tokenizer_sha, corpus.name, source_sha, val_fraction, totals,
                        {code: c for code, c in counts.items() if code}, tokenizer_borrowed=borrowed is not None)
    write_atomically(partial / MANIFEST, (json.dumps(asdict(manifest), indent=2) + "\n").encode())
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()  # an empty folder the user made for it
    if out.exists():  # only reached with overwrite: the new copy is complete before the old one goes
        os.replace(out, _sibling(out, ".previous"))
    os.replace(partial, out)
    _recover(out)
    return manifest
