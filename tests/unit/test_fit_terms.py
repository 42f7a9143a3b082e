"""``lightning-p2r calibrate`` fits the cost model's framework waits on the user's machine (issue 41 item 1): the probe
layouts it times, the fit and its spread, and the cluster file that carries them (timing itself: the distributed
test ``tests/distributed/test_calibrate_fit.py``)."""

import random

import pytest

from lightning_p2r.measure.fit_terms import (
    Probe,
    describe_fit,
    fit_terms,
    predicted_probe,
    probe_layouts,
    probe_workload,
    unfitted,
)
from lightning_p2r.planning.cluster import Cluster, load_cluster, write_cluster
from lightning_p2r.planning.framework import FITTED, framework_counts, missing_terms
from lightning_p2r.planning.layout import Layout


def _cpu_cluster(devices: int) -> Cluster:
    return Cluster(accelerator="cpu", devices=devices, devices_per_node=devices, overlap_collectives=False,
                   overlap_copies=False)


@pytest.mark.parametrize("per_term", [1, 2])
def test_the_probes_count_every_fitted_term_on_two_processes(per_term) -> None:
    cluster = _cpu_cluster(2)
    config, workload = probe_workload()
    layouts = probe_layouts(cluster, per_term)
    assert len(layouts) == len(set(layouts)) <= per_term * len(FITTED)
    for term in FITTED:
        counting = [layout for layout in layouts if framework_counts(config, layout, cluster, workload)[term] > 0]
        assert len(counting) >= per_term, (term, [layout.describe() for layout in layouts])


def test_each_terms_second_probe_is_where_that_term_is_the_largest_share_of_the_step() -> None:
    """The second probe of a term is the layout like the simplest one (the same other fitted terms) that counts the
    term most per second of the unfitted step, so the fit reads it off a step it dominates: for the blocking wait on
    two CPU processes, a ZeRO-3 layout (tens of waits), not ZeRO-1's few."""
    from lightning_p2r.planning.search import candidate_layouts
    from lightning_p2r.planning.step_time import estimate_step

    cluster = _cpu_cluster(2)
    config, workload = probe_workload()
    zeroed = unfitted(cluster)
    pool = list(candidate_layouts(config, cluster, workload))
    counts = {layout: framework_counts(config, layout, cluster, workload) for layout in pool}

    def share(layout: Layout, term: str) -> float:
        return counts[layout][term] / estimate_step(config, layout, zeroed, workload).total

    def others(layout: Layout, term: str) -> set[str]:
        return {t for t in FITTED if t != term and counts[layout][t] > 0}

    simplest, second = probe_layouts(cluster, 1), probe_layouts(cluster, 2)
    for term in FITTED:
        # The term's own simplest probe: a probe chosen for another term may count it too, with more other terms.
        first = min((layout for layout in simplest if counts[layout][term] > 0),
                    key=lambda layout: len(others(layout, term)))
        alike = [layout for layout in pool if counts[layout][term] > 0 and layout != first
                 and others(layout, term) == others(first, term)]
        best = max(share(layout, term) for layout in alike)
        assert any(share(layout, term) == best for layout in second if layout in alike), term
    # Plain data parallelism waits twice per step; its second probe waits many times more.
    term = "blocking_collective_overhead"
    blocking = sorted(counts[layout][term] for layout in second
                      if counts[layout][term] > 0 and not others(layout, term))
    assert blocking[0] == 2 and blocking[-1] >= 8 * 2


def test_one_process_has_nothing_to_fit() -> None:
    assert probe_layouts(_cpu_cluster(1)) == []
    assert fit_terms([]) == ({}, {})


def _synthetic(truth: dict[str, float], noise: float, seed: int) -> list[Probe]:
    """Probes of the real probe layouts whose measured step is the unfitted prediction plus ``truth``'s terms, times a
    relative noise of up to ``noise``."""
    rng = random.Random(seed)
    cluster = _cpu_cluster(2)
    probes = []
    for layout in probe_layouts(cluster):
        base = predicted_probe(layout, cluster, 1.0)
        exact = base.base_s + sum(truth[t] * base.counts[t] for t in FITTED)
        probes.append(predicted_probe(layout, cluster, exact * (1 + rng.uniform(-noise, noise))))
    return probes


def test_the_fit_recovers_known_terms_and_its_spread_brackets_them() -> None:
    truth = {"stage_overhead": 2e-3, "dtensor_overhead": 2e-5, "blocking_collective_overhead": 8e-4,
             "expert_wait_overhead": 9e-4}
    values, spread = fit_terms(_synthetic(truth, 0.0, 0))
    assert set(values) == set(spread) == set(FITTED)
    for term in FITTED:
        assert values[term] == pytest.approx(truth[term], rel=1e-6)
        assert spread[term][0] == pytest.approx(truth[term], rel=1e-6)
    values, spread = fit_terms(_synthetic(truth, 0.05, 1))
    for term in FITTED:
        low, high = spread[term]
        assert 0 <= low <= high
        assert low <= values[term] * 1.5 + 1e-9 and high >= values[term] / 1.5 - 1e-9
    # With noise the largest terms are still found within a factor (each has probes where it is a large share).
    assert values["dtensor_overhead"] == pytest.approx(truth["dtensor_overhead"], rel=0.5)


