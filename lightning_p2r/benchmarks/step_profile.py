"""Where one training step's time goes: the device's kernels, the host's operators, and the host's waits (issue 41
item 2: why the planner under-prices MoE steps on a GPU).

    python -m lightning_p2r.benchmarks.step_profile [--layers 2] [--dim 256] [--experts 16] [--top-k 2]
        [--capacity 1.25] [--seq-len 2048] [--batch 8] [--micro-batches 1] [--offload-fraction 0]
        [--device cuda] [--out DIR]

The model (``--experts 0``: dense) trains under ``P2RStrategy`` on random tokens (bf16-mixed on a GPU, fp32 on a
CPU), the micro-batches by Lightning's accumulation as ``plan --trial`` runs them. After the warm-up steps, two
optimizer steps run under ``torch.profiler``. Printed per optimizer step: the wall time (median of the unprofiled
steps), the device's busy time (kernel intervals merged), the host time inside torch operators, the operator and
kernel counts, the host's time blocked in synchronizations, and the operators with the most self device time and
the most self host time (also written to ``step_profile.csv``). A step whose device is busy for much less than its
wall time is bound by the host: its launches, Python and synchronizations, which the planner prices per operator.
"""

from __future__ import annotations

import statistics
import tempfile
from typing import Any

import lightning as L
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from lightning_p2r import M6Config, M6LanguageModel, OptimizerConfig, P2RStrategy
from lightning_p2r.benchmarks.offload import StepTimer
from lightning_p2r.benchmarks.report import base_parser, environment_info, print_environment, print_table, write_csv

WARMUP_STEPS = 3
PROFILED_STEPS = 2
TIMED_STEPS = 4
NAME_CHARS = 64
"""Kernel names are C++ signatures: the first characters name the kernel."""
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
"""CUDA runtime calls in which the host waits for the device (``cudaMemcpy`` without ``Async`` blocks)."""


class ProfileSteps(L.Callback):
    """Profiles the training batches ``[first, first + count)``."""

    def __init__(self, first: int, count: int, activities: list[ProfilerActivity]) -> None:
        self.first, self.last = first, first + count - 1
        self.profiler = profile(activities=activities)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if batch_idx == self.first:
            self.profiler.start()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if batch_idx == self.last:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.profiler.stop()


def merged_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def summarize(prof: Any, steps: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Per-step totals and the per-operator rows (milliseconds per optimizer step) of a finished profile."""
    events = prof.events()
    # Device-side events are kernels and copies, and the user annotations (``Optimizer.step#...``) drawn over them:
    # a range, not work, so left out of the busy time.
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    host_ops = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::")]
    averages = prof.key_averages()
    syncs = [a for a in averages if a.key in SYNC_CALLS]
    totals = {
        "device_busy_ms": merged_length([(e.time_range.start, e.time_range.end) for e in kernels]) / 1e3 / steps,
        "kernels": len(kernels) / steps,
        "aten_ops": len(host_ops) / steps,
        "host_sync_ms": sum(a.cpu_time_total for a in syncs) / 1e3 / steps,
        "host_syncs": sum(a.count for a in syncs) / steps,
    }
    rows = [{"op": a.key[:NAME_CHARS], "calls": a.count / steps, "self_host_ms": a.self_cpu_time_total / 1e3 / steps,
             "self_device_ms": getattr(a, "self_device_time_total", 0.0) / 1e3 / steps} for a in averages]
    return totals, rows


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16, help="0: a dense model")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity", type=float, default=1.25, help="capacity factor; 0: dropless")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=8, help="sequences per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--offload-fraction", type=float, default=0.0, help="P2RStrategy(offload_fraction=...)")
    parser.add_argument("--top", type=int, default=15, help="operators to print per table")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    config = M6Config(vocab_size=args.vocab, max_seq_len=args.seq_len, num_layers=args.layers, dim=args.dim,
                      num_heads=args.heads, num_experts=max(args.experts, 1),
                      moe_top_k=args.top_k if args.experts else 1,
                      capacity_factor=args.capacity or None, moe_layers=[] if args.experts == 0 else None)
    env = environment_info(device)
    print_environment(env)
    mb = args.micro_batches
    steps = WARMUP_STEPS + PROFILED_STEPS + TIMED_STEPS
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    profiler = ProfileSteps(WARMUP_STEPS * mb, PROFILED_STEPS * mb, activities)
    timer = StepTimer()
    L.seed_everything(0, verbose=False)
    module = M6LanguageModel(config, OptimizerConfig(lr=1e-4, warmup_steps=1, fused=None))
    windows = torch.randint(0, args.vocab, (steps * mb * args.batch, args.seq_len + 1),
                            generator=torch.Generator().manual_seed(0))
    strategy = P2RStrategy(log_telemetry=False, offload_fraction=args.offload_fraction)
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(accelerator=device.type, devices=1, strategy=strategy,
                            max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0, default_root_dir=root,
                            callbacks=[timer, profiler], accumulate_grad_batches=mb,
                            precision="bf16-mixed" if device.type == "cuda" else "32-true",
                            use_distributed_sampler=False)
        trainer.fit(module, torch.utils.data.DataLoader(windows, batch_size=args.batch))
    step_ends = timer.ends[mb - 1::mb]
    unprofiled = [b - a for a, b in zip(step_ends, step_ends[1:])][WARMUP_STEPS + PROFILED_STEPS:]
    totals, rows = summarize(profiler.profiler, PROFILED_STEPS)
    totals = {"wall_ms": 1e3 * statistics.median(unprofiled)} | totals
    print(f"{config.num_layers} layers, dim {config.dim}, "
          f"{'dense' if args.experts == 0 else f'{args.experts} experts top-{args.top_k}'}, "
          f"{mb} x {args.batch} x {args.seq_len} tokens per optimizer step; per step: "
          + ", ".join(f"{k} {v:.4g}" for k, v in totals.items()))
    columns = ["op", "calls", "self_host_ms", "self_device_ms"]
    for key in ("self_device_ms", "self_host_ms"):
        print(f"\nby {key}:")
        print_table(sorted(rows, key=lambda row: -row[key])[: args.top], columns)
    path = write_csv([totals | {"op": "(step)"}] + sorted(rows, key=lambda row: -row["self_host_ms"]),
                     f"{args.out}/step_profile.csv")
    print(f"wrote {path}")
    return totals


if __name__ == "__main__":
    main()
