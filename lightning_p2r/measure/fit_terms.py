"""The cost model's fitted framework terms, fitted on this machine by ``lightning-p2r calibrate``.

Four terms of the step estimate (``FITTED`` in :mod:`lightning_p2r.planning.framework`: a pipeline stage action, a
pass of a tensor-parallel split module, a blocking collective's wait, an expert all-to-all's wait) are Python and
synchronization time that no microbenchmark isolates. ``calibrate`` prices them the way the planner's
cross-validation does, on the user's own machine: it trains a handful of small layouts that count them
(:func:`probe_layouts`), predicts each with those terms at zero, and fits the terms by non-negative least squares on
the relative residuals (:func:`fit_terms`). Beside each value it writes the range of the fits that leave one probe
out (``Cluster.fitted_spread``): a wide range says the timings were noisy, and the term is known to that precision
only. One process counts none of the four terms, so a one-process calibration fits none of them (it fits the
offloaded copies' bandwidth on a CPU: :mod:`.offload_copies`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..models.config import M6Config
from ..planning.cluster import Cluster
from ..planning.framework import FITTED, framework_counts
from ..planning.layout import Layout, Workload

PROBE_MODEL: dict[str, Any] = {"vocab_size": 256, "max_seq_len": 64, "num_layers": 4, "dim": 64, "num_heads": 4,
                               "num_experts": 4, "moe_top_k": 1, "moe_layers": [1, 3], "capacity_factor": None,
                               "init_seed": 0}
"""A model every parallel dimension applies to (4 layers to pipeline, heads and experts to split), small enough that
the framework terms are a visible share of its step."""
PROBE_BATCH = 8
"""Sequences per step of a probe (its global batch)."""
PROBES_PER_TERM = 2
"""Layouts timed per fitted term (``--quick``: 1); the same layout may serve several terms."""
PROBE_STEPS = 8
"""Optimizer steps per probe (``--quick``: 5), two of them warm-up, as ``plan --trial`` runs a layout."""
PROBE_ROUNDS = 3
"""Times each probe is timed (``--quick``: 1), the probes in turn (1, 2, ..., K, then 1, 2, ... again); the fit reads
each probe's median, which from three rounds on ignores one slow round. On a 2-vCPU machine one probe's step moved by
10-35% between runs a few minutes apart (2026-11-29), and a single timing put that straight into the fitted terms;
with two rounds (their mean, until 2026-11-30) a probe's rounds still differed by up to a third, and the fitted
terms of two calibrations an hour apart by up to 3.7 times (a DTensor pass 73 and 269 us). Each round adds about
45 s per process count of 2 on such a machine."""


@dataclass(frozen=True)
class Probe:
    """One timed layout: its step measured, its step predicted with the fitted terms at zero, and each fitted term's
    count in that step."""

    layout: Layout
    measured_s: float
    base_s: float
    counts: dict[str, float]
    rounds_s: tuple[float, ...] = ()
    """Each round's measured step, when the probe was timed more than once (``measured_s`` is their median)."""


def probe_workload() -> tuple[M6Config, Workload]:
    config = M6Config(**PROBE_MODEL)
    return config, Workload(global_batch=PROBE_BATCH, seq_len=config.max_seq_len)


def unfitted(cluster: Cluster) -> Cluster:
    """``cluster`` with every fitted term at zero: the prediction the fit corrects."""
    return dataclasses.replace(cluster, **dict.fromkeys(FITTED, 0.0))


