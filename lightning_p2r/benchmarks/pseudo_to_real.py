"""Pseudo-to-Real against training the real model from scratch: validation loss per step and per training second.

    python -m lightning_p2r.benchmarks.pseudo_to_real [--out DIR] [--device cpu|cuda] [--quick] [--steps N]
        [--fractions F ...] [--policy-fraction F] [--variants NAME ...] [--val-every N] [--val-batches N]
        [--config YAML] [LightningCLI overrides ...]

Every variant is the model of ``recipes/pseudo_to_real.yaml`` (8 layers, dim 128, 4 experts; BPE 2048 on the KJV,
sequences of 64, batches of 16), built by the project's LightningCLI from that recipe with the same seed, hence the
same data order, the same token budget (``--steps``) and the same warmup + cosine schedule over ``--steps``:

- ``scratch``: the real model (one block per layer) from the first step; no PseudoToReal.
- ``p2r_f<F>_scale``: the pseudo model (every layer shares one block), delinked at ``round(F * steps)`` with
  ``optimizer_state="scale"``, one variant per value in ``--fractions``.
- ``p2r_f<F>_copy`` / ``p2r_f<F>_reset``: the same at ``--policy-fraction`` with the other optimizer-state policies.
- ``pseudo_only``: the pseudo model never delinked: what sharing alone reaches on the same budget.

Validation runs every ``--val-every`` steps on the same first ``--val-batches`` validation batches for every
variant. "Training seconds" is wall time from ``on_train_start`` with validation time taken out, so it counts the
steps, the dataloader and the delinking itself. The target of the "to reach" columns is the scratch run's final
validation loss; the step (and second) where a variant first gets there is interpolated linearly between the two
validation points around the crossing. Unknown flags go to the CLI of every variant alike (e.g.
``--model.optimizer.lr=0.001``), so a changed setting never favours one side.

The memory table counts the pseudo and the real model's parameters from built models and prices the training state
in fp32: 4 bytes of parameter, 4 of gradient and 8 of AdamW moments (exp_avg + exp_avg_sq) per parameter.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
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
    pyplot,
    save_figure,
    synchronize,
    with_environment,
    write_csv,
)

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "pseudo_to_real.yaml"
POLICIES = ("scale", "copy", "reset")
CURVE_COLUMNS = ["variant", "delink_step", "optimizer_state", "step", "train_seconds", "wall_seconds", "val_loss"]
SUMMARY_COLUMNS = ["variant", "delink_step", "final_val_loss", "steps_to_target", "seconds_to_target",
                   "steps_saved_%", "time_saved_%", "train_s", "pseudo_s_per_step", "real_s_per_step", "load_1m"]
MEMORY_COLUMNS = ["model", "part", "params", "param_MiB", "grad_MiB", "adamw_MiB", "total_MiB"]
BYTES_PARAM, BYTES_GRAD, BYTES_ADAMW = 4, 4, 8
# --quick: a tiny model on a tiny byte-level corpus; the smoke test checks plumbing, the numbers mean nothing.
QUICK_OVERRIDES = ["--model.config.num_layers=4", "--model.config.dim=32", "--model.config.num_heads=2",
                   "--model.config.num_experts=2", "--model.config.sparse_window=8", "--model.optimizer.warmup_steps=2",
                   "--data.tokenizer=bytes", "--data.vocab_size=256", "--data.seq_len=16", "--data.batch_size=4"]
QUICK_TEXT = ("And the benchmark said, let there be a loss curve: and there was a loss curve, and it went down.\n"
              "The pseudo model shared one block among its layers, and afterwards every layer had its own.\n")


@dataclass(frozen=True)
class Variant:
    name: str
    num_unique_blocks: int | None  # 1 = pseudo (shared), None = real
    delink_fraction: float | None = None
    optimizer_state: str | None = None


def plan_variants(fractions: Sequence[float], policy_fraction: float) -> list[Variant]:
    """Every variant the benchmark knows, in run order: scratch first (it defines the target)."""
    variants = [Variant("scratch", None)]
    variants += [Variant(f"p2r_f{f:g}_scale", 1, f, "scale") for f in fractions]
    variants += [Variant(f"p2r_f{policy_fraction:g}_{policy}", 1, policy_fraction, policy)
                 for policy in POLICIES if policy != "scale"]
    variants.append(Variant("pseudo_only", 1))
    unique: dict[str, Variant] = {}
    for variant in variants:
        unique.setdefault(variant.name, variant)
    return list(unique.values())


class ValidationRecorder(L.Callback):
    """Training clock (wall time since ``on_train_start`` minus time spent validating) at every step and validation.

    ``step_clock[i]`` is the clock at the end of optimizer step ``i``; ``points`` holds one
    ``(global_step, train_seconds, wall_seconds, val_loss)`` per validation, sanity check excluded.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start: float | None = None
        self.validating_since: float | None = None
        self.validation_seconds = 0.0
        self.step_clock: list[float] = []
        self.points: list[tuple[int, float, float, float]] = []

    def _now(self) -> float:
        synchronize(self.device)
        return time.perf_counter()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = self._now()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        assert self.start is not None
        self.step_clock.append(self._now() - self.start - self.validation_seconds)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and self.start is not None:
            self.validating_since = self._now()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or self.validating_since is None or self.start is None:
            return
        now = self._now()
        train_seconds = self.validating_since - self.start - self.validation_seconds
        self.validation_seconds += now - self.validating_since
        self.validating_since = None
        loss = float(trainer.callback_metrics["val/loss"])
        self.points.append((trainer.global_step, train_seconds, now - self.start, loss))


