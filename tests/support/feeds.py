"""The feeds' real counterparts, started by the tests on loopback: Debian's Prometheus scraping
``/metrics``, an HTTP receiver of alert webhooks (one that answers, one that fails its first
posts, one that never answers), and an OTLP/HTTP receiver keeping the protobuf bodies it is sent.

``fed_run``: one 2-rank ``stepwatch run`` with all three feeds (/metrics on 0.0.0.0, with a token), made once per test session
(``shared.once``) and read by tests/server/test_metrics.py, test_webhooks.py and test_otlp.py.
The program trains until the test opens its gate (every value Prometheus should hold is there,
the webhook has the alert, the OTLP receiver has spans and metrics), so it runs no longer than
the slowest of them needs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.support import STEPWATCH, clean_env, free_port
from tests.support.shared import once

# trains epochs of 20 steps until the gate file exists (at most 60 epochs); rank 1 marks a NaN
# loss at its 15th step (a NONFINITE alert for the webhook)
PROGRAM = '''
import os, pathlib, time
import torch
from torch.utils.data import DataLoader, TensorDataset
import stepwatch

torch.manual_seed(0)
torch.set_num_threads(1)
rank = int(os.environ.get("RANK", "0"))
gate = pathlib.Path(os.environ["FEED_GATE"])
x = torch.randn(160, 4)
loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
done = 0
for epoch in stepwatch.epochs(60):
    if epoch >= 2 and gate.exists():
        break
    for xb, yb in loader:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        done += 1
        if rank == 1 and done == 15:
            stepwatch.mark("loss", float("nan"))
        time.sleep(0.03)
'''

TOKEN = "feeds-token"  # /metrics binds 0.0.0.0 with it; Prometheus scrapes with it (Authorization: Bearer)

# what the gate waits for in Prometheus (each query must return a series for both ranks, or one)
PROM_QUERIES = {
    "steps_per_second": ("stepwatch_steps_per_second", 2),
    "step_time_median": ('stepwatch_step_time_seconds{quantile="0.5"}', 2),
    "step_time_p99": ('stepwatch_step_time_seconds{quantile="0.99"}', 2),
    "forward_share": ('stepwatch_phase_share_ratio{phase="forward"}', 2),
    "loss": ("stepwatch_loss", 2),
    "memory": ("stepwatch_memory_bytes", 2),
    "heartbeat_age": ("stepwatch_heartbeat_age_seconds", 2),
    "alerts": ('stepwatch_alerts_total{kind="NONFINITE"}', 1),
    "verdict": ("stepwatch_verdict_info", 1),
    "pending_rows": ("stepwatch_aggregator_pending_rows", 1),
    "rows_written": ("stepwatch_aggregator_rows_written_total > 0", 1),
}


class Receiver:
    """A ``ThreadingHTTPServer`` on loopback keeping every POST (path, body, headers); ``answer``
    decides the reply of the n-th POST (status; None: never answer, hold the connection)."""

    def __init__(self, answer: Any = None) -> None:
        self.posts: list[tuple[str, bytes, dict[str, str]]] = []
        self.lock = threading.Lock()
        self.closing = threading.Event()
        decide = answer or (lambda n, path: 200)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with receiver.lock:
                    receiver.posts.append((self.path, body, dict(self.headers)))
                    n = len(receiver.posts)
                status = decide(n, self.path)
                if status is None:  # a receiver that never answers
                    receiver.closing.wait(60)
                    return
                reply = receiver.reply(self.path)
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf" if self.path.startswith("/v1/")
                                 else "text/plain")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def reply(self, path: str) -> bytes:
        """The body of a 200: OTLP's empty response message (an empty protobuf is zero bytes)."""
        return b"" if path.startswith("/v1/") else b"ok"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def bodies(self, path: str | None = None) -> list[bytes]:
        with self.lock:
            return [body for p, body, _ in self.posts if path is None or p == path]

    def close(self) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()


def require_prometheus(missing: str | None) -> None:
    """Skips the test where the run had no Prometheus to scrape it (fails instead under CI's
    STEPWATCH_REQUIRE_PROMETHEUS=1)."""
    if missing is None:
        return
    if os.environ.get("STEPWATCH_REQUIRE_PROMETHEUS") == "1":
        pytest.fail(missing)
    pytest.skip(missing)


