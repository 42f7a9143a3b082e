"""What a run streams from prepared data, and in which proportions (docs/data.md, "Language mixtures").

A prepared directory of one corpus is streamed as it is. A multilingual directory is a mixture of its chosen
languages, drawn by temperature (``data.language_alpha``) or by explicit ``data.language_weights``. Every refusal is
one line naming the option and the fix, raised when the data module is built, before any training step.
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

    def folder(self, split: str) -> str:
        """The split's chunk folder."""
        return str(self.directory / self.language / split)

    def counts(self, split: str) -> dict[str, int]:
        """The split's ``tokens`` and ``bytes`` of text."""
        return self.manifest.languages[self.language][split] if self.language else self.manifest.splits[split]


@dataclass(frozen=True)
class Mixture:
    """The streams a run reads and each one's share of the training windows."""

    streams: dict[str, Stream]
    """By name (a language code); a single corpus is one stream named ""."""
    weights: dict[str, float]
    """Each named stream's probability of giving a training window (they sum to one); empty for a single corpus."""

    @property
    def manifest(self) -> Manifest:
        """The manifest that gives the tokenizer and the vocabulary."""
        return next(iter(self.streams.values())).manifest


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


def chosen_languages(corpus: str | None, prepared: str | None, languages: list[str] | None,
                     language_weights: dict[str, float] | None) -> list[str] | None:
    """The languages a run trains and evaluates on, checked as far as can be without the manifest: ``languages``,
    or else the keys of ``language_weights`` (which must then name the same ones); None for all the directory holds."""
    if prepared is None:
        for option, value in (("languages", languages), ("language_weights", language_weights)):
            if value is not None:
                raise ValueError(f"data.{option} applies to a multilingual prepared directory only: set data.prepared "
                                 "(prepare-data --source bible-multi), or drop it")
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


def read_mixture(prepared: str, tokenizer: str | None, vocab_size: int | None, languages: list[str] | None,
                 alpha: float, language_weights: dict[str, float] | None = None) -> Mixture:
    """The prepared directory's manifest, checked against the recipe's tokenizer and vocabulary, and the streams
    and weights of its (chosen) languages; ``languages`` as :func:`chosen_languages` returns them."""
    manifest = read_manifest(prepared)
    match_manifest(prepared, manifest, tokenizer, vocab_size)
    directory = Path(prepared).expanduser()
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
