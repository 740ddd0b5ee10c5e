"""Runs the aggregator: TCP frames and HTTP ingestion into ``<run>/history.sqlite``.

Prints one JSON line ``{"event": "ready", "tcp": "H:P", "http": "H:Q", ...}`` on stdout once
it listens, so a launcher can read the ports; SIGTERM/SIGINT drain and stop it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

__all__ = ["serve"]


async def _serve(run_dir: Path, host: str, port: int, http_port: int | None, token: str | None,
                 max_frame: int, ready: Any) -> dict[str, Any]:
    from ..store.sqlite import SqliteStore
    from .aggregator import Aggregator

    store = SqliteStore(run_dir / "history.sqlite")
    aggregator = Aggregator(store, max_frame=max_frame)
    tcp = await asyncio.start_server(aggregator.handle_connection, host, port)
    tcp_port = tcp.sockets[0].getsockname()[1]
    runner = None
    http_bound = None
    if http_port is not None:
        from aiohttp import web

        from .http_ingest import IngestApp

        runner = web.AppRunner(IngestApp(aggregator, run_dir=run_dir, token=token).build(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, http_port)
        await site.start()
        http_bound = runner.addresses[0][1] if runner.addresses else http_port
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, aggregator.stop)
    writer = asyncio.create_task(aggregator.write_loop())
    ready.write(json.dumps({"event": "ready", "tcp": f"{host}:{tcp_port}",
                            "http": f"{host}:{http_bound}" if http_bound else None,
                            "store": str(run_dir / "history.sqlite"), "pid": os.getpid()}) + "\n")
    ready.flush()
    await aggregator._stopping.wait()  # noqa: SLF001 - the one stop signal
    tcp.close()
    aggregator.close_connections()
    await tcp.wait_closed()
    if runner is not None:
        await runner.cleanup()
    await writer
    await aggregator.flush()  # rows accepted while the listeners were closing
    stats = aggregator.stats()
    store.close()
    return stats


def serve(run_dir: Path, *, host: str = "127.0.0.1", port: int = 0, http_port: int | None = None,
          token: str | None = None, max_frame: int = 16 * 1024 * 1024, ready: Any = None) -> dict[str, Any]:
    """Blocks until stopped; returns the aggregator's counters."""
    run_dir.mkdir(parents=True, exist_ok=True)
    stats = asyncio.run(_serve(run_dir, host, port, http_port, token, max_frame, ready or sys.stdout))
    (run_dir / "aggregator_stats.json").write_text(json.dumps(stats, indent=2))
    return stats


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m stepwatch.server")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--http-port", type=int, default=None)
    parser.add_argument("--token-env", default=None)
    args = parser.parse_args(argv)
    token = os.environ.get(args.token_env) if args.token_env else None
    serve(args.out, host=args.host, port=args.port, http_port=args.http_port, token=token)


if __name__ == "__main__":
    main()
