"""Streaming a prepared directory on two processes: data-parallel ranks read different batches, the ranks of a
tensor-parallel group or of a pipeline the same one, and a resumed run reads what an uninterrupted one would have
read."""

import json
from pathlib import Path

import pytest
from worker_launch import launch_configs

from lightning_p2r.data.prepared import prepare_data

pytest.importorskip("litdata", reason="litdata is installed by the README's second pip step (--no-deps)")

WORKER = Path(__file__).with_name("streaming_worker.py")
CONFIGS = [{"name": "dp2", "strategy": {}}, {"name": "tp2", "strategy": {"tensor_parallel": 2}},
           {"name": "pp2", "strategy": {"pipeline_parallel": 2, "micro_batches": 2}},
           {"name": "dp2_workers", "strategy": {}, "workers": 1}]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("streaming")
    corpus = out / "corpus.txt"
    corpus.write_text("".join(f"Line {i} of a corpus streamed to two ranks.\n" for i in range(800)))
    prepare_data(str(corpus), out / "prepared", tokenizer="bytes", log=lambda line: None)
    launch_configs(WORKER, out, 2, [config | {"prepared": str(out / "prepared")} for config in CONFIGS])
    return out


def _ranks(out: Path, name: str) -> list[dict]:
    return [json.loads((out / f"{name}-rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["dp2", "dp2_workers"])
def test_data_parallel_ranks_read_their_own_batches_and_resume_them(runs: Path, name: str) -> None:
    ranks = _ranks(runs, name)
    for rank in ranks:
        assert len(rank["straight"]) == 6 and rank["resumed"] == rank["straight"]
    assert all(a != b for a, b in zip(ranks[0]["straight"], ranks[1]["straight"]))
    assert [rank["replicas"] for rank in ranks] == [[2, 0], [2, 1]]


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["tp2", "pp2"])
def test_a_tensor_parallel_group_or_a_pipeline_reads_one_batch_and_resumes_it(runs: Path, name: str) -> None:
    ranks = _ranks(runs, name)
    assert [rank["replicas"] for rank in ranks] == [[1, 0], [1, 0]]  # one data-parallel replica over both ranks
    assert ranks[0]["straight"] == ranks[1]["straight"] and len(ranks[0]["straight"]) == 6
    assert ranks[0]["resumed"] == ranks[0]["straight"]