def test_terms_no_probe_counts_are_left_out() -> None:
    only_blocking = dict.fromkeys(FITTED, 0.0)
    probes = [Probe(Layout(), 1.0, 0.5, only_blocking | {"blocking_collective_overhead": 10.0}),
              Probe(Layout(micro_batches=2), 2.0, 1.0, only_blocking | {"blocking_collective_overhead": 20.0})]
    values, spread = fit_terms(probes)
    assert values == {"blocking_collective_overhead": pytest.approx(0.05)}
    assert list(spread) == ["blocking_collective_overhead"]


def test_the_fit_never_goes_negative() -> None:
    # Measured faster than predicted: the terms can only add time, so the fit is 0 (and says it was fitted).
    probes = [Probe(Layout(micro_batches=i + 1), 1.0, 1.2, dict.fromkeys(FITTED, float(i + 1))) for i in range(5)]
    values, spread = fit_terms(probes)
    assert all(v == 0 for v in values.values())
    assert all(s == [0.0, 0.0] for s in spread.values())


def test_a_fitted_file_round_trips_and_stops_the_missing_term_warning(tmp_path) -> None:
    cluster = _cpu_cluster(2)
    fitted = Cluster(**{**cluster.to_dict(), "dtensor_overhead": 2e-5, "stage_overhead": 0.0,
                        "fitted_spread": {"dtensor_overhead": [1e-5, 3e-5], "stage_overhead": [0.0, 1e-4]}})
    path = tmp_path / "cluster.yaml"
    write_cluster(fitted, path, describe_fit(fitted))
    assert load_cluster(path) == fitted
    assert "dtensor_overhead: 20 us (10-30 us)" in path.read_text()
    config, workload = probe_workload()
    layouts = [Layout(tensor_parallel=2), Layout(pipeline_parallel=2, micro_batches=2)]
    assert set(missing_terms(config, layouts, cluster, workload)) >= {"stage_overhead", "dtensor_overhead"}
    # A term fitted to 0 is known, not missing; one never fitted still is.
    missing = missing_terms(config, layouts, fitted, workload)
    assert "stage_overhead" not in missing and "dtensor_overhead" not in missing
    assert "blocking_collective_overhead" in missing


@pytest.mark.parametrize("spread", [{"matmul_overhead": [0.0, 1.0]}, {"stage_overhead": [2.0, 1.0]},
                                    {"stage_overhead": [-1.0, 1.0]}, {"stage_overhead": 1.0},
                                    {"stage_overhead": [0.0, float("nan")]}])
def test_a_bad_spread_is_refused_naming_the_field(spread) -> None:
    with pytest.raises(ValueError, match="fitted_spread"):
        Cluster(fitted_spread=spread)


def test_describe_fit_says_when_nothing_was_fitted() -> None:
    assert "one process" in describe_fit(_cpu_cluster(1))
    # Two processes with --no-fit: the reason is the flag, not the process count.
    assert "--no-fit" in describe_fit(_cpu_cluster(2), skipped=True)
    assert "one process" not in describe_fit(_cpu_cluster(2))


def test_each_probe_is_timed_in_rounds_and_fitted_at_its_median(monkeypatch) -> None:
    """``calibrate`` times the probes in turn (1, 2, ..., K, then again), ``rounds`` times (three by default), and the
    fit reads each probe's median: a probe slowed once by something else on the machine moves one round, not its
    fitted value. ``--quick`` times each once."""
    import lightning_p2r.measure.trial as trial
    from lightning_p2r.measure.fit_terms import PROBE_ROUNDS, fit_framework_terms

    cluster = _cpu_cluster(2)
    layouts = probe_layouts(cluster)
    calls: list[str] = []

    def timed(spec: dict) -> float:  # probe i's rounds: (i + 1) x 10 ms x (1.0, 1.1, 0.9); its first probe slowed once
        round_, index = divmod(len(calls), len(layouts))
        calls.append(spec["name"])
        return (index + 1) * 0.01 * (5.0 if (index, round_) == (0, 1) else (1.0, 1.1, 0.9)[round_])

    monkeypatch.setattr(trial, "run_trial", timed)
    fitted, probes = fit_framework_terms(cluster, threads=1, rounds=3, log=lambda _: None)
    assert calls == [layout.describe() for layout in layouts] * 3
    assert [p.layout for p in probes] == layouts
    assert probes[0].rounds_s == pytest.approx((0.01, 0.05, 0.009))
    assert [p.measured_s for p in probes] == pytest.approx([(i + 1) * 0.01 for i in range(len(layouts))])
    assert set(fitted.fitted_spread) == set(FITTED)
    calls.clear()
    _, default = fit_framework_terms(cluster, threads=1, log=lambda _: None)
    assert len(calls) == PROBE_ROUNDS * len(layouts) == 3 * len(default)
    calls.clear()
    _, quick = fit_framework_terms(cluster, threads=1, quick=True, log=lambda _: None)
    assert len(calls) == len(quick) and all(p.rounds_s == () for p in quick)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="probe rounds must be at least 1"):
            fit_framework_terms(cluster, threads=1, rounds=bad, log=lambda _: None)


