"""A Hugging Face model under P2RStrategy's layouts against Lightning's own strategies on the same model: step time
(and their ratio), and the host memory each rank's build takes (issue 38).

    python -m lightning_p2r.benchmarks.hf_layouts [--steps 12] [--repeats 2] [--arms a,b,...] [--out DIR] [--quick]
    python -m lightning_p2r.benchmarks.hf_layouts --build-memory [--quick]

The model is a Qwen3-MoE from its config (random weights, fp32). P2RStrategy arms build it in place
(``CausalLMModule(hf_config=...)``: meta device, each rank materializing its share); the Lightning arms build it
eagerly in the LightningModule's ``__init__`` and, for ``ModelParallelStrategy``, ``fully_shard`` each decoder layer
and then the root in ``configure_model`` (Lightning's documented FSDP2 recipe). Every arm trains the same global
batch of random tokens on 2 gloo processes, one thread each. Arms run in turn, ``--repeats`` rounds, so a drift of
the machine reaches every arm alike; each arm's figure is the median over its rounds of the median optimizer-step
interval after warm-up. Build memory: each rank's resident-memory growth from the start of Lightning's ``setup`` to
the first batch (``SetupMemoryProbe``), against the model's fp32 parameter bytes. In the timing arms the Lightning
models are built before ``setup`` and transformers' model code is imported during it, so the column there is not a
build comparison: ``--build-memory`` makes one, with a Llama of ~0.9 GB built inside ``setup`` by both arms (P2R in
place under ZeRO-3, and Lightning's DDP building it eagerly in ``configure_model``), one step each.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from lightning_p2r.benchmarks.report import (
    base_parser,
    chosen_layouts,
    environment_info,
    print_environment,
    print_table,
    save_bar_chart,
    with_environment,
    write_csv,
)
from lightning_p2r.measure.run import run_rank_worker

WARMUP = 3
ARMS: dict[str, dict[str, Any]] = {
    "lightning ddp": {"peer": "ddp"},
    "p2r none": {"strategy": {}},
    "p2r zero1": {"strategy": {"sharding": "zero1"}},
    "lightning model_parallel fsdp2": {"peer": "model_parallel"},
    "p2r zero2": {"strategy": {"sharding": "zero2"}},
    "p2r zero3": {"strategy": {"sharding": "zero3"}},
    "p2r zero3 offload 0.5": {"strategy": {"sharding": "zero3", "offload_fraction": 0.5}},
    "p2r zero3 layered m2": {"strategy": {"sharding": "zero3", "accumulation": "layered", "micro_batches": 2}},
}
BUILD_ARMS: dict[str, dict[str, Any]] = {
    "lightning ddp, eager build": {"peer": "ddp", "build_in_setup": True},
    "p2r zero3, built in place": {"strategy": {"sharding": "zero3"}},
    "p2r zero3 offload 0.5, built in place": {"strategy": {"sharding": "zero3", "offload_fraction": 0.5}},
}
PEER_OF = {"p2r none": "lightning ddp", "p2r zero1": "lightning ddp", "p2r zero2": "lightning model_parallel fsdp2",
           "p2r zero3": "lightning model_parallel fsdp2"}
"""Each P2R arm's Lightning counterpart for the ratio column (the same data-parallel layout)."""


