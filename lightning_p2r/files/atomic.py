"""Files written whole or not at all: a temporary file in the destination's folder, renamed over it (``os.replace``
is atomic on one file system), with the permissions a plain ``open`` would give (``mkstemp`` makes ``0600`` files,
which other users of a shared cache or run folder could not read)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def write_atomically(path: str | Path, data: bytes | str) -> None:
    """Write ``data`` (text as UTF-8) to ``path``, creating its folder; an interrupted write leaves an earlier file
    whole and no temporary file behind."""
    with replaced_atomically(path) as temporary:
        temporary.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


@contextmanager
def replaced_atomically(path: str | Path) -> Iterator[Path]:
    """A temporary file beside ``path`` (its folder created) for a writer that takes a path (``torch.save``,
    ``dcp_to_torch_save``), renamed over ``path`` when the block ends, removed if it raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    try:
        yield Path(temporary)
        os.chmod(temporary, 0o666 & ~_umask())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)  # reading it means setting it: set it straight back
    os.umask(mask)
    return mask
