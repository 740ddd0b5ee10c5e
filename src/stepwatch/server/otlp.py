"""OTLP export while the run trains (``--otlp-endpoint URL``; docs/metrics.md), with the official
OpenTelemetry SDK and its OTLP/HTTP protobuf exporters: metrics to ``URL/v1/metrics``, spans to
``URL/v1/traces``.

Metrics: the figures ``/metrics`` shows (``FeedState``), as observable instruments the SDK's
periodic reader collects every ``interval_s`` (``STEPWATCH_OTLP_INTERVAL_S``, default 5 s) and
once more at shutdown. Each point carries ``stepwatch.session``, ``stepwatch.rank`` and
``host.name``.

Spans: the ranks' own spans, as the aggregator accepts them (``Aggregator.span_tap`` hands over
each frame's span rows: one deque append a frame on the loop, all the work on this module's
thread). One trace a session (its id derived from the session id); each rank's
``stepwatch.session`` span is a root, its epochs under it, steps under the epochs, phases
(``data_load``, ``forward``, ``backward``, ``optimizer_step``, ...) and scopes under the steps, as
the ranks recorded them; every span of a rank has a resource of its own with ``stepwatch.rank``,
``host.name`` and ``stepwatch.session``. Span ids are derived from stepwatch's (a hash), so a
child sent before its parent still names it.

Sampling, so a million-step run does not flood a collector: every ``step`` span is exported
(with its phase times as attributes), and so is every span outside steps (sessions, epochs);
the spans inside a step (its phases and scopes) are exported only for the first
``full_first`` steps (``STEPWATCH_OTLP_FULL_FIRST``, default 10) and every ``full_every``-th step
after (``STEPWATCH_OTLP_FULL_EVERY``, default 100: steps 0-9, 100, 200, ...). A phase closes
before its step, so a span whose parent has not come yet waits for it, up to ``hold_s`` (10 s);
past that it is exported (a step longer than that has its phases whole).

Bounds: at most ``max_frames`` frames wait for the thread and ``max_held`` spans for their
parent; past either, spans are dropped and counted (``spans_dropped``). A collector that is slow
or gone costs the exporter's timeout (``timeout_s``) on this thread, never intake; a failed
export is counted (``export_failures``) with its spans dropped.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from typing import Any

import msgspec

from ..errors import StepwatchError
from .feed_state import FeedState
from .metrics import memory_series

__all__ = ["OtlpExporter", "SpanSampler"]

log = logging.getLogger("stepwatch.aggregator")
INTERVAL_ENV = "STEPWATCH_OTLP_INTERVAL_S"
FULL_FIRST_ENV = "STEPWATCH_OTLP_FULL_FIRST"
FULL_EVERY_ENV = "STEPWATCH_OTLP_FULL_EVERY"
# the spans table's columns (store rows as tuples)
_SESSION, _RANK, _ID, _PARENT, _NAME, _IDX, _START, _END, _GPU, _THREAD, _PID, _ATTRS = range(12)
_json = msgspec.json.Decoder()


def _env(name: str, default: float) -> float:
    text = os.environ.get(name)
    try:
        value = float(text) if text else default
    except ValueError:
        log.warning("%s=%r is not a number: %s is used", name, text, default)
        return default
    return value if value > 0 else default


def _id64(text: str) -> int:
    """A stepwatch span id as an OTLP span id (8 bytes, never 0)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") or 1


def trace_id_of(session_id: str) -> int:
    """A session's OTLP trace id (16 bytes, never 0)."""
    return int.from_bytes(hashlib.blake2b(session_id.encode(), digest_size=16).digest(), "big") or 1


