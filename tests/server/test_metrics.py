"""Prometheus ``/metrics`` on the aggregator (``--metrics-port``; docs/metrics.md): Debian's
Prometheus scrapes a live 2-rank run and the values are read back through its HTTP API; the
exposition parses with prometheus_client's own parser; the token; the bound on sessions."""

from __future__ import annotations

import math
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.support.feeds import FedRun, fed_run, require_prometheus
from tests.support.history import write_run


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> FedRun:
    return fed_run(tmp_path_factory)


def _by_rank(results: list[dict[str, Any]]) -> dict[str, float]:
    return {r["metric"]["rank"]: float(r["value"][1]) for r in results}


@pytest.mark.real
def test_prometheus_scrapes_a_live_two_rank_run(fed: FedRun) -> None:
    require_prometheus(fed.prometheus_missing)
    assert fed.returncode == 0, fed.stderr[-3000:]
    assert not fed.waited_for, f"still missing in Prometheus at the deadline: {fed.waited_for}"
    prom = fed.prometheus
    session = prom["steps_per_second"][0]["metric"]["session"]
    for name in ("steps_per_second", "step_time_median", "step_time_p99", "forward_share", "loss", "memory",
                 "heartbeat_age"):
        series = prom[name]
        assert {r["metric"]["rank"] for r in series} == {"0", "1"}, name
        for r in series:
            labels = r["metric"]
            assert labels["session"] == session and labels["host"] == socket.gethostname(), labels
            assert labels["job"] == "stepwatch"  # Prometheus's own label: it was scraped, not pushed
    rates = _by_rank(prom["steps_per_second"])
    assert all(1 < rate < 40 for rate in rates.values()), rates  # a 30 ms sleep between steps bounds it above
    medians, p99s = _by_rank(prom["step_time_median"]), _by_rank(prom["step_time_p99"])
    assert all(0 < medians[r] <= p99s[r] < 5 for r in medians), (medians, p99s)
    assert all(0 < share < 1 for share in _by_rank(prom["forward_share"]).values())
    assert all(math.isfinite(v) and v >= 0 for v in _by_rank(prom["loss"]).values())
    memory = prom["memory"]
    assert {(r["metric"]["device"], r["metric"]["kind"]) for r in memory} == {("rss", "rss")}
    assert all(float(r["value"][1]) > 10e6 for r in memory)
    assert all(0 <= v < 30 for v in _by_rank(prom["heartbeat_age"]).values())
    [alerts] = prom["alerts"]
    assert alerts["metric"]["session"] == session and float(alerts["value"][1]) >= 1
    [verdict] = prom["verdict"]
    assert verdict["metric"]["session"] == session and verdict["metric"]["name"] and verdict["value"][1] == "1"
    assert float(prom["rows_written"][0]["value"][1]) > 0
    assert float(prom["pending_rows"][0]["value"][1]) >= 0


@pytest.mark.real
def test_the_exposition_parses_and_every_name_is_stepwatchs(fed: FedRun) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    assert fed.metrics_text, "no /metrics exposition was taken while the run trained"
    # `run --metrics-host 0.0.0.0 --token-env VAR`: bound beyond loopback, and only the token opens it
    assert fed.metrics_without_token == 401
    families = {f.name: f for f in text_string_to_metric_families(fed.metrics_text)}
    assert families and all(name.startswith("stepwatch_") for name in families), sorted(families)
    kinds = {name: f.type for name, f in families.items()}
    assert kinds["stepwatch_step_time_seconds"] == "gauge" and kinds["stepwatch_alerts"] == "counter"
    # the text format has no info type: an info metric is a gauge named ..._info, of value 1
    assert kinds["stepwatch_verdict_info"] == "gauge" and kinds["stepwatch_aggregator_frames_rejected"] == "counter"
    [verdict] = families["stepwatch_verdict_info"].samples
    assert verdict.value == 1 and verdict.labels["name"] and verdict.labels["severity"]
    quantiles = {s.labels["quantile"] for s in families["stepwatch_step_time_seconds"].samples}
    assert quantiles == {"0.5", "0.9", "0.99"}
    phases = {s.labels["phase"] for s in families["stepwatch_phase_share_ratio"].samples}
    assert {"data_load", "forward", "backward", "optimizer", "wait"} <= phases
    for family in families.values():
        for sample in family.samples:
            if "rank" in sample.labels:
                assert set(sample.labels) >= {"session", "rank", "host"}, sample


