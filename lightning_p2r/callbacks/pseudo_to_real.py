"""``PseudoToReal``: delink a shared-weight "pseudo" model into the "real" one in the middle of ``fit``.

M6-10T trains a model of the real depth whose layers share one block (1/L of the block parameters and optimizer
state), then gives every layer its own copy and trains on. This callback decides *when* (a step, a fraction of
``max_steps``, a staged schedule, or an automatic criterion) and performs the switch through public Trainer APIs;
the transformation itself is :func:`lightning_p2r.sharing.delink`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from ..protocols import DelinksInPlace
from ..sharing import (
    POLICIES,
    MeasuredSecondMoments,
    OptimizerStatePolicy,
    Perturbation,
    check_delink_target,
    delink,
    find_block_sequence,
    full_depth,
    new_layout,
    rebind_scheduler,
    shared_experts,
)
from .gradient_agreement import GradientAgreementProbe
from .per_layer_moments import SecondMomentTracker


@dataclass
class DelinkEvent:
    """One delinking, as logged and stored in the callback's state."""

    step: int
    blocks_before: int
    blocks_after: int
    params_before: int
    params_after: int
    loss_before: float
    loss_after: float
    reason: str
    layers_before: int = 0
    """Layers the forward ran before (fewer than the depth for a shallow pseudo model); 0 in older records."""
    layers_after: int = 0
    """Layers it runs after: more than ``layers_before`` when a shallow model grew (its function changed)."""
    experts_upcycled: bool = False
    """Whether shared experts were upcycled into one FFN each at this event."""
    lm_loss_before: float = math.nan
    """The language-model loss (cross-entropy, without the routers' aux and z losses, which count once per MoE layer
    run and so grow with the depth) on the same batch, before."""
    lm_loss_after: float = math.nan
    """The same, after."""


def plan_stages(
    num_layers: int,
    current_blocks: int,
    max_steps: int,
    delink_at_step: int | None,
    delink_at_fraction: float | None,
    schedule: dict[int, int] | None,
    upcycle_only: bool = False,
) -> list[tuple[int, int]]:
    """(step, num_unique_blocks after) for each planned delinking, validated against the run and the model.
    ``upcycle_only``: the blocks are real but the experts share FFNs, so the first delinking upcycles them only."""
    if schedule:
        stages = sorted((int(step), int(blocks)) for step, blocks in schedule.items())
    elif delink_at_step is not None:
        stages = [(delink_at_step, num_layers)]
    elif delink_at_fraction is not None:
        if max_steps <= 0:
            raise ValueError("PseudoToReal.delink_at_fraction needs Trainer(max_steps=...) to be set")
        stages = [(round(delink_at_fraction * max_steps), num_layers)]
    else:
        return []
    blocks = current_blocks
    for index, (step, target) in enumerate(stages):
        if step < 0 or (max_steps > 0 and step >= max_steps):
            raise ValueError(
                f"PseudoToReal: delinking at step {step} is outside the run ({max_steps} optimizer steps: Trainer "
                "max_steps, or its epochs and batch limits); choose a step in [0, max_steps)"
            )
        if not (upcycle_only and index == 0 and blocks == num_layers):
            try:
                blocks = check_delink_target(num_layers, blocks, target)
            except ValueError as error:
                raise ValueError(f"PseudoToReal: the delinking planned at step {step}: {error}") from None
    return stages


def run_steps(trainer: L.Trainer) -> int:
    """The run's optimizer steps: Lightning's estimate, the fewest that ``max_steps``, the epochs and the batch
    limits allow (-1 when unbounded)."""
    estimate = trainer.estimated_stepping_batches
    return int(estimate) if math.isfinite(estimate) else -1


def stages_left(stages: list[tuple[int, int]], events: list[DelinkEvent],
                blocks_now: int) -> tuple[list[tuple[int, int]], str | None]:
    """The planned stages a resumed run still has to do, and a note when the plan and what the checkpoint did differ:
    a stage is done when the model already has its blocks, whatever step the checkpoint's run did it at (counting
    the recorded events instead skipped a stage the checkpoint's plan never had, or repeated one on a model already
    real). A fresh run (no events) keeps every stage."""
    if not events:
        return stages, None
    left = [(step, target) for step, target in stages if target > blocks_now]
    done = [stage for stage in stages if stage not in left]
    note = None
    if [target for _, target in done] != [event.blocks_after for event in events]:
        note = (f"PseudoToReal: the checkpoint's model has {blocks_now} blocks (delinked at step(s) "
                f"{[event.step for event in events]}); of this run's plan {stages}, "
                + (f"it still does {left}" if left else "nothing is left to do"))
    return left, note


