"""How pytest-xdist (optional: ``pytest -n 2``) splits the suite among its workers (tests/conftest.py's hook): a
worker takes whole files, as ``--dist loadfile`` does, so that a file's module-scoped runs happen once, and the files
reading the session's model-parallel runs (tests/distributed/conftest.py: four launches, the tier's largest setup)
go to one worker together, so that those launches run once too."""

from pathlib import Path

MESH_RUN_FILES = {"test_parallel.py", "test_pipeline.py", "test_compile_parallel.py", "test_planner_counts.py"}


def xdist_scope(nodeid: str) -> str:
    """The unit of work a worker takes whole: the test's file, or one scope for the mesh-run files."""
    path = nodeid.split("::", 1)[0]
    return "mesh_runs" if Path(path).name in MESH_RUN_FILES else path


def by_file_shared_runs_together(config, log):
    """xdist's scope scheduler with :func:`xdist_scope` as the scope."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFileSharedRunsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return ByFileSharedRunsTogether(config, log)
