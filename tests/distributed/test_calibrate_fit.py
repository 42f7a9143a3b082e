"""``lightning-p2r calibrate --processes 2`` fits the framework waits from timed probe layouts (issue 41 item 1): the
probes train on two processes, every fitted term gets a value and a spread, and the planner's estimate with the
fitted file is the unfitted estimate plus exactly the fitted terms' time."""

import pytest

from lightning_p2r.measure.fit_terms import fit_framework_terms, probe_workload
from lightning_p2r.planning.cluster import Cluster
from lightning_p2r.planning.framework import FITTED
from lightning_p2r.planning.step_time import estimate_step


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_calibrate_fits_every_framework_term_from_two_process_probes() -> None:
    cluster = Cluster(accelerator="cpu", devices=2, devices_per_node=2, overlap_collectives=False,
                      overlap_copies=False, operator_overhead=20e-6, step_overhead=0.01)
    fitted, probes = fit_framework_terms(cluster, quick=True, steps=4, threads=1, log=lambda _: None)
    assert len(probes) >= len(FITTED)
    assert all(p.measured_s > 0 and p.base_s > 0 for p in probes)
    assert set(fitted.fitted_spread) == set(FITTED)
    for term in FITTED:
        low, high = fitted.fitted_spread[term]
        assert 0 <= low <= high and getattr(fitted, term) >= 0
    config, workload = probe_workload()
    # The fitted file prices the probes at their unfitted estimate plus each term's count times its value.
    for probe in probes:
        expected = probe.base_s + sum(getattr(fitted, t) * probe.counts[t] for t in FITTED)
        assert estimate_step(config, probe.layout, fitted, workload).total == pytest.approx(expected, rel=1e-9)



@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_calibrate_fits_the_offloaded_copies_bandwidth_on_two_processes() -> None:
    """The copy probes train on two processes (data parallel, every block offloaded, and resident), and the fitted
    bandwidth is never above the copy alone's; the header line says which figure stands."""
    from lightning_p2r.measure.offload_copies import fit_copy_bandwidth

    cluster = Cluster(accelerator="cpu", devices=2, devices_per_node=2, overlap_collectives=False,
                      overlap_copies=False, host_device_bandwidth=20e9)
    lines: list[str] = []
    fitted, line = fit_copy_bandwidth(cluster, quick=True, threads=1, log=lines.append)
    assert len(lines) == 2 and all("ms per step" in logged for logged in lines)  # one round of each probe
    assert 0 < fitted.host_device_bandwidth <= cluster.host_device_bandwidth
    assert line.startswith("host_device_bandwidth: ") and "20.0 GB/s" in line
