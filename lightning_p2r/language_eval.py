"""Per-language evaluation of a multilingual run: loss, perplexity and bits per byte for each language.

Bits per byte divide the loss by what the text weighs in bytes rather than in tokens, so languages (a script that
takes three UTF-8 bytes per character against one) and tokenizers (bytes against a BPE) compare on one scale:
``bpb = loss_nats * tokens / (bytes * ln 2)``, with the split's tokens-per-byte ratio from the prepared manifest.
"""

from __future__ import annotations

import math

import torch


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
        """``<prefix>/loss``, ``/ppl`` and ``/bpb`` for each language and over all of them (token-weighted)."""
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
            total_nats, total_bytes = total_nats + loss_sum, total_bytes + text_bytes
        count = float(self.tokens.sum())
        if count:
            out[f"{prefix}/loss"] = total_nats / count
            out[f"{prefix}/ppl"] = math.exp(min(total_nats / count, 700.0))
            out[f"{prefix}/bpb"] = total_nats / (total_bytes * math.log(2))
        return out