def probe_layouts(cluster: Cluster, per_term: int = PROBES_PER_TERM) -> list[Layout]:
    """For each fitted term, layouts of the planner's search space on ``cluster``'s devices that count it: the simplest
    (fewest other fitted terms, then fewest micro-batches, then by name), and with ``per_term`` above one, layouts
    like it (the same other terms) where the term is the largest share of the step (most counts per second of the
    unfitted estimate), so that the fit reads the term's cost per count from a step it dominates, not from a small
    difference (a blocking collective priced only from the two or nine waits of plain data parallelism would take its
    value from the tensor-parallel probes, where it shares every count with the DTensor term). Empty on one device,
    where no layout counts one."""
    from ..planning.search import candidate_layouts
    from ..planning.step_time import estimate_step

    config, workload = probe_workload()
    pool = sorted(candidate_layouts(config, cluster, workload), key=lambda layout: layout.describe())
    counts = {layout: framework_counts(config, layout, cluster, workload) for layout in pool}
    zeroed = unfitted(cluster)

    @functools.cache  # a layout like the simplest for several terms is priced once
    def base_seconds(layout: Layout) -> float:
        return estimate_step(config, layout, zeroed, workload).total
    chosen: list[Layout] = []
    for term in FITTED:
        def others(layout: Layout, term: str = term) -> int:
            return sum(counts[layout][t] > 0 for t in FITTED if t != term)

        counting = sorted((layout for layout in pool if counts[layout][term] > 0),
                          key=lambda layout: (others(layout), layout.micro_batches, layout.describe()))
        if not counting:
            continue
        simplest = counting[0]
        alike = sorted((layout for layout in counting[1:] if others(layout) == others(simplest)),
                       key=lambda layout: (-counts[layout][term] / base_seconds(layout), layout.describe()))
        # A layout already chosen for another term measures this one too.
        chosen += [layout for layout in [simplest, *alike[: per_term - 1]] if layout not in chosen]
    return chosen


def predicted_probe(layout: Layout, cluster: Cluster, measured_s: float) -> Probe:
    """The :class:`Probe` of ``layout`` measured at ``measured_s`` on ``cluster``."""
    from ..planning.step_time import estimate_step

    config, workload = probe_workload()
    zeroed = unfitted(cluster)
    counts = framework_counts(config, layout, zeroed, workload)
    return Probe(layout=layout, measured_s=measured_s,
                 base_s=estimate_step(config, layout, zeroed, workload).total,
                 counts={term: float(counts[term]) for term in FITTED})


def fit_nonnegative(features: list[list[float]], residuals: list[float]) -> list[float]:
    """Non-negative least squares, by trying every subset of the columns (a handful of terms): the coefficients
    ``c >= 0`` minimizing ``sum((features @ c - residuals) ** 2)``."""
    import numpy as np

    a, b = np.asarray(features, dtype=float), np.asarray(residuals, dtype=float)
    columns = a.shape[1] if a.ndim == 2 else 0
    best, best_error = [0.0] * columns, float(np.sum(b ** 2))
    for size in range(1, columns + 1):
        for subset in itertools.combinations(range(columns), size):
            solution, *_ = np.linalg.lstsq(a[:, subset], b, rcond=None)
            if (solution < 0).any():
                continue
            error = float(np.sum((a[:, subset] @ solution - b) ** 2))
            if error < best_error:
                best_error, best = error, [0.0] * columns
                for index, value in zip(subset, solution):
                    best[index] = float(value)
    return best


def _fit(probes: list[Probe]) -> dict[str, float]:
    # Relative errors are what the planner's targets count: each probe weighs 1 / its measured step.
    features = [[p.counts[term] / p.measured_s for term in FITTED] for p in probes]
    residuals = [(p.measured_s - p.base_s) / p.measured_s for p in probes]
    return dict(zip(FITTED, fit_nonnegative(features, residuals)))


def fit_terms(probes: list[Probe]) -> tuple[dict[str, float], dict[str, list[float]]]:
    """The fitted terms that some probe counts, and for each the [lowest, highest] value of the fits leaving one probe
    out (the value itself twice when there are too few probes to leave one out). Terms no probe counts are left out
    of both: the machine says nothing about them."""
    counted = [term for term in FITTED if any(p.counts[term] > 0 for p in probes)]
    if not counted:
        return {}, {}
    values = _fit(probes)
    fits = [_fit(probes[:i] + probes[i + 1:]) for i in range(len(probes))] if len(probes) > len(counted) else []
    spread = {term: [min(f[term] for f in fits), max(f[term] for f in fits)] if fits else [values[term]] * 2
              for term in counted}
    return {term: values[term] for term in counted}, spread


