"""The files and connections one rank opens once its rank is known: its telemetry sink (and the
session in it), its step ledger, its heartbeat file, the shared spool, and, when configured, the
HTTP exporter and the aggregator's sender; rank 0 of a job stepwatch did not launch also writes
the run manifest.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..artifacts.heartbeat import HeartbeatWriter
from ..artifacts.run_manifest import RunManifest, current_versions, write_run_manifest
from ..artifacts.sink import TelemetrySink
from ..artifacts.spool import SpoolWriter
from ..artifacts.step_ledger import StepLedger
from ..guard import Site, report_internal
from ..schema import SessionSummary
from .config import RuntimeConfig
from .events import EventFactory
from .identity import DistributedIdentity

__all__ = ["RankArtifacts", "open_rank_artifacts"]


@dataclass
class RankArtifacts:
    """What ``open_rank_artifacts`` opened; ``ledger`` None when the disk had no room for it,
    ``exporter`` and ``sender`` None when not configured."""

    sink: TelemetrySink
    session: SessionSummary
    ledger: StepLedger | None
    factory: EventFactory
    heartbeat: HeartbeatWriter
    spool: SpoolWriter
    exporter: Any
    sender: Any


def open_rank_artifacts(config: RuntimeConfig, identity: DistributedIdentity, run_dir: Path, *, session_id: str,
                        started_ns: int, host: str, pid: int, suffix: str = "", launched: bool = False,
                        child: bool = False) -> RankArtifacts:
    """Opens the rank's artifacts under ``run_dir`` (``suffix`` keeps the files of a second
    process with the same rank apart; ``launched``: the launcher writes the run manifest;
    ``child``: a process the training process started, which never adopts the spool)."""
    rank = identity.rank
    sink = TelemetrySink(run_dir / "telemetry" / f"rank{rank}{suffix}", config.sink)
    ledger = _open_ledger(run_dir, session_id, rank, started_ns)
    session = sink.start_session(SessionSummary(
        session_id=session_id, status="running", started_at_ns=started_ns, host=host, pid=pid,
        job_id=identity.job_id, rank=rank, local_rank=identity.local_rank, world_size=identity.world_size,
        source="stepwatch.runtime"))
    factory = EventFactory(session_id=session_id, identity=identity, host=host, pid=pid,
                           interval_ms=int(round(config.interval * 1000)))
    heartbeat = HeartbeatWriter(run_dir, rank, name=f"rank{rank}{suffix}" if suffix else None)
    from .. import __version__

    spool = SpoolWriter(run_dir / "spool", sdk_version=__version__, max_bytes=config.spool_max_bytes,
                        adopt_existing=(config.world_size or 1) <= 1 and not child)  # ranks share <run>/spool
    exporter = sender = None
    if config.endpoint and config.api_key:
        from ..transport.http_exporter import HttpExporter

        exporter = HttpExporter(config.endpoint, config.api_key, sdk_version=__version__, spool_root=run_dir)
    if config.aggregator:
        from ..transport.sender import FrameSender, parse_address

        sender = FrameSender(parse_address(config.aggregator), {
            "session_id": session_id, "rank": rank, "local_rank": identity.local_rank,
            "world_size": identity.world_size, "job_id": identity.job_id, "host": host, "pid": pid,
            "started_ns": started_ns,
        })
    if rank == 0 and not launched:
        write_run_manifest(run_dir, RunManifest(session_id=session_id, started_at_ns=started_ns,
                                                command_line=list(sys.argv), world_size=identity.world_size, pid=pid,
                                                versions=current_versions()))
    return RankArtifacts(sink, session, ledger, factory, heartbeat, spool, exporter, sender)


def _open_ledger(run_dir: Path, session_id: str, rank: int, started_ns: int) -> StepLedger | None:
    """This rank's step ledger (artifacts/step_ledger.py): the steps a SIGKILL would take with
    it survive in its pages. None (and said once) when the disk has no room for it."""
    try:
        return StepLedger.create(run_dir, session_id, rank=rank, started_ns=started_ns)
    except (OSError, ValueError) as exc:
        report_internal(exc, Site.STEP_LEDGER_CREATE)
        return None
