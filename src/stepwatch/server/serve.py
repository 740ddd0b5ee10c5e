"""Runs the aggregator: TCP frames and HTTP ingestion into ``<run>/history.sqlite``.

Prints one JSON line ``{"event": "ready", "tcp": "H:P", "http": "H:Q", ...}`` on stdout once
it listens, so a launcher can read the ports; SIGTERM/SIGINT drain and stop it. A port it cannot
listen on (in use, not allowed) is one ``error:`` line on stderr and exit code 2, no traceback.

Its own session (for legacy frames that name none) is ``--session-id``, else the one in the run
directory's ``run.json`` (``stepwatch run`` writes it before starting the aggregator).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import signal
import sqlite3
import sys
import threading
from pathlib import Path
from typing import Any

from ..errors import StepwatchError
from ..log import log_to_stderr
from .settings import RETENTION_ENV, parse_duration, positive_from_env

__all__ = ["ListenError", "serve"]

# how long the dashboard (--ui-port) outlives the last flush: two of an open page's polls (one a
# second), so a page open on the run takes its end instead of finding the server gone
UI_LAST_POLL_S = 2.0


class ListenError(StepwatchError):
    """The aggregator cannot listen on its address (port in use, not allowed)."""


async def _serve(run_dir: Path, host: str, port: int, http_port: int | None, token: str | None,
                 max_frame: int, ready: Any, session_id: str | None, retention_ns: int | None,
                 say_losses: bool = True, watch: dict[str, Any] | None = None,
                 ui_port: int | None = None, feeds: dict[str, Any] | None = None,
                 children: list[Any] | None = None, store_url: str | None = None,
                 ui_host: str | None = None) -> dict[str, Any]:
    from ..artifacts.run_manifest import run_session_id
    from ..store import open_store
    from .aggregator import WORLD_WAIT_ENV, WORLD_WAIT_S, Aggregator

    # the history: run_dir's history.sqlite, or the store a URL names (docs/clickhouse.md)
    feed = None
    if store_url is None:
        store = open_store(run_dir / "history.sqlite")
    else:  # a remote store: written off the ticks, spilled to run_dir while it is down or slow
        from ..store.spill import SPILL_FILE
        from .store_feed import (
            StoreFeed,
            backoff_from_env,
            open_remote_store,
            slow_s_from_env,
            spill_max_bytes_from_env,
        )

        store = open_remote_store(store_url)  # a server that does not answer yet: opened later
        try:
            feed = StoreFeed(store, run_dir / SPILL_FILE, slow_s=slow_s_from_env(), backoff_s=backoff_from_env(),
                             spill_max_bytes=spill_max_bytes_from_env())
        except BaseException:
            store.close()
            raise
    aggregator = Aggregator(store, max_frame=max_frame, session_id=session_id or run_session_id(run_dir),
                            retention_ns=retention_ns, emit=ready.write, watchdog=_watchdog(run_dir, watch),
                            feed=feed, world_wait_s=positive_from_env(WORLD_WAIT_ENV, WORLD_WAIT_S))
    tcp = runner = dashboard = fed = None
    http_bound = ui_url = None
    try:
        try:
            tcp = await asyncio.start_server(aggregator.handle_connection, host, port)
        except OSError as exc:
            raise ListenError(f"cannot listen for frames on {host}:{port}: {exc.strerror or exc}") from None
        tcp_port = tcp.sockets[0].getsockname()[1]
        if http_port is not None:
            from aiohttp import web

            from .http_ingest import IngestApp

            runner = web.AppRunner(IngestApp(aggregator, run_dir=run_dir, token=token).build(), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, host, http_port)
            try:
                await site.start()
            except OSError as exc:
                raise ListenError(f"cannot listen for HTTP on {host}:{http_port}: {exc.strerror or exc}") from None
            http_bound = runner.addresses[0][1] if runner.addresses else http_port
        if ui_port is not None:
            dashboard, ui_url = _start_dashboard(store_url or run_dir, host, ui_port, token, ui_host)
            if children is not None:  # serve() stops it whatever ends this coroutine
                children.append(dashboard)
        fed = _start_feeds(feeds, run_dir, aggregator, host, token)
    except BaseException:
        if fed is not None:
            fed.close()
        if dashboard is not None:
            dashboard.stop()
        if runner is not None:
            await runner.cleanup()
        if tcp is not None:
            tcp.close()
            await tcp.wait_closed()
        if aggregator.close_feed():
            store.close()
        raise
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, aggregator.stop)
    writer = asyncio.create_task(aggregator.write_loop())
    watcher = asyncio.create_task(aggregator.watch_loop())
    world = asyncio.create_task(aggregator.world_loop())
    live = _start_live_verdicts(aggregator, run_dir, loop, store_url)
    ready.write({"event": "ready", "tcp": f"{host}:{tcp_port}", "http": f"{host}:{http_bound}" if http_bound else None,
                 "ui": ui_url, "ui_pid": dashboard.pid if dashboard is not None else None,
                 "store": str(getattr(store, "path", run_dir / "history.sqlite")), "pid": os.getpid(),
                 **({"metrics": fed.metrics_url} if fed is not None and fed.metrics_url else {})})
    await aggregator._stopping.wait()  # noqa: SLF001 - the one stop signal
    assert tcp is not None
    tcp.close()
    aggregator.close_connections()
    await tcp.wait_closed()
    if live is not None:  # after the ranks' connections are closed: they never wait on its last round
        await asyncio.to_thread(live.stop)
    if runner is not None:
        await runner.cleanup()
    await writer
    await watcher
    await world  # sessions still waiting for other nodes' ranks: closed with what is known
    await aggregator.check_alerts(final=True)  # a rank gone without a stop record, values that came last
    await aggregator.flush()  # rows accepted while the listeners were closing, and the last alerts
    # a remote store: what waits is written now if the server takes it (for up to 30 s), else it
    # stays in the spill file for the next aggregator on this directory
    store_done = await asyncio.to_thread(aggregator.close_feed)
    aggregator.store_events()
    if fed is not None:  # the last alerts posted, the last spans and metrics exported (each bounded in time)
        await asyncio.to_thread(fed.close)
    if dashboard is not None:  # last: an open page's next poll takes the run's end, then the page stops
        await asyncio.sleep(UI_LAST_POLL_S)
        await asyncio.to_thread(dashboard.stop)
    if say_losses:
        aggregator.report_losses()
    stats = aggregator.stats()
    if live is not None:
        stats["live_verdicts"] = live.stats()
    if fed is not None:
        stats["feeds"] = fed.stats()
    try:
        if store_done:  # else a write still hangs on the server, holding the store: the process exits anyway
            store.close()
    except (StepwatchError, OSError, sqlite3.Error) as exc:  # a full disk: the rows are in the WAL or lost (counted)
        logging.getLogger("stepwatch.aggregator").debug("closing the store failed: %s", exc)
    return stats


def _start_dashboard(source: Path | str, host: str, port: int, token: str | None,
                     ui_host: str | None = None) -> tuple[Any, str]:
    """The dashboard (web/app.py) over this server's directory (or the store URL it writes to),
    in a process of its own
    (server/dashboard.py): building a page's data never takes the writer's GIL, heap or garbage
    collector, and the child reads the store read-only (WAL: it never blocks the writer). It
    binds ``ui_host`` when given (refused beyond loopback without a token), else the aggregator's
    host when that is loopback or a token is set, else 127.0.0.1 (a dashboard is never open to a
    network without a token). Called on the loop's thread, which lives as long as the process:
    the child's parent-death signal follows it."""
    from .binds import http_bind
    from .dashboard import DashboardProcess

    bind = http_bind(host, token, ui_host, "--ui-host")
    dashboard = DashboardProcess(source, bind, port, token)
    try:
        url = dashboard.start()
    except OSError as exc:
        raise ListenError(f"cannot listen for the dashboard on {bind}:{port}: {exc.strerror or exc}") from None
    return dashboard, url


