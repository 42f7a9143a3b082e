"""``calibrate`` says when other work shared the machine while it measured (issue 41 item 1: a two-process
calibration taken while unit tests ran priced a held-out draw at 28% median error, a clean one at 21.5%): the share
of their cores the measuring processes got while timing it, named in a warning and in the file."""

import time
import warnings

import pytest

from lightning_p2r.measure import calibrate as calibrate_module
from lightning_p2r.measure.calibrate import BUSY_SHARE, BusyMachineWarning, busy_warnings
from lightning_p2r.measure.run import core_share
from lightning_p2r.planning.cluster import Cluster, load_cluster


def test_a_process_that_waits_gets_little_of_its_core() -> None:
    result, share = core_share(lambda: time.sleep(0.2) or "done", threads=1)
    assert result == "done"
    assert share < 0.5  # sleeping takes no CPU time
    _, shared = core_share(lambda: time.sleep(0.2), threads=2)
    assert shared <= share + 0.05  # two threads' worth of cores, idle


def test_a_quiet_machine_gives_no_warning_and_a_busy_one_names_the_share() -> None:
    assert busy_warnings(0.98) == []
    assert busy_warnings(BUSY_SHARE) == []
    low = busy_warnings(0.6)
    assert len(low) == 1 and "60%" in low[0] and "calibrate again" in low[0]


def test_the_command_prints_the_warning_and_writes_it_into_the_file(tmp_path, monkeypatch, capsys) -> None:
    def busy_calibrate(**kwargs) -> Cluster:
        warnings.warn("the measuring processes got 55% of their cores", BusyMachineWarning, stacklevel=2)
        warnings.warn("an unrelated warning", UserWarning, stacklevel=2)
        return Cluster(accelerator="cpu", devices=1, devices_per_node=1)

    monkeypatch.setattr(calibrate_module, "calibrate", busy_calibrate)
    out = tmp_path / "cluster.yaml"
    with pytest.warns(UserWarning, match="unrelated"):  # other warnings still reach the user as warnings
        calibrate_module.main(["--out", str(out), "--processes", "1", "--no-fit"])
    assert "warning: the measuring processes got 55% of their cores" in capsys.readouterr().err
    assert "# Warning: the measuring processes got 55% of their cores." in out.read_text()
    assert load_cluster(out).devices == 1
