"""Does Pseudo-to-Real pay off? Seeded arms at their best learning rate, paired against the real model from scratch.

    python -m lightning_p2r.benchmarks.pseudo_to_real [--quick] [--out DIR | --update-docs] [--jobs N]
        [--protocol sharing|growth|confirm] [--steps N] [--seeds N] [--first-seed S] [--lrs LR ...]
        [--no-ablations] [--no-timing] [--step-ratio R] [--config YAML] [recipe overrides]

``--protocol growth`` (issue 30) runs the same protocol over other arms, for twice the steps (800), into
``pseudo_to_real_growth*`` files and ``<out>/growth_runs``: ``scratch``; ``cycled`` (the sharing protocol's best);
``stack`` (a shallow model of L/4 blocks run as L/4 layers, grown to L by the cycle map at G_stack's point, 1/30 of
the run, ``p2r_protocol.GSTACK_GROWTH_FRACTION``); ``upcycle`` (the real depth, each MoE layer's experts sharing
one FFN until they are upcycled at 10%); ``stack_upcycle`` (both at G_stack's point). Their variants train at the
parent arm's best LR, 3 seeds, and are priced with its stage times: the growth point 3x earlier, 3x and 9x later,
identity-preserving growth (``growth_init: zero_outputs``), and the router re-initialized at upcycling.

``--protocol confirm`` (issue 41) runs the growth confirmation as committed in docs/pseudo_to_real.md before its
runs, into ``growth_confirm*`` files and ``<out>/confirm_runs``: the step timings first (they set the compute-matched
arm's length), then ``scratch``, ``scratch_matched`` (the real model for 0.3 r + 0.7 of the steps, r the shallow
stage's measured step-time ratio, its own schedule decayed at its last step), ``grow`` (L/4 layers grown 4x at 30%)
and ``drop_upcycle`` (experts sharing one FFN until 10%, then half of each expert's hidden units re-initialized),
swept from ``--first-seed``; the variant ``grow_rewarm`` (the LR warmed up again after growth); and the committed
decision per setting (``growth_confirm_verdict.csv``). The second size and the other corpus are recipe overrides,
e.g. ``--model.config.num_layers=24 --model.config.dim=96`` or ``--data.corpus=bible-multi --data.prepared=auto``.

The protocol (``p2r_protocol.py`` holds its pure parts):

1. **Arms** (``recipes/pseudo_to_real.yaml``'s model: 16 layers, pre-LN, MoE): ``scratch`` (real from step 0),
   ``p2r`` (one shared block, delinked at 10%), ``cycled`` (L/4 blocks cycled through the depth, L/2 at 5%, real
   at 10%) and ``pseudo_only``. ``p2r`` resumes from ``pseudo_only``'s checkpoint at the delink step (the shared
   stage is trained once per LR and seed). Every run uses a warmup-stable-decay schedule that decays to 0 at its
   last step, and less than one epoch of the corpus (no repeated data).
2. **LR sweep**: every arm at each ``--lrs`` value with seed 0; each arm's best LR is the one with the lowest final
   validation loss. 3. **Seeds**: seeds 1 .. ``--seeds``-1 at each arm's best LR. Seed s fixes init and data order
   for every arm, so differences are paired by seed. 4. **Ablations** (at ``p2r``'s best LR, every seed): the
   optimizer-state policies (copy, reset, per_layer), delink noise, LR re-warmup and the shared block's residual
   init, one lever at a time.
5. **Timing**: per memory setting, each arm's seconds per step in each of its stages, measured alone on the
   machine (the training runs above run ``--jobs`` at a time, so their clocks are not used): ``single`` (one
   process, nothing offloaded), ``zero3`` (2 ranks, ZeRO-3: the pseudo model gathers 1/L of the block bytes) and
   ``offload`` (one process, ``device_memory_budget`` that fits the pseudo model's states but only a quarter of
   the real blocks'). Time to a loss is then (steps in each stage) x (that stage's seconds per step) + the measured
   cost of each delinking, from the validation curves of step 2-3.

Output: ``pseudo_to_real.csv`` (validation curves: arm, lr, seed, step, val_loss, and the seconds under each
setting), ``pseudo_to_real_summary.csv`` (per arm and setting at the best LR), ``pseudo_to_real_sweep.csv``,
``pseudo_to_real_ablations.csv``, ``pseudo_to_real_timing.csv``, a PNG of the curves with seed bands, and tables.
Finished runs are kept under ``<out>/p2r_runs`` and reused when the command is run again with the same settings.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any
from unittest import mock

import lightning as L
import torch

from lightning_p2r.benchmarks.p2r_protocol import (
    GROWTH_RULE_FRACTION,
    Arm,
    Phase,
    Run,
    ablation_arms,
    best_lr,
    confirmation_arms,
    confirmation_verdict,
    first_crossing,
    growth_arms,
    loss_at,
    main_arms,
    matched_fraction,
    paired_difference,
    seconds_to,
    waves,
    wins_on_time,
)
from lightning_p2r.benchmarks.report import (
    base_parser,
    environment_info,
    print_environment,
    print_table,
    pyplot,
    save_figure,
    with_environment,
    write_csv,
)
from lightning_p2r.measure.run import worker_env

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "pseudo_to_real.yaml"
SETTINGS = ("single", "zero3", "offload")
TIMED_ARMS = ("scratch", "p2r", "cycled")
GROWTH_TIMED_ARMS = ("scratch", "cycled", "stack", "upcycle", "stack_upcycle", "grow", "drop_upcycle")
# --quick: a tiny model on a tiny byte-level corpus; the smoke test checks plumbing, the numbers mean nothing.
QUICK_OVERRIDES = ["--model.config.num_layers=4", "--model.config.dim=32", "--model.config.num_heads=2",
                   "--model.config.num_experts=2", "--model.config.sparse_window=8", "--model.optimizer.warmup_steps=2",
                   "--data.tokenizer=bytes", "--data.vocab_size=256", "--data.seq_len=16", "--data.batch_size=4"]
QUICK_TEXT = ("And the benchmark said, let there be a loss curve: and there was a loss curve, and it went down.\n"
              "The pseudo model shared one block among its layers, and afterwards every layer had its own.\n")
MOMENT_CHECK_STEPS = 20
MOMENT_WEIGHT = "attn.qkv.weight"


# ------------------------------------------------------------------------------------------- in the worker
class ValidationRecorder(L.Callback):
    """Training clock (wall time minus validation) at each step end, and (step, val loss) at each validation."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.validating_since: float | None = None
        self.validation_seconds = 0.0
        self.step_clock: list[float] = []
        self.points: list[tuple[int, float]] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        assert self.start is not None
        self.step_clock.append(time.perf_counter() - self.start - self.validation_seconds)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.validating_since = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or self.validating_since is None:
            return
        self.validation_seconds += time.perf_counter() - self.validating_since
        self.validating_since = None
        self.points.append((trainer.global_step, float(trainer.callback_metrics["val/loss"])))


