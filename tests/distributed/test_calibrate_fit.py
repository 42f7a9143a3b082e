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


def _fsdp_collective_worker(rank: int, port: int, queue) -> None:  # noqa: ANN001 (a spawn target)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_p2r.measure.module_hooks import fsdp_collective_timings, own_rank_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        device = torch.device("cpu")
        extra = fsdp_collective_timings(device, own_rank_mesh(device), init_device_mesh("cpu", (2,)), repeats=5)
        if rank == 0:
            queue.put(extra)
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fsdp2s_collectives_cost_more_over_two_ranks_than_over_each_rank_alone() -> None:
    """``fsdp_collective_overhead``'s measurement (issue 41 item 1): the sharded stack over both ranks issues real
    gathers and reduce-scatters (ZeRO-3 more of them), which a one-rank mesh does not, so each arm is slower over
    both; with nothing priced for the link, the cost per call is that whole difference over the calls."""
    import torch.multiprocessing as mp

    from lightning_p2r.measure.calibrate import _free_port
    from lightning_p2r.measure.module_hooks import COLLECTIVE_ARMS, HOOK_UNITS, collective_call_overhead

    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_fsdp_collective_worker, args=(_free_port(), queue), nprocs=2, join=True)
    extra = queue.get()
    assert set(extra) == set(COLLECTIVE_ARMS) and all(seconds > 0 for seconds in extra.values())
    calls = {arm: HOOK_UNITS * (gathers + reduces) for arm, (_, gathers, reduces) in COLLECTIVE_ARMS.items()}
    per_call = collective_call_overhead(extra, 0.0, 0.0)
    assert per_call == pytest.approx(sum(extra[arm] / calls[arm] for arm in extra) / 2)
    assert 0 < per_call < 0.1