def _start_feeds(feeds: dict[str, Any] | None, run_dir: Path, aggregator: Any, host: str, token: str | None) -> Any:
    """The feeds (server/feeds.py) the options ask for, their events tapped from the
    aggregator's ``emit``; None when none is asked for (nothing of them is imported then)."""
    if not feeds or not any(value is not None for value in feeds.values()):
        return None
    from .feeds import Feeds, feed_options_from

    fed = Feeds(feed_options_from(feeds), run_dir, aggregator, host, token)
    aggregator.emit = fed.tap(aggregator.emit)
    return fed


def _watchdog(run_dir: Path, watch: dict[str, Any] | None) -> Any:
    """The aggregator's watchdog (server/watchdog.py) with ``watch``'s options: ``stall_after_s``,
    ``throughput_window_s``, ``on_stall``, ``on_nonfinite``."""
    from ..analysis.alerts import AlertPolicy
    from .watchdog import Watchdog

    watch = watch or {}
    policy = AlertPolicy(stall_after_s=watch.get("stall_after_s") or AlertPolicy.stall_after_s,
                         throughput_window_s=watch.get("throughput_window_s") or AlertPolicy.throughput_window_s)
    return Watchdog(run_dir, policy, actions={"STALL": watch.get("on_stall") or "dump",
                                              "NONFINITE": watch.get("on_nonfinite") or "alert"})
