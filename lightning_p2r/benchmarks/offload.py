"""Granular offload: tokens/s and device-resident model-state bytes against the share of blocks offloaded.

    python -m lightning_p2r.benchmarks.offload [--out DIR] [--device cpu|cuda] [--quick]

For each ``offload_fraction`` in 0, 0.25, 0.5, 0.75, 1 the same M6 model trains a few steps under ``P2RStrategy``;
the table reports the median step time after warm-up as tokens/s, the strategy's telemetry for a steady step
(peak device model-state bytes, bytes moved each way, copy wait, host and device optimizer step times) and, on
CUDA, ``torch.cuda.max_memory_allocated``. The peer is the same model under Lightning's
``ModelParallelStrategy`` with FSDP2's ``CPUOffloadPolicy`` on every block (everything offloaded). Last, the host
optimizer: torch's fused CPU AdamW against its foreach AdamW on the same parameters.

On a CPU-only machine the "device" is the CPU itself: offloading then moves bytes between two places in the same
memory and can only cost time; the figures show that cost and check the accounting, not a memory saving.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_p2r import M6Config, M6LanguageModel, OptimizerConfig, P2RStrategy, TextDataModule
from lightning_p2r.benchmarks.report import (
    apply_threads,
    base_parser,
    environment_info,
    print_environment,
    print_table,
    pyplot,
    save_figure,
    with_environment,
    write_csv,
)
from lightning_p2r.planning.model import model_forward_flops

FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
COLUMNS = ["setup", "offloaded", "tokens_per_s", "step_ms", "model_tflops", "mfu", "peak_model_MB",
           "cuda_max_alloc_MB", "h2d_MB", "d2h_MB", "copy_wait_ms", "host_step_ms", "device_step_ms",
           "resident_blocks_max"]


class StepTimer(L.Callback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())


class FSDP2OffloadModule(M6LanguageModel):
    """The peer: every block and the root wrapped by FSDP2 ``fully_shard`` with ``CPUOffloadPolicy``."""

    def configure_model(self) -> None:
        if self.transformer is not None:
            return
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        # CPUOffloadPolicy wants the parameters on the host before fully_shard: Lightning's init context would
        # otherwise build them on the GPU.
        with torch.device("cpu"):
            super().configure_model()

        policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        mesh = self.device_mesh["data_parallel"]
        for block in self.transformer.blocks:
            fully_shard(block, mesh=mesh, offload_policy=policy)
        fully_shard(self.transformer, mesh=mesh, offload_policy=policy)


def _offloading_model_parallel() -> Any:
    """Lightning's ModelParallelStrategy, less its ``model_to_device``: that moves every parameter to the GPU after
    ``configure_model``, and CPUOffloadPolicy needs FSDP2's sharded parameters to stay on the host."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    class OffloadingModelParallel(ModelParallelStrategy):
        def model_to_device(self) -> None:
            pass

    return OffloadingModelParallel(data_parallel_size=1, tensor_parallel_size=1)