class Prometheus:
    """Debian's ``prometheus`` from a private directory, scraping one target every second."""

    def __init__(self, home: Path, target: str, binary: str, token: str | None = None) -> None:
        home.mkdir(parents=True, exist_ok=True)
        config = home / "prometheus.yml"
        bearer = f"    authorization:\n      credentials: '{token}'\n" if token else ""
        config.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
                          f"scrape_configs:\n  - job_name: stepwatch\n{bearer}    static_configs:\n"
                          f"      - targets: ['{target}']\n")
        self.port = free_port()
        with (home / "prometheus.log").open("wb") as log:
            self.process = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={home / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"], cwd=home, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start: {(home / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.2)  # its readiness has no event to await

    def query(self, expression: str) -> list[dict[str, Any]]:
        """``/api/v1/query``'s result: [{"metric": {labels}, "value": [ts, "value"]}, ...]."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expression})
        with urllib.request.urlopen(url, timeout=10) as answer:
            data = json.loads(answer.read())
        assert data["status"] == "success", data
        return list(data["data"]["result"])

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


@dataclass
class FedRun:
    run_dir: Path
    returncode: int
    stderr: str
    metrics_port: int
    prometheus: dict[str, list[dict[str, Any]]]  # PROM_QUERIES' names -> results, while it trained
    metrics_text: str  # one /metrics exposition, while it trained
    metrics_without_token: int  # the HTTP status of a scrape with no token, while it trained
    webhook_posts: list[tuple[str, bytes, dict[str, str]]]
    otlp_posts: list[tuple[str, bytes, dict[str, str]]]
    otlp_during: int  # OTLP posts received before the gate opened (while the run went)
    stats: dict[str, Any] = field(default_factory=dict)
    prometheus_missing: str | None = None  # why no Prometheus scraped the run (the other feeds' tests still run)
    gate_after_s: float = 0.0
    waited_for: list[str] = field(default_factory=list)  # what was still missing at the gate's deadline


def fed_run(factory: pytest.TempPathFactory) -> FedRun:
    return once(factory, "feeds-run", _fed)


def _fed(base: Path) -> FedRun:
    (base / "train.py").write_text(PROGRAM)
    run_dir, gate = base / "run", base / "gate"
    port = free_port()
    binary = shutil.which("prometheus")
    prometheus = Prometheus(base / "prometheus", f"127.0.0.1:{port}", binary, TOKEN) if binary else None
    missing_why = None if binary else "prometheus is not installed (apt-get install -y prometheus)"
    hook = Receiver(lambda n, path: 503 if n <= 2 else 200)  # the first two posts fail: retried
    otlp = Receiver()
    job = None
    try:
        job = subprocess.Popen(
            [*STEPWATCH, "run", "--nproc-per-node", "2", "--master-port", str(free_port()), "--out", str(run_dir),
             "--view", "off", "--quiet", "--interval", "200", "--metrics-port", str(port),
             "--metrics-host", "0.0.0.0", "--token-env", "FEED_TOKEN",  # beyond loopback: with a token
             "--alert-webhook", f"{hook.url}/hook", "--otlp-endpoint", otlp.url, "train.py"],
            cwd=base, env=clean_env(FEED_GATE=str(gate), FEED_TOKEN=TOKEN, STEPWATCH_VERDICT_INTERVAL_S="0.5",
                                    STEPWATCH_OTLP_INTERVAL_S="1", STEPWATCH_OTLP_FULL_FIRST="3",
                                    STEPWATCH_OTLP_FULL_EVERY="10"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started = time.monotonic()
        results: dict[str, list[dict[str, Any]]] = {}
        text = ""
        refused = 0
        missing = list(PROM_QUERIES) if prometheus is not None else []
        waiting = ["the run's start"]
        deadline = started + 150
        while job.poll() is None and time.monotonic() < deadline:
            for name in list(missing):
                assert prometheus is not None
                found = prometheus.query(PROM_QUERIES[name][0])
                if len(found) >= PROM_QUERIES[name][1]:
                    results[name] = found
                    missing.remove(name)
            if not text and not missing:
                url = f"http://127.0.0.1:{port}/metrics"
                request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
                with urllib.request.urlopen(request, timeout=10) as answer:
                    text = answer.read().decode()
                try:
                    urllib.request.urlopen(url, timeout=10).close()
                    refused = 200
                except urllib.error.HTTPError as exc:
                    refused = exc.code
            waiting = missing + ([] if any(b"NONFINITE" in b for b in hook.bodies()) else ["webhook"]) + (
                [] if otlp.bodies("/v1/traces") and otlp.bodies("/v1/metrics") else ["otlp"])
            if not waiting:
                break
            time.sleep(0.5)  # polling other processes' state: there is no event to await
        gate_after = time.monotonic() - started
        otlp_during = len(otlp.bodies())
        gate.write_text("done")
        _, stderr = job.communicate(timeout=120)
    finally:
        if job is not None and job.poll() is None:
            job.kill()
            job.communicate(timeout=30)
        if prometheus is not None:
            prometheus.close()
        hook.close()
        otlp.close()
    stats_file = run_dir / "aggregator_stats.json"
    stats = json.loads(stats_file.read_text()) if stats_file.is_file() else {}
    return FedRun(run_dir, job.returncode, stderr, port, results, text, refused, list(hook.posts), list(otlp.posts),
                  otlp_during, stats, missing_why, gate_after, waiting)
