"""One GPU script (issue 40): M6 dense and MoE steps at accelerator speed, MFU, the offload sweep, and a plain
FSDP2 + ``torch.compile`` peer on the identical model, in one run.

    python -m lightning_p2r.benchmarks.gpu [--out DIR] [--smoke] [--budget-s 450] [--arms NAME,...]

Arms, in order (the most informative first, so that a run cut short by ``--budget-s`` keeps them):

- ``sync``: one MoE layer's forward and backward on the grouped kernel under
  ``torch.cuda.set_sync_debug_mode("error")`` (on CPU: :class:`HostSyncCounter`), and its output against the
  per-expert loop's;
- ``moe-loop``, ``moe-grouped``, ``moe-grouped-compile``: a ~1.2B-parameter MoE M6 (8 layers, dim 1024, 16 experts
  of hidden 4096, top-2, capacity 1.25; 0.17B active) under ``P2RStrategy``, bf16-mixed, with each expert kernel,
  then compiled;
- ``moe-peer``: the same model under plain FSDP2 (``fully_shard`` per block and root, bf16 parameters through
  ``MixedPrecisionPolicy``, fp32 reduction) with each block compiled and fused AdamW: torchtitan's recipe;
- ``dense-compile``, ``dense-peer``: a ~0.94B dense M6 (16 layers, dim 2048), the same two ways;
- ``moe-offload-half``, ``moe-offload-all``: 4 and 8 of the MoE model's 8 blocks offloaded (the exact host step);
  the same with ``-delayed`` (``host_step="delayed"``: the host update hidden behind the next step), and the delayed
  all-offloaded MoE and the dense model compiled (``-compile``; the dense one exact and delayed), each against its
  resident arm above.
- ``moe-accum4``, ``moe-offload-all-layered4``, ``moe-offload-all-delayed-layered4``, ``dense-compile-accum4``,
  ``dense-offload-all-delayed-layered4-compile``: four batches per optimizer step, resident by Lightning's
  accumulation against every block offloaded under layered accumulation (with recompute), where each block is
  fetched and its host update run once per four micro-batches: the host step's share of a step shrinks as the
  batch grows (DeepSpeed's ZeRO-Offload also relies on large batches for this).

Every arm reports tokens/s, model TFLOP/s (:mod:`lightning_p2r.measure.throughput`: active parameters and attention,
3x the forward), MFU against the device's table peak and against a bf16 matmul measured in the same process, and
``torch.cuda.max_memory_allocated``; offloading arms also the strategy's own median host-step and copy-wait times
per step (``host_step_ms``, ``copy_wait_ms``). ``--arms`` runs the named arms in the order given. An arm that fails
is reported with its error, and the next one runs.
``--smoke`` runs every arm's code path on tiny models in seconds (CPU: the peer and ``compile`` with the
"aot_eager" backend); CI runs it.
"""

from __future__ import annotations

import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

from lightning_p2r import M6Config, M6LanguageModel, OptimizerConfig, P2RStrategy, Throughput
from lightning_p2r.benchmarks.offload import StepTimer, matmul_peak_tflops
from lightning_p2r.benchmarks.report import (
    base_parser,
    environment_info,
    print_environment,
    print_table,
    save_bar_chart,
    with_environment,
    write_csv,
)
from lightning_p2r.measure.host_syncs import HostSyncCounter
from lightning_p2r.measure.throughput import mfu, peak_tflops, training_flops_per_token
from lightning_p2r.models.moe import MoEFeedForward
from lightning_p2r.models.transformer import M6Transformer
from lightning_p2r.planning.model import model_forward_flops

COLUMNS = ["arm", "model", "params_M", "active_M", "kernel", "compile", "offloaded", "host_step", "micro_batches",
           "accumulation", "tokens_per_s",
           "step_ms", "tflops", "mfu", "logged_mfu", "mfu_vs_matmul", "cuda_max_alloc_MB", "host_step_ms",
           "copy_wait_ms", "graph_breaks", "wall_s", "status"]


