"""Per-block torch.compile against eager: the median step time of the same training, dense and MoE, on 1 and 2
CPU processes.

    python -m lightning_p2r.benchmarks.compile [--steps 10] [--layouts "one process,dp2"] [--models dense,MoE]
                                               [--backend inductor] [--out DIR | --update-docs] [--quick]

Each layout trains an M6 model (4 layers, width 256, 128 tokens per sequence, fp32, no dropout) for a few steps
on gloo processes with one thread each, the same global batch, once eager and once with
``P2RStrategy(compile=...)`` (``True``: inductor); "dense" has dense FFNs only, "MoE" makes layers 1 and 3 MoE
(8 experts in 2 prototypes of top-1, dropless). The step time is the median optimizer-step interval after the
warm-up steps, which absorb the compilation and the recompiles while the MoE layers' segment sizes turn dynamic;
the warm-up column is the time from the start of training to the end of the last warm-up step, compilation
included.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from lightning_p2r.benchmarks.parallel import model_config
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

WARMUP = 4
LAYOUTS: dict[str, dict[str, Any]] = {
    "one process": {"devices": 1, "strategy": {}},
    "dp2": {"devices": 2, "strategy": {}},
    "zero3 x2": {"devices": 2, "strategy": {"sharding": "zero3"}},
    "tp2": {"devices": 2, "strategy": {"tensor_parallel": 2}},
    "ep2": {"devices": 2, "strategy": {"expert_parallel": 2}, "moe_only": True},
}
DEFAULT_LAYOUTS = ("one process", "dp2")
MODELS = ("dense", "MoE")


def benchmark_model(kind: str, quick: bool) -> dict[str, Any]:
    """The parallel benchmark's M6-T model, or the same with dense FFNs only; no dropout (compiled code draws its
    own random numbers, and the runs should compute the same thing)."""
    config = model_config(quick) | {"dropout": 0.0}
    return config | {"moe_layers": []} if kind == "dense" else config


def _worker(spec: dict[str, Any]) -> None:
    import lightning as L
    import torch.distributed as dist

    from lightning_p2r import P2RStrategy
    from lightning_p2r.measure.run import fit_on_random_tokens
    from lightning_p2r.strategy.compile import is_compiled

    class StartTime(L.Callback):
        def on_train_start(self, *args: Any) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step == spec["warmup"]:
                self.warmup_s = time.perf_counter() - self.start

    clock = StartTime()
    strategy = P2RStrategy(**spec["strategy"])
    trainer, module, step_s = fit_on_random_tokens(spec, strategy, warmup=spec["warmup"], callbacks=(clock,))
    report = {"rank": trainer.global_rank, "step_s": step_s, "warmup_s": clock.warmup_s, "path": strategy.path,
              "compiled": all(is_compiled(b) for b in module.transformer.blocks)}
    Path(spec["out"]).with_suffix(f".rank{trainer.global_rank}.json").write_text(json.dumps(report))
    if dist.is_initialized():
        dist.barrier()


def _measure(name: str, kind: str, model: dict[str, Any], layout: dict[str, Any], compile_option: bool | str,
             args: Any, out: Path) -> dict[str, Any]:
    strategy = layout["strategy"] | ({"compile": compile_option} if compile_option else {})
    spec = {"name": f"{kind} {name}", "model": model, "steps": args.steps, "global_batch": args.global_batch,
            "warmup": WARMUP, "out": str(out / ".compile_run"), "devices": layout["devices"], "strategy": strategy}
    reports = run_rank_worker("lightning_p2r.benchmarks.compile", spec, timeout=1800)
    if compile_option and not all(r["compiled"] for r in reports):
        raise RuntimeError(f"{spec['name']}: the blocks were not compiled")
    return {"step_s": statistics.median(r["step_s"] for r in reports),
            "warmup_s": max(r["warmup_s"] for r in reports), "engine": reports[0]["path"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker(json.loads(sys.argv[2]))
        return {}
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--layouts", type=str, default=",".join(DEFAULT_LAYOUTS),
                        help="comma-separated, of: " + ", ".join(LAYOUTS))
    parser.add_argument("--models", type=str, default=",".join(MODELS), help="comma-separated, of: " +
                        ", ".join(MODELS))
    parser.add_argument("--backend", default="inductor",
                        help="torch.compile backend of the compiled runs (default: %(default)s, what compile=True "
                             "means)")
    args = parser.parse_args(argv)
    names = chosen_layouts(parser, args.layouts, LAYOUTS)
    kinds = chosen_layouts(parser, args.models, dict.fromkeys(MODELS))
    if args.quick:
        args.steps = WARMUP + 2
    compile_option: bool | str = True if args.backend == "inductor" else args.backend
    env = environment_info("cpu")
    print_environment(env)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for kind in kinds:
        model = benchmark_model(kind, args.quick)
        for name in names:
            layout = LAYOUTS[name]
            if layout.get("moe_only") and kind == "dense":
                continue  # expert parallelism splits MoE layers
            eager = _measure(name, kind, model, layout, False, args, out)
            compiled = _measure(name, kind, model, layout, compile_option, args, out)
            tokens = args.global_batch * model["max_seq_len"]
            rows.append({"model": kind, "layout": name, "processes": layout["devices"], "engine": eager["engine"],
                         "eager_s_per_step": round(eager["step_s"], 4),
                         "compiled_s_per_step": round(compiled["step_s"], 4),
                         "compiled_over_eager": round(eager["step_s"] / compiled["step_s"], 3),
                         "eager_tokens_per_s": round(tokens / eager["step_s"], 1),
                         "compiled_tokens_per_s": round(tokens / compiled["step_s"], 1),
                         "eager_warmup_s": round(eager["warmup_s"], 1),
                         "compiled_warmup_s": round(compiled["warmup_s"], 1), "backend": args.backend})
            print(f"{kind} {name}: done", flush=True)
    columns = ["model", "layout", "processes", "engine", "eager_s_per_step", "compiled_s_per_step",
               "compiled_over_eager", "eager_warmup_s", "compiled_warmup_s"]
    print_table(rows, columns)
    print("compiled_over_eager: eager step time / compiled step time (above 1: compiled is faster)")
    write_csv(with_environment(rows, env), out / "compile.csv")
    save_bar_chart(out / "compile.png", [f"{r['model']}, {r['layout']}" for r in rows],
                   {"eager": [r["eager_tokens_per_s"] for r in rows],
                    f"compiled ({args.backend})": [r["compiled_tokens_per_s"] for r in rows]},
                   ylabel="tokens/s (global batch)",
                   title=f"M6, per-block torch.compile vs eager on CPU processes (gloo, 1 thread each), "
                         f"median after {WARMUP} warm-up steps")
    print(f"wrote {out / 'compile.csv'}, {out / 'compile.png'}")
    return {"rows": rows}


if __name__ == "__main__":
    main()
