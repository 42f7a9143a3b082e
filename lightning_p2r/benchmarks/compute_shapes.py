"""How fast this device runs the model's compute at each shape: a linear layer's matmuls, the MoE layer's expert
matmuls and causal attention, forward and backward, over a grid of shapes (issue 41 item 2: is the planner's compute
term, priced from one large matmul's speed, wrong by shape?).

    python -m lightning_p2r.benchmarks.compute_shapes [--out DIR] [--quick] [--device cuda]

Each row is one shape's median seconds for forward + backward, in bf16 on CUDA and fp32 on a CPU (the precisions
training uses there), timed over several calls per synchronization as training queues them, and its TFLOP/s as the
planner counts FLOPs (``compute_shapes.csv``, ``compute_shapes.png``, a printed table). docs/benchmarks.md ("The
planner on a GPU") reads the H100's rows against the planner's constants.
"""

from __future__ import annotations

import csv
import itertools
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lightning_p2r.benchmarks.report import base_parser, save_bar_chart
from lightning_p2r.measure.run import median_seconds
from lightning_p2r.models.moe import expert_mlps

FIELDS = ("kind", "rows", "inner", "outer", "groups", "seconds")
"""kind "linear": ``rows`` x ``inner`` by ``inner`` x ``outer``; "experts": ``groups`` experts' two matmuls
(``inner`` -> ``outer`` -> ``inner``, GELU between) over ``rows`` assignments in all; "attention": causal attention
of ``rows`` tokens in sequences of ``inner`` with ``outer`` channels (heads x head dim), heads of 64."""


CALLS = 4
"""Calls per timing: one call per synchronization would time the host's wait for the device (on an H100, 0.2 ms
whatever the shape)."""


def _dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _per_call(step, iters: int, device: torch.device) -> float:
    def calls() -> None:
        for _ in range(CALLS):
            step()
    return median_seconds(calls, warmup=1, iters=iters, device=device) / CALLS


def linear_seconds(device: torch.device, rows: int, inner: int, outer: int, iters: int) -> float:
    """A linear layer's forward and both gradients (input and weight) at one shape."""
    x = torch.randn(rows, inner, device=device, dtype=_dtype(device), requires_grad=True)
    weight = torch.randn(outer, inner, device=device, dtype=_dtype(device), requires_grad=True)
    grad = torch.randn(rows, outer, device=device, dtype=_dtype(device))

    def step() -> None:
        F.linear(x, weight).backward(grad)
        x.grad = weight.grad = None
    return _per_call(step, iters, device)


