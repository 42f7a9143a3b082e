"""The planner's predicted step time against measured CPU runs of the same layouts.

    python -m lightning_p2r.benchmarks.planner [--clusters DIR] [--layouts ...] [--steps 12] [--out DIR] [--quick]
    python -m lightning_p2r.benchmarks.planner --cross-validate [--clusters DIR] [--measured CSV] [--seed 0]

The machine is described by one cluster file per process count (``cluster-1.yaml``, ``cluster-2.yaml``: on this
CPU-only machine processes share memory bandwidth and caches, so two busy processes are each slower than one
alone); without ``--clusters DIR`` they are measured first (``lightning-p2r calibrate --processes n``, one thread
per process, the way every benchmark worker runs) and written next to the results. Each layout trains the parallel
benchmark's MoE M6 (fp32, dropless, every other layer MoE) for a few steps on gloo processes; the measured step is
the median optimizer-step interval after warm-up (rank 0's). The prediction is
``lightning_p2r.planning.estimate_step`` for the same model, layout, batch and cluster, with its parts. The table
gives both and the error; the issue's bar is 25%. ``--cross-validate`` runs the held-out protocol of
:mod:`lightning_p2r.benchmarks.planner_cv` instead (a random sample of layouts and three models; the fitted
constants are fitted on one half and judged on the other).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from lightning_p2r.benchmarks.report import (
    base_parser,
    chosen_layouts,
    environment_info,
    print_environment,
    print_table,
    save_bar_chart,
    with_environment,
    write_csv,
)
from lightning_p2r.measure.run import run_rank_worker

WARMUP = 3
LAYOUTS: dict[str, dict[str, Any]] = {
    "one process": {"devices": 1, "strategy": {}},
    "one process layered m4 offload 0.5": {"devices": 1, "strategy": {
        "accumulation": "layered", "micro_batches": 4, "offload_fraction": 0.5}},
    "dp2": {"devices": 2, "strategy": {}},
    "dp2 zero1": {"devices": 2, "strategy": {"sharding": "zero1"}},
    "dp2 zero3": {"devices": 2, "strategy": {"sharding": "zero3"}},
    "dp2 zero3 layered m4": {"devices": 2, "strategy": {"sharding": "zero3", "accumulation": "layered",
                                                        "micro_batches": 4}},
    "tp2": {"devices": 2, "strategy": {"tensor_parallel": 2}},
    "ep2": {"devices": 2, "strategy": {"expert_parallel": 2}},
    "pp2 1f1b m4": {"devices": 2, "strategy": {"pipeline_parallel": 2, "micro_batches": 4}},
    "pp2 looped_bfs v2 m4": {"devices": 2, "strategy": {"pipeline_parallel": 2, "micro_batches": 4,
                                                        "pipeline_schedule": "looped_bfs", "stages_per_rank": 2}},
}


def model_config(quick: bool) -> dict[str, Any]:
    from lightning_p2r.benchmarks.parallel import model_config as parallel_model

    return parallel_model(quick)


def _worker(spec: dict[str, Any]) -> None:
    import torch.distributed as dist

    from lightning_p2r import P2RStrategy
    from lightning_p2r.measure.run import OptimizerStepTimer, fit_on_random_tokens

    timer = OptimizerStepTimer()
    trainer, _, step_s = fit_on_random_tokens(spec, P2RStrategy(**spec["strategy"]), warmup=WARMUP,
                                              callbacks=(timer,))
    intervals = [b - a for a, b in zip(timer.ends[WARMUP - 1:], timer.ends[WARMUP:])]
    report = {"rank": trainer.global_rank, "step_s": step_s, "min_step_s": min(intervals)}
    Path(spec["out"]).with_suffix(f".rank{trainer.global_rank}.json").write_text(json.dumps(report))
    if dist.is_initialized():
        dist.barrier()


def predicted_step(model: dict[str, Any], layout: dict[str, Any], cluster: Any, global_batch: int) -> Any:
    from lightning_p2r import M6Config
    from lightning_p2r.planning import Workload, estimate_step
    from lightning_p2r.planning.cli import layout_from_options

    config = M6Config(**model)
    workload = Workload(global_batch=global_batch, seq_len=config.max_seq_len)
    return estimate_step(config, layout_from_options(layout["strategy"]), cluster.with_devices(layout["devices"]),
                         workload)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker(json.loads(sys.argv[2]))
        return {}
    from lightning_p2r.measure.calibrate import calibrate
    from lightning_p2r.planning import load_cluster, write_cluster

    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--clusters", help="a folder with cluster-<processes>.yaml files of this machine (or, with "
                        "--cross-validate, planner_cv_cluster-<processes>.yaml; default: calibrate now)")
    parser.add_argument("--steps", type=int, help="optimizer steps per layout (default 12; 8 with --cross-validate)")
    parser.add_argument("--cross-validate", action="store_true",
                        help="the cross-validation protocol (lightning_p2r.benchmarks.planner_cv) instead of the "
                             "fixed layouts")
    parser.add_argument("--measured", help="with --cross-validate: re-evaluate this planner_cv.csv, run nothing")
    parser.add_argument("--seed", type=int, default=0, help="with --cross-validate: the layout sample's seed")
    parser.add_argument("--passes", type=int, default=1, help="with --cross-validate: measure every layout this many "
                        "times (each pass recalibrates) and keep the fastest median; the passes' spread is reported")
    parser.add_argument("--repeat-of", help="with --cross-validate: an earlier planner_cv.csv of the same seed, to "
                        "report how far the same layouts measured apart (the machine's noise)")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--layouts", type=str, default=",".join(LAYOUTS), help="comma-separated, of: " +
                        ", ".join(LAYOUTS))
    args = parser.parse_args(argv)
    names = chosen_layouts(parser, args.layouts, LAYOUTS)
    if args.measured and not args.cross_validate:
        parser.error("--measured needs --cross-validate")
    if args.quick:
        args.steps = WARMUP + 2
    args.steps = args.steps or (8 if args.cross_validate else 12)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.cross_validate:
        from lightning_p2r.benchmarks import planner_cv

        process_counts = planner_cv.PROCESSES
        prefix = "planner_cv_cluster"
    else:
        process_counts = tuple(sorted({LAYOUTS[name]["devices"] for name in names}))
        prefix = "cluster"
    clusters: dict[int, Any] = {}

    def cluster_for(processes: int, refresh: bool = False) -> Any:
        # Calibrated on first use (the protocol asks just before its runs); ``refresh`` calibrates again and keeps the
        # faster of each constant (a later pass of the protocol: contention only ever slows a measurement down).
        if refresh and processes in clusters and not args.clusters:
            from lightning_p2r.benchmarks.planner_cv import best_of

            print(f"calibrating {processes} process(es) again, load {os.getloadavg()[0]:.2f}", flush=True)
            clusters[processes] = best_of(clusters[processes], calibrate(processes=processes, threads=1,
                                                                         quick=args.quick))
            write_cluster(clusters[processes], out / f"{prefix}-{processes}.yaml",
                          f"The faster of each constant of {processes}-process calibrations (one thread per process)")
        if processes not in clusters:
            if args.clusters:
                try:
                    folder = Path(args.clusters)  # the protocol's own files first, then calibrate's names
                    path = folder / f"{prefix}-{processes}.yaml"
                    clusters[processes] = load_cluster(path if path.is_file() else folder / f"cluster-{processes}.yaml")
                except ValueError as error:
                    parser.error(str(error))
            else:
                print(f"calibrating {processes} process(es), load {os.getloadavg()[0]:.2f}", flush=True)
                clusters[processes] = calibrate(processes=processes, threads=1, quick=args.quick)
            write_cluster(clusters[processes], out / f"{prefix}-{processes}.yaml",
                          f"Calibrated by lightning-p2r calibrate --processes {processes} (one thread per process)")
        return clusters[processes]

    if args.cross_validate:
        return planner_cv.run(args, cluster_for)
    for processes in process_counts:
        cluster_for(processes)
    model = model_config(args.quick)
    env = environment_info("cpu")
    print_environment(env)
    rows = []
    for name in names:
        layout = LAYOUTS[name]
        spec = {"name": name, "model": model, "steps": args.steps, "global_batch": args.global_batch,
                "out": str(out / ".planner_run"), **layout}
        measured = run_rank_worker("lightning_p2r.benchmarks.planner", spec, timeout=1200)[0]["step_s"]
        predicted = predicted_step(model, layout, clusters[layout["devices"]], args.global_batch)
        row = {"layout": name, "processes": layout["devices"], "measured_s": round(measured, 4),
               "predicted_s": round(predicted.total, 4),
               "error_pct": round(100 * (predicted.total - measured) / measured, 1)}
        row |= {f"{part}_s": round(value, 4) for part, value in predicted.as_dict().items() if part != "total"}
        rows.append(row)
        print(f"{name}: measured {measured:.4f} s, predicted {predicted.total:.4f} s", flush=True)
    columns = list(rows[0])
    print_table(rows, columns)
    worst = max(abs(r["error_pct"]) for r in rows)
    within = sum(abs(r["error_pct"]) <= 25 for r in rows)
    print(f"{within} of {len(rows)} layouts within 25% of the measured step; largest error {worst:.1f}%")
    write_csv(with_environment(rows, env), out / "planner.csv")
    save_bar_chart(out / "planner.png", [r["layout"] for r in rows],
                   {"measured": [r["measured_s"] for r in rows], "predicted": [r["predicted_s"] for r in rows]},
                   ylabel="seconds per optimizer step", title="Planner: predicted vs measured step (CPU)")
    return {"rows": rows}


if __name__ == "__main__":
    main()
