"""Tensor and expert parallelism on CPU processes: collective bytes per step (counted) against the formulas,
per-rank model-state bytes, and tokens/s.

    python -m lightning_p2r.benchmarks.parallel [--steps 8] [--layouts tp2,ep2,...] [--out DIR] [--quick]

Each layout trains the same MoE M6 (every other layer MoE, dropless, M6-T prototyping with 2 prototypes of top-1,
fp32) for a few steps on 2 or 4 gloo processes with ``P2RStrategy(count_collectives=True)``, one thread each, the
same global batch. Per layout the table gives, averaged over the ranks, the bytes of each collective kind in the
last step next to what ``lightning_p2r.planning.traffic`` predicts from the model's sizes (tensor
parallel's activation and vocabulary-parallel loss all-reduces, expert parallel's all-to-alls, the balance loss's
all-reduces, and FSDP2's gathers, reduce-scatters or all-reduces over the data ranks, from the bytes of the
parameter parts more than one data rank holds); each rank's parameter and optimizer-state bytes
against one process's; and tokens/s (global batch tokens over the median step time after warm-up). On 2 cores,
4 processes share 2 cores: their tokens/s measure the overhead, not a speed-up.
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
    save_bar_chart,
    with_environment,
    write_csv,
)
from lightning_p2r.measure.collectives import KINDS, data_parallel_parts, predicted_bytes
from lightning_p2r.measure.run import run_rank_worker

WARMUP = 3
LAYOUTS: dict[str, dict[str, Any]] = {
    "one process": {"devices": 1, "strategy": {}},
    "dp2": {"devices": 2, "strategy": {}},
    "tp2": {"devices": 2, "strategy": {"tensor_parallel": 2}},
    "ep2": {"devices": 2, "strategy": {"expert_parallel": 2}},
    "tp2 zero3": {"devices": 2, "strategy": {"tensor_parallel": 2, "sharding": "zero3"}},
    "tp2 sp": {"devices": 2, "strategy": {"tensor_parallel": 2, "sequence_parallel": True}},
    "tp4": {"devices": 4, "strategy": {"tensor_parallel": 4}},
    "ep4": {"devices": 4, "strategy": {"expert_parallel": 4}},
    "tp2 x ep2": {"devices": 4, "strategy": {"tensor_parallel": 2, "expert_parallel": 2}},
    "tp2 x ep2 zero3": {"devices": 4, "strategy": {"tensor_parallel": 2, "expert_parallel": 2, "sharding": "zero3"}},
}


def model_config(quick: bool) -> dict[str, Any]:
    size = {"dim": 64, "num_layers": 2, "max_seq_len": 32} if quick else {"dim": 256, "num_layers": 4,
                                                                          "max_seq_len": 128}
    return size | {"vocab_size": 256, "num_heads": 4, "num_experts": 8, "num_prototypes": 2, "moe_top_k": 1,
                   "moe_layers": list(range(1, size["num_layers"], 2)), "capacity_factor": None, "init_seed": 0}


def _worker(spec: dict[str, Any]) -> None:
    import torch.distributed as dist

    from lightning_p2r import P2RStrategy
    from lightning_p2r.measure.memory import local_model_state_bytes
    from lightning_p2r.measure.run import fit_on_random_tokens

    strategy = P2RStrategy(count_collectives=True, **spec["strategy"])
    trainer, module, step_s = fit_on_random_tokens(spec, strategy, warmup=WARMUP)
    state = local_model_state_bytes(module, trainer.strategy.optimizers[0])
    last = strategy.collectives_history[-1]
    block_bytes, root_bytes = data_parallel_parts(module)
    report = {"rank": trainer.global_rank, "step_s": step_s, "bytes": dict(last.bytes),
              "calls": dict(last.calls), "param_bytes": state.params, "optimizer_bytes": state.optimizer,
              "block_bytes": block_bytes, "root_bytes": root_bytes, "path": strategy.path,
              "fsdp_mode": strategy.fsdp_mode}
    Path(spec["out"]).with_suffix(f".rank{trainer.global_rank}.json").write_text(json.dumps(report))
    if dist.is_initialized():
        dist.barrier()






def main(argv: list[str] | None = None) -> dict[str, Any]:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker(json.loads(sys.argv[2]))
        return {}
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--layouts", type=str, default=",".join(LAYOUTS), help="comma-separated, of: " +
                        ", ".join(LAYOUTS))
    args = parser.parse_args(argv)
    names = chosen_layouts(parser, args.layouts, LAYOUTS)
    if args.quick:
        args.steps = WARMUP + 2
    model = model_config(args.quick)
    env = environment_info("cpu")
    print_environment(env)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in names:
        layout = LAYOUTS[name]
        spec = {"name": name, "model": model, "steps": args.steps, "global_batch": args.global_batch,
                "out": str(out / ".parallel_run"), **layout}
        reports = run_rank_worker("lightning_p2r.benchmarks.parallel", spec, timeout=1200)
        ranks = len(reports)
        mean = {kind: sum(r["bytes"].get(kind, 0) for r in reports) / ranks for kind in KINDS}
        predicted = predicted_bytes(model, layout["strategy"], layout["devices"], args.global_batch, reports[0],
                                    gloo=True)  # CPU processes
        step_s = statistics.median(r["step_s"] for r in reports)
        row: dict[str, Any] = {"layout": name, "processes": layout["devices"], "engine": reports[0]["path"]}
        for kind in KINDS:
            row[f"{kind}_bytes"] = round(mean[kind])
            row[f"{kind}_formula"] = round(predicted[kind]) if predicted else None
        row |= {"param_bytes_per_rank": max(r["param_bytes"] for r in reports),
                "optimizer_bytes_per_rank": max(r["optimizer_bytes"] for r in reports),
                "step_s": round(step_s, 4),
                "tokens_per_s": round(args.global_batch * model["max_seq_len"] / step_s, 1)}
        rows.append(row)
        print(f"{name}: done", flush=True)
    columns = ["layout", "processes"] + [f"{k}_{s}" for k in KINDS for s in ("bytes", "formula")] + [
        "param_bytes_per_rank", "optimizer_bytes_per_rank", "step_s", "tokens_per_s"]
    print_table(rows, columns)
    mismatched = [r["layout"] for r in rows if r["all_reduce_formula"] is not None and any(
        r[f"{k}_bytes"] != r[f"{k}_formula"] for k in KINDS)]
    print("counted bytes equal the formulas for every model-parallel layout" if not mismatched else
          f"counted bytes differ from the formulas for: {mismatched}")
    write_csv(with_environment(rows, env), out / "parallel.csv")
    save_bar_chart(out / "parallel.png", [r["layout"] for r in rows],
                   {"tokens/s": [r["tokens_per_s"] for r in rows]}, ylabel="tokens/s (global batch)",
                   title="M6 MoE, tensor / expert parallel on CPU processes (gloo, 1 thread each)")
    print(f"wrote {out / 'parallel.csv'}, {out / 'parallel.png'}")
    return {"rows": rows, "mismatched": mismatched}


if __name__ == "__main__":
    main()