def _start_live_verdicts(aggregator: Any, run_dir: Path, loop: asyncio.AbstractEventLoop,
                         store_url: str | None = None) -> Any:
    """The live verdicts' thread (server/live_verdicts.py), or None when turned off."""
    from .live_verdicts import LiveVerdicts, interval_from_env

    interval = interval_from_env()
    if interval <= 0:
        return None

    def store_row(table: str, row: dict[str, Any]) -> None:
        try:
            loop.call_soon_threadsafe(aggregator.queue_rows, table, [row])
        except RuntimeError:  # the loop has closed: the aggregator is gone
            pass

    live = LiveVerdicts(store_url or run_dir / "history.sqlite", progress=aggregator.live_progress, emit=aggregator.emit,
                        store_row=store_row, interval_s=interval, run_dir=run_dir,
                        busy=aggregator.under_load)
    live.start()
    return live


class EventLines:
    """The aggregator's stdout: the ready line, each live event (``Aggregator.emit``: alerts,
    verdicts) and the stopped line, as JSON lines written on a thread of their own.

    Why a thread: a reader that stops reading (a pipe nobody drains once it has the ready line,
    a stuck launcher) made ``write`` block once the pipe's 64 KiB were full, and it blocked the
    event loop: ingestion stalled, SIGTERM was never handled and the rows waiting were never
    written (64 RANK_LOST alerts are 96 KiB). Now the loop only queues a line; past
    ``max_lines`` waiting, a line is dropped and counted (``event_lines_dropped``). The thread
    writes to a duplicate of the stream's descriptor with ``os.write``, so one blocked in a full
    pipe holds no lock of ``sys.stdout`` that the interpreter's exit would wait on."""

    def __init__(self, stream: Any, max_lines: int = 10_000) -> None:
        self._stream = stream
        self._fd: int | None = None
        try:
            stream.flush()
            self._fd = os.dup(stream.fileno())
        except (AttributeError, OSError, ValueError):  # a stream with no descriptor (a test's StringIO)
            self._fd = None
        self._queue: queue.Queue[str | None] = queue.Queue(max_lines)
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="stepwatch-event-lines", daemon=True)
        self._thread.start()

    def write(self, message: dict[str, Any]) -> None:
        """Queues one line; never blocks (any thread: the loop, the live verdicts' thread)."""
        try:
            self._queue.put_nowait(json.dumps(message, default=str) + "\n")
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        broken = False
        while (line := self._queue.get()) is not None:
            if broken:
                continue
            try:
                if self._fd is None:
                    self._stream.write(line)
                    self._stream.flush()
                    continue
                data = line.encode()
                while data:
                    data = data[os.write(self._fd, data):]
            except (OSError, ValueError):  # nobody reads it any more
                broken = True

    def close(self, timeout: float = 2.0) -> bool:
        """Waits up to ``timeout`` for the queued lines to be written; False when a reader that
        does not read kept them (the process exits anyway, the stats file holds the counters)."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return False
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        if self._fd is not None:
            os.close(self._fd)
        return True


def serve(run_dir: Path, *, host: str = "127.0.0.1", port: int = 0, http_port: int | None = None,
          token: str | None = None, max_frame: int = 16 * 1024 * 1024, ready: Any = None,
          session_id: str | None = None, retention_ns: int | None = None, say_losses: bool = True,
          watch: dict[str, Any] | None = None, ui_port: int | None = None,
          feeds: dict[str, Any] | None = None, store: str | None = None,
          ui_host: str | None = None) -> dict[str, Any]:
    """Blocks until stopped; returns the aggregator's counters. Raises ListenError (and writes
    nothing) when it cannot listen; ``retention_ns``: the history's window per session and rank;
    ``say_losses`` False: failed writes are only counted (``stepwatch run`` says them itself);
    ``watch``: the watchdog's options (``_watchdog``; docs/watchdog.md); ``ui_port``: also serve
    the dashboard (docs/dashboard.md) on that port (0: any free), on ``ui_host`` if given
    (``http_bind``); ``feeds``: ``metrics_port``, ``metrics_host``, ``alert_webhook``, ``otlp_endpoint`` (server/feeds.py, docs/metrics.md); ``store``: a store URL
    (``clickhouse://...``) the rows go to instead of ``run_dir/history.sqlite`` (docs/clickhouse.md)."""
    log_to_stderr()  # the server is a program of its own: its warnings go to stderr
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = EventLines(ready or sys.stdout)
    children: list[Any] = []  # the dashboard's process, stopped here whatever ended the loop
    try:
        stats = asyncio.run(_serve(run_dir, host, port, http_port, token, max_frame, lines, session_id,
                                   retention_ns, say_losses, watch, ui_port, feeds, children, store, ui_host))
        stats["event_lines_dropped"] = lines.dropped
        _write_stats(run_dir, stats, lines)
    finally:
        for child in children:  # already stopped on the way out; after an error, stopped now
            child.stop()
        lines.close()
    return stats


def _write_stats(run_dir: Path, stats: dict[str, Any], ready: EventLines) -> None:
    """``aggregator_stats.json``, and the same counters as a last JSON line after the ready line,
    so a launcher learns them even when the disk is too full to hold the file."""
    from ..artifacts._files import atomic_write_bytes

    try:
        atomic_write_bytes(run_dir / "aggregator_stats.json", json.dumps(stats, indent=2).encode(), fsync=False)
    except OSError as exc:
        stats["stats_file_error"] = f"{exc.strerror or exc}"
    ready.write({"event": "stopped", "stats": stats})


def main(argv: list[str] | None = None) -> None:
    import argparse

    from ..analysis.alerts import AlertPolicy
    from .launcher import AGGREGATOR_STORE_ENV

    parser = argparse.ArgumentParser(prog="python -m stepwatch.server")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--http-port", type=int, default=None)
    parser.add_argument("--ui-port", type=int, default=None, help="also serve the dashboard on this port (0: any free)")
    parser.add_argument("--token-env", default=None)
    parser.add_argument("--session-id", default=None)
    parser.add_argument("--retention", default=os.environ.get(RETENTION_ENV) or None,
                        help=f"history window per session and rank, e.g. 7d, 12h (default: ${RETENTION_ENV}, else none)")
    parser.add_argument("--launched", action="store_true",
                        help="started by `stepwatch run`, which reports lost writes itself (from the stopped line)")
    parser.add_argument("--stall-after", type=float, default=AlertPolicy.stall_after_s,
                        help="seconds without progress before a rank is STALLed (docs/watchdog.md)")
    parser.add_argument("--throughput-window", type=float, default=AlertPolicy.throughput_window_s,
                        help="seconds per THROUGHPUT_DROP window")
    parser.add_argument("--on-stall", choices=("dump", "kill"), default="dump")
    parser.add_argument("--on-nonfinite", choices=("alert", "halt"), default="alert")
    parser.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics on this port (0: any free)")
    parser.add_argument("--metrics-host", default=None, help="the address /metrics binds (beyond loopback: a token)")
    parser.add_argument("--ui-host", default=None, help="the address the dashboard binds (beyond loopback: a token)")
    parser.add_argument("--alert-webhook", default=None, help="POST each alert and verdict change to this URL")
    parser.add_argument("--otlp-endpoint", default=None, help="export metrics and spans over OTLP/HTTP to this URL")
    parser.add_argument("--store", default=None,
                        help="write the history to this store URL (clickhouse://host:9000/db) instead of OUT/history.sqlite"
                             f" (or ${AGGREGATOR_STORE_ENV}: a URL with a password stays out of `ps`)")
    args = parser.parse_args(argv)
    store = args.store or os.environ.pop(AGGREGATOR_STORE_ENV, None) or None
    if not args.stall_after > 0 or not args.throughput_window > 0:
        parser.error("--stall-after and --throughput-window must be positive")
    token = os.environ.get(args.token_env) if args.token_env else None
    try:
        retention_ns = parse_duration(args.retention) if args.retention else None
    except ValueError as exc:
        parser.error(f"--retention: {exc}")
    try:
        serve(args.out, host=args.host, port=args.port, http_port=args.http_port, token=token,
              session_id=args.session_id, retention_ns=retention_ns, say_losses=not args.launched, ui_port=args.ui_port,
              ui_host=args.ui_host, store=store,
              feeds={"metrics_port": args.metrics_port, "metrics_host": args.metrics_host,
                     "alert_webhook": args.alert_webhook, "otlp_endpoint": args.otlp_endpoint},
              watch={"stall_after_s": args.stall_after, "throughput_window_s": args.throughput_window,
                     "on_stall": args.on_stall, "on_nonfinite": args.on_nonfinite})
    except StepwatchError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
