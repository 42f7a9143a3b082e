"""``lightning-p2r prepare-data`` killed mid-way (SIGKILL, so no cleanup runs): nothing that looks complete is left,
an earlier complete directory survives a killed --overwrite, training from what is left is refused in one line, and
a re-run completes over the stale .partial copy."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import lightning_p2r
from lightning_p2r import TextDataModule
from lightning_p2r.data.prepared import PreparedDataError, prepare_data, read_manifest

pytestmark = pytest.mark.slow  # kills and reruns a prepare-data process (the README tier skips it)

pytest.importorskip("litdata", reason="litdata is installed by the README's second pip step (--no-deps)")

QUIET = {"log": lambda line: None}
REPO = Path(lightning_p2r.__file__).resolve().parents[1]


def _corpus(path: Path, lines: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"Line {i}: the word was tested, and the test was {'good' * (i % 5)}.\n"
                            for i in range(lines)), encoding="utf-8")
    return path


def _launch(source: Path, out: Path, *options: str) -> subprocess.Popen:
    """prepare-data in a session of its own, so that killing its group also kills litdata's encoding workers."""
    # Its own temporary directory: a killed run cannot remove its litdata working folders (prepared.py).
    temporary = out.parent / "tmp"
    temporary.mkdir(exist_ok=True)
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                        "TMPDIR": str(temporary)}
    return subprocess.Popen([sys.executable, "-m", "lightning_p2r.cli", "prepare-data", "--source", str(source),
                             "--out", str(out), "--tokenizer", "bytes", *options], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _kill_once_partial(runs: dict[Path, subprocess.Popen], timeout: float = 90.0) -> None:
    """Watch every run at once, and kill each (SIGKILL, its whole group) as soon as its ``OUT.partial`` appears."""
    deadline = time.monotonic() + timeout
    while runs:
        for out, process in list(runs.items()):
            partial = out.with_name(out.name + ".partial")
            if partial.exists():
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                process.stderr.close()
                assert process.returncode == -signal.SIGKILL and partial.exists()
                del runs[out]
            elif process.poll() is not None:
                pytest.fail(f"prepare-data ended (status {process.returncode}) before writing {partial}: "
                            f"{process.stderr.read().decode()[-2000:]}")
        assert time.monotonic() < deadline, f"prepare-data wrote no .partial copy in {timeout} s"
        time.sleep(0.002)


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_killed_prepare_leaves_nothing_complete_and_a_rerun_completes(tmp_path: Path) -> None:
    big = _corpus(tmp_path / "big.txt", 100_000)  # ~6 MB: encoding takes about a second after .partial appears
    fresh, kept = tmp_path / "fresh", tmp_path / "kept"
    prepare_data(str(_corpus(tmp_path / "small.txt", 400)), kept, tokenizer="bytes", **QUIET)
    before = _files(kept)
    # Both killed runs at once: each pays Python's and Lightning's start-up, the longest part of the test.
    _kill_once_partial({fresh: _launch(big, fresh), kept: _launch(big, kept, "--overwrite")})

    # A first prepare killed mid-way: no OUT, and training from it is refused in one line naming the fix.
    assert not fresh.exists()
    with pytest.raises(PreparedDataError, match="does not exist .*half-written .partial copy.*prepare-data") as error:
        TextDataModule(prepared=str(fresh))
    assert "\n" not in str(error.value)
    # A killed --overwrite: the earlier complete directory is untouched and still trains.
    assert _files(kept) == before
    data = TextDataModule(prepared=str(kept), seq_len=16, batch_size=4)
    assert data.manifest.source.endswith("small.txt") and data.vocab_size == 256
    data.setup("fit")
    assert next(iter(data.train_dataloader())).shape == (4, 17)

    # Re-runs complete over the stale .partial copies.
    for out, options in ((fresh, {}), (kept, {"overwrite": True})):
        manifest = prepare_data(str(big), out, tokenizer="bytes", **options, **QUIET)
        assert sum(split["bytes"] for split in manifest.splits.values()) == big.stat().st_size
        assert read_manifest(out) == manifest
        assert not out.with_name(out.name + ".partial").exists()
        assert not out.with_name(out.name + ".previous").exists()


def test_a_prepare_stopped_between_its_two_renames_gets_the_old_copy_back(tmp_path: Path) -> None:
    source, out = _corpus(tmp_path / "small.txt", 400), tmp_path / "out"
    previous = tmp_path / "out.previous"
    prepare_data(str(source), out, tokenizer="bytes", **QUIET)
    before = _files(out)
    out.rename(previous)  # --overwrite moved the old copy aside, and stopped before renaming the new one in
    with pytest.raises(PreparedDataError, match="stopped while replacing it; its old copy is in out.previous"):
        TextDataModule(prepared=str(out))
    lines: list[str] = []
    prepare_data(str(source), out, tokenizer="bytes", log=lines.append)  # the old copy is back, and it is current
    assert "nothing to do" in lines[0] and _files(out) == before and not previous.exists()
    previous.mkdir()  # stopped while deleting the old copy, after the new one was in place (its manifest goes last)
    (previous / "chunk-0-0.bin").write_bytes(b"stale")
    (previous / "manifest.json").write_bytes((out / "manifest.json").read_bytes())
    prepare_data(str(source), out, tokenizer="bytes", **QUIET)
    assert not previous.exists() and _files(out) == before
