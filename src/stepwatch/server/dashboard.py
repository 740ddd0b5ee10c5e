"""The aggregator's dashboard (``--ui-port``) as a child process (``web/process.py``).

The aggregator binds the dashboard's socket (so its ready line holds the URL at once, and a port
in use is its own ``ListenError``), starts ``python -m stepwatch.web.process`` with that socket,
and closes its own copy: every connection is accepted, and every page built, in the child. The
aggregator stays the one writer of the store; the child only reads it.

The child never outlives the aggregator: its stdin is a pipe whose only writer is here (end of
file there stops it, however this process ends, SIGKILL included), it gets the kernel's
parent-death signal on Linux, and ``stop`` (each of the aggregator's shutdown paths) ends it,
SIGKILL after a grace period. A child that dies while the aggregator runs is said once on
stderr; ingestion goes on without it.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from ..lifetime import preexec_die_with_parent
from ..log import logger
from ..web.process import STORE_ENV, TOKEN_ENV

__all__ = ["DashboardProcess"]

STOP_GRACE_S = 5.0  # how long a stopped dashboard may take before it is killed


class DashboardProcess:
    """Example::

        dashboard = DashboardProcess(run_dir, "127.0.0.1", 0, token=None)
        url = dashboard.start()      # OSError when it cannot listen
        ...
        dashboard.stop()
    """

    def __init__(self, path: Path | str, host: str, port: int, token: str | None) -> None:
        # a store URL goes to the child in its environment: its password stays out of `ps`
        self.path: Path | str = path if isinstance(path, str) else Path(path).resolve()
        self.host = host
        self.port = port
        self.token = token
        self.process: subprocess.Popen[bytes] | None = None
        self.bound: int | None = None
        self._stopping = False

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def url(self) -> str:
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{shown}:{self.bound}/"

    def start(self) -> str:
        """Binds the socket, starts the child with it; the URL. OSError when it cannot listen or
        start (nothing is left running then). Call it from the thread that will live as long as
        the child should (the parent-death signal follows the thread that started it)."""
        sockets = _listen(self.host, self.port)
        try:
            self.bound = int(sockets[0].getsockname()[1])
            env = dict(os.environ)
            env.pop(TOKEN_ENV, None)
            env.pop(STORE_ENV, None)
            if self.token is not None:
                env[TOKEN_ENV] = self.token
            source = ["--path", str(self.path)]
            if isinstance(self.path, str):
                env[STORE_ENV], source = self.path, []
            fds = [str(sock.fileno()) for sock in sockets]
            # preexec_fn only calls prctl (libc loaded before the fork): nothing a thread could hold a lock for
            self.process = subprocess.Popen(
                [sys.executable, "-m", "stepwatch.web.process", *source,
                 *(arg for fd in fds for arg in ("--fd", fd))],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, pass_fds=[sock.fileno() for sock in sockets],
                env=env, preexec_fn=preexec_die_with_parent())
        finally:
            for sock in sockets:  # the child's now: a dead child refuses connections instead of queueing them
                sock.close()
        threading.Thread(target=self._watch, name="stepwatch-dashboard-watch", daemon=True).start()
        return self.url

    def _watch(self) -> None:
        """Says once on stderr if the child dies while the aggregator still runs."""
        process = self.process
        assert process is not None
        code = process.wait()
        if not self._stopping:
            logger.warning("the dashboard (pid %d) exited with code %s; ingestion goes on without it",
                           process.pid, code)

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """Ends the child (end of file on its pipe, SIGTERM, SIGKILL after ``grace_s``); its exit
        code, None when it was never started. Blocks up to ``grace_s``: call it off the loop."""
        process = self.process
        if process is None:
            return None
        self._stopping = True
        if process.poll() is None:
            try:
                assert process.stdin is not None
                process.stdin.close()
                process.send_signal(signal.SIGTERM)
            except OSError:  # gone meanwhile
                pass
            try:
                process.wait(grace_s)
            except subprocess.TimeoutExpired:
                process.kill()
        elif process.stdin is not None:
            process.stdin.close()
        return process.wait()


def _listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address ``host`` names (``localhost``: 127.0.0.1 and ::1, as
    aiohttp binds them), all on one port: the first one's when ``port`` is 0. OSError (and none
    left open) when one cannot be bound."""
    seen: list[tuple[int, tuple[str, int]]] = []
    for family, _, _, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE):
        if (family, address[:2]) not in seen:
            seen.append((family, address[:2]))
    sockets: list[socket.socket] = []
    unavailable: OSError | None = None
    try:
        for family, (addr, _) in seen:
            bound = sockets[0].getsockname()[1] if sockets else port
            try:
                sockets.append(socket.create_server((addr, bound), family=family, backlog=128))
            except OSError as exc:
                if exc.errno != errno.EADDRNOTAVAIL:
                    raise
                unavailable = exc  # a family this machine has not enabled (as asyncio skips it)
        if not sockets:
            raise unavailable or OSError(errno.EADDRNOTAVAIL, f"no address for {host}")
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets
