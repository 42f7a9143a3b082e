"""The device's own speeds for ``lightning-p2r calibrate``, timed in one process: matmul, attention (by sequence
length and head size), memory and elementwise bandwidth, dropout, one operator's and one matmul call's fixed cost, host
to device copies and the optimizer step (what each is: ``lightning_p2r.measure.calibrate``'s docstring).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..planning.cluster import (
    ELEMENTWISE_LARGE_BYTES,
    ELEMENTWISE_SMALL_BYTES,
    MEMORY_LARGE_BYTES,
)
from ..strategy.host_allocator import retain_freed_host_memory, wants_retained
from .layer_probes import hf_layer_overheads, layer_overheads
from .run import fastest_medians, median_seconds


def matmul_flops(device: torch.device, size: int, repeats: int) -> float:
    """FLOP/s of a linear layer's forward and backward (input and weight gradients: the transposed products
    training runs), on (4 size, size) inputs and a (4 size, size) weight, fp32 on CPU, bf16 on CUDA."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(4 * size, size, device=device, dtype=dtype, requires_grad=True)
    weight = torch.randn(4 * size, size, device=device, dtype=dtype, requires_grad=True)

    def step() -> None:
        torch.nn.functional.linear(x, weight).sum().backward()

    seconds = median_seconds(step, iters=repeats, device=device)
    return 3 * 2 * (4 * size) * size * (4 * size) / seconds


