"""Layered vs standard gradient accumulation in P2RStrategy: collectives, host->device bytes and tokens/s per step.

    python -m lightning_p2r.benchmarks.layered [--out DIR] [--steps N] [--quick]

For m = 1, 2, 4, 8 micro-batches and a global batch of 16 sequences (8 per rank), a dense M6 model trains on 2
CPU processes (gloo) under ``P2RStrategy(sharding="zero3")``: "standard" is Lightning's
``accumulate_grad_batches=m`` with per-rank batches of 8/m, "layered" is ``accumulation="layered",
micro_batches=m`` with per-rank batches of 8. A first pass with ``count_collectives=True`` records rank 0's
all-gather and reduce-scatter calls and bytes of the last optimizer step; a second pass without the counter (it
costs a Python call per collective) gives tokens/s from the median optimizer-step time after warm-up. Last, one
process (its own worker, also OMP_NUM_THREADS=1) with every block offloaded (``offload_fraction=1.0``) gives the
host->device parameter bytes per step, its own tokens/s and median step time (``offload_tokens_per_s``,
``offload_step_ms``, global batch 8), on the GPU when one is available (``--offload-device``): there the step time
shows what moving each block once per step instead of once per micro-batch buys.

The parent process launches the 2-process worker (this same module with ``--worker``) through ``subprocess``;
Lightning's launcher starts rank 1 by re-running the worker's command line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_p2r import M6Config, M6LanguageModel, OptimizerConfig, P2RStrategy, TextDataModule
from lightning_p2r.benchmarks.report import (
    apply_threads,
    base_parser,
    environment_info,
    print_environment,
    print_table,
    pyplot,
    save_figure,
    with_environment,
    write_csv,
)
from lightning_p2r.measure.run import OptimizerStepTimer, worker_env

MICRO_BATCHES = (1, 2, 4, 8)
GLOBAL_BATCH = 16
COLUMNS = ["mode", "m", "all_gather_calls", "all_gather_bytes", "reduce_scatter_calls", "reduce_scatter_bytes",
           "collective_calls", "collective_bytes", "h2d_param_bytes", "step_ms", "tokens_per_s", "offload_device",
           "offload_step_ms", "offload_tokens_per_s"]
RATIOS = ["collective_calls", "collective_bytes", "h2d_param_bytes", "tokens_per_s"]
WORKER_TIMEOUT_S = 600






def _corpus(work: Path) -> str:
    path = work / "corpus.txt"
    if not path.exists():
        rng = random.Random(0)
        words = ["layered", "gather", "reduce", "scatter", "block", "token", "step", "rank", "micro", "batch",
                 "the", "of", "and", "a", "to", "in", "is", "that", "with", "each"]
        path.write_text(" ".join(rng.choice(words) for _ in range(40_000)), encoding="utf-8")
    return str(path)


def run_config(config: dict[str, Any], work: Path) -> dict[str, Any] | None:
    """Train one configuration; rank 0 returns (and writes to ``work/results``) what it measured."""
    L.seed_everything(0)
    model = config["model"]
    seq_len = model["max_seq_len"]
    module = M6LanguageModel(M6Config(**model), OptimizerConfig(lr=1e-3, warmup_steps=1, fused=None))
    devices, m = config["devices"], config["m"]
    per_rank = config["global_batch"] // devices
    layered = config["mode"] == "layered"
    strategy_kwargs: dict[str, Any] = {"log_telemetry": False}
    if devices > 1:
        strategy_kwargs |= {"sharding": "zero3", "count_collectives": config["count"]}
    if config.get("offload"):
        strategy_kwargs["offload_fraction"] = 1.0
    if layered:
        strategy_kwargs |= {"accumulation": "layered", "micro_batches": m}
    timer = OptimizerStepTimer()
    trainer = L.Trainer(accelerator=config.get("accelerator", "cpu"), devices=devices,
                        strategy=P2RStrategy(**strategy_kwargs),
                        max_steps=config["steps"], accumulate_grad_batches=1 if layered else m, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[timer],
                        default_root_dir=work / "runs" / config["name"])
    data = TextDataModule(corpus=_corpus(work), tokenizer="bytes", seq_len=seq_len,
                          batch_size=per_rank if layered else per_rank // m, cache_dir=str(work / "cache"))
    trainer.fit(module, datamodule=data)
    strategy = trainer.strategy
    intervals = [b - a for a, b in zip(timer.ends, timer.ends[1:])]
    intervals = intervals[config["warmup"]:] or intervals
    result: dict[str, Any] = {"name": config["name"], "steps": trainer.global_step,
                              "step_s": statistics.median(intervals) if intervals else float("nan")}
    result["tokens_per_s"] = config["global_batch"] * seq_len / result["step_s"]
    if strategy.collectives_history:
        stats = strategy.collectives_history[-1]
        result |= {"calls": dict(stats.calls), "bytes": dict(stats.bytes), "total_calls": stats.total_calls,
                   "total_bytes": stats.total_bytes}
    if strategy.telemetry is not None:
        result["h2d_bytes"] = strategy.telemetry.h2d_bytes
    if trainer.world_size > 1:
        import torch.distributed as dist

        dist.barrier()
    if trainer.global_rank != 0:
        return None
    (work / "results").mkdir(parents=True, exist_ok=True)
    (work / "results" / f"{config['name']}.json").write_text(json.dumps(result))
    return result


def _worker(args: Any) -> None:
    apply_threads(args.threads)
    for config in json.loads(args.configs):
        run_config(config, Path(args.out))


def _launch(configs: list[dict[str, Any]], work: Path, timeout: float) -> None:
    """Run configurations in sequence in one worker launch: ``python -m lightning_p2r.benchmarks.layered``."""
    env = worker_env(threads=1)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "lightning_p2r.benchmarks.layered", "--worker", "--out", str(work),
               "--configs", json.dumps(configs)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"worker failed ({result.returncode}):\n{result.stderr[-6000:]}")


def _configs(args: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    model = {"vocab_size": 256, "max_seq_len": args.seq_len, "num_layers": args.layers, "dim": args.dim,
             "num_heads": max(1, args.dim // 64), "moe_layers": []}
    two, one = [], []
    for mode in ("standard", "layered"):
        for m in args.micro_batches:
            base = {"mode": mode, "m": m, "model": model, "warmup": args.warmup}
            two.append(base | {"name": f"{mode}_m{m}_count", "devices": 2, "count": True, "steps": args.count_steps,
                               "global_batch": GLOBAL_BATCH})
            two.append(base | {"name": f"{mode}_m{m}_time", "devices": 2, "count": False, "steps": args.steps,
                               "global_batch": GLOBAL_BATCH})
            one.append(base | {"name": f"{mode}_m{m}_offload", "devices": 1, "count": False, "offload": True,
                               "steps": args.steps, "global_batch": GLOBAL_BATCH // 2,
                               "accelerator": "gpu" if args.offload_device == "cuda" else "cpu"})
    return two, one


def _rows(args: Any, results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for mode in ("standard", "layered"):
        for m in args.micro_batches:
            count, timing = results[f"{mode}_m{m}_count"], results[f"{mode}_m{m}_time"]
            offload = results[f"{mode}_m{m}_offload"]
            calls, sizes = count.get("calls", {}), count.get("bytes", {})
            rows.append({"mode": mode, "m": m,
                         "all_gather_calls": calls.get("all_gather", 0), "all_gather_bytes": sizes.get("all_gather", 0),
                         "reduce_scatter_calls": calls.get("reduce_scatter", 0),
                         "reduce_scatter_bytes": sizes.get("reduce_scatter", 0),
                         "collective_calls": count.get("total_calls", 0),
                         "collective_bytes": count.get("total_bytes", 0),
                         "h2d_param_bytes": offload.get("h2d_bytes", 0), "step_ms": 1e3 * timing["step_s"],
                         "tokens_per_s": timing["tokens_per_s"], "offload_device": args.offload_device,
                         "offload_step_ms": 1e3 * offload["step_s"], "offload_tokens_per_s": offload["tokens_per_s"]})
    return rows


def _ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_key = {(r["mode"], r["m"]): r for r in rows}
    out = []
    for (mode, m), layered in by_key.items():
        if mode != "layered":
            continue
        standard = by_key[("standard", m)]
        out.append({"m": m} | {f"{c} layered/standard": layered[c] / standard[c] if standard[c] else float("nan")
                               for c in RATIOS})
    return out


def _plot(path: Path, rows: list[dict[str, Any]], title: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.5), dpi=110)
    panels = (("collective_calls", "collectives per optimizer step (rank 0)", "calls"),
              ("h2d_param_bytes", "host->device parameter bytes per step (offload 1.0)", "MB"),
              ("tokens_per_s", "throughput (2 CPU processes, no counter)", "tokens/s"),
              ("offload_step_ms", f"step time, 1 process, offload 1.0 ({rows[0]['offload_device']})", "ms"))
    for ax, (column, label, unit) in zip(axes, panels):
        for mode, marker in (("standard", "o"), ("layered", "s")):
            mode_rows = [r for r in rows if r["mode"] == mode]
            scale = 2**20 if unit == "MB" else 1
            ax.plot([r["m"] for r in mode_rows], [r[column] / scale for r in mode_rows], marker=marker, label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["m"] for r in rows if r["mode"] == "standard"],
                      [str(r["m"]) for r in rows if r["mode"] == "standard"])
        ax.set_xlabel("micro-batches m")
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        ax.set_title(label, fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, Any]]] | None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps of each timed run")
    parser.add_argument("--count-steps", type=int, default=3, help="optimizer steps of each counted run")
    parser.add_argument("--warmup", type=int, default=2, help="step intervals left out of the median")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=list(MICRO_BATCHES))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--offload-device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="where the one-process offload runs train (auto: CUDA when available)")
    parser.add_argument("--timeout", type=float, default=WORKER_TIMEOUT_S, help="seconds for the 2-process worker")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--configs", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return None
    if args.quick:
        args.steps, args.count_steps, args.warmup, args.layers, args.dim, args.seq_len = 3, 2, 1, 2, 32, 16
        args.micro_batches = [m for m in args.micro_batches if m <= 2]
    if any(GLOBAL_BATCH // 2 % m for m in args.micro_batches):
        parser.error(f"every m must divide the per-rank batch {GLOBAL_BATCH // 2}")
    if args.offload_device == "auto":
        args.offload_device = "cuda" if torch.cuda.is_available() else "cpu"
    apply_threads(args.threads)
    env = environment_info("cpu")
    print_environment(env)

    two, one = _configs(args)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        start = time.perf_counter()
        _launch(two, work, args.timeout)
        print(f"2-process runs: {time.perf_counter() - start:.1f} s")
        # Its own worker too, with OMP_NUM_THREADS=1: in a process with 2 OpenMP threads the CPU block streamer's
        # copies and the compute stall each other on a 2-core machine (steps 10-50x slower and erratic).
        start = time.perf_counter()
        _launch(one, work, args.timeout)
        print(f"1-process offload runs: {time.perf_counter() - start:.1f} s")
        results = {p.stem: json.loads(p.read_text()) for p in (work / "results").glob("*.json")}
    rows = _rows(args, results)
    ratios = _ratios(rows)
    print_table(rows, COLUMNS)
    print_table(ratios, list(ratios[0]))

    out = Path(args.out)
    write_csv(with_environment(rows, env), out / "layered.csv")
    _plot(out / "layered.png", rows, f"P2RStrategy zero3, layered vs standard accumulation, global batch "
          f"{GLOBAL_BATCH} x {args.seq_len} tokens ({args.layers} blocks, dim {args.dim}) on {env['device_name']}")
    print(f"wrote {out / 'layered.csv'}, {out / 'layered.png'}")
    return {"rows": rows, "ratios": ratios}


if __name__ == "__main__":
    main()