class SpanSampler:
    """Which spans go out: the rule of the module's doc. ``decide`` takes one span row and
    returns the rows to export now (it and any children that waited for it)."""

    def __init__(self, full_first: int = 10, full_every: int = 100, hold_s: float = 10.0, max_held: int = 50_000,
                 max_known: int = 200_000, clock: Any = time.monotonic) -> None:
        self.full_first = full_first
        self.full_every = max(1, full_every)
        self.hold_s = hold_s
        self.max_held = max_held
        self.max_known = max_known
        self.clock = clock
        self._known: OrderedDict[tuple[str, str], bool] = OrderedDict()  # (session, span) -> its children go out
        self._held: OrderedDict[tuple[str, str], list[tuple[float, tuple[Any, ...]]]] = OrderedDict()
        self.held = 0
        self.dropped = 0
        self.duplicates = 0
        self.sampled_out = 0

    def full(self, step: int) -> bool:
        return step < self.full_first or step % self.full_every == 0

    def decide(self, row: tuple[Any, ...], inherited: bool | None = None) -> list[tuple[Any, ...]]:
        """``inherited``: its parent's decision, when the caller knows it (a span that waited too long)."""
        session, span_id, parent, name = row[_SESSION], row[_ID], row[_PARENT], row[_NAME]
        if (session, span_id) in self._known:  # a row sent twice (a sender's retry): it went out once
            self.duplicates += 1
            return []
        if name == "step":
            out, children = True, self.full(row[_IDX]) if type(row[_IDX]) is int else True
        elif parent is None:
            out = children = True
        else:
            if inherited is None:
                inherited = self._known.get((session, parent))
            if inherited is None:  # its parent (its step, most often) has not come yet
                if self.held >= self.max_held:
                    self.dropped += 1
                    return []
                self._held.setdefault((session, parent), []).append((self.clock(), row))
                self.held += 1
                return []
            out = children = inherited
        if isinstance(span_id, str):
            self._remember((session, span_id), children)
        found = [row] if out else []
        if not out:
            self.sampled_out += 1
        waiting = self._held.pop((session, span_id), None) if isinstance(span_id, str) else None
        for _, child in waiting or ():
            self.held -= 1
            found.extend(self.decide(child))
        return found

    def _remember(self, key: tuple[str, str], children: bool) -> None:
        self._known[key] = children
        if len(self._known) > self.max_known:
            self._known.popitem(last=False)

    def expired(self, everything: bool = False) -> list[tuple[Any, ...]]:
        """Spans that waited ``hold_s`` for their parent (all of them with ``everything``): out, whole."""
        now = self.clock()
        found: list[tuple[Any, ...]] = []
        for key in list(self._held):
            rows = self._held[key]
            if not everything and now - rows[0][0] < self.hold_s:
                continue
            del self._held[key]
            self.held -= len(rows)
            for _, row in rows:  # the parent is not marked seen: when it comes, it goes out too
                found.extend(self.decide(row, True))
        return found