def _scrape(url: str, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _core(tmp_path: Path, sessions: list[str]) -> Any:
    """A real aggregator core over a history holding ``sessions`` (two ranks, 30 steps each; the
    first ones stopped), each announced by a frame, oldest first."""
    from stepwatch.server.aggregator import Aggregator
    from stepwatch.store.sqlite import SqliteStore
    from stepwatch.transport.frames import Message

    store = SqliteStore(tmp_path / "history.sqlite")
    core = Aggregator(store)
    for i, session in enumerate(sessions):
        write_run(store, session, 2, 30)
        if i < len(sessions) - 1:  # every session but the newest has stopped
            store.append_many({"telemetry": [
                {"session_id": session, "rank": rank, "timestamp_ns": 1_790_000_001_000_000_000 + i,
                 "event_type": "stop", "collector": "stepwatch", "device_id": None, "allocated": None,
                 "reserved": None, "active": None, "inactive": None, "change": None, "used": None, "free": None,
                 "total": None, "pid": 1, "host": "test", "context": "stepwatch capture stopped (completed)",
                 "metadata": {}} for rank in range(2)]})
        for rank in range(2):
            core.accept(Message(meta={"session_id": session, "rank": rank, "host": f"node{rank}"},
                                tables={"marks": [{"id": f"{i:04d}{rank:028d}", "name": "loss", "value": 0.5}]}))
    return core, store


def test_sessions_are_bounded_and_finished_ones_expire(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from stepwatch.server.feed_state import FeedState
    from stepwatch.server.metrics import StepwatchCollector

    sessions = [f"session-{i}" for i in range(6)]
    core, store = _core(tmp_path, sessions)
    now = [0.0]
    state = FeedState(tmp_path, core, max_sessions=3, finished_ttl_s=60, cache_s=0, clock=lambda: now[0])
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StepwatchCollector(state, core))

    def shown() -> dict[str, set[str]]:
        found: dict[str, set[str]] = {}
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for sample in family.samples:
                if "session" in sample.labels:
                    found.setdefault(sample.labels["session"], set()).add(sample.labels.get("host", ""))
        return found

    try:
        first = shown()
        assert set(first) == {"session-3", "session-4", "session-5"}  # the newest three only
        assert first["session-5"] == {"node0", "node1"}  # each rank's host, as its first frame said
        now[0] = 59.0
        assert set(shown()) == {"session-3", "session-4", "session-5"}
        now[0] = 61.0  # a minute after they were seen stopped: sessions 3 and 4 expire; the running one stays
        assert set(shown()) == {"session-5"}
        text = generate_latest(registry).decode()
        assert "stepwatch_metrics_sessions_expired_total 2.0" in text
        assert len(state._readers) == 1  # the expired sessions' readers are closed
    finally:
        state.close()
        store.close()


def test_a_token_guards_metrics_and_no_token_binds_loopback_only(tmp_path: Path) -> None:
    from stepwatch.errors import StepwatchError
    from stepwatch.server.feed_state import FeedState
    from stepwatch.server.metrics import start_metrics

    core, store = _core(tmp_path, ["only"])
    state = FeedState(tmp_path, core, cache_s=0)
    guarded, _ = start_metrics(state, core, "127.0.0.1", 0, "s3cret")
    open_one, _ = start_metrics(state, core, "0.0.0.0", 0, None)  # no token: loopback, whatever --host says
    everywhere, _ = start_metrics(state, core, "127.0.0.1", 0, "s3cret", bind="0.0.0.0")  # --metrics-host
    try:
        assert everywhere.host == "0.0.0.0"
        assert _scrape(everywhere.url.replace("0.0.0.0", "127.0.0.1"))[0] == 401
        assert _scrape(everywhere.url.replace("0.0.0.0", "127.0.0.1"), "s3cret")[0] == 200
        with pytest.raises(StepwatchError, match="--metrics-host 0.0.0.0 is not loopback: it then needs a token"):
            start_metrics(state, core, "127.0.0.1", 0, None, bind="0.0.0.0")
        assert _scrape(guarded.url)[0] == 401
        assert _scrape(guarded.url, "wrong")[0] == 401
        status, body = _scrape(guarded.url, "s3cret")
        assert status == 200 and 'stepwatch_steps{host="node0",rank="0",session="only"} 30.0' in body
        assert 'stepwatch_memory_peak_bytes{device="rss",host="node0",kind="rss",rank="0",session="only"}' in body
        assert open_one.host == "127.0.0.1" and _scrape(open_one.url)[0] == 200
        assert _scrape(open_one.url.replace("/metrics", "/other"))[0] == 404
    finally:
        everywhere.close()
        guarded.close()
        open_one.close()
        state.close()
        store.close()


def test_serve_refuses_a_metrics_port_in_use(tmp_path: Path) -> None:
    from stepwatch.errors import StepwatchError
    from stepwatch.server.serve import serve

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(StepwatchError, match=f"cannot listen for /metrics on 127.0.0.1:{port}"):
            serve(tmp_path / "hub", feeds={"metrics_port": port}, ready=_Lines())


class _Lines:
    def write(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass


@pytest.mark.real
def test_serve_says_where_its_metrics_are(tmp_path: Path) -> None:
    import json
    import subprocess

    from tests.support import STEPWATCH, clean_env

    proc = subprocess.Popen([*STEPWATCH, "serve", "--out", str(tmp_path / "hub"), "--metrics-port", "0"],
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        assert ready["metrics"].startswith("http://127.0.0.1:") and ready["metrics"].endswith("/metrics")
        status, body = _scrape(ready["metrics"])
        assert status == 200 and "stepwatch_aggregator_pending_rows 0.0" in body
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr


@pytest.mark.real
def test_run_with_a_remote_aggregator_has_no_feeds_to_serve(tmp_path: Path) -> None:
    from tests.support import run_stepwatch

    (tmp_path / "train.py").write_text("print('never run')\n")
    proc = run_stepwatch("run", "--aggregator", "127.0.0.1:9", "--metrics-port", "0", "--out", str(tmp_path / "run"),
                         "train.py", cwd=tmp_path)
    assert proc.returncode == 2 and "--metrics-port, --alert-webhook and --otlp-endpoint" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("command", "args", "env", "said"), [
    ("run", ["--metrics-port", "0", "--metrics-host", "0.0.0.0"], {},
     "--metrics-host 0.0.0.0 is not loopback: it then needs a token (--token-env VAR"),
    ("run", ["--ui-port", "0", "--ui-host", "192.0.2.7"], {}, "--ui-host 192.0.2.7 is not loopback"),
    ("run", ["--metrics-port", "0", "--metrics-host", "0.0.0.0", "--token-env", "SW_EMPTY"], {"SW_EMPTY": ""},
     "--token-env SW_EMPTY: that variable is empty or unset"),
    ("run", ["--metrics-host", "127.0.0.1"], {}, "--metrics-host says where --metrics-port binds; give that too"),
    ("serve", ["--metrics-port", "0", "--metrics-host", "::"], {}, "--metrics-host :: is not loopback"),
    ("serve", ["--ui-port", "0", "--ui-host", "0.0.0.0"], {}, "--ui-host 0.0.0.0 is not loopback"),
])
def test_a_bind_beyond_loopback_without_a_token_is_refused_before_anything_starts(
        command: str, args: list[str], env: dict[str, str], said: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from stepwatch.ui.cli import cli

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "train.py").write_text("raise SystemExit('never run')\n")
    out = tmp_path / "out"
    tail = [str(tmp_path / "train.py")] if command == "run" else []
    result = CliRunner().invoke(cli, [command, "--out", str(out), *args, *tail])
    assert result.exit_code == 2, result.output
    assert said in " ".join(result.stderr.split()), result.stderr
    assert not out.exists()  # nothing was started
