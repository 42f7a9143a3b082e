"""A checkpoint's bytes checked against the checksums its format carries (``strategy/checkpoint_integrity.py``):
``torch.load`` trusts a single file's tensor bytes and DCP its shards', so a damaged copy resumed silently (a
new-user audit found an Adam second moment of 1e6 after 400 flipped bytes)."""

import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import flip_inside_largest_item, flip_inside_largest_record

from lightning_p2r.strategy.checkpoint_integrity import check_integrity, integrity_problems


def _single_file(path: Path) -> Path:
    torch.save({"state_dict": {"w": torch.randn(256, 64), "b": torch.randn(64)}, "epoch": 0}, path)
    return path


def _sharded(folder: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's note that it saves without a process group
        dcp.save({"model": {"w": torch.randn(256, 64), "b": torch.randn(64)}, "step": torch.tensor(3)},
                 checkpoint_id=str(folder))
    torch.save({"lightning_p2r_sharded": {"optimizers": 0}}, folder / "meta.pt")
    return folder


def test_an_intact_checkpoint_has_no_problem(tmp_path: Path) -> None:
    assert integrity_problems(_single_file(tmp_path / "one.ckpt")) == []
    assert integrity_problems(_sharded(tmp_path / "sharded")) == []
    check_integrity(tmp_path / "one.ckpt")


def test_flipped_bytes_in_a_single_file_fail_their_record_checksum(tmp_path: Path) -> None:
    path = _single_file(tmp_path / "one.ckpt")
    flip_inside_largest_record(path)
    assert torch.load(path, weights_only=True)["epoch"] == 0  # torch loads it without a word
    (problem,) = integrity_problems(path)
    assert problem.startswith("record one/data/") and "Bad CRC-32" in problem
    with pytest.raises(ValueError, match=r"one.ckpt is damaged: record one/data/\d+ fails its check .*another "
                                         r"checkpoint"):
        check_integrity(path)


def test_a_legacy_file_has_no_checksum_to_read(tmp_path: Path) -> None:
    path = tmp_path / "legacy.ckpt"
    torch.save({"state_dict": {"w": torch.ones(4)}}, path, _use_new_zipfile_serialization=False)
    assert integrity_problems(path) == []


@pytest.mark.parametrize("damage", ["flipped", "truncated", "missing", "meta"])
def test_a_damaged_sharded_checkpoint_is_named(tmp_path: Path, damage: str) -> None:
    folder = _sharded(tmp_path / "sharded")
    shard = next(folder.glob("*.distcp"))
    if damage == "flipped":
        assert flip_inside_largest_item(folder) == shard.name
        expected = rf"{shard.name}, item model\.w: record .* fails its check \(Bad CRC-32"
    elif damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:1000])
        expected = rf"{shard.name} holds 1000 bytes where its items need \d+ \(truncated\)"
    elif damage == "missing":
        shard.unlink()
        expected = rf"{shard.name} is missing"
    else:
        (folder / "meta.pt").write_bytes((folder / "meta.pt").read_bytes()[:50])
        expected = r"meta.pt cannot be read"
    problems = integrity_problems(folder)
    assert problems and re.match(expected, problems[0]), problems
    with pytest.raises(ValueError, match="sharded is damaged"):
        check_integrity(folder)


@pytest.mark.parametrize("parts", [2, 3])
def test_the_reading_split_over_ranks_finds_what_one_reader_finds(tmp_path: Path, parts: int) -> None:
    folder = _sharded(tmp_path / "sharded")
    flip_inside_largest_item(folder)
    single = _single_file(tmp_path / "one.ckpt")
    flip_inside_largest_record(single)
    for path in (folder, single):
        split = [problem for part in range(parts) for problem in integrity_problems(path, part, parts)]
        assert sorted(split) == sorted(integrity_problems(path)) != []


def test_a_damaged_index_is_named_and_a_file_without_checksums_is_not_refused(tmp_path: Path) -> None:
    """Bytes flipped in an archive's index made zipfile raise (and on one rank only, with the reading split); a
    file torch wrote without CRCs (``set_crc32_options(False)``, CRC 0) was reported as failing every one."""
    path = _single_file(tmp_path / "one.ckpt")
    data = bytearray(path.read_bytes())
    index = data.rindex(b"PK\x01\x02")  # the central directory's first entry
    data[index:index + 4] = b"XXXX"
    path.write_bytes(bytes(data))
    (problem,) = integrity_problems(path)
    assert problem.startswith("its archive's index cannot be read")
    assert integrity_problems(path, 1, 2) == []  # said once, by the first part
    torch.serialization.set_crc32_options(False)
    try:
        unchecked = _single_file(tmp_path / "unchecked.ckpt")
    finally:
        torch.serialization.set_crc32_options(True)
    assert integrity_problems(unchecked) == []


def test_a_file_that_is_no_torch_archive_is_named_as_such(tmp_path: Path) -> None:
    """A recipe or cluster YAML given as --ckpt_path got torch's memory-mapped load's hint: save it again "with
    _use_new_zipfile_serialization=True"."""
    from lightning_p2r.strategy.checkpoint import check_checkpoint_path

    (tmp_path / "recipe.yaml").write_text("trainer:\n  max_steps: 5\n")
    torch.save({"state_dict": {}}, tmp_path / "legacy.ckpt", _use_new_zipfile_serialization=False)
    (tmp_path / "cut.ckpt").write_bytes(b"PK\x03\x04" + b"\0" * 60)
    with pytest.raises(ValueError) as error:
        check_checkpoint_path(tmp_path / "recipe.yaml", loads_sharded=True)
    assert str(error.value).endswith("cannot be loaded: it is not a torch checkpoint: torch.save writes a zip "
                                     "archive, and this file starts with b'trainer:'")
    with pytest.raises(ValueError, match=r"legacy.ckpt cannot be loaded: it was saved in torch's legacy format"):
        check_checkpoint_path(tmp_path / "legacy.ckpt", loads_sharded=True)
    with pytest.raises(ValueError, match=r"cut.ckpt cannot be loaded: it is truncated or not a torch checkpoint"):
        check_checkpoint_path(tmp_path / "cut.ckpt", loads_sharded=True)


def test_a_sharded_checkpoint_loads_into_one_process_without_a_process_group_quietly(tmp_path: Path) -> None:
    """Resuming a sharded checkpoint with sharding none on one process (no process group) printed torch's
    "torch.distributed is disabled ... assuming the intent is to load in a single process" warning."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from lightning_p2r.strategy.checkpoint import load_model_into, load_optimizer_into

    torch.manual_seed(0)
    saved = torch.nn.Linear(3, 3)
    optimizer = torch.optim.AdamW(saved.parameters())
    saved(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's own one-process notice on save
        dcp.save({"model": get_model_state_dict(saved), "optimizer0": get_optimizer_state_dict(saved, optimizer)},
                 checkpoint_id=str(tmp_path), no_dist=True)
    loaded = torch.nn.Linear(3, 3)
    loaded_optimizer = torch.optim.AdamW(loaded.parameters())
    loaded(torch.ones(1, 3)).sum().backward()
    loaded_optimizer.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_model_into(loaded, tmp_path)
        load_optimizer_into(loaded, loaded_optimizer, 0, tmp_path)
    assert torch.equal(loaded.weight, saved.weight)
    assert torch.equal(loaded_optimizer.state[loaded.weight]["exp_avg"], optimizer.state[saved.weight]["exp_avg"])
