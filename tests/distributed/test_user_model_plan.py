"""A user's own block-sequence model declares its parallel plan (``protocols.ParallelPlan``) and trains under
``P2RStrategy(tensor_parallel=2)`` with the losses of a plain one-process run on the same batches."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("user_model_worker.py")


def _run(out: Path, tensor_parallel: int, expert_parallel: int = 1, *extra: str, data_parallel: int = 1) -> list[dict]:
    env = os.environ | {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    for key in ("LOCAL_RANK", "WORLD_SIZE", "GLOBAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    result = subprocess.run([sys.executable, str(WORKER), "--out", str(out), "--tensor-parallel",
                             str(tensor_parallel), "--expert-parallel", str(expert_parallel), "--data-parallel",
                             str(data_parallel), *extra],
                            capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = tensor_parallel * expert_parallel * data_parallel
    name = f"tp{tensor_parallel}.ep{expert_parallel}.dp{data_parallel}"
    return [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_user_model_with_its_own_plan_trains_tensor_parallel_like_one_process(tmp_path: Path) -> None:
    (reference,) = _run(tmp_path, 1)
    ranks = _run(tmp_path, 2)
    for rank in ranks:
        # embedding, head and each block's two linear layers (weights and biases) are split
        assert rank["split_parameters"] >= 2 + 3 * 3
        assert rank["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)
    assert reference["losses"][-1] < reference["losses"][0]  # it trains: the comparison means something


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_users_own_moe_with_a_declared_expert_plan_trains_expert_parallel_like_one_process(tmp_path: Path) -> None:
    """Issue 39 item 2: the strategy splits whatever expert module the plan declares (not only M6's)."""
    (reference,) = _run(tmp_path, 1, 1, "--experts")
    ranks = _run(tmp_path, 1, 2, "--experts")
    assert reference["experts_held"] == [4, 4, 4]
    for rank in ranks:
        assert rank["experts_held"] == [2, 2, 2]  # each rank holds and runs half of every layer's experts
    # Each data rank's losses are its half of the batch: their mean is the one-process loss of the whole batch.
    mean = [sum(values) / 2 for values in zip(*(rank["losses"] for rank in ranks))]
    assert mean == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)
    assert reference["losses"][-1] < reference["losses"][0]


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sharding", ["none", "zero1"])
def test_replicas_built_eagerly_from_different_seeds_start_from_rank_zeros_model(tmp_path: Path, sharding: str) -> None:
    """Issue 39 item 1: replicated data parallelism is FSDP2's replicate layout, which (unlike DDP's wrapper) does not
    broadcast a model; the placement copies rank 0's eager model to the others, so a script without a common seed
    still trains one model, the one-process run's from rank 0's seed."""
    (reference,) = _run(tmp_path, 1)
    ranks = _run(tmp_path, 1, 1, "--seed-per-rank", "--sharding", sharding, data_parallel=2)
    assert ranks[0]["weights"] == ranks[1]["weights"]  # one model, however each rank built its own
    mean = [sum(values) / 2 for values in zip(*(rank["losses"] for rank in ranks))]
    assert mean == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)
    assert reference["weights"] == pytest.approx(ranks[0]["weights"], rel=1e-5, abs=1e-6)