@dataclass(frozen=True)
class Sizes:
    moe: M6Config
    dense: M6Config
    batch_size: int
    seq_len: int
    steps: int
    warmup: int


def full_sizes() -> Sizes:
    seq = 2048
    moe = M6Config(vocab_size=32768, max_seq_len=seq, num_layers=8, dim=1024, num_heads=16, num_experts=16,
                   moe_top_k=2, ffn_hidden_dim=4096, capacity_factor=1.25)
    dense = M6Config(vocab_size=32768, max_seq_len=seq, num_layers=16, dim=2048, num_heads=16, moe_layers=[],
                     ffn_hidden_dim=8192)
    return Sizes(moe=moe, dense=dense, batch_size=8, seq_len=seq, steps=10, warmup=4)


def smoke_sizes() -> Sizes:
    seq = 32
    moe = M6Config(vocab_size=256, max_seq_len=seq, num_layers=2, dim=32, num_heads=4, num_experts=4, moe_top_k=2,
                   ffn_hidden_dim=64, capacity_factor=1.25)
    dense = M6Config(vocab_size=256, max_seq_len=seq, num_layers=2, dim=32, num_heads=4, moe_layers=[])
    return Sizes(moe=moe, dense=dense, batch_size=2, seq_len=seq, steps=4, warmup=1)


def parameter_counts(config: M6Config) -> tuple[float, float]:
    """(total, active per token) parameters, from the model built on the meta device (ties and shared blocks counted
    once): an MoE layer's token runs top-k experts per prototype, not all of them."""
    with torch.device("meta"):
        model = M6Transformer(config)
    total = sum(p.numel() for p in model.parameters())
    per_expert = 2 * config.dim * config.routed_hidden_dim
    unused = config.num_experts - config.num_prototypes * config.moe_top_k
    moe_blocks = {model.layer_to_block[layer] for layer in range(config.num_layers) if config.is_moe_layer(layer)}
    return total, total - len(moe_blocks) * unused * per_expert


def random_windows(config: M6Config, sizes: Sizes, count: int, batch_size: int | None = None
                   ) -> torch.utils.data.DataLoader:
    batch_size = batch_size or sizes.batch_size
    generator = torch.Generator().manual_seed(0)
    windows = torch.randint(0, config.vocab_size, (count * batch_size, sizes.seq_len + 1), generator=generator)
    return torch.utils.data.DataLoader(windows, batch_size=batch_size)


def _median_step(ends: list[float], warmup: int, batches_per_step: int = 1) -> float:
    """Median optimizer-step interval after ``warmup`` steps; ``ends`` holds every training batch's end, and with
    Lightning's accumulation each optimizer step ends on every ``batches_per_step``-th batch."""
    step_ends = ends[batches_per_step - 1::batches_per_step]
    steps = [b - a for a, b in zip(step_ends, step_ends[1:])][warmup:]
    return statistics.median(steps)


