"""The collectives' bandwidth and latency among this machine's processes for ``lightning-p2r calibrate``: every device
probe run in each process at once (they share the machine as training processes do), then each collective kind timed
over several payloads and fitted to a ring's line.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from ..planning.network import ring_terms
from .device_probes import device_constants
from .module_hooks import module_hook_seconds, own_rank_mesh
from .run import core_share, free_port, median_seconds

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
"""The collective kinds ``calibrate`` times (``send`` is priced at all-reduce's bandwidth)."""


def collective_fit(kind: str, ranks: int, payloads: list[float], seconds: list[float]) -> tuple[float, float]:
    """(bus bandwidth in bytes/s, latency per ring step in s) of one collective kind among ``ranks`` ranks, from its
    times at several payloads: a least-squares line through (payload, seconds), whose slope is the ring's share of
    the payload over the bandwidth and whose intercept is its latency steps times the latency. Noise never makes
    the latency negative; times that do not grow with the payload give the fastest time as latency and the largest
    payload's time as its bandwidth's bound."""
    if len(payloads) != len(seconds) or len(set(payloads)) < 2:
        raise ValueError("the fit needs times at two or more different payloads")
    share, steps = ring_terms(kind, ranks)
    mean_p, mean_s = sum(payloads) / len(payloads), sum(seconds) / len(seconds)
    slope = (sum((p - mean_p) * (t - mean_s) for p, t in zip(payloads, seconds))
             / sum((p - mean_p) ** 2 for p in payloads))
    intercept = max(mean_s - slope * mean_p, 0.0)
    if slope <= 0:  # times that do not grow with the payload: latency-bound, bandwidth no better than the largest's
        largest = max(range(len(payloads)), key=payloads.__getitem__)
        intercept, slope = min(seconds), seconds[largest] / payloads[largest]
    return share / slope, intercept / steps


def measure_processes(processes: int, threads: int, quick: bool) -> dict[str, float]:
    """:func:`device_constants` measured in ``processes`` local processes at once (on a CPU-only machine they share
    memory bandwidth and caches, as training processes do), averaged, plus each collective kind's bus bandwidth
    among them (:func:`collective_fit` over several message sizes; all-reduce's is the link's, the other kinds' are
    kept relative to it in ``collective_factors``) and the link's latency per ring step, from the mean of small
    all-reduces (:func:`latency_per_step`). Every kind is priced at that latency: pricing each at its own fitted
    latency made the cross-validation's held-out errors larger (docs/planning.md)."""
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(processes, free_port(), threads, quick, queue), nprocs=processes, join=True)
    measured = queue.get()
    payloads = [4.0 * elements for elements in collective_sizes(quick, processes)]
    fits = {}
    for kind in COLLECTIVES:
        times = [measured.pop(f"{kind}@{index}") for index in range(len(payloads))]
        fits[kind] = collective_fit(kind, processes, payloads, times)
    bandwidth, _ = fits.pop("all_reduce")
    latency = latency_per_step(measured.pop("small_all_reduce_mean"), "all_reduce", processes)
    return measured | {
        "intra_node_bandwidth": bandwidth, "intra_node_latency": latency,
        "collective_factors": {kind: round(fit[0] / bandwidth, 3) for kind, fit in fits.items()}}


