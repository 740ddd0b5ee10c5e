"""The dashboard as a process of its own: what the aggregator starts for ``--ui-port``.

Served from the aggregator's process, an open page cost ingestion about a quarter of its rate at
14k steps/s (bench/README.md): building a running run's page data held the aggregator's GIL and
filled its heap for the cyclic GC. Here the dashboard (``web.app.Dashboard``, the same app as
``stepwatch ui``) runs in a child the aggregator starts (``server/dashboard.py``), reading the
history store read-only (SQLite in WAL mode: a reader never blocks the writer), at a lower
scheduling priority, so a slow browser can cost the aggregator nothing but a share of a core
it would not get anyway.

The parent binds the listening socket itself and hands it over (``--fd``): the URL is known
and a port in use is the parent's error before anything starts, and a browser that connects
while this process is still importing waits in the socket's backlog instead of being refused.

It dies with the aggregator: its stdin is a pipe only the aggregator holds, and end of file on
it (the aggregator stopped it, exited or was killed, even with SIGKILL) stops it; the kernel's
parent-death signal (Linux) says the same. SIGINT is ignored (a Ctrl-C in the terminal reaches
the whole process group; the aggregator drains first and then stops its dashboard, so a page
open on the run still sees its end); SIGTERM stops it.

Usage (by ``server/dashboard.py``, not by hand)::

    python -m stepwatch.web.process --path RUN_OR_OUT_DIR --fd 3 [--fd 4] [--nice 10]

The token, if any, comes in the environment variable ``STEPWATCH_UI_TOKEN`` (never on a command
line, where ``ps`` shows it) and is removed from the environment once read.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

__all__ = ["TOKEN_ENV", "main"]

TOKEN_ENV = "STEPWATCH_UI_TOKEN"
STORE_ENV = "STEPWATCH_UI_STORE"  # a store URL to serve instead of --path (its password stays out of `ps`)
SHUTDOWN_S = 1.0  # how long a stopping dashboard lets a request in flight finish


async def _serve(path: Path | str, fds: list[int], token: str | None) -> None:
    from aiohttp import web

    from ..views.sources import Catalog
    from .app import Dashboard

    sockets = [socket.socket(fileno=fd) for fd in fds]
    catalog = Catalog(path)
    runner = web.AppRunner(Dashboard(catalog, token=token).build(), access_log=None, shutdown_timeout=SHUTDOWN_S)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    def parent_pipe() -> None:
        try:
            data = os.read(0, 4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the aggregator closed it, exited or was killed
            loop.remove_reader(0)
            stop.set()

    try:
        os.set_blocking(0, False)
        loop.add_reader(0, parent_pipe)
    except (OSError, ValueError):  # no stdin to watch (started by hand): SIGTERM and the parent-death signal
        pass
    try:
        await runner.setup()
        for sock in sockets:
            await web.SockSite(runner, sock).start()
        await stop.wait()
    finally:
        await runner.cleanup()
        catalog.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stepwatch.web.process")
    parser.add_argument("--path", type=Path, help="what the dashboard serves (as `stepwatch ui PATH`); "
                        f"without it, the store URL in ${STORE_ENV}")
    parser.add_argument("--fd", type=int, action="append", required=True,
                        help="a listening socket inherited from the parent (one per address)")
    parser.add_argument("--nice", type=int, default=10, help="added to this process's niceness (0: none)")
    args = parser.parse_args(argv)
    token = os.environ.pop(TOKEN_ENV, None) or None
    source: Path | str | None = args.path or os.environ.pop(STORE_ENV, None)
    if source is None:
        parser.error(f"--path or ${STORE_ENV} names what to serve")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if args.nice:
        try:
            os.nice(args.nice)
        except OSError:  # not allowed here: the same priority as the aggregator
            pass
    try:
        asyncio.run(_serve(source, args.fd, token))
    except Exception as exc:  # noqa: BLE001 - one line on stderr, never a traceback over the job's output
        print(f"[stepwatch] the dashboard stopped: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        os._exit(1)
    sys.stderr.flush()
    # not the interpreter's exit: it would join the app's reader threads, one of which may be
    # building a page for seconds; this process writes nothing, so there is nothing to lose
    os._exit(0)


if __name__ == "__main__":
    main()
