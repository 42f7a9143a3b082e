"""The per-language table `lightning-p2r validate`/`test` and the multilingual benchmark print: a pure function of
the logged metrics."""

import warnings

import torch

from lightning_p2r.console.known_warnings import silence_known_noise
from lightning_p2r.data.language_eval import LanguageLosses, language_rows, language_table


def _metrics() -> dict[str, float]:
    losses = LanguageLosses(["en", "zh", "xx"])
    losses.add(0, torch.tensor(2.0), 300)
    losses.add(1, torch.tensor(4.0), 100)
    losses.add(2, torch.tensor(3.0), 100)
    return losses.metrics("val", {"en": 0.5, "zh": 1.0, "xx": 0.25})


def test_rows_follow_the_languages_and_end_with_the_token_weighted_overall_row() -> None:
    metrics = _metrics()
    rows = language_rows(metrics, "val", ["zh", "en", "xx"])
    assert [(r["language"], r["script"], r["tokens"]) for r in rows] == [
        ("zh", "Han", 100), ("en", "Latin", 300), ("xx", "", 100), ("all", "", 500)]
    assert rows[0]["loss"] == 4.0 and rows[-1]["loss"] == metrics["val/loss"] == (600 + 400 + 300) / 500
    assert rows[1]["bpb"] == metrics["val/bpb/en"] and rows[1]["ppl"] == metrics["val/ppl/en"]
    # Without an order, the metrics' own; a 0-d tensor (a Trainer's callback_metrics) reads like a float.
    as_tensors = {key: torch.tensor(value) for key, value in metrics.items()}
    assert [r["language"] for r in language_rows(as_tensors, "val")] == ["en", "zh", "xx", "all"]
    assert language_rows(metrics, "test") == [] and language_table({"val/loss": 1.0}, "val") == ""


def test_the_table_has_one_line_per_row_with_headers_and_rounded_numbers() -> None:
    lines = language_table(_metrics(), "val", ["en", "zh"]).splitlines()
    assert lines[0].split() == ["language", "script", "tokens", "loss", "perplexity", "bits/byte"]
    assert set(lines[1]) <= {"-", " "}
    assert lines[2].split() == ["en", "Latin", "300", "2.000", "7.389", "1.443"]  # bpb = 2 * 0.5 / ln 2
    assert lines[3].split() == ["zh", "Han", "100", "4.000", "54.598", "5.771"]
    assert lines[4].split()[0] == "all" and lines[4].split()[1] == "500"  # every language the metrics hold
    without_tokens = {key: value for key, value in _metrics().items() if "/tokens" not in key}
    assert language_table(without_tokens, "val", ["en"]).splitlines()[2].split()[2] == "-"


def test_the_sync_dist_notice_is_silenced_for_the_language_metrics_only() -> None:
    """They are summed over the ranks before they are logged; another metric logged without sync_dist still warns."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        silence_known_noise()
        for name in ("val/bpb/zh", "test/tokens", "val/loss", "train/loss", "val/accuracy/en"):
            warnings.warn(f"It is recommended to use `self.log({name!r}, ..., sync_dist=True)` when logging on epoch "
                          "level in distributed setting to accumulate the metric across devices.", stacklevel=1)
    assert [str(w.message).split("'")[1] for w in caught] == ["train/loss", "val/accuracy/en"]
