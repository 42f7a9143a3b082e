"""The Pseudo-to-Real benchmark's protocol as pure functions: which runs, which LR wins, and what the seeds say.

Kept apart from the runner (``pseudo_to_real.py``) so the statistics a reader trusts are unit-tested on numbers
made up for the test, not on a training run.

- An :class:`Arm` is a training recipe: the sharing it starts with, when it delinks, and how.
- A :class:`Run` is an arm at one learning rate and one seed. Seed ``s`` fixes the model init and the data order,
  and is the same for every arm, so differences between arms are *paired* by seed.
- An arm with a ``trunk`` starts from the trunk arm's checkpoint at its first delink step (same seed and LR): the
  shared stage is trained once, and a resumed run is bit-identical to an uninterrupted one (tested in
  ``tests/unit/test_pseudo_to_real.py``), so branching saves time without changing a figure.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Arm:
    """One way to train the model: where it starts and when (and how) it delinks."""

    name: str
    blocks: int | None
    """Unique blocks at step 0; None is the real model (one per layer)."""
    sharing: str = "sequence"
    schedule: tuple[tuple[float, int | None], ...] = ()
    """(fraction of the run, unique blocks after; None = real) for each delinking, in order."""
    optimizer_state: str = "scale"
    delink_noise: float = 0.0
    rewarm_steps: int = 0
    residual_init: str = "depth"
    pseudo_depth: str = "shared"
    """"shallow": the first stage runs its ``blocks`` as that many layers, and delinking grows the depth."""
    growth_init: str = "copy"
    unique_experts: int | None = None
    """FFNs the experts of a layer share before the first delinking upcycles them (None: one per expert)."""
    upcycle_router: str = "keep"
    upcycle_drop: float = 0.0
    """Drop-Upcycling: the share of each upcycled expert's hidden units re-initialized at upcycling."""
    steps_fraction: float = 1.0
    """The share of the run's optimizer steps this arm trains, its schedule decaying at its own last step (the
    compute-matched scratch arm trains fewer steps than the others)."""
    trunk: str | None = None
    """The arm whose checkpoint at this arm's first delink step it resumes from (its shared stage)."""
    parent: str | None = None
    """A variant of another arm: it trains at that arm's best LR (no sweep of its own), and its stages have that
    arm's shapes, so it is priced with that arm's measured step times."""
    note: str = ""

    def own_steps(self, steps: int, multiple: int = 1) -> int:
        """This arm's optimizer steps in a run of ``steps``: rounded to a ``multiple`` (the validation interval,
        so that the last step is measured), at least one multiple."""
        if self.steps_fraction == 1.0:
            return steps
        return max(multiple, round(steps * self.steps_fraction / multiple) * multiple)

    def delink_steps(self, steps: int) -> dict[int, int | None]:
        """{optimizer step: unique blocks after} for a run of ``steps`` steps."""
        return {round(fraction * steps): blocks for fraction, blocks in self.schedule}

    def model_options(self) -> dict[str, object]:
        """The model options this arm sets (everything else is the recipe's)."""
        return {"num_unique_blocks": self.blocks, "sharing": self.sharing, "residual_init": self.residual_init,
                "pseudo_depth": self.pseudo_depth, "growth_init": self.growth_init,
                "num_unique_experts": self.unique_experts, "upcycle_router": self.upcycle_router,
                "upcycle_drop": self.upcycle_drop}

    def cli_args(self) -> list[str]:
        """``model_options`` as LightningCLI overrides of the recipe."""
        return [f"--model.config.{key}={'null' if value is None else value}"
                for key, value in self.model_options().items()]


@dataclass(frozen=True)
class Run:
    arm: Arm
    lr: float
    seed: int

    @property
    def name(self) -> str:
        return f"{self.arm.name}_lr{self.lr:g}_s{self.seed}"


