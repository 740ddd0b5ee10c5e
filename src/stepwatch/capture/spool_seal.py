"""Spans, marks and snapshots from the training thread's tables to the spool (and the aggregator).

At every sampler tick with an aggregator the closed spans and marks are shipped early, so they are
in the history within about a second; every spool interval (and once more at stop) they are sealed
into a spool batch with the snapshots and their blobs. A batch a full or vanished disk refuses is
lost, and counted.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..artifacts.spool import SpoolWriter
from ..guard import Site, guarded, report_internal
from .spans import SpanRecorder
from .tables import BoundedTable

__all__ = ["SpoolSealer"]


class SpoolSealer:
    """Seals one rank's spool batches. ``gpu_timer`` returns the training state's GPU timer (set
    late, once CUDA is in use); ``wire(kind, rows)`` queues rows for the aggregator (None: no
    aggregator): spans and marks as their wire rows (``spans.SpanWireRow``, ``MarkWireRow``),
    snapshots as records; ``exporter`` submits each written batch over HTTP (None: no exporter)."""

    def __init__(self, spans: SpanRecorder, snapshot_rows: BoundedTable[tuple[list[dict[str, Any]], Any]],
                 spool: SpoolWriter, run_dir: Path, *, gpu_timer: Callable[[], Any],
                 wire: Callable[[str, list[Any]], None] | None, exporter: Any = None) -> None:
        self.spans = spans
        self.snapshot_rows = snapshot_rows
        self.spool = spool
        self.run_dir = run_dir
        self._gpu_timer = gpu_timer
        self._wire = wire
        self.exporter = exporter
        self._shipped_spans: list[Any] = []  # sent to the aggregator ahead of the next seal
        self._shipped_marks: list[Any] = []
        self.write_lost = 0

    def ship_early(self) -> None:
        """Between seals the aggregator still gets closed spans and marks at every tick; the next
        spool batch holds them too."""
        if self._wire is None:
            return
        span_rows: list[Any] = []
        mark_rows: list[Any] = []
        self._shipped_spans.extend(self.spans.span_records(self._gpu_timer(), final=False, rows=span_rows))
        self._shipped_marks.extend(self.spans.mark_records(rows=mark_rows))
        self._wire("spans", span_rows)
        self._wire("marks", mark_rows)

    def seal(self, final: bool = False) -> None:
        """Writes closed spans (those whose GPU time is resolved), marks and snapshots as a batch."""
        # Records (msgspec Structs) are built here, on this thread, by the recorder (spans.py), in
        # one pass with their wire rows when there is an aggregator.
        wire = self._wire is not None
        span_rows: list[Any] | None = [] if wire else None
        mark_rows: list[Any] | None = [] if wire else None
        fresh_spans: list[Any] = self.spans.span_records(self._gpu_timer(), final=final, rows=span_rows)
        fresh_marks: list[Any] = self.spans.mark_records(rows=mark_rows)
        spans = self._shipped_spans + fresh_spans
        marks = self._shipped_marks + fresh_marks
        self._shipped_spans, self._shipped_marks = [], []
        snapshots: list[dict[str, Any]] = []
        for records, job in self.snapshot_rows.drain():
            snapshots.extend(records)
            if job is not None:
                from .snapshots import write_blobs

                with guarded:
                    write_blobs(job, self.run_dir / "snapshots" / job.span_id)
        if self._wire is not None:
            self._wire("spans", span_rows)
            self._wire("marks", mark_rows)
            self._wire("snapshots", snapshots)
        roots: list[Any] = []
        if final:
            # The session span gets a batch of its own, written last: a final batch over the byte
            # cap is split and its older pieces evicted, and that must not take the span that
            # everything else hangs under.
            roots = [span for span in spans if span.parent_id is None]
            spans = [span for span in spans if span.parent_id is not None]
        try:
            paths = self.spool.write(spans, marks, snapshots)
            paths += self.spool.write(roots, [], [])
        except OSError as exc:  # full or vanished disk: the batch is lost, and counted as such
            self.write_lost += len(spans) + len(roots) + len(marks) + len(snapshots)
            report_internal(exc, Site.SPOOL_WRITE)
            return
        if self.exporter is not None:
            for path in paths:
                self.exporter.submit(path)

    def drops(self) -> dict[str, int]:
        """What the spool lost, by cause (the stop record's ``dropped``)."""
        return {
            "snapshot_rows_evicted": self.snapshot_rows.evicted,
            "spool_batches_evicted": self.spool.evicted_batches,
            "spool_records_evicted": self.spool.evicted_records,
            "spool_records_dropped": self.spool.dropped_records,
            "spool_records_lost_to_write_errors": self.write_lost,
        }
