"""CPU training with glibc's malloc as it comes against freed host memory kept for reuse (``host_allocator``).

    python -m lightning_p2r.benchmarks.host_allocator [--steps 14] [--repeats 2] [--processes 1,2] [--out DIR]

Each case trains one model under ``P2RStrategy(host_allocator="system")`` and ``"retain"``, each run a fresh set of
processes (one thread each; the setting is per process and cannot be undone), the two arms alternating, ``--repeats``
times. The table gives each run's median optimizer-step time after 4 warm-up steps and rank 0's minor page faults per
step (the kernel mapping in a page on first touch: what glibc's defaults make a step pay again for the memory the
last one gave back), and per case the ratio of the arms' medians. Models: the quickstart recipe's MoE (4 layers of
width 128, 4 experts top-1 with capacity 1.25, alternating banded attention, a vocabulary of 2,048) and a dense one
(6 layers of width 256), 16 sequences of 64 tokens per step, split over the processes, with 1 and 4 micro-batches.
"""

from __future__ import annotations

import json
import statistics
import sys
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
from lightning_p2r.measure.memory import minor_faults
from lightning_p2r.measure.run import OptimizerStepTimer, fit_on_random_tokens, run_rank_worker

WARMUP = 4
ARMS = ("system", "retain")
MODELS: dict[str, dict[str, Any]] = {
    "moe": {"vocab_size": 2048, "max_seq_len": 64, "num_layers": 4, "dim": 128, "num_heads": 4, "num_experts": 4,
            "moe_top_k": 1, "capacity_factor": 1.25, "attention": "alternating", "sparse_window": 32, "init_seed": 0},
    "dense": {"vocab_size": 2048, "max_seq_len": 64, "num_layers": 6, "dim": 256, "num_heads": 4, "moe_layers": [],
              "init_seed": 0},
}
QUICK_MODEL = {"vocab_size": 64, "max_seq_len": 16, "num_layers": 2, "dim": 16, "num_heads": 2, "moe_layers": []}
GLOBAL_BATCH = 16


def _worker(spec: dict[str, Any]) -> None:
    from lightning_p2r import P2RStrategy

    faults = OptimizerStepTimer(read=minor_faults)  # the page faults at each step's end
    trainer, _, step_s = fit_on_random_tokens(spec, P2RStrategy(host_allocator=spec["arm"]), warmup=WARMUP,
                                              callbacks=(faults,))
    per_step = [b - a for a, b in zip(faults.ends[WARMUP - 1:], faults.ends[WARMUP:])]  # the steps step_s times
    report = {"step_ms": 1000 * step_s, "faults_per_step": statistics.median(per_step)}
    Path(spec["out"]).with_suffix(f".rank{trainer.global_rank}.json").write_text(json.dumps(report), encoding="utf-8")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker(json.loads(sys.argv[2]))
        return {}
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each arm, alternating")
    parser.add_argument("--processes", default="1,2", help="comma-separated process counts (default: %(default)s)")
    parser.add_argument("--micro-batches", default="1,4", help="comma-separated counts (default: %(default)s)")
    args = parser.parse_args(argv)
    processes = [int(p) for p in args.processes.split(",")]
    micro = [int(m) for m in args.micro_batches.split(",")]
    models = MODELS
    if args.quick:
        models, args.steps, args.repeats, micro = {"tiny": QUICK_MODEL}, WARMUP + 2, 1, [1]
    env = environment_info("cpu")
    print_environment(env)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, model in models.items():
        for count in processes:
            for m in micro:
                for repeat in range(args.repeats):
                    for arm in ARMS:
                        spec = {"name": f"{name} x{count} m{m} {arm}", "model": model, "devices": count,
                                "accumulate_grad_batches": m, "steps": args.steps, "global_batch": GLOBAL_BATCH,
                                "arm": arm, "out": str(out / ".host_allocator_run")}
                        measured = run_rank_worker("lightning_p2r.benchmarks.host_allocator", spec, timeout=900)[0]
                        print(f"{name} x{count} m{m} {arm} (run {repeat}): {measured['step_ms']:.1f} ms, "
                              f"{measured['faults_per_step']:.0f} page faults per step", flush=True)
                        rows.append({"model": name, "processes": count, "micro_batches": m, "host_allocator": arm,
                                     "run": repeat, "step_ms": round(measured["step_ms"], 2),
                                     "faults_per_step": measured["faults_per_step"]})
    print_table(rows, ["model", "processes", "micro_batches", "host_allocator", "run", "step_ms", "faults_per_step"])
    cases = sorted({(r["model"], r["processes"], r["micro_batches"]) for r in rows},
                   key=lambda case: (list(models).index(case[0]), case[1], case[2]))
    summary = []
    for case in cases:
        median = {arm: statistics.median(r["step_ms"] for r in rows
                                         if (r["model"], r["processes"], r["micro_batches"]) == case
                                         and r["host_allocator"] == arm) for arm in ARMS}
        summary.append({"case": f"{case[0]} x{case[1]} m{case[2]}", "system_ms": round(median["system"], 2),
                        "retain_ms": round(median["retain"], 2),
                        "retain_over_system": round(median["retain"] / median["system"], 3)})
    print_table(summary, ["case", "system_ms", "retain_ms", "retain_over_system"])
    write_csv(with_environment(rows, env), out / "host_allocator.csv")
    save_bar_chart(out / "host_allocator.png", [s["case"] for s in summary],
                   {arm: [s[f"{arm}_ms"] for s in summary] for arm in ARMS}, ylabel="ms per optimizer step (median)",
                   title="CPU training: glibc's malloc as it comes (system) or keeping freed memory (retain)")
    print(f"wrote {out / 'host_allocator.csv'}, {out / 'host_allocator.png'}")
    return {"rows": rows, "summary": summary}


if __name__ == "__main__":
    main()
