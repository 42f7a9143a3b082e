"""Time to the first optimizer step and steady-state step time of ``recipes/quickstart.yaml`` on this machine.

    python -m lightning_p2r.benchmarks.quickstart [--out DIR] [--device cpu|cuda] [--quick] [--max-steps N]
                                                   [--skip-steps N] [--config YAML] [LightningCLI overrides ...]

The Trainer, model and data module are built by the project's own LightningCLI from the recipe, with what does not
belong in a speed measurement switched off: loggers (W&B, CSV), checkpointing, the progress bar, the model summary
and validation. Unknown flags go to the CLI after those, so ``--data.tokenizer=bytes`` and the like win.

Reported stages, all wall time on ``time.perf_counter``:

- process start -> ``main()``: interpreter start and imports (torch, lightning); read from ``/proc/self/stat``, so
  only meaningful when run as ``python -m``; in-process callers (tests) see their own process age.
- ``main()`` -> CLI built: config parsing and Trainer / module instantiation.
- CLI built -> ``on_train_start``: ``fit`` setup: tokenizer + token ids (from the cache when warm), model build,
  optimizer.
- ``on_train_start`` -> end of the first optimizer step.
- steady state: median step time over the steps after ``--skip-steps`` (default 10), and tokens/s from it.

Whether the tokenizer cache was warm is detected (no file added to the cache folder during the run) and printed: a
cold run includes BPE training and corpus encoding, a warm one only loading. Run twice for the warm number.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

import lightning as L
import torch

from lightning_p2r.benchmarks.report import (
    apply_threads,
    base_parser,
    environment_info,
    print_environment,
    print_table,
    save_line_chart,
    with_environment,
    write_csv,
)
from lightning_p2r.measure.run import synchronize

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"
SUMMARY_COLUMNS = ["stage", "value"]
# A tiny model for --quick: the smoke test checks plumbing, not speed.
QUICK_OVERRIDES = ["--model.config.num_layers=2", "--model.config.dim=32", "--model.config.num_heads=2",
                   "--model.config.num_experts=2", "--model.config.sparse_window=8", "--data.seq_len=16",
                   "--data.batch_size=4"]


def process_start() -> float:
    """This process's start as a ``time.perf_counter`` value (10 ms resolution), or now if it cannot be read."""
    now = time.perf_counter()
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            # Field 22 (starttime, clock ticks since boot); split after the ")" as the command name may hold spaces.
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return now
    return now - max(age, 0.0)


class StepTimer(L.Callback):
    """Records the wall time of ``on_train_start`` and of the end of every training batch (one optimizer step)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.train_start: float | None = None
        self.batch_ends: list[float] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        synchronize(self.device)
        self.train_start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # Synchronizing makes a step's time its own rather than whatever CUDA work it left queued for the next.
        synchronize(self.device)
        self.batch_ends.append(time.perf_counter())

    def step_seconds(self) -> list[float]:
        """Duration of each step; step 0 runs from ``on_train_start`` (includes the dataloader's first batch)."""
        if self.train_start is None:
            return []
        ends = [self.train_start, *self.batch_ends]
        return [b - a for a, b in zip(ends, ends[1:])]


def _cache_files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()} if folder.is_dir() else set()


def build_cli(cli_args: list[str], timer: StepTimer) -> Any:
    """The project's LightningCLI, instantiated but not run."""
    from lightning_p2r.cli import P2RCLI
    from lightning_p2r.data import TextDataModule
    from lightning_p2r.module import M6LanguageModel

    # sys.argv holds this benchmark's own flags, already parsed; LightningCLI would warn that they are ignored.
    with mock.patch.object(sys, "argv", sys.argv[:1]):
        # save_config_callback=None: nothing is logged, so there is no run folder to save the config to.
        return P2RCLI(M6LanguageModel, TextDataModule, args=cli_args, run=False, save_config_callback=None,
                      trainer_defaults={"callbacks": [timer]})