def hf_config(quick: bool) -> dict[str, Any]:
    size = ({"hidden_size": 64, "num_hidden_layers": 2, "moe_intermediate_size": 32} if quick else
            {"hidden_size": 256, "num_hidden_layers": 6, "moe_intermediate_size": 128})
    return size | {"model_type": "qwen3_moe", "vocab_size": 2048, "intermediate_size": 512,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": size["hidden_size"] // 4,
                   "num_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 512}


def build_config(quick: bool) -> dict[str, Any]:
    """A dense Llama of ~220 M parameters (0.9 GB in fp32), or a small one with ``quick``."""
    size = ({"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "vocab_size": 1024} if quick else
            {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 12, "vocab_size": 32000})
    return size | {"model_type": "llama", "num_attention_heads": 8, "num_key_value_heads": 8,
                   "max_position_embeddings": 512, "tie_word_embeddings": False}


def _peer_module(spec: dict[str, Any]) -> Any:
    """An eager build in ``__init__`` (or in ``configure_model`` with ``build_in_setup``, under DDP's eager init);
    under ModelParallelStrategy, FSDP2 applied in ``configure_model``."""
    from torch.distributed.fsdp import fully_shard

    from lightning_p2r.causal_lm import CausalLMModule, build_hf_model

    class PeerModule(CausalLMModule):
        def configure_model(self) -> None:
            if self.model is None:
                self.model = build_hf_model(spec["hf_config"])
            mesh = getattr(self, "device_mesh", None)
            if spec["peer"] != "model_parallel" or mesh is None:
                return
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh["data_parallel"])
            fully_shard(self.model, mesh=mesh["data_parallel"])

    module = PeerModule(model=None if spec.get("build_in_setup") else build_hf_model(spec["hf_config"]),
                        hf_config=spec["hf_config"] if spec.get("build_in_setup") else None,
                        optimizer={"warmup_steps": 1})
    return module


def _worker(spec: dict[str, Any]) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist

    from lightning_p2r import P2RStrategy
    from lightning_p2r.causal_lm import CausalLMModule
    from lightning_p2r.measure.memory import SetupMemoryProbe
    from lightning_p2r.measure.run import OptimizerStepTimer

    L.seed_everything(0)
    if "peer" in spec:
        from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

        module = _peer_module(spec)
        strategy = (DDPStrategy() if spec["peer"] == "ddp" else
                    ModelParallelStrategy(data_parallel_size=spec["devices"], tensor_parallel_size=1))
    else:
        module = CausalLMModule(hf_config=spec["hf_config"], optimizer={"warmup_steps": 1})
        strategy = P2RStrategy(**spec["strategy"])
    ends, probe = OptimizerStepTimer(), SetupMemoryProbe()
    trainer = L.Trainer(accelerator="cpu", devices=spec["devices"], max_steps=spec["steps"], strategy=strategy,
                        logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[ends, probe])
    seq = spec["seq_len"]
    data = torch.randint(0, spec["hf_config"]["vocab_size"], (spec["steps"] * spec["global_batch"], seq + 1),
                         generator=torch.Generator().manual_seed(0))
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=spec["global_batch"] // spec["devices"]))
    steps = [b - a for a, b in zip(ends.ends[WARMUP - 1:], ends.ends[WARMUP:])] or [float("nan")]
    report = {"rank": trainer.global_rank, "step_s": statistics.median(steps),
              "setup_growth": probe.result.setup_growth,
              "param_bytes": sum(p.numel() * 4 for p in module.model.parameters())}
    Path(spec["out"]).with_suffix(f".rank{trainer.global_rank}.json").write_text(json.dumps(report))
    if dist.is_initialized():
        dist.barrier()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker(json.loads(sys.argv[2]))
        return {}
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2, help="rounds over the arms (alternating)")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--arms", type=str, default=None, help="comma-separated, of: " + ", ".join(ARMS))
    parser.add_argument("--build-memory", action="store_true", help="measure the build's memory instead (a ~0.9 GB "
                        "Llama built inside setup: in place under P2RStrategy, eagerly under Lightning's DDP)")
    args = parser.parse_args(argv)
    if args.build_memory:
        return _build_memory(args)
    names = chosen_layouts(parser, args.arms or ",".join(ARMS), ARMS)
    if args.quick:
        args.steps, args.repeats, args.seq_len = WARMUP + 2, 1, 32
    config = hf_config(args.quick)
    env = environment_info("cpu")
    print_environment(env)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    measured: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for round_index in range(args.repeats):
        for name in names:
            spec = {"name": name, "hf_config": config, "steps": args.steps, "global_batch": args.global_batch,
                    "seq_len": args.seq_len, "devices": 2, "out": str(out / ".hf_layouts_run"), **ARMS[name]}
            reports = run_rank_worker("lightning_p2r.benchmarks.hf_layouts", spec, timeout=1200)
            measured[name].append({"step_s": statistics.median(r["step_s"] for r in reports),
                                   "setup_growth": max(r["setup_growth"] for r in reports),
                                   "param_bytes": reports[0]["param_bytes"]})
            print(f"round {round_index + 1}: {name}: {measured[name][-1]['step_s']:.4f} s/step", flush=True)
    rows = []
    for name in names:
        step_s = statistics.median(m["step_s"] for m in measured[name])
        rows.append({"arm": name, "step_s": round(step_s, 4),
                     "tokens_per_s": round(args.global_batch * args.seq_len / step_s, 1),
                     "rounds_min_max_s": f"{min(m['step_s'] for m in measured[name]):.4f}-"
                                         f"{max(m['step_s'] for m in measured[name]):.4f}",
                     "build_growth_mb_per_rank": round(max(m["setup_growth"] for m in measured[name]) / 2**20, 1),
                     "model_mb": round(measured[name][0]["param_bytes"] / 2**20, 1)})
    by_name = {row["arm"]: row for row in rows}
    for row in rows:
        peer = by_name.get(PEER_OF.get(row["arm"], ""))
        row["vs_lightning"] = round(row["step_s"] / peer["step_s"], 3) if peer else None
    print_table(rows, ["arm", "step_s", "tokens_per_s", "rounds_min_max_s", "vs_lightning",
                       "build_growth_mb_per_rank", "model_mb"])
    write_csv(with_environment(rows, env), out / "hf_layouts.csv")
    save_bar_chart(out / "hf_layouts.png", [r["arm"] for r in rows], {"s/step": [r["step_s"] for r in rows]},
                   ylabel="seconds per optimizer step (median)",
                   title="HF Qwen3-MoE on 2 CPU processes: P2RStrategy vs Lightning's strategies")
    print(f"wrote {out / 'hf_layouts.csv'}, {out / 'hf_layouts.png'}")
    return {"rows": rows}


