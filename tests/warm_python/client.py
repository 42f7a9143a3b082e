"""The stand-in for ``sys.executable`` while the suite runs: it asks a warm server (``server.py``) to fork a copy of
itself that runs this command, passes on its stdio, forwards the signals it receives, and exits as the copy did.
Anything the server declines (``-c``, interpreter options, a startup variable it cannot reproduce) or any failure
to reach it runs the real interpreter instead, with the same arguments. Standard library only: it starts under
``python -I -S`` in about 20 ms.
"""

import json
import os
import signal
import socket
import sys
import time

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def run_fresh(real_python: str, argv: list[str]) -> None:
    os.execv(real_python, [real_python, *argv])


def inherited_fds() -> list[int]:
    """The descriptors this process inherited: stdio and any its parent passed on (``pass_fds``: torch's compile
    workers talk over two such pipes)."""
    return sorted(int(name) for name in os.listdir("/proc/self/fd") if _is_open(int(name)))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:  # the listing's own descriptor, closed by now
        return False
    return True


def ask(path: str, argv: list[str]) -> tuple[socket.socket, dict]:
    fds = inherited_fds()
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    connection.connect(path)
    request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "fds": fds}
    socket.send_fds(connection, [json.dumps(request).encode()], fds)
    return connection, json.loads(connection.recv(1 << 16))


def exit_as(status: int) -> None:
    """End this process as the child ended: with its code, or killed by the same signal."""
    if status < 0:
        if -status not in (signal.SIGKILL, signal.SIGSTOP):  # neither can have a handler
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        time.sleep(5)
        status = 128 - status
    os._exit(status)


def main(real_python: str, sockets: list[str]) -> None:
    argv = sys.argv[1:]
    if os.environ.get("P2R_FRESH_PROCESSES") == "1":
        run_fresh(real_python, argv)
    rank = int(os.environ.get("RANK") or os.environ.get("LOCAL_RANK") or 0)
    try:
        connection, reply = ask(sockets[rank % len(sockets)], argv)
    except (OSError, ValueError):
        run_fresh(real_python, argv)
    if "pid" not in reply:
        connection.close()
        run_fresh(real_python, argv)
    child = reply["pid"]

    def forward(number: int, frame: object) -> None:
        try:
            os.kill(child, number)
        except ProcessLookupError:
            pass

    for number in FORWARDED:
        signal.signal(number, forward)
    message = connection.recv(1 << 16)
    exit_as(json.loads(message)["status"] if message else 1)