def rewarm_scale(steps_since_delink: int, rewarm_steps: int) -> float:
    """The LR factor of the ``steps_since_delink``-th step after delinking: linear from 1/rewarm_steps to 1."""
    return min(1.0, (steps_since_delink + 1) / rewarm_steps)


class PseudoToReal(L.Callback):
    """Delink the model's shared blocks mid-training (M6-10T "Pseudo-to-Real").

    Give exactly one of ``delink_at_step``, ``delink_at_fraction``, ``schedule`` or ``auto=True``.

    A shallow pseudo model (``M6Config.pseudo_depth="shallow"``) is grown instead, which changes its function unless
    ``M6Config.growth_init="zero_outputs"``: the language-model loss on the same batch before and after is logged as
    ``p2r/loss_before_growth`` and ``p2r/loss_after_growth``. Experts sharing one FFN (``M6Config.num_unique_experts``)
    are upcycled at the first delinking. Both are refused with pipeline parallelism, ``auto`` and "per_layer".

    Args:
        delink_at_step: optimizer step at which the model becomes real (each layer its own block).
        delink_at_fraction: the same, as a fraction of ``Trainer(max_steps)``.
        schedule: staged delinking, ``{step: num_unique_blocks}``, e.g. ``{100: 2, 200: 4, 300: 8}``.
        auto: delink when the layers' gradients on their shared weights stop agreeing (after Yang et al. 2021,
            "Speeding up Deep Model Training by Sharing Weights and then Unsharing"): every
            ``auto_check_every`` steps the per-layer gradient contributions to each shared linear weight are
            measured; when the moving average of their mean pairwise cosine similarity drops below
            ``auto_threshold``, or falls ``auto_drop_from_peak`` (a fraction) below the highest average seen so
            far (and at least ``auto_min_step`` steps have run), or at ``auto_max_step``, delink. Measured on
            the earlier 8-layer ``recipes/pseudo_to_real.yaml`` (dim 128, 600 steps): the average rose from 0.57
            to a peak of 0.71 near step 90 and drifted down to 0.62 by step 600, so an absolute threshold of 0.2
            never fired there, while a 5% drop from the peak fired at step 131; the relative test adapts to the
            model's own level.
        auto_threshold: cosine similarity under which the layers are judged to want different weights.
        auto_drop_from_peak: relative drop of the average below its running peak that triggers delinking
            (e.g. 0.05); None disables the relative test.
        auto_min_step: never delink automatically before this step.
        auto_max_step: delink at this step at the latest (None: no bound).
        auto_check_every: steps between two measurements.
        auto_smoothing: weight of the history in the moving average (0 uses the last measurement alone).
        optimizer_state: how AdamW/SGD state is carried to the copies: "scale", "copy", "reset" (see ``delink``) or
            "per_layer": during the ``per_layer_steps`` steps before each planned delinking, each layer's own
            gradient on the shared linear and expert weights is rebuilt, and each copy's second moment is the
            shared one times the share its layers' gradients measured (``callbacks.per_layer_moments``); costs
            one fp32 tensor per layer and probed weight while measuring. Needs a planned delink (not ``auto``).
        per_layer_steps: optimizer steps "per_layer" measures before each planned delinking.
        restart_schedule: start the LR schedule (warmup included) over at delinking; by default it continues.
        delink_noise: break the copies' symmetry: Gaussian noise of this standard deviation relative to each
            tensor's RMS on every copy (0 keeps the function exactly; see ``sharing.Perturbation``).
        rewarm_steps: after each delinking, scale the learning rate by (k + 1) / rewarm_steps at the k-th step, so
            the copies start with small, diverging updates; 0 leaves the schedule alone. The scale multiplies the
            LR the scheduler set for that step (a schedule that sets the LR from its own state, as
            ``M6LanguageModel``'s ``LambdaLR`` does) and is logged as ``p2r/lr_scale``.
    """

    def __init__(
        self,
        delink_at_step: int | None = None,
        delink_at_fraction: float | None = None,
        schedule: dict[int, int] | None = None,
        auto: bool = False,
        auto_threshold: float = 0.2,
        auto_drop_from_peak: float | None = 0.05,
        auto_min_step: int = 0,
        auto_max_step: int | None = None,
        auto_check_every: int = 10,
        auto_smoothing: float = 0.8,
        optimizer_state: OptimizerStatePolicy = "scale",
        restart_schedule: bool = False,
        delink_noise: float = 0.0,
        rewarm_steps: int = 0,
        per_layer_steps: int = 20,
    ) -> None:
        chosen = [name for name, value in (("delink_at_step", delink_at_step),
                                           ("delink_at_fraction", delink_at_fraction),
                                           ("schedule", schedule or None), ("auto", auto or None))
                  if value is not None]
        if len(chosen) != 1:
            raise ValueError(
                "PseudoToReal needs exactly one of delink_at_step, delink_at_fraction, schedule or auto=True; "
                f"got {chosen or 'none'}"
            )
        if delink_at_fraction is not None and not 0.0 <= delink_at_fraction < 1.0:
            raise ValueError(f"PseudoToReal.delink_at_fraction must be in [0, 1), got {delink_at_fraction}")
        if optimizer_state not in POLICIES:
            raise ValueError(f"PseudoToReal.optimizer_state must be one of {', '.join(map(repr, POLICIES))}, got "
                             f"{optimizer_state!r}")
        if optimizer_state == "per_layer" and auto:
            raise ValueError("PseudoToReal(optimizer_state='per_layer') measures the steps before a planned delinking; "
                             "with auto=True the step is not known in advance: give delink_at_step, "
                             "delink_at_fraction or schedule, or use 'scale'")
        if isinstance(per_layer_steps, bool) or not isinstance(per_layer_steps, int) or per_layer_steps < 1:
            raise ValueError(f"PseudoToReal.per_layer_steps must be an integer >= 1, got {per_layer_steps!r}")
        if not -1.0 <= auto_threshold <= 1.0:
            raise ValueError(
                f"PseudoToReal.auto_threshold must be a cosine similarity in [-1, 1], got {auto_threshold}")
        if auto_drop_from_peak is not None and not 0.0 < auto_drop_from_peak < 1.0:
            raise ValueError(f"PseudoToReal.auto_drop_from_peak must be in (0, 1) or None, got {auto_drop_from_peak}")
        if auto_check_every < 1:
            raise ValueError(f"PseudoToReal.auto_check_every must be >= 1, got {auto_check_every}")
        if not 0.0 <= auto_smoothing < 1.0:
            raise ValueError(f"PseudoToReal.auto_smoothing must be in [0, 1), got {auto_smoothing}")
        if auto_max_step is not None and auto_max_step < auto_min_step:
            raise ValueError("PseudoToReal.auto_max_step must be >= auto_min_step")
        if not 0.0 <= delink_noise < 1.0:
            raise ValueError(f"PseudoToReal.delink_noise must be in [0, 1) (relative to each tensor's RMS), got "
                             f"{delink_noise!r}")
        if isinstance(rewarm_steps, bool) or not isinstance(rewarm_steps, int) or rewarm_steps < 0:
            raise ValueError(f"PseudoToReal.rewarm_steps must be an integer >= 0, got {rewarm_steps!r}")
        self.delink_noise = delink_noise
        self.rewarm_steps = rewarm_steps
        self.per_layer_steps = per_layer_steps
        self._tracker: SecondMomentTracker | None = None
        self.delink_at_step = delink_at_step
        self.delink_at_fraction = delink_at_fraction
        self.schedule = dict(schedule) if schedule else None
        self.auto = auto
        self.auto_threshold = auto_threshold
        self.auto_drop_from_peak = auto_drop_from_peak
        self.peak_agreement: float | None = None
        self.auto_min_step = auto_min_step
        self.auto_max_step = auto_max_step
        self.auto_check_every = auto_check_every
        self.auto_smoothing = auto_smoothing
        self.optimizer_state = optimizer_state
        self.restart_schedule = restart_schedule
        self.events: list[DelinkEvent] = []
        self.agreement: float | None = None
        self._stages: list[tuple[int, int]] = []
        self._probe: GradientAgreementProbe | None = None

    # ------------------------------------------------------------------------------------------------ setup
    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        holder = find_block_sequence(pl_module)
        num_layers = full_depth(holder)
        if not isinstance(trainer.strategy, (SingleDeviceStrategy, DDPStrategy, DelinksInPlace)):
            raise ValueError(
                f"PseudoToReal cannot re-apply {type(trainer.strategy).__name__}'s wrapping after delinking; "
                "use a single device, DDP, or lightning_p2r's P2RStrategy"
            )
        growing = num_layers > len(holder.layer_to_block) or bool(shared_experts(holder))
        if growing and not self.events:
            self._check_growth(trainer)
        # Stages already done (a resumed run) are not planned again; the model was rebuilt real on load.
        done_blocks = self.events[-1].blocks_after if self.events else None
        if done_blocks is not None and done_blocks != len(holder.blocks):
            raise ValueError(f"PseudoToReal state says {done_blocks} blocks, the model has {len(holder.blocks)}")
        if self.auto:
            if len(holder.blocks) == num_layers:
                raise ValueError("PseudoToReal(auto=True): the model is already real, there is nothing to delink")
            self._stages = []
            return
        # Plan from the blocks the run started with, so a resumed run validates the same whole schedule.
        initial_blocks = self.events[0].blocks_before if self.events else len(holder.blocks)
        upcycle_only = bool(shared_experts(holder)) or (bool(self.events) and self.events[0].experts_upcycled)
        if self.delink_at_fraction is not None and trainer.max_steps <= 0:
            raise ValueError("PseudoToReal.delink_at_fraction needs Trainer(max_steps=...) to be set")
        stages = plan_stages(num_layers, initial_blocks, run_steps(trainer), self.delink_at_step,
                             self.delink_at_fraction, self.schedule, upcycle_only=upcycle_only)
        self._stages, note = stages_left(stages, self.events, len(holder.blocks))
        if note:
            rank_zero_info(note)

    def _check_growth(self, trainer: L.Trainer) -> None:
        """A shallow pseudo model or shared experts: refuse what growth and upcycling do not support yet."""
        layout = getattr(trainer.strategy, "layout", None)
        if isinstance(trainer.strategy, DelinksInPlace) and getattr(layout, "pipeline_parallel", 1) > 1:
            # The stages are cut by layers, and growth adds layers: every stage would have to be cut again.
            raise ValueError("PseudoToReal: growing a shallow model or upcycling shared experts is not supported with "
                             "pipeline_parallel > 1; train the pseudo stage without pipelining")
        if self.auto:
            raise ValueError("PseudoToReal(auto=True) measures layers that share a block; a shallow model or shared "
                             "experts has none: give delink_at_step, delink_at_fraction or schedule")
        if self.optimizer_state == "per_layer":
            raise ValueError("PseudoToReal(optimizer_state='per_layer') cannot carry state into a growing model or "
                             "upcycled experts; use 'scale'")

    # ---------------------------------------------------------------------------------------------- trigger
    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if batch_idx % trainer.accumulate_grad_batches:
            return  # never in the middle of an accumulation window
        step = trainer.global_step
        if self._stages and step >= self._stages[0][0]:
            planned, target = self._stages.pop(0)
            late = f", done at step {step} (resumed past it)" if step > planned else ""
            if late:  # (the restored step is known from the first batch on, not at fit start)
                rank_zero_warn(f"PseudoToReal: the run resumes at step {step}, past the delinking planned at step "
                               f"{planned}: it delinks at its first step, {step}")
            self._delink(trainer, pl_module, batch, target, reason=f"planned at step {planned}{late}")
        elif self.auto and not self.events:
            self._auto_step(trainer, pl_module, batch, step)
        self._track_moments(pl_module, step)
        self._rewarm(trainer)

    def _track_moments(self, pl_module: L.LightningModule, step: int) -> None:
        """"per_layer": attach the tracker ``per_layer_steps`` before the next planned delinking; fold each step."""
        if self.optimizer_state != "per_layer" or not self._stages:
            return
        if self._tracker is not None:
            self._tracker.fold()
            return
        delink_step, target = self._stages[0]
        if delink_step - self.per_layer_steps <= step < delink_step:
            holder = find_block_sequence(pl_module)
            new_map, _ = new_layout(list(holder.layer_to_block), target or len(holder.layer_to_block),
                                     getattr(holder, "sharing", "sequence"))
            self._tracker = SecondMomentTracker(holder, new_map)

    def _measured_policy(self, trainer: L.Trainer) -> OptimizerStatePolicy | MeasuredSecondMoments:
        """The policy ``delink`` gets: the measurement for "per_layer" (averaged over ranks), else the name."""
        if self.optimizer_state != "per_layer":
            return self.optimizer_state
        if self._tracker is None:
            rank_zero_warn("PseudoToReal(optimizer_state='per_layer'): no step was measured before this delinking "
                           "(a run resumed inside the measuring window, or a delink at step 0); using 'scale'")
            return "scale"
        measured = self._tracker.finish()
        self._tracker = None
        if trainer.world_size > 1:
            # Each rank measured its own batch; every rank must carry the same state into the copies.
            device = trainer.strategy.root_device
            ratios = {name: trainer.strategy.reduce(ratio.to(device), reduce_op="mean").cpu()
                      for name, ratio in sorted(measured.ratios.items())}
            measured = MeasuredSecondMoments(ratios, measured.steps)
        return measured

    def _rewarm(self, trainer: L.Trainer) -> None:
        if not self.rewarm_steps or not self.events:
            return
        since = trainer.global_step - self.events[-1].step
        if not 0 <= since < self.rewarm_steps:
            return
        scale = rewarm_scale(since, self.rewarm_steps)
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * scale
        for logger in trainer.loggers:
            logger.log_metrics({"p2r/lr_scale": scale}, step=trainer.global_step)

    def _auto_step(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, step: int) -> None:
        if self.auto_max_step is not None and step >= self.auto_max_step:
            self._delink(trainer, pl_module, batch, None, reason=f"auto: reached auto_max_step={self.auto_max_step}")
            return
        if self.agreement is not None and step >= self.auto_min_step:
            if self.agreement < self.auto_threshold:
                self._delink(trainer, pl_module, batch, None,
                             reason=f"auto: gradient agreement {self.agreement:.3f} < {self.auto_threshold}")
                return
            drop = self.auto_drop_from_peak
            if drop is not None and self.peak_agreement is not None and (
                    self.agreement < (1 - drop) * self.peak_agreement):
                self._delink(trainer, pl_module, batch, None,
                             reason=f"auto: gradient agreement {self.agreement:.3f} fell more than {drop:.0%} below "
                                    f"its peak {self.peak_agreement:.3f}")
                return
        if step % self.auto_check_every == 0:
            if self._probe is not None:  # the last probe saw no backward (a skipped step): drop its hooks
                self._probe.remove()
            self._probe = GradientAgreementProbe(find_block_sequence(pl_module))

    @override
    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._probe is None:
            return
        measured = self._probe.finish()
        self._probe = None
        if measured is None:
            return
        if trainer.world_size > 1:
            # Each rank measured its own batch; every rank must take the same decision (delinking is collective).
            local = torch.tensor(measured, device=trainer.strategy.root_device)
            measured = float(trainer.strategy.reduce(local, reduce_op="mean"))
        self.agreement = measured if self.agreement is None else (
            self.auto_smoothing * self.agreement + (1 - self.auto_smoothing) * measured)
        self.peak_agreement = max(self.agreement, self.peak_agreement or self.agreement)
        for logger in trainer.loggers:
            logger.log_metrics({"p2r/gradient_agreement": measured, "p2r/gradient_agreement_avg": self.agreement},
                               step=trainer.global_step)

    # -------------------------------------------------------------------------------------------- delinking
    def _delink(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, target: int | None,
                reason: str) -> None:
        if self._probe is not None:
            self._probe.remove()
            self._probe = None
        policy = self._measured_policy(trainer)
        holder = find_block_sequence(pl_module)
        blocks_before, layers_before = len(holder.blocks), len(holder.layer_to_block)
        upcycling = bool(shared_experts(holder))
        params_before = _count(pl_module)
        loss_before, lm_loss_before = _batch_loss(pl_module, batch)
        if len(trainer.optimizers) != 1:
            raise ValueError(f"PseudoToReal supports one optimizer, the module configured {len(trainer.optimizers)}")
        # Seeded by the step: every rank draws the same noise, and each stage of a staged plan new noise.
        perturb = Perturbation(self.delink_noise, seed=trainer.global_step) if self.delink_noise else None
        if isinstance(trainer.strategy, DelinksInPlace):
            # A strategy that places blocks itself (P2RStrategy) delinks and re-places them in one go.
            optimizer = trainer.strategy.delink_model(pl_module, trainer.optimizers[0], target, policy, perturb)
        else:
            optimizer = delink(pl_module, trainer.optimizers[0], num_unique_blocks=target, optimizer_state=policy,
                               perturb=perturb)
            _rewrap(trainer, pl_module)
        trainer.strategy.optimizers = [optimizer]
        for config in trainer.lr_scheduler_configs:
            config.scheduler = rebind_scheduler(config.scheduler, optimizer)
            if self.restart_schedule:
                config.scheduler.last_epoch = -1
                config.scheduler.step()
        loss_after, lm_loss_after = _batch_loss(pl_module, batch)
        event = DelinkEvent(step=trainer.global_step, blocks_before=blocks_before,
                            blocks_after=len(find_block_sequence(pl_module).blocks), params_before=params_before,
                            params_after=_count(pl_module), loss_before=loss_before,
                            loss_after=loss_after, reason=reason, layers_before=layers_before,
                            layers_after=len(find_block_sequence(pl_module).layer_to_block),
                            experts_upcycled=upcycling, lm_loss_before=lm_loss_before, lm_loss_after=lm_loss_after)
        self.events.append(event)
        metrics = {f"p2r/{key}": float(value) for key, value in asdict(event).items() if key != "reason"}
        if event.layers_after > event.layers_before:
            # Growth changes the function (the model gets deeper): the same batch's language-model loss on both sides
            # says by how much (equal up to rounding with growth_init="zero_outputs").
            metrics |= {"p2r/loss_before_growth": event.lm_loss_before, "p2r/loss_after_growth": event.lm_loss_after}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._unhook()

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._unhook()

    def _unhook(self) -> None:
        """A run that ends or fails inside a measuring window leaves no hooks or wrapped run_layer behind."""
        for probe in (self._tracker, self._probe):
            if probe is not None:
                probe.remove()
        self._tracker = self._probe = None

    # ------------------------------------------------------------------------------------------- checkpoint
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"events": [asdict(event) for event in self.events], "agreement": self.agreement,
                "peak_agreement": self.peak_agreement}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.events = [DelinkEvent(**event) for event in state_dict.get("events", [])]
        self.agreement = state_dict.get("agreement")
        self.peak_agreement = state_dict.get("peak_agreement")


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@torch.no_grad()
def _batch_loss(pl_module: L.LightningModule, batch: Any) -> tuple[float, float]:
    """The module's loss and language-model loss ("ce") on ``batch`` in eval mode (no dropout or router jitter), for
    the before/after record; the random state is left as it was, so recording does not change the run. NaN without
    ``losses`` (or without a "ce" entry)."""
    losses = getattr(pl_module, "losses", None)
    if losses is None:
        return math.nan, math.nan
    was_training = pl_module.training
    devices = [batch.device] if isinstance(batch, torch.Tensor) and batch.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        pl_module.eval()
        try:
            result = losses(batch)
            return float(result["loss"]), float(result.get("ce", math.nan))
        finally:
            pl_module.train(was_training)


def _rewrap(trainer: L.Trainer, pl_module: L.LightningModule) -> None:
    """Re-apply the strategy's wrapping so it sees the new parameters.

    DDP registers parameters with its reducer when it wraps the module; parameters created afterwards would
    never be all-reduced and the ranks would silently drift apart.
    """
    strategy = trainer.strategy
    if isinstance(strategy, DDPStrategy):
        strategy.model = pl_module
        strategy.configure_ddp()
