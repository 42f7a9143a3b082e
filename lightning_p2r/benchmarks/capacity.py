"""Capacity: the largest model that trains under a per-rank memory limit, for each layout, and what setup costs.

    python -m lightning_p2r.benchmarks.capacity [--memory-limit 3GiB] [--layers 4 8 16] [--steps 5] [--out DIR]

For a ladder of dense M6 models (width ``--dim``, ``--layers`` deep) and the layouts ``none`` (one process, every
block resident), ``zero3`` (2 ranks), ``offload`` (one process, every block in host memory) and ``zero3_offload``
(2 ranks, both), each run is a fresh process group that trains ``--steps`` steps under ``P2RStrategy`` and reports,
per rank: the peak growth of resident memory from the start of Lightning's ``setup`` (before the model is built)
to the first batch, also over the model's fp32 parameter bytes; the peak resident memory over the whole run; and
whether every step ran. A layout "fits" a limit when every rank's measured peak stays under it; the summary gives
the largest model in the ladder that fits, per layout.

On a CPU the memory is host RSS (sampled every 2 ms: Linux keeps only a lifetime high-water mark), and the limit is
compared with the measured peak rather than enforced (``RLIMIT_AS`` counts address space that torch reserves but
never touches, so it would stop runs that fit). With ``--device cuda`` the limit is enforced with
``torch.cuda.set_per_process_memory_fraction`` and the figures are ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from lightning_p2r.benchmarks.report import (
    base_parser,
    environment_info,
    print_environment,
    print_table,
    save_bar_chart,
    with_environment,
    write_csv,
)

LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "none": (1, {}),
    "zero3": (2, {"sharding": "zero3"}),
    "offload": (1, {"offload_fraction": 1.0}),
    "zero3_offload": (2, {"sharding": "zero3", "offload_fraction": 1.0}),
}
COLUMNS = ["label", "layout", "layers", "params_M", "param_MiB", "rank", "setup_growth_MiB", "setup_growth_x",
           "peak_MiB", "steps", "fits"]
MiB = 2**20


def rss_bytes() -> int:
    with open("/proc/self/status", encoding="utf-8") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class MemoryProbe:
    """Samples this process's memory in a thread: the peak since ``start`` and the peak of the current phase."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.peak = self.phase_peak = self.phase_start = 0
        self._running = False

    def read(self) -> int:
        import torch

        return torch.cuda.memory_allocated() if self.cuda else rss_bytes()

    def start(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.phase_start = self.peak = self.phase_peak = self.read()
        self._running = True
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while self._running:
            value = self.read()
            self.peak, self.phase_peak = max(self.peak, value), max(self.phase_peak, value)
            time.sleep(0.002)

    def end_phase(self) -> int:
        """Peak growth since ``start`` (the setup phase); sampling goes on for the whole run."""
        import torch

        if self.cuda:
            return torch.cuda.max_memory_allocated() - self.phase_start
        return max(self.phase_peak, self.read()) - self.phase_start

    def stop(self) -> int:
        import torch

        self._running = False
        return torch.cuda.max_memory_allocated() if self.cuda else max(self.peak, self.read())


def _worker(spec: dict[str, Any]) -> None:
    """One run (every rank of it): train, then write this rank's figures to ``spec['out']``."""
    import lightning as L
    import torch

    from lightning_p2r import M6Config, M6LanguageModel, OptimizerConfig, P2RStrategy

    cuda = spec["device"] == "cuda"
    probe = MemoryProbe(cuda)

    class Phases(L.Callback):
        setup_growth = 0

        def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
            if cuda:
                total = torch.cuda.get_device_properties(trainer.strategy.root_device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, spec["limit"] / total),
                                                           trainer.strategy.root_device)
            probe.start()  # before configure_model: the build and the placement are in the phase

        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                                 batch_idx: int) -> None:
            if batch_idx == 0:
                self.setup_growth = probe.end_phase()

    fields = {"vocab_size": spec["vocab"], "max_seq_len": spec["seq_len"], "num_layers": spec["layers"],
              "dim": spec["dim"], "num_heads": spec["dim"] // 64, "moe_layers": []}
    if "init_seed" in M6Config.__dataclass_fields__:  # (absent before the name-seeded init: older code is compared)
        fields["init_seed"] = 0
    else:
        torch.manual_seed(0)
    config = M6Config(**fields)
    module = M6LanguageModel(config, OptimizerConfig(warmup_steps=1))
    phases = Phases()
    devices = spec["devices"]
    trainer = L.Trainer(accelerator="cuda" if cuda else "cpu", devices=devices,
                        strategy=P2RStrategy(**spec["strategy"]), max_steps=spec["steps"], logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[phases])
    data = torch.randint(0, spec["vocab"], (spec["steps"] * devices * spec["batch_size"], spec["seq_len"] + 1))
    error = None
    try:
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=spec["batch_size"]))
    except (RuntimeError, torch.OutOfMemoryError) as caught:  # an out-of-memory run is a result, not a crash
        error = f"{type(caught).__name__}: {str(caught)[:200]}"
    peak = probe.stop()
    report = {"rank": trainer.global_rank, "setup_growth": phases.setup_growth, "peak": peak,
              "steps": trainer.global_step, "param_bytes": sum(p.numel() * 4 for p in module.parameters()),
              "params": sum(p.numel() for p in module.parameters()), "error": error}
    Path(spec["out"], f"rank{trainer.global_rank}.json").write_text(json.dumps(report), encoding="utf-8")


