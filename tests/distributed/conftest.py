"""The model-parallel tests' worker runs, shared by test_parallel.py, test_pipeline.py and
test_compile_parallel.py: four launches (one process for the references and checkpoints, two processes, four
processes, one process again to resume); and the cache folder the recipe runs share."""

from pathlib import Path

import pytest
from mesh_configs import (
    COMPILE_TWO_PROCESSES,
    FOUR_PROCESSES,
    ONE_PROCESS,
    PIPELINE_FOUR_PROCESSES,
    PIPELINE_ONE_PROCESS,
    PIPELINE_RESUME,
    PIPELINE_TWO_PROCESSES,
    RESUME,
    TWO_PROCESSES,
)
from worker_launch import launch_configs

WORKER = Path(__file__).with_name("parallel_worker.py")


@pytest.fixture(scope="session")
def recipe_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache folder (tokenizers, prepared corpora) for the session's recipe runs (recipe_runs.run_command): the
    first run that needs the KJV's BPE tokenizer or prepared corpus builds it, the others read it, as a user's
    second run does."""
    return tmp_path_factory.mktemp("recipe-cache")


@pytest.fixture(scope="session")
def mesh_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mesh")
    launch_configs(WORKER, out, 1, ONE_PROCESS + PIPELINE_ONE_PROCESS)
    launch_configs(WORKER, out, 2, TWO_PROCESSES + PIPELINE_TWO_PROCESSES + COMPILE_TWO_PROCESSES)
    launch_configs(WORKER, out, 4, FOUR_PROCESSES + PIPELINE_FOUR_PROCESSES)
    launch_configs(WORKER, out, 1, RESUME + PIPELINE_RESUME)
    return out
