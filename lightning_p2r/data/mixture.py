"""What a run streams from prepared data, and in which proportions (docs/data.md: "Language mixtures" and "Mixing
prepared directories").

A prepared directory of one corpus is streamed as it is. A multilingual directory is a mixture of its chosen
languages, drawn by temperature (``data.language_alpha``) or by explicit ``data.language_weights``. A list of
single-corpus directories that share one tokenizer is a mixture of the directories, drawn by
``data.prepared_weights`` (default: in proportion to their training tokens). Every refusal is one line naming the
option and the fix, raised when the data module is built, before any training step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .prepared import Manifest, read_manifest
from .streaming import mixture_weights


@dataclass(frozen=True)
class Stream:
    """One part of a mixture: a language of a multilingual directory, or a whole single-corpus directory."""

    directory: Path
    manifest: Manifest
    language: str = ""

    def _split(self, split: str) -> str:
        # A single corpus keeps no test split: its test pass reads validation, as the in-memory path does.
        return split if self.language or split in self.manifest.splits else "val"

    def folder(self, split: str) -> str:
        """The split's chunk folder."""
        return str(self.directory / self.language / self._split(split))

    def counts(self, split: str) -> dict[str, int]:
        """The split's ``tokens`` and ``bytes`` of text."""
        if self.language:
            return self.manifest.languages[self.language][split]
        return self.manifest.splits[self._split(split)]


@dataclass(frozen=True)
class Mixture:
    """The streams a run reads and each one's share of the training windows."""

    streams: dict[str, Stream]
    """By name (a language code, or a listed directory's name); a single corpus is one stream named ""."""
    weights: dict[str, float]
    """Each named stream's probability of giving a training window (they sum to one); empty for a single corpus."""

    @property
    def manifest(self) -> Manifest:
        """The manifest that gives the tokenizer and the vocabulary (every listed directory shares them)."""
        return next(iter(self.streams.values())).manifest

    @property
    def directory(self) -> Path:
        """The (first) prepared directory: its tokenizer.json is every stream's tokenizer."""
        return next(iter(self.streams.values())).directory


def check_weights(option: str, weights: Mapping[str, float] | Sequence[float], example: str) -> None:
    """Refuse sampling weights that cannot be normalised into probabilities: negative, non-finite or all zero."""
    values = list(weights.values()) if isinstance(weights, Mapping) else list(weights)
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
           or v < 0]
    if bad or not any(v > 0 for v in values):
        problem = f"{bad[0]!r} is not a finite number >= 0" if bad else "no weight is above zero"
        raise ValueError(f"{option}={_shown(weights)}: {problem}; give finite, non-negative weights with at least one "
                         f"above zero (they are normalised), e.g. {example}")


def _shown(weights: Any) -> str:
    return str(dict(weights)) if isinstance(weights, Mapping) else str(list(weights))


def check_directory_list(corpus: str | None, prepared: str | list[str] | None,
                         prepared_weights: list[float] | None) -> None:
    """The options that go with a list of prepared directories, checked before any manifest is read."""
    if not isinstance(prepared, (list, tuple)):
        if prepared_weights is not None:
            raise ValueError(f"data.prepared_weights={_shown(prepared_weights)} weighs the directories of a list in "
                             f"data.prepared, which is {prepared!r}: list the directories, or drop "
                             "data.prepared_weights")
        return
    if not prepared:
        raise ValueError("data.prepared is an empty list: name a prepared directory, or several to mix")
    if corpus is not None:
        raise ValueError(f"data.corpus={corpus} prepares one directory, and data.prepared lists {len(prepared)}: "
                         "prepare each with `lightning-p2r prepare-data` first and drop data.corpus")
    if prepared_weights is not None:
        if len(prepared_weights) != len(prepared):
            raise ValueError(f"data.prepared_weights={_shown(prepared_weights)} has {len(prepared_weights)} weight(s) "
                             f"for the {len(prepared)} directories of data.prepared: give one per directory, in "
                             "its order")
        check_weights("data.prepared_weights", prepared_weights, "[3, 1]")


def chosen_languages(corpus: str | None, prepared: str | list[str] | None, languages: list[str] | None,
                     language_weights: dict[str, float] | None) -> list[str] | None:
    """The languages a run trains and evaluates on, checked as far as can be without the manifest: ``languages``,
    or else the keys of ``language_weights`` (which must then name the same ones); None for all the directory holds."""
    for option, value in (("languages", languages), ("language_weights", language_weights)):
        if value is not None and prepared is None:
            raise ValueError(f"data.{option} applies to a multilingual prepared directory only: set data.prepared "
                             "(prepare-data --source bible-multi), or drop it")
        if value is not None and isinstance(prepared, (list, tuple)):
            raise ValueError(f"data.{option} chooses among the languages of one multilingual directory, and "
                             "data.prepared is a list: weigh its directories with data.prepared_weights, or drop "
                             f"data.{option}")
    if language_weights is None:
        return languages
    check_weights("data.language_weights", language_weights, "{en: 3, fr: 1}")
    if languages is not None and sorted(languages) != sorted(language_weights):
        raise ValueError(f"data.languages={languages} but data.language_weights names {list(language_weights)}: name "
                         "the same languages in both, or drop data.languages (the weights' languages are the ones "
                         "trained on)")
    if corpus not in (None, "bible-multi"):
        raise ValueError(f"data.language_weights={_shown(language_weights)} but data.corpus={corpus} prepares one "
                         "corpus, not languages: drop data.language_weights, or use corpus bible-multi")
    chosen = list(languages if languages is not None else language_weights)
    if corpus == "bible-multi":
        from .bible_multi import TRANSLATIONS

        _refuse_unknown("data.language_weights", chosen, list(TRANSLATIONS), "bible-multi")
    return chosen


