"""Alert webhooks (``--alert-webhook URL`` on ``run``, ``serve`` and ``watch``; docs/metrics.md).

Each alert and each change of a session's primary verdict is POSTed as one JSON object whose
``text`` is the line ``stepwatch run`` prints (the field Slack and Mattermost incoming webhooks
show), with the structured record beside it::

    {"text": "[stepwatch] ALERT STALL (critical) rank 1 ...", "event": "alert",
     "alert": {...alerts.jsonl's record...}, "session_id": "...", "host": "...", "source": "stepwatch"}

Never blocking the caller: ``send`` only queues (at most ``max_queue`` posts wait; past that a
post is dropped and counted). One thread posts them in order, each with ``attempts`` tries: a
connection error, a timeout, a 429 or a 5xx is tried again after ``backoff_s``, doubled each
time (capped at ``max_backoff_s``); any other 4xx is final (the URL or payload is wrong, a retry
cannot help). A post that fails all its tries is counted ``failed``. A receiver that never
answers costs ``timeout_s`` a try on that thread, never the aggregator's loop; its posts pile up
in the queue, and past ``max_queue`` are dropped (counted). The counters go to
``aggregator_stats.json`` (``feeds.webhook``) and ``/metrics``.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any

__all__ = ["WebhookSender", "alert_payload", "verdict_payload"]

log = logging.getLogger("stepwatch.aggregator")


def alert_payload(alert: dict[str, Any], line: str | None = None) -> dict[str, Any]:
    """The JSON posted for one alert (``Alert.to_dict()``'s record)."""
    text = line or f"[stepwatch] ALERT {alert.get('kind')} ({alert.get('severity')}) {alert.get('message')}"
    return {"text": text, "event": "alert", "alert": alert, "session_id": alert.get("session_id"),
            "host": socket.gethostname(), "source": "stepwatch"}


def verdict_payload(message: dict[str, Any]) -> dict[str, Any]:
    """The JSON posted for a verdict change (the aggregator's ``verdict`` event)."""
    return {"text": message.get("line") or "", "event": "verdict", "verdict": message.get("verdict"),
            "session_id": message.get("session_id"), "step": message.get("step"), "host": socket.gethostname(),
            "source": "stepwatch"}


class WebhookSender:
    """Example::

        sender = WebhookSender("https://hooks.slack.com/services/...")
        sender.send(alert_payload(alert.to_dict(), alert.line()))
        sender.close()   # waits up to its timeout for the posts still queued
    """

    def __init__(self, url: str, *, max_queue: int = 1000, attempts: int = 5, backoff_s: float = 0.5,
                 max_backoff_s: float = 30.0, timeout_s: float = 5.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{url!r} is not an http(s) URL")
        self.url = url
        self.attempts = max(1, attempts)
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.timeout_s = timeout_s
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(max_queue)
        self._stop = threading.Event()
        self.queued = 0
        self.sent = 0
        self.retries = 0
        self.failed = 0
        self.dropped = 0
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="stepwatch-webhook", daemon=True)
        self._thread.start()

    def send(self, payload: dict[str, Any]) -> bool:
        """Queues one post; False (and counted as dropped) when ``max_queue`` wait already."""
        if self._stop.is_set():
            self.dropped += 1
            return False
        try:
            self._queue.put_nowait(payload)
        except queue.Full:
            self.dropped += 1
            return False
        self.queued += 1
        return True

    def note_event(self, message: dict[str, Any]) -> None:
        """The aggregator's ``emit`` events: alerts and verdict changes are posted."""
        event = message.get("event")
        if event == "alert" and isinstance(message.get("alert"), dict):
            self.send(alert_payload(message["alert"], message.get("line")))
        elif event == "verdict":
            self.send(verdict_payload(message))

    def _run(self) -> None:
        while (payload := self._queue.get()) is not None:
            self._post(payload)

    def _post(self, payload: dict[str, Any]) -> None:
        body = json.dumps(payload, default=str).encode()
        delay = self.backoff_s
        for attempt in range(self.attempts):
            if attempt:
                self.retries += 1
                if self._stop.wait(delay):  # closing: no more waiting between tries
                    break
                delay = min(delay * 2, self.max_backoff_s)
            request = urllib.request.Request(self.url, data=body, method="POST",
                                             headers={"Content-Type": "application/json",
                                                      "User-Agent": "stepwatch-webhook"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                    answer.read()
                self.sent += 1
                return
            except urllib.error.HTTPError as exc:
                self.last_error = f"HTTP {exc.code}"
                if exc.code < 500 and exc.code != 429:
                    break  # the receiver refuses this post: trying again cannot help
            except (OSError, ValueError) as exc:  # refused, reset, timed out, a bad URL
                self.last_error = f"{type(exc).__name__}: {exc}"
        self.failed += 1
        if self.failed == 1:
            log.warning("alert webhook: a post to %s failed after its tries (%s); later failures are counted",
                        self.url, self.last_error)

    def stats(self) -> dict[str, Any]:
        return {"url": self.url, "queued": self.queued, "sent": self.sent, "retries": self.retries,
                "failed": self.failed, "dropped": self.dropped, "waiting": self._queue.qsize(),
                "last_error": self.last_error}

    def close(self, timeout: float = 10.0) -> bool:
        """Lets the queued posts go for up to ``timeout`` seconds, then stops (what still waits is
        counted dropped). True when everything queued was dealt with."""
        deadline = time.monotonic() + timeout
        try:
            self._queue.put(None, timeout=max(0.0, timeout))
        except queue.Full:
            pass
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self._stop.set()
        finished = not self._thread.is_alive()
        if not finished:
            while True:  # empty it (each post left counted dropped), so the thread ends after the one it is on
                try:
                    if self._queue.get_nowait() is not None:
                        self.dropped += 1
                except queue.Empty:
                    break
            try:
                self._queue.put_nowait(None)
            except queue.Full:
                pass
        return finished
