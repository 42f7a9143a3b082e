"""The strategy's reduction of a logged value or a decision (``reduce_in_place``) on two gloo processes: every
operator Lightning passes by name or as a ``ReduceOp``, on float and integer tensors, gives each rank the same,
correct value (one all-reduce, without a barrier before it)."""

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from lightning_p2r.strategy.process_group import reduce_in_place

RANKS = 2


def _reduce_on_rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    try:
        value = float(rank + 1)  # ranks hold 1.0 and 2.0
        results = {
            "mean": reduce_in_place(torch.tensor(value), reduce_op="mean").item(),
            "avg": reduce_in_place(torch.tensor(value), reduce_op="avg").item(),
            "sum": reduce_in_place(torch.tensor(value), reduce_op="sum").item(),
            "max": reduce_in_place(torch.tensor(value), reduce_op="max").item(),
            "none_is_sum": reduce_in_place(torch.tensor(value), reduce_op=None).item(),
            "reduce_op_min": reduce_in_place(torch.tensor(value), reduce_op=dist.ReduceOp.MIN).item(),
            # Lightning's reduce_boolean_decision: the count of ranks that agree, as an integer sum.
            "decision_count": reduce_in_place(torch.tensor(int(rank == 0)), reduce_op=dist.ReduceOp.SUM).item(),
            "integer_mean": reduce_in_place(torch.tensor(2 * rank + 2), reduce_op="mean").item(),
        }
        Path(out).with_suffix(f".rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def test_every_rank_gets_the_same_reduced_value_for_every_operator(tmp_path: Path) -> None:
    out = tmp_path / "reduced"
    # Forked, not spawned: a spawned rank is a fresh interpreter importing torch, Lightning and this module (about
    # 8 s of CPU each on 2 cores) for a dozen all-reduces.
    mp.start_processes(_reduce_on_rank, args=(find_free_network_port(), str(out)), nprocs=RANKS, join=True,
                       start_method="fork")
    results = [json.loads(out.with_suffix(f".rank{rank}.json").read_text()) for rank in range(RANKS)]
    assert results[0] == results[1]
    assert results[0] == {"mean": 1.5, "avg": 1.5, "sum": 3.0, "max": 2.0, "none_is_sum": 3.0, "reduce_op_min": 1.0,
                          "decision_count": 1, "integer_mean": 3}