class SaveAtSteps(L.Callback):
    """Save a full checkpoint when ``global_step`` reaches each key of ``paths`` (the trunk a branch resumes)."""

    def __init__(self, paths: dict[int, str]) -> None:
        self.paths = paths

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        path = self.paths.get(trainer.global_step)
        if path is not None and not Path(path).exists():
            trainer.save_checkpoint(path)


class SecondMomentCheck(L.Callback):
    """How well each copy's AdamW second moment at the last delinking matches the gradients it then gets.

    At the delink step it reads each layer's bias-corrected ``exp_avg_sq`` of ``attn.qkv.weight`` (mean over the
    tensor); over the next ``steps`` steps it averages the same tensor's squared gradient as the optimizer sees it
    (after clipping). The ratio is 1 when the carried moment is what the copy's own gradients give; "scale"'s rule
    assumes the layers' gradients are identical, so it is below 1 when they are not.
    """

    def __init__(self, delink_step: int, steps: int) -> None:
        self.delink_step, self.steps = delink_step, steps
        self.carried: list[float] = []
        self.squares: list[float] = []
        self.count = 0

    def _weights(self, pl_module: L.LightningModule) -> list[torch.Tensor]:
        from lightning_p2r.sharing import find_block_sequence

        holder = find_block_sequence(pl_module)
        return [holder.blocks[block].get_parameter(MOMENT_WEIGHT) for block in holder.layer_to_block]

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_step != self.delink_step or self.carried:
            return
        beta2 = trainer.optimizers[0].param_groups[0]["betas"][1]
        for weight in self._weights(pl_module):
            state = trainer.optimizers[0].state.get(weight, {})
            if "exp_avg_sq" not in state:
                self.carried.append(0.0)
                continue
            correction = 1.0 - beta2 ** float(state["step"])
            self.carried.append(float(state["exp_avg_sq"].mean()) / correction)
        self.squares = [0.0] * len(self.carried)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if not self.carried or self.count >= self.steps:
            return
        clip = trainer.gradient_clip_val
        coef = 1.0
        if clip:
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
            coef = min(1.0, clip / (norm + 1e-6))
        for index, weight in enumerate(self._weights(pl_module)):
            if weight.grad is not None:
                self.squares[index] += float((weight.grad * coef).square().mean())
        self.count += 1

    def ratio(self) -> float | None:
        """Geometric mean over layers of carried / observed (None before the check has run)."""
        if not self.count:
            return None
        ratios = [c / (s / self.count) for c, s in zip(self.carried, self.squares) if s > 0]
        if not ratios or min(ratios) <= 0:
            return 0.0 if ratios else None
        return math.exp(statistics.fmean(math.log(r) for r in ratios))


def build_cli(cli_args: list[str]) -> Any:
    """The project's LightningCLI over the recipe, instantiated but not run."""
    from lightning_p2r.cli import P2RCLI
    from lightning_p2r.data import TextDataModule
    from lightning_p2r.module import M6LanguageModel

    with mock.patch.object(sys, "argv", sys.argv[:1]):  # our own flags are not LightningCLI's
        return P2RCLI(M6LanguageModel, TextDataModule, args=cli_args, run=False, save_config_callback=None)


def _worker(spec: dict[str, Any]) -> None:
    """One run, in its own process (and, for 2 ranks, the process Lightning launches for rank 1)."""
    from lightning_p2r import PseudoToReal

    torch.set_num_threads(spec["threads"])
    cli = build_cli(spec["args"])
    num_layers = cli.model.config.num_layers
    recorder = ValidationRecorder()
    callbacks: list[L.Callback] = []
    schedule = {int(step): blocks or num_layers for step, blocks in spec["schedule"].items()}
    moment_check = None
    if schedule:
        arm = spec["arm"]
        callbacks.append(PseudoToReal(schedule=schedule, optimizer_state=arm["optimizer_state"],
                                      delink_noise=arm["delink_noise"], rewarm_steps=arm["rewarm_steps"]))
        if spec["moment_check"]:
            moment_check = SecondMomentCheck(max(schedule), MOMENT_CHECK_STEPS)
            callbacks.append(moment_check)
    if spec["save_at"]:
        callbacks.append(SaveAtSteps({int(step): path for step, path in spec["save_at"].items()}))
    cli.trainer.callbacks.extend([*callbacks, recorder])
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=spec["resume"])
    if cli.trainer.global_rank:
        return
    plan = getattr(cli.trainer.strategy, "plan", None)
    result = {"points": recorder.points, "step_clock": recorder.step_clock, "delinks": sorted(schedule),
              "moment_ratio": moment_check.ratio() if moment_check else None,
              "offloaded_blocks": len(plan.offloaded) if plan is not None else 0}
    Path(spec["result"]).write_text(json.dumps(result), encoding="utf-8")


