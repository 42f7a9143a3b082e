"""One MoE FFN layer against a dense FFN with the same active parameters per token: forward + backward tokens/s.

    python -m lightning_p2r.benchmarks.moe [--out DIR] [--device cpu|cuda] [--quick]

Each MoE variant is compared with a :class:`~lightning_p2r.models.transformer.DenseFeedForward` that does the same
FFN work per token when routing is perfectly balanced and nothing is padded. The matching rule: a token runs
``num_prototypes * moe_top_k`` experts, so the dense hidden size is that many expert hidden sizes:

- top-1 (1 prototype, k=1):         dense hidden = expert hidden
- top-2 (1 prototype, k=2):         dense hidden = 2 x expert hidden
- prototyping k (k prototypes, top-1 in each): dense hidden = k x expert hidden

Every variant runs dropless (``capacity_factor=None``) and with capacity 1.25. The gap to dense is the price of the
router, the dispatch/combine copies and the padded slots (a capacity of 1.25 runs 25% more expert rows than
tokens; dropless pads every expert to the busiest one's load).

One timed iteration is: MoE forward, loss = output . fixed random cotangent + the router losses at the default
weights, backward (into the weights and the input, as inside a model). Gradients are cleared, not applied: no
optimizer step, so routing is the same every iteration. The router is freshly initialized and the input random,
so load is close to balanced; a trained router is usually less balanced, so dropped fractions here are a floor.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_p2r.benchmarks.report import (
    apply_threads,
    base_parser,
    environment_info,
    print_environment,
    print_table,
    save_bar_chart,
    with_environment,
    write_csv,
)
from lightning_p2r.measure.run import median_seconds
from lightning_p2r.models.config import M6Config
from lightning_p2r.models.moe import MoEFeedForward
from lightning_p2r.models.transformer import DenseFeedForward

COLUMNS = ["variant", "routing", "capacity", "tokens", "tokens_per_s", "ms_per_iter", "dropped_fraction",
           "ratio_vs_dense", "dense_hidden", "round_spread"]
CAPACITIES: tuple[float | None, ...] = (None, 1.25)


@dataclass(frozen=True)
class Variant:
    name: str
    top_k: int
    prototypes: int

    @property
    def routing(self) -> str:
        return f"top-{self.top_k}" if self.prototypes == 1 else f"{self.prototypes} x top-{self.top_k}"

    @property
    def active_experts(self) -> int:
        """Experts each token runs: the dense FFN's hidden size is this many expert hidden sizes."""
        return self.prototypes * self.top_k


VARIANTS = (Variant("top1", 1, 1), Variant("top2", 2, 1), Variant("proto2", 1, 2), Variant("proto4", 1, 4))


@dataclass(frozen=True)
class Sizes:
    dim: int
    expert_hidden: int
    experts: int
    tokens: int
    rounds: int
    """Passes over all cases; a case's time is the median of its per-round medians."""
    warmup: int
    """Untimed iterations of a case at the start of each round (its caches went cold while the others ran)."""
    iters: int
    """Timed iterations of a case per round."""


# 2 CPU cores: the full default run (8 MoE cases + 3 dense baselines, 3 x (1 + 2) iterations each) takes about two
# minutes.
DEFAULT_SIZES = Sizes(dim=256, expert_hidden=1024, experts=8, tokens=8192, rounds=3, warmup=1, iters=2)
QUICK_SIZES = Sizes(dim=32, expert_hidden=64, experts=4, tokens=256, rounds=2, warmup=1, iters=1)


@dataclass
class Case:
    """One layer to time, and what it measured."""

    variant: str
    routing: str
    capacity: float | None
    dense_hidden: int
    step: Callable[[], None]
    dropped: list[float]
    round_seconds: list[float] = dataclasses.field(default_factory=list)

    @property
    def is_dense(self) -> bool:
        return self.routing == "dense"


def _train_step(layer: nn.Module, x: torch.Tensor, cotangent: torch.Tensor, config: M6Config,
                stats: list[float]) -> Callable[[], None]:
    """A closure running forward + backward once; MoE layers append their dropped fraction to ``stats``."""

    def step() -> None:
        for param in layer.parameters():
            param.grad = None
        x.grad = None
        out = layer(x)
        if isinstance(layer, MoEFeedForward):
            loss = (out.output * cotangent).sum()
            loss = loss + config.router_aux_loss_coef * out.aux_loss + config.router_z_loss_coef * out.z_loss
            stats.append(float(out.stats.dropped_fraction))
        else:
            loss = (out * cotangent).sum()
        loss.backward()

    return step


