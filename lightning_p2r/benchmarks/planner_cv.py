"""Cross-validation of the planner's cost model on layouts it was never tuned on.

    python -m lightning_p2r.benchmarks.planner --cross-validate [--clusters DIR] [--measured CSV] [--seed 0]
                                               [--out DIR | --update-docs]

The protocol:

1. **Sample.** A seeded random draw of layouts from the planner's own search space (``candidate_layouts``: ZeRO
   stage, tensor / expert / pipeline degrees, schedules, stages per rank, sequence parallelism, micro-batches,
   standard or layered accumulation) over 1, 2 and 4 processes and three model shapes: a dense model, an MoE model,
   and a deeper, narrower dense one, stratified by model and process count and, within those, by parallelism kind
   (data, tp, ep, pp and their combinations). The halves A and B alternate within each kind, so every kind drawn
   twice is fitted on one half and scored on the other.
2. **Calibrate.** ``lightning-p2r calibrate --processes n`` for n = 1, 2, 4 (or the files of ``--clusters DIR``). On
   this 2-core machine 4 processes are oversubscribed: that is what the calibration sees, and what the runs see.
3. **Measure.** Each layout trains for a few steps (random tokens, one thread per process) in a worker; the
   measured step is rank 0's median optimizer-step interval after warm-up. ``os.getloadavg()`` is recorded beside
   every measurement: the machine is shared and its timings are noisy.
4. **Fit on one half, report on the other.** The constants the calibration cannot measure directly (the
   ``FITTED`` terms of :mod:`lightning_p2r.planning.framework`) are fitted by non-negative least squares on the
   relative error of one half; the other half is predicted with them, and only that half is reported: the median
   and largest |error|, Spearman's rank correlation of predicted and measured step (pooled, and the mean over
   models), and per model how much slower the predicted-best layout measures than the measured-best. Then the
   halves swap.

``--passes N`` measures every layout N times, pass after pass (each pass recalibrating each process count and
keeping the faster of each constant), keeps each layout's fastest pass and reports how far the passes differ.
``--repeat-of CSV`` compares the measurements with an earlier run's of the same layouts (same seed): the
machine's run-to-run noise, a floor under the achievable error. ``--measured CSV`` re-evaluates stored measurements
(the CSV this command writes) without running anything, so a change to the cost model is judged on the same
measurements.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import statistics
from pathlib import Path
from typing import Any

from lightning_p2r.measure.fit_terms import fit_nonnegative, unfitted

STEPS = 8
GLOBAL_BATCH = 8
PROCESSES = (1, 2, 4)
SAMPLES = {1: 6, 2: 15, 4: 15}
"""Layouts drawn per process count, spread evenly over the models (36 in all, 18 per half)."""
_COMMON = {"vocab_size": 256, "max_seq_len": 128, "capacity_factor": None, "init_seed": 0}
MODELS: dict[str, dict[str, Any]] = {
    "dense": _COMMON | {"dim": 128, "num_layers": 4, "num_heads": 4, "moe_layers": []},
    "moe": _COMMON | {"dim": 128, "num_layers": 4, "num_heads": 4, "num_experts": 8, "num_prototypes": 2,
                      "moe_top_k": 1, "moe_layers": [1, 3]},
    "deep": _COMMON | {"dim": 64, "num_layers": 12, "num_heads": 2, "moe_layers": []},
}


def layout_pool(model: str, processes: int) -> list[Any]:
    """Every valid layout of the planner's search space for ``model`` on ``processes`` devices (no memory limit: the
    models are tiny)."""
    from lightning_p2r import M6Config
    from lightning_p2r.planning import Cluster, Workload
    from lightning_p2r.planning.search import candidate_layouts

    config = M6Config(**MODELS[model])
    cluster = Cluster(devices=processes, devices_per_node=processes)
    workload = Workload(global_batch=GLOBAL_BATCH, seq_len=config.max_seq_len)
    return sorted(candidate_layouts(config, cluster, workload), key=lambda layout: layout.describe())


def parallel_kind(layout: Any) -> str:
    """The model-parallel dimensions a layout uses ("tp+pp", "ep", ...), or "data" for data parallelism alone: the
    strata of the draw, so that every kind the fit prices is seen by both halves."""
    kinds = [name for name, degree in (("tp", layout.tensor_parallel), ("ep", layout.expert_parallel),
                                       ("pp", layout.pipeline_parallel)) if degree > 1]
    return "+".join(kinds) or "data"


def sample_layouts(seed: int, samples: dict[int, int] = SAMPLES) -> list[dict[str, Any]]:
    """The seeded draw: per process count, ``samples[n]`` layouts spread over the models (without repeats) and, within
    a model, over the parallelism kinds its pool has (:func:`parallel_kind`, visited in a random order, a random
    layout of each). The halves alternate along the draw grouped by the dimensions it uses, so the layouts using
    each model-parallel dimension (and each kind drawn twice) are split between both halves, and the halves differ in
    size by at most one."""
    rng = random.Random(seed)
    drawn: list[dict[str, Any]] = []
    for processes, count in samples.items():
        for model_index, model in enumerate(MODELS):
            share = count // len(MODELS) + (model_index < count % len(MODELS))
            by_kind: dict[str, list[Any]] = {}
            for layout in layout_pool(model, processes):
                by_kind.setdefault(parallel_kind(layout), []).append(layout)
            kinds = sorted(by_kind)
            rng.shuffle(kinds)
            while share > 0 and any(by_kind.values()):
                for kind in kinds:
                    if share > 0 and by_kind[kind]:
                        layout = by_kind[kind].pop(rng.randrange(len(by_kind[kind])))
                        drawn.append({"model": model, "processes": processes, "layout": layout})
                        share -= 1
    # Alternate the halves along the draw sorted by the dimensions used, expert parallelism first (its terms are the
    # rarest in the pools), so that every layout using one dimension is next to the others using it; the sort is
    # stable, each kind's rows stay in draw order.
    def dimensions(entry: dict[str, Any]) -> tuple[bool, ...]:
        kind = parallel_kind(entry["layout"])
        return tuple(name not in kind for name in ("ep", "tp", "pp")) + (kind,)

    first = rng.randrange(2)
    for position, entry in enumerate(sorted(drawn, key=dimensions)):
        entry["half"] = "AB"[(first + position) % 2]
    return drawn


def layout_options(layout: Any) -> str:
    values = dataclasses.asdict(layout)
    return json.dumps({k: v for k, v in values.items() if v != getattr(type(layout)(), k)}, sort_keys=True)


def layout_of(options: str) -> Any:
    from lightning_p2r.planning.layout import Layout

    values = json.loads(options)
    if values.get("offload_blocks") is not None:
        values["offload_blocks"] = tuple(values["offload_blocks"])
    return Layout(**values)


def best_of(first: Any, second: Any) -> Any:
    """The faster of two calibrations of the same machine, constant by constant (rates: the larger; fixed costs and
    per-parameter times: the smaller): on a shared machine contention only ever makes a measurement slower."""
    values = {}
    for field in dataclasses.fields(first):
        a, b = getattr(first, field.name), getattr(second, field.name)
        if isinstance(a, bool) or not isinstance(a, float):
            continue
        if field.name.endswith(("flops", "bandwidth")):
            values[field.name] = max(a, b)
        elif field.name.endswith(("overhead", "latency", "per_param")):
            values[field.name] = min(a, b)
    return dataclasses.replace(first, **values)


def measure(entry: dict[str, Any], out: Path, steps: int) -> float:
    """Seconds per optimizer step of one sampled layout (the planner benchmark's worker)."""
    from lightning_p2r.measure.run import run_rank_worker

    layout = entry["layout"]
    spec = {"name": f"{entry['model']} {layout.describe()}", "model": MODELS[entry["model"]],
            "devices": entry["processes"], "steps": steps, "global_batch": GLOBAL_BATCH,
            "accumulate_grad_batches": layout.trainer_accumulation, "strategy": layout.strategy_options(),
            "out": str(out / ".planner_cv_run")}
    return run_rank_worker("lightning_p2r.benchmarks.planner", spec, timeout=900)[0]["step_s"]


# ------------------------------------------------------------------------------------------------- evaluation
def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties); NaN for fewer than 3 points."""
    if len(xs) < 3:
        return math.nan

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        result = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                result[order[k]] = (i + j) / 2
            i = j + 1
        return result

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    norm = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / norm if norm else math.nan


def predictions(rows: list[dict[str, Any]], clusters: dict[int, Any]) -> None:
    """Add to each row the cost model's prediction with every fitted term at zero (``base_s``) and each fitted
    term's count (``feature_<name>``): the prediction is ``base_s + sum(coefficient * feature)``."""
    from lightning_p2r import M6Config
    from lightning_p2r.planning import Workload, estimate_step
    from lightning_p2r.planning.framework import FITTED, framework_counts

    for row in rows:
        config = M6Config(**MODELS[row["model"]])
        layout = layout_of(row["options"])
        cluster = clusters[int(row["processes"])].with_devices(int(row["processes"]))
        cluster = unfitted(cluster)
        workload = Workload(global_batch=GLOBAL_BATCH, seq_len=config.max_seq_len)
        row["base_s"] = estimate_step(config, layout, cluster, workload).total
        for name, count in framework_counts(config, layout, cluster, workload).items():
            if name in FITTED:
                row[f"feature_{name}"] = count