def main_arms(num_layers: int, delink_fraction: float = 0.1) -> list[Arm]:
    """The four arms the issue asks for: scratch, pseudo delinked at ``delink_fraction``, a cycled model of L/4
    unique blocks delinked in two stages (L/2 at half the fraction, L at the fraction), and pseudo only."""
    if num_layers % 4:
        raise ValueError(f"the cycled arm needs num_layers divisible by 4, got {num_layers}")
    return [
        Arm("scratch", None, note="the real model from step 0"),
        Arm("pseudo_only", 1, note="one block shared by every layer, never delinked"),
        Arm("p2r", 1, schedule=((delink_fraction, None),), trunk="pseudo_only",
            note=f"pseudo, delinked at {delink_fraction:.0%}"),
        Arm("cycled", num_layers // 4, sharing="cycle",
            schedule=((delink_fraction / 2, num_layers // 2), (delink_fraction, None)),
            note=f"L/4 blocks cycled, L/2 at {delink_fraction / 2:.0%}, real at {delink_fraction:.0%}"),
    ]


def ablation_arms(p2r: Arm, rewarm_steps: int, noise: float) -> list[Arm]:
    """One lever at a time on top of the ``p2r`` arm: the optimizer-state policy, symmetry breaking, and the
    residual init of the shared block (which changes the shared stage, so those arms train their own trunk, as
    does per_layer, which measures during the shared stage)."""
    p2r = replace(p2r, parent="p2r")
    return [
        replace(p2r, name="p2r_copy", optimizer_state="copy", note="moments kept as they were"),
        replace(p2r, name="p2r_reset", optimizer_state="reset", note="moments dropped"),
        # per_layer measures the steps before the delink: it cannot start from a checkpoint taken at the delink.
        replace(p2r, name="p2r_per_layer", optimizer_state="per_layer", trunk=None,
                note="each copy's own second moment, measured over the 20 steps before"),
        replace(p2r, name="p2r_noise", delink_noise=noise, note=f"noise {noise:g} x RMS on every copy"),
        replace(p2r, name="p2r_rewarm", rewarm_steps=rewarm_steps, note=f"LR re-warmup over {rewarm_steps} steps"),
        replace(p2r, name="p2r_init_applications", residual_init="applications", trunk=None,
                note="residual outputs std / sqrt(2 L g)"),
        replace(p2r, name="p2r_init_blocks", residual_init="blocks", trunk=None,
                note="residual outputs std / sqrt(2U)"),
    ]


GSTACK_GROWTH_FRACTION = 10e9 / 300e9
"""Where G_stack grows (Du et al. 2024, as we read it), as a fraction of the token budget: 10B tokens into their 7B
model's 300B. Their fitted rule for the growth point (a function of model size and compute) was fitted on models of
hundreds of millions to billions of parameters; it is not extrapolated to a model of a few million, and the ratio
of their flagship run is kept instead."""


def growth_arms(num_layers: int, growth_factor: int = 4, upcycle_fraction: float = 0.1,
                point_factor: float = 3.0) -> list[Arm]:
    """Issue 30's arms. Swept over LRs: ``scratch``, ``cycled`` (the best of the sharing protocol), ``stack`` (a
    shallow model of L/``growth_factor`` blocks run as that many layers, grown to L by the cycle map at G_stack's
    point), ``upcycle`` (the real depth, each layer's experts sharing one FFN, upcycled at ``upcycle_fraction``)
    and ``stack_upcycle`` (both, in one delinking at G_stack's point). Variants at their parent's best LR: the growth
    point ``point_factor`` x earlier and later (and ``point_factor``**2 x later), the identity-preserving growth, and a
    re-initialized router."""
    if num_layers % growth_factor or num_layers % 4:
        raise ValueError(f"the growth arms need num_layers divisible by 4 and by {growth_factor}, got {num_layers}")
    shallow = num_layers // growth_factor
    point = GSTACK_GROWTH_FRACTION
    stack = Arm("stack", shallow, sharing="cycle", pseudo_depth="shallow", schedule=((point, None),),
                note=f"{shallow} layers grown to {num_layers} at {point:.1%} (G_stack's point)")
    upcycle = Arm("upcycle", None, unique_experts=1, schedule=((upcycle_fraction, None),),
                  note=f"one FFN per layer shared by the experts, upcycled at {upcycle_fraction:.0%}")
    return [
        Arm("scratch", None, note="the real model from step 0"),
        Arm("cycled", num_layers // 4, sharing="cycle", schedule=((0.05, num_layers // 2), (0.1, None)),
            note="L/4 blocks cycled, L/2 at 5%, real at 10%"),
        stack,
        upcycle,
        replace(stack, name="stack_upcycle", unique_experts=1,
                note=f"{shallow} layers sharing one FFN, grown and upcycled at {point:.1%}"),
        replace(stack, name="stack_early", schedule=((point / point_factor, None),), parent="stack",
                note=f"grown at {point / point_factor:.1%}"),
        replace(stack, name="stack_late", schedule=((point * point_factor, None),), parent="stack",
                note=f"grown at {point * point_factor:.1%}"),
        # Added after the first run of this protocol measured the 3x-later point best of the three: 9x later.
        replace(stack, name="stack_later", schedule=((point * point_factor ** 2, None),), parent="stack",
                note=f"grown at {point * point_factor ** 2:.0%} (added after the first run: later measured better)"),
        replace(stack, name="stack_zero_outputs", growth_init="zero_outputs", parent="stack",
                note="new layers' output projections zeroed (the function is kept at growth)"),
        replace(upcycle, name="upcycle_reinit", upcycle_router="reinit", parent="upcycle",
                note="the router re-initialized at upcycling"),
        # Issue 41 item 4: Drop-Upcycling (Nakamura et al., ICLR 2025) at its paper's ratio and at half of it.
        replace(upcycle, name="drop_upcycle", upcycle_drop=0.5, parent="upcycle",
                note="Drop-Upcycling: half of each expert's hidden units re-initialized at upcycling"),
        replace(upcycle, name="drop_upcycle_quarter", upcycle_drop=0.25, parent="upcycle",
                note="Drop-Upcycling with a quarter of each expert's hidden units re-initialized"),
    ]


GROWTH_RULE_FRACTION = 0.3
"""The growth confirmation's rule (docs/pseudo_to_real.md, "The confirmation, fixed before it runs"): grow 4x at
30% of the run's optimizer steps, the point the first size measured best; not moved for the new settings."""


def matched_fraction(grow_at: float, step_time_ratio: float) -> float:
    """The share of the run a real model trains in the time the grown arm takes: ``grow_at`` of the run at the
    shallow stage's ``step_time_ratio`` (its seconds per step over the real model's), then the rest at full cost."""
    if not 0.0 < step_time_ratio <= 1.5 or not 0.0 < grow_at < 1.0:
        raise ValueError(f"expected 0 < grow_at < 1 and a step-time ratio in (0, 1.5], got {grow_at}, "
                         f"{step_time_ratio}")
    return grow_at * step_time_ratio + (1.0 - grow_at)


def confirmation_arms(num_layers: int, warmup_steps: int, matched: float, growth_factor: int = 4,
                      grow_at: float = GROWTH_RULE_FRACTION, upcycle_fraction: float = 0.1) -> list[Arm]:
    """The growth confirmation's arms, as committed before its runs. Main (each swept over the LRs): ``scratch``;
    ``scratch_matched``, the real model for ``matched`` of the run (the grown arm's compute) with its own schedule;
    ``grow``, a shallow model of L/``growth_factor`` blocks grown by the cycle map at ``grow_at``; ``drop_upcycle``,
    the real depth with each layer's experts sharing one FFN until ``upcycle_fraction``, then upcycled with half of
    each expert's hidden units re-initialized. One variant at ``grow``'s best LR: ``grow_rewarm``, the LR warmed up
    again over ``warmup_steps`` after growth."""
    if num_layers % growth_factor:
        raise ValueError(f"growth by {growth_factor} needs num_layers divisible by it, got {num_layers}")
    shallow = num_layers // growth_factor
    grow = Arm("grow", shallow, sharing="cycle", pseudo_depth="shallow", schedule=((grow_at, None),),
               note=f"{shallow} layers grown to {num_layers} at {grow_at:.0%} (the rule)")
    return [
        Arm("scratch", None, note="the real model from step 0"),
        Arm("scratch_matched", None, steps_fraction=matched,
            note=f"the real model for {matched:.1%} of the steps: the grown arm's compute"),
        grow,
        Arm("drop_upcycle", None, unique_experts=1, upcycle_drop=0.5, schedule=((upcycle_fraction, None),),
            note=f"one FFN per layer until {upcycle_fraction:.0%}, then Drop-Upcycling (r = 0.5)"),
        replace(grow, name="grow_rewarm", rewarm_steps=max(1, warmup_steps), parent="grow",
                note=f"grown at {grow_at:.0%}, the LR warmed up again over {warmup_steps} steps"),
    ]


def loss_at(xs: Sequence[float], losses: Sequence[float], x: float) -> float:
    """The loss curve sampled at ``xs`` read at ``x``, linear between samples (NaN outside them)."""
    if not xs or x < xs[0] or x > xs[-1]:
        return math.nan
    for i in range(1, len(xs)):
        if x <= xs[i]:
            frac = (x - xs[i - 1]) / (xs[i] - xs[i - 1]) if xs[i] > xs[i - 1] else 1.0
            return losses[i - 1] + frac * (losses[i] - losses[i - 1])
    return losses[-1]


def confirmation_verdict(grow: Mapping[int, float], scratch_at_grow_time: Mapping[int, float],
                         matched: Mapping[int, float], time_ratio: float) -> dict[str, object]:
    """The committed decision in one setting, per seed paired: ``grow`` (final losses) ends below scratch's curve
    read at the time the grown run took, by more than 2 standard errors; it reaches scratch's final loss in less
    time (``time_ratio`` < 1: its time to that loss over scratch's whole run); and it is not worse than the
    compute-matched scratch (``matched``'s final losses), read strictly: a mean difference of at most 0."""
    equal_time = paired_difference(grow, scratch_at_grow_time)
    versus_matched = paired_difference(grow, matched)
    sooner = math.isfinite(time_ratio) and time_ratio < 1.0
    not_worse = versus_matched.n > 0 and versus_matched.mean <= 0.0
    return {"diff_at_equal_time": equal_time.mean, "diff_at_equal_time_se": equal_time.se,
            "lower_by_2se": equal_time.significant, "time_ratio": time_ratio, "sooner": sooner,
            "diff_vs_matched": versus_matched.mean, "diff_vs_matched_se": versus_matched.se,
            "not_worse_than_matched": not_worse, "confirmed": equal_time.significant and sooner and not_worse}


def trunk_of(run: Run, arms: Mapping[str, Arm]) -> Run | None:
    """The run this one branches from, or None."""
    return None if run.arm.trunk is None else Run(arms[run.arm.trunk], run.lr, run.seed)


def waves(runs: Sequence[Run], arms: Mapping[str, Arm]) -> list[list[Run]]:
    """``runs`` and the trunks they need, in dependency order: every trunk in a wave before its branches."""
    needed: dict[str, Run] = {}
    for run in runs:
        trunk = trunk_of(run, arms)
        if trunk is not None:
            needed.setdefault(trunk.name, trunk)
        needed.setdefault(run.name, run)
    first = [run for run in needed.values() if run.arm.trunk is None]
    second = [run for run in needed.values() if run.arm.trunk is not None]
    return [wave for wave in (first, second) if wave]


# ------------------------------------------------------------------------------------------------ statistics
def first_crossing(xs: Sequence[float], losses: Sequence[float], target: float) -> float | None:
    """Where ``losses`` (sampled at ``xs``) first reach ``target`` or below, linear between samples; None if never."""
    for i, loss in enumerate(losses):
        if loss <= target:
            if i == 0 or losses[i - 1] == loss:
                return xs[i]
            frac = (losses[i - 1] - target) / (losses[i - 1] - loss)
            return xs[i - 1] + frac * (xs[i] - xs[i - 1])
    return None


def best_lr(final_losses: Mapping[float, Sequence[float]]) -> float:
    """The LR with the lowest mean final loss (ties: the smaller LR); a non-finite loss counts as a failure."""
    def score(lr: float) -> tuple[float, float]:
        values = final_losses[lr]
        mean = statistics.fmean(values) if values and all(math.isfinite(v) for v in values) else math.inf
        return mean, lr
    return min(final_losses, key=score)


@dataclass(frozen=True)
class Paired:
    """Mean and standard error of per-seed differences ``arm - reference`` (negative: the arm is lower)."""

    mean: float
    se: float
    n: int
    diffs: tuple[float, ...] = field(default=())

    @property
    def significant(self) -> bool:
        """Lower by more than 2 standard errors (needs at least 2 seeds)."""
        return self.n >= 2 and self.mean < -2 * self.se


def paired_difference(arm: Mapping[int, float], reference: Mapping[int, float]) -> Paired:
    """Per-seed ``arm[s] - reference[s]`` over the seeds both have."""
    seeds = sorted(set(arm) & set(reference))
    diffs = tuple(arm[s] - reference[s] for s in seeds)
    if not diffs:
        return Paired(math.nan, math.nan, 0)
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan
    return Paired(statistics.fmean(diffs), se, len(diffs), diffs)


@dataclass(frozen=True)
class Phase:
    """A stretch of training with one model shape: it runs from ``start`` (an optimizer step) to the next phase."""

    start: int
    seconds_per_step: float


def seconds_to(step: float, phases: Sequence[Phase], delink_seconds: float = 0.0) -> float:
    """Training seconds to reach ``step`` (fractional) when each phase costs its own time per step; every phase
    boundary crossed after step 0 adds ``delink_seconds``."""
    total = 0.0
    for index, phase in enumerate(phases):
        end = phases[index + 1].start if index + 1 < len(phases) else math.inf
        if step <= phase.start:
            break
        total += (min(step, end) - phase.start) * phase.seconds_per_step
        if index > 0:
            total += delink_seconds
    return total


def wins_on_time(step_gap: float, pseudo_fraction: float, step_time_ratio: float) -> bool:
    """The issue's criterion: P2R reaches scratch's final loss sooner iff ``delta < tau (1 - r)``, with ``delta``
    the extra steps it needs (as a fraction of the run), ``tau`` the fraction of the run spent pseudo and ``r`` the
    pseudo/real step-time ratio (delinking itself taken as free)."""
    return step_gap < pseudo_fraction * (1.0 - step_time_ratio)