def run_p2r(config: M6Config, sizes: Sizes, device: torch.device, *, compile_backend: str | bool,
            offload_fraction: float = 0.0, host_step: str = "exact", micro_batches: int = 1,
            accumulation: str = "standard") -> dict[str, float]:
    """Median seconds per optimizer step of ``config`` under ``P2RStrategy`` (bf16-mixed), and the MFU the run's own
    :class:`Throughput` callback logged over its last window (a check of the callback against this script).

    Each optimizer step takes ``micro_batches`` batches of ``sizes.batch_size`` sequences: Lightning's
    ``accumulate_grad_batches`` for "standard" accumulation, the strategy's layered accumulation (with recompute:
    only each block's input kept per micro-batch) for "layered"."""
    layered = accumulation == "layered"
    L.seed_everything(0, verbose=False)
    module = M6LanguageModel(config, OptimizerConfig(lr=1e-4, warmup_steps=1, fused=None))
    timer = StepTimer()
    throughput = Throughput(window=max(1, sizes.steps - sizes.warmup - 1), prog_bar=False)
    strategy = P2RStrategy(compile=compile_backend, offload_fraction=offload_fraction, log_telemetry=False,
                           host_step=host_step, accumulation=accumulation,
                           micro_batches=micro_batches if layered else 1, recompute=layered)
    trainer_accumulation = 1 if layered else micro_batches
    loader = random_windows(config, sizes, sizes.steps * trainer_accumulation,
                            sizes.batch_size * (micro_batches if layered else 1))
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(accelerator=device.type, devices=1, strategy=strategy, max_steps=sizes.steps,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0, default_root_dir=root,
                            callbacks=[timer, throughput], precision="bf16-mixed", use_distributed_sampler=False,
                            accumulate_grad_batches=trainer_accumulation)
        trainer.fit(module, train_dataloaders=loader)
    timed = strategy.telemetry_history[sizes.warmup:]
    offload = {f"{name}_ms": 1000 * statistics.median(getattr(stats, f"{name}_seconds") for stats in timed)
               for name in ("host_step", "copy_wait")} if timed else {}
    return {"seconds": _median_step(timer.ends, sizes.warmup, trainer_accumulation),
            "logged_mfu": throughput.last.get("perf/mfu", float("nan"))} | offload


def _single_process_group(device: torch.device) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{find_free_network_port()}", rank=0,
                            world_size=1)


