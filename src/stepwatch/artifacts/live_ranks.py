"""The ranks of a run directory as processes: pid, host, whether they still run, their latest
step and step rate. Read from the heartbeat files (the ``boot`` record names the process and
what it registered) and the step ledgers (the exact latest step, written on every step).

For the tools that act on a running job from outside (``stepwatch halt``, ``dump-stacks``,
memory snapshots); nothing here writes, and nothing here imports torch.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from .._decode import DECODE_FAILURES
from ..errors import ArtifactError
from ._files import process_alive

__all__ = ["HEARTBEAT_FILE", "RankProcess", "is_run_dir", "live_ranks", "rank_processes", "require_run_dir"]

HEARTBEAT_FILE = re.compile(r"^heartbeat_rank(\d+)((?:-p\d+)?)\.jsonl$")  # also a second process of a rank's
_CHUNK = 256 * 1024
_ROTATED = 3  # heartbeat_rank<N>.jsonl.1 .. .3 (artifacts/heartbeat.py keeps three)
_RATE_WINDOW = 200  # ledger records the step rate is measured over
_decoder = msgspec.json.Decoder()


@dataclass(frozen=True)
class RankProcess:
    """One rank's latest process, as its files describe it.

    ``name`` is the file stem (``rank<N>``, or ``rank<N>-p<pid>`` for a second process of the
    same rank). ``step`` counts the steps it completed; ``step_ts`` is when the latest of them
    was known; ``steps_per_s`` its recent rate (None while unknown). ``stack_signal`` and
    ``stack_file`` are set when the rank registered a stack dump signal (``docs/stacks.md``);
    ``poll_s`` is how often its background thread looks at request files.
    """

    rank: int
    name: str
    pid: int
    host: str | None
    session_id: str | None
    booted_at: float
    stopped: bool
    step: int
    step_ts: float
    steps_per_s: float | None
    stack_signal: int | None
    stack_file: str | None
    poll_s: float | None
    heartbeat: Path

    @property
    def local(self) -> bool:
        """On this host (a rank of another node can be read, not signalled)."""
        return self.host is None or self.host == socket.gethostname()

    def alive(self) -> bool:
        """Still running: no stop record after its boot, and its pid is that process (not reused)."""
        if self.stopped:
            return False
        return process_alive(self.host or socket.gethostname(), self.pid, int(self.booted_at * 1e9))


def is_run_dir(path: Path) -> bool:
    """A directory stepwatch wrote: a run manifest or a rank's heartbeat file."""
    if not path.is_dir():
        return False
    if (path / "run.json").is_file():
        return True
    return any(HEARTBEAT_FILE.match(p.name) for p in path.glob("heartbeat_rank*.jsonl"))


