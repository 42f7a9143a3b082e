"""Projections of the papers' headline runs with the planner's cost model (no run: every figure is a prediction).

    python -m lightning_p2r.benchmarks.projections [--out DIR | --update-docs] [--quick]

Three scenarios, each with its assumptions in ``SCENARIOS`` below and in docs/planning.md:

1. **M6-10T**: 10 trillion parameters (48 MoE layers of 10,240 experts, 80 prototypes of top-1) on 512 V100s of
   32 GB. The fastest layout for the real model and for the pseudo model (one shared block per kind), with the
   offload fraction each needs, under the package's fp32 parameters with Adam, and under leaner states (bf16
   parameters and gradients, a factored optimizer at 4 bytes per parameter).
2. **A 1T dense model on 1,024 A100s** (Lamy-Poirier): the fastest layered-accumulation + looped breadth-first
   pipeline layout against the fastest depth-first 1F1B layout with ZeRO-3, over global batch sizes; then each
   layout's step time as the inter-node bandwidth shrinks, and the bandwidth below which it grows by over 10%.
3. **ZeRO's 100B model on 400 V100s**: the paper's layout (tensor parallel 16 inside a DGX-2, ZeRO-2 over 25 data
   ranks) priced, and the fastest layout the planner finds; TFLOP/s per GPU next to the paper's 38.

Prints each table, writes ``projections.csv``, ``projection_bandwidth.png`` and ``projection_breakdown.png``. Each
step time carries the band the planner's cross-validations support (``docs/benchmarks/planner_cv_scores.json`` and
the samples kept in ``planner_cv_*/``: the worst held-out median and largest |error| on CPU over them): a floor on
the uncertainty, since the GPU constants are assumed.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from lightning_p2r.benchmarks.report import base_parser, print_table, pyplot, save_bar_chart, write_csv
from lightning_p2r.models.config import M6Config
from lightning_p2r.planning import (
    Cluster,
    Layout,
    Plan,
    SearchSpace,
    Workload,
    estimate_memory,
    estimate_step,
    evaluate,
    search,
)
from lightning_p2r.planning.model import model_forward_flops, parameter_count, pseudo_of

# ---------------------------------------------------------------------------------------------- assumptions
# V100 SXM2 32 GB, 8 per node (NVLink), fp16 tensor cores: 125 TFLOP/s peak, about half on large GEMMs.
V100_NODE8 = Cluster(name="v100-32gb-x8", devices=512, devices_per_node=8, device_memory=32e9,
                     host_memory_per_node=1.5e12, device_flops=60e12, attention_flops=30e12,
                     memory_bandwidth=0.75e12, elementwise_bandwidth=0.5e12, operator_overhead=8e-6,
                     host_device_bandwidth=12e9,
                     optimizer_seconds_per_param=3e-11, host_optimizer_seconds_per_param=1e-9,
                     intra_node_bandwidth=100e9, inter_node_bandwidth=12.5e9 / 8 * 4)
# DGX-2: 16 V100 32 GB on NVSwitch, 8 x 100 Gb/s InfiniBand per node (ZeRO section 10.1: 800 Gb/s).
V100_DGX2 = dataclasses.replace(V100_NODE8, name="dgx2-v100", devices=400, devices_per_node=16,
                                intra_node_bandwidth=120e9, inter_node_bandwidth=100e9 / 16)
# A100 SXM 80 GB, 8 per node, bf16: 312 TFLOP/s peak, about half achieved; NVLink 3; 8 x 200 Gb/s HDR per node.
A100_NODE8 = Cluster(name="a100-80gb-x8", devices=1024, devices_per_node=8, device_memory=80e9,
                     host_memory_per_node=2e12, device_flops=150e12, attention_flops=100e12,
                     memory_bandwidth=1.6e12, elementwise_bandwidth=1.2e12, operator_overhead=5e-6,
                     host_device_bandwidth=20e9,
                     optimizer_seconds_per_param=1.5e-11, host_optimizer_seconds_per_param=1e-9,
                     intra_node_bandwidth=230e9, inter_node_bandwidth=25e9)

# M6-10T (arXiv 2110.03888; the shape from a public survey of the paper's table: 48 layers, hidden 1024, 16 heads,
# expert hidden 9984, 10,240 experts in 80 prototypes): vocabulary and sequence length are assumptions.
M6_10T = M6Config(vocab_size=21128, max_seq_len=512, num_layers=48, dim=1024, num_heads=16, ffn_hidden_dim=9984,
                  num_experts=10240, num_prototypes=80, moe_top_k=1, capacity_factor=1.0)
# A GPT-style 1T dense model (12 L d^2 = 1.0e12): 128 layers of width 25,600, sequences of 2,048 tokens.
DENSE_1T = M6Config(vocab_size=51200, max_seq_len=2048, num_layers=128, dim=25600, num_heads=160, moe_layers=[])
# ZeRO's 100B (Table 4: 125 layers of hidden 8192 for about 100B); 64 heads and sequences of 1,024 assumed.
ZERO_100B = M6Config(vocab_size=50257 + 47, max_seq_len=1024, num_layers=125, dim=8192, num_heads=64,
                     moe_layers=[])


def _flops_per_gpu(config: M6Config, workload: Workload, plan: Plan, devices: int) -> float:
    """Model FLOP/s per device: 3 x the forward FLOPs of the step's tokens (no recompute) over the step time."""
    return 3 * workload.tokens * model_forward_flops(config, workload.seq_len) / plan.step.total / devices