def cross_validate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Fit the ``FITTED`` terms on each half and score the other; ``rows`` carry ``base_s`` and the features (see
    :func:`predictions`). Returns the fitted coefficients and the held-out scores per direction, and sets each row's
    ``predicted_s`` and ``error_pct`` to its held-out prediction."""
    from lightning_p2r.planning.framework import FITTED

    result: dict[str, Any] = {}
    for half in ("A", "B"):  # the model without fitted terms, on the same halves: what the fit changes
        base = [r | {"predicted_s": r["base_s"], "error_pct": 100 * (r["base_s"] - r["measured_s"]) / r["measured_s"]}
                for r in rows if r["half"] == half]
        result[f"no fitted terms, half {half}"] = {"coefficients": {}} | scores(base)
    for fit_half, test_half in (("A", "B"), ("B", "A")):
        train = [r for r in rows if r["half"] == fit_half]
        test = [r for r in rows if r["half"] == test_half]
        # Relative errors are what the targets count: weight each row by 1 / measured.
        features = [[r[f"feature_{n}"] / r["measured_s"] for n in FITTED] for r in train]
        residuals = [(r["measured_s"] - r["base_s"]) / r["measured_s"] for r in train]
        coefficients = dict(zip(FITTED, fit_nonnegative(features, residuals) if FITTED else []))
        for r in test:
            r["predicted_s"] = r["base_s"] + sum(c * r[f"feature_{n}"] for n, c in coefficients.items())
            r["error_pct"] = 100 * (r["predicted_s"] - r["measured_s"]) / r["measured_s"]
            r["fitted_on"] = fit_half
        result[f"fit {fit_half}, test {test_half}"] = {"coefficients": coefficients} | scores(test)
    return result


def scores(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Held-out scores: median and largest |error| (%), Spearman (pooled and mean over models), and per model the
    predicted-best layout's measured step over the measured-best's, minus one (%)."""
    errors = [abs(r["error_pct"]) for r in rows]
    by_model: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_model.setdefault(r["model"], []).append(r)
    per_model = {m: spearman([r["predicted_s"] for r in rs], [r["measured_s"] for r in rs])
                 for m, rs in by_model.items()}
    regret = {m: 100 * (min(rs, key=lambda r: r["predicted_s"])["measured_s"] /
                        min(r["measured_s"] for r in rs) - 1) for m, rs in by_model.items()}
    valid = [v for v in per_model.values() if not math.isnan(v)]
    by_processes: dict[str, list[float]] = {}
    for r in rows:
        by_processes.setdefault(str(r["processes"]), []).append(abs(r["error_pct"]))
    return {"layouts": len(rows), "median_abs_error_pct": statistics.median(errors),
            "abs_error_pct_by_processes": {n: {"median": statistics.median(e), "max": max(e), "layouts": len(e)}
                                           for n, e in sorted(by_processes.items())},
            "max_abs_error_pct": max(errors),
            "spearman_pooled": spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]),
            "spearman_per_model": per_model, "spearman_model_mean": statistics.fmean(valid) if valid else math.nan,
            "best_regret_pct": regret, "worst_best_regret_pct": max(regret.values())}


