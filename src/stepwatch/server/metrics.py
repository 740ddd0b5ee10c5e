"""Prometheus ``/metrics`` on the aggregator (``--metrics-port``; docs/metrics.md).

A custom collector (``StepwatchCollector``) builds the exposition at scrape time from
``FeedState`` (the live view's figures of the kept sessions) and the aggregator's counters:
nothing is updated per row on the ingest path, so a scraper costs the ranks nothing and a slow
or dead one costs nothing at all. The HTTP server is a thread of its own (``http.server``), not
the aggregator's event loop: a scrape reads files and SQLite, which must not stall intake.

Security, as the dashboard's: it binds ``--metrics-host`` when given (beyond loopback only with a
token), else the aggregator's host when that is loopback or a token is set, else 127.0.0.1; with a
token every request must carry ``Authorization: Bearer TOKEN`` (compared in constant time).

``prometheus_client`` is imported here only, and this module only when ``--metrics-port`` is
given (the ``metrics`` extra).
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ..errors import StepwatchError
from .feed_state import FeedState

__all__ = ["MetricsServer", "StepwatchCollector", "start_metrics"]

_LABELS = ("session", "rank", "host")


class StepwatchCollector:
    """``prometheus_client`` collector: ``collect()`` yields the metric families now."""

    def __init__(self, state: FeedState, aggregator: Any, extra: Any = None) -> None:
        self.state = state
        self.aggregator = aggregator
        self.extra = extra or (lambda: {})  # more counters (the webhooks', the OTLP exporter's)
        self.scrapes = 0

    def describe(self) -> list[Any]:
        return []  # no describe at registration: collect() would run there, before the aggregator has a session

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        self.scrapes += 1
        step_time = GaugeMetricFamily("stepwatch_step_time_seconds",
                                      "Step time over the rank's last 100 steps, by quantile",
                                      labels=[*_LABELS, "quantile"])
        rate = GaugeMetricFamily("stepwatch_steps_per_second", "Steps per second over the rank's last 100 steps",
                                 labels=_LABELS)
        steps = GaugeMetricFamily("stepwatch_steps", "Steps the rank has completed", labels=_LABELS)
        shares = GaugeMetricFamily("stepwatch_phase_share_ratio",
                                   "Share of the step time each phase took over the last 100 steps (wait: the rest)",
                                   labels=[*_LABELS, "phase"])
        loss = GaugeMetricFamily("stepwatch_loss", "The rank's last loss (inferred, or the one the program marks)",
                                 labels=_LABELS)
        memory = GaugeMetricFamily("stepwatch_memory_bytes", "The rank's latest memory sample, by device",
                                   labels=[*_LABELS, "device", "kind"])
        peak = GaugeMetricFamily("stepwatch_memory_peak_bytes", "The rank's highest memory sample, by device",
                                 labels=[*_LABELS, "device", "kind"])
        age = GaugeMetricFamily("stepwatch_heartbeat_age_seconds", "Seconds since the rank's last sign of life",
                                labels=_LABELS)
        up = GaugeMetricFamily("stepwatch_rank_running", "1 while the rank runs, 0 once stopped, silent or lost",
                               labels=[*_LABELS, "state"])
        alerts = CounterMetricFamily("stepwatch_alerts", "Alerts raised since the aggregator started, by kind",
                                     labels=["session", "kind"])
        verdict = InfoMetricFamily("stepwatch_verdict", "The session's current primary verdict",
                                   labels=["session"])
        for session in self.state.sessions():
            sid = session.session_id
            for r in session.ranks:
                labels = [sid, str(r.rank), r.host]
                for q, value in sorted(r.step_time_quantiles.items()):
                    step_time.add_metric([*labels, f"{q:g}"], value)
                if r.steps_per_s is not None:
                    rate.add_metric(labels, r.steps_per_s)
                if r.step is not None:
                    steps.add_metric(labels, r.step)
                for phase, share in sorted(r.phase_shares.items()):
                    shares.add_metric([*labels, phase], share)
                if r.loss is not None:
                    loss.add_metric(labels, r.loss)
                for device, (latest, highest) in memory_series(r):
                    kind = "rss" if device == "rss" else "device"
                    memory.add_metric([*labels, device, kind], latest)
                    peak.add_metric([*labels, device, kind], highest)
                if r.heartbeat_age_s is not None:
                    age.add_metric(labels, r.heartbeat_age_s)
                up.add_metric([*labels, r.state], 1.0 if r.state == "running" else 0.0)
            for kind, count in sorted(session.alerts.items()):
                alerts.add_metric([sid, kind], count)
            if session.verdict:
                v = session.verdict
                verdict.add_metric([sid], {"name": str(v.get("name") or ""), "severity": str(v.get("severity") or ""),
                                           "ranks": ",".join(str(x) for x in v.get("ranks") or ())})
        yield from (step_time, rate, steps, shares, loss, memory, peak, age, up, alerts, verdict)
        yield from self._aggregator_families()

    def _aggregator_families(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        agg = self.aggregator
        rejected = CounterMetricFamily("stepwatch_aggregator_frames_rejected", "Frames refused, by reason",
                                       labels=["reason"])
        for reason, count in sorted(dict(agg.rejected).items()):
            rejected.add_metric([reason], count)
        yield rejected
        yield CounterMetricFamily("stepwatch_aggregator_rows_accepted", "Rows accepted", value=agg.rows_accepted)
        yield CounterMetricFamily("stepwatch_aggregator_rows_written", "Rows written to the history",
                                  value=agg.written_rows())
        yield CounterMetricFamily("stepwatch_aggregator_rows_lost", "Rows accepted whose write failed",
                                  value=agg.lost_rows())
        if agg.feed is not None:  # a remote store (docs/clickhouse.md): its spill queue
            store = agg.feed.stats()
            yield GaugeMetricFamily("stepwatch_store_degraded", "1 while the history store is down or slow",
                                    value=int(store["store_degraded"]))
            yield GaugeMetricFamily("stepwatch_store_spill_pending_rows", "Rows waiting in the spill queue",
                                    value=store["store_spill_pending_rows"])
            yield CounterMetricFamily("stepwatch_store_spilled_rows", "Rows spilled to the local queue",
                                      value=store["store_spilled_rows"])
            yield CounterMetricFamily("stepwatch_store_replayed_rows", "Spilled rows the store took later",
                                      value=store["store_replayed_rows"])
        yield GaugeMetricFamily("stepwatch_aggregator_pending_rows", "Rows waiting for the writer (queue depth)",
                                value=agg.pending_rows)
        yield GaugeMetricFamily("stepwatch_aggregator_ranks", "Ranks seen", value=len(agg.ranks))
        yield CounterMetricFamily("stepwatch_metrics_sessions_expired",
                                  "Finished sessions no longer reported (docs/metrics.md)",
                                  value=self.state.expired_sessions)
        for name, (kind, help_text, value) in sorted(self.extra().items()):
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name, help_text, value=value)


def memory_series(rank: Any) -> list[tuple[str, tuple[int, int]]]:
    """(device, (latest, peak)) of a rank: each device's where the samples were read per device,
    else the live view's one figure (device ``all``)."""
    if rank.memory_devices:
        return sorted(rank.memory_devices.items())
    if rank.memory_bytes is None:
        return []
    return [("all", (rank.memory_bytes, rank.memory_peak_bytes or rank.memory_bytes))]