def fit_framework_terms(cluster: Cluster, *, quick: bool = False, steps: int | None = None,
                        threads: int | None = None, rounds: int | None = None,
                        log: Any = print) -> tuple[Cluster, list[Probe]]:
    """Time the probe layouts on ``cluster.devices`` processes of this machine (``threads`` torch threads each, else
    what ``plan --trial`` gives a process), ``rounds`` times in turn (``PROBE_ROUNDS``; ``quick``: once), and return
    ``cluster`` with the fitted terms and their spread set, and the probes (``cluster`` unchanged, and no probe, on
    one device). A probe that fails to run is left out, with a warning: a term no other probe counts stays unfitted
    (outside ``fitted_spread``), and ``plan`` then warns where a layout counts it."""
    from .trial import TRIAL_FAILURES, failure_reason, in_turn, run_trial, trial_spec

    layouts = probe_layouts(cluster, 1 if quick else PROBES_PER_TERM)
    config, workload = probe_workload()
    steps = steps or (5 if quick else PROBE_STEPS)
    if rounds is None:
        rounds = 1 if quick else PROBE_ROUNDS
    if rounds < 1:
        raise ValueError(f"probe rounds must be at least 1, got {rounds}")
    failed: dict[int, str] = {}
    with tempfile.TemporaryDirectory() as folder:
        def timed(index: int, round_: int) -> float:
            layout = layouts[index]
            if index in failed:
                return math.nan
            spec = trial_spec(config, layout, workload, devices=cluster.devices, steps=steps,
                              accelerator=cluster.accelerator, out=str(Path(folder) / f"probe{index}_{round_}"))
            spec["threads"] = threads or spec["threads"]
            try:
                measured = run_trial(spec)
            except TRIAL_FAILURES as error:
                # One layout that cannot run here must not cost the minutes measured so far: fit on the others.
                failed[index] = failure_reason(error)
                log(f"warning: probe {layout.describe()} failed ({failed[index]}); the fit goes on without it")
                return math.nan
            of_rounds = f" (round {round_}/{rounds})" if rounds > 1 else ""
            log(f"probe {index + 1}/{len(layouts)}{of_rounds}: {layout.describe()}: {measured * 1e3:.1f} ms per step")
            return measured

        timings = in_turn(len(layouts), rounds, timed)
    probes = []
    for index, (layout, measured) in enumerate(zip(layouts, timings)):
        if index in failed:
            continue
        probe = dataclasses.replace(predicted_probe(layout, cluster, statistics.median(measured)),
                                    rounds_s=tuple(measured) if rounds > 1 else ())
        log(f"{layout.describe()}: {probe.measured_s * 1e3:.1f} ms per step"
            f"{' (median of its rounds)' if rounds > 1 else ''}, {probe.base_s * 1e3:.1f} ms before the fitted terms")
        probes.append(probe)
    values, spread = fit_terms(probes)
    return dataclasses.replace(cluster, **values, fitted_spread=spread), probes


def describe_fit(cluster: Cluster, *, skipped: bool = False) -> str:
    """Lines for the cluster file's header: each fitted term with its leave-one-out range. ``skipped``: calibrate's
    ``--no-fit`` (a file of 2 processes so made said "one process counts none of them" until 2026-12-02)."""
    if not cluster.fitted_spread:
        if skipped:
            return "No framework term fitted (--no-fit skipped the fits; the planner warns where a layout counts one)."
        if cluster.devices == 1:
            return "No framework term fitted (one process counts none of them)."
        return "No framework term fitted (no timed probe layout gave one)."
    lines = ["Fitted from timed probe layouts (value, and its range leaving one probe out):"]
    for term, (low, high) in cluster.fitted_spread.items():
        lines.append(f"  {term}: {getattr(cluster, term) * 1e6:.0f} us ({low * 1e6:.0f}-{high * 1e6:.0f} us)")
    return "\n".join(lines)