def _config(args: Any) -> M6Config:
    return M6Config(vocab_size=256, max_seq_len=args.seq_len, num_layers=args.layers, dim=args.dim,
                    num_heads=max(1, args.dim // 64), num_experts=4, capacity_factor=1.25)


def _run(args: Any, strategy: Any, module_class: type = M6LanguageModel) -> dict[str, Any]:
    L.seed_everything(0)
    module = module_class(_config(args), OptimizerConfig(lr=1e-3, warmup_steps=1, fused=None))
    data = TextDataModule(corpus=args.corpus, tokenizer="bytes", seq_len=args.seq_len, batch_size=args.batch_size)
    timer = StepTimer()
    accelerator = "cuda" if args.device.startswith("cuda") else "cpu"
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(accelerator=accelerator, devices=1, strategy=strategy, max_steps=args.steps,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0, default_root_dir=root,
                            callbacks=[timer], precision=args.precision)
        if accelerator == "cuda":
            torch.cuda.reset_peak_memory_stats()
        trainer.fit(module, datamodule=data)
    steps = [b - a for a, b in zip(timer.ends, timer.ends[1:])][args.warmup:]
    step = statistics.median(steps)
    tokens_per_s = args.batch_size * args.seq_len / step
    # Model FLOPs: forward and backward (3x the forward) of the matmuls and attention, no recompute counted.
    tflops = 3 * model_forward_flops(module.config, args.seq_len) * tokens_per_s / 1e12
    row: dict[str, Any] = {"tokens_per_s": tokens_per_s, "step_ms": 1000 * step, "model_tflops": tflops,
                           "mfu": tflops / args.peak_tflops if args.peak_tflops else float("nan"),
                           "cuda_max_alloc_MB": torch.cuda.max_memory_allocated() / 2**20
                           if accelerator == "cuda" else float("nan")}
    history = getattr(trainer.strategy, "telemetry_history", None)
    if history:
        stats = history[-1]
        row |= {"peak_model_MB": stats.peak_device_model_bytes / 2**20, "h2d_MB": stats.h2d_bytes / 2**20,
                "d2h_MB": stats.d2h_bytes / 2**20, "copy_wait_ms": 1000 * stats.copy_wait_seconds,
                "host_step_ms": 1000 * stats.host_step_seconds, "device_step_ms": 1000 * stats.device_step_seconds,
                "resident_blocks_max": max(s.peak_resident_offloaded_blocks for s in history[args.warmup:])}
    return row


def matmul_peak_tflops(device: torch.device, size: int = 8192, repeats: int = 10) -> float:
    """TFLOP/s of a large bf16 matmul on ``device``: what the mfu column divides by when no peak is given."""
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize(device)
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e12


def _optimizer_rows(args: Any) -> list[dict[str, Any]]:
    """Host AdamW step time on ``--optimizer-params`` parameters: fused vs foreach (both on the CPU)."""
    rows = []
    numel = int(args.optimizer_params)
    chunks = [torch.nn.Parameter(torch.randn(numel // 8)) for _ in range(8)]
    for chunk in chunks:
        chunk.grad = torch.randn_like(chunk)
    for name, kwargs in (("fused", {"fused": True}), ("foreach", {"foreach": True})):
        optimizer = torch.optim.AdamW(chunks, lr=1e-4, **kwargs)
        optimizer.step()  # creates the state
        times = []
        for _ in range(args.optimizer_iters):
            start = time.perf_counter()
            optimizer.step()
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        rows.append({"optimizer": f"AdamW {name} (cpu)", "params_M": numel / 1e6, "step_ms": 1000 * seconds,
                     "params_per_s_M": numel / seconds / 1e6})
    rows[0]["speedup_vs_foreach"] = rows[1]["step_ms"] / rows[0]["step_ms"]
    rows[1]["speedup_vs_foreach"] = 1.0
    return rows


def _plot(path: Path, rows: list[dict[str, Any]], title: str) -> None:
    plt = pyplot()
    labels = [r["offloaded"] if "P2R" in r["setup"] else "FSDP2\npeer" for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=110)
    left.bar(labels, [r.get("tokens_per_s", float("nan")) for r in rows], color="tab:blue")
    left.set_title("throughput", fontsize=10)
    left.set_ylabel("tokens/s")
    left.set_xlabel("blocks offloaded")
    nan = float("nan")
    memory = [nan if r.get("cuda_max_alloc_MB") is None else r["cuda_max_alloc_MB"] for r in rows]
    use_cuda = any(m == m for m in memory)  # NaN != NaN: no CUDA figures (a failed peer has none either)
    right.bar(labels, memory if use_cuda else [r.get("peak_model_MB", nan) for r in rows],
              color="tab:orange")
    right.set_title("torch.cuda.max_memory_allocated" if use_cuda else "peak device model-state (telemetry)",
                    fontsize=10)
    right.set_ylabel("MB")
    right.set_xlabel("blocks offloaded")
    for ax in (left, right):
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4, help="step intervals left out of the median")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--corpus", default="kjv")
    parser.add_argument("--optimizer-params", type=float, default=50e6)
    parser.add_argument("--optimizer-iters", type=int, default=5)
    parser.add_argument("--no-peer", action="store_true", help="skip the FSDP2 CPUOffloadPolicy peer")
    parser.add_argument("--precision", default="32-true", help="Trainer precision, e.g. bf16-mixed on a GPU")
    parser.add_argument("--peak-tflops", type=float, help="the device's peak TFLOP/s for the mfu column (default on "
                        "CUDA: a measured 8192^3 bf16 matmul's; none on CPU)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.layers, args.dim, args.seq_len, args.batch_size = 5, 1, 4, 64, 32, 4
        args.optimizer_params, args.optimizer_iters = 2e5, 2
    apply_threads(args.threads)
    if args.peak_tflops is None and args.device.startswith("cuda"):
        args.peak_tflops = matmul_peak_tflops(torch.device(args.device))
        print(f"mfu is against a measured bf16 matmul peak of {args.peak_tflops:.0f} TFLOP/s")
    env = environment_info(args.device)
    print_environment(env)

    rows = []
    for fraction in FRACTIONS:
        row = {"setup": f"P2RStrategy offload_fraction={fraction}", "offloaded": f"{round(fraction * args.layers)}"
               f"/{args.layers}"} | _run(args, P2RStrategy(offload_fraction=fraction, log_telemetry=False))
        rows.append(row)
    if not args.no_peer:
        try:
            peer = _run(args, _offloading_model_parallel(), FSDP2OffloadModule)
            rows.append({"setup": "ModelParallelStrategy + FSDP2 CPUOffloadPolicy", "offloaded": "all"} | peer)
        except Exception as error:  # the peer is informative, not essential: say why it is missing
            print(f"peer skipped: {type(error).__name__}: {error}")
            rows.append({"setup": f"FSDP2 peer failed: {type(error).__name__}", "offloaded": "all"})
    print_table(rows, COLUMNS)
    optimizer_rows = _optimizer_rows(args)
    print_table(optimizer_rows, ["optimizer", "params_M", "step_ms", "params_per_s_M", "speedup_vs_foreach"])

    out = Path(args.out)
    write_csv(with_environment(rows, env), out / "offload.csv")
    write_csv(with_environment(optimizer_rows, env), out / "offload_optimizer.csv")
    _plot(out / "offload.png", rows, f"P2RStrategy offload on {env['device_name']} ({args.layers} blocks, "
          f"dim {args.dim})")
    print(f"wrote {out / 'offload.csv'}, {out / 'offload_optimizer.csv'}, {out / 'offload.png'}")
    return {"runs": rows, "optimizer": optimizer_rows}


if __name__ == "__main__":
    main()
