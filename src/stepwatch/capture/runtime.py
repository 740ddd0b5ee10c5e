"""The per-process runtime: one background thread samples collectors and drains the bounded
tables into the run directory (telemetry sink, heartbeat file, bundles).

Threads: the training thread only appends to ``BoundedTable``s (phases, progress, errors).
The sampler thread owns the sink and the heartbeat writer; ``stop`` joins it first and only
then writes the last records itself. Every failure inside is logged once and swallowed.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

from ..artifacts.bundles import write_oom_bundle
from ..artifacts.heartbeat import HeartbeatWriter, heartbeat_record
from ..artifacts.run_manifest import RunManifest, current_versions, read_run_manifest, write_run_manifest
from ..artifacts.sink import TelemetrySink
from ..artifacts.spool import SpoolWriter
from ..schema import SessionStatus, SessionSummary, TelemetryEventV3, new_session_id
from .collectors import CollectorHealth, CpuCollector, discover_accelerators, discover_nvml
from .config import RuntimeConfig
from .events import EventFactory
from .guard import guarded, report_internal, swallowed
from .identity import DistributedIdentity, resolve_distributed_identity
from .phases import PhaseScopes
from .spans import ClosedSpan, MarkRow, SpanRecorder
from .tables import BoundedTable
from .training import TrainingState, pre_init_marks

__all__ = ["NullRuntime", "Runtime", "is_oom"]

_DISCOVER_EVERY_S = 5.0


def is_oom(exc: BaseException) -> bool:
    """torch's OutOfMemoryError (any backend, or a subclass of it) or Python's MemoryError."""
    return isinstance(exc, MemoryError) or _is_torch_oom(exc)


def _is_torch_oom(exc: BaseException) -> bool:
    # by name, so torch need not be imported; along the MRO, so subclasses count too
    return any(cls.__name__ == "OutOfMemoryError" for cls in type(exc).__mro__)


def _json_safe(value: Any) -> Any:
    """Attrs as strict JSON: non-finite floats become "nan"/"inf"/"-inf", unknown types str()."""
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value in (float("inf"), float("-inf")):
            return "inf" if value > 0 else "-inf"
        return value
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if hasattr(value, "item"):
        return _json_safe(value.item())
    return str(value)


_PLAIN_TYPES = frozenset({int, str, bool, type(None)})


def _clean_attrs(attrs: dict[str, Any] | None) -> dict[str, Any]:
    """Attrs of plain values pass as they are (the usual case, once per span); others are cleaned."""
    if not attrs:
        return {}
    for value in attrs.values():
        if type(value) not in _PLAIN_TYPES:
            return _json_safe(attrs)  # type: ignore[no-any-return]
    return attrs


class NullRuntime:
    """Stands in when stepwatch is disabled or failed to start: same verbs, no effect."""

    active = False
    run_dir: Path | None = None
    session_id: str | None = None

    def progress(self, step: int, **metrics: Any) -> None:
        return None

    def record_oom(self, exc: BaseException) -> Path | None:
        return None

    def stop(self, status: SessionStatus = "completed", timeout: float = 2.0) -> None:
        return None


def _shared_session_id(identity: DistributedIdentity) -> str | None:
    """One session id for all ranks of a job started without ``stepwatch run``."""
    if identity.world_size <= 1:
        return None
    if identity.job_id and identity.job_id != "none":
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"stepwatch:{identity.job_id}"))
    # same parent (the torchrun agent) on this node: its pid and start time name the job
    try:
        import psutil

        parent = psutil.Process(os.getppid())
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"stepwatch:{socket.gethostname()}:{parent.pid}:{parent.create_time()}"))
    except Exception:  # noqa: BLE001
        return None


def _fully_imported_torch() -> Any:
    """torch once its import has finished, else None.

    The sampler thread can run while the training thread is still inside ``import torch``; the
    half-built module then lacks ``cuda``/``optim`` and touching them raises.
    """
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "optim") or not hasattr(getattr(torch, "utils", None), "data"):
        return None
    return torch if hasattr(torch, "cuda") else None


class Runtime:
    """Started by ``stepwatch.init``; see ``RuntimeConfig`` for the options."""

    active = True

    def __init__(self, config: RuntimeConfig, *, launched: bool = False) -> None:
        self.config = config
        self.identity = resolve_distributed_identity(
            job_id=config.job_id, rank=config.rank, local_rank=config.local_rank, world_size=config.world_size
        )
        self.started_ns = time.time_ns()
        self.session_id = config.session_id or _shared_session_id(self.identity) or new_session_id()
        self.run_dir = config.run_dir(self.session_id, self.started_ns)
        self.launched = launched
        self.host = socket.gethostname()
        self.pid = os.getpid()
        rank = self.identity.rank
        self.sink = TelemetrySink(self.run_dir / "telemetry" / f"rank{rank}", config.sink)
        self.session = self.sink.start_session(
            SessionSummary(
                session_id=self.session_id, status="running", started_at_ns=self.started_ns, host=self.host,
                pid=self.pid, job_id=self.identity.job_id, rank=rank, local_rank=self.identity.local_rank,
                world_size=self.identity.world_size, source="stepwatch.runtime",
            )
        )
        self.factory = EventFactory(
            session_id=self.session_id, identity=self.identity, host=self.host, pid=self.pid,
            interval_ms=int(round(config.interval * 1000)),
        )
        rows = config.table_rows
        self.phase_rows: BoundedTable[tuple[Any, ...]] = BoundedTable("phases", rows)
        self.progress_rows: BoundedTable[tuple[float, int, dict[str, Any]]] = BoundedTable("progress", rows)
        self.error_events: BoundedTable[TelemetryEventV3] = BoundedTable("errors", 1024)
        self.scopes = PhaseScopes(self.session_id, self.phase_rows.append)
        self.collectors = [CollectorHealth(CpuCollector())]
        with guarded:
            nvml = discover_nvml()
            if nvml is not None:
                self.collectors.append(CollectorHealth(nvml))
        self.heartbeat = HeartbeatWriter(self.run_dir, rank)
        self.spans = SpanRecorder(rank=rank, rows=rows)
        for row in pre_init_marks():
            self.spans.marks.append(row)
        self.snapshot_rows: BoundedTable[tuple[list[dict[str, Any]], Any]] = BoundedTable("snapshots", 1024)
        self.training = TrainingState(self.spans, snapshot_sink=self._snapshot_sink, blob_uri=self._blob_uri,
                                      on_step=self._on_step)
        from .. import __version__

        self.spool = SpoolWriter(self.run_dir / "spool", sdk_version=__version__, max_bytes=config.spool_max_bytes)
        self.exporter: Any = None
        if config.endpoint and config.api_key:
            from ..transport.http_exporter import HttpExporter

            self.exporter = HttpExporter(config.endpoint, config.api_key, sdk_version=__version__,
                                         spool_root=self.run_dir)
        self.patches: Any = None
        self.sender: Any = None
        self._wire: dict[str, list[Any]] = {"telemetry": [], "spans": [], "marks": [], "snapshots": [], "heartbeat": []}
        if config.aggregator:
            from ..transport.sender import FrameSender, parse_address

            self.sender = FrameSender(parse_address(config.aggregator), {
                "session_id": self.session_id, "rank": rank, "local_rank": self.identity.local_rank,
                "world_size": self.identity.world_size, "job_id": self.identity.job_id, "host": self.host,
                "pid": self.pid, "started_ns": self.started_ns,
            })
        self._deferred: list[ClosedSpan] = []
        self.spool_write_lost = 0
        self._next_seal = time.monotonic() + config.spool_interval
        self.recent: deque[TelemetryEventV3] = deque(maxlen=config.oom_ring)
        self._recent_lock = threading.RLock()  # re-entered if SIGTERM lands inside record_oom
        self.step = 0
        self.sink_dropped = 0
        self._stop = threading.Event()
        # Held for each tick and for the final drain: the last records are never written by two
        # threads at once, and the sink is never closed under a tick still appending.
        self._tick_lock = threading.Lock()
        self._stopped = False
        self._next_sample = 0.0
        self._next_heartbeat = 0.0
        # The first tick looks right away: a device the program set up before init() (or early
        # in a short run) must not wait _DISCOVER_EVERY_S for its first sample.
        self._next_discovery = 0.0
        self._last_cuda_mb: tuple[int, int] | None = None
        if rank == 0 and not launched:
            write_run_manifest(
                self.run_dir,
                RunManifest(session_id=self.session_id, started_at_ns=self.started_ns, command_line=list(sys.argv),
                            world_size=self.identity.world_size, pid=self.pid, versions=current_versions()),
            )
        # First sample now, so every later record carries real counters.
        self._sample(time.time())
        self._write(self.factory.point("start", context="stepwatch capture started",
                                       metadata={"run_dir": str(self.run_dir)}))
        self._heartbeat_write(self._heartbeat("boot", phase="start"))
        self.heartbeat.flush()
        if config.auto_instrument:
            with guarded:
                self.install_patches()
        self._thread = threading.Thread(target=self._loop, name="stepwatch-sampler", daemon=True)
        self._thread.start()

    # -- calling-thread API (append only) ----------------------------------------------------

    def progress(self, step: int, **metrics: Any) -> None:
        """A ``progress`` heartbeat record (loss, toks_per_s, dt_fetch_s, grad_norm, ...)."""
        step = int(step)  # a numpy or tensor step number must still encode as a JSON integer
        self.step = step
        self.progress_rows.append((time.time(), step, metrics))

    def record_oom(self, exc: BaseException) -> Path | None:
        """Records an OOM as an ``error`` event and writes a flight-recorder bundle."""
        backend = "cuda" if _is_torch_oom(exc) else "cpu"
        reason = f"{type(exc).__name__}: {exc}"[:4000]
        event = self.factory.point(
            "error", context=reason.splitlines()[0][:500] if reason else None,
            metadata={"oom_reason": reason, "exception_type": f"{type(exc).__module__}.{type(exc).__name__}",
                      "step": self.step, "phase_path": list(self.scopes.current_path())},
        )
        self.error_events.append(event)
        with self._recent_lock:
            recent = list(self.recent)
        return write_oom_bundle(
            self.run_dir / "bundles", reason=reason, backend=backend, session=self.session,
            events=[*recent, event],
            metadata={"rank": self.identity.rank, "step": self.step, "exception": reason,
                      "timestamp_ns": event.timestamp_ns, "phase_path": list(self.scopes.current_path())},
        )

    # -- background thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        # wake for whichever comes first: a sample, a heartbeat, or the once-a-second flush
        period = min(self.config.interval, self.config.heartbeat_interval, 1.0)
        while not self._stop.wait(period):
            with self._tick_lock:
                if self._stop.is_set():
                    break
                with guarded:
                    self.tick()

    def tick(self) -> None:
        now = time.time()
        mono = time.monotonic()
        if mono >= self._next_discovery:
            self._next_discovery = mono + _DISCOVER_EVERY_S
            known = {h.collector.name for h in self.collectors}
            for collector in discover_accelerators(known):
                self.collectors.append(CollectorHealth(collector))
            self._enable_gpu_timing()
        if self.patches is None and self.config.auto_instrument:
            self.install_patches()
        if mono >= self._next_sample:
            self._next_sample = mono + self.config.interval
            self._sample(now)
        self._drain()
        if mono >= self._next_seal:
            self._next_seal = mono + self.config.spool_interval
            self._seal_spool()
        if mono >= self._next_heartbeat:
            self._next_heartbeat = mono + self.config.heartbeat_interval
            self._heartbeat_write(self._heartbeat("heartbeat"))
        self.heartbeat.flush()
        self._flush_sink()
        self._ship()

    def _sample(self, now: float) -> None:
        timestamp_ns = int(now * 1e9)
        accelerators = any(h.collector.backend not in ("cpu",) for h in self.collectors)
        for health in self.collectors:
            readings, transition = health.poll(now)
            meta = health.metadata()
            if transition is not None:
                context = health.last_error if transition == "collector_degraded" else "collector works again"
                self._write(self.factory.point(transition, context=context, metadata=meta,
                                               timestamp_ns=timestamp_ns, collector=health.collector.name))
            primary = health.collector.backend != "cpu" or not accelerators
            for reading in readings:
                self._write(self.factory.sample(health.collector.name, reading, meta, timestamp_ns, primary=primary))
                if health.collector.backend in ("cuda", "rocm") and reading.device_id == 0:
                    self._last_cuda_mb = (reading.allocated >> 20, reading.reserved >> 20)

    def _drain(self) -> None:
        for row in self.phase_rows.drain():
            self._write(self.factory.phase(row, self.scopes.prefix))
        for event in self.error_events.drain():
            self._write(event)
        for ts, step, metrics in self.progress_rows.drain():
            self._heartbeat_write(self._heartbeat("progress", ts=ts, step=step, **metrics))

    def _heartbeat_write(self, record: dict[str, Any]) -> None:
        self.heartbeat.write(record)
        if self.sender is not None:
            self._wire["heartbeat"].append(record)

    def _ship(self) -> None:
        """Sends the rows new since the last tick to the aggregator (when there is one)."""
        if self.sender is None:
            return
        wire, self._wire = self._wire, {name: [] for name in self._wire}
        with guarded:
            self.sender.ship(wire)

    def _write(self, event: TelemetryEventV3) -> None:
        if self.sender is not None:
            self._wire["telemetry"].append(event)
        with self._recent_lock:
            self.recent.append(event)
        try:
            self.sink.append(event)
        except OSError as exc:  # disk full or gone: keep memory bounded, count what is lost
            self.sink_dropped += self.sink.discard_buffer()
            report_internal(exc, "sink.append")

    def _flush_sink(self) -> None:
        try:
            self.sink.maybe_flush()
        except OSError as exc:
            self.sink_dropped += self.sink.discard_buffer()
            report_internal(exc, "sink.flush")

    def _heartbeat(self, msg: str, *, ts: float | None = None, step: int | None = None, **fields: Any) -> dict[str, Any]:
        if self._last_cuda_mb is not None:
            fields.setdefault("gpu_mem_alloc", self._last_cuda_mb[0])
            fields.setdefault("gpu_mem_reserved", self._last_cuda_mb[1])
        return heartbeat_record(ts=ts or time.time(), pid=self.pid, rank=self.identity.rank,
                                step=self.step if step is None else step, msg=msg, **fields)

    # -- spans, spool, torch ---------------------------------------------------------------------

    def install_patches(self) -> bool:
        """Torch auto-instrumentation, once torch is fully imported (also when it comes later)."""
        if _fully_imported_torch() is None:
            return False
        from .torch_patches import TorchPatches

        patches = TorchPatches(self.training)
        self.patches = patches  # set first: a failing install is not retried every tick
        patches.install()
        return True

    def _enable_gpu_timing(self) -> None:
        torch = _fully_imported_torch()
        if self.training.gpu_timer is None and torch is not None and torch.cuda.is_initialized():
            from .gpu_timing import GpuTimer

            self.training.gpu_timer = GpuTimer(lambda: torch.cuda.Event(enable_timing=True))

    def _on_step(self, step: int) -> None:
        self.step = step

    def _blob_uri(self, span_id: str, kind: str) -> str:
        return (self.run_dir / "snapshots" / span_id / f"{kind}.safetensors").resolve().as_uri()

    def _snapshot_sink(self, records: list[dict[str, Any]], job: Any) -> None:
        self.snapshot_rows.append((records, job))

    def _span_record(self, closed: ClosedSpan) -> dict[str, Any]:
        span = closed.span
        fmt = self.spans.format_id
        return {
            "id": fmt(span.id), "name": span.name, "parent_id": fmt(span.parent_id), "index": span.index,
            "start_ns": span.start_ns, "end_ns": closed.end_ns, "cpu_ns": None,
            "gpu_ns": span.gpu if isinstance(span.gpu, int) else None, "memory_peak_bytes": None,
            "thread_id": span.thread_id, "pid": self.pid, "rank": self.identity.rank,
            "attrs": _clean_attrs(span.attrs), "mark_ids": [fmt(m) for m in span.mark_ids or ()],
        }

    def _mark_record(self, row: MarkRow) -> dict[str, Any]:
        fmt = self.spans.format_id
        record = {"id": fmt(row.id), "span_id": fmt(row.span_id), "name": row.name, "value_type": row.value_type,
                  "value": row.value, "attrs": _clean_attrs(row.attrs), "ts_ns": row.ts_ns, "kind": row.kind}
        if row.nonfinite is not None:
            record["value_nonfinite"] = row.nonfinite
        return record

    def _seal_spool(self, final: bool = False) -> None:
        """Writes closed spans (those whose GPU time is resolved), marks and snapshots as a batch."""
        timer = self.training.gpu_timer
        if timer is not None:
            timer.resolve()
        ready: list[ClosedSpan] = []
        waiting: list[ClosedSpan] = []
        for closed in [*self._deferred, *self.spans.closed.drain()]:
            gpu = closed.span.gpu
            if gpu is not None and not isinstance(gpu, int) and not final and timer is not None and timer.outstanding(closed.span):
                waiting.append(closed)
            else:
                ready.append(closed)
        self._deferred = waiting
        spans = [self._span_record(c) for c in ready]
        marks = [self._mark_record(m) for m in self.spans.marks.drain()]
        snapshots: list[dict[str, Any]] = []
        for records, job in self.snapshot_rows.drain():
            snapshots.extend(records)
            if job is not None:
                from .snapshots import write_blobs

                with guarded:
                    write_blobs(job, self.run_dir / "snapshots" / job.span_id)
        if self.sender is not None:
            self._wire["spans"].extend(spans)
            self._wire["marks"].extend(marks)
            self._wire["snapshots"].extend(snapshots)
        try:
            paths = self.spool.write(spans, marks, snapshots)
        except OSError as exc:  # full or vanished disk: the batch is lost, and counted as such
            self.spool_write_lost += len(spans) + len(marks) + len(snapshots)
            report_internal(exc, "spool.write")
            return
        for path in paths:
            if self.exporter is not None:
                self.exporter.submit(path)

    # -- stop ----------------------------------------------------------------------------------

    def drops(self) -> dict[str, int]:
        return {
            "phase_rows_evicted": self.phase_rows.evicted,
            "progress_rows_evicted": self.progress_rows.evicted,
            "error_events_evicted": self.error_events.evicted,
            "sink_records_dropped": self.sink_dropped,
            "span_rows_evicted": self.spans.closed.evicted,
            "mark_rows_evicted": self.spans.marks.evicted,
            "snapshot_rows_evicted": self.snapshot_rows.evicted,
            "spans_over_depth_cap": self.spans.depth_dropped,
            "spool_batches_evicted": self.spool.evicted_batches,
            "spool_records_evicted": self.spool.evicted_records,
            "spool_records_dropped": self.spool.dropped_records,
            "spool_records_lost_to_write_errors": self.spool_write_lost,
            "gpu_timing_pool_exhausted": getattr(self.training.gpu_timer, "pool_exhausted", 0),
            "gpu_timing_unresolved": getattr(self.training.gpu_timer, "unresolved_dropped", 0),
            "wire_rows_dropped": self.sender.rows_dropped if self.sender is not None else 0,
        }

    def stop(self, status: SessionStatus = "completed", timeout: float = 2.0, exit_code: int | None = None) -> None:
        """Flushes to a deadline and closes the session with ``status``. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        with self._tick_lock:
            self._stop_locked(status, timeout, exit_code)

    def _stop_locked(self, status: SessionStatus, timeout: float, exit_code: int | None) -> None:
        if self.patches is not None:
            with guarded:
                self.patches.uninstall()
        with guarded:
            self.training.finish()
        with guarded:
            self.spans.close_all()
            self._seal_spool(final=True)
        if self.exporter is not None:
            with guarded:
                self.exporter.close(timeout)
        with guarded:
            self._sample(time.time())
            self._drain()
            self._write(self.factory.point(
                "stop", context=f"stepwatch capture stopped ({status})",
                metadata={"dropped": self.drops(), "internal_errors": sum(swallowed().values()),
                          "collector_failures": {h.collector.name: h.failures_total for h in self.collectors}},
            ))
        with guarded:
            self._heartbeat_write(self._heartbeat("stop", status=status))
            self.heartbeat.close()
        if self.sender is not None:
            with guarded:
                self._ship()
                self.sender.close(min(timeout, 1.0))
        with guarded:
            self.session = self.sink.close(status) or self.session
        if self.identity.rank == 0 and not self.launched:
            with guarded:
                manifest = read_run_manifest(self.run_dir)
                manifest.status = status
                manifest.ended_at_ns = time.time_ns()
                manifest.exit_code = exit_code
                write_run_manifest(self.run_dir, manifest)
