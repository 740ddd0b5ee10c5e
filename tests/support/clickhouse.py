"""Debian's ``clickhouse-server`` (18.16) for the tests: one per test session, started from a
private directory (its own config, users, data and log dirs; free ports; 127.0.0.1 only) by
whichever parallel worker asks first, shared by every worker, stopped by pid when the last one
is done. Each test uses a database of its own (``database_url``).

Sharing: ``server.lock`` (exclusive, held while starting or stopping) guards ``server.json``
(pid and ports); every worker using the server holds ``users.lock`` shared for its session. At the
end a worker that can take ``users.lock`` exclusively is the last user and stops the server; a
worker that asks later finds no live server and starts a new one.

Where the binary is missing the tests skip, unless ``STEPWATCH_REQUIRE_CLICKHOUSE=1`` (CI), where
they fail.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from . import free_port
from .shared import shared_dir

BINARY = Path("/usr/sbin/clickhouse-server")
_STARTED: dict[int, subprocess.Popen[bytes]] = {}  # the servers this worker started: reaped when stopped

_CONFIG = """<yandex>
  <logger><level>warning</level><log>{home}/log/server.log</log><errorlog>{home}/log/error.log</errorlog>
    <console>0</console></logger>
  <listen_host>127.0.0.1</listen_host>
  <http_port>{http_port}</http_port>
  <tcp_port>{tcp_port}</tcp_port>
  <path>{home}/data/</path>
  <tmp_path>{home}/tmp/</tmp_path>
  <user_files_path>{home}/user_files/</user_files_path>
  <format_schema_path>{home}/format_schemas/</format_schema_path>
  <users_config>{home}/users.xml</users_config>
  <default_profile>default</default_profile>
  <default_database>default</default_database>
  <mark_cache_size>268435456</mark_cache_size>
  <uncompressed_cache_size>0</uncompressed_cache_size>
  <mlock_executable>false</mlock_executable>
</yandex>
"""
_USERS = """<yandex>
  <profiles><default></default></profiles>
  <users><default><password></password><networks><ip>127.0.0.1</ip><ip>::1</ip></networks>
    <profile>default</profile><quota>default</quota></default></users>
  <quotas><default></default></quotas>
</yandex>
"""


def require_clickhouse() -> None:
    """Skips the test where the server binary is missing (fails under STEPWATCH_REQUIRE_CLICKHOUSE=1)."""
    missing = None
    if not BINARY.exists():
        missing = f"{BINARY} is not installed (apt-get install -y clickhouse-server clickhouse-client)"
    else:
        try:
            import clickhouse_driver  # noqa: F401
        except ImportError:
            missing = "clickhouse-driver is not installed (pip install 'stepwatch[clickhouse]')"
    if missing is None:
        return
    if os.environ.get("STEPWATCH_REQUIRE_CLICKHOUSE") == "1":
        pytest.fail(missing)
    pytest.skip(missing)


def require_chdb() -> None:
    """Skips the test where chdb (ClickHouse 26.x in-process, the dev extra) is not installed;
    fails instead under STEPWATCH_REQUIRE_CLICKHOUSE=1."""
    try:
        import chdb  # noqa: F401
    except ImportError:
        missing = "chdb is not installed (pip install chdb: about 35 s, 0.9 GB with pandas and pyarrow)"
        if os.environ.get("STEPWATCH_REQUIRE_CLICKHOUSE") == "1":
            pytest.fail(missing)
        pytest.skip(missing)


def mutations_done(store: Any) -> None:
    """Waits until the server has applied the store's mutations (``ALTER ... DELETE``,
    ``MATERIALIZE TTL``; asynchronous on every version): the event is the server's own table of
    them (18.16 says nothing else when one is done)."""
    deadline = time.monotonic() + 30
    while store.query_tuples("SELECT count() FROM system.mutations WHERE database = ? AND is_done = 0",
                             (store.url.database,)) != [(0,)]:
        assert time.monotonic() < deadline, "mutations not applied in 30 s"
        time.sleep(0.05)


def _ping(http_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/ping", timeout=2) as answer:
            return bool(answer.read().strip() == b"Ok.")
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (its parent, the worker that started it, not reaping) is gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return False


def _start(home: Path) -> dict[str, Any]:
    home = home / f"server-{uuid.uuid4().hex[:8]}"
    for sub in ("log", "data", "tmp", "user_files", "format_schemas"):
        (home / sub).mkdir(parents=True)
    http_port, tcp_port = free_port(), free_port()
    (home / "config.xml").write_text(_CONFIG.format(home=home, http_port=http_port, tcp_port=tcp_port))
    (home / "users.xml").write_text(_USERS)
    return _launch(home, http_port, tcp_port)


def _launch(home: Path, http_port: int, tcp_port: int) -> dict[str, Any]:
    """Starts the server of ``home``'s config (again, after a stop or a kill: same data, same ports)."""
    with (home / "log" / "stdout.log").open("ab") as log:
        process = subprocess.Popen([str(BINARY), f"--config-file={home / 'config.xml'}"], cwd=home,
                                   stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)  # outlives the worker that started it
    deadline = time.monotonic() + 60
    while not _ping(http_port):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            errors = (home / "log" / "error.log")
            raise RuntimeError(f"clickhouse-server did not start: "
                               f"{errors.read_text()[-2000:] if errors.exists() else '(no log)'}")
        time.sleep(0.05)  # /ping is the only readiness signal the server gives
    _STARTED[process.pid] = process
    return {"pid": process.pid, "http_port": http_port, "tcp_port": tcp_port, "home": str(home)}