def _row(scenario: str, config: M6Config, workload: Workload, cluster: Cluster, plan: Plan | None,
         note: str = "") -> dict[str, Any]:
    row: dict[str, Any] = {"scenario": scenario, "parameters": f"{parameter_count(config) / 1e9:,.0f}B",
                           "devices": cluster.devices, "global_batch": workload.global_batch}
    if plan is None:
        return row | {"layout": "none fits", "note": note}
    return row | {"layout": plan.layout.describe(), "fits": "yes" if plan.fits else plan.reason,
                  "step_s": round(plan.step.total, 2),
                  "tokens_per_s": round(plan.tokens_per_second(workload)),
                  "tflops_per_device": round(_flops_per_gpu(config, workload, plan, cluster.devices) / 1e12, 1),
                  "device_GB": round(plan.memory.device_total / 1e9, 1), "host_GB": round(plan.memory.host / 1e9, 1),
                  "bubble_s": round(plan.step.bubble, 2), "exposed_comm_s": round(
                      plan.step.tensor_parallel + plan.step.expert_parallel + plan.step.pipeline_sends +
                      plan.step.data_parallel + plan.step.offload_copies, 2), "note": note}


def m6_10t(quick: bool) -> list[dict[str, Any]]:
    config = M6_10T.replace(num_layers=8, num_experts=1280, num_prototypes=10) if quick else M6_10T
    cluster = V100_NODE8.with_devices(64) if quick else V100_NODE8
    space = SearchSpace(shardings=("zero3",), schedules=("1f1b", "looped_bfs"), offload_fractions=(0.0, 0.5, 0.75,
                        1.0), accumulations=("standard", "layered"), sequence_parallel=(False,),
                        micro_batch_counts=(1, 2, 4, 8), max_tensor_parallel=1, pipeline_degrees=(1, 2, 4, 8),
                        expert_degrees=(1, 8, 32, 64, 128, 256, 512))
    rows = []
    for states, workload in (("fp32 params + Adam (the package)", Workload(global_batch=8 * cluster.devices,
                                                                         seq_len=config.max_seq_len,
                                                                         precision="bf16-mixed")),
                             ("bf16 params, 4 B optimizer", Workload(global_batch=8 * cluster.devices,
                                                                    seq_len=config.max_seq_len,
                                                                    precision="bf16-mixed", param_bytes=2,
                                                                    optimizer_bytes_per_param=4))):
        plans, priced = search(config, cluster, workload, space)
        best = plans[0] if plans else None
        note = f"{states}; {priced} layouts priced"
        if best is None:
            needed = parameter_count(config) * (2 * workload.param_bytes + workload.optimizer_bytes_per_param)
            note += (f"; model states {needed / 1e12:.0f} TB > devices "
                     f"{cluster.devices * cluster.device_memory / 1e12:.0f} TB + hosts "
                     f"{cluster.nodes * cluster.host_memory_per_node / 1e12:.0f} TB")
        rows.append(_row("M6-10T real", config, workload, cluster, best, note))
        if best is not None:
            # The pseudo stage runs on the layout the run keeps after delinking: its own memory and step time.
            pseudo = pseudo_of(config)
            pseudo_plan = dataclasses.replace(best, memory=estimate_memory(pseudo, best.layout, cluster, workload),
                                              step=estimate_step(pseudo, best.layout, cluster, workload))
            rows.append(_row("M6-10T pseudo (same layout)", pseudo, workload, cluster, pseudo_plan, states))
    return rows


