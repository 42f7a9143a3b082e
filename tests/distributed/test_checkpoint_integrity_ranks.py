"""A checkpoint's checksums read by two gloo ranks at once (``check_integrity_on_ranks``): each reads its share,
both refuse a damaged file with the same message, including when reading fails on one rank only (which used to
leave the other waiting in the collective)."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.fabric.plugins.environments.lightning import find_free_network_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from helpers import flip_inside_largest_record  # noqa: E402

from lightning_p2r.strategy import checkpoint_integrity  # noqa: E402

RANKS = 2


def _check_on_rank(rank: int, port: int, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    results = {}
    try:
        for name in ("intact", "flipped", "unreadable"):
            if name == "unreadable" and rank == 1:  # reading fails on this rank only
                checkpoint_integrity.integrity_problems = lambda *args: 1 / 0
            try:
                checkpoint_integrity.check_integrity_on_ranks(Path(folder) / ("intact.ckpt" if name == "intact"
                                                                              else "flipped.ckpt"))
                results[name] = "accepted"
            except ValueError as error:
                results[name] = str(error)
        Path(folder, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def test_both_ranks_refuse_a_damaged_checkpoint_alike(tmp_path: Path) -> None:
    for name in ("intact", "flipped"):
        torch.save({"state_dict": {f"w{i}": torch.randn(64, 64) for i in range(4)}}, tmp_path / f"{name}.ckpt")
    flip_inside_largest_record(tmp_path / "flipped.ckpt")
    mp.start_processes(_check_on_rank, args=(find_free_network_port(), str(tmp_path)), nprocs=RANKS, join=True,
                       start_method="fork")
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(RANKS)]
    assert results[0] == results[1]
    assert results[0]["intact"] == "accepted"
    assert "flipped.ckpt is damaged: record flipped/data/" in results[0]["flipped"]
    assert "reading it failed (ZeroDivisionError" in results[0]["unreadable"]
