"""Where one rank's records go: its telemetry sink, its heartbeat file and, with an aggregator,
the rows shipped to it at each tick; and the last records kept for an OOM bundle.

Written by the sampler thread, and by ``stop`` once the sampler has given way: never by two
threads at once. A record that cannot be written is counted (``sink_dropped``: a full or vanished
disk; ``rows_unwritable``: a record that could not be built or encoded), never raised.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ..artifacts.heartbeat import HeartbeatWriter
from ..artifacts.sink import RecordNotEncodable, TelemetrySink
from ..guard import Site, guarded, report_internal
from ..schema import TelemetryEventV3
from ..transport.frames import COLUMNAR

__all__ = ["BUILT_COLUMNAR", "WIRE_KINDS", "RankOutputs"]

WIRE_KINDS = ("telemetry", "spans", "marks", "snapshots", "heartbeat")
BUILT_COLUMNAR = ("spans", "marks")  # queued as columnar rows already (``wire``)


class RankOutputs:
    """The rank's outlets. ``sender``: the aggregator's frame sender (None: no aggregator);
    ``recent``: how many of the last telemetry records an OOM bundle gets."""

    def __init__(self, sink: TelemetrySink, heartbeat: HeartbeatWriter, *, sender: Any = None, recent: int = 256) -> None:
        self.sink = sink
        self.heartbeat = heartbeat
        self.sender = sender
        self.recent: deque[TelemetryEventV3] = deque(maxlen=recent)
        self._wire: dict[str, list[Any]] = {kind: [] for kind in WIRE_KINDS}
        self.sink_dropped = 0
        self.rows_unwritable = 0

    def write(self, event: TelemetryEventV3) -> None:
        """A telemetry record: to the sink, the OOM ring and the aggregator."""
        if self.sender is not None:
            self._wire["telemetry"].append(event)
        # No lock: deque.append is atomic under the GIL, and record_oom's list(recent) runs in C
        # without running Python code, so it cannot see the deque change mid-copy.
        self.recent.append(event)
        sink = self.sink
        try:
            sink.append(event)
        except OSError as exc:  # disk full or gone: keep memory bounded, count what is lost
            self.sink_dropped += sink.discard_buffer()
            report_internal(exc, Site.SINK_APPEND)
        except RecordNotEncodable as exc:  # this record, or one batched before it: dropped
            self.rows_unwritable += exc.dropped
            report_internal(exc, Site.SINK_ENCODE)
        except Exception as exc:  # noqa: BLE001 - a record the sink could not encode (it drops
            # that one and raises, maybe from a later append): the rest of the chunk goes on
            self.rows_unwritable += 1
            report_internal(exc, Site.SINK_ENCODE)

    def flush_sink(self) -> None:
        """The sink's batched records to disk, when its flush interval says so."""
        sink = self.sink
        try:
            sink.maybe_flush()
        except OSError as exc:
            self.sink_dropped += sink.discard_buffer()
            report_internal(exc, Site.SINK_FLUSH)
        except RecordNotEncodable as exc:  # a batched record dropped as the flush encoded it
            self.rows_unwritable += exc.dropped
            report_internal(exc, Site.SINK_ENCODE)

    def heartbeat_write(self, record: dict[str, Any]) -> None:
        """A heartbeat record: to the rank's heartbeat file and the aggregator."""
        self.heartbeat.write(record)
        if self.sender is not None:
            self._wire["heartbeat"].append(record)

    def wire(self, kind: str, rows: list[Any]) -> None:
        """Rows of ``kind`` (``WIRE_KINDS``) for the aggregator's next frame: spans and marks as
        the columnar rows the span recorder built with their spool records (``spans.SpanWireRow``,
        ``MarkWireRow``), the others as records."""
        self._wire[kind].extend(rows)

    def ship(self) -> None:
        """Sends the rows new since the last tick to the aggregator (when there is one)."""
        if self.sender is None:
            return
        wire, self._wire = self._wire, {kind: [] for kind in WIRE_KINDS}
        for kind in BUILT_COLUMNAR:
            rows = wire.pop(kind)
            if rows:
                wire[kind] = {"columns": COLUMNAR[kind], "rows": rows}  # type: ignore[assignment]
        with guarded:
            self.sender.ship(wire)
