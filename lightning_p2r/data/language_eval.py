"""Per-language evaluation of a multilingual run: loss, perplexity and bits per byte for each language, and the
table ``lightning-p2r validate``/``test`` and the multilingual benchmark print from the logged metrics.

Bits per byte divide the loss by what the text weighs in bytes rather than in tokens, so languages (a script that
takes three UTF-8 bytes per character against one) and tokenizers (bytes against a BPE) compare on one scale:
``bpb = loss_nats * tokens / (bytes * ln 2)``, with the split's tokens-per-byte ratio from the prepared manifest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..console.text_table import format_table

COLUMNS = {"language": "language", "script": "script", "tokens": "tokens", "loss": "loss", "ppl": "perplexity",
           "bpb": "bits/byte"}
"""The keys of :func:`language_rows` and the headers :func:`language_table` gives them."""


class LanguageLosses:
    """Token-weighted sums of the loss per language over one evaluation pass, reduced over ranks at its end."""

    def __init__(self, languages: list[str]) -> None:
        self.languages = languages
        self.loss_sums = torch.zeros(len(languages), dtype=torch.float64)
        self.tokens = torch.zeros(len(languages), dtype=torch.float64)

    def add(self, index: int, mean_loss: torch.Tensor, tokens: int) -> None:
        self.loss_sums[index] += float(mean_loss.detach()) * tokens
        self.tokens[index] += tokens

    def metrics(self, prefix: str, tokens_per_byte: dict[str, float]) -> dict[str, float]:
        """``<prefix>/loss``, ``/ppl``, ``/bpb`` and ``/tokens`` (the tokens scored) for each language and over all
        of them (token-weighted)."""
        out: dict[str, float] = {}
        total_nats, total_bytes = 0.0, 0.0
        for code, loss_sum, tokens in zip(self.languages, self.loss_sums.tolist(), self.tokens.tolist()):
            if tokens == 0:
                continue
            loss = loss_sum / tokens
            text_bytes = tokens / tokens_per_byte[code]
            out[f"{prefix}/loss/{code}"] = loss
            out[f"{prefix}/ppl/{code}"] = math.exp(min(loss, 700.0))
            out[f"{prefix}/bpb/{code}"] = loss_sum / (text_bytes * math.log(2))
            out[f"{prefix}/tokens/{code}"] = tokens
            total_nats, total_bytes = total_nats + loss_sum, total_bytes + text_bytes
        count = float(self.tokens.sum())
        if count:
            out[f"{prefix}/loss"] = total_nats / count
            out[f"{prefix}/ppl"] = math.exp(min(total_nats / count, 700.0))
            out[f"{prefix}/bpb"] = total_nats / (total_bytes * math.log(2))
            out[f"{prefix}/tokens"] = count
        return out


def _script(code: str) -> str:
    from .bible_multi import SCRIPTS, TRANSLATIONS

    return SCRIPTS.get(code, "Latin") if code in TRANSLATIONS else ""


def language_rows(metrics: Mapping[str, Any], split: str, languages: Sequence[str] | None = None
                  ) -> list[dict[str, Any]]:
    """One row per language with ``<split>/loss/<code>`` in ``metrics`` (in the order of ``languages`` when given,
    else as the metrics list them), then the overall row ``all``: language, script (when the corpus names it),
    tokens scored, loss (nats per token), perplexity and bits per byte. Values may be floats or 0-d tensors (what a
    Trainer's ``callback_metrics`` holds); empty when the metrics hold no language."""
    marker = f"{split}/loss/"
    found = [key[len(marker):] for key in metrics if key.startswith(marker)]
    codes = [code for code in languages if code in found] if languages is not None else found

    def row(name: str, script: str, suffix: str) -> dict[str, Any]:
        values = {key: float(metrics[f"{split}/{key}{suffix}"]) for key in ("loss", "ppl", "bpb")}
        tokens = metrics.get(f"{split}/tokens{suffix}")
        return {"language": name, "script": script, "tokens": None if tokens is None else round(float(tokens))
                } | values

    rows = [row(code, _script(code), f"/{code}") for code in codes]
    return rows + [row("all", "", "")] if rows and f"{split}/loss" in metrics else rows


def language_table(metrics: Mapping[str, Any], split: str, languages: Sequence[str] | None = None) -> str:
    """The rows of :func:`language_rows` as an aligned plain-text table; empty when the metrics hold no language."""
    rows = language_rows(metrics, split, languages)
    if not rows:
        return ""
    return format_table([{COLUMNS[key]: value for key, value in row.items()} for row in rows], list(COLUMNS.values()))