def attention_flops(device: torch.device, seq_len: int, repeats: int) -> float:
    """FLOP/s of causal scaled-dot-product attention forward and backward (8 sequences, 4 heads of 64), counted as
    the cost model counts it: 4 x keys attended x head size per query and head, times three."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = (torch.randn(8, 4, seq_len, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

    def step() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    seconds = median_seconds(step, iters=repeats, device=device)
    return 3 * 8 * 4 * seq_len * 4 * (seq_len + 1) / 2 * 64 / seconds


ATTENTION_GRID = {"cpu": ((32, 64, 128, 256), (8, 16, 32, 64)), "cuda": ((256, 1024, 4096), (64, 128))}
"""Sequence lengths and head sizes of ``Cluster.attention_rates``, by device type: what models trained there use."""
ATTENTION_GRID_QUICK = {"cpu": ((32, 128), (8, 64)), "cuda": ((256, 1024), (64, 128))}
_RATE_KEY = "attention_rate@"


def attention_rate(device: torch.device, seq_len: int, head_dim: int, repeats: int) -> float:
    """Marginal FLOP/s of causal scaled-dot-product attention, forward and backward, at ``seq_len`` and
    ``head_dim``: the time 8 sequences of 4 heads take beyond 2 sequences, against the FLOPs the cost model counts
    for the 24 added sequence-heads. The difference leaves out the kernel's fixed cost per call, which the layer's
    fixed cost (``dense_layer_overhead``, timed on the model's own code) already holds. Each size keeps its faster
    of two rounds."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def step_of(sequences: int) -> Callable[[], None]:
        q, k, v = (torch.randn(sequences, 4, seq_len, head_dim, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    seconds = fastest_medians({"few": step_of(2), "many": step_of(8)}, device, repeats, rounds=2)
    flops = 3 * seq_len * 4 * (seq_len + 1) / 2 * head_dim * 24
    added = seconds["many"] - seconds["few"]
    if added <= 0:  # timing noise: the average rate of the larger run instead
        added = seconds["many"] * 24 / 32
    return flops / added


def attention_rates(device: torch.device, quick: bool, repeats: int) -> dict[str, float]:
    """:func:`attention_rate` on the device's grid (``ATTENTION_GRID``), keyed ``attention_rate@SEQxHEAD`` so that
    the processes' values average like every other constant; :func:`rate_rows` turns them into the cluster's rows."""
    grid = (ATTENTION_GRID_QUICK if quick else ATTENTION_GRID)["cuda" if device.type == "cuda" else "cpu"]
    return {f"{_RATE_KEY}{seq}x{head}": attention_rate(device, seq, head, repeats)
            for seq in grid[0] for head in grid[1]}


def rate_rows(measured: dict[str, Any]) -> list[list[float]]:
    """Pop the ``attention_rate@SEQxHEAD`` entries of ``measured`` into ``Cluster.attention_rates`` rows."""
    rows = []
    for key in [k for k in measured if k.startswith(_RATE_KEY)]:
        seq, head = key[len(_RATE_KEY):].split("x")
        rows.append([int(seq), int(head), float(measured.pop(key))])
    return sorted(rows)


def memory_bandwidth(device: torch.device, elements: int, repeats: int) -> float:
    """Bytes/s of plain memory traffic: an add of large tensors (two read, one written)."""
    a, b = torch.randn(elements, device=device), torch.randn(elements, device=device)
    out = torch.empty_like(a)
    seconds = median_seconds(lambda: torch.add(a, b, out=out), iters=repeats, device=device)
    return 3 * elements * 4 / seconds


def elementwise_bandwidth(device: torch.device, rows: int, repeats: int) -> float:
    """Bytes/s of the elementwise operators of a layer, forward and backward: a LayerNorm, a GELU and a residual
    add over (rows, 1024), counted as the cost model counts them (3 + 2 + 3 elements moved per element in forward,
    three times that in all)."""
    x = torch.randn(rows, 1024, device=device, requires_grad=True)
    norm = torch.nn.LayerNorm(1024, device=device)

    def step() -> None:
        (torch.nn.functional.gelu(norm(x)) + x).sum().backward()

    seconds = median_seconds(step, iters=repeats, device=device)
    return 3 * 8 * rows * 1024 * 4 / seconds


def dropout_overheads(device: torch.device, repeats: int) -> dict[str, float]:
    """Seconds per element of a dropout in training (forward and backward, beyond a multiply of the same tensor:
    the random mask), and per attention probability of causal attention with dropout beyond the same without (the
    kernel that can drop probabilities materializes them)."""
    x = torch.randn(2**20, device=device, requires_grad=True)
    dropped = median_seconds(lambda: torch.nn.functional.dropout(x, 0.1, training=True).sum().backward(),
                             iters=repeats, device=device)
    scaled = median_seconds(lambda: (x * 1.1).sum().backward(), iters=repeats, device=device)
    sequences, heads, length = 16, 4, 64
    q = torch.randn(sequences, heads, length, 16, device=device, requires_grad=True)

    def attention(p: float) -> Callable[[], None]:
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True,
                                                                       dropout_p=p).sum().backward()

    added = (median_seconds(attention(0.1), iters=repeats, device=device)
             - median_seconds(attention(0.0), iters=repeats, device=device))
    return {"dropout_element_overhead": max(dropped - scaled, 0.0) / x.numel(),
            "attention_dropout_element_overhead": max(added, 0.0) / (sequences * heads * length * length)}


def operator_overhead(device: torch.device, chain: int, repeats: int) -> float:
    """Seconds per operator: a chain of tiny ops run forward and backward, divided by three times its length (the
    cost model counts a layer's forward operators and prices forward + backward as three times them)."""
    x = torch.ones(4, device=device, requires_grad=True)

    def step() -> None:
        y = x
        for _ in range(chain):
            y = y * 1.0001
        y.sum().backward()

    return median_seconds(step, iters=repeats, device=device) / (3 * chain)


MATMUL_PROBE_DIMS = (32, 64, 128, 256)
"""Widths of the (4 dim, dim) linear layer the CPU's matmul costs are read from: weights of 16 KiB to 1 MiB, whose
weight and gradient (``MEMORY_SMALL_BYTES`` at the widest) a CPU's caches hold."""


def linear_intercept(device: torch.device, dim: int, repeats: int) -> tuple[float, int]:
    """(seconds, weight bytes): the intercept in the rows of a (4 dim, dim) linear layer's forward and backward timed
    at 16 to 128 rows (:func:`line_fit`), and its weight's bytes: what a call costs at any row count."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    weight = torch.randn(4 * dim, dim, device=device, dtype=dtype, requires_grad=True)
    rows = [16, 32, 64, 128]
    seconds = []
    # Several calls per timing, as training queues them: on CUDA a timing of one call would be mostly the host's
    # wait for the device (measured on an H100: 0.2 ms per call, which priced small MoE models 4x too slow).
    calls = 8

    def linear_calls(x: torch.Tensor) -> None:
        for _ in range(calls):
            torch.nn.functional.linear(x, weight).sum().backward()
    for count in rows:
        x = torch.randn(count, dim, device=device, dtype=dtype, requires_grad=True)
        seconds.append(median_seconds(lambda x=x: linear_calls(x), iters=repeats, device=device) / calls)
    intercept, _ = line_fit(rows, seconds)
    return intercept, weight.numel() * weight.element_size()


def line_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError("the fit needs points at two or more different x")
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope


WEIGHT_PASSES = 5
"""Passes over a linear layer's weight per forward and backward that the cost model prices: read by the forward and
by the input's gradient, its gradient written, then read and written by the accumulation."""


def matmul_costs(weight_bytes: list[int], intercepts: list[float], operator_seconds: float,
                 bandwidth: float) -> dict[str, float]:
    """``matmul_overhead`` and ``memory_small_bandwidth`` from a linear layer's fixed cost per call at several weight
    sizes, all held by the caches: a line in the weight's bytes, whose value at no weight is the call's three
    launches and three matmul calls, and whose slope is ``WEIGHT_PASSES`` passes over the weight. The cache's
    bandwidth is never taken below ``bandwidth`` (memory's, beyond the caches); a slope of 0 or less (noise: the
    traffic too small to see) leaves it unmeasured (0), and the call's cost is then read as before, against the
    weight's traffic at ``bandwidth``."""
    fixed, per_byte = line_fit(weight_bytes, intercepts)
    if per_byte <= 0:
        middle = len(weight_bytes) // 2
        return against_memory(intercepts[middle], weight_bytes[middle], operator_seconds, bandwidth)
    return {"matmul_overhead": max(fixed - 3 * operator_seconds, 0.0) / 3,
            "memory_small_bandwidth": max(WEIGHT_PASSES / per_byte, bandwidth)}


def against_memory(intercept: float, weight_bytes: int, operator_seconds: float, bandwidth: float) -> dict[str, float]:
    """``matmul_overhead`` from one layer's fixed cost per call, less its three launches and ``WEIGHT_PASSES`` passes
    over its weight at ``bandwidth`` (never negative), and no cache rate."""
    return {"matmul_overhead": max(intercept - 3 * operator_seconds - WEIGHT_PASSES * weight_bytes / bandwidth,
                                   0.0) / 3,
            "memory_small_bandwidth": 0.0}


def measure_matmul_costs(device: torch.device, repeats: int, operator_seconds: float,
                         bandwidth: float) -> dict[str, float]:
    """``matmul_overhead``: what a linear layer's forward and backward cost per matmul call at few rows beyond their
    launches and weight traffic (where its cost stops scaling with the rows), and on a CPU ``memory_small_bandwidth``
    (:func:`matmul_costs` over ``MATMUL_PROBE_DIMS``). On CUDA one (4096, 1024) layer, against its weight's traffic
    at ``bandwidth``: a small copy there is bound by its launch, which ``operator_overhead`` prices, not by a faster
    memory."""
    if device.type == "cuda":
        return against_memory(*linear_intercept(device, 1024, repeats), operator_seconds, bandwidth)
    measured = [linear_intercept(device, dim, repeats) for dim in MATMUL_PROBE_DIMS]
    return matmul_costs([size for _, size in measured], [seconds for seconds, _ in measured], operator_seconds,
                        bandwidth)


def host_device_copy(device: torch.device, elements: int, repeats: int) -> tuple[float, float]:
    """(bytes/s, seconds of a tiny copy): pinned host -> device on CUDA, a host memory copy on CPU."""
    pin = device.type == "cuda"
    source = torch.randn(elements, pin_memory=pin)
    target = torch.empty(elements, device=device)
    tiny_source, tiny_target = torch.randn(1, pin_memory=pin), torch.empty(1, device=device)
    seconds = median_seconds(lambda: target.copy_(source, non_blocking=pin), iters=repeats, device=device)
    latency = median_seconds(lambda: tiny_target.copy_(tiny_source, non_blocking=pin), iters=repeats, device=device)
    return elements * 4 / max(seconds - latency, 1e-12), latency


def adam_seconds_per_param(device: torch.device, elements: int, repeats: int) -> float:
    """A step of AdamW as the package builds it (fused where torch has a fused kernel for the device)."""
    param = torch.nn.Parameter(torch.randn(elements, device=device))
    param.grad = torch.randn(elements, device=device)
    optimizer = torch.optim.AdamW([param], lr=1e-4, fused=True)
    return median_seconds(optimizer.step, iters=repeats, device=device) / elements


def device_constants(device: torch.device, quick: bool) -> dict[str, float]:
    """Everything measured on one device (see the module docstring), as :class:`Cluster` fields. On a CPU this
    process's malloc first keeps what it frees below 32 MiB, as a training process's does
    (``P2RStrategy(host_allocator="auto")``), so that each probe pays for memory what training pays: nothing again
    below that size, and a fault per page of the tensors from 32 MiB on (the large elementwise probe's)."""
    if wants_retained("auto", device.type):  # allocate as a training process under the default does
        retain_freed_host_memory()
    repeats = 3 if quick else 20
    size = (1024 if device.type == "cuda" else 128) if quick else (4096 if device.type == "cuda" else 256)
    copy_bandwidth, copy_latency = host_device_copy(device, 2**20 if quick else 2**23, repeats)
    operator_seconds = operator_overhead(device, 50 if quick else 200, repeats)
    # Always far beyond a CPU's caches (``MEMORY_LARGE_BYTES``: three fp32 tensors): the planner interpolates from
    # the caches' rate to it.
    bandwidth = memory_bandwidth(device, MEMORY_LARGE_BYTES // (3 * 4), repeats)
    return {"device_flops": matmul_flops(device, size, repeats),
            "attention_flops": attention_flops(device, 128 if quick or device.type != "cuda" else 2048, repeats),
            "memory_bandwidth": bandwidth,
            "elementwise_bandwidth": elementwise_bandwidth(device, ELEMENTWISE_LARGE_BYTES // 4096, repeats),
            "elementwise_small_bandwidth": elementwise_bandwidth(device, ELEMENTWISE_SMALL_BYTES // 4096,
                                                                 repeats * 5),
            "operator_overhead": operator_seconds,
            **layer_overheads(device, repeats),
            **hf_layer_overheads(device, repeats),
            **dropout_overheads(device, repeats),
            **attention_rates(device, quick, 3 if quick else 10),
            **measure_matmul_costs(device, repeats, operator_seconds, bandwidth),
            "host_device_bandwidth": copy_bandwidth, "host_device_latency": copy_latency,
            "optimizer_seconds_per_param": adam_seconds_per_param(device, 2**18 if quick else 2**22, repeats),
            "host_optimizer_seconds_per_param": adam_seconds_per_param(torch.device("cpu"), 2**18 if quick
                                                                       else 2**22, repeats)}


