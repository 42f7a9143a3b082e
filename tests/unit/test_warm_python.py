"""The suite's warm interpreters (tests/warm_python/): a process forked from a server behaves as the fresh
interpreter it replaces, in what it runs, sees and reports, and in how it ends."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from warm_python import WarmPython

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the warm servers pass descriptors over Linux sockets; elsewhere unused")

MARKER = "colorsys"  # preloaded by the test's servers, imported by no fresh interpreter at startup


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory):
    servers = WarmPython(tmp_path_factory.mktemp("warm"), preloaded=(MARKER,))
    servers.wait_listening()
    yield servers
    servers.stop()


def _script(folder: Path, text: str) -> Path:
    path = folder / "script.py"
    path.write_text(text, encoding="utf-8")
    return path


def _run(warm: WarmPython, *argv: str, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(warm.executable), *argv], capture_output=True, text=True, timeout=60, **kwargs)


def test_a_script_runs_forked_with_its_arguments_folder_environment_and_stdin(warm, tmp_path: Path) -> None:
    script = _script(tmp_path, "import os, sys\n"
                               f"print('{MARKER}' in sys.modules, sys.argv[1:], sys.path[0], os.getcwd(),"
                               " os.environ['CHOSEN'], sys.stdin.read(), sys.executable)\n")
    work = tmp_path / "work"
    work.mkdir()
    result = _run(warm, str(script), "a", "b c", cwd=work, env=os.environ | {"CHOSEN": "yes"}, input="piped")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "['a',", "'b", "c']", str(tmp_path), str(work), "yes", "piped",
                                     str(warm.executable)]
    # A path relative to the caller's folder, not the server's:
    relative = _run(warm, "script.py", cwd=tmp_path, env=os.environ | {"CHOSEN": "yes"})
    assert relative.returncode == 0 and relative.stdout.startswith("True"), relative.stderr


def test_descriptors_passed_on_keep_their_numbers(warm, tmp_path: Path) -> None:
    # torch's compile workers are started this way: two pipes passed by number.
    read, write = os.pipe()
    script = _script(tmp_path, "import os, sys\nos.write(int(sys.argv[1]), b'through the pipe')\n")
    result = subprocess.run([str(warm.executable), str(script), str(write)], pass_fds=(write,), timeout=60)
    os.close(write)
    assert result.returncode == 0
    assert os.read(read, 100) == b"through the pipe"
    os.close(read)


def test_a_module_runs_with_the_working_folder_first_on_its_path(warm, tmp_path: Path) -> None:
    (tmp_path / "chosen_module.py").write_text("import sys\nprint(__name__, sys.path[0], sys.argv[1:])\n")
    result = _run(warm, "-m", "chosen_module", "x", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["__main__", str(tmp_path), "['x']"]


def test_exit_status_exception_and_signal_are_the_childs(warm, tmp_path: Path) -> None:
    assert _run(warm, str(_script(tmp_path, "import sys\nsys.exit(3)\n"))).returncode == 3
    failed = _run(warm, str(_script(tmp_path, "raise ValueError('named problem')\n")))
    assert failed.returncode == 1 and "ValueError: named problem" in failed.stderr
    for number in (signal.SIGTERM, signal.SIGKILL):
        killed = _run(warm, str(_script(tmp_path, f"import os\nos.kill(os.getpid(), {int(number)})\n")))
        assert killed.returncode == -number, killed.stderr


def test_what_a_fork_cannot_reproduce_runs_the_real_interpreter(warm, tmp_path: Path) -> None:
    code = f"import sys; print('{MARKER}' in sys.modules)"
    assert _run(warm, "-c", code).stdout.strip() == "False"
    script = _script(tmp_path, code + "\n")
    assert _run(warm, str(script)).stdout.strip() == "True"
    assert _run(warm, str(script), env=os.environ | {"PYTHONWARNINGS": "error"}).stdout.strip() == "False"
    assert _run(warm, str(script), env=os.environ | {"P2R_FRESH_PROCESSES": "1"}).stdout.strip() == "False"


def test_alternate_ranks_get_different_string_hashes_and_fresh_random_state(warm, tmp_path: Path) -> None:
    script = _script(tmp_path, "import random\nprint(hash('rank-dependent order'), random.random())\n")
    outputs = [_run(warm, str(script), env=os.environ | {"RANK": str(rank)}).stdout.split() for rank in (0, 1, 0)]
    assert outputs[0][0] != outputs[1][0]  # two ranks of a job: different hash seeds, as fresh processes have
    assert outputs[0][0] == outputs[2][0]  # one server: one seed
    assert outputs[0][1] != outputs[2][1]  # Python's generator reseeded in each child


def test_stopping_the_client_stops_the_child(warm, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    script = _script(tmp_path, f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                               "print('started', flush=True)\ntime.sleep(60)\n")
    for stop, status in (("terminate", -signal.SIGTERM), ("kill", -signal.SIGKILL)):
        client = subprocess.Popen([str(warm.executable), str(script)], stdout=subprocess.PIPE, text=True)
        assert client.stdout.readline().strip() == "started"
        child = int(pid_file.read_text())
        assert child != client.pid
        getattr(client, stop)()
        assert client.wait(timeout=10) == status
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), f"the child outlived its client's {stop}"
        client.stdout.close()


def _alive(pid: int) -> bool:
    # The process may exit between any two of these looks; each one that finds it gone means it is not alive.
    try:
        os.kill(pid, 0)
        status = Path(f"/proc/{pid}/status").read_text()
    except (ProcessLookupError, FileNotFoundError):
        return False
    return "zombie" not in status


def test_the_stand_in_names_the_real_interpreter(warm) -> None:
    # This process's binary, not sys.executable: in a run that holds slow tests too, sys.executable is already the
    # session's own stand-in (tests/conftest.py).
    assert os.path.samefile(warm.real_python, "/proc/self/exe")
    assert warm.executable.read_text().startswith(f"#!{warm.real_python} -IS")