def collective_sizes(quick: bool, processes: int) -> list[int]:
    """Elements per collective: a tiny message (latency), a medium one and a large one (bandwidth), each a multiple
    of ``processes`` so that every rank's part of a gather or reduce-scatter is whole."""
    large = 2**18 if quick else 2**22
    return [-(-elements // processes) * processes for elements in (1, large // 64, large)]


def _worker(rank: int, processes: int, port: int, threads: int, quick: bool, queue: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    use_nccl = torch.cuda.is_available() and torch.cuda.device_count() >= processes
    device = torch.device("cuda", rank) if use_nccl else torch.device("cpu")
    if use_nccl:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_nccl else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=processes)
    try:
        dist.barrier()
        constants, constants["core_share"] = core_share(lambda: device_constants(device, quick), threads)
        constants["module_hook_overhead"] = module_hook_seconds(device, own_rank_mesh(device), 5 if quick else 15)
        repeats = 3 if quick else 20
        rounds = LATENCY_ROUNDS_QUICK if quick else LATENCY_ROUNDS
        # The latency is timed in windows spread over the collective timings and their median kept: on a 2-core
        # CPU one window's mean ranged over 0.2-0.56 ms within a run, and one window per calibration gave 0.22 to
        # 0.80 ms from one run to the next.
        windows = [small_all_reduce_mean(device, rounds)]
        for index, elements in enumerate(collective_sizes(quick, processes)):
            # Tiny messages are noisier: more repetitions where they cost little.
            times = _time_collectives(elements, processes, device, repeats * (5 if index == 0 else 1))
            constants |= {f"{kind}@{index}": seconds for kind, seconds in times.items()}
            windows.append(small_all_reduce_mean(device, rounds))
        constants["small_all_reduce_mean"] = statistics.median(windows)
        flat = flat_constants(constants)  # the ranks' values are averaged as one tensor
        names = sorted(flat)
        values = torch.tensor([flat[name] for name in names], dtype=torch.float64, device=device)
        dist.all_reduce(values)
        if rank == 0:
            queue.put(nested_constants({name: float(value) / processes for name, value in zip(names, values.tolist())}))
    finally:
        dist.destroy_process_group()


def flat_constants(constants: dict[str, Any]) -> dict[str, float]:
    """``constants`` with each mapping of timings (``hf_layer_overheads``) spread into ``name/key`` entries."""
    flat: dict[str, float] = {}
    for name, value in constants.items():
        if isinstance(value, dict):
            flat |= {f"{name}/{key}": seconds for key, seconds in value.items()}
        else:
            flat[name] = value
    return flat


def nested_constants(flat: dict[str, float]) -> dict[str, Any]:
    """The inverse of :func:`flat_constants`."""
    nested: dict[str, Any] = {}
    for name, value in flat.items():
        outer, _, key = name.partition("/")
        if key:
            nested.setdefault(outer, {})[key] = value
        else:
            nested[name] = value
    return nested


def small_all_reduce_mean(device: torch.device, rounds: int) -> float:
    """One window of the latency measurement: the mean call of ``LATENCY_CALLS`` back-to-back all-reduces of each of
    ``LATENCY_ELEMENTS``, the median of ``rounds`` rounds per size, averaged over the sizes."""
    return sum(statistics.median(mean_call_seconds(_all_reduce_of(elements, device), calls=LATENCY_CALLS,
                                                   device=device) for _ in range(rounds))
               for elements in LATENCY_ELEMENTS) / len(LATENCY_ELEMENTS)


LATENCY_ELEMENTS = (256, 4096)
"""fp32 elements of the all-reduces timed for the latency: small enough that bandwidth adds little (16 KB at most),
not so small that gloo takes its path for a few elements, which is faster than what training's messages see."""
LATENCY_CALLS = 50
"""Back-to-back calls per timed round of the latency: about what a training step issues."""
LATENCY_ROUNDS = 7
"""Rounds per size; their median counts, as the benchmarks' median step does (``--quick``: 3)."""
LATENCY_ROUNDS_QUICK = 3


def latency_per_step(seconds_per_call: float, kind: str, ranks: int) -> float:
    """The latency per ring step of a collective whose small calls take ``seconds_per_call`` on average among
    ``ranks`` ranks: that time over its latency steps (:func:`~lightning_p2r.planning.network.ring_terms`)."""
    if seconds_per_call < 0:
        raise ValueError(f"seconds_per_call must be >= 0, got {seconds_per_call}")
    return seconds_per_call / max(1, ring_terms(kind, ranks)[1])


def mean_call_seconds(fn: Any, *, calls: int, device: torch.device, warmup: int = 10) -> float:
    """The mean wall time of ``calls`` back-to-back calls of ``fn`` (after ``warmup``): every call counts, the
    slow ones too."""
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / calls


def _all_reduce_of(elements: int, device: torch.device) -> Any:
    import torch.distributed as dist

    tensor = torch.ones(elements, device=device)
    return lambda: dist.all_reduce(tensor)


def _time_collectives(elements: int, processes: int, device: torch.device, repeats: int) -> dict[str, float]:
    """The median seconds of each collective kind over a message of ``elements`` fp32 values."""
    import torch.distributed as dist

    # The names torch 2.13 prefers, where it has them (the older ones warn).
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    whole = torch.ones(elements, device=device)
    part, gathered = torch.ones(elements // processes, device=device), torch.empty(elements, device=device)
    times = {}
    for kind, run in (("all_reduce", lambda: dist.all_reduce(whole)),
                      ("all_gather", lambda: gather(gathered, part)),
                      ("reduce_scatter", lambda: scatter(part, whole)),
                      ("all_to_all", lambda: dist.all_to_all_single(gathered, whole)),
                      ("broadcast", lambda: dist.broadcast(whole, 0))):
        dist.barrier()
        times[kind] = median_seconds(run, iters=repeats, device=device)
    return times


def one_process_hooks(device: torch.device, quick: bool) -> float:
    """:func:`module_hook_seconds` in this process, inside a process group of its own for the while (FSDP2 needs
    one), or the one it already runs in."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    repeats = 5 if quick else 15
    if dist.is_initialized():
        return module_hook_seconds(device, own_rank_mesh(device), repeats)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1)
    try:
        return module_hook_seconds(device, init_device_mesh(device.type, (1,)), repeats)
    finally:
        dist.destroy_process_group()