def dense_1t(quick: bool) -> tuple[list[dict[str, Any]], dict[str, list[tuple[float, float]]]]:
    """The two layout families at 1,024 GPUs over global batches; then, at a 2M-token batch, over device counts
    (the shortest training time is the step time at the largest useful cluster); then the bandwidth sweeps."""
    config = DENSE_1T.replace(num_layers=16, dim=4096, num_heads=32) if quick else DENSE_1T
    cluster = A100_NODE8.with_devices(64) if quick else A100_NODE8
    degrees = (2, 4, 8, 16, 32, 64, 128)
    families = {
        "layered + looped BFS pipeline": SearchSpace(schedules=("looped_bfs",), accumulations=("layered",),
                                                     shardings=("zero3",), pipeline_degrees=degrees,
                                                     offload_fractions=(0.0,)),
        "1F1B + ZeRO-3": SearchSpace(schedules=("1f1b",), accumulations=("standard",), shardings=("zero3",),
                                     pipeline_degrees=degrees, offload_fractions=(0.0,)),
    }
    rows, sweeps, best = [], {}, {}
    batches = (256, 1024) if quick else (512, 1024, 2048)
    sizes = (cluster.devices,) if quick else (1024, 2048, 4096, 8192)
    runs = [(batch, cluster.devices) for batch in batches] + [(batches[1], n) for n in sizes if n != cluster.devices]
    for batch, devices in runs:
        workload = Workload(global_batch=batch, seq_len=config.max_seq_len, precision="bf16-mixed")
        for family, space in families.items():
            plans, priced = search(config, cluster.with_devices(devices), workload, space)
            plan = plans[0] if plans else None
            rows.append(_row(f"1T dense, {family}", config, workload, cluster.with_devices(devices), plan,
                             f"{priced} layouts priced"))
            if plan is not None and (batch, devices) == (batches[1], cluster.devices):
                best[family] = (plan.layout, workload)
    for family, (layout, workload) in best.items():
        sweeps[family] = bandwidth_sweep(config, layout, cluster, workload)
    return rows, sweeps


BANDWIDTHS = (0.5e9, 1e9, 2e9, 3.125e9, 6.25e9, 12.5e9, 25e9, 50e9, 100e9)


def bandwidth_sweep(config: M6Config, layout: Layout, cluster: Cluster, workload: Workload
                    ) -> list[tuple[float, float]]:
    """(inter-node bandwidth per device, predicted step seconds) for one layout."""
    return [(bandwidth, evaluate(config, layout, dataclasses.replace(cluster, inter_node_bandwidth=bandwidth),
                                 workload).step.total) for bandwidth in BANDWIDTHS]


def slowdown_threshold(sweep: list[tuple[float, float]], limit: float = 1.1) -> float | None:
    """The lowest swept bandwidth at which the step is still within ``limit`` of the fastest bandwidth's step,
    or None if even the first is."""
    best = sweep[-1][1]
    fine = [bandwidth for bandwidth, seconds in sweep if seconds <= limit * best]
    return min(fine) if fine else None


