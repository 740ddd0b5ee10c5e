"""The per-process runtime: one background thread samples collectors and drains the bounded
tables into the run directory (telemetry sink, heartbeat file, bundles).

``Runtime`` holds the rank's identity (session, run directory, rank) and wires parts that have
one job each:

* ``TrainingState`` (training.py): steps, phases and epochs of the training thread;
* ``open_rank_artifacts`` (rank_artifacts.py): the files and connections the rank opens;
* ``RankOutputs`` (rank_outputs.py): where records go (sink, heartbeat file, aggregator);
* ``TableDrain`` (table_drain.py): the training thread's tables into those outputs;
* ``DeviceSampling`` (device_sampling.py): the collectors, sampled each interval;
* ``SpoolSealer`` (spool_seal.py): spans, marks and snapshots into spool batches;
* ``HaltController`` (halt_control.py) and ``MemoryRequests`` (memory_requests.py): what the
  rank is asked from outside;
* ``Sampler`` (sampler.py): the background thread, and how it gives way to ``stop``.

What is left here: the tick that drives the parts, the step callback, how the rank ended (failures,
OOM bundles, its end file) and stop.

Threads: the training thread only appends to ``BoundedTable``s (phases, progress, errors).
The sampler thread owns the sink and the heartbeat writer; ``stop`` joins it first and only
then writes the last records itself. Every failure inside is logged once and swallowed.

Shutdown is bounded in time: the sampler drains a chunk of rows at a time and gives way to
``stop`` between chunks; ``stop`` writes what is still queued until its deadline (``timeout``
seconds after it was called) and counts the rest as ``*_dropped_at_stop``. A sampler stuck
inside a tick past the deadline (a disk that blocks a write) is never closed under: ``stop``
returns and the sampler closes the session itself once that tick returns.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..artifacts.bundles import new_oom_bundle_dir, write_oom_bundle
from ..artifacts.heartbeat import heartbeat_record
from ..artifacts.run_manifest import read_run_manifest, write_run_manifest
from ..artifacts.run_outcome import error_from_exception, error_from_signal, rank_outcome, write_rank_end
from ..artifacts.step_ledger import StepLedger
from ..guard import Site, guarded, report_internal, swallowed
from ..lifetime import LAUNCHER_PID_ENV, die_with_parent, launcher_gone
from ..schema import SessionStatus, TelemetryEventV3, new_session_id
from . import torch_attach
from .config import RuntimeConfig
from .controls import current_phase, register_stack_signal
from .device_sampling import DeviceSampling, fully_imported_torch
from .halt_control import HaltController
from .identity import DistributedIdentity, resolve_distributed_identity
from .memory_requests import MemoryRequests
from .phases import PhaseScopes
from .rank_artifacts import open_rank_artifacts
from .rank_outputs import RankOutputs
from .sampler import Sampler
from .spans import OpenSpan, SpanRecorder
from .spool_seal import SpoolSealer
from .table_drain import TableDrain
from .tables import BoundedTable
from .training import TrainingState, pre_init_marks

if TYPE_CHECKING:
    from .children import ChildProcess

__all__ = ["NullRuntime", "Runtime", "is_oom"]

# A tick that found a table a quarter full (or more) looks again this soon, not a whole period
# later: a burst is written before the bound evicts it.
_BACKLOG_WAIT_S = 0.05
# The device a torch OOM message names: "CUDA out of memory", "HIP out of memory", "MPS backend
# out of memory", "DefaultCPUAllocator: can't allocate memory".
_OOM_DEVICE = re.compile(r"\b(?:HIP|CUDA|MPS)\b|CPU")
_OOM_BACKENDS = {"HIP": "rocm", "CUDA": "cuda", "MPS": "mps", "CPU": "cpu"}


def is_oom(exc: BaseException) -> bool:
    """torch's OutOfMemoryError (any backend, or a subclass of it) or Python's MemoryError."""
    return isinstance(exc, MemoryError) or _is_torch_oom(exc)


def _is_torch_oom(exc: BaseException) -> bool:
    # by name, so torch need not be imported; along the MRO, so subclasses count too
    return any(cls.__name__ == "OutOfMemoryError" for cls in type(exc).__mro__)


class NullRuntime:
    """Stands in when stepwatch is disabled or failed to start: same verbs, no effect."""

    active = False
    run_dir: Path | None = None
    session_id: str | None = None
    halt_step: int | None = None

    def progress(self, step: int, **metrics: Any) -> None:
        return None

    def record_oom(self, exc: BaseException) -> Path | None:
        return None

    def stop(self, status: SessionStatus = "completed", timeout: float = 2.0) -> None:
        return None


def _shared_origin(identity: DistributedIdentity) -> tuple[str, int | None] | None:
    """(session id, start time in ns or None) that every rank of a job started without
    ``stepwatch run`` derives alike: the run directory is named from them, so all ranks land
    in one directory whatever second each of them started in."""
    if identity.world_size <= 1:
        return None
    if identity.job_id:
        # the launcher's job id names the job; no start time is shared across nodes
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"stepwatch:{identity.job_id}")), None
    # same parent (the torchrun agent) on this node: its pid and start time name the job
    try:
        import psutil

        parent = psutil.Process(os.getppid())
        created = parent.create_time()
        return (str(uuid.uuid5(uuid.NAMESPACE_URL, f"stepwatch:{socket.gethostname()}:{parent.pid}:{created}")),
                int(created * 1e9))
    except Exception:  # noqa: BLE001
        return None


def _oom_backend(exc: BaseException, sampled: set[str]) -> str:
    """The memory an OOM is about: ``MemoryError`` is host memory; a torch OOM names its device
    in the message (CUDA, HIP, MPS, CPU), else it is the accelerator this process samples."""
    if not _is_torch_oom(exc):
        return "cpu"
    named = _OOM_DEVICE.search(str(exc)[:300])
    if named is not None:
        backend = _OOM_BACKENDS[named.group(0)]
        return "rocm" if backend == "cuda" and "rocm" in sampled else backend  # a HIP build may say CUDA
    for backend in ("cuda", "rocm", "mps"):
        if backend in sampled:
            return backend
    torch = sys.modules.get("torch")
    return "rocm" if getattr(getattr(torch, "version", None), "hip", None) else "cuda"


class Runtime:
    """Started by ``stepwatch.init``; see ``RuntimeConfig`` for the options."""

    active = True

    def __init__(self, config: RuntimeConfig, *, launched: bool = False, child: ChildProcess | None = None) -> None:
        """``child``: this is a process the training process started (see ``children.py``). Its
        identity may not be known yet (``child.identity`` None): then nothing is written until
        ``open_child`` is called (``init_process_group`` or the first step), and a child that
        never gets there leaves no trace."""
        self.config = config
        self.child = child
        if child is not None and child.identity is not None:
            self.identity = child.identity
        elif child is not None:
            self.identity = child.parent_identity  # provisional: never written anywhere
        else:
            self.identity = resolve_distributed_identity(
                job_id=config.job_id, rank=config.rank, local_rank=config.local_rank, world_size=config.world_size
            )
        self.started_ns = time.time_ns()
        shared = None if config.session_id else _shared_origin(self.identity)
        self.session_id = config.session_id or (shared[0] if shared else None) or new_session_id()
        # The default directory's name: ranks of one job must all pick the same one, so it
        # carries the session id and only a time every rank shares (the agent's start) or none.
        if self.identity.world_size > 1 and (shared or config.session_id):
            self.run_dir = config.run_dir(self.session_id, shared[1] if shared else None)
        else:
            self.run_dir = config.run_dir(self.session_id, self.started_ns)
        self.launched = launched or child is not None  # children never write the run manifest
        self.host = socket.gethostname()
        self.pid = os.getpid()
        rows = config.table_rows
        self.phase_rows: BoundedTable[tuple[Any, ...]] = BoundedTable("phases", rows)
        self.progress_rows: BoundedTable[tuple[float, int, dict[str, Any]]] = BoundedTable("progress", rows)
        self.error_events: BoundedTable[TelemetryEventV3] = BoundedTable("errors", 1024)
        self.scopes = PhaseScopes(self.session_id, self.phase_rows.append)
        self.devices = DeviceSampling()
        self.spans = SpanRecorder(rank=self.identity.rank, rows=rows)
        for row in pre_init_marks():
            self.spans.marks.append(row)
        self.snapshot_rows: BoundedTable[tuple[list[dict[str, Any]], Any]] = BoundedTable("snapshots", 1024)
        self._ledger: StepLedger | None = None  # opened with the artifacts, once the rank is known (_open)
        self._ledger_write: Any = None
        self.training = TrainingState(self.spans, snapshot_sink=self._snapshot_sink, blob_uri=self._blob_uri,
                                      on_step=self._on_step)
        self.exporter: Any = None
        self.patches: Any = None
        self.sender: Any = None
        self._next_seal = time.monotonic() + config.spool_interval
        self.step = 0
        self._stopped = False
        self.sampler = Sampler(period=min(config.interval, config.heartbeat_interval, 1.0),
                               backlog_wait=_BACKLOG_WAIT_S, tick=self.tick, finish=self._finish_handed_off)
        self._next_sample = 0.0
        self._next_heartbeat = 0.0
        self._progress_calls = 0  # the program's CUDA device is read at the first and every 64th
        # What ended this rank (uncaught exceptions, a caught signal): see record_failure.
        self.failures: list[dict[str, Any]] = []
        self._ended_with_launcher = False  # set at stop (_launcher_ending)
        # Requests from outside (capture/controls.py, docs/halt.md, docs/stacks.md): read by the
        # sampler; the training thread sees a halt only at a step once one is asked for.
        self.halts = HaltController(
            self.training, session_id=self.session_id, rank=lambda: self.identity.rank,
            say=lambda msg, **fields: self.outputs.heartbeat_write(self._heartbeat(msg, **fields)),
            ended=self._write_rank_end, current_step=lambda: self.step)
        self._stack_signal: tuple[int, str] | None = None
        self._poll_s = min(config.interval, config.heartbeat_interval, 1.0)
        self.memory = MemoryRequests(wanted=config.memory_history)
        # False while a child's identity is pending: nothing is written, ticks only install patches.
        self.opened = False
        if child is not None and child.identity is None:
            self.training.on_step = self._on_child_step
        if child is None or child.identity is not None:
            self._open(self.identity, suffix=child.suffix if child is not None else "",
                       process=child.record() if child is not None else None)
        if config.auto_instrument:
            with guarded:
                self.install_patches()
        if os.environ.get(LAUNCHER_PID_ENV):
            # under ``stepwatch run``: die with whoever started this rank (the launcher, or
            # torchrun, whose own parent-death signal comes from the launcher)
            die_with_parent(signal.SIGTERM)
        self.sampler.start()

    def _open(self, identity: DistributedIdentity, *, suffix: str = "", process: dict[str, Any] | None = None) -> None:
        """Opens this process's artifacts under ``identity``'s rank (``suffix`` keeps the files of a
        second process with the same rank apart) and writes the first records."""
        config = self.config
        self.identity = identity
        rank = identity.rank
        self.spans.rank = rank  # span records are built at seal time, on the sampler: all carry it
        opened = open_rank_artifacts(config, identity, self.run_dir, session_id=self.session_id,
                                     started_ns=self.started_ns, host=self.host, pid=self.pid, suffix=suffix,
                                     launched=self.launched, child=self.child is not None)
        self.sink, self.session, self.factory = opened.sink, opened.session, opened.factory
        self.heartbeat, self.spool, self.exporter, self.sender = opened.heartbeat, opened.spool, opened.exporter, opened.sender
        self._ledger = opened.ledger
        self._ledger_write = self._ledger.write_step if self._ledger is not None else None
        name = f"rank{rank}{suffix}"
        with guarded:
            self._stack_signal = register_stack_signal(self.run_dir, name)
        self.halts.watch(self.run_dir)
        outputs = self.outputs = RankOutputs(self.sink, self.heartbeat, sender=self.sender, recent=config.oom_ring)
        self.drain = TableDrain(self.phase_rows, self.error_events, self.progress_rows, outputs, factory=self.factory,
                                prefix=self.scopes.prefix, heartbeat=self._heartbeat, stopping=lambda: self._stopped)
        self.sealer = SpoolSealer(self.spans, self.snapshot_rows, self.spool, self.run_dir,
                                  gpu_timer=lambda: self.training.gpu_timer,
                                  wire=outputs.wire if self.sender is not None else None, exporter=self.exporter)
        self.memory.watch(self.run_dir, name, rank, self.session_id, self.started_ns)
        # First sample now, so every later record carries real counters.
        self.devices.sample(time.time(), self.factory, self.outputs.write)
        metadata: dict[str, Any] = {"run_dir": str(self.run_dir)}
        if process is not None:
            metadata["process"] = process
        self.outputs.write(self.factory.point("start", context="stepwatch capture started", metadata=metadata))
        self.outputs.heartbeat_write(self._heartbeat(
            "boot", phase="start", host=self.host, session_id=self.session_id, poll_s=self._poll_s,
            stack_signal=self._stack_signal[0] if self._stack_signal else None,
            stack_file=self._stack_signal[1] if self._stack_signal else None))
        self.heartbeat.flush()
        self.opened = True
        self.training.on_step = self._on_step
        with guarded:
            from .children import note_captured

            note_captured(self.session_id, identity)

    def open_child(self, identity: DistributedIdentity | None) -> None:
        """Opens a pending child's artifacts: under ``identity`` (from ``init_process_group``), or
        as a worker when None (its first step came first). Once only; later calls do nothing."""
        child = self.child
        if child is None or self.opened or self._stopped:
            return
        with self.sampler.lock:
            if self.opened or self._stopped:
                return
            from .children import settle_identity

            settle_identity(child, identity, self.run_dir, self.session_id)
            assert child.identity is not None
            self._open(child.identity, suffix=child.suffix, process=child.record())

    # -- calling-thread API (append only) ----------------------------------------------------

    def progress(self, step: int, **metrics: Any) -> None:
        """A ``progress`` heartbeat record (loss, toks_per_s, dt_fetch_s, grad_norm, ...)."""
        step = int(step)  # a numpy or tensor step number must still encode as a JSON integer
        self.step = step
        self.progress_rows.append((time.time(), step, metrics))
        calls = self._progress_calls = self._progress_calls + 1
        if calls & 63 == 1:  # the first call, then every 64th: ~0.4-1 us, on the caller's thread
            self.devices.note_program_device()

    def record_oom(self, exc: BaseException) -> Path | None:
        """Records an OOM as an ``error`` event and writes a flight-recorder bundle; the event
        names the bundle (``oom_dump_path``), and is recorded even if the bundle cannot be."""
        if not self.opened:
            self.open_child(None)  # an OOM in a child before its first step: recorded as a worker's
            if not self.opened:
                return None
        backend = _oom_backend(exc, self.devices.backends())
        reason = f"{type(exc).__name__}: {exc}"[:4000]
        directory = new_oom_bundle_dir(self.run_dir / "bundles", backend)
        event = self.factory.point(
            "error", context=reason.splitlines()[0][:500] if reason else None,
            metadata={"oom_reason": reason, "oom_dump_path": str(directory.resolve()),
                      "exception_type": f"{type(exc).__module__}.{type(exc).__name__}",
                      "step": self.step, "phase_path": list(self.scopes.current_path())},
        )
        recent = list(self.outputs.recent)  # one C-level copy: atomic under the GIL (see RankOutputs.write)
        try:
            return write_oom_bundle(
                self.run_dir / "bundles", reason=reason, backend=backend, session=self.session,
                events=[*recent, event], directory=directory,
                metadata={"rank": self.identity.rank, "step": self.step, "exception": reason,
                          "timestamp_ns": event.timestamp_ns, "phase_path": list(self.scopes.current_path())},
            )
        except Exception as error:  # noqa: BLE001 - the error record must not be lost with the bundle
            event.metadata.pop("oom_dump_path", None)  # not appended anywhere yet: still ours to change
            event.metadata["oom_dump_error"] = f"{type(error).__name__}: {error}"[:500]
            report_internal(error, Site.OOM_BUNDLE)
            return None
        finally:
            self.error_events.append(event)

    # -- how the rank ended (docs/run-outcome.md) --------------------------------------------------

    def record_failure(self, exc: BaseException, tb: Any, *, thread: str, fatal: bool) -> None:
        """An uncaught exception (from the excepthooks): kept for the stop record, written to
        the rank's end file now (whatever happens to the process next, it survives), and queued
        as an ``error`` event so the timeline shows it."""
        error = error_from_exception(exc, tb, rank=self.identity.rank, thread=thread, fatal=fatal)
        # an OOM already has its error event (record_oom, with its bundle): not a second one
        event = not getattr(exc, "__stepwatch_recorded__", False)
        self._note_failure(error, context=f"uncaught {error['type']}: {error['message']}", event=event)

    def record_signal(self, signum: int, *, fatal: bool = True) -> None:
        """A signal received (from the SIGTERM handler); ``fatal``: its default action ends the rank."""
        error = error_from_signal(signum, rank=self.identity.rank, pid=self.pid)
        error["fatal"] = fatal
        self._note_failure(error, context=error["message"])

    def _note_failure(self, error: dict[str, Any], *, context: str, event: bool = True) -> None:
        error.update(pid=self.pid, host=self.host)
        self.failures.append(error)
        self._write_rank_end()
        if event:
            self.error_events.append(self.factory.point(
                "error", context=context.splitlines()[0][:500] if context else None, timestamp_ns=error["at_ns"],
                metadata={"failure": {k: v for k, v in error.items() if k not in ("pid", "host")}, "step": self.step}))

    def outcome(self) -> str:
        if self._ended_with_launcher:  # stopped because ``stepwatch run`` died: every record says killed
            return "killed"
        outcome = rank_outcome(self.failures)
        return "halted" if outcome == "exited" and self.halts.step is not None else outcome

    def _write_rank_end(self) -> None:
        with guarded:
            write_rank_end(self.run_dir, {
                "schema_version": 1, "session_id": self.session_id, "rank": self.identity.rank,
                "local_rank": self.identity.local_rank, "world_size": self.identity.world_size, "pid": self.pid,
                "host": self.host, "outcome": self.outcome(), "errors": list(self.failures),
                "ended_at_ns": time.time_ns(), **({"halt": self.halts.record()} if self.halts.step is not None else {}),
            })

    # -- background thread ---------------------------------------------------------------------

    def tick(self) -> None:
        if not self.opened:  # a child whose identity is pending: nothing to write yet
            if self.patches is None and self.config.auto_instrument:
                self.install_patches()
            return
        now = time.time()
        ledger = self._ledger
        if ledger is not None:
            ledger.alive(int(now * 1e9))
        mono = time.monotonic()
        self.sampler.backlog = self.drain.backlog()
        if self.devices.discover(mono):
            self._enable_gpu_timing()
        if self.patches is None and self.config.auto_instrument:
            self.install_patches()
        self._poll_controls(mono)
        if mono >= self._next_sample:
            self._next_sample = mono + self.config.interval
            self.devices.sample(now, self.factory, self.outputs.write)
        if not self.drain.run():
            return  # stop is waiting: it writes the rest and closes the files
        if mono >= self._next_seal:
            self._next_seal = mono + self.config.spool_interval
            self.sealer.seal()
        else:
            self.sealer.ship_early()
        if mono >= self._next_heartbeat:
            self._next_heartbeat = mono + self.config.heartbeat_interval
            record = self._heartbeat("heartbeat", **self._phase_fields())
            record.setdefault("phase", None)  # null between steps (heartbeat_record drops None)
            self.outputs.heartbeat_write(record)
        self.heartbeat.flush()
        self.outputs.flush_sink()
        self.outputs.ship()

    def _heartbeat(self, msg: str, *, ts: float | None = None, step: int | None = None, **fields: Any) -> dict[str, Any]:
        gpu_mb = self.devices.gpu_mb
        if gpu_mb is not None:
            fields.setdefault("gpu_mem_alloc", gpu_mb[0])
            fields.setdefault("gpu_mem_reserved", gpu_mb[1])
        return heartbeat_record(ts=ts or time.time(), pid=self.pid, rank=self.identity.rank,
                                step=self.step if step is None else step, msg=msg, **fields)

    # -- spans, spool, torch ---------------------------------------------------------------------

    def install_patches(self) -> bool:
        """Torch auto-instrumentation: at once when torch is imported, else the moment its import
        completes (torch_attach.py); the tick's call is the fallback."""
        return torch_attach.install(self)

    def _enable_gpu_timing(self) -> None:
        torch = fully_imported_torch()
        if self.training.gpu_timer is None and torch is not None and torch.cuda.is_initialized():
            from .gpu_timing import GpuTimer, cuda_event_source

            make_event, record = cuda_event_source(torch)
            self.training.gpu_timer = GpuTimer(make_event, record=record)

    def _on_child_step(self, step: int, span: OpenSpan | None = None) -> None:
        """A pending child's first step: it is a worker (no ``init_process_group`` came first).
        Only a pending child's state calls this; opening puts ``_on_step`` back, so no step of
        any other process pays for the check."""
        if not self.opened:
            with guarded:
                self.open_child(None)
        self._on_step(step, span)

    def _on_step(self, step: int, span: OpenSpan | None = None) -> None:
        self.step = step
        halts = self.halts
        if halts.target is not None:  # a halt waits for its step (one attribute read until then)
            halts.step_done(step)
        write = self._ledger_write
        if write is not None and span is not None:
            try:
                write(span)
            except Exception as exc:  # noqa: BLE001 - never into the training: the ledger is off from here
                self._ledger_write = None
                report_internal(exc, Site.STEP_LEDGER_WRITE)
        if step & 63 == 1:  # the first step, then every 64th: cheap enough for the step path
            self.devices.note_program_device()

    # -- coherent halt (docs/halt.md): the HaltController's, as integrations and api.py ask ------

    @property
    def halt(self) -> Any:
        """The ``HaltRequest`` this rank follows (None: none)."""
        return self.halts.request

    @property
    def halt_step(self) -> int | None:
        """The step this rank halted at, once the target step completed (None: not halted)."""
        return self.halts.step

    def halt_record(self) -> dict[str, Any] | None:
        """The rank's halt, for its end file and run.json (None: not halted)."""
        return self.halts.record()

    def halt_reached_here(self) -> bool:
        """The halt's step is done, and this is the thread it stops (integrations ask)."""
        return self.halts.reached_here()

    def leave_halt_to_caller(self) -> None:
        """A framework stops its loop its own way: no ``Halt`` at the next phase."""
        self.halts.leave_to_caller()

    def raise_halt(self) -> None:
        """Raises ``Halt`` for the step reached (a framework that trained on after its stop)."""
        self.halts.raise_halt()

    def _poll_controls(self, mono: float) -> None:
        with guarded:
            self.halts.poll()
        self.memory.poll(mono, lambda msg, **fields: self.outputs.heartbeat_write(self._heartbeat(msg, **fields)))

    def _phase_fields(self) -> dict[str, Any]:
        phase, seconds = current_phase(self.training, time.time_ns())
        return {"phase": phase, "phase_s": seconds} if phase is not None else {"phase": None}

    def _blob_uri(self, span_id: str, kind: str) -> str:
        return (self.run_dir / "snapshots" / span_id / f"{kind}.safetensors").resolve().as_uri()

    def _snapshot_sink(self, records: list[dict[str, Any]], job: Any) -> None:
        self.snapshot_rows.append((records, job))

    # -- stop ----------------------------------------------------------------------------------

    def drops(self) -> dict[str, int]:
        return {
            "phase_rows_evicted": self.phase_rows.evicted,
            "progress_rows_evicted": self.progress_rows.evicted,
            "phase_rows_dropped_at_stop": self.drain.dropped_at_stop["phases"],
            "progress_rows_dropped_at_stop": self.drain.dropped_at_stop["progress"],
            "rows_unwritable": self.outputs.rows_unwritable,
            "error_events_evicted": self.error_events.evicted,
            "sink_records_dropped": self.outputs.sink_dropped,
            "span_rows_evicted": self.spans.closed.evicted,
            "mark_rows_evicted": self.spans.marks.evicted,
            "spans_over_depth_cap": self.spans.depth_dropped,
            **self.sealer.drops(),
            "gpu_timing_pool_exhausted": getattr(self.training.gpu_timer, "pool_exhausted", 0),
            "gpu_timing_unresolved": getattr(self.training.gpu_timer, "unresolved_dropped", 0),
            "gpu_timing_record_failed": getattr(self.training.gpu_timer, "record_failed", 0),
            "wire_rows_dropped": self.sender.rows_dropped if self.sender is not None else 0,
        }

    def stop(self, status: SessionStatus = "completed", timeout: float = 2.0, exit_code: int | None = None) -> None:
        """Writes what is queued until ``timeout`` seconds from now, then closes the session with
        ``status``. Idempotent.

        Rows still queued at the deadline are counted (``*_dropped_at_stop``), not written; the
        stop record, the closing of the files and (when configured) the exporter's and the
        sender's last batch come after it. A sampler stuck past the deadline closes the session
        itself once its tick returns.
        """
        if self._stopped:
            return
        self._stopped = True
        torch_attach.cancel(self)
        deadline = time.monotonic() + max(0.0, float(timeout))
        if not self.sampler.stop(deadline, (status, max(0.0, float(timeout)), exit_code), now=time.monotonic):
            report_internal(TimeoutError(f"sampler busy past the {timeout} s stop deadline; "
                                         "it closes the session when its write returns"), Site.STOP_HANDOFF)
            return
        try:
            self._stop_locked(status, timeout, exit_code, deadline)
        finally:
            self.sampler.lock.release()

    def _finish_handed_off(self, handoff: tuple[SessionStatus, float, int | None]) -> None:
        """A stop the sampler runs, when ``stop`` could not wait for its tick."""
        status, timeout, exit_code = handoff
        self._stop_locked(status, timeout, exit_code, time.monotonic() + timeout)

    def _launcher_ending(self, status: SessionStatus) -> tuple[SessionStatus, dict[str, Any]]:
        """A stop because ``stepwatch run`` died (``kill -9``, its terminal closed): the kernel's
        parent-death SIGTERM, not the end of the training. Said as such in the stop records."""
        launcher = launcher_gone()
        if launcher is None:
            return status, {}
        return ("interrupted" if status == "completed" else status), {
            "ended_by": "launcher_died", "launcher_pid": launcher,
            "reason": f"the launcher (stepwatch run, pid {launcher}) died; the job was stopped with it"}

    def _stop_locked(self, status: SessionStatus, timeout: float, exit_code: int | None, deadline: float) -> None:
        if not self.opened:  # a child that never stepped nor joined a process group: no trace
            if self.patches is not None:
                with guarded:
                    self.patches.uninstall()
            return
        status, ending = self._launcher_ending(status)
        self._ended_with_launcher = bool(ending)
        with guarded:  # first: the deadline bounds this, not the exporter's wait below
            self.drain.run(deadline)
        if self.patches is not None:
            with guarded:
                self.patches.uninstall()
        with guarded:
            self.training.finish()
        with guarded:
            self.spans.close_all()
            if self.training.gpu_timer is not None:  # the last steps' GPU time, not dropped
                self.training.gpu_timer.settle(min(1.0, max(0.0, deadline - time.monotonic())))
            self.sealer.seal(final=True)
        if self.exporter is not None:
            with guarded:
                self.exporter.close(timeout)
        with guarded:
            self.devices.sample(time.time(), self.factory, self.outputs.write)
            self.drain.run(deadline)  # an error event recorded meanwhile (phases and progress are off now)
        with guarded:
            self.outputs.write(self.factory.point(
                "stop", context=f"stepwatch capture stopped ({status})",
                metadata={"dropped": self.drops(), "internal_errors": sum(swallowed().values()),
                          "outcome": self.outcome(),
                          "collector_failures": self.devices.failures(),
                          **ending},
            ))
        first_error = next((e for e in self.failures if e.get("fatal")), None)
        with guarded:
            self.outputs.heartbeat_write(self._heartbeat("stop", status=status, error=first_error, **ending,
                                                  outcome=self.outcome()))
            self.heartbeat.close()
        self._write_rank_end()
        # before the network's goodbyes, which may wait on an aggregator that is going too
        if self.identity.rank == 0 and (not self.launched or ending):
            with guarded:  # a dead launcher cannot write its run.json: rank 0 says how the run ended
                manifest = read_run_manifest(self.run_dir)
                manifest.status = status
                manifest.ended_at_ns = time.time_ns()
                manifest.exit_code = exit_code
                manifest.outcome = self.outcome()
                manifest.error = next((e for e in self.failures if e.get("fatal")), None) or self.halts.record()
                manifest.errors = list(self.failures)
                if ending:
                    manifest.extra.update(ending)
                write_run_manifest(self.run_dir, manifest)
        if self.sender is not None:
            with guarded:
                self.outputs.ship()
                self.sender.close(min(timeout, 1.0))
        with guarded:
            self.session = self.sink.close(status) or self.session
        ledger, self._ledger, self._ledger_write = self._ledger, None, None
        if ledger is not None:
            with guarded:
                ledger.close(time.time_ns())  # after the last step (training.finish) went in
