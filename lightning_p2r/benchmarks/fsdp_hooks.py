"""What FSDP2's wrapping costs per unit and micro-batch on a mesh of one rank: ``calibrate``'s tiny blocks against
M6 blocks of real widths.

    python -m lightning_p2r.benchmarks.fsdp_hooks [--widths 80 160] [--experts 0 8] [--repeats 15] [--out DIR]

``calibrate`` prices FSDP2's hooks (``module_hook_overhead``) from a stack of tiny blocks
(``lightning_p2r.measure.module_hooks``), one constant per unit and micro-batch whatever the block. This times the
same protocol on M6 transformers of 3 blocks (dense, or every block MoE), one process, a gloo group of one rank,
4 micro-batches of one 64-token sequence, gradient sync on the last: the step plain, then with every block and the
root wrapped by ``fully_shard`` (resharding after forward or not); the difference per wrapped module and micro-batch
is the hook cost. A unit's bytes are printed beside it: FSDP2 also copies each parameter into and out of its
buffers when it gathers, which grows with them. One thread; each timing the median of ``--repeats`` steps after 3
warm-up ones, the three models timed in turn ``--rounds`` times and each figure the median over the rounds.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_p2r.benchmarks.report import (
    base_parser,
    environment_info,
    print_environment,
    print_table,
    save_bar_chart,
    with_environment,
    write_csv,
)
from lightning_p2r.measure.module_hooks import (
    HOOK_MICRO_BATCHES,
    HOOK_WIDTH,
    hook_call_overhead,
    hook_stack,
    hooked_step_seconds,
    module_hook_seconds,
)

BLOCKS = 3
SEQ_LEN = 64


def _transformer(width: int, experts: int) -> torch.nn.Module:
    from lightning_p2r import M6Config, M6LanguageModel

    config = M6Config(vocab_size=512, max_seq_len=SEQ_LEN, num_layers=BLOCKS, dim=width, num_heads=width // 16,
                      num_experts=max(experts, 2), moe_layers=None if experts else [], moe_top_k=1,
                      capacity_factor=None, init_seed=0)
    torch.manual_seed(0)
    module = M6LanguageModel(config)
    module.configure_model()
    return module.transformer


def _logits_mean(output: Any) -> torch.Tensor:
    return output.logits.float().mean()


def m6_hook_row(width: int, experts: int, mesh: Any, repeats: int, rounds: int) -> dict[str, Any]:
    """The hook cost per wrapped module and micro-batch of a 3-block M6 transformer (see the module docstring): the
    plain and the two wrapped models timed in turn ``rounds`` times, each round's difference, their median (one slow
    spell of the machine moves one round, not the figure)."""
    from torch.distributed.fsdp import fully_shard

    tokens = torch.randint(0, 512, (1, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    models = {"plain": _transformer(width, experts)}
    for reshard in (False, True):
        model = _transformer(width, experts)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        models[reshard] = model
    per_round: dict[Any, list[float]] = {"plain": [], False: [], True: []}
    for _ in range(rounds):
        times = {key: hooked_step_seconds(model, tokens, repeats, _logits_mean) for key, model in models.items()}
        per_round["plain"].append(times["plain"])
        for reshard in (False, True):
            per_round[reshard].append(hook_call_overhead(times["plain"], times[reshard], BLOCKS + 1,
                                                         HOOK_MICRO_BATCHES))
    kept, resharded = statistics.median(per_round[False]), statistics.median(per_round[True])
    block_bytes = sum(p.numel() * p.element_size() for p in models["plain"].blocks[0].parameters())
    return {"blocks": f"M6 width {width}, " + (f"{experts} experts" if experts else "dense"),
            "unit_MB": block_bytes / 2**20, "plain_step_ms": statistics.median(per_round["plain"]) * 1e3,
            "hook_ms_kept": kept * 1e3, "hook_ms_resharded": resharded * 1e3, "hook_ms": (kept + resharded) / 2 * 1e3}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_p2r.measure.run import free_port

    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[80, 160])
    parser.add_argument("--experts", type=int, nargs="+", default=[0, 8])
    parser.add_argument("--repeats", type=int, default=15, help="timed steps per round (their median)")
    parser.add_argument("--rounds", type=int, default=3, help="the models timed in turn this many times")
    args = parser.parse_args(argv)
    if args.quick:
        args.widths, args.experts, args.repeats, args.rounds = [32], [0, 4], 2, 1
    torch.set_num_threads(1)
    env = environment_info("cpu")
    print_environment(env)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        tiny_bytes = sum(p.numel() * p.element_size() for p in hook_stack(torch.device("cpu"))[0].parameters())
        rows = [{"blocks": f"calibrate's tiny blocks (width {HOOK_WIDTH})", "unit_MB": tiny_bytes / 2**20,
                 "plain_step_ms": float("nan"), "hook_ms_kept": float("nan"), "hook_ms_resharded": float("nan"),
                 "hook_ms": module_hook_seconds(torch.device("cpu"), mesh, args.repeats) * 1e3}]
        rows += [m6_hook_row(width, experts, mesh, args.repeats, args.rounds)
                 for width in args.widths for experts in args.experts]
    finally:
        if owned:
            dist.destroy_process_group()
    print_table(rows, ["blocks", "unit_MB", "plain_step_ms", "hook_ms_kept", "hook_ms_resharded", "hook_ms"])
    write_csv(with_environment(rows, env), out / "fsdp_hooks.csv")
    save_bar_chart(out / "fsdp_hooks.png", [r["blocks"] for r in rows], {"ms per unit and micro-batch":
                                                                          [r["hook_ms"] for r in rows]},
                   ylabel="ms per wrapped module and micro-batch", title="FSDP2 over a one-rank mesh, 1 CPU thread")
    print(f"wrote {out / 'fsdp_hooks.csv'}, {out / 'fsdp_hooks.png'}")
    return {"rows": rows}


if __name__ == "__main__":
    main(sys.argv[1:])
