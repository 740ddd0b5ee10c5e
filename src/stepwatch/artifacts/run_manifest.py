"""``run.json``: what a run directory is — session, command line, hosts, ranks, versions, status,
and how the training ended (``outcome``, ``error``, ``errors``: docs/run-outcome.md)."""

from __future__ import annotations

import platform
import socket
import sys
from pathlib import Path
from typing import Any

import msgspec

from .._decode import DECODE_FAILURES, undecodable
from ..errors import ArtifactError
from ._files import atomic_write_bytes

__all__ = ["RUN_MANIFEST", "RunManifest", "platform_text", "read_run_manifest", "run_session_id", "write_run_manifest",
           "write_run_manifest_in_place"]

RUN_MANIFEST = "run.json"


class RunManifest(msgspec.Struct, kw_only=True):
    schema_version: int = 1
    session_id: str
    status: str = "running"
    started_at_ns: int
    ended_at_ns: int | None = None
    command_line: list[str] = msgspec.field(default_factory=list)
    launcher: str = "init"
    hosts: list[str] = msgspec.field(default_factory=lambda: [socket.gethostname()])
    world_size: int = 1
    pid: int | None = None
    exit_code: int | None = None
    # how the training ended (docs/run-outcome.md): ``status`` stays the capture's session status
    outcome: str = "running"
    error: dict[str, Any] | None = None  # the error that decided the outcome (first fatal one)
    errors: list[dict[str, Any]] = msgspec.field(default_factory=list)  # every rank's, by time
    versions: dict[str, str] = msgspec.field(default_factory=dict)
    extra: dict[str, Any] = msgspec.field(default_factory=dict)


def platform_text() -> str:
    """The system, its release and the machine ("Linux-6.1.0-x86_64-with-glibc2.36": on Linux,
    ``platform.platform()``'s text) without reading the processor, which Python finds by running
    ``uname -p``: a training process (and the launcher) start no process for it (a fork beside
    CUDA's threads, a second lost where processes are slow to start)."""
    system = platform.uname()  # the processor is read only when asked for
    text = "-".join(part for part in (system.system, system.release, system.machine) if part)
    lib, version = platform.libc_ver()
    return f"{text}-with-{lib}{version}" if lib else text


def current_versions() -> dict[str, str]:
    from .. import __version__

    versions = {"stepwatch": __version__, "python": platform.python_version(), "platform": platform_text()}
    torch = sys.modules.get("torch")
    if torch is not None:
        versions["torch"] = str(getattr(torch, "__version__", "?"))
    return versions


def write_run_manifest(run_dir: Path, manifest: RunManifest) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(run_dir / RUN_MANIFEST, msgspec.json.format(msgspec.json.encode(manifest), indent=2))


def write_run_manifest_in_place(run_dir: Path, manifest: RunManifest) -> OSError | None:
    """``write_run_manifest``, and on a full disk (no room for the temporary copy) the new content
    over the old file's own blocks: not atomic, but the run's ending is recorded. Returns the
    error if neither worked (nothing raised: the caller says it and goes on)."""
    try:
        write_run_manifest(run_dir, manifest)
        return None
    except OSError as exc:
        error = exc
    try:
        with open(run_dir / RUN_MANIFEST, "r+b") as handle:
            handle.write(msgspec.json.format(msgspec.json.encode(manifest), indent=2))
            handle.truncate()
    except OSError:
        return error
    return None


def read_run_manifest(run_dir: Path) -> RunManifest:
    path = run_dir / RUN_MANIFEST
    try:
        return msgspec.json.decode(path.read_bytes(), type=RunManifest)
    except OSError as exc:
        raise ArtifactError(path, f"cannot read: {exc.strerror}") from exc
    except msgspec.ValidationError as exc:
        raise ArtifactError(path, f"invalid run manifest: {exc}") from None
    except DECODE_FAILURES as exc:
        raise ArtifactError(path, f"not valid JSON: {undecodable(exc)}") from None


class _SessionOnly(msgspec.Struct):
    session_id: str | None = None


def run_session_id(run_dir: Path) -> str | None:
    """The session the run directory's run.json names, or None (no run.json, not JSON, no
    session). Looser than ``read_run_manifest`` on purpose: the commands that only need to know
    which session is the run's own (``watch``, ``serve``, ``summary``, ``explain``) still find
    it in a manifest damaged elsewhere or written by a newer version."""
    try:
        value = msgspec.json.decode((run_dir / RUN_MANIFEST).read_bytes(), type=_SessionOnly).session_id
    except (OSError, msgspec.ValidationError, *DECODE_FAILURES):
        return None
    return value or None