def require_run_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` as a run directory, or ArtifactError saying what it is instead."""
    run_dir = Path(path)
    if not run_dir.exists():
        raise ArtifactError(run_dir, "no such directory")
    if not run_dir.is_dir():
        raise ArtifactError(run_dir, "not a directory (give the run directory)")
    if not is_run_dir(run_dir):
        raise ArtifactError(run_dir, "not a run directory: no run.json and no heartbeat_rank<N>.jsonl")
    return run_dir


def rank_processes(run_dir: str | os.PathLike[str]) -> list[RankProcess]:
    """Every rank process with a boot record in ``run_dir``, by rank then name."""
    root = Path(run_dir)
    found: list[RankProcess] = []
    for path in sorted(root.glob("heartbeat_rank*.jsonl")):
        match = HEARTBEAT_FILE.match(path.name)
        if match is None:
            continue
        described = _describe(path, int(match.group(1)), f"rank{match.group(1)}{match.group(2)}")
        if described is not None:
            found.append(_with_ledger(root, described))
    return sorted(found, key=lambda r: (r.rank, r.name))


def live_ranks(run_dir: str | os.PathLike[str]) -> list[RankProcess]:
    """The rank processes still running (from the files; a rank on another host counts as
    running while its files say so)."""
    return [r for r in rank_processes(run_dir) if (r.alive() if r.local else not r.stopped)]


# -- reading -----------------------------------------------------------------------------------


def _describe(path: Path, rank: int, name: str) -> RankProcess | None:
    """The latest boot record of the file (or of its rotated files), what followed it."""
    after: list[dict[str, Any]] = []  # records after the boot, newest first
    for candidate in [path, *(path.with_name(f"{path.name}.{i}") for i in range(1, _ROTATED + 1))]:
        if not candidate.is_file():
            break
        boot = None
        for record in _records_backward(candidate):
            if record.get("msg") == "boot":
                boot = record
                break
            if len(after) < 4096:
                after.append(record)
        if boot is not None:
            return _from_boot(path, rank, name, boot, after)
    return None


def _records_backward(path: Path) -> Any:
    """The file's JSON records, last first, reading from the end a chunk at a time; lines that
    do not decode (a torn tail) are skipped."""
    try:
        with path.open("rb") as file:
            end = file.seek(0, os.SEEK_END)
            rest = b""
            while end > 0:
                start = max(0, end - _CHUNK)
                file.seek(start)
                data = file.read(end - start) + rest
                end = start
                lines = data.split(b"\n")
                rest = lines[0] if start > 0 else b""
                for raw in reversed(lines[1:] if start > 0 else lines):
                    record = _decode(raw)
                    if record is not None:
                        yield record
            if rest:
                record = _decode(rest)
                if record is not None:
                    yield record
    except OSError:
        return


def _decode(raw: bytes) -> dict[str, Any] | None:
    if not raw.strip():
        return None
    try:
        record = _decoder.decode(raw)
    except DECODE_FAILURES:
        return None
    return record if isinstance(record, dict) else None


def _int(value: Any) -> int | None:
    return value if type(value) is int else None


def _num(value: Any) -> float | None:
    return float(value) if type(value) in (int, float) else None


def _from_boot(path: Path, rank: int, name: str, boot: dict[str, Any], after: list[dict[str, Any]]) -> RankProcess | None:
    pid = _int(boot.get("pid"))
    booted = _num(boot.get("ts"))
    if pid is None or booted is None:
        return None
    stopped = any(r.get("msg") == "stop" for r in after)
    stepped = [(r["step"], r["ts"]) for r in after if type(r.get("step")) is int and _num(r.get("ts")) is not None]
    step, step_ts = (stepped[0] if stepped else (_int(boot.get("step")) or 0, booted))
    rate = _fastest_rate([(s, t) for s, t in reversed(stepped) if t >= step_ts - 60.0], min_span_s=1.0)
    host = boot.get("host")
    session = boot.get("session_id")
    signal_number = _int(boot.get("stack_signal"))
    stack_file = boot.get("stack_file")
    return RankProcess(rank=rank, name=name, pid=pid, host=host if isinstance(host, str) else None,
                       session_id=session if isinstance(session, str) else None, booted_at=booted, stopped=stopped,
                       step=step, step_ts=step_ts, steps_per_s=rate, stack_signal=signal_number,
                       stack_file=stack_file if isinstance(stack_file, str) else None,
                       poll_s=_num(boot.get("poll_s")), heartbeat=path)


def _fastest_rate(points: list[tuple[int, float]], *, min_span_s: float = 0.0) -> float | None:
    """Steps per second from (step, time) points, oldest first: the fastest over the last 10, 50
    and all of them. The fastest, because a stall inside the window (a slow rank, a checkpoint)
    would make the average too slow, and a halt step chosen from too slow a rate is one a rank
    has passed before it reads the request."""
    best = None
    if len(points) < 2:
        return None
    last_step, last_ts = points[-1]
    for size in (10, 50, len(points)):
        first_step, first_ts = points[max(0, len(points) - size)]
        span = last_ts - first_ts
        if span > 0 and span >= min_span_s and last_step > first_step:
            rate = (last_step - first_step) / span
            best = rate if best is None else max(best, rate)
    return best


def _with_ledger(run_dir: Path, rank: RankProcess) -> RankProcess:
    """The step ledger's latest step and rate where it is newer than the heartbeat's: it is
    written on every step, the heartbeat only every few seconds."""
    path = run_dir / "ledger" / f"rank{rank.rank}-{rank.pid}.steps"
    if not path.is_file():
        return rank
    from .step_ledger import read_ledger

    try:
        ledger = read_ledger(path)
    except (ArtifactError, OSError):
        return rank
    records = ledger.records
    if not records:
        return rank
    last = records[-1]
    step, step_ts = last.index + 1, last.end_ns / 1e9
    if step < rank.step:
        return rank
    rate = _fastest_rate([(r.index, r.end_ns / 1e9) for r in records[-_RATE_WINDOW:]])
    rate = rate if rate is not None else rank.steps_per_s
    return RankProcess(**{**rank.__dict__, "step": step, "step_ts": step_ts, "steps_per_s": rate})