def first_crossing(xs: Sequence[float], losses: Sequence[float], target: float) -> float | None:
    """Where ``losses`` (sampled at ``xs``) first reach ``target`` or below, linear between samples; None if never."""
    for i, loss in enumerate(losses):
        if loss <= target:
            if i == 0 or losses[i - 1] == loss:
                return xs[i]
            frac = (losses[i - 1] - target) / (losses[i - 1] - loss)
            return xs[i - 1] + frac * (xs[i] - xs[i - 1])
    return None


def build_cli(cli_args: list[str]) -> Any:
    """The project's LightningCLI over the recipe, instantiated but not run."""
    from lightning_p2r.cli import P2RCLI
    from lightning_p2r.data import TextDataModule
    from lightning_p2r.module import M6LanguageModel

    # sys.argv holds this benchmark's own flags; LightningCLI would warn that they are ignored.
    with mock.patch.object(sys, "argv", sys.argv[:1]):
        return P2RCLI(M6LanguageModel, TextDataModule, args=cli_args, run=False, save_config_callback=None)


def run_variant(variant: Variant, base_args: list[str], device: torch.device) -> dict[str, Any]:
    """Train one variant; return its validation curve, per-step clock and delink step."""
    from lightning_p2r import PseudoToReal

    load_1m = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else math.nan
    blocks = "null" if variant.num_unique_blocks is None else str(variant.num_unique_blocks)
    with tempfile.TemporaryDirectory(prefix=f"p2r-bench-{variant.name}-") as root:
        cli = build_cli([*base_args, f"--trainer.default_root_dir={root}",
                         f"--model.config.num_unique_blocks={blocks}"])
        recorder = ValidationRecorder(device)
        callback = None
        if variant.delink_fraction is not None:
            callback = PseudoToReal(delink_at_fraction=variant.delink_fraction, optimizer_state=variant.optimizer_state)
            cli.trainer.callbacks.append(callback)
        cli.trainer.callbacks.append(recorder)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    if not recorder.points:
        raise RuntimeError(f"{variant.name}: no validation ran; check --val-every against --steps")
    delink_step = None
    if callback is not None:
        if not callback.events:
            raise RuntimeError(f"{variant.name}: PseudoToReal never delinked")
        delink_step = callback.events[0].step
    return {"variant": variant, "points": recorder.points, "step_clock": recorder.step_clock,
            "delink_step": delink_step, "config": cli.model.config, "load_1m": load_1m}


def _mean_step_seconds(step_clock: Sequence[float], first: int, stop: int) -> float:
    """Mean duration of steps ``first..stop-1``; step 0 (first batch, lazy setup) is always left out."""
    first = max(first, 1)
    durations = [step_clock[i] - step_clock[i - 1] for i in range(first, min(stop, len(step_clock)))]
    return statistics.fmean(durations) if durations else math.nan