def main(argv: list[str] | None = None) -> dict[str, Any]:
    started = process_start()
    main_start = time.perf_counter()
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=RECIPE, help="recipe YAML (default: the quickstart)")
    parser.add_argument("--max-steps", type=int, help="optimizer steps to run (default 60, or 3 with --quick)")
    parser.add_argument("--skip-steps", type=int, help="steps left out of the steady state (default 10, 1 quick)")
    args, cli_overrides = parser.parse_known_args(argv)
    max_steps = args.max_steps or (3 if args.quick else 60)
    skip = args.skip_steps if args.skip_steps is not None else (1 if args.quick else 10)
    device = torch.device(args.device)
    apply_threads(args.threads)

    env = environment_info(device)
    print_environment(env)
    with tempfile.TemporaryDirectory(prefix="p2r-quickstart-bench-") as root:
        cli_args = [
            "--config", str(args.config),
            f"--trainer.accelerator={device.type}",
            f"--trainer.max_steps={max_steps}",
            f"--trainer.default_root_dir={root}",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
            "--trainer.callbacks=[]",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            "--trainer.limit_val_batches=0",
            *(QUICK_OVERRIDES if args.quick else []),
            *cli_overrides,
        ]
        print("cli args: " + " ".join(cli_args))
        timer = StepTimer(device)
        cli = build_cli(cli_args, timer)
        built = time.perf_counter()
        cache_dir = Path(cli.datamodule.cache_dir)
        cache_before = _cache_files(cache_dir)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        cache_state = "warm" if _cache_files(cache_dir) <= cache_before else "cold (built during this run)"

    steps = timer.step_seconds()
    if not steps or timer.train_start is None:
        raise RuntimeError("training ran no step; check --max-steps and the data overrides")
    data = cli.datamodule
    tokens_per_step = data.batch_size * data.seq_len * cli.trainer.world_size
    steady = steps[skip:] or steps[1:] or steps  # a short run has nothing after the skip: use what there is
    median_step = statistics.median(steady)
    first_step_end = timer.batch_ends[0]

    summary = {
        "steps": len(steps),
        "steady_steps": len(steady),
        "tokens_per_step": tokens_per_step,
        "tokenizer": data.tokenizer_kind,
        "tokenizer_cache": cache_state,
        "process_to_main_s": main_start - started,
        "main_to_cli_built_s": built - main_start,
        "fit_setup_s": timer.train_start - built,
        "first_step_s": first_step_end - timer.train_start,
        "to_first_step_from_process_s": first_step_end - started,
        "to_first_step_from_main_s": first_step_end - main_start,
        "median_step_s": median_step,
        "tokens_per_s": tokens_per_step / median_step,
        # The median hides stalls (another process on the cores); the mean and the slow-step count show them.
        "mean_step_s": statistics.fmean(steady),
        "mean_tokens_per_s": tokens_per_step / statistics.fmean(steady),
        "slow_steps": sum(step > 3 * median_step for step in steady),
    }
    print(f"\ntokenizer cache: {cache_state} ({data.tokenizer_kind}, vocab {data.vocab_size}, {cache_dir})")
    print(f"{len(steps)} steps of {tokens_per_step} tokens; steady state = steps {len(steps) - len(steady)}.."
          f"{len(steps) - 1}\n")
    stages = [
        ("process start -> main() (s)", summary["process_to_main_s"]),
        ("main() -> CLI built (s)", summary["main_to_cli_built_s"]),
        ("CLI built -> on_train_start (fit setup) (s)", summary["fit_setup_s"]),
        ("on_train_start -> first step end (s)", summary["first_step_s"]),
        ("= process start -> first step end (s)", summary["to_first_step_from_process_s"]),
        ("= main() -> first step end (s)", summary["to_first_step_from_main_s"]),
        (f"median step time after step {skip} (s)", median_step),
        ("tokens/s (steady, from the median)", summary["tokens_per_s"]),
        (f"mean step time after step {skip} (s)", summary["mean_step_s"]),
        ("tokens/s (steady, from the mean)", summary["mean_tokens_per_s"]),
        (f"steps > 3x the median (of {len(steady)})", summary["slow_steps"]),
    ]
    print_table([{"stage": name, "value": value} for name, value in stages], SUMMARY_COLUMNS)

    csv_path = write_csv(with_environment([summary], env), args.out / "quickstart.csv")
    step_rows = [{"step": i, "step_s": s, "tokens_per_s": tokens_per_step / s} for i, s in enumerate(steps)]
    write_csv(step_rows, args.out / "quickstart_steps.csv")
    # Step 0 (lazy init, first batch) is plotted only when it is all there is: it would squash the other steps.
    first = 1 if len(steps) > 1 else 0
    png_path = save_line_chart(
        args.out / "quickstart.png", list(range(first, len(steps))),
        {"step time (ms)": [s * 1e3 for s in steps[first:]], f"median after step {skip}": [median_step * 1e3] * (
            len(steps) - first)},
        xlabel="optimizer step (step 0 not shown)" if first else "optimizer step", ylabel="ms per step (log scale)",
        logy=True,
        title=(f"quickstart recipe: {tokens_per_step} tokens/step, median {median_step * 1e3:.1f} ms after step "
               f"{skip} = {summary['tokens_per_s']:,.0f} tokens/s; first step {summary['first_step_s']:.2f} s\n"
               f"{env['device_name']} ({env['device']}, {env['threads']} threads), torch {env['torch']}"),
    )
    print(f"\nwrote {csv_path}, {args.out / 'quickstart_steps.csv'} and {png_path}")
    return summary


if __name__ == "__main__":
    main()