def run_peer(config: M6Config, sizes: Sizes, device: torch.device, *, compile_backend: str | bool) -> float:
    """Median seconds per step of ``config`` under plain FSDP2 + per-block ``torch.compile`` (torchtitan's way):
    bf16 parameters in compute through ``MixedPrecisionPolicy``, fp32 gradient reduction, fused AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    _single_process_group(device)
    torch.manual_seed(0)
    with torch.device(device):
        model = M6Transformer(config)
    mesh = init_device_mesh(device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        if compile_backend:
            block.compile(backend="inductor" if compile_backend is True else compile_backend)
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    ends = []
    for batch in random_windows(config, sizes, sizes.steps):
        batch = batch.to(device)
        out = model(batch[:, :-1])
        ce = F.cross_entropy(out.logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss = ce + config.router_aux_loss_coef * out.aux_loss + config.router_z_loss_coef * out.z_loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        ends.append(time.perf_counter())
    return _median_step(ends, sizes.warmup)


def check_moe_syncs(config: M6Config, device: torch.device) -> dict[str, Any]:
    """One MoE layer, grouped kernel, forward + backward under bf16 autocast: host synchronizations (CUDA's sync
    debug mode raises at the first; on CPU the counter counts) and the largest difference from the loop kernel."""
    torch.manual_seed(0)
    grouped = MoEFeedForward(replace(config, expert_kernel="grouped")).to(device)
    loop = MoEFeedForward(replace(config, expert_kernel="loop")).to(device)
    loop.load_state_dict(grouped.state_dict())
    x = torch.randn(4096 if device.type == "cuda" else 64, config.dim, device=device)
    status = "no host sync"
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = grouped(x)  # a first call outside the check: lazy CUDA initialization may synchronize
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                out = grouped(x)
                (out.output.float().sum() + out.aux_loss).backward()
            except RuntimeError as error:
                status = f"synchronized: {str(error).splitlines()[0][:120]}"
            finally:
                torch.cuda.set_sync_debug_mode(0)
        else:
            with HostSyncCounter() as counter:
                out = grouped(x)
                (out.output.float().sum() + out.aux_loss).backward()
            status = "no host sync" if counter.total == 0 else f"host syncs {dict(counter.counts)}"
        reference = loop(x).output
    difference = (out.output.float() - reference.float()).abs().max().item()
    scale = reference.float().abs().max().item()
    return {"status": f"{status}; grouped vs loop max |diff| {difference:.3g} (max |out| {scale:.3g})"}


@dataclass(frozen=True)
class Arm:
    name: str
    model: str  # "moe" | "dense" | "-"
    kernel: str
    compile: bool
    run: Callable[[Sizes, torch.device, Any], Any]
    offload_fraction: float = 0.0
    host_step: str = "-"
    micro_batches: int = 1
    accumulation: str = "-"


def _arms() -> list[Arm]:
    def p2r(model: str, kernel: str, compile_: bool, fraction: float = 0.0, host_step: str = "exact",
            micro_batches: int = 1, accumulation: str = "standard") -> Callable:
        def go(sizes: Sizes, device: torch.device, backend: Any) -> float:
            config = replace(getattr(sizes, model), expert_kernel=kernel)
            return run_p2r(config, sizes, device, compile_backend=backend if compile_ else False,
                           offload_fraction=fraction, host_step=host_step, micro_batches=micro_batches,
                           accumulation=accumulation)
        return go

    def offload(model: str, compile_: bool, fraction: float, host_step: str, micro_batches: int = 1) -> Arm:
        layered = micro_batches > 1  # an offloaded block is fetched once per step only under layered accumulation
        name = (f"{model}-offload-{'all' if fraction == 1.0 else 'half'}{'-delayed' if host_step == 'delayed' else ''}"
                f"{f'-layered{micro_batches}' if layered else ''}{'-compile' if compile_ else ''}")
        kernel = "grouped" if model == "moe" else "auto"
        accumulation = "layered" if layered else "standard"
        return Arm(name, model, "grouped" if model == "moe" else "-", compile_,
                   p2r(model, kernel, compile_, fraction, host_step, micro_batches, accumulation),
                   offload_fraction=fraction, host_step=host_step, micro_batches=micro_batches,
                   accumulation=accumulation if layered else "-")

    def accumulated(model: str, compile_: bool, micro_batches: int) -> Arm:
        """The resident model over the same tokens per step, by Lightning's (standard) accumulation."""
        kernel = "grouped" if model == "moe" else "auto"
        return Arm(f"{model}{'-compile' if compile_ else ''}-accum{micro_batches}", model,
                   "grouped" if model == "moe" else "-", compile_, p2r(model, kernel, compile_, 0.0, "exact",
                                                                      micro_batches, "standard"),
                   micro_batches=micro_batches, accumulation="standard")

    def peer(model: str) -> Callable:
        def go(sizes: Sizes, device: torch.device, backend: Any) -> float:
            config = replace(getattr(sizes, model), expert_kernel="grouped")
            return run_peer(config, sizes, device, compile_backend=backend)
        return go

    return [
        Arm("sync", "moe", "grouped", False, lambda sizes, device, backend: check_moe_syncs(sizes.moe, device)),
        Arm("moe-loop", "moe", "loop", False, p2r("moe", "loop", False)),
        Arm("moe-grouped", "moe", "grouped", False, p2r("moe", "grouped", False)),
        Arm("moe-grouped-compile", "moe", "grouped", True, p2r("moe", "grouped", True)),
        Arm("moe-peer", "moe", "grouped", True, peer("moe")),
        Arm("dense-compile", "dense", "-", True, p2r("dense", "auto", True)),
        Arm("dense-peer", "dense", "-", True, peer("dense")),
        offload("moe", False, 0.5, "exact"),
        offload("moe", False, 1.0, "exact"),
        offload("moe", False, 0.5, "delayed"),
        offload("moe", False, 1.0, "delayed"),
        offload("moe", True, 1.0, "delayed"),
        offload("dense", True, 1.0, "exact"),
        offload("dense", True, 1.0, "delayed"),
        accumulated("moe", False, 4),
        offload("moe", False, 1.0, "exact", 4),
        offload("moe", False, 1.0, "delayed", 4),
        accumulated("dense", True, 4),
        offload("dense", True, 1.0, "delayed", 4),
    ]


