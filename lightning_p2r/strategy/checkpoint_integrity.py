"""Whether a checkpoint's bytes are the ones that were written, checked before a run resumes from it.

``torch.load`` reads a file's index and trusts its tensors' bytes: a copy with a few bytes flipped loads and trains
from wrong values, silently (a new user's audit: an Adam second moment of 1e6 after 400 flipped bytes). Both formats
carry checksums nobody reads: ``torch.save`` writes a zip archive, a CRC-32 per record, and torch distributed
checkpoint (DCP) stores each item as such an archive inside its ``.distcp`` files, at the offset and length its
``.metadata`` names. This module reads them all and reports what does not match: a record whose CRC fails, a shard
file missing or shorter than the items it should hold, an unreadable ``.metadata`` or ``meta.pt``.

The reading can be split over ranks (``part`` of ``parts``): each reads its share of the records, and the caller
gathers the problems so that every rank refuses the same checkpoint. A file in torch's legacy (pre-zip) format has
no checksums: only its loading checks it.
"""

from __future__ import annotations

import io
import zipfile
import zlib
from pathlib import Path
from typing import BinaryIO

import torch

_CHUNK = 1 << 20
_ZIP_MAGIC = b"PK\x03\x04"
"""The first bytes of a zip archive's first record: torch.save's files and DCP's items begin with them."""

META_FILE = "meta.pt"
"""A sharded checkpoint's file of everything Lightning saves besides the states (``strategy/checkpoint.py``)."""


def integrity_problems(path: str | Path, part: int = 0, parts: int = 1) -> list[str]:
    """What is wrong with the checkpoint at ``path`` (a file, or a sharded checkpoint's directory), among the records
    this ``part`` of ``parts`` reads (the whole-checkpoint checks: part 0); empty when nothing is."""
    path = Path(path)
    if path.is_dir():
        return _sharded_problems(path, part, parts)
    with path.open("rb") as stream:
        if stream.read(4) != _ZIP_MAGIC:
            return []  # torch's legacy format (no checksums), or not a checkpoint at all: loading it says which
        return _archive_problems(stream, part, parts)


def check_integrity(path: str | Path) -> None:
    """Raise a ``ValueError`` naming what is damaged in the checkpoint at ``path`` (every record read)."""
    raise_for(path, integrity_problems(path))


def check_integrity_on_ranks(path: str | Path) -> None:
    """:func:`check_integrity` with the reading split over the process group's ranks (when one is initialized): each
    reads its share, all learn every problem, and all raise alike (none goes on to a collective the others left)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return check_integrity(path)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        problems = integrity_problems(path, rank, world)
    except Exception as error:  # noqa: BLE001 (a rank that raised would leave the others waiting in the gather)
        problems = [f"reading it failed ({type(error).__name__}: {_first_line(error)})"]
    gathered: list[list[str] | None] = [None] * world
    dist.all_gather_object(gathered, problems)
    raise_for(path, [problem for problems in gathered for problem in problems or []])


def raise_for(path: str | Path, problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ValueError(f"checkpoint {path} is damaged: {'; '.join(problems[:3])}{more}. Its bytes are not the ones "
                         "written (an interrupted or failed copy?): use another checkpoint, or copy this one again")


def _archive_problems(stream: BinaryIO, part: int, parts: int) -> list[str]:
    """The records of the zip archive in ``stream`` (this part's share) whose bytes fail their CRC-32, or the
    archive's own damage (its index unreadable). A record stored with a CRC of 0 carries none (torch's
    ``set_crc32_options(False)``): not read."""
    try:
        archive = zipfile.ZipFile(stream)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as error:
        return [f"its archive's index cannot be read ({_first_line(error)})"] if part == 0 else []
    problems = []
    with archive:
        for info in [info for info in archive.infolist() if info.CRC != 0][part::parts]:
            try:
                with archive.open(info) as record:
                    while record.read(_CHUNK):  # the CRC is compared at the record's end
                        pass
            except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError) as error:
                problems.append(f"record {info.filename} fails its check ({_first_line(error)})")
    return problems


class _Window(io.RawIOBase):
    """The bytes [offset, offset + length) of an open file, as a seekable file of their own (a DCP item, read by
    zipfile without copying it into memory)."""

    def __init__(self, stream: BinaryIO, offset: int, length: int) -> None:
        super().__init__()
        self._stream, self._offset, self._length, self._position = stream, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = min(max(base + position, 0), self._length)
        return self._position

    def readinto(self, buffer) -> int:  # noqa: ANN001 (a writable buffer)
        count = min(len(buffer), self._length - self._position)
        if count <= 0:
            return 0
        self._stream.seek(self._offset + self._position)
        data = self._stream.read(count)
        buffer[:len(data)] = data
        self._position += len(data)
        return len(data)


def _sharded_problems(path: Path, part: int, parts: int) -> list[str]:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    problems = []
    if part == 0:
        try:
            torch.load(path / META_FILE, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 (any failure to read it is the same problem)
            problems.append(f"{META_FILE} cannot be read ({type(error).__name__}: {_first_line(error)})")
    try:
        storage = FileSystemReader(str(path)).read_metadata().storage_data
    except Exception as error:  # noqa: BLE001
        return problems + [f"its DCP index .metadata cannot be read ({type(error).__name__}: {_first_line(error)})"]
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in storage.items():
        by_file.setdefault(info.relative_path, []).append((info.offset, info.length, index.fqn))
    readable = []  # (file, offset, length, name) of every item in a file that holds it whole
    for name, items in sorted(by_file.items()):
        shard = path / name
        needed = max(offset + length for offset, length, _ in items)
        if not shard.is_file():
            problems += [f"{name} is missing"] if part == 0 else []
        elif shard.stat().st_size < needed:
            problems += ([f"{name} holds {shard.stat().st_size} bytes where its items need {needed} (truncated)"]
                         if part == 0 else [])
        else:
            readable += [(name, offset, length, fqn) for offset, length, fqn in sorted(items)]
    for name, offset, length, fqn in readable[part::parts]:
        with (path / name).open("rb") as stream:
            item = _Window(stream, offset, length)
            if item.read(4) != _ZIP_MAGIC:
                continue  # an item stored otherwise (a transform of a later torch): no checksum to read
            item.seek(0)
            problems += [f"{name}, item {fqn}: {problem}" for problem in _archive_problems(item, 0, 1)]
    return problems


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    line = text.splitlines()[0] if text else type(error).__name__
    return line if len(line) <= 100 else line[:100].rsplit(" ", 1)[0] + " ..."
