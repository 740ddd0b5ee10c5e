"""Uploads sealed spool batches to a trace endpoint: ``POST {endpoint}/v1/traces``.

The wire contract is spool-format-v1.md, "Wire format: POST /v1/traces", as the SDK it replaces
really speaks it (spool-current-practice.md, "Uploads"): the body is the batch file's exact bytes,
gzip-compressed (deterministic, mtime 0) only from 1 KiB up, with ``Authorization: Bearer``,
``Content-Type: application/json``, ``X-Stepwatch-SDK-Version`` and ``X-Stepwatch-Batch-Id``.
The server dedupes by batch id, so a retry is always safe, and every retry is byte-identical.

It avoids that SDK's mistakes ("Its mistakes"): the last batch of a run (the one that holds the
session span) is uploaded by ``close()``, first in line, and a failed batch is never forgotten:
it is re-queued after a cool-down, and what this process could not send stays on disk, listed
by ``pending_on_disk()`` (batch files not in ``<spool>/.uploaded``) for a later process.

Threads: ``submit()`` only appends to a bounded queue under a lock and
returns; one named daemon thread does every HTTP request; ``close(timeout)`` flushes to a
deadline, then stops. Nothing raises into the caller: every loss is counted by reason.
"""

from __future__ import annotations

import email.utils
import gzip
import http.client
import os
import random
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter, deque
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..guard import Site, report_internal

__all__ = ["GZIP_MIN_BYTES", "THREAD_NAME", "UPLOADED_FILE", "HttpExporter", "batch_id_of", "parse_retry_after"]

GZIP_MIN_BYTES = 1024
UPLOADED_FILE = ".uploaded"
THREAD_NAME = "stepwatch-http-exporter"
_BATCH_GLOB = "[0-9]*-*.json"  # <created_ns, 20 digits>-<batch_id>.json, as SpoolWriter names them
_BAD_KEY = frozenset({401, 403})
_RETRYABLE_4XX = frozenset({408, 425, 429})  # timeout, too early, rate-limited: worth sending again
_MAX_RESPONSE_BYTES = 64 * 1024  # read (and discard) at most this much of a response body


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date), >= 0.

    Returns ``None`` when the header is absent or unreadable (the caller backs off instead).
    """
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:  # RFC 9110 dates are GMT; a naive parse means "-0000"
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if seconds != seconds:  # NaN
        return None
    return max(0.0, seconds)


def batch_id_of(path: Path) -> str:
    """The batch id a spool file name carries: ``<created_ns>-<batch_id>.json`` -> ``batch_id``."""
    stem = path.name.removesuffix(".json")
    _, sep, tail = stem.partition("-")
    return tail if sep and tail else stem


def _read_ids(file: Path) -> set[str]:
    try:
        text = file.read_text(encoding="ascii", errors="replace")
    except FileNotFoundError:
        return set()
    return {line.strip() for line in text.splitlines() if line.strip()}


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """urllib would replay a redirected POST as a bodiless GET: surface the 3xx instead."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


class _Batch:
    __slots__ = ("attempts", "batch_id", "counted_failed", "path", "tried_in_close")

    def __init__(self, path: Path, batch_id: str) -> None:
        self.path = path
        self.batch_id = batch_id
        self.attempts = 0  # over its whole life, all rounds
        self.tried_in_close = False
        self.counted_failed = False