def zero_100b(quick: bool) -> list[dict[str, Any]]:
    config = ZERO_100B.replace(num_layers=16, dim=2048, num_heads=16) if quick else ZERO_100B
    cluster = V100_DGX2.with_devices(80) if quick else V100_DGX2
    workload = Workload(global_batch=32 * cluster.devices // 16, seq_len=config.max_seq_len, precision="bf16-mixed")
    # ZeRO-100B: stages 1 + 2 with Megatron's model parallelism of 16 inside a DGX-2 and activation checkpointing
    # (here: recompute, which the strategy runs under layered accumulation).
    paper = Layout(sharding="zero2", tensor_parallel=16, accumulation="layered", recompute=True)
    rows = [_row("ZeRO 100B, paper's layout (tp16, zero2, recompute)", config, workload, cluster,
                 evaluate(config, paper, cluster, workload), "paper: 38 TFLOP/s per GPU")]
    plans, priced = search(config, cluster, workload, SearchSpace(max_tensor_parallel=16, offload_fractions=(0.0,),
                                                                   schedules=("1f1b", "looped_bfs"),
                                                                   micro_batch_counts=(1, 2, 4, 8, 16, 32)))
    rows.append(_row("ZeRO 100B, fastest layout found", config, workload, cluster, plans[0] if plans else None,
                     f"{priced} layouts priced"))
    return rows


def save_sweep(path: Path, sweeps: dict[str, list[tuple[float, float]]]) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    for family, sweep in sweeps.items():
        ax.plot([b / 1e9 for b, _ in sweep], [s for _, s in sweep], marker="o", label=family)
    ax.set_xscale("log")
    ax.set_xlabel("inter-node bandwidth per GPU (GB/s)")
    ax.set_ylabel("predicted seconds per step")
    ax.set_title("1T dense on 1,024 A100s: step time vs network (projection)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


CROSS_VALIDATION = Path("docs/benchmarks/planner_cv_scores.json")


def stored_cross_validations(folder: Path = CROSS_VALIDATION.parent) -> list[Path]:
    """Every stored cross-validation's scores under ``folder``: the latest run's and each kept earlier sample's
    (``planner_cv_*/planner_cv_scores.json``)."""
    return sorted([folder / CROSS_VALIDATION.name, *folder.glob(f"planner_cv_*/{CROSS_VALIDATION.name}")])


def cross_validated_bands(paths: Path | list[Path] = CROSS_VALIDATION) -> dict[str, float]:
    """The held-out |error| (%) the planner's cross-validations measured (``benchmarks.planner --cross-validate``):
    "typical", the largest of the directions' medians, and "worst", the largest error, over every file of ``paths``
    that exists (several samples: the band holds for the worst of them); empty without any."""
    import json

    scores = [v for path in ([paths] if isinstance(paths, Path) else paths) if path.is_file()
              for k, v in json.loads(path.read_text()).items() if k.startswith("fit ")]
    if not scores:
        return {}
    return {"typical": max(s["median_abs_error_pct"] for s in scores),
            "worst": max(s["max_abs_error_pct"] for s in scores)}


def band(step: float, error_pct: float) -> tuple[float, float]:
    """The step times a prediction ``step`` allows when the prediction errs by at most ``error_pct`` of the
    measured step: (step / (1 + e), step / (1 - e)); no upper bound from an error of 100% or more."""
    e = error_pct / 100
    return step / (1 + e), (step / (1 - e) if e < 1 else float("inf"))


def with_bands(rows: list[dict[str, Any]], bands: dict[str, float]) -> None:
    for row in rows:
        if "step_s" in row:
            for name, error in bands.items():
                low, high = band(row["step_s"], error)
                row[f"step_s_{name}_band"] = f"{low:.3g}-{high:.3g}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--cross-validation", type=Path, nargs="+", default=None,
                        help="the planner cross-validations' scores for the error bands, the worst of them counting "
                             "(default: docs/benchmarks/planner_cv_scores.json and planner_cv_*/ beside it)")
    args = parser.parse_args(argv if argv is not None else sys.argv[1:])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = m6_10t(args.quick)
    dense_rows, sweeps = dense_1t(args.quick)
    rows += dense_rows + zero_100b(args.quick)
    sources = args.cross_validation or stored_cross_validations()
    bands = cross_validated_bands(sources)
    with_bands(rows, bands)
    columns = ["scenario", "parameters", "devices", "global_batch", "layout", "fits", "step_s", "tokens_per_s",
               "tflops_per_device", "device_GB", "host_GB", "bubble_s", "exposed_comm_s", "note"]
    columns[7:7] = [f"step_s_{name}_band" for name in bands]
    print("PROJECTIONS of the cost model, not measurements (assumptions: docs/planning.md)")
    if bands:
        print(f"error bands: the planner's held-out |error| on CPU, the worst of {len(sources)} samples (median "
              f"{bands['typical']:.0f}%, largest {bands['worst']:.0f}%); GPU constants here are assumed, not "
              "calibrated")
    print_table(rows, columns)
    thresholds = []
    for family, sweep in sweeps.items():
        threshold = slowdown_threshold(sweep)
        thresholds.append({"layout family": family, "step_s_at_100GB/s": round(sweep[-1][1], 2),
                           "lowest_GB/s_within_10pct": None if threshold is None else threshold / 1e9})
        for bandwidth, seconds in sweep:
            rows.append({"scenario": f"bandwidth sweep, {family}", "inter_node_GBps": bandwidth / 1e9,
                         "step_s": round(seconds, 3)})
    print_table(thresholds, list(thresholds[0]) if thresholds else [])
    write_csv(rows, out / "projections.csv")
    save_sweep(out / "projection_bandwidth.png", sweeps)
    plotted = [r for r in rows if "tokens_per_s" in r]
    save_bar_chart(out / "projection_breakdown.png", [r["scenario"] for r in plotted],
                   {"step s": [r["step_s"] for r in plotted], "exposed comm s": [r["exposed_comm_s"] for r in plotted],
                    "bubble s": [r["bubble_s"] for r in plotted]},
                   ylabel="predicted seconds per step", title="Projected step time by scenario")
    return {"rows": rows, "thresholds": thresholds}


if __name__ == "__main__":
    main()
