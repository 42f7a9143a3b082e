"""Tokenizers (byte-level BPE trained on the corpus, or raw bytes), their cache, and the corpus encoded once."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

import numpy as np
import torch

from ..files import write_atomically
from .corpus import load_corpus

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TokenizerKind = Literal["bpe", "bytes"]

ENDOFTEXT = "<|endoftext|>"
DEFAULT_BPE_VOCAB = 4096
MIN_BPE_VOCAB = 512
BYTE_VOCAB = 256
# Bumped whenever tokenizer training or id encoding changes, so stale cache files are never reused.
_CACHE_VERSION = "1"

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
        write_atomically(Path(path), self.to_json().encode("utf-8"))

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
        write_atomically(path, buf.getvalue())
    return tokenizer, torch.from_numpy(ids.astype(np.int64))
