"""Capacity: the largest model that trains under a per-rank memory limit, for each layout, and what setup costs.

    python -m lightning_p2r.benchmarks.capacity [--sizes 2 4 8 16] [--layouts none zero3 offload zero3_offload]
        [--memory-limit 3GiB] [--steps 5] [--dim 1024] [--out DIR] [--label TEXT]

For a ladder of dense M6 models (``--sizes``: layer counts at width ``--dim``, or ``LAYERSxDIM`` such as ``8x2048``;
``moe_layers=[]`` makes every feed-forward dense) and the layouts

- ``none``: one process, every block resident;
- ``zero3``: 2 ranks, ``P2RStrategy(sharding="zero3")``;
- ``offload``: one process, ``P2RStrategy(offload_fraction=1.0)``;
- ``zero3_offload``: 2 ranks, both,

each run is a fresh process group that trains ``--steps`` steps and reports, per rank (figures taken in the rank's
own process by :class:`~lightning_p2r.measure.memory.SetupMemoryProbe`): the peak growth of memory from
the start of Lightning's ``setup`` (before ``configure_model`` builds the model) to the first training batch, in
MiB and over the model's fp32 parameter bytes; the peak over the whole run; and whether every step ran. The summary
gives, per layout, the largest model in the ladder whose every rank stayed at or under ``--memory-limit``.

On a CPU the memory is host RSS and the limit is checked against the measured peak, not enforced: the only
per-process limit Linux offers without cgroups, ``RLIMIT_AS``, counts address space, and torch, glibc and gloo
reserve far more of it than they touch (a fresh process with torch and gloo maps several GiB), so it would stop
runs whose resident memory fits. With ``--device cuda`` the limit is enforced with
``torch.cuda.set_per_process_memory_fraction`` (an allocation past it raises ``OutOfMemoryError``, which the run
reports as a failed run) and the fit is judged on ``torch.cuda.max_memory_allocated``; host RSS is reported as well,
as offload moves memory there. That path is written but was not run here (no accelerator on the machine the
committed figures come from).

Two-rank runs are launched the way a user launches them: the benchmark starts one subprocess per run
(``python -m lightning_p2r.benchmarks.capacity --worker SPEC``), whose ``Trainer(devices=2, accelerator="cpu")``
re-launches it once more for rank 1 with Lightning's own subprocess launcher; each rank writes its figures to a JSON
file that the parent collects. Every worker reports where it imported ``lightning_p2r`` from, and the parent
refuses figures from another copy than its own, so comparing two checkouts (``PYTHONPATH=<worktree>``, run from
inside the worktree: ``python -m`` puts the current directory first on ``sys.path``) measures the one intended.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from lightning_p2r.benchmarks.report import (
    base_parser,
    environment_info,
    print_environment,
    print_table,
    pyplot,
    save_figure,
    with_environment,
    write_csv,
)
from lightning_p2r.measure.run import worker_env

LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "none": (1, {}),
    "zero3": (2, {"sharding": "zero3"}),
    "offload": (1, {"offload_fraction": 1.0}),
    "zero3_offload": (2, {"sharding": "zero3", "offload_fraction": 1.0}),
}
COLUMNS = ["label", "layout", "layers", "dim", "params_M", "param_MiB", "rank", "setup_growth_MiB", "setup_growth_x",
           "peak_MiB", "steps", "fits"]
CUDA_COLUMNS = ["cuda_setup_growth_MiB", "cuda_setup_growth_x", "cuda_peak_MiB"]
MiB = 2**20


def package_root() -> str:
    """The directory ``lightning_p2r`` is imported from in this process."""
    import lightning_p2r

    return str(Path(lightning_p2r.__file__).resolve().parent)


def package_commit() -> str:
    """The git commit of the imported package's checkout (``+dirty`` with uncommitted changes), or ``unknown``."""
    root = Path(package_root()).parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def parse_size(text: str, dim: int) -> tuple[int, int]:
    """``"8"`` -> (8 layers, ``dim``); ``"8x2048"`` -> (8, 2048)."""
    layers, _, width = text.lower().partition("x")
    try:
        size = int(layers), int(width) if width else dim
    except ValueError:
        raise ValueError(f"--sizes entry {text!r} is not LAYERS or LAYERSxDIM (e.g. 16 or 16x1024)") from None
    if size[0] < 1 or size[1] < 64 or size[1] % 64:
        raise ValueError(f"--sizes entry {text!r}: layers must be >= 1 and dim a multiple of 64 (heads of 64)")
    return size