def _refuse_unknown(option: str, chosen: list[str], available: list[str], where: str) -> None:
    unknown = [code for code in chosen if code not in available]
    if unknown or not chosen:
        raise ValueError(f"{option}: {where} has no language {', '.join(map(repr, unknown)) or '(none chosen)'}: it "
                         f"holds {', '.join(available)}")


def match_manifest(prepared: str, manifest: Manifest, tokenizer: str | None, vocab_size: int | None) -> None:
    """A recipe that names another tokenizer or vocabulary than the prepared directory's is refused, naming both."""
    if vocab_size is not None and vocab_size != manifest.vocab_size:
        raise ValueError(f"data.vocab_size={vocab_size} but {prepared} was prepared with vocab_size "
                         f"{manifest.vocab_size}: drop data.vocab_size, or prepare the corpus again with it")
    if tokenizer is not None and tokenizer != manifest.tokenizer:
        raise ValueError(f"data.tokenizer={tokenizer!r} but {prepared} was prepared with tokenizer "
                         f"{manifest.tokenizer!r}: drop data.tokenizer, or prepare the corpus again with it")


def read_mixture(prepared: str | list[str], tokenizer: str | None, vocab_size: int | None,
                 languages: list[str] | None, alpha: float, language_weights: dict[str, float] | None = None,
                 prepared_weights: list[float] | None = None) -> Mixture:
    """The prepared directory's manifest, checked against the recipe's tokenizer and vocabulary, and the streams
    and weights of its (chosen) languages (``languages`` as :func:`chosen_languages` returns them); for a list of
    directories, each one's (see :func:`_listed_directories`)."""
    if isinstance(prepared, (list, tuple)):
        return _listed_directories(list(prepared), tokenizer, vocab_size, prepared_weights)
    manifest = read_manifest(prepared)
    match_manifest(prepared, manifest, tokenizer, vocab_size)
    directory = Path(prepared).expanduser().resolve()  # stream folders join onto it
    if not manifest.languages:
        if language_weights is not None:
            raise ValueError(f"data.language_weights={_shown(language_weights)} but {prepared} holds one corpus, not "
                             "languages: drop data.language_weights")
        if languages is not None:
            raise ValueError(f"data.languages={languages} but {prepared} holds one corpus, not languages")
        return Mixture({"": Stream(directory, manifest)}, {})
    chosen = list(manifest.languages) if languages is None else languages
    option = "data.language_weights" if language_weights is not None else "data.languages"
    _refuse_unknown(option, chosen, list(manifest.languages), prepared)
    if language_weights is None:
        weights = mixture_weights({code: manifest.languages[code]["train"]["tokens"] for code in chosen}, alpha)
    else:
        total = sum(language_weights.values())
        weights = {code: language_weights[code] / total for code in chosen}
    return Mixture({code: Stream(directory, manifest, code) for code in chosen}, weights)


def _listed_directories(prepared: list[str], tokenizer: str | None, vocab_size: int | None,
                        weights: list[float] | None) -> Mixture:
    """One stream per listed single-corpus directory, named by the directory's name, all with the first one's
    tokenizer; weighted by ``weights`` or else by training tokens (as if the corpora were concatenated)."""
    streams: dict[str, Stream] = {}
    for entry in prepared:
        directory = Path(entry).expanduser().resolve()
        manifest = read_manifest(directory)
        match_manifest(entry, manifest, tokenizer, vocab_size)
        if manifest.languages:
            raise ValueError(f"data.prepared lists {entry}, a directory of {len(manifest.languages)} languages: list "
                             "single-corpus directories, or train on this one alone and weigh its languages with "
                             "data.language_weights")
        if directory.name in streams:
            raise ValueError(f"data.prepared lists two directories named {directory.name!r} "
                             f"({streams[directory.name].directory} and {directory}): the name keys their metrics, so "
                             "rename one")
        if streams:
            _same_tokenizer(prepared[0], next(iter(streams.values())).manifest, entry, manifest)
        streams[directory.name] = Stream(directory, manifest)
    raw = weights if weights is not None else [s.manifest.splits["train"]["tokens"] for s in streams.values()]
    total = sum(raw)
    return Mixture(streams, {name: weight / total for name, weight in zip(streams, raw)})


def _same_tokenizer(first: str, first_manifest: Manifest, other: str, manifest: Manifest) -> None:
    """Mixed directories must mean the same text by the same id: one tokenizer kind, vocabulary and BPE."""
    if (manifest.tokenizer, manifest.vocab_size) != (first_manifest.tokenizer, first_manifest.vocab_size):
        raise ValueError(f"data.prepared mixes {first} (tokenizer {first_manifest.tokenizer!r}, vocab_size "
                         f"{first_manifest.vocab_size}) and {other} (tokenizer {manifest.tokenizer!r}, vocab_size "
                         f"{manifest.vocab_size}): prepare {other} again with "
                         f"`lightning-p2r prepare-data --tokenizer_from {first} --overwrite ...`")
    if manifest.tokenizer_sha256 != first_manifest.tokenizer_sha256:
        raise ValueError(f"data.prepared mixes {first} and {other}, whose {manifest.tokenizer} tokenizers differ "
                         "(each was trained on its own corpus, so one id means other text in each): prepare "
                         f"{other} again with `lightning-p2r prepare-data --tokenizer_from {first} --overwrite ...`")
