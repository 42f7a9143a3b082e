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

import statistics
from pathlib import Path
from typing import Any

from lightning_p2r.benchmarks.p2r_protocol import paired_difference
from lightning_p2r.benchmarks.pseudo_to_real import launch_run
from lightning_p2r.benchmarks.report import (
    base_parser,
    environment_info,
    print_environment,
    print_table,
    save_bar_chart,
    with_environment,
    write_csv,
)

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"
ARMS = ("exact", "delayed")


def run_arm(name: str, cli_args: list[str], result: Path, threads: int = 2) -> dict[str, Any]:
    """One training run in its own process, by the Pseudo-to-Real benchmark's worker (no delinking): its validation
    points and its median step time after two warm-up steps."""
    spec = {"name": name, "threads": threads, "args": cli_args, "schedule": {}, "arm": None, "moment_check": False,
            "save_at": {}, "resume": None, "result": str(result)}
    run = launch_run(spec, timeout=3600)
    clock = run["step_clock"]
    steps = [b - a for a, b in zip(clock[2:], clock[3:])] or [float("nan")]
    return {"points": run["points"], "step_s": statistics.median(steps)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--config", type=Path, default=RECIPE)
    args = parser.parse_args(argv)
    # --quick: the code path (both arms, their validation and table) in a few steps, not a measurement: one thread
    # and the byte tokenizer (no BPE to train first).
    steps, val_every, val_batches = (8, 4, 2) if args.quick else (args.steps, max(args.steps // 6, 1), 20)
    seeds = 1 if args.quick else args.seeds
    quick_data = ["--data.tokenizer=bytes", "--data.vocab_size=256"] if args.quick else []
    env = environment_info("cpu")
    print_environment(env)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    finals: dict[str, list[float]] = {arm: [] for arm in ARMS}
    step_times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for seed in range(seeds):
        for arm in ARMS:
            name = f"{arm}_seed{seed}"
            result = run_arm(name, [
                "--config", str(args.config), f"--seed_everything={seed}", "--trainer.accelerator=cpu",
                "--trainer.devices=1", "--trainer.num_sanity_val_steps=0", "--trainer.logger=false",
                "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false",
                "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={out / '.runs'}",
                f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={val_every}",
                f"--trainer.limit_val_batches={val_batches}", "--trainer.strategy=lightning_p2r.P2RStrategy",
                "--trainer.strategy.offload_fraction=0.5", f"--trainer.strategy.host_step={arm}", *quick_data],
                out / f".delayed_{name}.json", threads=1 if args.quick else 2)
            finals[arm].append(result["points"][-1][1])
            step_times[arm].append(result["step_s"])
            print(f"seed {seed} {arm}: final val loss {finals[arm][-1]:.4f}, {result['step_s']:.4f} s/step",
                  flush=True)
    paired = paired_difference(dict(enumerate(finals["delayed"])), dict(enumerate(finals["exact"])))
    rows = [{"arm": arm, "final_val_loss_mean": round(statistics.fmean(finals[arm]), 4),
             "final_val_loss_sd": round(statistics.stdev(finals[arm]), 4) if seeds > 1 else None,
             "vs_exact": None if arm == "exact" else f"{paired.mean:+.4f} ± {paired.se:.4f}",
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