def _run(spec: dict[str, Any], timeout: int) -> list[dict[str, Any]]:
    env = os.environ | {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // spec[
        "devices"]))}
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(key, None)
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


def _parse_size(text: str) -> int:
    from lightning_p2r.strategy.plan import parse_bytes

    return parse_bytes(text, name="--memory-limit")


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker(json.loads(sys.argv[2]))
        return {}
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", help="the ladder of depths (default: 4 8 16; quick: 1 2)")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--memory-limit", default="3GiB", help="per-rank limit (bytes or a size string)")
    parser.add_argument("--label", default="this change", help="written in the CSV, to put runs side by side")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    args = parser.parse_args(argv)
    if args.quick:
        args.dim, args.steps, args.seq_len = 128, 2, 16
    if args.layers is None:
        args.layers = [1, 2] if args.quick else [4, 8, 16]
    limit = _parse_size(args.memory_limit)
    env = environment_info(args.device)
    print_environment(env)
    rows: list[dict[str, Any]] = []
    for layout in args.layouts:
        devices, strategy = LAYOUTS[layout]
        for layers in args.layers:
            with tempfile.TemporaryDirectory() as out:
                spec = {"layers": layers, "dim": args.dim, "vocab": 256, "seq_len": args.seq_len,
                        "batch_size": args.batch_size, "steps": args.steps, "devices": devices,
                        "strategy": strategy, "device": args.device, "limit": limit, "out": out}
                for report in _run(spec, args.timeout):
                    param_bytes = report.get("param_bytes", 0)
                    ok = report.get("error") is None and report.get("steps") == args.steps
                    row = {"label": args.label, "layout": layout, "layers": layers,
                           "params_M": report.get("params", 0) / 1e6, "param_MiB": param_bytes / MiB,
                           "rank": report["rank"], "setup_growth_MiB": report.get("setup_growth", 0) / MiB,
                           "setup_growth_x": report.get("setup_growth", 0) / param_bytes if param_bytes else None,
                           "peak_MiB": report.get("peak", 0) / MiB, "steps": report.get("steps", 0),
                           "fits": bool(ok and report.get("peak", 0) <= limit), "error": report.get("error")}
                    rows.append(row)
                    print(f"{layout} layers={layers} rank {row['rank']}: setup +{row['setup_growth_MiB']:.0f} MiB, "
                          f"peak {row['peak_MiB']:.0f} MiB, steps {row['steps']}"
                          + (f", error {row['error']}" if row["error"] else ""), flush=True)
    print_table(rows, COLUMNS)
    summary = _summary(rows, args.layouts, limit)
    print(f"\nLargest model in the ladder under {args.memory_limit} per rank:")
    print_table(summary, ["layout", "largest_layers", "largest_params_M", "peak_MiB"])
    out = Path(args.out)
    write_csv(with_environment(rows, env), out / "capacity.csv")
    largest = {r["layout"]: r["largest_params_M"] or 0.0 for r in summary}
    save_bar_chart(out / "capacity.png", list(largest), {f"params (M) under {args.memory_limit}": list(
        largest.values())}, ylabel="parameters (millions)",
        title=f"Largest dense M6 (width {args.dim}) that trains {args.steps} steps, per layout ({args.label})")
    print(f"wrote {out / 'capacity.csv'}, {out / 'capacity.png'}")
    return {"rows": rows, "summary": summary}


def _summary(rows: list[dict[str, Any]], layouts: list[str], limit: int) -> list[dict[str, Any]]:
    summary = []
    for layout in layouts:
        runs: dict[int, list[dict[str, Any]]] = {}
        for row in rows:
            if row["layout"] == layout:
                runs.setdefault(row["layers"], []).append(row)
        fitting = [(layers, ranks) for layers, ranks in sorted(runs.items()) if all(r["fits"] for r in ranks)]
        if fitting:
            layers, ranks = fitting[-1]
            summary.append({"layout": layout, "largest_layers": layers, "largest_params_M": ranks[0]["params_M"],
                            "peak_MiB": max(r["peak_MiB"] for r in ranks)})
        else:
            summary.append({"layout": layout, "largest_layers": None, "largest_params_M": None, "peak_MiB": None})
    return summary


if __name__ == "__main__":
    main()