def _stop(state: dict[str, Any]) -> None:
    pid = int(state["pid"])
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 20
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
    process = _STARTED.pop(pid, None)
    if process is not None:
        process.wait(10)


class PrivateClickHouse:
    """A server of one test's own, which the test may pause (SIGSTOP: a hung server), kill
    (SIGKILL) and start again on the same data and ports; the shared one must never be."""

    def __init__(self, home: Path) -> None:
        require_clickhouse()
        self.state = _start(home)
        self.home = Path(self.state["home"])
        self.tcp_port = int(self.state["tcp_port"])
        self.http_port = int(self.state["http_port"])

    @property
    def pid(self) -> int:
        return int(self.state["pid"])

    def url(self, database: str) -> str:
        return f"clickhouse://default@127.0.0.1:{self.tcp_port}/{database}"

    def pause(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def kill(self) -> None:
        """SIGKILL (a paused server too), and reaped."""
        os.kill(self.pid, signal.SIGKILL)
        process = _STARTED.pop(self.pid, None)
        if process is not None:
            process.wait(10)

    def start(self) -> None:
        self.state = _launch(self.home, self.http_port, self.tcp_port)

    def stop(self) -> None:
        if _alive(self.pid):
            os.kill(self.pid, signal.SIGCONT)
            _stop(self.state)


class ClickHouseServer:
    """A running server's native (tcp) port; ``database_url`` gives each test its own database."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.tcp_port = int(state["tcp_port"])
        self.http_port = int(state["http_port"])
        self.pid = int(state["pid"])
        self.home = Path(state["home"])

    def database_url(self, prefix: str = "t") -> str:
        return f"clickhouse://default@127.0.0.1:{self.tcp_port}/{prefix}_{uuid.uuid4().hex[:12]}"


def clickhouse_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClickHouseServer]:
    """The body of a session-scoped fixture: the shared server, held for this worker's session."""
    require_clickhouse()
    home = shared_dir(tmp_path_factory) / "clickhouse"
    home.mkdir(parents=True, exist_ok=True)
    state_file = home / "server.json"
    users: IO[str] = open(home / "users.lock", "a")  # noqa: SIM115 - held for the whole session
    try:
        with open(home / "server.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state = json.loads(state_file.read_text()) if state_file.exists() else None
            if state is None or not _alive(int(state["pid"])) or not _ping(int(state["http_port"])):
                state = _start(home)
                state_file.write_text(json.dumps(state))
            fcntl.flock(users, fcntl.LOCK_SH)
        yield ClickHouseServer(state)
    finally:
        fcntl.flock(users, fcntl.LOCK_UN)
        with open(home / "server.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no other worker holds it: the last user
            except BlockingIOError:
                pass
            else:
                if state_file.exists():
                    _stop(json.loads(state_file.read_text()))
                    state_file.unlink()
                fcntl.flock(users, fcntl.LOCK_UN)
        users.close()


def imported_trace_run(tmp_path_factory: pytest.TempPathFactory, server: ClickHouseServer) -> dict[str, Any]:
    """The session-shared two-rank run (tests/support/trace_run.py) imported once per server, for
    every worker, into a database of its own and into a new history.sqlite (the same importer,
    so the same rows): ``{"url", "sqlite", "run_dir", "session_id"}``. Read only."""
    from stepwatch.store import open_store
    from stepwatch.store.importers import import_path
    from stepwatch.store.sqlite import SqliteStore

    from .shared import once
    from .trace_run import trace_run

    run_dir = trace_run(tmp_path_factory)

    def build(home: Path) -> dict[str, Any]:
        url = server.database_url("trace")
        sqlite_path = home / "history.sqlite"
        with SqliteStore(sqlite_path) as sqlite:
            import_path(run_dir, sqlite)
        ch = open_store(url)
        try:
            import_path(run_dir, ch)
        finally:
            ch.close()
        session_id = json.loads((run_dir / "run.json").read_text())["session_id"]
        return {"url": url, "sqlite": sqlite_path, "run_dir": run_dir, "session_id": session_id}

    # keyed by the server: a server started again later in the session has none of the rows
    return once(tmp_path_factory, f"clickhouse-trace-run-{server.pid}", build)
