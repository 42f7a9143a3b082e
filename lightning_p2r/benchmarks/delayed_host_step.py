"""What a delayed host step costs in loss (issue 40 item 5): the quickstart recipe with half its blocks offloaded,
``host_step="exact"`` against ``"delayed"``, on the same seeds.

    python -m lightning_p2r.benchmarks.delayed_host_step [--steps 300] [--seeds 3] [--out DIR] [--quick]

Each run is one process (2 threads), the recipe's model, data, LR schedule and clipping, ``offload_fraction=0.5``;
seed s fixes the init and the data order for both arms, so the difference is paired by seed. The table gives each
arm's final validation loss (the recipe's 20 fixed batches), the paired difference delayed - exact with its
standard error, and the median step time. On a CPU the host and the "device" share the cores, so the time column
says nothing about hiding the host step (a GPU's ``benchmarks.gpu`` measures that): this benchmark is for the loss.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

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

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"
ARMS = ("exact", "delayed")


def _worker(spec: dict[str, Any]) -> None:
    from lightning_p2r.benchmarks.pseudo_to_real import ValidationRecorder, build_cli

    torch.set_num_threads(spec["threads"])
    cli = build_cli(spec["args"])
    recorder = ValidationRecorder()
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    clock = recorder.step_clock
    steps = [b - a for a, b in zip(clock[2:], clock[3:])] or [float("nan")]
    Path(spec["result"]).write_text(json.dumps({"points": recorder.points, "step_s": statistics.median(steps)}))


def _run(spec: dict[str, Any]) -> dict[str, Any]:
    command = [sys.executable, "-m", "lightning_p2r.benchmarks.delayed_host_step", "--worker", json.dumps(spec)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=3600, env=worker_env(spec["threads"]))
    path = Path(spec["result"])
    if result.returncode or not path.exists():
        raise RuntimeError(f"run {spec['name']} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(path.read_text())


def paired(differences: list[float]) -> tuple[float, float]:
    """Mean and standard error of paired differences (the error is nan for one pair)."""
    mean = statistics.fmean(differences)
    if len(differences) < 2:
        return mean, math.nan
    return mean, statistics.stdev(differences) / math.sqrt(len(differences))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker(json.loads(sys.argv[2]))
        return {}
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--config", type=Path, default=RECIPE)
    args = parser.parse_args(argv)
    steps, val_every, val_batches = (20, 10, 2) if args.quick else (args.steps, max(args.steps // 6, 1), 20)
    seeds = 1 if args.quick else args.seeds
    env = environment_info("cpu")
    print_environment(env)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    finals: dict[str, list[float]] = {arm: [] for arm in ARMS}
    step_times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for seed in range(seeds):
        for arm in ARMS:
            name = f"{arm}_seed{seed}"
            spec = {"name": name, "threads": 2, "result": str(out / f".delayed_{name}.json"), "args": [
                "--config", str(args.config), f"--seed_everything={seed}", "--trainer.accelerator=cpu",
                "--trainer.devices=1", "--trainer.num_sanity_val_steps=0", "--trainer.logger=false",
                "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false",
                "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={out / '.runs'}",
                f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={val_every}",
                f"--trainer.limit_val_batches={val_batches}", "--trainer.strategy=lightning_p2r.P2RStrategy",
                "--trainer.strategy.offload_fraction=0.5", f"--trainer.strategy.host_step={arm}"]}
            result = _run(spec)
            finals[arm].append(result["points"][-1][1])
            step_times[arm].append(result["step_s"])
            print(f"seed {seed} {arm}: final val loss {finals[arm][-1]:.4f}, {result['step_s']:.4f} s/step",
                  flush=True)
    diff, error = paired([d - e for d, e in zip(finals["delayed"], finals["exact"])])
    rows = [{"arm": arm, "final_val_loss_mean": round(statistics.fmean(finals[arm]), 4),
             "final_val_loss_sd": round(statistics.stdev(finals[arm]), 4) if seeds > 1 else None,
             "vs_exact": None if arm == "exact" else f"{diff:+.4f} ± {error:.4f}",
             "step_s_median": round(statistics.median(step_times[arm]), 4), "seeds": seeds, "steps": steps}
            for arm in ARMS]
    print_table(rows, ["arm", "final_val_loss_mean", "final_val_loss_sd", "vs_exact", "step_s_median", "seeds",
                       "steps"])
    write_csv(with_environment(rows, env), out / "delayed_host_step.csv")
    save_bar_chart(out / "delayed_host_step.png", list(ARMS),
                   {"final val loss": [r["final_val_loss_mean"] for r in rows]}, ylabel="final validation loss",
                   title=f"Delayed host step: quickstart, offload 0.5, {steps} steps, {seeds} seeds")
    print(f"wrote {out / 'delayed_host_step.csv'}, {out / 'delayed_host_step.png'}")
    return {"rows": rows, "finals": finals}


if __name__ == "__main__":
    main()
