"""Standard accumulation on FSDP2: reduce the gradients once per optimizer step or after every micro-batch.

    python -m lightning_p2r.benchmarks.accumulation_sync [--micro-batches 4] [--steps 12] [--repeats 2] [--out DIR]

ZeRO-3 on 2 CPU processes (gloo, one thread each), Lightning's ``accumulate_grad_batches=m``, dense M6 (6 blocks,
width 256, 64 tokens per sequence, 2 sequences per micro-batch and rank). ``P2RStrategy(reduce_every_micro_batch=
False)`` (the default) skips the reduce-scatter of the non-final micro-batches; ``True`` reduces after each. The
table gives the median optimizer-step time after 4 warm-up steps, per run, and the ratio of the medians.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
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
from lightning_p2r.measure.run import worker_env

WARMUP = 4


def _worker(spec: dict[str, Any]) -> None:
    import lightning as L
    import torch

    from lightning_p2r import M6Config, M6LanguageModel, OptimizerConfig, P2RStrategy

    class StepEnds(L.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            self.ends.append(time.perf_counter())

    L.seed_everything(0)
    config = M6Config(vocab_size=256, max_seq_len=64, num_layers=6, dim=256, num_heads=4, moe_layers=[], init_seed=0)
    module = M6LanguageModel(config, OptimizerConfig(warmup_steps=1))
    ends = StepEnds()
    m = spec["micro_batches"]
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=spec["steps"], accumulate_grad_batches=m,
                        strategy=P2RStrategy(sharding="zero3", reduce_every_micro_batch=spec["reduce_each"]),
                        logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[ends])
    data = torch.randint(0, 256, (spec["steps"] * m * 2 * 2, 65))
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    if trainer.global_rank == 0:
        boundaries = ends.ends[WARMUP * m - 1::m]
        steps = [b - a for a, b in zip(boundaries, boundaries[1:])]
        Path(spec["out"]).write_text(json.dumps({"step_ms": 1000 * statistics.median(steps)}), encoding="utf-8")


def _run(spec: dict[str, Any]) -> float:
    env = worker_env(threads=1)
    command = [sys.executable, "-m", "lightning_p2r.benchmarks.accumulation_sync", "--worker", json.dumps(spec)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"run failed: {result.stderr[-2000:]}")
    return json.loads(Path(spec["out"]).read_text(encoding="utf-8"))["step_ms"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker(json.loads(sys.argv[2]))
        return {}
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each mode, alternating")
    args = parser.parse_args(argv)
    if args.quick:
        args.micro_batches, args.steps, args.repeats = 2, WARMUP + 2, 1
    env = environment_info("cpu")
    print_environment(env)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for repeat in range(args.repeats):
        for reduce_each in (True, False):
            spec = {"micro_batches": args.micro_batches, "steps": args.steps, "reduce_each": reduce_each,
                    "out": str(out / ".accumulation_sync_run.json")}
            rows.append({"reduce": "every micro-batch" if reduce_each else "once per step", "run": repeat,
                         "m": args.micro_batches, "step_ms": _run(spec)})
    Path(out / ".accumulation_sync_run.json").unlink(missing_ok=True)
    medians = {mode: statistics.median(r["step_ms"] for r in rows if r["reduce"] == mode)
               for mode in ("every micro-batch", "once per step")}
    print_table(rows, ["reduce", "run", "m", "step_ms"])
    ratio = medians["once per step"] / medians["every micro-batch"]
    print(f"once per step / every micro-batch, median step time: {ratio:.2f}")
    write_csv(with_environment(rows, env), out / "accumulation_sync.csv")
    save_bar_chart(out / "accumulation_sync.png", list(medians), {"step ms (median)": list(medians.values())},
                   ylabel="ms per optimizer step",
                   title=f"ZeRO-3, 2 CPU processes, {args.micro_batches} micro-batches per step")
    print(f"wrote {out / 'accumulation_sync.csv'}, {out / 'accumulation_sync.png'}")
    return {"rows": rows, "ratio": ratio}


if __name__ == "__main__":
    main()
