"""``calibrate`` prices an offloaded block's copies at the bandwidth they reach inside training on a CPU-only machine
(issue 41 item 1: one-process offloaded layouts were priced 13% short in the median over four held-out draws): the
copies land in freshly allocated pages there, which a copy into a reused buffer does not see."""

import dataclasses

import pytest

from lightning_p2r.measure import offload_copies
from lightning_p2r.measure.offload_copies import (
    copied_bytes,
    copy_probe_layouts,
    copy_probe_workload,
    fit_copy_bandwidth,
    fitted_copy_bandwidth,
)
from lightning_p2r.planning.cluster import Cluster
from lightning_p2r.planning.step_time import estimate_step


def _cpu(devices: int = 1, bandwidth: float = 50e9) -> Cluster:
    return Cluster(accelerator="cpu", devices=devices, devices_per_node=devices, overlap_collectives=False,
                   overlap_copies=False, host_device_bandwidth=bandwidth)


def test_the_probes_differ_only_in_offloading_every_block_and_the_offloaded_one_copies() -> None:
    from lightning_p2r.planning.layout import check_layout

    resident, offloaded = copy_probe_layouts()
    for devices in (1, 2, 3, 4, 8):  # every rank trains the same sequences, on any number of processes
        config, workload = copy_probe_workload(devices)
        assert workload.global_batch == devices * copy_probe_workload()[1].global_batch
        for layout in (resident, offloaded):
            check_layout(layout, config, _cpu(devices), workload)
    assert dataclasses.replace(offloaded, offload_fraction=0.0) == resident and offloaded.offload_fraction == 1.0
    config, workload = copy_probe_workload()
    cluster = _cpu()
    assert copied_bytes(config, resident, cluster, workload) == 0
    # Every micro-batch fetches each block's parameters in its forward and its backward: many MB per step.
    assert copied_bytes(config, offloaded, cluster, workload) > 2 * resident.micro_batches * 4 * 1e6


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("true_bandwidth", [3e9, 7e9, 20e9])
def test_the_fit_recovers_the_bandwidth_a_probe_step_ran_at(devices, true_bandwidth) -> None:
    """Steps made by the cost model itself at a slower copy bandwidth: the fit reads that bandwidth back, whatever
    else the offloaded step costs more (host optimizer, hooks, each copy's latency)."""
    config, workload = copy_probe_workload(devices)
    resident, offloaded = copy_probe_layouts()
    measured_alone = _cpu(devices)
    inside = dataclasses.replace(measured_alone, host_device_bandwidth=true_bandwidth)
    resident_s = estimate_step(config, resident, inside, workload).total
    offloaded_s = estimate_step(config, offloaded, inside, workload).total
    assert fitted_copy_bandwidth(measured_alone, resident_s, offloaded_s) == pytest.approx(true_bandwidth, rel=1e-6)


def test_the_fit_never_prices_copies_faster_than_alone_and_keeps_the_measurement_when_nothing_is_left() -> None:
    config, workload = copy_probe_workload()
    resident, offloaded = copy_probe_layouts()
    cluster = _cpu(bandwidth=10e9)
    resident_s = estimate_step(config, resident, cluster, workload).total
    faster = estimate_step(config, offloaded, dataclasses.replace(cluster, host_device_bandwidth=40e9),
                           workload).total
    assert fitted_copy_bandwidth(cluster, resident_s, faster) == cluster.host_device_bandwidth
    assert fitted_copy_bandwidth(cluster, resident_s, resident_s) is None  # noise: no extra time at all
    assert fitted_copy_bandwidth(cluster, resident_s, 0.5 * resident_s) is None


def test_calibrate_fits_on_cpu_in_rounds_and_says_so_and_leaves_cuda_alone(monkeypatch) -> None:
    config, workload = copy_probe_workload()
    resident, offloaded = copy_probe_layouts()
    cluster = _cpu()
    slow = dataclasses.replace(cluster, host_device_bandwidth=5e9)
    steps = {resident.describe(): estimate_step(config, resident, slow, workload).total,
             offloaded.describe(): estimate_step(config, offloaded, slow, workload).total}
    runs = []

    def run_trial(spec):
        runs.append((spec["name"], spec["devices"], spec["threads"]))
        # A round slowed by something else: the median of three ignores it.
        return steps[spec["name"]] * (3.0 if len(runs) == 2 else 1.0)

    monkeypatch.setattr("lightning_p2r.measure.trial.run_trial", run_trial)
    fitted, line = fit_copy_bandwidth(cluster, rounds=3, threads=1, log=lambda line: None)
    assert [name for name, _, _ in runs] == [resident.describe(), offloaded.describe()] * 3  # in turn
    assert all(devices == 1 and threads == 1 for _, devices, threads in runs)
    assert fitted.host_device_bandwidth == pytest.approx(5e9, rel=1e-6)
    assert "5.0 GB/s inside training" in line and "the copy alone ran at 50.0 GB/s" in line
    runs.clear()
    gpu = dataclasses.replace(cluster, accelerator="cuda", overlap_copies=True)
    assert fit_copy_bandwidth(gpu, log=lambda line: None) == (gpu, "") and not runs
    monkeypatch.setattr(offload_copies, "fitted_copy_bandwidth", lambda *args: None)
    kept, line = fit_copy_bandwidth(cluster, rounds=1, log=lambda line: None)
    assert kept == cluster and "the copy alone (50.0 GB/s)" in line


def test_a_failing_probe_keeps_the_calibration_and_says_why(monkeypatch) -> None:
    def run_trial(spec):
        raise RuntimeError(f"{spec['name']} failed: out of memory\nTraceback ...")

    monkeypatch.setattr("lightning_p2r.measure.trial.run_trial", run_trial)
    cluster = _cpu()
    logged: list[str] = []
    kept, line = fit_copy_bandwidth(cluster, rounds=1, log=logged.append)
    assert kept == cluster
    assert "the copy alone (50.0 GB/s)" in line and "none m4 failed: out of memory" in line
    assert "Traceback" not in line and logged[-1].startswith("warning: the offload copy probes failed")