def summarize(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per variant (columns as ``SUMMARY_COLUMNS``); "to target" columns need a scratch run."""
    scratch = next((r for r in results if r["variant"].name == "scratch"), None)
    target = scratch["points"][-1][3] if scratch else None
    crossings = []
    for result in results:
        steps, seconds, _, losses = zip(*result["points"])
        crossings.append((first_crossing(steps, losses, target), first_crossing(seconds, losses, target))
                         if target is not None else (None, None))
    reference = crossings[results.index(scratch)] if scratch else (None, None)
    rows = []
    for result, (at_step, at_second) in zip(results, crossings):
        clock = result["step_clock"]
        delink = result["delink_step"]
        pseudo = result["variant"].num_unique_blocks == 1
        # First step of the real stage: the delink step; never for pseudo_only; 0 for scratch.
        switch = delink if delink is not None else (len(clock) if pseudo else 0)
        row: dict[str, Any] = {"variant": result["variant"].name, "delink_step": delink,
                               "final_val_loss": result["points"][-1][3]}
        if target is None:
            row |= dict.fromkeys(("steps_to_target", "seconds_to_target", "steps_saved_%", "time_saved_%"), "-")
        else:
            row["steps_to_target"] = "never" if at_step is None else f"{at_step:.0f}"
            row["seconds_to_target"] = "never" if at_second is None else f"{at_second:.1f}"
            for key, value, ref in (("steps_saved_%", at_step, reference[0]),
                                    ("time_saved_%", at_second, reference[1])):
                row[key] = "-" if value is None or not ref else f"{100.0 * (1.0 - value / ref):.1f}"
        row["train_s"] = clock[-1] if clock else math.nan
        row["pseudo_s_per_step"] = _mean_step_seconds(clock, 0, switch) if switch else math.nan
        row["real_s_per_step"] = _mean_step_seconds(clock, switch, len(clock)) if switch < len(clock) else math.nan
        row["load_1m"] = result["load_1m"]
        rows.append(row)
    return rows


def memory_rows(config: Any) -> list[dict[str, Any]]:
    """fp32 parameter + gradient + AdamW bytes of the pseudo (1 block) and real model, from built models."""
    from lightning_p2r.models import M6Transformer

    rows = []
    for label, blocks in (("pseudo", 1), ("real", None)):
        model = M6Transformer(config.replace(num_unique_blocks=blocks))
        total = sum(p.numel() for p in model.parameters())  # a tied tensor counts once
        in_blocks = sum(p.numel() for p in model.blocks.parameters())
        for part, count in (("blocks", in_blocks), ("rest", total - in_blocks), ("total", total)):
            rows.append({"model": label, "part": part, "params": count,
                         "param_bytes": count * BYTES_PARAM, "grad_bytes": count * BYTES_GRAD,
                         "adamw_bytes": count * BYTES_ADAMW,
                         "total_bytes": count * (BYTES_PARAM + BYTES_GRAD + BYTES_ADAMW)})
    for row in rows:
        for key in ("param", "grad", "adamw", "total"):
            row[f"{key}_MiB"] = row[f"{key}_bytes"] / 2**20
    return rows


def save_plot(path: Path, results: Sequence[dict[str, Any]], target: float | None, title: str) -> Path:
    plt = pyplot()
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(13, 5.5), dpi=110, sharey=True)
    for i, result in enumerate(results):
        steps, seconds, _, losses = zip(*result["points"])
        color = f"C{i % 10}"
        name = result["variant"].name
        by_step.plot(steps, losses, marker=".", color=color, label=name)
        by_time.plot(seconds, losses, marker=".", color=color, label=name)
        delink = result["delink_step"]
        if delink is not None:
            clock = result["step_clock"]
            delink_s = clock[delink - 1] if 0 < delink <= len(clock) else 0.0
            by_step.axvline(delink, color=color, linestyle=":", alpha=0.7)
            by_time.axvline(delink_s, color=color, linestyle=":", alpha=0.7)
    for ax, xlabel in ((by_step, "optimizer step"), (by_time, "training seconds (validation excluded)")):
        if target is not None:
            ax.axhline(target, color="black", linestyle="--", linewidth=0.8, label="scratch final val loss")
        ax.set_xlabel(xlabel)
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
    by_step.set_ylabel("validation loss (log scale); dotted: delink")
    by_step.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=RECIPE, help="recipe YAML (default: pseudo_to_real.yaml)")
    parser.add_argument("--steps", type=int, help="optimizer steps of every run (default 600, 12 with --quick)")
    parser.add_argument("--fractions", type=float, nargs="+",
                        help="delink points as fractions of --steps (default 0.1 0.25 0.5; 0.25 with --quick)")
    parser.add_argument("--policy-fraction", type=float, default=0.25,
                        help="fraction at which copy and reset are also run (default %(default)s)")
    parser.add_argument("--variants", nargs="+",
                        help="variant names to run (default all; scratch + p2r_f0.25_scale with --quick)")
    parser.add_argument("--val-every", type=int, help="steps between validations (default 25, 4 with --quick)")
    parser.add_argument("--val-batches", type=int, help="validation batches (default 20, 2 with --quick)")
    args, cli_overrides = parser.parse_known_args(argv)
    steps = args.steps or (12 if args.quick else 600)
    fractions = args.fractions or ([0.25] if args.quick else [0.1, 0.25, 0.5])
    val_every = args.val_every or (4 if args.quick else 25)
    val_batches = args.val_batches or (2 if args.quick else 20)
    device = torch.device(args.device)
    apply_threads(args.threads)

    known = plan_variants(fractions, args.policy_fraction)
    wanted = args.variants or (["scratch", f"p2r_f{fractions[0]:g}_scale"] if args.quick else None)
    if wanted is not None:
        unknown = sorted(set(wanted) - {v.name for v in known})
        if unknown:
            parser.error(f"unknown variants {unknown}; known: {[v.name for v in known]}")
        known = [v for v in known if v.name in wanted]

    env = environment_info(device)
    print_environment(env)
    with tempfile.TemporaryDirectory(prefix="p2r-bench-data-") as data_dir:
        quick_args: list[str] = []
        if args.quick:
            corpus = Path(data_dir) / "corpus.txt"
            corpus.write_text(QUICK_TEXT * 40, encoding="utf-8")
            quick_args = [*QUICK_OVERRIDES, f"--data.corpus={corpus}"]
        base_args = [
            "--config", str(args.config),
            f"--trainer.accelerator={device.type}",
            f"--trainer.max_steps={steps}",
            f"--trainer.val_check_interval={val_every}",
            f"--trainer.limit_val_batches={val_batches}",
            "--trainer.num_sanity_val_steps=0",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
            "--trainer.callbacks=[]",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            *quick_args,
            *cli_overrides,
        ]
        print("cli args (every variant): " + " ".join(base_args))
        results = []
        for variant in known:
            print(f"\n=== {variant.name} ===", flush=True)
            result = run_variant(variant, base_args, device)
            points = result["points"]
            print(f"{variant.name}: delink step {result['delink_step']}, final val loss {points[-1][3]:.4f} at step "
                  f"{points[-1][0]}, {result['step_clock'][-1]:.1f} training s", flush=True)
            results.append(result)

    rows = summarize(results)
    scratch = next((r for r in results if r["variant"].name == "scratch"), None)
    target = scratch["points"][-1][3] if scratch else None
    print(f"\n{steps} steps per run, validation every {val_every} steps on {val_batches} batches; target = scratch's "
          f"final val loss {'-' if target is None else f'{target:.4f}'}")
    print("s_per_step: mean over the stage's steps (step 0 left out; the delink step counts as real); load_1m: "
          "1-minute load average when the run started\n")
    print_table(rows, SUMMARY_COLUMNS)

    # The model config as the CLI resolved it (vocabulary linked from the data); memory_rows sets the sharing.
    memory = memory_rows(results[0]["config"])
    print("\ntraining state in fp32 (params 4 B + grads 4 B + AdamW 8 B per parameter)\n")
    print_table(memory, MEMORY_COLUMNS)
    totals = {row["model"]: row["total_bytes"] for row in memory if row["part"] == "total"}
    block_bytes = {row["model"]: row["total_bytes"] for row in memory if row["part"] == "blocks"}
    print(f"real / pseudo: {totals['real'] / totals['pseudo']:.2f}x in total, "
          f"{block_bytes['real'] / block_bytes['pseudo']:.2f}x in the blocks")

    curve_rows = []
    for result in results:
        variant = result["variant"]
        for step, train_s, wall_s, loss in result["points"]:
            curve_rows.append({"variant": variant.name, "delink_step": result["delink_step"],
                               "optimizer_state": variant.optimizer_state, "step": step, "train_seconds": train_s,
                               "wall_seconds": wall_s, "val_loss": loss})
    csv_path = write_csv(with_environment(curve_rows, env), args.out / "pseudo_to_real.csv")
    summary_path = write_csv(with_environment(rows, env), args.out / "pseudo_to_real_summary.csv")
    memory_path = write_csv(with_environment(memory, env), args.out / "pseudo_to_real_memory.csv")
    png_path = save_plot(
        args.out / "pseudo_to_real.png", results, target,
        title=(f"Pseudo-to-Real vs real from scratch: {steps} steps, same data order and LR schedule; val every "
               f"{val_every} steps on {val_batches} batches\n{env['device_name']} ({env['device']}, "
               f"{env['threads']} threads, load avg 1m {env['load_avg_1m']}), torch {env['torch']}"
               + (" -- QUICK: numbers mean nothing" if args.quick else "")),
    )
    print(f"\nwrote {csv_path}, {summary_path}, {memory_path} and {png_path}")
    return {"summary": rows, "memory": memory, "env": env, "target": target}


if __name__ == "__main__":
    main()
