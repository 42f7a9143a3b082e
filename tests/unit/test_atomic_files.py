"""Files written whole: the permissions a plain open gives, no temporary file left (``lightning_p2r.files``)."""

import os
import stat
from pathlib import Path

import pytest

from lightning_p2r.files import replaced_atomically, write_atomically
from lightning_p2r.planning.cluster import Cluster, load_cluster, write_cluster


@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def test_a_file_is_written_whole_with_the_permissions_open_gives(tmp_path: Path, umask_022) -> None:
    path = tmp_path / "new" / "folder" / "file.yaml"
    write_atomically(path, "first\n")
    write_atomically(path, b"second\n")
    assert path.read_text() == "second\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # mkstemp's 0600 kept other users out
    assert [p.name for p in path.parent.iterdir()] == ["file.yaml"]


def test_a_failed_write_leaves_the_earlier_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "file.txt"
    write_atomically(path, "kept")
    with pytest.raises(TypeError):
        write_atomically(path, 3)  # type: ignore[arg-type]
    assert path.read_text() == "kept" and [p.name for p in tmp_path.iterdir()] == ["file.txt"]


def test_a_writer_taking_a_path_gets_a_temporary_file_renamed_in_place(tmp_path: Path, umask_022) -> None:
    """``replaced_atomically``: for ``torch.save``-like writers (the checkpoint conversions), the same rule."""
    path = tmp_path / "missing" / "out.ckpt"
    with replaced_atomically(path) as temporary:
        temporary.write_text("whole")
    assert path.read_text() == "whole" and stat.S_IMODE(path.stat().st_mode) == 0o644
    with pytest.raises(RuntimeError), replaced_atomically(path) as temporary:
        temporary.write_text("half")
        raise RuntimeError("interrupted")
    assert path.read_text() == "whole" and [p.name for p in path.parent.iterdir()] == ["out.ckpt"]


def test_a_cluster_file_calibrate_writes_is_readable_by_others(tmp_path: Path, umask_022) -> None:
    """``calibrate --out`` wrote its file 0600 (a new-user audit)."""
    path = tmp_path / "cluster.yaml"
    write_cluster(Cluster(name="here", devices=1, devices_per_node=1), path, comment="a comment")
    assert stat.S_IMODE(path.stat().st_mode) == 0o644 and load_cluster(path).name == "here"
