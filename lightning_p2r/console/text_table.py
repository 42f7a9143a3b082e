"""Aligned plain-text tables, printed by the benchmarks and by the CLI (``lightning-p2r validate``'s per-language
table)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def format_cell(value: Any) -> str:
    """A float with three decimals (three significant digits below 0.01, thousands separators from 1000, ``-`` for
    NaN); ``-`` for None; anything else as ``str`` gives it."""
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.3g}" if 0 < abs(value) < 0.01 else f"{value:.3f}"
    return "-" if value is None else str(value)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """An aligned plain-text table: text left-aligned, numbers right-aligned."""
    cells = [[format_cell(row.get(col)) for col in columns] for row in rows]
    widths = [max([len(col)] + [len(r[i]) for r in cells]) for i, col in enumerate(columns)]
    numeric = [all(isinstance(row.get(col), int | float) for row in rows) for col in columns]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    return "\n".join([line(columns), line(["-" * w for w in widths]), *(line(r) for r in cells)])