def experts_seconds(device: torch.device, rows: int, inner: int, outer: int, groups: int, iters: int) -> float:
    """The MoE layer's expert matmuls (the package's own kernel choice for the device) over ``rows`` assignments
    spread evenly over ``groups`` experts, forward and backward."""
    dtype = _dtype(device)
    x = torch.randn(rows, inner, device=device, dtype=dtype, requires_grad=True)
    w_in = torch.randn(groups, inner, outer, device=device, dtype=dtype, requires_grad=True)
    w_out = torch.randn(groups, outer, inner, device=device, dtype=dtype, requires_grad=True)
    counts = torch.full((groups,), rows // groups, device=device, dtype=torch.int64)
    counts[-1] += rows - int(counts.sum())
    kernel = "grouped" if device.type == "cuda" and hasattr(torch, "_grouped_mm") else "loop"

    def step() -> None:
        expert_mlps(x, counts, w_in, w_out, kernel).float().sum().backward()
        x.grad = w_in.grad = w_out.grad = None
    return _per_call(step, iters, device)


def attention_seconds(device: torch.device, rows: int, seq_len: int, channels: int, iters: int) -> float:
    """Causal scaled-dot-product attention (the fused kernel the device offers), forward and backward."""
    heads = max(1, channels // 64)
    shape = (max(1, rows // seq_len), heads, seq_len, channels // heads)
    q, k, v = (torch.randn(shape, device=device, dtype=_dtype(device), requires_grad=True) for _ in range(3))

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).float().sum().backward()
        q.grad = k.grad = v.grad = None
    return _per_call(step, iters, device)


def shape_grid(device: torch.device, quick: bool) -> list[dict[str, int]]:
    """The shapes timed: rows from a micro-batch of a few sequences to a large step's, widths from a small model's
    to a few billion parameters' (on a CPU, and with ``quick``, a smaller grid)."""
    if device.type == "cuda" and not quick:
        rows, widths = (512, 2048, 8192, 32768), (256, 1024, 2048, 4096)
        expert_rows, groups, seqs = (2048, 16384, 65536), (4, 16, 64), (256, 1024, 4096)
    elif device.type == "cuda":
        rows, widths = (1024, 16384), (256, 2048)
        expert_rows, groups, seqs = (4096, 32768), (4, 16), (512, 2048)
    elif not quick:
        rows, widths = (64, 256, 1024), (64, 128, 256, 512)
        expert_rows, groups, seqs = (256, 1024), (4, 16), (64, 256)
    else:
        rows, widths = (64, 512), (64, 256)
        expert_rows, groups, seqs = (256,), (4,), (64,)
    grid = []
    for r, inner, factor in itertools.product(rows, widths, (1, 3, 4, 0.25)):
        outer = int(inner * factor)
        if outer >= 64:
            grid.append({"kind": "linear", "rows": r, "inner": inner, "outer": outer, "groups": 1})
    for r, inner, g in itertools.product(expert_rows, widths, groups):
        grid.append({"kind": "experts", "rows": r, "inner": inner, "outer": 4 * inner // max(1, g // 8), "groups": g})
    for r, seq, channels in itertools.product((max(rows),), seqs, widths):
        if seq <= r:
            grid.append({"kind": "attention", "rows": r, "inner": seq, "outer": channels, "groups": 1})
    return grid


def measure_shapes(device: torch.device, quick: bool = False, iters: int | None = None) -> list[dict[str, Any]]:
    """Every shape of :func:`shape_grid`, timed: rows of :data:`FIELDS`."""
    iters = iters or (3 if quick else 7)
    out = []
    for shape in shape_grid(device, quick):
        kind = shape["kind"]
        if kind == "linear":
            seconds = linear_seconds(device, shape["rows"], shape["inner"], shape["outer"], iters)
        elif kind == "experts":
            seconds = experts_seconds(device, shape["rows"], shape["inner"], shape["outer"], shape["groups"], iters)
        else:
            seconds = attention_seconds(device, shape["rows"], shape["inner"], shape["outer"], iters)
        out.append(shape | {"seconds": seconds})
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def write_rows(rows: list[dict[str, Any]], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows({k: row[k] for k in FIELDS} for row in rows)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = base_parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = measure_shapes(device, args.quick)
    out = Path(args.out)
    write_rows(rows, out / "compute_shapes.csv")
    print(f"{'kind':9s} {'rows':>6s} {'inner':>6s} {'outer':>6s} {'groups':>6s} {'ms':>9s} {'TFLOP/s':>8s}")
    for row in rows:
        row["tflops"] = row_flops(row) / row["seconds"] / 1e12
        print(f"{row['kind']:9s} {row['rows']:6d} {row['inner']:6d} {row['outer']:6d} {row['groups']:6d} "
              f"{1e3 * row['seconds']:9.3f} {row['tflops']:8.2f}")
    save_bar_chart(out / "compute_shapes.png", [f"{r['kind'][0]}{r['rows']}x{r['inner']}x{r['outer']}/{r['groups']}"
                                                for r in rows], {"TFLOP/s": [r["tflops"] for r in rows]},
                   title=f"compute by shape on {device.type}", ylabel="TFLOP/s")
    print(f"wrote {out / 'compute_shapes.csv'}, {out / 'compute_shapes.png'} ({len(rows)} shapes)")
    return rows


def row_flops(row: dict[str, Any]) -> float:
    """FLOPs of one row's forward and backward (three times the forward), as the planner counts them: attention over
    the mean (s + 1) / 2 keys of a causal query."""
    rows, inner, outer = int(row["rows"]), int(row["inner"]), int(row["outer"])
    if row["kind"] == "attention":
        return 3 * 2 * 2 * rows * (inner + 1) / 2 * outer
    forward = 2 * rows * inner * outer * (2 if row["kind"] == "experts" else 1)
    return 3 * forward


if __name__ == "__main__":
    main()