class HttpExporter:
    """Uploads spool batch files from one background thread; never blocks nor raises into the caller.

    Example::

        exporter = HttpExporter("https://traces.example.com", api_key, sdk_version="0.1.0",
                                spool_root=run_dir)
        exporter.submit(run_dir / "spool" / "00000001700000000000000-<batch_id>.json")
        exporter.close(2.0)   # uploads what is queued, the run's last batch first, to a deadline

    Delivery of one batch: any 2xx is success (its id is appended to ``<spool>/.uploaded``);
    429 waits ``Retry-After`` (seconds or HTTP date, capped); 5xx, 408 and network errors back
    off exponentially with jitter; after ``max_attempts`` in a round the batch goes to the back
    of the queue and the exporter cools down before the next round. Other 3xx/4xx (400, 413...)
    reject the batch at once; 401/403 also stop the exporter (bad key, warned once on stderr).

    Args:
        endpoint: base URL; batches go to ``{endpoint}/v1/traces``.
        api_key: sent as ``Authorization: Bearer <api_key>``.
        sdk_version: the ``X-Stepwatch-SDK-Version`` header (default: this stepwatch).
        spool_root: the run directory (its ``spool/`` is used) or the spool directory itself.
        max_queue: batches waiting at most; past it the oldest is dropped (and counted).
        max_attempts: requests per batch per round.
        backoff_s: first backoff delay, doubled per consecutive failure (jitter x0.5-1).
        max_backoff_s: cap of a backoff delay and of the cool-down between rounds.
        retry_after_cap_s: cap of a server's ``Retry-After``.
        request_timeout_s: socket timeout of one request (shortened to the close deadline).
        path: the trace route (the current SDK uses ``/api/traces``; the contract ``/v1/traces``).

    Raises:
        ConfigError: empty endpoint or key, a non-http(s) endpoint, or a bad option.
    """

    def __init__(
        self,
        endpoint: str,
        api_key: str,
        *,
        sdk_version: str | None = None,
        spool_root: str | os.PathLike[str],
        max_queue: int = 1024,
        max_attempts: int = 4,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        retry_after_cap_s: float = 60.0,
        request_timeout_s: float = 10.0,
        path: str = "/v1/traces",
    ) -> None:
        if not isinstance(endpoint, str) or not endpoint.strip():
            raise ConfigError("the trace exporter needs an endpoint (got none)")
        if not isinstance(api_key, str) or not api_key:
            raise ConfigError("the trace exporter needs an API key (got none)")
        if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in api_key):
            raise ConfigError("the API key must not contain whitespace or control characters")
        parts = urllib.parse.urlsplit(endpoint.strip())
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"endpoint must be an http(s) URL, got {endpoint!r}")
        if not isinstance(max_queue, int) or max_queue < 1:
            raise ConfigError(f"max_queue must be an integer >= 1, got {max_queue!r}")
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise ConfigError(f"max_attempts must be an integer >= 1, got {max_attempts!r}")
        for name, value in (("backoff_s", backoff_s), ("max_backoff_s", max_backoff_s),
                            ("retry_after_cap_s", retry_after_cap_s)):
            if not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
        if not isinstance(request_timeout_s, (int, float)) or not 0 < request_timeout_s < float("inf"):
            raise ConfigError(f"request_timeout_s must be a finite number > 0, got {request_timeout_s!r}")
        if sdk_version is None:
            from .. import __version__

            sdk_version = __version__

        root = Path(spool_root)
        self.spool_dir = root if root.name == "spool" else root / "spool"
        self.url = endpoint.strip().rstrip("/") + "/" + path.lstrip("/")
        self.sdk_version = str(sdk_version)
        self.max_queue = max_queue
        self.max_attempts = max_attempts
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = max(float(max_backoff_s), float(backoff_s))
        self.retry_after_cap_s = float(retry_after_cap_s)
        self.request_timeout_s = float(request_timeout_s)
        # the same headers, in the same order, on every attempt of every batch (only the id varies)
        self._headers = {
            "Authorization": f"Bearer {api_key}",
            "Content-Type": "application/json",
            "User-Agent": f"stepwatch/{self.sdk_version}",
            "X-Stepwatch-SDK-Version": self.sdk_version,
        }
        # proxies come from the environment (HTTPS_PROXY...), read once here, as urllib does
        self._opener = urllib.request.build_opener(_NoRedirect())

        self.sent = 0
        self.retries = 0
        self.rejected = 0
        self.dropped = 0
        self.failed = 0
        self.skipped = 0  # submitted again, or already in .uploaded: not sent twice
        self.errors = 0  # exceptions of our own, contained
        self.drops: Counter[str] = Counter()  # dropped, by reason
        self.last_error: str | None = None
        self.warned = False

        self._pid = os.getpid()
        self._init_state()
        self._file_lock = threading.Lock()
        self._tail_checked: set[Path] = set()
        try:
            self._uploaded = _read_ids(self.spool_dir / UPLOADED_FILE)
        except OSError:
            self._uploaded = set()

    def _init_state(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue: deque[_Batch] = deque()
        self._queued: set[str] = set()  # ids waiting or in flight
        self._last: _Batch | None = None
        self._inflight: _Batch | None = None
        self._thread: threading.Thread | None = None
        self._closed = False  # no more submits
        self._closing = False  # flushing to self._deadline
        self._deadline = 0.0
        self._stop_now = False
        self._disabled = False
        self._cooldown_until = 0.0
        self._consecutive_failures = 0

    def __repr__(self) -> str:
        return (f"HttpExporter({self.url!r}, sent={self.sent}, retries={self.retries}, rejected={self.rejected}, "
                f"dropped={self.dropped}, failed={self.failed})")

    # -- the caller's side ---------------------------------------------------------------------

    @property
    def disabled(self) -> bool:
        """True once the server refused the key (401/403): nothing more is sent."""
        return self._disabled

    def submit(self, path: str | os.PathLike[str]) -> bool:
        """Queues one sealed batch file for upload and returns at once.

        Returns:
            True if queued; False if not (closed, bad key, already uploaded or queued, or an
            internal error), each counted. A full queue drops its oldest batch instead, so the
            newest, which may hold the session span, always gets in.
        """
        try:
            self._check_fork()
            batch = Path(path)
            entry = _Batch(batch, batch_id_of(batch))
            with self._cond:
                if self._closed:
                    self._drop("closed")
                    return False
                if self._disabled:
                    self._drop("bad_key")
                    return False
                if entry.batch_id in self._uploaded or entry.batch_id in self._queued:
                    self.skipped += 1
                    return False
                if len(self._queue) >= self.max_queue:
                    oldest = self._queue.popleft()  # still on disk: pending_on_disk() lists it
                    self._queued.discard(oldest.batch_id)
                    self._drop("queue_full")
                self._queue.append(entry)
                self._queued.add(entry.batch_id)
                self._last = entry
                self._cond.notify_all()
            self._ensure_worker()
            return True
        except Exception as exc:  # noqa: BLE001 - fail-open
            self._internal(exc)
            return False

    def resume(self) -> int:
        """Queues the batch files left on disk by an earlier process (oldest first, up to the free
        queue room); returns how many were queued. The rest wait for a later call."""
        queued = 0
        try:
            with self._cond:
                room = self.max_queue - len(self._queue)
                waiting = set(self._queued)
            for path in self.pending_on_disk():
                if queued >= room:
                    break
                if batch_id_of(path) not in waiting and self.submit(path):
                    queued += 1
        except Exception as exc:  # noqa: BLE001
            self._internal(exc)
        return queued

    def pending_on_disk(self) -> list[Path]:
        """Batch files in the spool directory not recorded in its ``.uploaded``, oldest first."""
        try:
            with self._cond:
                uploaded = set(self._uploaded)
            uploaded |= _read_ids(self.spool_dir / UPLOADED_FILE)
            return [p for p in sorted(self.spool_dir.glob(_BATCH_GLOB)) if batch_id_of(p) not in uploaded]
        except Exception as exc:  # noqa: BLE001
            self._internal(exc)
            return []

    def counters(self) -> dict[str, Any]:
        """A snapshot: sent, retries, rejected, dropped (and ``drops`` by reason), failed, skipped,
        errors, and ``queued`` (waiting or in flight now)."""
        with self._cond:
            return {
                "sent": self.sent, "retries": self.retries, "rejected": self.rejected,
                "dropped": self.dropped, "failed": self.failed, "skipped": self.skipped,
                "errors": self.errors, "queued": len(self._queue) + (self._inflight is not None),
                "drops": dict(self.drops),
            }

    def close(self, timeout: float = 2.0) -> None:
        """Uploads what is queued until ``timeout`` seconds have passed, the run's last batch
        first, then stops. Batches still queued are counted in ``failed`` (they stay on disk).
        Idempotent; never raises."""
        try:
            self._check_fork()
            deadline = time.monotonic() + max(0.0, float(timeout))
            with self._cond:
                if self._closed:
                    return
                self._closed = True
                self._closing = True
                self._deadline = deadline
                last = self._last
                # the last batch holds the session span: never let a backlog keep it off the wire
                if last is not None and self._queue and self._queue[0] is not last and any(
                        e is last for e in self._queue):
                    self._queue.remove(last)
                    self._queue.appendleft(last)
                self._cond.notify_all()
                thread = self._thread
            if thread is not None and thread.is_alive():
                if thread is not threading.current_thread():
                    thread.join(max(0.0, deadline - time.monotonic()))
            else:
                # no worker (never needed, or Thread.start failed at shutdown): flush right here;
                # a worker starting concurrently is harmless, both take batches under the lock
                self._loop()
            with self._cond:
                self._stop_now = True
                leftover = list(self._queue)
                if self._inflight is not None:
                    leftover.append(self._inflight)
                self._queue.clear()
                for entry in leftover:
                    entry.counted_failed = True
                self.failed += len(leftover)
                self._cond.notify_all()
        except Exception as exc:  # noqa: BLE001
            self._internal(exc)

    # -- the worker's side ---------------------------------------------------------------------

    def _ensure_worker(self) -> None:
        with self._cond:
            current = self._thread
            if self._closed or (current is not None and (current.ident is None or current.is_alive())):
                return
            thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self._thread = thread
        try:
            thread.start()
        except RuntimeError as exc:  # "can't create new thread at interpreter shutdown": close() drains
            with self._cond:
                if self._thread is thread:
                    self._thread = None
                self.last_error = f"worker not started: {exc}"

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # noqa: BLE001 - the worker must end quietly, never with a traceback
            self._internal(exc)

    def _loop(self) -> None:
        while True:
            entry = self._next()
            if entry is None:
                return
            try:
                outcome, delay = self._deliver(entry)
            except Exception as exc:  # noqa: BLE001
                self._internal(exc)
                outcome, delay = "deferred", self._next_backoff()
            self._settle(entry, outcome, delay)

    def _next(self) -> _Batch | None:
        with self._cond:
            while True:
                if self._stop_now or self._disabled:
                    return None
                now = time.monotonic()
                if self._closing:
                    # flushing: skip the cool-down, but give each batch one round at most
                    if not self._queue or now >= self._deadline or self._queue[0].tried_in_close:
                        return None
                    entry = self._queue.popleft()
                    entry.tried_in_close = True
                    break
                if self._queue and now >= self._cooldown_until:
                    entry = self._queue.popleft()
                    break
                self._cond.wait(self._cooldown_until - now if self._queue else None)
            self._inflight = entry
            return entry

    def _settle(self, entry: _Batch, outcome: str, delay: float) -> None:
        with self._cond:
            if self._inflight is entry:
                self._inflight = None
            if entry.counted_failed and outcome != "deferred":
                self.failed -= 1  # close() gave up on it, then it finished after all
            if outcome == "deferred":
                if not self._stop_now:
                    self._queue.append(entry)  # to the back: one bad batch must not block the rest
                    self._cooldown_until = time.monotonic() + delay
                    return
                if not entry.counted_failed:
                    self.failed += 1
            elif outcome == "sent":
                self.sent += 1
                self._consecutive_failures = 0
                self._cooldown_until = 0.0
            elif outcome == "rejected":
                self.rejected += 1
            elif outcome == "gone":
                self._drop("evicted")  # the spool's byte cap removed it before its turn
            else:  # "unreadable"
                self.failed += 1
            self._queued.discard(entry.batch_id)

    def _deliver(self, entry: _Batch) -> tuple[str, float]:
        """One round for one batch: up to ``max_attempts`` byte-identical requests."""
        try:
            raw = entry.path.read_bytes()
        except FileNotFoundError:
            return "gone", 0.0
        except OSError as exc:
            self.last_error = f"cannot read {entry.path}: {exc}"
            return "unreadable", 0.0
        headers = dict(self._headers)
        headers["X-Stepwatch-Batch-Id"] = entry.batch_id
        body = raw
        if len(raw) >= GZIP_MIN_BYTES:
            body = gzip.compress(raw, compresslevel=6, mtime=0)  # mtime 0: same bytes on every retry
            headers["Content-Encoding"] = "gzip"
        attempts = 0
        while True:
            with self._cond:
                if entry.attempts:
                    self.retries += 1
            entry.attempts += 1
            attempts += 1
            status, retry_after = self._post(body, headers)
            if status is not None and 200 <= status < 300:
                self._record_uploaded(entry)
                return "sent", 0.0
            if status is not None and (300 <= status < 500 and status not in _RETRYABLE_4XX):
                self.last_error = f"HTTP {status} for batch {entry.batch_id}"
                if status in _BAD_KEY:
                    self._disable(status)
                return "rejected", 0.0
            if status is not None:
                self.last_error = f"HTTP {status} for batch {entry.batch_id}"
            delay = min(retry_after, self.retry_after_cap_s) if retry_after is not None else self._next_backoff()
            if attempts >= self.max_attempts or not self._pause(delay):
                return "deferred", delay

    def _post(self, body: bytes, headers: dict[str, str]) -> tuple[int | None, float | None]:
        """Sends once; returns (status, Retry-After seconds) or (None, None) on a network error."""
        timeout = self.request_timeout_s
        with self._cond:
            if self._closing:
                timeout = max(0.05, min(timeout, self._deadline - time.monotonic()))
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with self._opener.open(request, timeout=timeout) as response:
                response.read(_MAX_RESPONSE_BYTES)
                return int(response.status), None
        except urllib.error.HTTPError as exc:
            try:  # an HTTPError holds the connection open until closed (ResourceWarning otherwise)
                retry_after = None
                if exc.code in (429, 503):
                    retry_after = parse_retry_after(exc.headers.get("Retry-After") if exc.headers else None)
                try:
                    exc.read(_MAX_RESPONSE_BYTES)
                except (OSError, http.client.HTTPException):
                    pass
                return int(exc.code), retry_after
            finally:
                exc.close()
        except (OSError, http.client.HTTPException, ValueError) as exc:
            # refused, reset, DNS, TLS, timeout (URLError and TimeoutError are OSErrors)
            self.last_error = f"{type(exc).__name__}: {exc}"
            return None, None

    def _pause(self, delay: float) -> bool:
        """Waits ``delay`` seconds; False if the exporter must stop first (or the close deadline
        would pass: then the batch is left for a later process instead)."""
        end = time.monotonic() + delay
        with self._cond:
            while True:
                if self._stop_now or self._disabled:
                    return False
                now = time.monotonic()
                if self._closing and end > self._deadline:
                    return False
                if now >= end:
                    return True
                self._cond.wait(end - now)

    def _next_backoff(self) -> float:
        with self._cond:
            self._consecutive_failures += 1
            exponent = min(self._consecutive_failures - 1, 32)
        return min(self.max_backoff_s, self.backoff_s * 2.0 ** exponent) * random.uniform(0.5, 1.0)

    def _record_uploaded(self, entry: _Batch) -> None:
        with self._cond:
            self._uploaded.add(entry.batch_id)
        file = entry.path.parent / UPLOADED_FILE
        try:
            with self._file_lock:
                prefix = b""
                if file not in self._tail_checked:  # a crash may have torn the last line
                    self._tail_checked.add(file)
                    try:
                        with open(file, "rb") as f:
                            if f.seek(0, os.SEEK_END) > 0:
                                f.seek(-1, os.SEEK_END)
                                prefix = b"" if f.read(1) == b"\n" else b"\n"
                    except FileNotFoundError:
                        pass
                with open(file, "ab") as f:
                    f.write(prefix + entry.batch_id.encode("ascii", "replace") + b"\n")
        except OSError as exc:  # uploaded all the same; a later process may send it again (deduped)
            self._internal(exc)

    def _disable(self, status: int) -> None:
        with self._cond:
            if self._disabled:
                return
            self._disabled = True
            for queued in self._queue:
                self._drop("bad_key")
                self._queued.discard(queued.batch_id)
            self._queue.clear()
            self._cond.notify_all()
            first = not self.warned
            self.warned = True
        if first:
            try:
                sys.stderr.write(
                    f"[stepwatch] trace upload refused (HTTP {status}) by {self.url}: check the API key; "
                    f"no more batches will be sent by this process (they stay in {self.spool_dir})\n")
            except Exception:  # noqa: BLE001 - a closed stderr must not break the host
                pass

    # -- bookkeeping ---------------------------------------------------------------------------

    def _drop(self, reason: str) -> None:  # with the lock held
        self.dropped += 1
        self.drops[reason] += 1

    def _internal(self, exc: Exception) -> None:
        try:
            with self._cond:
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
        except Exception:  # noqa: BLE001
            pass
        report_internal(exc, Site.HTTP_EXPORTER)

    def _check_fork(self) -> None:
        """After fork() the child owns fresh locks and no worker; the parent uploads its queue."""
        pid = os.getpid()
        if pid != self._pid:
            self._pid = pid
            self._init_state()
            self._file_lock = threading.Lock()
