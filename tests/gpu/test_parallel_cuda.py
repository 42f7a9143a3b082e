"""Tensor and expert parallelism on 2 CUDA devices (NCCL) against one device, with the CPU test's worker and
comparisons (tests/distributed/test_parallel.py). Skipped unless 2 devices are present: one GPU cannot run a
multi-rank NCCL job. Written without a GPU to run it on (none was lent): a first run may need fixes."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from test_parallel import _assert_matches  # noqa: E402
from worker_launch import launch_configs  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.distributed,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL, 2 ranks)")]

CUDA = {"accelerator": "cuda"}
WORKER = Path(__file__).resolve().parents[1] / "distributed" / "parallel_worker.py"


def _launch(out: Path, devices: int, configs: list[dict]) -> None:
    launch_configs(WORKER, out, devices, configs)


@pytest.mark.timeout(900)
def test_tensor_and_expert_parallel_on_two_gpus_match_one_gpu(tmp_path: Path) -> None:
    _launch(tmp_path, 1, [{"name": "reference"} | CUDA])
    _launch(tmp_path, 2, [{"name": "tp2", "strategy": {"tensor_parallel": 2}} | CUDA,
                          {"name": "ep2_zero3", "strategy": {"expert_parallel": 2, "sharding": "zero3"}} | CUDA,
                          {"name": "ep2_zero3_offload", "strategy": {"expert_parallel": 2, "sharding": "zero3",
                                                                     "offload_fraction": 0.5}} | CUDA])
    for name in ("tp2", "ep2_zero3", "ep2_zero3_offload"):
        _assert_matches(tmp_path, name, "reference")
