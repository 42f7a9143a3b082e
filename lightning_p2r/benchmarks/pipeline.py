"""Pipeline parallelism on CPU processes: the measured bubble of each schedule against the analytic one, ZeRO-3's
gathers per step for a depth-first and a breadth-first schedule, tokens/s, and a timeline of one step per rank.

    python -m lightning_p2r.benchmarks.pipeline [--steps 6] [--micro-batches 4] [--layouts ...] [--out DIR] [--quick]

Each layout trains the same M6 (8 layers, every other one MoE, dropless, fp32) for a few steps with
``P2RStrategy(pipeline_parallel=2, ...)`` on gloo processes, one thread each, on the same global batch. The
measured bubble of a rank is the share of the pipeline schedule's wall time (from a barrier to the end of
``schedule.step``, in the last step) in which its stages computed nothing: ``1 - busy / span``, busy being the time
inside the stages' ``forward_one_chunk`` and ``backward_one_chunk``. The analytic bubble is
``(p - 1) / (v * m + p - 1)`` for p pipeline ranks, v stages per rank and m micro-batches, which assumes every
stage costs the same and communication is free (the first and last stages also hold the embedding and head, and
the CPU processes share 2 cores, so the measured value is higher). The ZeRO-3 layouts run 2 pipeline ranks x 2
data ranks (4 processes on 2 cores: their times are not speeds) and count FSDP2's gathers and reduce-scatters of
the last step; the point-to-point sends between stages are counted too.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from lightning_p2r.benchmarks.report import (
    base_parser,
    chosen_layouts,
    environment_info,
    print_environment,
    print_table,
    pyplot,
    save_figure,
    with_environment,
    write_csv,
)
from lightning_p2r.layout import bubble_fraction
from lightning_p2r.measure.run import run_rank_worker

WARMUP = 2
LAYOUTS: dict[str, dict[str, Any]] = {
    "one process": {"devices": 1, "strategy": {"accumulation": "layered"}},
    "gpipe": {"devices": 2, "strategy": {"pipeline_parallel": 2, "pipeline_schedule": "gpipe"}},
    "1f1b": {"devices": 2, "strategy": {"pipeline_parallel": 2, "pipeline_schedule": "1f1b"}},
    "interleaved_1f1b v2": {"devices": 2, "strategy": {"pipeline_parallel": 2, "stages_per_rank": 2,
                                                       "pipeline_schedule": "interleaved_1f1b"}},
    "looped_bfs v2": {"devices": 2, "strategy": {"pipeline_parallel": 2, "stages_per_rank": 2,
                                                 "pipeline_schedule": "looped_bfs"}},
    "1f1b zero3 dp2": {"devices": 4, "strategy": {"pipeline_parallel": 2, "pipeline_schedule": "1f1b",
                                                  "sharding": "zero3"}},
    "looped_bfs v2 zero3 dp2": {"devices": 4, "strategy": {"pipeline_parallel": 2, "stages_per_rank": 2,
                                                           "pipeline_schedule": "looped_bfs", "sharding": "zero3"}},
}
TIMELINE_LAYOUTS = ("gpipe", "1f1b", "interleaved_1f1b v2", "looped_bfs v2")


def model_config(quick: bool) -> dict[str, Any]:
    size = {"dim": 64, "max_seq_len": 32} if quick else {"dim": 192, "max_seq_len": 128}
    return size | {"num_layers": 8, "vocab_size": 256, "num_heads": 4, "num_experts": 4, "moe_top_k": 1,
                   "moe_layers": [1, 3, 5, 7], "capacity_factor": None, "dropout": 0.0, "init_seed": 0}


def _worker(spec: dict[str, Any]) -> None:
    import lightning as L
    import torch.distributed as dist

    from lightning_p2r import P2RStrategy
    from lightning_p2r.measure.run import fit_on_random_tokens

    class RecordTimeline(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            pipeline = trainer.strategy.engine.pipeline_runner()
            if pipeline is not None:
                pipeline.timeline = []

    strategy = P2RStrategy(count_collectives=True, micro_batches=spec["micro_batches"], **spec["strategy"])
    trainer, _, step_s = fit_on_random_tokens(spec, strategy, warmup=WARMUP, callbacks=(RecordTimeline(),))
    last = strategy.collectives_history[-1]
    report: dict[str, Any] = {"rank": trainer.global_rank, "step_s": step_s,
                              "bytes": dict(last.bytes), "calls": dict(last.calls), "path": strategy.path}
    pipeline = strategy.engine.pipeline_runner()
    if pipeline is not None and pipeline.step_spans:
        start, end = pipeline.step_spans[-1]
        events = [e for e in pipeline.timeline if start <= e.start <= end]
        busy = sum(e.end - e.start for e in events)
        report |= {"span_s": end - start, "busy_s": busy,
                   "events": [[e.stage, e.kind, e.micro_batch, e.start - start, e.end - start] for e in events]}
    Path(spec["out"]).with_suffix(f".rank{trainer.global_rank}.json").write_text(json.dumps(report))
    if dist.is_initialized():
        dist.barrier()


def save_timeline(path: Path, timelines: dict[str, list[dict[str, Any]]], micro_batches: int) -> Path:
    """One panel per schedule: a row per rank, a bar per stage computation (forward light, backward dark), labelled
    with its micro-batch; the gaps are the bubble."""
    plt = pyplot()
    fig, axes = plt.subplots(len(timelines), 1, figsize=(11, 1.6 * len(timelines) + 0.6), dpi=110, squeeze=False)
    colors = {"forward": "#9ecae1", "backward": "#3182bd"}
    for ax, (name, reports) in zip(axes[:, 0], timelines.items()):
        for row, report in enumerate(reports):
            for stage, kind, micro_batch, start, end in report.get("events", []):
                ax.barh(row, (end - start) * 1e3, left=start * 1e3, color=colors[kind], edgecolor="white")
                ax.text((start + end) / 2 * 1e3, row, f"s{stage}.{micro_batch}", ha="center", va="center",
                        fontsize=6)
        ax.set_yticks(range(len(reports)), [f"rank {r}" for r in range(len(reports))])
        ax.invert_yaxis()
        ax.set_title(f"{name}: one step, {micro_batches} micro-batches (s<stage>.<micro-batch>; light forward, dark "
                     "backward)", fontsize=8)
        ax.set_xlabel("ms from the step's start")
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker(json.loads(sys.argv[2]))
        return {}
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--layouts", type=str, default=",".join(LAYOUTS), help="comma-separated, of: " +
                        ", ".join(LAYOUTS))
    args = parser.parse_args(argv)
    names = chosen_layouts(parser, args.layouts, LAYOUTS)
    if args.quick:
        args.steps, args.global_batch = WARMUP + 2, 8
    model = model_config(args.quick)
    env = environment_info("cpu")
    print_environment(env)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, timelines = [], {}
    for name in names:
        layout = LAYOUTS[name]
        spec = {"name": name, "model": model, "steps": args.steps, "global_batch": args.global_batch,
                "micro_batches": args.micro_batches, "out": str(out / ".pipeline_run"), **layout}
        reports = run_rank_worker("lightning_p2r.benchmarks.pipeline", spec, timeout=1800)
        strategy = layout["strategy"]
        p, v = strategy.get("pipeline_parallel", 1), strategy.get("stages_per_rank", 1)
        step_s = statistics.median(r["step_s"] for r in reports)
        measured = [1 - r["busy_s"] / r["span_s"] for r in reports if "span_s" in r]
        ranks = len(reports)
        row: dict[str, Any] = {
            "layout": name, "processes": layout["devices"], "schedule": strategy.get("pipeline_schedule", "-"),
            "stages_per_rank": v, "micro_batches": args.micro_batches,
            "bubble_measured": round(statistics.mean(measured), 3) if measured else None,
            "bubble_measured_per_rank": "/".join(f"{b:.3f}" for b in measured) if measured else None,
            "bubble_analytic": round(bubble_fraction(p, v, args.micro_batches), 3) if p > 1 else None,
            "all_gather_calls": round(sum(r["calls"].get("all_gather", 0) for r in reports) / ranks, 1),
            "all_gather_bytes": round(sum(r["bytes"].get("all_gather", 0) for r in reports) / ranks),
            "reduce_scatter_calls": round(sum(r["calls"].get("reduce_scatter", 0) for r in reports) / ranks, 1),
            "reduce_scatter_bytes": round(sum(r["bytes"].get("reduce_scatter", 0) for r in reports) / ranks),
            "send_bytes": round(sum(r["bytes"].get("send", 0) for r in reports) / ranks),
            "step_s": round(step_s, 4),
            "tokens_per_s": round(args.global_batch * model["max_seq_len"] / step_s, 1)}
        rows.append(row)
        if name in TIMELINE_LAYOUTS:
            timelines[name] = reports
        print(f"{name}: done", flush=True)
    columns = ["layout", "processes", "micro_batches", "bubble_measured", "bubble_measured_per_rank",
               "bubble_analytic", "all_gather_calls", "all_gather_bytes", "reduce_scatter_calls",
               "reduce_scatter_bytes", "send_bytes", "step_s", "tokens_per_s"]
    print_table(rows, columns)
    write_csv(with_environment(rows, env), out / "pipeline.csv")
    written = [out / "pipeline.csv"]
    if timelines:
        written.append(save_timeline(out / "pipeline.png", timelines, args.micro_batches))
    print("wrote " + ", ".join(str(p) for p in written))
    return {"rows": rows}


if __name__ == "__main__":
    main()