# ------------------------------------------------------------------------------------------- in the parent
def launch_run(spec: dict[str, Any], timeout: int = 7200) -> dict[str, Any]:
    """Run ``spec`` in a fresh process; the result JSON it wrote."""
    env = worker_env(spec["threads"])
    command = [sys.executable, "-m", "lightning_p2r.benchmarks.pseudo_to_real", "--worker", json.dumps(spec)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    path = Path(spec["result"])
    if result.returncode or not path.exists():
        raise RuntimeError(f"run {spec['name']} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(path.read_text(encoding="utf-8"))


def epoch_batches(loader: Any) -> int | None:
    """Batches in one epoch of ``loader``; None for a stream that has no fixed length (a language mixture sampled
    with replacement of its weights: it draws fresh windows for as long as asked)."""
    try:
        return len(loader)
    except TypeError:
        return None


def settings_key(base_args: Sequence[str], steps: int) -> str:
    """A short hash of a run's settings, with the temporary folder they mention replaced by a placeholder."""
    root = next((a.split("=", 1)[1] for a in base_args if a.startswith("--trainer.default_root_dir=")), None)
    stable = [a.replace(root, "<tmp>") if root else a for a in base_args]
    return hashlib.sha256(json.dumps([stable, steps]).encode()).hexdigest()[:10]


class Runner:
    """Trains runs ``jobs`` at a time in subprocesses, keeping each finished result under ``folder``."""

    def __init__(self, folder: Path, base_args: list[str], steps: int, jobs: int, arms: dict[str, Arm],
                 timeout: int, val_every: int = 1) -> None:
        self.folder, self.base_args, self.steps, self.jobs, self.arms = folder, base_args, steps, jobs, arms
        self.timeout, self.val_every = timeout, val_every
        folder.mkdir(parents=True, exist_ok=True)
        # Results are reused only under the same settings: the hash covers every argument a run gets, except the
        # per-invocation temporary folder (the root dir, and the --quick corpus inside it).
        self.key = settings_key(base_args, steps)

    def own_steps(self, arm: Arm) -> int:
        return arm.own_steps(self.steps, self.val_every)

    def _paths(self, run: Run) -> tuple[Path, Path]:
        own = self.own_steps(run.arm)
        # names hold dots (lr0.002): no with_suffix; an arm of its own length says it (it depends on a timing)
        stem = f"{run.name}{'' if own == self.steps else f'_n{own}'}_{self.key}"
        return self.folder / f"{stem}.json", self.folder / f"{stem}.ckpt"

    def _spec(self, run: Run, save_at: dict[int, str]) -> dict[str, Any]:
        arm = run.arm
        delinks = arm.delink_steps(self.steps)
        args = [*self.base_args, f"--seed_everything={run.seed}", f"--data.seed={run.seed}",
                f"--model.optimizer.lr={run.lr}", *arm.cli_args()]
        if self.own_steps(arm) != self.steps:  # the last value of an option wins: its schedule ends there too
            args.append(f"--trainer.max_steps={self.own_steps(arm)}")
        trunk = None if arm.trunk is None else Run(self.arms[arm.trunk], run.lr, run.seed)
        # The moment check compares layers that shared a block; a grown or upcycled model has no such pairing.
        moment_check = bool(delinks) and arm.pseudo_depth == "shared" and arm.unique_experts is None
        return {"name": run.name, "args": args, "threads": 1, "arm": asdict(arm), "schedule": delinks,
                "save_at": save_at, "moment_check": moment_check,
                "resume": str(self._paths(trunk)[1]) if trunk else None, "result": str(self._paths(run)[0])}

    def result(self, run: Run) -> dict[str, Any]:
        """The run's validation curve, the trunk's points before the branch included."""
        data = json.loads(self._paths(run)[0].read_text(encoding="utf-8"))
        if run.arm.trunk is not None:
            branch = min(run.arm.delink_steps(self.steps))
            trunk = self.result(Run(self.arms[run.arm.trunk], run.lr, run.seed))
            data["points"] = ([p for p in trunk["points"] if p[0] <= branch]
                              + [p for p in data["points"] if p[0] > branch])
        return data

    def run_all(self, runs: Sequence[Run]) -> None:
        branches: dict[str, set[int]] = {}
        for run in runs:
            if run.arm.trunk is not None:
                trunk = Run(self.arms[run.arm.trunk], run.lr, run.seed)
                branches.setdefault(trunk.name, set()).add(min(run.arm.delink_steps(self.steps)))
        for wave in waves(runs, self.arms):
            specs = []
            for run in wave:
                result_path, ckpt_path = self._paths(run)
                needs_ckpt = run.name in branches and not ckpt_path.exists()
                if result_path.exists() and not needs_ckpt:
                    continue
                save_at = {step: str(ckpt_path) for step in branches.get(run.name, ())}
                if len(save_at) > 1:
                    raise ValueError(f"{run.name}: branches at several steps are not supported")
                specs.append(self._spec(run, save_at))
            with ThreadPoolExecutor(max_workers=self.jobs) as pool:
                list(pool.map(self._one, specs))  # list(): re-raise a failed run here

    def _one(self, spec: dict[str, Any]) -> None:
        began = time.perf_counter()
        data = launch_run(spec, self.timeout)
        final = data["points"][-1] if data["points"] else None
        print(f"  {spec['name']}: final val loss {final[1] if final else float('nan'):.4f}, "
              f"{time.perf_counter() - began:.0f} s", flush=True)


def sizes(config: Any) -> dict[str, int]:
    """fp32 training-state bytes (param 4 + grad 4 + AdamW 8 per parameter) of the pseudo and the real model."""
    from lightning_p2r.models import M6Transformer

    out = {}
    for label, blocks in (("pseudo", 1), ("real", None)):
        with torch.device("meta"):
            model = M6Transformer(config.replace(num_unique_blocks=blocks))
        total = sum(p.numel() for p in model.parameters())
        in_blocks = sum(p.numel() for p in model.blocks.parameters())
        out[f"{label}_total"], out[f"{label}_blocks"] = total * 16, in_blocks * 16
    return out


def timing_specs(arms: dict[str, Arm], timed: Sequence[str], base_args: list[str], folder: Path, phase_steps: int,
                 budget: int, threads: int) -> list[dict[str, Any]]:
    """One timing run per (memory setting, arm): each stage of the arm gets ``phase_steps`` steps."""
    specs = []
    for setting in SETTINGS:
        extra = {"single": [],
                 "zero3": ["--trainer.devices=2", "--trainer.strategy=lightning_p2r.P2RStrategy",
                           "--trainer.strategy.sharding=zero3"],
                 "offload": ["--trainer.strategy=lightning_p2r.P2RStrategy",
                             f"--trainer.strategy.device_memory_budget={budget}"]}[setting]
        for name in timed:
            arm = arms[name]
            stages = len(arm.schedule) + 1
            schedule = {phase_steps * (i + 1): blocks for i, (_, blocks) in enumerate(arm.schedule)}
            args = [*base_args, f"--trainer.max_steps={phase_steps * stages}", "--trainer.limit_val_batches=0",
                    *arm.cli_args(), *extra]
            if setting == "zero3":
                args.append(f"--data.batch_size={_batch_size(base_args) // 2}")  # same tokens per optimizer step
            specs.append({"name": f"timing_{setting}_{name}", "setting": setting, "arm": asdict(arm),
                          "args": args, "threads": 1 if setting == "zero3" else threads, "schedule": schedule,
                          "save_at": {}, "moment_check": False, "resume": None,
                          "result": str(folder / f"timing_{setting}_{name}.json")})
    return specs


def _batch_size(args: Sequence[str]) -> int:
    value = 16
    for arg in args:
        if arg.startswith("--data.batch_size="):
            value = int(arg.split("=", 1)[1])
    return value


def phase_times(clock: Sequence[float], boundaries: Sequence[int], skip: int = 2) -> tuple[list[float], float]:
    """Mean seconds per step of each stage (its first ``skip`` steps left out: allocation, re-planning) and the mean
    extra cost of a delink step over the stage it starts."""
    steps = [clock[0]] + [clock[i] - clock[i - 1] for i in range(1, len(clock))]
    edges = [0, *boundaries, len(steps)]
    means = []
    for start, stop in zip(edges, edges[1:]):
        window = steps[start + skip:stop] or steps[start:stop]
        means.append(statistics.fmean(window))
    extra = [steps[b] - means[i + 1] for i, b in enumerate(boundaries) if b < len(steps)]
    return means, statistics.fmean(extra) if extra else 0.0


# ------------------------------------------------------------------------------------------------- analysis
def final_loss(result: dict[str, Any]) -> float:
    return result["points"][-1][1] if result["points"] else math.nan


def analyse(runner: Runner, arms: dict[str, Arm], main: list[str], lrs: Sequence[float], seeds: Sequence[int],
            timing: dict[str, dict[str, Any]], ablations: list[str]) -> dict[str, Any]:
    """``seeds``: the sweep ran on the first, the arms' best LRs on all of them."""
    steps = runner.steps
    sweep_rows, best = [], {}
    for name in main:
        finals = {lr: [final_loss(runner.result(Run(arms[name], lr, seeds[0])))] for lr in lrs}
        best[name] = best_lr(finals)
        sweep_rows += [{"arm": name, "lr": lr, "seed": seeds[0], "final_val_loss": finals[lr][0],
                        "best": lr == best[name]} for lr in lrs]
    results = {name: {s: runner.result(Run(arms[name], best[name], s)) for s in seeds} for name in main}
    for name in ablations:  # variants: at their parent's best LR
        best[name] = best[arms[name].parent]
        results[name] = {s: runner.result(Run(arms[name], best[name], s)) for s in seeds}
    finals = {name: {s: final_loss(r) for s, r in per_seed.items()} for name, per_seed in results.items()}
    scratch = finals["scratch"]
    summary, ablation_rows, time_rows = [], [], []
    for name in [*main, *ablations]:
        arm = arms[name]
        diff = paired_difference(finals[name], scratch)
        crossings = {s: first_crossing([p[0] for p in r["points"]], [p[1] for p in r["points"]], scratch[s])
                     for s, r in results[name].items()}
        reached = [c for c in crossings.values() if c is not None]
        # The other way round: where scratch's curve (same seed) reaches this arm's final loss.
        scratch_reaches = [first_crossing([p[0] for p in results["scratch"][s]["points"]],
                                          [p[1] for p in results["scratch"][s]["points"]], finals[name][s])
                           for s in results[name] if s in results["scratch"]]
        step_ratio = statistics.fmean(c / steps for c in reached) if len(reached) == len(crossings) else math.nan
        tau = min(arm.delink_steps(steps)) / steps if arm.schedule else (1.0 if arm.blocks is not None else 0.0)
        row = {"arm": name, "lr": best[name], "seeds": len(finals[name]),
               "final_mean": statistics.fmean(finals[name].values()),
               "final_sd": statistics.stdev(finals[name].values()) if len(finals[name]) > 1 else math.nan,
               "diff_vs_scratch": diff.mean, "diff_se": diff.se, "lower_by_2se": diff.significant,
               "steps_to_scratch_final": step_ratio, "tau": tau,
               "moment_ratio": _mean_or_nan([r.get("moment_ratio") for r in results[name].values()])}
        if name in ablations:
            vs = paired_difference(finals[name], finals[arm.parent])
            ablation_rows.append(row | {"note": arm.note, "parent": arm.parent, "diff_vs_parent": vs.mean,
                                        "diff_vs_parent_se": vs.se})
        else:
            summary.append(row)
        for setting, measured in timing.items():
            if _priced_as(arm) in measured:
                time_rows.append(_time_row(row, arm, measured, setting, reached, len(crossings), step_ratio, steps)
                                 | {"time_ratio_at_own_final": _own_final_ratio(arm, measured, scratch_reaches,
                                                                                steps)})
    return {"best": best, "results": results, "sweep": sweep_rows, "summary": summary, "ablations": ablation_rows,
            "time": time_rows}


def confirmation_rows(analysis: dict[str, Any], timing: dict[str, dict[str, Any]], arms: dict[str, Arm],
                      steps: int) -> list[dict[str, Any]]:
    """The confirmation's verdict in each timed setting: scratch's loss read off its own curve at the step it
    reaches in the seconds the grown run took (that setting's measured step times), paired by seed."""
    results = analysis["results"]
    if not {"grow", "scratch", "scratch_matched"} <= set(results):
        return []
    finals = {name: {s: final_loss(r) for s, r in results[name].items()} for name in ("grow", "scratch_matched")}
    rows = []
    for setting, measured in timing.items():
        if not {"grow", "scratch"} <= set(measured):
            continue
        grow_seconds = clock(arms["grow"], steps, measured["grow"])(steps)
        scratch_step = grow_seconds / measured["scratch"]["phases"][0]
        at_time = {s: loss_at([p[0] for p in r["points"]], [p[1] for p in r["points"]], scratch_step)
                   for s, r in results["scratch"].items()}
        time_ratio = next((row["time_ratio"] for row in analysis["time"]
                           if row["arm"] == "grow" and row["setting"] == setting), math.nan)
        rows.append({"setting": setting, "grow_seconds": grow_seconds, "scratch_step_at_that_time": scratch_step}
                    | confirmation_verdict(finals["grow"], at_time, finals["scratch_matched"], time_ratio))
    return rows


def _priced_as(arm: Arm) -> str:
    """The arm whose measured stage times price this one: a variant's stages have its parent's shapes, and the real
    model of another length (the compute-matched scratch) is scratch's shape."""
    if arm.parent:
        return arm.parent
    return "scratch" if arm.steps_fraction != 1.0 and arm.blocks is None and not arm.schedule else arm.name


def clock(arm: Arm, steps: int, times: dict[str, Any]) -> Callable[[float], float]:
    """Training seconds to reach a (fractional) step of ``arm``, from one setting's measured stage times."""
    starts = [0, *sorted(arm.delink_steps(steps))]
    timeline = [Phase(start, seconds) for start, seconds in zip(starts, times["phases"])]
    return lambda step: seconds_to(step, timeline, times["delink_s"])


def _time_row(row: dict[str, Any], arm: Arm, measured: dict[str, Any], setting: str, reached: list[float],
              seeds: int, step_ratio: float, steps: int) -> dict[str, Any]:
    """Seconds to scratch's final loss under one memory setting, from the measured seconds per step of each stage."""
    times = measured[_priced_as(arm)]
    phases, delink_s = times["phases"], times["delink_s"]
    seconds_at = clock(arm, steps, times)
    real_s = measured["scratch"]["phases"][0] if "scratch" in measured else phases[-1]
    scratch_time = steps * real_s
    all_reached = len(reached) == seeds
    seconds = statistics.fmean(seconds_at(c) for c in reached) if all_reached else math.inf
    r = phases[0] / real_s
    delta = step_ratio - 1.0 if math.isfinite(step_ratio) else math.inf
    return {"arm": arm.name, "setting": setting, "s_per_step_first_stage": phases[0], "s_per_step_real": phases[-1],
            "delink_s": delink_s, "r": r, "tau": row["tau"], "delta": delta,
            "criterion_wins": wins_on_time(delta, row["tau"], r) if arm.schedule else "-",
            "time_to_scratch_final_s": seconds, "scratch_time_s": scratch_time,
            "time_ratio": seconds / scratch_time if scratch_time else math.nan}


def _own_final_ratio(arm: Arm, measured: dict[str, Any], scratch_reaches: list[float | None], steps: int) -> float:
    """The arm's seconds for its whole run over the seconds scratch takes to reach the arm's final loss (mean over
    seeds; below 1: the arm gets to its own final loss sooner than scratch gets there). NaN if scratch never does."""
    if "scratch" not in measured or not scratch_reaches or any(c is None for c in scratch_reaches):
        return math.nan
    own_seconds = clock(arm, steps, measured[_priced_as(arm)])(steps)
    real_s = measured["scratch"]["phases"][0]
    return statistics.fmean(own_seconds / (c * real_s) if c else math.inf for c in scratch_reaches)


def _mean_or_nan(values: Sequence[float | None]) -> float:
    kept = [v for v in values if v is not None]
    return statistics.fmean(kept) if kept else math.nan


def curve_rows(analysis: dict[str, Any], timing: dict[str, dict[str, Any]], arms: dict[str, Arm],
               steps: int) -> list[dict[str, Any]]:
    rows = []
    for name, per_seed in analysis["results"].items():
        clocks = {setting: clock(arms[name], steps, measured[_priced_as(arms[name])])
                  for setting, measured in timing.items() if _priced_as(arms[name]) in measured}
        for seed, result in per_seed.items():
            for step, loss in result["points"]:
                row = {"arm": name, "lr": analysis["best"][name], "seed": seed, "step": step, "val_loss": loss}
                row |= {f"seconds_{setting}": seconds_at(step) for setting, seconds_at in clocks.items()}
                rows.append(row)
    return rows


def save_plot(path: Path, analysis: dict[str, Any], names: Sequence[str], timing: dict[str, dict[str, Any]],
              arms: dict[str, Arm], steps: int, title: str) -> Path:
    plt = pyplot()
    panels = ["steps", *[s for s in ("zero3", "offload") if s in timing]]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5), dpi=110, sharey=True, squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for i, name in enumerate(names):
            per_seed = analysis["results"][name]
            curves = [r["points"] for r in per_seed.values()]
            xs = [p[0] for p in curves[0]]
            if any([p[0] for p in c] != xs for c in curves):
                continue
            if panel != "steps":
                if _priced_as(arms[name]) not in timing[panel]:
                    continue
                seconds_at = clock(arms[name], steps, timing[panel][_priced_as(arms[name])])
                xs = [seconds_at(x) for x in xs]
            losses = list(zip(*[[p[1] for p in c] for c in curves]))
            mean = [statistics.fmean(v) for v in losses]
            ax.plot(xs, mean, color=f"C{i % 10}", linestyle="-" if i < 10 else "--",
                    label=f"{name} (lr {analysis['best'][name]:g}, {len(curves)} seeds)")
            ax.fill_between(xs, [min(v) for v in losses], [max(v) for v in losses], color=f"C{i % 10}", alpha=0.2)
        ax.set_xlabel("optimizer step" if panel == "steps" else f"seconds ({panel}, from measured step times)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation loss (mean; band: min-max over seeds)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)


SUMMARY_COLUMNS = ["arm", "lr", "seeds", "final_mean", "final_sd", "diff_vs_scratch", "diff_se", "lower_by_2se",
                   "steps_to_scratch_final", "tau", "moment_ratio"]
TIME_COLUMNS = ["arm", "setting", "s_per_step_first_stage", "s_per_step_real", "delink_s", "r", "tau", "delta",
                "criterion_wins", "time_to_scratch_final_s", "scratch_time_s", "time_ratio", "time_ratio_at_own_final"]
VERDICT_COLUMNS = ["setting", "grow_seconds", "scratch_step_at_that_time", "diff_at_equal_time",
                   "diff_at_equal_time_se", "lower_by_2se", "time_ratio", "sooner", "diff_vs_matched",
                   "diff_vs_matched_se", "not_worse_than_matched", "confirmed"]
ABLATION_COLUMNS = ["arm", "parent", "lr", "seeds", "final_mean", "final_sd", "diff_vs_parent", "diff_vs_parent_se",
                    "diff_vs_scratch", "diff_se", "steps_to_scratch_final", "moment_ratio", "note"]
TIMING_COLUMNS = ["setting", "arm", "stage", "blocks", "s_per_step", "delink_s", "offloaded_blocks_at_end"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--config", type=Path, default=RECIPE, help="recipe YAML (default: pseudo_to_real.yaml)")
    parser.add_argument("--protocol", choices=("sharing", "growth", "confirm"), default="sharing",
                        help="sharing: issue 14's arms and ablations; growth: issue 30's shallow stage grown by "
                             "stacking and experts upcycled; confirm: issue 41's growth confirmation, its rule and "
                             "arms as committed in docs/pseudo_to_real.md (default %(default)s)")
    parser.add_argument("--steps", type=int, help="optimizer steps of every run (default 400, or 800 for the growth "
                                                  "protocol; 40 and 80 with --quick)")
    parser.add_argument("--seeds", type=int, help="seeds per arm at its best LR (default 3, 2 with --quick)")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="the LR sweep's seed; the others follow it (default 0; the confirmation uses 3)")
    parser.add_argument("--step-ratio", type=float,
                        help="confirm: the shallow stage's seconds per step over the real model's, instead of the "
                             "single-process timing (sets the compute-matched scratch's length)")
    parser.add_argument("--lrs", type=float, nargs="+", help="the LR sweep (default 0.002 0.004 0.008)")
    parser.add_argument("--jobs", type=int, default=2, help="training runs at a time, 1 thread each (default 2)")
    parser.add_argument("--val-every", type=int, help="steps between validations (default 25, 10 with --quick)")
    parser.add_argument("--val-batches", type=int, help="validation batches (default 12, 2 with --quick)")
    parser.add_argument("--timing-steps", type=int, help="steps per stage in the timing runs (default 40)")
    parser.add_argument("--arms", nargs="+", help="only these main arms (scratch always), e.g. a compute-matched "
                                                  "scratch baseline: --arms scratch --steps N")
    parser.add_argument("--no-ablations", action="store_true", help="skip the one-lever-at-a-time runs")
    parser.add_argument("--variants", nargs="+", help="only these one-lever variants (default: every variant of the "
                                                      "arms run), e.g. --arms upcycle --variants drop_upcycle")
    parser.add_argument("--no-timing", action="store_true", help="skip the per-setting step timings")
    parser.add_argument("--reuse-timing", action="store_true",
                        help="read the step timings kept by an earlier run of the same settings")
    parser.add_argument("--timeout", type=int, default=7200, help="seconds one run may take (default %(default)s)")
    args, cli_overrides = parser.parse_known_args(argv)
    if args.worker:
        _worker(json.loads(args.worker))
        return {}
    quick = args.quick
    growth = args.protocol in ("growth", "confirm")
    confirm = args.protocol == "confirm"
    steps = args.steps or (40 if quick else 400) * (2 if growth else 1)
    seeds = args.seeds or (2 if quick else 3)
    lrs = args.lrs or ([0.002, 0.008] if quick else [0.002, 0.004, 0.008])
    val_every = args.val_every or (10 if quick else 25)
    val_batches = args.val_batches or (2 if quick else 12)
    phase_steps = args.timing_steps or (4 if quick else 40)
    if steps % val_every:
        parser.error(f"--steps ({steps}) must be a multiple of --val-every ({val_every}): the last step is measured")
    env = environment_info("cpu")
    print_environment(env)
    out: Path = args.out
    with tempfile.TemporaryDirectory(prefix="p2r-bench-") as scratch_dir:
        extra: list[str] = []
        if quick:
            corpus = Path(scratch_dir) / "corpus.txt"
            corpus.write_text(QUICK_TEXT * 40, encoding="utf-8")
            extra = [*QUICK_OVERRIDES, f"--data.corpus={corpus}"]
        common = ["--config", str(args.config), "--trainer.accelerator=cpu", "--trainer.devices=1",
                  "--trainer.num_sanity_val_steps=0", "--trainer.logger=false",
                  "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]",
                  "--trainer.enable_progress_bar=false",
                  "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={scratch_dir}",
                  "--model.optimizer.schedule=wsd", "--model.optimizer.min_lr_ratio=0.0", *extra, *cli_overrides]
        train_args = [*common, f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={val_every}",
                      f"--trainer.limit_val_batches={val_batches}"]
        probe = build_cli([*common, "--trainer.max_steps=1"])
        config = probe.model.config
        probe.datamodule.setup("fit")
        batches = epoch_batches(probe.datamodule.train_dataloader())
        if batches is not None and steps > batches:
            parser.error(f"--steps={steps} is more than one epoch ({batches} batches): the protocol never repeats data")
        warmup = probe.model.optimizer_config.warmup_steps
        if confirm:  # the compute-matched length is set once the step times are known (below)
            every = confirmation_arms(config.num_layers, warmup, matched=1.0)
            arms = {arm.name: arm for arm in every if arm.parent is None}
            ablations = [] if args.no_ablations else [arm for arm in every if arm.parent is not None]
        elif growth:
            every = growth_arms(config.num_layers)
            arms = {arm.name: arm for arm in every if arm.parent is None}
            ablations = [] if args.no_ablations else [arm for arm in every if arm.parent is not None]
        else:
            arms = {arm.name: arm for arm in main_arms(config.num_layers)}
            ablations = [] if args.no_ablations else ablation_arms(arms["p2r"], rewarm_steps=max(2, steps // 20),
                                                                      noise=0.02)
        if args.arms:
            unknown = sorted(set(args.arms) - set(arms))
            if unknown:
                parser.error(f"--arms: unknown {unknown}; the main arms are {sorted(arms)}")
            arms = {name: arm for name, arm in arms.items() if name == "scratch" or name in args.arms}
            ablations = [arm for arm in ablations if arm.parent in arms]
        if args.variants:
            unknown = sorted(set(args.variants) - {arm.name for arm in ablations})
            if unknown:
                parser.error(f"--variants: unknown {unknown}; the variants of these arms are "
                             f"{sorted(arm.name for arm in ablations)}")
            ablations = [arm for arm in ablations if arm.name in args.variants]
        main_names = list(arms)
        first = "grow" if confirm else "stack" if growth else "p2r"
        if first in arms and warmup >= min(arms[first].delink_steps(steps)):
            parser.error(f"warmup ({warmup} steps) must end before {first}'s first delinking "
                         f"(step {min(arms[first].delink_steps(steps))}): run more --steps")
        arms.update({arm.name: arm for arm in ablations})
        runner = Runner(out / (f"{args.protocol}_runs" if confirm else "growth_runs" if growth else "p2r_runs"),
                        train_args, steps, args.jobs, arms, args.timeout, val_every)
        epoch = batches if batches is not None else "not fixed: a streamed mixture"
        print(f"{steps} steps per run (one epoch is {epoch}), {config.num_layers} layers, dim {config.dim}; "
              f"runs kept in {runner.folder} (key {runner.key})")

        timing: dict[str, dict[str, Any]] = {}
        timing_rows: list[dict[str, Any]] = []

        def measure_timing() -> None:
            size = sizes(config)
            budget = size["pseudo_total"] + (size["real_blocks"] - size["pseudo_blocks"]) // 4
            threads = os.cpu_count() or 1
            print(f"\n== timing: {phase_steps} steps per stage, offload budget {budget / 2**20:.2f} MiB (pseudo "
                  f"{size['pseudo_total'] / 2**20:.2f} MiB, real {size['real_total'] / 2**20:.2f} MiB) ==", flush=True)
            timed = [name for name in (GROWTH_TIMED_ARMS if growth else TIMED_ARMS) if name in arms]
            # Kept beside the runs, under the runs' settings key: --reuse-timing reads them instead of measuring.
            timing_folder = runner.folder / f"timing_{runner.key}"
            timing_folder.mkdir(exist_ok=True)
            for spec in timing_specs(arms, timed, common, timing_folder, phase_steps, budget, threads):
                reused = args.reuse_timing and Path(spec["result"]).exists()
                data = json.loads(Path(spec["result"]).read_text(encoding="utf-8")) if reused else launch_run(
                    spec, args.timeout)
                phases, delink_s = phase_times(data["step_clock"], sorted(int(s) for s in spec["schedule"]))
                timing.setdefault(spec["setting"], {})[spec["arm"]["name"]] = {"phases": phases, "delink_s": delink_s}
                blocks = [spec["arm"]["blocks"] or config.num_layers,
                          *[b or config.num_layers for b in spec["schedule"].values()]]
                for stage, (count, seconds) in enumerate(zip(blocks, phases)):
                    timing_rows.append({"setting": spec["setting"], "arm": spec["arm"]["name"], "stage": stage,
                                        "blocks": count, "s_per_step": seconds, "delink_s": delink_s if stage else 0.0,
                                        "offloaded_blocks_at_end": data["offloaded_blocks"]})
                print(f"  {spec['name']}: " + ", ".join(f"{s:.3f}" for s in phases) + " s/step", flush=True)

        if confirm:  # the step times come first: they set the compute-matched scratch's length
            if args.step_ratio is None:
                if args.no_timing:
                    parser.error("--protocol confirm needs the step timings or --step-ratio")
                measure_timing()
            ratio = args.step_ratio or timing["single"]["grow"]["phases"][0] / timing["single"]["scratch"]["phases"][0]
            arms["scratch_matched"] = replace(arms["scratch_matched"],
                                              steps_fraction=matched_fraction(GROWTH_RULE_FRACTION, ratio))
            print(f"shallow stage at {ratio:.3f} of a real step: scratch_matched trains "
                  f"{runner.own_steps(arms['scratch_matched'])} of {steps} steps", flush=True)
        seed_list = list(range(args.first_seed, args.first_seed + seeds))
        print(f"\n== LR sweep (seed {seed_list[0]}) ==", flush=True)
        runner.run_all([Run(arms[name], lr, seed_list[0]) for name in main_names for lr in lrs])
        best = {name: best_lr({lr: [final_loss(runner.result(Run(arms[name], lr, seed_list[0])))] for lr in lrs})
                for name in main_names}
        print("best LR per arm: " + ", ".join(f"{k} {v:g}" for k, v in best.items()))
        print(f"\n== seeds {seed_list[1:]} at each arm's best LR ==", flush=True)
        runner.run_all([Run(arms[name], best[name], s) for name in main_names for s in seed_list[1:]])
        if ablations:
            print(f"\n== variants at their parent arm's best LR, seeds {seed_list} ==", flush=True)
            runner.run_all([Run(arm, best[arm.parent], s) for arm in ablations for s in seed_list])
        if not args.no_timing and not timing:
            measure_timing()

    for measured in timing.values():
        # Every arm's last stage is the real model, the model scratch times for the whole run: one measurement of
        # it per setting (the longest) keeps the timing noise of short stages out of r and the times.
        if "scratch" in measured:
            for name, times in measured.items():
                if arms[name].schedule:
                    times["phases"][-1] = measured["scratch"]["phases"][0]
    analysis = analyse(runner, arms, main_names, lrs, seed_list, timing, [a.name for a in ablations])
    print(f"\nLR sweep (seed {seed_list[0]}, final validation loss)\n")
    print_table(analysis["sweep"], ["arm", "lr", "final_val_loss", "best"])
    print(f"\nat each arm's best LR, {seeds} seeds, paired against scratch (diff < 0: lower than scratch)\n")
    print_table(analysis["summary"], SUMMARY_COLUMNS)
    print("steps_to_scratch_final: mean over seeds of (first step at or below that seed's scratch final loss) / "
          "steps; '-' if some seed never gets there. moment_ratio: qkv exp_avg_sq carried at the (last) delinking "
          f"/ mean squared gradient over the next {MOMENT_CHECK_STEPS} steps, geometric mean over layers")
    if analysis["time"]:
        print("\ntime to scratch's final loss per memory setting, from each stage's measured seconds per step; "
              "criterion: delta < tau (1 - r); time_ratio_at_own_final: the arm's whole run over the time scratch "
              "takes to reach the arm's final loss (below 1: the arm is faster to its own loss)\n")
        print_table(analysis["time"], TIME_COLUMNS)
    if analysis["ablations"]:
        print("\nvariants, each at its parent arm's best LR: one lever each on top of the parent\n")
        print_table(analysis["ablations"], ABLATION_COLUMNS)
    if timing_rows:
        print("\nseconds per step by stage (measured alone; step 0-1 of each stage left out); the analysis prices "
              "every arm's real stage at scratch's figure of the same setting\n")
        print_table(timing_rows, TIMING_COLUMNS)
    stem = "growth_confirm" if confirm else "pseudo_to_real_growth" if growth else "pseudo_to_real"
    verdicts = confirmation_rows(analysis, timing, arms, steps) if confirm else []
    if verdicts:
        print(f"\nthe committed decision, per setting (grow at {GROWTH_RULE_FRACTION:.0%}, seeds {seed_list}): "
              "confirmed = lower than scratch at equal time by > 2 SE, and sooner to scratch's final loss, and not "
              "worse than scratch_matched\n")
        print_table(verdicts, VERDICT_COLUMNS)
    written = [
        write_csv(with_environment(curve_rows(analysis, timing, arms, steps), env), out / f"{stem}.csv"),
        write_csv(with_environment(analysis["summary"], env), out / f"{stem}_summary.csv"),
        write_csv(with_environment(analysis["sweep"], env), out / f"{stem}_sweep.csv"),
    ]
    if analysis["ablations"]:
        written.append(write_csv(with_environment(analysis["ablations"], env), out / f"{stem}_ablations.csv"))
    if verdicts:
        written.append(write_csv(with_environment(verdicts, env), out / f"{stem}_verdict.csv"))
    if timing_rows:
        written.append(write_csv(with_environment(timing_rows, env), out / f"{stem}_timing.csv"))
        written.append(write_csv(with_environment(analysis["time"], env), out / f"{stem}_time.csv"))
    written.append(save_plot(
        # The growth variants are points along one axis (when to grow, how): drawn with the main arms.
        out / f"{stem}.png", analysis, [*main_names, *(a.name for a in ablations)] if growth else main_names, timing,
        arms, steps,
        title=(f"{'Growth' if growth else 'Pseudo-to-Real'} vs scratch: {config.num_layers} layers, dim {config.dim}, "
               f"{steps} steps (WSD), each arm at its best LR, {seeds} seeds\n"
               f"{env['device_name']}, torch {env['torch']}"
               + (" -- QUICK: numbers mean nothing" if quick else ""))))
    print("\nwrote " + ", ".join(str(p) for p in written))
    return analysis | {"timing": timing, "env": env}


if __name__ == "__main__":
    main()
