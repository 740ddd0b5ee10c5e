"""A real aggregator process for the tests (``python -m stepwatch.server``), and the reads and raw
clients the tests check it with."""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from stepwatch.transport.sender import parse_address


class Aggregator:
    """A running ``python -m stepwatch.server`` and its ready line."""

    def __init__(self, out: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.out = out
        self.err_path = out.parent / f"{out.name}.stderr"
        self._err = self.err_path.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "stepwatch.server", "--out", str(out), *args],
                                     stdout=subprocess.PIPE, stderr=self._err, text=True,
                                     env={**os.environ, **(env or {})})
        self.ready = self._ready_line()
        self.tcp = parse_address(self.ready["tcp"])
        self.http = parse_address(self.ready["http"]) if self.ready.get("http") else None

    def _ready_line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        selector = selectors.DefaultSelector()
        selector.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            if not selector.select(timeout=30):
                self.proc.kill()
                raise AssertionError(f"no ready line in 30 s: {self.stderr()}")
        finally:
            selector.close()
        line = self.proc.stdout.readline()
        assert line, f"aggregator exited ({self.proc.wait()}): {self.stderr()}"
        ready = json.loads(line)
        assert ready["event"] == "ready"
        return ready

    def stderr(self) -> str:
        if not self._err.closed:
            self._err.flush()
        return self.err_path.read_text()

    def stop(self, timeout: float = 20) -> dict[str, Any]:
        """SIGTERM, wait, and the counters it wrote."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"aggregator did not stop within {timeout} s after SIGTERM") from None
        finally:
            self._err.close()
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        assert code == 0, self.err_path.read_text()
        return json.loads((self.out / "aggregator_stats.json").read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._err.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def query(path: Path, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        return db.execute(sql, params).fetchall()
    finally:
        db.close()


def raw_client(address: tuple[str, int], data: bytes, *, wait_close: bool = True) -> bool:
    """Sends ``data`` on a fresh connection and closes; True if the server closed it first."""
    with socket.create_connection(address, timeout=5) as sock:
        sock.sendall(data)
        if not wait_close:
            return False
        try:
            return sock.recv(1) == b""
        except (ConnectionResetError, TimeoutError):
            return False


def wait_for(predicate: Any, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return False
