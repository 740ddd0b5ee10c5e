"""The coherent halt: ``<run>/.HALT``, the request that every rank stop at the same step.

A collective or a checkpoint is consistent only if every rank stops at the same step boundary,
so the request names a *step*, not a moment. ``request_halt`` writes it (atomically: a rank reads
the old file or the new one, never half of one); each rank's background thread reads it at its
tick and the training thread stops once it has completed that step (``docs/halt.md``).

The step stepwatch chooses (``at_step=None``) is one every rank can still reach::

    lead_s  = 2 * poll_s + 2.0                 # a rank sees the file within poll_s of its write
    reach_r = step_r + rate_r * (now - seen_r + lead_s)   # where rank r will be by then
    target  = max(floor(max_r reach_r) + 1, max_r step_r + 1)

``step_r`` is rank r's latest completed step, ``seen_r`` when that was known, ``rate_r`` its
steps/s (its step ledger, else its heartbeat file; the fastest over its last 10, 50 and 200
steps, so a stall in the window does not make the step too near), ``poll_s`` the slowest rank's tick period
(1 s by default). Twice the poll period plus two seconds is the margin for a rank that is one
tick late and for the clocks of the ranks' files.
"""

from __future__ import annotations

import getpass
import math
import os
import socket
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec

from .._decode import DECODE_FAILURES
from ..errors import ArtifactError, StepwatchError
from ._files import atomic_write_bytes
from .live_ranks import RankProcess, live_ranks, require_run_dir

__all__ = ["HALT_FILENAME", "HaltRefused", "HaltRequest", "choose_halt_step", "read_halt", "request_halt"]

HALT_FILENAME = ".HALT"
HALT_SCHEMA_VERSION = 1
DEFAULT_POLL_S = 1.0
_MARGIN_S = 2.0


class HaltRefused(StepwatchError, ValueError):
    """The halt cannot be requested as asked (the step has passed, no rank runs); nothing was
    written."""


class HaltRequest(msgspec.Struct, kw_only=True, frozen=True):
    """The content of ``<run>/.HALT``.

    ``target_step``: the ranks stop once they have completed this many steps (the step counter
    of the heartbeat and the summary). ``chosen``: stepwatch chose it (no ``--at-step``);
    ``basis`` then holds what each rank's files said (step, when, rate) and ``lead_s``.
    ``session_id``: the session it is meant for (a rank of another session ignores it).
    """

    target_step: int
    reason: str
    requested_at: float
    iso: str
    by: str
    session_id: str | None = None
    chosen: bool = False
    basis: dict[str, Any] = msgspec.field(default_factory=dict)
    schema_version: int = HALT_SCHEMA_VERSION


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _who() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name in a bare container
        user = str(os.getuid()) if hasattr(os, "getuid") else "unknown"
    return f"{user}@{socket.gethostname()} pid {os.getpid()}"


def choose_halt_step(ranks: list[RankProcess], *, now: float | None = None) -> tuple[int, dict[str, Any]]:
    """(target step, the basis it was chosen from): the module docstring's formula."""
    if not ranks:
        raise HaltRefused("no running rank to choose a step from")
    now = time.time() if now is None else now
    poll_s = max((r.poll_s for r in ranks if r.poll_s), default=DEFAULT_POLL_S)
    lead_s = 2 * poll_s + _MARGIN_S
    reach = 0.0
    basis: dict[str, Any] = {"lead_s": lead_s, "poll_s": poll_s, "ranks": {}}
    for r in ranks:
        rate = r.steps_per_s or 0.0
        projected = r.step + rate * max(0.0, now - r.step_ts + lead_s)
        reach = max(reach, projected)
        basis["ranks"][r.name] = {"step": r.step, "seen_at": round(r.step_ts, 3),
                                  "steps_per_s": round(rate, 3) if r.steps_per_s else None,
                                  "reach": round(projected, 1)}
    target = max(math.floor(reach) + 1, max(r.step for r in ranks) + 1)
    return target, basis


def request_halt(run_dir: str | os.PathLike[str], *, at_step: int | None = None,
                 reason: str = "requested with stepwatch halt", by: str | None = None,
                 keep_pending: bool = False) -> HaltRequest:
    """Writes ``<run>/.HALT`` and returns it. ``keep_pending``: a halt this session has already
    been asked for is returned as it is, not moved (an alert action must not re-target ranks
    that are on their way to the step another request named).

    ``at_step`` None: stepwatch chooses a step every running rank can still reach (module
    docstring). An ``at_step`` some rank has already completed is refused (``HaltRefused``):
    the ranks could no longer stop together. Raises ``ArtifactError`` when ``run_dir`` is not a
    run directory or the file cannot be written; nothing is left half-written.
    """
    root = require_run_dir(run_dir)
    ranks = live_ranks(root)
    if at_step is not None and (type(at_step) is not int or at_step < 1):
        raise HaltRefused(f"--at-step must be a step number >= 1, got {at_step!r}")
    now = time.time()
    basis: dict[str, Any] = {}
    if at_step is None:
        if not ranks:
            raise HaltRefused(f"{root}: no rank is running (every rank has stopped or none has started): "
                              "nothing to halt; give --at-step to halt a job that has not started yet")
        target, basis = choose_halt_step(ranks, now=now)
    else:
        ahead = max(ranks, key=lambda r: r.step, default=None)
        if ahead is not None and ahead.step >= at_step:
            raise HaltRefused(f"step {at_step} has already passed: rank {ahead.rank} has completed step {ahead.step}; "
                              "omit --at-step to let stepwatch choose a step every rank can still reach")
        target = at_step
    sessions = {r.session_id for r in ranks if r.session_id}
    session_id = sessions.pop() if len(sessions) == 1 else _manifest_session(root)
    if keep_pending:
        try:
            pending = read_halt(root)
        except ArtifactError:  # a damaged .HALT: replaced
            pending = None
        if pending is not None and pending.session_id in (None, session_id):
            return pending
    request = HaltRequest(target_step=target, reason=str(reason)[:2000], requested_at=round(now, 6), iso=_iso(now),
                          by=by or _who(), session_id=session_id, chosen=at_step is None, basis=basis)
    path = root / HALT_FILENAME
    try:
        atomic_write_bytes(path, msgspec.json.encode(request))
    except OSError as exc:
        raise ArtifactError(path, f"cannot write: {exc.strerror or exc}") from exc
    return request


def read_halt(run_dir: str | os.PathLike[str]) -> HaltRequest | None:
    """``<run>/.HALT``, or None when there is none. ArtifactError naming the file and the field
    when it is not a halt request."""
    path = Path(run_dir) / HALT_FILENAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ArtifactError(path, f"cannot read: {exc.strerror or exc}") from exc
    return parse_halt(data, path)


def parse_halt(data: bytes, path: Path) -> HaltRequest:
    try:
        request = msgspec.json.decode(data, type=HaltRequest)
    except msgspec.ValidationError as exc:
        raise ArtifactError(path, f"not a halt request: {exc}") from None
    except DECODE_FAILURES as exc:
        raise ArtifactError(path, f"not valid JSON: {exc}") from None
    if request.target_step < 1:
        raise ArtifactError(path, f"target_step must be >= 1, got {request.target_step}", field="$.target_step")
    return request


def _manifest_session(root: Path) -> str | None:
    try:
        from .run_manifest import read_run_manifest

        return read_run_manifest(root).session_id or None
    except Exception:  # noqa: BLE001 - no run.json (a job run with stepwatch.init alone)
        return None
