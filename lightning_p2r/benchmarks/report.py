"""Helpers shared by the benchmarks: CLI flags, environment, timing, CSV, plain-text tables and plots (the tables
themselves are :mod:`lightning_p2r.console.text_table`'s, which the CLI prints too)."""

from __future__ import annotations

import argparse
import csv
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_p2r.console.text_table import format_cell, format_table
from lightning_p2r.measure.speed import cpu_name

DEFAULT_OUT = Path("runs/benchmarks")
DOCS_OUT = Path("docs/benchmarks")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def base_parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the flags every benchmark takes: ``--out``, ``--device`` and ``--quick``."""
    # allow_abbrev=False: the quickstart benchmark forwards unknown flags to LightningCLI, and abbreviation
    # matching could otherwise swallow one of them.
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False)
    outputs = parser.add_mutually_exclusive_group()
    outputs.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for CSV and PNG (default: %(default)s)")
    # The committed figures change only when asked: a casual run must not overwrite what docs/benchmarks.md cites.
    outputs.add_argument("--update-docs", dest="out", action="store_const", const=DOCS_OUT,
                         help=f"write to {DOCS_OUT}, the figures docs/benchmarks.md shows")
    parser.add_argument("--device", default=default_device(), help="torch device (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes for smoke tests; the numbers mean nothing")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    return parser


def chosen_layouts(parser: argparse.ArgumentParser, text: str, known: Mapping[str, Any]) -> list[str]:
    """The comma-separated layout names of ``--layouts``; an unknown one is a usage error naming the choices."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown:
        parser.error(f"unknown layouts {unknown}; choose from {list(known)}")
    return names


def apply_threads(threads: int | None) -> None:
    """Set torch's thread count when asked: on a shared machine 1 thread can beat 2 stalled at every barrier. The
    environment's ``OMP_NUM_THREADS`` is set too: a ``Trainer`` in this process would otherwise reset the count to
    the cores per process when it starts fitting (Lightning does where the variable is unset), and the benchmark
    would time another thread count than it was asked for."""
    if threads:
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


# ------------------------------------------------------------------------------------------------ environment
def environment_info(device: str | torch.device = "cpu") -> dict[str, Any]:
    """What a reader needs to compare two runs: torch version, device name, torch threads and CPU count."""
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return {
        "torch": torch.__version__,
        "device": str(device),
        "device_name": name,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count() or 0,
        # Other processes compete for the same cores; a load near cpu_count before starting makes timings suspect.
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else math.nan,
    }


def print_environment(env: Mapping[str, Any]) -> None:
    print("environment: " + ", ".join(f"{key}={value}" for key, value in env.items()))


def with_environment(rows: Sequence[Mapping[str, Any]], env: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Rows with the environment appended as ``env_*`` columns, so a CSV read on its own says where it ran."""
    return [dict(row) | {f"env_{key}": value for key, value in env.items()} for row in rows]


# ------------------------------------------------------------------------------------------------------ timing


# ------------------------------------------------------------------------------------------------ CSV / table
def write_csv(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Write ``rows`` as CSV; the header is the union of their keys in first-seen order."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns))
        writer.writeheader()
        writer.writerows(rows)
    return path


def print_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> None:
    print(format_table(rows, columns))


# ------------------------------------------------------------------------------------------------------ plots
def pyplot() -> Any:
    # Imported lazily and on the Agg backend: benchmarks run headless, and importing them must not need a display.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_bar_chart(path: str | os.PathLike[str], categories: Sequence[str], series: Mapping[str, Sequence[float]],
                   *, ylabel: str, title: str) -> Path:
    """Grouped bars: one group per category, one bar per series (NaN leaves a gap)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5), dpi=110)
    width = 0.8 / max(len(series), 1)
    for i, (label, values) in enumerate(series.items()):
        xs = [c + (i - (len(series) - 1) / 2) * width for c in range(len(categories))]
        bars = ax.bar(xs, values, width, label=label)
        ax.bar_label(bars, labels=[format_cell(float(v)) for v in values], fontsize=7, padding=2)
    # Long or many category names would overlap side by side: slant them.
    crowded = sum(len(c) for c in categories) > 70
    ax.set_xticks(range(len(categories)), categories, rotation=25 if crowded else 0,
                  ha="right" if crowded else "center", fontsize=8 if crowded else None)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)


def save_line_chart(path: str | os.PathLike[str], x: Sequence[float], series: Mapping[str, Sequence[float]],
                    *, xlabel: str, ylabel: str, title: str, logy: bool = False) -> Path:
    """One line per series over a shared x axis; ``logy`` for values spread over orders of magnitude."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5), dpi=110)
    for label, values in series.items():
        ax.plot(x, values, marker=".", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if logy:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def save_figure(fig: Any, path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    import matplotlib.pyplot as plt

    plt.close(fig)  # figures are otherwise kept alive by pyplot's registry
    return path
