"""Locally banded attention against dense causal attention: forward + backward time over the sequence length.

    python -m lightning_p2r.benchmarks.attention [--seq-lens 512 1024 2048 4096] [--window 256] [--out DIR]

One :class:`~lightning_p2r.models.CausalSelfAttention` core (after the projections: q, k, v of shape batch x heads x
seq x head_dim) timed three ways: dense causal (``is_causal``, the fused kernel skips the masked half), banded
through a dense (T, T) mask (what the package did before the chunked kernel), and banded through
:func:`~lightning_p2r.models.banded_attention` (cost grows with T x window). The table gives the median seconds of
forward + backward and each banded variant's ratio to dense causal; the chunked kernel's largest difference from the
masked result is printed as a check.
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

COLUMNS = ["seq_len", "window", "dense_causal_s", "masked_band_s", "chunked_band_s", "masked_ratio",
           "chunked_ratio", "max_abs_diff"]


def _forward_backward(attend: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
    def run() -> None:
        for t in (q, k, v):
            t.grad = None
        attend(q, k, v).sum().backward()
    return run


def measure(seq_len: int, window: int, *, batch: int, heads: int, head_dim: int, device: str,
            iters: int) -> dict[str, Any]:
    """One row: the three variants' median forward + backward seconds at this length and window."""
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq_len, head_dim, device=device, generator=generator).requires_grad_()
               for _ in range(3))
    mask = local_causal_mask(seq_len, window, device=q.device)
    variants = {
        "dense_causal_s": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "masked_band_s": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        "chunked_band_s": lambda q, k, v: banded_attention(q, k, v, window),
    }
    row: dict[str, Any] = {"seq_len": seq_len, "window": window}
    for name, attend in variants.items():
        row[name] = median_seconds(_forward_backward(attend, q, k, v), iters=iters, device=device)
    row["masked_ratio"] = row["masked_band_s"] / row["dense_causal_s"]
    row["chunked_ratio"] = row["chunked_band_s"] / row["dense_causal_s"]
    with torch.no_grad():
        expected = variants["masked_band_s"](q, k, v)
        row["max_abs_diff"] = (banded_attention(q, k, v, window) - expected).abs().max().item()
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args(argv)
    if args.quick:
        args.seq_lens, args.window, args.heads, args.iters = [128, 256], 32, 2, 1
    apply_threads(args.threads)
    env = environment_info(args.device)
    print_environment(env)
    rows = [measure(seq_len, args.window, batch=args.batch, heads=args.heads, head_dim=args.head_dim,
                    device=args.device, iters=args.iters) for seq_len in args.seq_lens]
    print_table(rows, COLUMNS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(with_environment(rows, env), out / "attention.csv")
    save_line_chart(out / "attention.png", args.seq_lens,
                    {"dense causal": [r["dense_causal_s"] for r in rows],
                     "banded, (T, T) mask": [r["masked_band_s"] for r in rows],
                     "banded, chunked": [r["chunked_band_s"] for r in rows]},
                    xlabel="sequence length", ylabel="seconds, forward + backward", logy=True,
                    title=f"attention core, window {args.window}, {args.heads} heads x {args.head_dim}, "
                          f"{env['device_name']}")
    print(f"wrote {out / 'attention.csv'}, {out / 'attention.png'}")
    return {"rows": rows}


if __name__ == "__main__":
    main(sys.argv[1:])
