"""The aggregator's feeds, started by ``serve`` when their options are given (docs/metrics.md):
Prometheus ``/metrics`` (``--metrics-port``), alert webhooks (``--alert-webhook``) and OTLP
(``--otlp-endpoint``). Each lives on threads of its own and only reads: the aggregator hands
them its events (``tap``, wrapped around its ``emit``) and, for OTLP, each frame's span rows
(``Aggregator.span_tap``, one call a frame); the figures are read at scrape or export time. A
feed that cannot start is an error before the aggregator listens; one that fails later costs
counted drops, never intake.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import StepwatchError

__all__ = ["FeedOptions", "Feeds", "feed_options_from"]

log = logging.getLogger("stepwatch.aggregator")
SESSIONS_ENV = "STEPWATCH_METRICS_SESSIONS"
FINISHED_TTL_ENV = "STEPWATCH_METRICS_FINISHED_TTL_S"


class FeedOptions:
    """What to feed: ``metrics_port`` (None: no /metrics), ``alert_webhook`` and ``otlp_endpoint``
    (URLs or None)."""

    def __init__(self, metrics_port: int | None = None, alert_webhook: str | None = None,
                 otlp_endpoint: str | None = None, metrics_host: str | None = None) -> None:
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host  # None: the aggregator's host, by serve.http_bind's rule
        self.alert_webhook = alert_webhook
        self.otlp_endpoint = otlp_endpoint

    def __bool__(self) -> bool:
        return self.metrics_port is not None or bool(self.alert_webhook) or bool(self.otlp_endpoint)


def feed_options_from(values: dict[str, Any] | None) -> FeedOptions:
    values = values or {}
    return FeedOptions(values.get("metrics_port"), values.get("alert_webhook"), values.get("otlp_endpoint"),
                       values.get("metrics_host"))


def _env_number(name: str, default: float) -> float:
    text = os.environ.get(name)
    try:
        return float(text) if text else default
    except ValueError:
        log.warning("%s=%r is not a number: %s is used", name, text, default)
        return default


class Feeds:
    """Started with the aggregator, closed after its last flush (the last alerts are posted)."""

    def __init__(self, options: FeedOptions, run_dir: Path, aggregator: Any, host: str, token: str | None) -> None:
        self.options = options
        self.state: Any = None
        self.metrics: Any = None
        self.webhook: Any = None
        self.otlp: Any = None
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        try:
            if options.metrics_port is not None or options.otlp_endpoint:
                from .feed_state import DEFAULT_FINISHED_TTL_S, DEFAULT_MAX_SESSIONS, FeedState

                self.state = FeedState(run_dir, aggregator,
                                       max_sessions=int(_env_number(SESSIONS_ENV, DEFAULT_MAX_SESSIONS)),
                                       finished_ttl_s=_env_number(FINISHED_TTL_ENV, DEFAULT_FINISHED_TTL_S))
                self._listeners.append(self.state.note_event)
            if options.alert_webhook:
                from .webhooks import WebhookSender

                try:
                    self.webhook = WebhookSender(options.alert_webhook)
                except ValueError as exc:
                    raise StepwatchError(f"--alert-webhook: {exc}") from None
                self._listeners.append(self.webhook.note_event)
            if options.otlp_endpoint:
                from .otlp import OtlpExporter

                self.otlp = OtlpExporter(options.otlp_endpoint, self.state, aggregator)
                aggregator.span_tap = self.otlp.take_spans
            if options.metrics_port is not None:
                from .metrics import start_metrics

                self.metrics, _ = start_metrics(self.state, aggregator, host, options.metrics_port, token,
                                                extra=self._counters, bind=options.metrics_host)
        except BaseException:
            self.close()
            raise

    @property
    def metrics_url(self) -> str | None:
        return self.metrics.url if self.metrics is not None else None

    def tap(self, emit: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
        """``emit`` that also hands each event to the feeds (never raising into the caller)."""
        listeners = self._listeners
        if not listeners:
            return emit

        def tapped(message: dict[str, Any]) -> None:
            emit(message)
            for listener in listeners:
                try:
                    listener(message)
                except Exception as exc:  # noqa: BLE001 - a feed never fails the aggregator
                    log.debug("a feed failed on an event: %s", exc)

        return tapped

    def _counters(self) -> dict[str, tuple[str, str, float]]:
        """The feeds' own counters on /metrics."""
        found: dict[str, tuple[str, str, float]] = {}
        if self.webhook is not None:
            stats = self.webhook.stats()
            found["stepwatch_webhook_sent"] = ("counter", "Alert webhook posts delivered", stats["sent"])
            found["stepwatch_webhook_failed"] = ("counter", "Alert webhook posts that failed every try",
                                                 stats["failed"])
            found["stepwatch_webhook_dropped"] = ("counter", "Alert webhook posts dropped (queue full)",
                                                  stats["dropped"])
        if self.otlp is not None:
            stats = self.otlp.stats()
            found["stepwatch_otlp_spans_exported"] = ("counter", "Spans exported over OTLP", stats["spans_exported"])
            found["stepwatch_otlp_spans_dropped"] = ("counter", "Spans dropped (queue full, failed export)",
                                                     stats["spans_dropped"])
        return found

    def stats(self) -> dict[str, Any]:
        found: dict[str, Any] = {}
        if self.metrics is not None:
            found["metrics"] = {"url": self.metrics.url}
        if self.state is not None:
            found.setdefault("metrics", {}).update({"expired_sessions": self.state.expired_sessions,
                                                    "read_errors": self.state.read_errors})
        if self.webhook is not None:
            found["webhook"] = self.webhook.stats()
        if self.otlp is not None:
            found["otlp"] = self.otlp.stats()
        return found

    def close(self) -> None:
        """The last spans and metrics exported, the queued posts sent (each bounded in time)."""
        for part, closing in ((self.otlp, "close"), (self.webhook, "close"), (self.metrics, "close"),
                              (self.state, "close")):
            if part is None:
                continue
            try:
                getattr(part, closing)()
            except Exception as exc:  # noqa: BLE001 - closing a feed never fails the aggregator's end
                log.warning("closing a feed failed: %s: %s", type(exc).__name__, exc)