# ------------------------------------------------------------------------------------------------------ worker
def _worker(spec: dict[str, Any]) -> None:
    """One run (every rank of it): train ``spec['steps']`` steps, then write this rank's figures to ``spec['out']``."""
    import lightning as L
    import torch

    from lightning_p2r import M6Config, M6LanguageModel, OptimizerConfig, P2RStrategy
    from lightning_p2r.measure.memory import SetupMemoryProbe

    cuda = spec["device"] == "cuda"

    class CudaMemoryLimit(L.Callback):
        """Caps this rank's CUDA allocations at the limit (placed before the probe: its setup hook runs first)."""

        def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
            device = trainer.strategy.root_device
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, spec["limit"] / total), device)

    fields = {"vocab_size": spec["vocab"], "max_seq_len": spec["seq_len"], "num_layers": spec["layers"],
              "dim": spec["dim"], "num_heads": spec["dim"] // 64, "moe_layers": []}
    if "init_seed" in M6Config.__dataclass_fields__:  # absent before the name-seeded init, whose figures we compare
        fields["init_seed"] = 0
    else:
        torch.manual_seed(0)
    module = M6LanguageModel(M6Config(**fields), OptimizerConfig(warmup_steps=1))
    probe = SetupMemoryProbe()
    devices = spec["devices"]
    trainer = L.Trainer(accelerator="cuda" if cuda else "cpu", devices=devices,
                        strategy=P2RStrategy(**spec["strategy"]), max_steps=spec["steps"], logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0,
                        callbacks=[CudaMemoryLimit(), probe] if cuda else [probe])
    data = torch.randint(0, spec["vocab"], (spec["steps"] * devices * spec["batch_size"], spec["seq_len"] + 1))
    error = None
    try:
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=spec["batch_size"]))
    except (RuntimeError, torch.OutOfMemoryError) as caught:  # running out of memory is a result, not a crash
        error = f"{type(caught).__name__}: {str(caught)[:300]}"
    report = probe.result.as_dict() | {"rank": trainer.global_rank, "steps": trainer.global_step, "error": error,
                                       "package": package_root()}
    Path(spec["out"], f"rank{trainer.global_rank}.json").write_text(json.dumps(report), encoding="utf-8")