def build_cases(sizes: Sizes, device: torch.device) -> list[Case]:
    """Every MoE variant in each capacity mode, plus one dense baseline per distinct active hidden size."""
    base = M6Config(dim=sizes.dim, num_heads=1, ffn_hidden_dim=sizes.expert_hidden, num_experts=sizes.experts)
    generator = torch.Generator(device="cpu").manual_seed(0)  # the same tokens for every layer
    x = torch.randn(sizes.tokens, sizes.dim, generator=generator).to(device).requires_grad_(True)
    cotangent = torch.randn(sizes.tokens, sizes.dim, generator=generator).to(device)
    cases: list[Case] = []
    dense_done: set[int] = set()
    for variant in VARIANTS:
        hidden = variant.active_experts * sizes.expert_hidden
        if hidden not in dense_done:
            dense_done.add(hidden)
            torch.manual_seed(0)
            config = base.replace(ffn_hidden_dim=hidden)
            layer = DenseFeedForward(config).to(device).train()
            cases.append(Case(f"dense{variant.active_experts}x", "dense", None, hidden,
                              _train_step(layer, x, cotangent, config, []), []))
        for capacity in CAPACITIES:
            torch.manual_seed(0)  # the same router and experts in both capacity modes
            config = base.replace(moe_top_k=variant.top_k, num_prototypes=variant.prototypes,
                                  capacity_factor=capacity)
            layer = MoEFeedForward(config).to(device).train()
            dropped: list[float] = []
            cases.append(Case(variant.name, variant.routing, capacity, hidden,
                              _train_step(layer, x, cotangent, config, dropped), dropped))
    return cases


def run(sizes: Sizes, device: torch.device) -> list[dict[str, Any]]:
    """Time every case and return one row per case (dense baselines included).

    Cases are interleaved in rounds instead of timed one after another: on a shared machine the CPU's throughput
    drifts (here it was seen to halve for tens of seconds), and timing each case in one block would turn that drift
    into a fake MoE-vs-dense gap. Each round starts at a different case so none always runs first.
    """
    cases = build_cases(sizes, device)
    for r in range(sizes.rounds):
        shift = r * len(cases) // sizes.rounds
        for case in cases[shift:] + cases[:shift]:
            case.round_seconds.append(median_seconds(case.step, warmup=sizes.warmup, iters=sizes.iters,
                                                     device=device))
        print(f"  round {r + 1}/{sizes.rounds} done", flush=True)
    dense = {case.dense_hidden: statistics.median(case.round_seconds) for case in cases if case.is_dense}
    return [_row(case, sizes.tokens, dense[case.dense_hidden]) for case in cases]


def _capacity_label(capacity: float | None) -> str:
    return "dropless" if capacity is None else f"{capacity:g}"


def _row(case: Case, tokens: int, dense_seconds: float) -> dict[str, Any]:
    seconds = statistics.median(case.round_seconds)
    return {
        "variant": case.variant,
        "routing": case.routing,
        "capacity": "-" if case.is_dense else _capacity_label(case.capacity),
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "ms_per_iter": seconds * 1e3,
        "dropped_fraction": sum(case.dropped) / len(case.dropped) if case.dropped else math.nan,
        # > 1 would mean the MoE layer is faster than the dense FFN doing the same per-token work.
        "ratio_vs_dense": dense_seconds / seconds,
        "dense_hidden": case.dense_hidden,
        # How far apart the rounds were: a large spread says the machine was busy and the ratio is rough.
        "round_spread": (max(case.round_seconds) - min(case.round_seconds)) / seconds,
    }


def plot(rows: Sequence[dict[str, Any]], path: Path, sizes: Sizes, env: dict[str, Any]) -> Path:
    by_key = {(row["variant"], row["capacity"]): row for row in rows}
    names = [v.name for v in VARIANTS]
    labels = [f"{v.name}\n({v.routing})" for v in VARIANTS]
    dense = [by_key[(f"dense{v.active_experts}x", "-")]["tokens_per_s"] for v in VARIANTS]
    series = {"dense, same active params": dense}
    for capacity in CAPACITIES:
        label = _capacity_label(capacity)
        legend = "MoE dropless" if capacity is None else f"MoE capacity {label}"
        series[legend] = [by_key[(name, label)]["tokens_per_s"] for name in names]
    title = (f"MoE layer fwd+bwd, {sizes.tokens} tokens, dim {sizes.dim}, expert hidden {sizes.expert_hidden}, "
             f"{sizes.experts} experts\n{env['device_name']} ({env['device']}, {env['threads']} threads), "
             f"torch {env['torch']}")
    return save_bar_chart(path, labels, series, ylabel="tokens / s (higher is better)", title=title)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, help="tokens per iteration (overrides the size preset)")
    parser.add_argument("--iters", type=int, help="timed iterations per case and round (overrides the preset)")
    parser.add_argument("--rounds", type=int, help="interleaved passes over all cases (overrides the preset)")
    args = parser.parse_args(argv)
    sizes = QUICK_SIZES if args.quick else DEFAULT_SIZES
    given = {"tokens": args.tokens, "iters": args.iters, "rounds": args.rounds}
    overrides = {name: value for name, value in given.items() if value}
    sizes = dataclasses.replace(sizes, **overrides)
    device = torch.device(args.device)
    apply_threads(args.threads)

    env = environment_info(device)
    print_environment(env)
    print(f"sizes: {sizes}")
    rows = run(sizes, device)
    print()
    print_table(rows, COLUMNS)

    csv_path = write_csv(with_environment(rows, env), args.out / "moe.csv")
    png_path = plot(rows, args.out / "moe.png", sizes, env)
    print(f"\nwrote {csv_path} and {png_path}")
    return rows


if __name__ == "__main__":
    main()
