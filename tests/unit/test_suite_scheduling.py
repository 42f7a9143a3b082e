"""The suite's own scheduling under pytest-xdist (tests/suite_scheduling.py): every file that reads the session's
model-parallel runs is kept on one worker, or the runs would happen once per worker."""

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_file_reading_the_shared_mesh_runs_is_scheduled_together() -> None:
    from suite_scheduling import MESH_RUN_FILES

    readers = {path.name for path in (TESTS / "distributed").glob("test_*.py")
               if re.search(r"\bmesh_runs\b", path.read_text(encoding="utf-8"))}
    assert readers == MESH_RUN_FILES


def test_the_scheduler_groups_by_file_and_the_mesh_files_together() -> None:
    from suite_scheduling import xdist_scope as scope

    assert scope("tests/distributed/test_parallel.py::test_a[x]") == scope("tests/distributed/test_pipeline.py::b")
    assert scope("tests/unit/test_cli.py::test_a") == scope("tests/unit/test_cli.py::test_b") != scope(
        "tests/unit/test_plan.py::test_a")