def test_a_probe_that_fails_is_left_out_and_the_fit_goes_on(monkeypatch) -> None:
    """A layout that cannot run on the user's machine costs neither the minutes already measured nor the other
    terms: it is tried once, named in a warning, and left out of the fit; a term only it counted stays unfitted, so
    ``plan`` warns where a layout counts it."""
    import subprocess

    import lightning_p2r.measure.trial as trial
    from lightning_p2r.measure.fit_terms import fit_framework_terms

    cluster = _cpu_cluster(2)
    layouts = probe_layouts(cluster)  # as the fit picks them, two per term
    config, workload = probe_workload()
    # The probes that count the expert wait all fail (one by an error, one by a timeout, if there are two).
    failing = [layout for layout in layouts
               if framework_counts(config, layout, cluster, workload)["expert_wait_overhead"] > 0]
    assert failing
    calls: list[str] = []

    def timed(spec: dict) -> float:
        calls.append(spec["name"])
        if spec["name"] == failing[0].describe():
            raise RuntimeError(f"{spec['name']} failed: not enough memory\nTraceback (most recent call last): ...")
        if spec["name"] in {layout.describe() for layout in failing[1:]}:
            raise subprocess.TimeoutExpired("python", 1800)
        return 0.05

    monkeypatch.setattr(trial, "run_trial", timed)
    logged: list[str] = []
    fitted, probes = fit_framework_terms(cluster, threads=1, rounds=2, log=logged.append)
    for layout in failing:
        assert calls.count(layout.describe()) == 1  # not tried again in the second round
    assert [p.layout for p in probes] == [layout for layout in layouts if layout not in failing]
    assert "expert_wait_overhead" not in fitted.fitted_spread
    assert {"stage_overhead", "dtensor_overhead", "blocking_collective_overhead"} <= set(fitted.fitted_spread)
    warnings = [line for line in logged if line.startswith("warning:")]
    assert len(warnings) == len(failing) and "not enough memory" in warnings[0] and "Traceback" not in warnings[0]


def test_the_step_range_moves_each_fitted_term_to_the_ends_of_its_spread() -> None:
    """``plan``'s step_low_s / step_high_s: the prediction with every fitted term at the low, then the high, end of
    its leave-one-out range; the estimate is linear in the terms, so each end is the prediction plus each count
    times the distance to that end. A layout that counts none, or a file without a spread, gives the prediction."""
    from lightning_p2r.planning.step_time import estimate_step, fitted_step_range

    config, workload = probe_workload()
    values = {"stage_overhead": 600e-6, "dtensor_overhead": 400e-6, "blocking_collective_overhead": 1e-3,
              "expert_wait_overhead": 800e-6}
    spread = {"stage_overhead": [300e-6, 2e-3], "dtensor_overhead": [380e-6, 450e-6],
              "blocking_collective_overhead": [0.9e-3, 1.4e-3], "expert_wait_overhead": [0.0, 1.6e-3]}
    cluster = Cluster(accelerator="cpu", devices=2, devices_per_node=2, overlap_collectives=False, **values,
                      fitted_spread=spread)
    for layout in (Layout(pipeline_parallel=2, micro_batches=2), Layout(tensor_parallel=2), Layout(expert_parallel=2)):
        counts = framework_counts(config, layout, cluster, workload)
        step = estimate_step(config, layout, cluster, workload).total
        low, high = fitted_step_range(config, layout, cluster, workload)
        assert low == pytest.approx(step + sum(counts[t] * (spread[t][0] - values[t]) for t in FITTED))
        assert high == pytest.approx(step + sum(counts[t] * (spread[t][1] - values[t]) for t in FITTED))
        assert low < step < high
    # A fitted value outside its leave-one-out range (non-negative least squares allows it): the range still holds
    # the prediction.
    outside = Cluster(accelerator="cpu", devices=2, devices_per_node=2, overlap_collectives=False,
                      **(values | {"stage_overhead": 3e-3}), fitted_spread=spread)
    layout = Layout(pipeline_parallel=2, micro_batches=2)
    low, high = fitted_step_range(config, layout, outside, workload)
    assert low < estimate_step(config, layout, outside, workload).total == pytest.approx(high)
    # One process counts no fitted term; a file without a spread has no range to move in.
    one = Cluster(accelerator="cpu", devices=1, devices_per_node=1, **values, fitted_spread=spread)
    step = estimate_step(config, Layout(), one, workload).total
    assert fitted_step_range(config, Layout(), one, workload) == (pytest.approx(step), pytest.approx(step))
    bare = _cpu_cluster(2)
    step = estimate_step(config, Layout(tensor_parallel=2), bare, workload).total
    assert fitted_step_range(config, Layout(tensor_parallel=2), bare, workload) == (step, step)
