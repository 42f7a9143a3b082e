"""A Python interpreter that has imported torch, Lightning, transformers and this package once, and forks a copy of
itself for each ``python script.py ...`` or ``python -m module ...`` the suite starts (``client.py`` asks for one).

Why: the suite starts a few hundred processes (workers, Lightning's other ranks, commands), and on a 2-core machine
each spends 5-12 s importing before it does anything. A forked copy starts with those imports done.

What a child gets, so that it behaves as a fresh interpreter would:
- the client's descriptors under their numbers (stdio and any its parent passed on; sent over the socket), working
  directory, environment and arguments; ``sys.path[0]`` as Python sets it (the script's folder, or the working
  directory under ``-m``), the client's ``PYTHONPATH`` entries after it; stdio buffered as ``PYTHONUNBUFFERED`` says;
- the intra-op thread count ``OMP_NUM_THREADS`` asks for (OpenMP read the server's environment when it loaded);
- Python's and NumPy's random generators reseeded from the OS (a fork would copy the server's state); torch's
  generator is the same as a fresh process's, since the server never draws from it;
- Lightning's rank-zero flag read from the child's environment (Lightning reads it when imported);
- its own process group, killed when the client disappears before the child has exited (the client was killed);
- ``sys.executable`` naming the client, so that the processes it starts (Lightning's other ranks) are forked too.

What it cannot get: the server's string-hash seed is shared by all its children, where fresh processes draw one
each. Two servers with different seeds serve alternate ranks (``RANK`` parity), so that two ranks of one job differ
in hash order as real processes do. A request the server cannot reproduce faithfully (interpreter options, ``-c``,
a different ``PYTHON*`` variable or one that a preloaded library reads when imported) is answered "fresh", and the
client runs the real interpreter instead.

Protocol (``SOCK_SEQPACKET``, JSON): the client sends ``{"argv", "cwd", "env", "fds"}`` with those descriptors;
the server answers ``{"pid"}`` or ``{"fresh": reason}``, then ``{"status"}`` (``os.waitstatus_to_exitcode``) when
the child exits.
"""

from __future__ import annotations

import fcntl
import gc
import importlib
import json
import os
import select
import signal
import socket
import sys
import time

IMPORTED_WHEN_LOADED = ("HF_", "TRANSFORMERS_", "TORCH_", "TORCHINDUCTOR_", "TORCHDYNAMO_", "PYTORCH_", "CUDA_",
                        "MKL_", "OPENBLAS_", "KMP_", "GOMP_", "PL_", "LIGHTNING_", "TOKENIZERS_", "HUGGINGFACE_")
"""Prefixes of variables a preloaded library may read when imported: a child whose value differs runs fresh."""

READ_WHEN_USED = ("PYTHONUNBUFFERED", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "OMP_NUM_THREADS", "PL_GLOBAL_SEED",
                  "PL_SEED_WORKERS", "PL_TRAINER_", "LIGHTNING_P2R_")
"""Variables (or prefixes) the child applies itself or that are read only when used: they may differ."""


MAX_FDS = 64
"""Most descriptors a client passes on (stdio and its parent's ``pass_fds``); more, and it runs fresh."""

STARTUP_ENV = dict(os.environ)
"""The server's environment before it imported anything (Lightning sets variables of its own when imported)."""


def differing_startup_variable(env: dict[str, str]) -> str | None:
    """The first variable read at startup or import whose value the child would need but the server lacks (equal
    to the server's value either before or after its imports, a variable is the same)."""
    for key in sorted(set(env) | set(STARTUP_ENV)):
        if key.startswith(READ_WHEN_USED) or not key.startswith(("PYTHON", *IMPORTED_WHEN_LOADED)):
            continue
        if env.get(key) not in (STARTUP_ENV.get(key), os.environ.get(key)):
            return key
    return None


def fresh_reason(request: dict) -> str | None:
    """Why this request must run in the real interpreter, or None when a fork reproduces it."""
    argv = request["argv"]
    if not argv or (argv[0].startswith("-") and argv[0] != "-m") or (argv[0] == "-m" and len(argv) < 2):
        return f"interpreter options {argv[:1]}"
    if argv[0] != "-m" and not os.path.isfile(os.path.join(request["cwd"], argv[0])):
        return f"no script {argv[0]}"  # the real interpreter says so in its own words
    variable = differing_startup_variable(request["env"])
    return f"{variable} differs" if variable else None