def _build_memory(args: Any) -> dict[str, Any]:
    """Each arm once, one optimizer step: the largest resident-memory growth of a rank while it builds and places
    the model, against the model's fp32 bytes (2 processes; one launch per arm, so imports are the same)."""
    config = build_config(args.quick)
    env = environment_info("cpu")
    print_environment(env)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, arm in BUILD_ARMS.items():
        spec = {"name": name, "hf_config": config, "steps": 1, "global_batch": 2, "seq_len": 16, "devices": 2,
                "out": str(out / ".hf_build_run"), **arm}
        reports = run_rank_worker("lightning_p2r.benchmarks.hf_layouts", spec, timeout=1800)
        growth = max(r["setup_growth"] for r in reports)
        model = reports[0]["param_bytes"]
        rows.append({"arm": name, "model_mb": round(model / 2**20, 1),
                     "build_growth_mb_per_rank": round(growth / 2**20, 1),
                     "growth_over_model": round(growth / model, 3)})
        print(f"{name}: done", flush=True)
    print_table(rows, ["arm", "model_mb", "build_growth_mb_per_rank", "growth_over_model"])
    write_csv(with_environment(rows, env), out / "hf_build_memory.csv")
    save_bar_chart(out / "hf_build_memory.png", [r["arm"] for r in rows],
                   {"growth / model bytes": [r["growth_over_model"] for r in rows]},
                   ylabel="peak RSS growth in setup / model fp32 bytes (per rank)",
                   title="Building a Llama on 2 CPU processes: in place vs eager")
    print(f"wrote {out / 'hf_build_memory.csv'}, {out / 'hf_build_memory.png'}")
    return {"rows": rows}


if __name__ == "__main__":
    main()