def _run(spec: dict[str, Any], timeout: int) -> list[dict[str, Any]]:
    """Start one run in a fresh process (which launches its other ranks) and collect every rank's report."""
    threads = max(1, (os.cpu_count() or 2) // spec["devices"])  # ranks share the cores rather than oversubscribe
    env = worker_env(threads)
    command = [sys.executable, "-m", "lightning_p2r.benchmarks.capacity", "--worker", json.dumps(spec)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
        failure = None if result.returncode == 0 else f"exit {result.returncode}: {result.stderr[-300:]}"
    except subprocess.TimeoutExpired:
        failure = f"timed out after {timeout} s"
    reports = []
    for rank in range(spec["devices"]):
        path = Path(spec["out"], f"rank{rank}.json")
        reports.append(json.loads(path.read_text(encoding="utf-8")) if path.exists() else
                       {"rank": rank, "error": failure or "no report"})
    return reports


def _mib(value: int | None) -> float:
    return float("nan") if value is None else value / MiB


def _ratio(value: int | None, param_bytes: int | None) -> float:
    return float("nan") if value is None or not param_bytes else value / param_bytes


def _row(report: dict[str, Any], *, label: str, layout: str, layers: int, dim: int, steps: int, limit: int,
         cuda: bool) -> dict[str, Any]:
    param_bytes = report.get("param_bytes")
    completed = report.get("error") is None and report.get("steps") == steps
    peak = report.get("cuda_run_peak") if cuda else report.get("run_peak_rss")
    row = {"label": label, "layout": layout, "layers": layers, "dim": dim,
           "params_M": (param_bytes or 0) / 4 / 1e6, "param_MiB": _mib(param_bytes), "rank": report["rank"],
           "setup_growth_MiB": _mib(report.get("setup_growth")),
           "setup_growth_x": _ratio(report.get("setup_growth"), param_bytes),
           "peak_MiB": _mib(report.get("run_peak_rss")), "steps": report.get("steps", 0),
           "fits": bool(completed and peak is not None and peak <= limit), "limit_MiB": limit / MiB,
           "rss_at_setup_MiB": _mib(report.get("rss_at_setup")), "method": report.get("method"),
           "error": report.get("error")}
    if cuda:
        row |= {"cuda_setup_growth_MiB": _mib(report.get("cuda_setup_growth")),
                "cuda_setup_growth_x": _ratio(report.get("cuda_setup_growth"), param_bytes),
                "cuda_peak_MiB": _mib(report.get("cuda_run_peak"))}
    return row


def summarize(rows: list[dict[str, Any]], layouts: list[str]) -> list[dict[str, Any]]:
    """Per layout, the largest model of the ladder whose every rank completed the run within the limit."""
    summary = []
    for layout in layouts:
        runs: dict[tuple[int, int], list[dict[str, Any]]] = {}
        for row in rows:
            if row["layout"] == layout:
                runs.setdefault((row["layers"], row["dim"]), []).append(row)
        # A run fits when every one of its ranks does; runs are ordered by size (a failed rank reports no params).
        fitting = sorted((max(r["params_M"] for r in ranks), layers, dim, ranks)
                         for (layers, dim), ranks in runs.items() if all(r["fits"] for r in ranks))
        best: dict[str, Any] = {"layout": layout, "largest_layers": None, "largest_dim": None,
                                "largest_params_M": None, "peak_MiB": None}
        if fitting:
            params_m, layers, dim, ranks = fitting[-1]
            best |= {"largest_layers": layers, "largest_dim": dim, "largest_params_M": params_m,
                     "peak_MiB": max(r["peak_MiB"] for r in ranks)}
        summary.append(best)
    return summary


def _summary(rows: list[dict[str, Any]], layouts: list[str], limit: int) -> list[dict[str, Any]]:
    """:func:`summarize`, kept with the limit argument the rows already carry (they hold ``fits``)."""
    del limit
    return summarize(rows, layouts)


def _plot(path: Path, rows: list[dict[str, Any]], layouts: list[str], limit: int, title: str) -> Path:
    """Left: setup growth over fp32 parameter bytes (worst rank); right: run peak per rank against the limit."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5), dpi=110)
    sizes = sorted({(r["params_M"], r["layers"], r["dim"]) for r in rows})
    width = 0.8 / max(len(sizes), 1)
    for i, (params_m, layers, dim) in enumerate(sizes):
        worst = [max((r["setup_growth_x"] for r in rows if r["layout"] == layout and r["layers"] == layers
                      and r["dim"] == dim), default=float("nan")) for layout in layouts]
        xs = [c + (i - (len(sizes) - 1) / 2) * width for c in range(len(layouts))]
        bars = left.bar(xs, worst, width, label=f"{layers}x{dim} ({params_m:.3g}M params)")
        left.bar_label(bars, labels=[f"{v:.2f}" for v in worst], fontsize=7, padding=2)
    left.set_xticks(range(len(layouts)), layouts)
    left.set_ylabel("setup RSS growth / fp32 parameter bytes (worst rank)")
    left.axhline(1.0, color="grey", lw=0.8, ls=":")
    left.legend(fontsize=8)
    left.grid(axis="y", alpha=0.3)
    for layout in layouts:
        points = sorted((r["params_M"], r["peak_MiB"]) for r in rows if r["layout"] == layout)
        right.plot([p for p, _ in points], [m for _, m in points], marker="o", ms=4, lw=0.8, label=layout)
    right.axhline(limit / MiB, color="red", lw=0.8, ls="--", label=f"limit {limit / MiB:.0f} MiB")
    right.set_xlabel("parameters (M)")
    right.set_ylabel("peak RSS per rank over the run (MiB)")
    right.set_ylim(bottom=0)
    right.legend(fontsize=8)
    right.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker(json.loads(sys.argv[2]))
        return {}
    from lightning_p2r.layout import parse_bytes

    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--sizes", "--layers", dest="sizes", nargs="+",
                        help="the ladder: layer counts at --dim, or LAYERSxDIM (default: 2 4 8 16; quick: 1 2)")
    parser.add_argument("--dim", type=int, default=1024, help="model width for sizes given as layer counts")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=2, help="per rank")
    parser.add_argument("--memory-limit", default="3GiB",
                        help="per-rank limit, bytes or a size string (default: %(default)s; two ranks of the "
                             "largest default rung, and the parent, stay well inside a 24 GiB machine)")
    parser.add_argument("--label", default=None, help="written in the CSV to put runs side by side (default: the "
                        "package's git commit)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    args = parser.parse_args(argv)
    if args.quick:
        args.dim, args.steps, args.seq_len = 128, 2, 16
    sizes = [parse_size(text, args.dim) for text in (args.sizes or (["1", "2"] if args.quick else
                                                                      ["2", "4", "8", "16"]))]
    limit = parse_bytes(args.memory_limit, name="--memory-limit")
    cuda = args.device.startswith("cuda")
    env = environment_info(args.device) | {"package": package_root(), "commit": package_commit()}
    label = args.label or env["commit"]
    print_environment(env)
    rows: list[dict[str, Any]] = []
    for layout in args.layouts:
        devices, strategy = LAYOUTS[layout]
        for layers, dim in sizes:
            with tempfile.TemporaryDirectory() as out:
                spec = {"layers": layers, "dim": dim, "vocab": 256, "seq_len": args.seq_len,
                        "batch_size": args.batch_size, "steps": args.steps, "devices": devices,
                        "strategy": strategy, "device": "cuda" if cuda else "cpu", "limit": limit, "out": out}
                for report in _run(spec, args.timeout):
                    if report.get("package") not in (None, env["package"]):
                        report = {"rank": report["rank"], "error": f"rank imported {report['package']}, "
                                  f"not {env['package']}: check PYTHONPATH and the working directory"}
                    row = _row(report, label=label, layout=layout, layers=layers, dim=dim, steps=args.steps,
                               limit=limit, cuda=cuda)
                    rows.append(row)
                    print(f"{layout} {layers}x{dim} rank {row['rank']}: setup +{row['setup_growth_MiB']:.0f} MiB "
                          f"({row['setup_growth_x']:.2f}x params), peak {row['peak_MiB']:.0f} MiB, "
                          f"steps {row['steps']}" + (f", error {row['error']}" if row["error"] else ""), flush=True)
    print_table(rows, COLUMNS + (CUDA_COLUMNS if cuda else []))
    summary = summarize(rows, args.layouts)
    print(f"\nLargest model in the ladder with every rank's measured peak <= {args.memory_limit} "
          f"({'max_memory_allocated' if cuda else 'host RSS'}):")
    print_table(summary, ["layout", "largest_layers", "largest_dim", "largest_params_M", "peak_MiB"])
    out = Path(args.out)
    write_csv(with_environment(rows, env), out / "capacity.csv")
    _plot(out / "capacity.png", rows, args.layouts, limit,
          f"Dense M6, {args.steps} steps, {'CUDA' if cuda else 'host RSS'} per rank ({label})")
    print(f"wrote {out / 'capacity.csv'}, {out / 'capacity.png'}")
    return {"rows": rows, "summary": summary}


if __name__ == "__main__":
    main()