class Child:
    """What a forked child runs: set up as a fresh interpreter, then the script or module as ``__main__``."""

    def __init__(self, request: dict, fds: list[int], client: str) -> None:
        self.argv, self.cwd, self.env, self.numbers = request["argv"], request["cwd"], request["env"], request["fds"]
        self.fds, self.client = fds, client
        self.server_stdio = (sys.stdin, sys.stdout, sys.stderr)  # kept: freeing them would close descriptors 0-2

    def run(self) -> None:
        """Runs in the child; an exception or ``SystemExit`` ends the process as it would end a fresh one."""
        self._become_fresh()
        import runpy

        if self.argv[0] == "-m":
            sys.argv = [self.argv[1], *self.argv[2:]]
            runpy.run_module(self.argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(self.argv)
            runpy.run_path(self.argv[0], run_name="__main__")

    def _become_fresh(self) -> None:
        # Each received descriptor goes to the number it had in the client: first all out of the way (a received
        # one may sit on another's number), then into place.
        parked = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1024) for fd in self.fds]
        for fd in self.fds:
            os.close(fd)
        for number, fd in zip(self.numbers, parked):
            os.dup2(fd, number)
            os.close(fd)
        os.setpgid(0, 0)
        os.chdir(self.cwd)
        old_path = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
        os.environ.clear()
        os.environ.update(self.env)
        # The temporary directory is read from TMPDIR once per process and kept: read again, from the child's.
        if "tempfile" in sys.modules:
            sys.modules["tempfile"].tempdir = None
        self._set_path(old_path)
        self._set_stdio()
        self._reseed()
        if "OMP_NUM_THREADS" in self.env and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(max(1, int(self.env["OMP_NUM_THREADS"])))
        lightning_ranks = sys.modules.get("lightning.fabric.utilities.rank_zero")
        if lightning_ranks is not None:  # Lightning's rank-zero flag, read from the environment when imported
            lightning_ranks.rank_zero_only.rank = lightning_ranks._get_rank() or 0
        sys.executable = self.client
        sys.dont_write_bytecode = bool(self.env.get("PYTHONDONTWRITEBYTECODE"))

    def _set_path(self, old_pythonpath: list[str]) -> None:
        first = os.getcwd() if self.argv[0] == "-m" else os.path.dirname(os.path.realpath(self.argv[0]))
        new_pythonpath = [os.path.abspath(entry) for entry in self.env.get("PYTHONPATH", "").split(os.pathsep)
                          if entry]
        rest = [entry for entry in sys.path[1:] if entry not in {os.path.abspath(p) for p in old_pythonpath}]
        sys.path[:] = [first, *new_pythonpath, *rest]
        importlib.invalidate_caches()

    def _set_stdio(self) -> None:
        import io

        unbuffered = bool(self.env.get("PYTHONUNBUFFERED"))

        def text(fd: int, mode: str, errors: str) -> io.TextIOWrapper:
            raw = io.FileIO(fd, mode, closefd=False)
            if "r" in mode:
                return io.TextIOWrapper(io.BufferedReader(raw), encoding="utf-8", errors=errors)
            return io.TextIOWrapper(io.BufferedWriter(raw), encoding="utf-8", errors=errors,
                                    line_buffering=raw.isatty(), write_through=unbuffered or fd == 2)

        sys.stdin = sys.__stdin__ = text(0, "r", "strict")
        sys.stdout = sys.__stdout__ = text(1, "w", "strict")
        sys.stderr = sys.__stderr__ = text(2, "w", "backslashreplace")

    @staticmethod
    def _reseed() -> None:
        import random

        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()


class Server:
    """Accepts requests on its socket, forks one child per request, reports each child's exit to its client."""

    def __init__(self, path: str, client: str) -> None:
        self.client = client
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(path)
        self.listener.listen(64)
        self.children: dict[int, socket.socket | None] = {}  # pid -> its client's connection (None: client gone)

    def serve(self) -> Child:
        """Serve until stdin closes (the suite ended); returns only in a forked child, with what it must run."""
        while True:
            watched = [self.listener, sys.stdin, *(c for c in self.children.values() if c is not None)]
            ready, _, _ = select.select(watched, [], [], 0.05)
            if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
                self._stop_all()
                sys.exit(0)
            self._reap()
            for connection in [c for c in ready if c not in (self.listener, sys.stdin)]:
                self._client_gone(connection)
            if self.listener in ready:
                child = self._accept()
                if child is not None:
                    return child

    def _accept(self) -> Child | None:
        connection, _ = self.listener.accept()
        try:
            message, fds, _, _ = socket.recv_fds(connection, 1 << 20, MAX_FDS)
            request = json.loads(message)
        except (OSError, ValueError):
            connection.close()
            return None
        reason = fresh_reason(request)
        if reason is None and (len(fds) != len(request["fds"]) or not {0, 1, 2} <= set(request["fds"])):
            reason = f"descriptors {request['fds']} not all received or no stdio"
        print(f"{time.strftime('%H:%M:%S')} {' '.join(request['argv'])[:160]} -> {reason or 'forked'}", flush=True)
        if reason is not None:
            connection.send(json.dumps({"fresh": reason}).encode())
            connection.close()
            for fd in fds:
                os.close(fd)
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self.listener.close()
            for other in [connection, *self.children.values()]:
                if other is not None:
                    other.close()
            for number in (signal.SIGCHLD, signal.SIGTERM):
                signal.signal(number, signal.SIG_DFL)
            return Child(request, fds, self.client)
        for fd in fds:
            os.close(fd)
        self.children[pid] = connection
        connection.send(json.dumps({"pid": pid}).encode())
        return None

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            connection = self.children.pop(pid, None)
            if connection is not None:
                try:
                    connection.send(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:
                    pass
                connection.close()

    def _client_gone(self, connection: socket.socket) -> None:
        """A client's connection became readable: it closed (the client was killed), so its child goes too."""
        try:
            if connection.recv(16):
                return
        except OSError:
            pass
        pid = next(p for p, c in self.children.items() if c is connection)
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        connection.close()
        self.children[pid] = None

    def _stop_all(self) -> None:
        for pid in self.children:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def preload(modules: list[str]) -> None:
    """Import what every child would import, then freeze the heap so that children do not copy it back on GC."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as error:  # not installed here: the children import what they need themselves
            print(f"not preloaded: {name} ({error})", file=sys.stderr, flush=True)
    gc.collect()
    gc.freeze()


def main() -> Child:
    """Listen first, so that a client arriving during the imports waits in the queue instead of starting fresh."""
    path, client, modules = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    started = time.perf_counter()
    server = Server(path, client)
    preload(modules)
    print(f"ready after {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    return server.serve()


if __name__ == "__main__":
    main().run()