class OtlpExporter:
    """Example::

        exporter = OtlpExporter("http://collector:4318", FeedState(run_dir, aggregator), aggregator)
        aggregator.span_tap = exporter.take_spans
        ...
        exporter.close()   # the last spans and a last collection of the metrics
    """

    def __init__(self, endpoint: str, state: FeedState, aggregator: Any, *, interval_s: float | None = None,
                 full_first: int | None = None, full_every: int | None = None, max_frames: int = 10_000,
                 timeout_s: float = 5.0, batch: int = 512) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.metrics import MeterProvider
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        except ImportError:
            raise StepwatchError("--otlp-endpoint needs the OpenTelemetry SDK: pip install 'stepwatch[otlp]'") from None
        from .. import __version__

        base = endpoint.rstrip("/")
        self.endpoint = base
        self.state = state
        self.aggregator = aggregator
        self.interval_s = interval_s or _env(INTERVAL_ENV, 5.0)
        self.sampler = SpanSampler(int(full_first or _env(FULL_FIRST_ENV, 10)),
                                   int(full_every or _env(FULL_EVERY_ENV, 100)))
        self.max_frames = max_frames
        self.batch = batch
        self._frames: deque[tuple[str, int, Any, list[tuple[Any, ...]]]] = deque()
        self._resources: OrderedDict[tuple[str, int, str], Any] = OrderedDict()
        self._Resource = Resource
        self._scope = InstrumentationScope("stepwatch", __version__)
        self._span_exporter = OTLPSpanExporter(endpoint=f"{base}/v1/traces", timeout=timeout_s)
        self._reader = PeriodicExportingMetricReader(
            OTLPMetricExporter(endpoint=f"{base}/v1/metrics", timeout=timeout_s),
            export_interval_millis=self.interval_s * 1000, export_timeout_millis=timeout_s * 1000)
        self._meters = MeterProvider(resource=Resource.create({"service.name": "stepwatch",
                                                               "service.version": __version__}),
                                     metric_readers=[self._reader])
        self._instruments(self._meters.get_meter("stepwatch", __version__))
        self.frames_taken = 0
        self.spans_exported = 0
        self.spans_dropped = 0
        self.export_failures = 0
        self.exports = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stepwatch-otlp", daemon=True)
        self._thread.start()

    # -- spans ------------------------------------------------------------------------------------

    def take_spans(self, session: str, rank: int, host: Any, rows: list[tuple[Any, ...]]) -> None:
        """The aggregator's tap, on its loop: queue the frame's rows, nothing more. A copy of the
        list (of the same tuples): the aggregator extends its own with the next frames' rows."""
        if len(self._frames) >= self.max_frames:
            self.spans_dropped += len(rows)
            return
        self._frames.append((session, rank, host, rows[:]))
        self.frames_taken += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._export_spans()
        self._export_spans(final=True)

    def _export_spans(self, final: bool = False) -> None:
        ready: list[Any] = []
        hosts: dict[tuple[str, int], str] = {}
        while self._frames:
            session, rank, host, rows = self._frames.popleft()
            hosts[(session, rank)] = str(host or "")
            for row in rows:
                ready.extend(self.sampler.decide(row))
        ready.extend(self.sampler.expired(everything=final))
        if self.sampler.dropped:
            self.spans_dropped += self.sampler.dropped
            self.sampler.dropped = 0
        rank_hosts = self.aggregator.rank_hosts
        spans = [self._span(row, hosts.get((row[_SESSION], row[_RANK]))
                            or rank_hosts.get((row[_SESSION], row[_RANK]), "")) for row in ready]
        for first in range(0, len(spans), self.batch):
            self._send(spans[first:first + self.batch])

    def _send(self, spans: list[Any]) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        try:
            result = self._span_exporter.export(spans)
        except Exception as exc:  # noqa: BLE001 - a collector's failure is a counted drop
            result = None
            log.debug("OTLP span export failed: %s", exc)
        self.exports += 1
        if result == SpanExportResult.SUCCESS:
            self.spans_exported += len(spans)
            return
        self.spans_dropped += len(spans)
        self.export_failures += 1
        if self.export_failures == 1:
            log.warning("OTLP: exporting spans to %s/v1/traces failed (later failures are counted)", self.endpoint)

    def _resource(self, session: str, rank: int, host: str) -> Any:
        key = (session, rank, host)
        found = self._resources.get(key)
        if found is None:
            found = self._resources[key] = self._Resource.create({
                "service.name": "stepwatch", "stepwatch.session": session, "stepwatch.rank": rank, "host.name": host})
            if len(self._resources) > 4096:
                self._resources.popitem(last=False)
        return found

    def _span(self, row: tuple[Any, ...], host: str) -> Any:
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.trace import SpanContext, TraceFlags

        session = row[_SESSION]
        trace_id = trace_id_of(session)
        flags = TraceFlags(TraceFlags.SAMPLED)
        context = SpanContext(trace_id, _id64(f"{session}/{row[_ID]}"), is_remote=False, trace_flags=flags)
        parent = (SpanContext(trace_id, _id64(f"{session}/{row[_PARENT]}"), is_remote=False, trace_flags=flags)
                  if row[_PARENT] else None)
        attributes: dict[str, Any] = {"stepwatch.span_id": str(row[_ID])}
        if type(row[_IDX]) is int:
            attributes["stepwatch.step" if row[_NAME] == "step" else "stepwatch.index"] = row[_IDX]
        if type(row[_GPU]) is int:
            attributes["stepwatch.gpu_ns"] = row[_GPU]
        if type(row[_THREAD]) is int:
            attributes["thread.id"] = row[_THREAD]
        if isinstance(row[_ATTRS], str) and row[_ATTRS] not in ("", "{}"):
            try:
                extra = _json.decode(row[_ATTRS])
            except (msgspec.DecodeError, RecursionError):
                extra = None
            if isinstance(extra, dict):
                for key, value in extra.items():
                    if isinstance(value, (bool, int, float, str)):
                        attributes[f"stepwatch.{key}"] = value
        start = row[_START] if type(row[_START]) is int else None
        end = row[_END] if type(row[_END]) is int else start
        return ReadableSpan(name=str(row[_NAME]), context=context, parent=parent,
                            resource=self._resource(session, row[_RANK], host), attributes=attributes,
                            start_time=start, end_time=end, instrumentation_scope=self._scope)

    # -- metrics ----------------------------------------------------------------------------------

    def _instruments(self, meter: Any) -> None:
        from opentelemetry.metrics import Observation

        def per_rank(pick: Any) -> Any:
            def callback(options: Any) -> list[Any]:
                found = []
                for session in self.state.sessions():
                    for rank in session.ranks:
                        base = {"stepwatch.session": session.session_id, "stepwatch.rank": rank.rank,
                                "host.name": rank.host}
                        for value, extra in pick(rank):
                            if value is not None:
                                found.append(Observation(value, {**base, **extra}))
                return found
            return callback

        gauges = (
            ("stepwatch.step_time", "s", "Step time over the rank's last 100 steps, by quantile",
             lambda r: [(v, {"quantile": q}) for q, v in sorted(r.step_time_quantiles.items())]),
            ("stepwatch.steps_per_second", "{step}/s", "Steps per second over the rank's last 100 steps",
             lambda r: [(r.steps_per_s, {})]),
            ("stepwatch.steps", "{step}", "Steps the rank has completed", lambda r: [(r.step, {})]),
            ("stepwatch.phase_share", "1", "Share of the step time each phase took over the last 100 steps",
             lambda r: [(v, {"phase": p}) for p, v in sorted(r.phase_shares.items())]),
            ("stepwatch.loss", "1", "The rank's last loss", lambda r: [(r.loss, {})]),
            ("stepwatch.memory", "By", "The rank's latest memory sample, by device",
             lambda r: [(latest, {"device": device, "kind": "rss" if device == "rss" else "device"})
                        for device, (latest, _) in memory_series(r)]),
            ("stepwatch.heartbeat_age", "s", "Seconds since the rank's last sign of life",
             lambda r: [(r.heartbeat_age_s, {})]),
        )
        for name, unit, description, pick in gauges:
            meter.create_observable_gauge(name, callbacks=[per_rank(pick)], unit=unit, description=description)

        def alerts(options: Any) -> list[Any]:
            return [Observation(count, {"stepwatch.session": s.session_id, "kind": kind})
                    for s in self.state.sessions() for kind, count in sorted(s.alerts.items())]

        def verdicts(options: Any) -> list[Any]:
            return [Observation(1, {"stepwatch.session": s.session_id, "name": str(s.verdict.get("name")),
                                    "severity": str(s.verdict.get("severity"))})
                    for s in self.state.sessions() if s.verdict]

        def aggregator(options: Any) -> list[Any]:
            return [Observation(self.aggregator.pending_rows)]

        def lost(options: Any) -> list[Any]:
            return [Observation(self.aggregator.lost_rows())]

        meter.create_observable_counter("stepwatch.alerts", callbacks=[alerts], unit="{alert}",
                                        description="Alerts raised since the aggregator started, by kind")
        meter.create_observable_gauge("stepwatch.verdict", callbacks=[verdicts], unit="1",
                                      description="1 for the session's current primary verdict")
        meter.create_observable_gauge("stepwatch.aggregator.pending_rows", callbacks=[aggregator], unit="{row}",
                                      description="Rows waiting for the writer (queue depth)")
        meter.create_observable_counter("stepwatch.aggregator.rows_lost", callbacks=[lost], unit="{row}",
                                        description="Rows accepted whose write failed")

    # -- the end ----------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "frames_taken": self.frames_taken, "spans_exported": self.spans_exported,
                "spans_sampled_out": self.sampler.sampled_out, "spans_dropped": self.spans_dropped,
                "spans_waiting": self.sampler.held, "spans_duplicate": self.sampler.duplicates, "exports": self.exports, "export_failures": self.export_failures,
                "full_first": self.sampler.full_first, "full_every": self.sampler.full_every,
                "interval_s": self.interval_s}

    def close(self, timeout: float = 15.0) -> None:
        """The spans still queued or waiting, then a last collection of the metrics."""
        self._stop.set()
        self._thread.join(timeout)
        try:
            self._meters.shutdown(timeout_millis=timeout * 1000)
        finally:
            self._span_exporter.shutdown()
