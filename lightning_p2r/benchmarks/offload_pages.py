"""Where an offloaded block's copies land on a CPU-only machine: in fresh pages, at a fraction of a copy's speed.

    python -m lightning_p2r.benchmarks.offload_pages [--rounds 3] [--steps 10] [--out DIR]

On a CPU the block streamer's "device" is host memory: a block's storage is freed when the block is released and
allocated again at its next fetch, and the C allocator often returns such storage to the kernel, so the next copy
writes into fresh pages (a page fault and a zeroed page per 4 KiB). Two parts, one thread:

- **copies**: a 64 MiB copy into a buffer that is reused, and into a buffer allocated for each copy (that size is
  always mapped fresh by glibc's allocator): the bandwidth of each, and the minor page faults per MiB copied;
- **training**: ``calibrate``'s copy probe model (:mod:`lightning_p2r.measure.offload_copies`: 4 MoE layers of
  width 96, 8 experts, 4 micro-batches of 4 sequences) trained resident and with every block offloaded, in turn
  ``--rounds`` times, in this process: the median step, and the minor page faults per step (the median of the steps
  after 2 warm-up ones), beside the bytes the offloaded step copies (the planner's count).

``calibrate`` reads the copies' bandwidth inside training off the same pair of layouts; this shows why it must.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

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
from lightning_p2r.measure.memory import minor_faults

COPY_BYTES = 64 * 2**20
"""Above glibc's largest dynamic mmap threshold (32 MiB): a buffer of this size is mapped fresh at each allocation."""


def copy_rows(size_bytes: int, repeats: int) -> list[dict[str, Any]]:
    """The copy into a reused buffer and into a fresh one: GB/s (median of ``repeats``) and faults per MiB."""
    elements = size_bytes // 4
    source = torch.randn(elements)
    reused = torch.empty(elements)

    def into_reused() -> None:
        reused.copy_(source)

    def into_fresh() -> None:
        torch.empty(elements).copy_(source)

    rows = []
    for case, copy in (("copy into a reused buffer", into_reused), ("copy into fresh pages", into_fresh)):
        copy()
        seconds, faults = [], []
        for _ in range(repeats):
            before, start = minor_faults(), time.perf_counter()
            copy()
            seconds.append(time.perf_counter() - start)
            faults.append(minor_faults() - before)
        rows.append({"part": "copies", "case": case, "GB_per_s": size_bytes / statistics.median(seconds) / 1e9,
                     "step_ms": float("nan"), "faults_per_MiB": statistics.median(faults) / (size_bytes / 2**20),
                     "faults_per_step": float("nan"), "copied_MB_per_step": float("nan")})
    return rows


def training_rows(steps: int, rounds: int, quick: bool) -> list[dict[str, Any]]:
    """The copy probe pair trained in turn ``rounds`` times (see the module docstring)."""
    from dataclasses import asdict, replace

    from lightning_p2r.measure.offload_copies import copied_bytes, copy_probe_layouts, copy_probe_workload
    from lightning_p2r.measure.run import OptimizerStepTimer, fit_on_random_tokens
    from lightning_p2r.planning.cluster import Cluster
    from lightning_p2r.strategy import P2RStrategy

    config, workload = copy_probe_workload()
    if quick:
        config = replace(config, num_layers=2, dim=32, num_experts=2)
    cluster = Cluster(accelerator="cpu", devices=1, devices_per_node=1)
    layouts = copy_probe_layouts()
    measured: dict[str, dict[str, list[float]]] = {layout.describe(): {"step": [], "faults": []} for layout in layouts}
    for _ in range(rounds):
        for layout in layouts:
            spec = {"model": asdict(config), "devices": 1, "steps": steps, "global_batch": workload.global_batch,
                    "accumulate_grad_batches": layout.trainer_accumulation, "accelerator": "cpu"}
            faults = OptimizerStepTimer(read=minor_faults)  # the page faults at each step's end
            _, _, step_s = fit_on_random_tokens(spec, P2RStrategy(**layout.strategy_options(), log_telemetry=False),
                                                warmup=2, callbacks=(faults,))
            diffs = [b - a for a, b in zip(faults.ends[1:], faults.ends[2:])]  # after 2 warm-up steps, as step_s
            measured[layout.describe()]["step"].append(step_s)
            measured[layout.describe()]["faults"].append(statistics.median(diffs) if diffs else float("nan"))
    return [{"part": "training", "case": layout.describe(), "GB_per_s": float("nan"),
             "step_ms": statistics.median(measured[layout.describe()]["step"]) * 1e3, "faults_per_MiB": float("nan"),
             "faults_per_step": statistics.median(measured[layout.describe()]["faults"]),
             "copied_MB_per_step": copied_bytes(config, layout, cluster, workload) / 1e6} for layout in layouts]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per training run (2 warm-up)")
    parser.add_argument("--rounds", type=int, default=3, help="the two layouts trained in turn this many times")
    parser.add_argument("--repeats", type=int, default=15, help="timed copies per case (their median)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.repeats = 4, 1, 3
    apply_threads(1)
    env = environment_info("cpu")
    print_environment(env)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = copy_rows(2**20 if args.quick else COPY_BYTES, args.repeats)
    rows += training_rows(args.steps, args.rounds, args.quick)
    print_table(rows, ["part", "case", "GB_per_s", "faults_per_MiB", "step_ms", "faults_per_step",
                       "copied_MB_per_step"])
    resident, offloaded = rows[-2:]
    extra_pages_mb = (offloaded["faults_per_step"] - resident["faults_per_step"]) * 4096 / 1e6
    print(f"offloading every block added {offloaded['step_ms'] - resident['step_ms']:.1f} ms and "
          f"{offloaded['faults_per_step'] - resident['faults_per_step']:.0f} minor page faults per step "
          f"({extra_pages_mb:.1f} MB of fresh pages) for {offloaded['copied_MB_per_step']:.1f} MB copied")
    write_csv(with_environment(rows, env), out / "offload_pages.csv")
    save_bar_chart(out / "offload_pages.png", [r["case"] for r in rows[2:]],
                   {"step (ms)": [r["step_ms"] for r in rows[2:]],
                    "minor page faults per step / 100": [r["faults_per_step"] / 100 for r in rows[2:]]},
                   ylabel="ms, or faults / 100", title="Offloaded blocks on a CPU: steps and page faults, 1 thread")
    print(f"wrote {out / 'offload_pages.csv'}, {out / 'offload_pages.png'}")
    return {"rows": rows}


if __name__ == "__main__":
    main(sys.argv[1:])