class MetricsServer:
    """The exposition over HTTP on a thread: ``GET /metrics`` (and ``/``)."""

    def __init__(self, registry: Any, host: str, port: int, token: str | None) -> None:
        from prometheus_client import exposition

        encoder = exposition.generate_latest
        expected = token.encode() if token else None

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if expected is not None:
                    scheme, _, given = self.headers.get("Authorization", "").partition(" ")
                    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
                        self._answer(401, b"missing or wrong bearer token\n", "text/plain",
                                     {"WWW-Authenticate": 'Bearer realm="stepwatch"'})
                        return
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self._answer(404, b"not found: /metrics\n", "text/plain")
                    return
                try:
                    body = encoder(registry)
                except Exception as exc:  # noqa: BLE001 - a failed scrape is a 500, never a dead server
                    self._answer(500, f"{type(exc).__name__}: {exc}\n".encode(), "text/plain")
                    return
                self._answer(200, body, exposition.CONTENT_TYPE_LATEST)

            def _answer(self, status: int, body: bytes, kind: str, headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
                pass

        try:
            self.httpd = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise StepwatchError(f"cannot listen for /metrics on {host}:{port}: {exc.strerror or exc}") from None
        self.httpd.daemon_threads = True
        self.host = host
        self.port = int(self.httpd.server_address[1])
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="stepwatch-metrics", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{shown}:{self.port}/metrics"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def start_metrics(state: FeedState, aggregator: Any, host: str, port: int, token: str | None,
                  extra: Any = None, bind: str | None = None) -> tuple[MetricsServer, StepwatchCollector]:
    """The collector in a registry of its own, served on ``port`` of ``bind`` or ``host`` (see the
    module's doc for which); raises StepwatchError when it cannot listen, for a ``bind`` beyond
    loopback with no token, or when ``prometheus_client`` is missing (the ``metrics`` extra)."""
    try:
        from prometheus_client import CollectorRegistry
    except ImportError:
        raise StepwatchError("--metrics-port needs prometheus_client: pip install 'stepwatch[metrics]'") from None
    from .binds import http_bind

    address = http_bind(host, token, bind, "--metrics-host")
    registry = CollectorRegistry(auto_describe=False)
    collector = StepwatchCollector(state, aggregator, extra)
    registry.register(collector)
    return MetricsServer(registry, address, port, token), collector