def save_scatter(path: Path, rows: list[dict[str, Any]], title: str) -> None:
    from lightning_p2r.benchmarks.report import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 6), dpi=110)
    for half, color in (("A", "tab:blue"), ("B", "tab:orange")):
        for processes, marker in zip(PROCESSES, "o^s"):
            points = [r for r in rows if r["half"] == half and int(r["processes"]) == processes]
            if points:
                ax.scatter([r["measured_s"] for r in points], [r["predicted_s"] for r in points], c=color,
                           marker=marker, label=f"half {half}, {processes} process(es)", alpha=0.8)
    values = [v for r in rows for v in (r["measured_s"], r["predicted_s"])]
    low, top = min(values) / 1.2, max(values) * 1.2
    ax.plot([low, top], [low, top], color="grey", lw=0.8)
    for band in (0.85, 1.15):  # the 15% target
        ax.plot([low, top], [low * band, top * band], color="grey", lw=0.5, ls="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(low, top)
    ax.set_ylim(low, top)
    ax.set_xlabel("measured s per step")
    ax.set_ylabel("predicted s per step (held-out: fitted on the other half)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    save_figure(fig, path)


def repeatability(rows: list[dict[str, Any]], earlier: list[dict[str, Any]]) -> dict[str, Any]:
    """How far the same layouts measured in an earlier run (its planner_cv.csv rows) are from these: per layout
    |a - b| / min(a, b) in %, the median and the largest. The floor under any prediction's error on this machine."""
    before = {(r["model"], str(r["processes"]), r["layout"]): float(r["measured_s"]) for r in earlier
              if r["measured_s"] not in ("", "nan")}
    differences = [100 * abs(r["measured_s"] - before[key]) / min(r["measured_s"], before[key]) for r in rows
                   if (key := (r["model"], str(r["processes"]), r["layout"])) in before]
    if not differences:
        return {}
    return {"layouts": len(differences), "median_pct": statistics.median(differences),
            "max_pct": max(differences)}


def passes_spread(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """:func:`repeatability` of pass 2 against pass 1 of the same rows (empty with one pass)."""
    if not rows or "pass2_s" not in rows[0]:
        return {}
    first = [r | {"measured_s": float(r["pass1_s"])} for r in rows]
    second = [r | {"measured_s": float(r["pass2_s"])} for r in rows if not math.isnan(float(r["pass2_s"]))]
    return repeatability(second, first)


def print_scores(result: dict[str, Any]) -> None:
    for direction, s in result.items():
        if "coefficients" not in s:  # the passes' or runs' spread, printed where it is measured
            continue
        coefficients = ", ".join(f"{k}={v:.3g}" for k, v in s["coefficients"].items()) or "none"
        per_model = ", ".join(f"{m} {v:+.2f}" for m, v in s["spearman_per_model"].items())
        regret = ", ".join(f"{m} {v:.1f}%" for m, v in s["best_regret_pct"].items())
        processes = ", ".join(f"{n}: {e['median']:.0f}% / {e['max']:.0f}%"
                              for n, e in s["abs_error_pct_by_processes"].items())
        print(f"{direction}: fitted {coefficients}\n  held-out {s['layouts']} layouts: median |error| "
              f"{s['median_abs_error_pct']:.1f}%, largest {s['max_abs_error_pct']:.1f}%, Spearman pooled "
              f"{s['spearman_pooled']:.2f} (per model {per_model}; mean {s['spearman_model_mean']:.2f}), "
              f"predicted-best slower than measured-best by: {regret}\n  median / largest |error| by processes: "
              f"{processes}")


def run(args: Any, cluster_for: Any) -> dict[str, Any]:
    """The protocol (see the module docstring); ``args`` are the planner benchmark's parsed options and
    ``cluster_for(processes)`` the cluster of that many processes. It is asked for each process count just before
    that count's layouts run (the draw is ordered by processes), so a calibration and the runs it prices see the
    shared machine's load close together in time."""
    import csv

    from lightning_p2r.benchmarks.report import environment_info, print_environment, print_table, write_csv

    out = Path(args.out)
    env = environment_info("cpu")
    print_environment(env)
    if args.measured:
        with open(args.measured, encoding="utf-8") as file:
            rows = [{k: v for k, v in r.items() if not k.startswith(("base_s", "feature_", "predicted_s",
                                                                     "error_pct", "fitted_on"))}
                    for r in csv.DictReader(file)]
        for r in rows:
            r["measured_s"] = float(r["measured_s"]) if r["measured_s"] not in ("", "nan") else math.nan
    else:
        rows = []
        entries = sample_layouts(args.seed)
        passes = max(1, getattr(args, "passes", 1))
        for number in range(1, passes + 1):
            calibrated: set[int] = set()
            for index, entry in enumerate(entries):
                if entry["processes"] not in calibrated:
                    cluster_for(entry["processes"], refresh=number > 1)
                    calibrated.add(entry["processes"])
                if number == 1:
                    rows.append({"model": entry["model"], "processes": entry["processes"], "half": entry["half"],
                                 "layout": entry["layout"].describe(), "options": layout_options(entry["layout"]),
                                 "measured_s": math.inf, "status": "ok", "load_avg_1m": 0.0})
                row = rows[index]
                load = os.getloadavg()[0]
                try:
                    seconds = round(measure(entry, out, args.steps), 5)
                except Exception as error:  # noqa: BLE001 - a failed layout is reported, not fatal to the protocol
                    seconds, row["status"] = math.nan, f"failed: {str(error)[-300:]!r}"
                row[f"pass{number}_s"] = seconds
                row[f"pass{number}_load_avg_1m"] = round(max(load, os.getloadavg()[0]), 2)
                # The fastest pass counts (contention only slows a run down); a failure in any pass drops the layout.
                row["measured_s"] = min(row["measured_s"], seconds) if not math.isnan(seconds) else math.nan
                row["load_avg_1m"] = max(row["load_avg_1m"], row[f"pass{number}_load_avg_1m"])
                print(f"pass {number}: {row['model']} x{row['processes']} {row['layout']}: {seconds} s "
                      f"(load {row[f'pass{number}_load_avg_1m']}) {row['status'] if row['status'] != 'ok' else ''}",
                      flush=True)
                write_csv(rows, out / "planner_cv.csv")  # after every run: an interrupted protocol keeps what it has
    measured = [r for r in rows if not math.isnan(r["measured_s"])]
    predictions(measured, {n: cluster_for(n) for n in PROCESSES})
    result = cross_validate(measured)
    spread = passes_spread(rows)
    print_table(measured, ["half", "model", "processes", "layout", "measured_s", "base_s", "predicted_s",
                           "error_pct", "load_avg_1m"])
    print_scores(result)
    if spread:
        result["passes"] = spread
        print(f"pass 2 against pass 1, the same layouts: median difference {spread['median_pct']:.0f}%, largest "
              f"{spread['max_pct']:.0f}% ({spread['layouts']} layouts)")
    if args.repeat_of:
        with open(args.repeat_of, encoding="utf-8") as file:
            result["repeatability"] = repeatability(measured, list(csv.DictReader(file)))
        if result["repeatability"]:
            print(f"the same layouts measured by {args.repeat_of}: median difference "
                  f"{result['repeatability']['median_pct']:.0f}%, largest {result['repeatability']['max_pct']:.0f}% "
                  f"({result['repeatability']['layouts']} layouts)")
    failed = len(rows) - len(measured)
    if failed:
        print(f"{failed} sampled layouts failed to run and are left out")
    for r in measured:
        for key in ("base_s", "predicted_s", "error_pct"):
            r[key] = round(r[key], 4)
    measured_keys = {id(r) for r in measured}
    write_csv([{"env_load_avg_1m_at_report": env["load_avg_1m"]} | r for r in measured] +
              [r for r in rows if id(r) not in measured_keys], out / "planner_cv.csv")
    (out / "planner_cv_scores.json").write_text(json.dumps(result, indent=1, default=float))
    save_scatter(out / "planner_cv.png", measured, "Planner cross-validation (CPU): each point predicted with the "
                 "terms fitted on the other half")
    return {"rows": measured, "scores": result}