def measure_arm(arm: Arm, sizes: Sizes, device: torch.device, backend: Any, peaks: tuple[Any, Any]
                ) -> dict[str, Any]:
    config = getattr(sizes, arm.model)
    row: dict[str, Any] = {"arm": arm.name, "model": arm.model, "kernel": arm.kernel, "compile": arm.compile,
                           "offloaded": f"{round(arm.offload_fraction * config.num_layers)}/{config.num_layers}",
                           "host_step": arm.host_step, "micro_batches": arm.micro_batches,
                           "accumulation": arm.accumulation}
    total, active = parameter_counts(config)
    row |= {"params_M": total / 1e6, "active_M": active / 1e6}
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        result = arm.run(sizes, device, backend)
    except Exception as error:  # an arm that fails is a finding: report it, run the next one
        traceback.print_exc()
        row["status"] = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
        result = None
    row["wall_s"] = time.perf_counter() - start
    if arm.compile:
        row["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
    if isinstance(result, dict) and "seconds" in result:
        row |= {key: value for key, value in result.items() if key != "seconds"}
        result = result["seconds"]
    if isinstance(result, dict):
        row |= result
    elif result is not None:
        tokens_per_s = sizes.batch_size * arm.micro_batches * sizes.seq_len / result
        forward = model_forward_flops(config, sizes.seq_len)
        table_peak, matmul_peak = peaks
        row |= {"tokens_per_s": tokens_per_s, "step_ms": 1000 * result,
                "tflops": training_flops_per_token(forward) * tokens_per_s / 1e12,
                "mfu": mfu(tokens_per_s, forward, table_peak), "mfu_vs_matmul": mfu(tokens_per_s, forward, matmul_peak),
                "status": "ok"}
    if device.type == "cuda":
        row["cuda_max_alloc_MB"] = torch.cuda.max_memory_allocated() / 2**20
    return row


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny models on any device: the code paths, in seconds")
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="skip the arms that would start after this many seconds (default: %(default)s)")
    parser.add_argument("--arms", help="comma-separated arm names to run (default: all)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    sizes = smoke_sizes() if args.smoke or args.quick else full_sizes()
    arms = _arms()
    if args.arms:
        wanted = [name.strip() for name in args.arms.split(",")]
        unknown = sorted(set(wanted) - {arm.name for arm in arms})
        if unknown:
            parser.error(f"unknown arms {unknown}; choose from {[arm.name for arm in arms]}")
        by_name = {arm.name: arm for arm in arms}
        arms = [by_name[name] for name in wanted]  # in the order asked: a run cut short keeps the first
    backend: Any = True if device.type == "cuda" else "aot_eager"
    env = environment_info(device)
    print_environment(env)
    matmul_peak = matmul_peak_tflops(device) if device.type == "cuda" else None
    table_peak = peak_tflops(env["device_name"], torch.bfloat16) if device.type == "cuda" else None
    print(f"peaks: table {table_peak} TFLOP/s, measured bf16 matmul {matmul_peak and round(matmul_peak)} TFLOP/s")
    out = Path(args.out)
    rows: list[dict[str, Any]] = []
    began = time.perf_counter()
    for arm in arms:
        if time.perf_counter() - began > args.budget_s:
            rows.append({"arm": arm.name, "model": arm.model, "status": f"skipped: past --budget-s {args.budget_s}"})
            continue
        rows.append(measure_arm(arm, sizes, device, backend, (table_peak, matmul_peak)))
        print(f"[{time.perf_counter() - began:6.1f} s] " + ", ".join(f"{k}={v}" for k, v in rows[-1].items()),
              flush=True)
        write_csv(with_environment(rows, env), out / "gpu.csv")  # after each arm: a cut-short run keeps its rows
    print_table(rows, COLUMNS)
    timed = [row for row in rows if row.get("tokens_per_s")]
    if timed:
        save_bar_chart(out / "gpu.png", [row["arm"] for row in timed],
                       {"tokens/s": [row["tokens_per_s"] for row in timed]},
                       title=f"M6 on {env['device_name']} (bf16)", ylabel="tokens/s")
    print(f"wrote {out / 'gpu.csv'}" + (f", {out / 'gpu.png'}" if timed else ""))
    return rows


if __name__ == "__main__":
    main()
