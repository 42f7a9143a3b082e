"""Locally banded attention against dense causal attention: forward + backward time over the sequence length.

    python -m lightning_p2r.benchmarks.attention [--seq-lens 512 1024 2048 4096] [--window 256] [--out DIR]
        [--device cuda --dtype bfloat16]

One :class:`~lightning_p2r.models.CausalSelfAttention` core (after the projections: q, k, v of shape batch x heads x
seq x head_dim) timed each way a layer can run: dense causal (``is_causal``, the fused kernel skips the masked half),
banded through a dense (T, T) mask ("masked"), through :func:`~lightning_p2r.models.banded_attention` ("chunked",
cost grows with T x window) and, off CPU, through compiled ``flex_attention`` with a block mask ("flex"; torch has
no flex backward on CPU). The table gives the median seconds of forward + backward, each banded kernel's ratio to
dense causal, the kernel ``attention_kernel="auto"`` picks for that shape, and the largest difference of the chunked
and flex results from the masked one. Rows are written to the CSV as they are measured.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lightning_p2r.benchmarks.report import (
    apply_threads,
    base_parser,
    environment_info,
    print_environment,
    print_table,
    save_line_chart,
    with_environment,
    write_csv,
)
from lightning_p2r.measure.run import median_seconds
from lightning_p2r.models import banded_attention, local_causal_mask
from lightning_p2r.models.attention import band_block_mask, choose_bands, flex_available, flex_band_attention

COLUMNS = ["seq_len", "window", "dense_causal_s", "masked_band_s", "chunked_band_s", "flex_band_s", "masked_ratio",
           "chunked_ratio", "flex_ratio", "auto_picks", "max_abs_diff", "flex_max_abs_diff"]


def _forward_backward(attend: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
    def run() -> None:
        for t in (q, k, v):
            t.grad = None
        attend(q, k, v).sum().backward()
    return run


def measure(seq_len: int, window: int, *, batch: int, heads: int, head_dim: int, device: str,
            iters: int, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """One row: each kernel's median forward + backward seconds at this length and window."""
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq_len, head_dim, device=device, generator=generator, dtype=dtype)
               .requires_grad_() for _ in range(3))
    mask = local_causal_mask(seq_len, window, device=q.device)
    variants = {
        "dense_causal_s": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "masked_band_s": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        "chunked_band_s": lambda q, k, v: banded_attention(q, k, v, window),
    }
    if q.device.type != "cpu" and flex_available():
        block_mask = band_block_mask(seq_len, window, str(q.device))
        variants["flex_band_s"] = lambda q, k, v: flex_band_attention(q, k, v, block_mask)
    row: dict[str, Any] = {"seq_len": seq_len, "window": window, "flex_band_s": None, "flex_ratio": None,
                           "flex_max_abs_diff": None}  # None: flex cannot run backward here (CPU)
    for name, attend in variants.items():
        row[name] = median_seconds(_forward_backward(attend, q, k, v), iters=iters, device=device)
    for kernel in ("masked", "chunked", "flex"):
        if row.get(f"{kernel}_band_s") is not None:
            row[f"{kernel}_ratio"] = row[f"{kernel}_band_s"] / row["dense_causal_s"]
    bands = choose_bands("auto", {window}, tuple(q.shape), dtype, q.device, training=True, dropout=0.0)
    row["auto_picks"] = bands[window].kernel if window in bands else "dense"
    with torch.no_grad():
        expected = variants["masked_band_s"](q, k, v).float()
        row["max_abs_diff"] = (banded_attention(q, k, v, window).float() - expected).abs().max().item()
        if "flex_band_s" in variants:
            row["flex_max_abs_diff"] = (variants["flex_band_s"](q, k, v).float() - expected).abs().max().item()
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args(argv)
    if args.quick:
        args.seq_lens, args.window, args.heads, args.iters = [128, 256], 32, 2, 1
    apply_threads(args.threads)
    env = environment_info(args.device)
    print_environment(env)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seq_len in args.seq_lens:  # each row written as it comes: a run stopped early keeps what it measured
        rows.append(measure(seq_len, args.window, batch=args.batch, heads=args.heads, head_dim=args.head_dim,
                            device=args.device, iters=args.iters, dtype=getattr(torch, args.dtype)))
        write_csv(with_environment(rows, env), out / "attention.csv")
        print_table(rows[-1:], COLUMNS)
    print_table(rows, COLUMNS)
    series = {"dense causal": [r["dense_causal_s"] for r in rows],
              "banded, (T, T) mask": [r["masked_band_s"] for r in rows],
              "banded, chunked": [r["chunked_band_s"] for r in rows]}
    if all(r["flex_band_s"] is not None for r in rows):
        series["banded, flex"] = [r["flex_band_s"] for r in rows]
    save_line_chart(out / "attention.png", args.seq_lens, series,
                    xlabel="sequence length", ylabel="seconds, forward + backward", logy=True,
                    title=f"attention core, window {args.window}, {args.heads} heads x {args.head_dim}, "
                          f"{env['device_name']}")
    print(f"wrote {out / 'attention.csv'}, {out / 'attention.png'}")
    return {"rows": rows}


if __name__ == "__main__":
    main(sys.argv[1:])
