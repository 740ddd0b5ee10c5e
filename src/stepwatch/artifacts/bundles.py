"""OOM flight-recorder bundles and standalone diagnose bundles (manifest schema 2).

Both tie back to their capture through ``session_id`` (spec: "Diagnose and OOM manifests").
Layouts follow telemetry-current-practice.md "Exports and bundles".
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from .._decode import read_json_file
from ..errors import ArtifactError
from ..schema import SessionSummary, TelemetryEventV3
from ._files import atomic_write_bytes
from .run_manifest import platform_text

__all__ = ["environment_info", "new_oom_bundle_dir", "read_bundle", "read_bundle_manifest", "write_diagnose_bundle",
           "write_oom_bundle"]

BUNDLE_SCHEMA_VERSION = 2
_encoder = msgspec.json.Encoder()
_seq = iter(range(1, 1 << 62))


def _dump(path: Path, value: Any) -> str:
    atomic_write_bytes(path, msgspec.json.format(_encoder.encode(value), indent=2), fsync=False)
    return path.name


def read_bundle_manifest(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``manifest.json`` of a bundle (ours or Stormlog's, schema 2).

    Raises:
        ArtifactError: naming the file that is missing, not JSON (nested too deeply included)
            or not a bundle manifest.
    """
    path = Path(directory) / "manifest.json"
    manifest = read_json_file(path, what="bundle manifest is not valid JSON")
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
        raise ArtifactError(path, "not a bundle manifest (an object with a list of files)", field="$.files")
    return manifest


def read_bundle(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Every JSON file a bundle's manifest lists, decoded, by name (``manifest.json`` too).

    Raises:
        ArtifactError: naming the first file that cannot be read as JSON.
    """
    root = Path(directory)
    manifest = read_bundle_manifest(root)
    files: dict[str, Any] = {"manifest.json": manifest}
    for name in manifest["files"]:
        if isinstance(name, str) and name.endswith(".json") and name != "manifest.json" and "/" not in name:
            files[name] = read_json_file(root / name)
    return files


def environment_info() -> dict[str, Any]:
    """Host, Python, torch and device inventory, without initialising any accelerator."""
    import psutil

    memory = psutil.virtual_memory()
    info: dict[str, Any] = {
        "host": socket.gethostname(),
        "platform": platform_text(),
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "cpu_count": os.cpu_count(),
        "memory_total_bytes": memory.total,
        "memory_available_bytes": memory.available,
        "pid": os.getpid(),
        "devices": [{"kind": "cpu", "index": -1, "total_bytes": memory.total}],
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = str(torch.__version__)  # a TorchVersion (str subclass) msgspec cannot encode
        info["cuda_available"] = bool(torch.cuda.is_available())
        if info["cuda_available"]:
            for index in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(index)
                info["devices"].append(
                    {"kind": "hip" if torch.version.hip else "cuda", "index": index, "name": props.name,
                     "total_bytes": int(props.total_memory)}
                )
            return info
    info["devices"] += _nvml_devices()  # a process without torch (the CLI) still sees the GPUs
    return info


def _nvml_devices() -> list[dict[str, Any]]:
    """NVIDIA GPUs as the driver lists them (no CUDA context); empty without nvidia-ml-py or a driver."""
    from ..nvml import load_nvml

    nvml = load_nvml()
    if nvml is None:
        return []
    devices = []
    try:
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            name = nvml.nvmlDeviceGetName(handle)
            devices.append({"kind": "cuda", "index": index, "source": "nvml",
                            "name": name.decode() if isinstance(name, bytes) else str(name),
                            "total_bytes": int(nvml.nvmlDeviceGetMemoryInfo(handle).total)})
    except Exception:  # noqa: BLE001 - a driver that stops answering leaves the inventory partial
        pass
    return devices


def _allocator_summary(backend: str) -> dict[str, Any]:
    torch = sys.modules.get("torch")
    if backend in ("cuda", "rocm") and torch is not None and torch.cuda.is_initialized():
        return {
            "backend": backend,
            "devices": {
                str(i): {k: v for k, v in torch.cuda.memory_stats(i).items() if k.endswith((".current", ".peak")) or "num_" in k}
                for i in range(torch.cuda.device_count())
            },
            "summary_text": torch.cuda.memory_summary(abbreviated=True),
        }
    import psutil

    info = psutil.Process().memory_info()
    summary: dict[str, Any] = {"backend": backend, "process_rss_bytes": info.rss, "process_vms_bytes": info.vms}
    mps = getattr(torch, "mps", None) if backend == "mps" else None
    if mps is not None:
        try:
            summary["mps_current_allocated_bytes"] = int(mps.current_allocated_memory())
            summary["mps_driver_allocated_bytes"] = int(mps.driver_allocated_memory())
        except Exception:  # noqa: BLE001 - the host view above is still a summary
            pass
    return summary


def _memory_snapshot(directory: Path) -> str | None:
    """torch's allocator snapshot, only when the program enabled memory-history recording."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    try:
        snapshot = torch.cuda.memory._snapshot()  # noqa: SLF001 - torch's documented snapshot entry point
        if not any(snapshot.get("device_traces") or []):
            return None  # history recording off: nothing beyond allocator_summary.json
        path = directory / "memory_snapshot.pickle"  # torch's own format, read by its memory_viz
        torch.cuda.memory._dump_snapshot(str(path))  # noqa: SLF001 - likewise
        return path.name
    except Exception:  # noqa: BLE001 - a bundle without the snapshot is still a bundle
        return None


def new_oom_bundle_dir(root: Path, backend: str) -> Path:
    """The path of the next ``oom_dump_<UTC>_<pid>_<backend>_<seq>/`` under ``root`` (not created):
    named first so that the error record can point at its bundle, which holds that record."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return root / f"oom_dump_{stamp}_{os.getpid()}_{backend}_{next(_seq)}"


def write_oom_bundle(
    root: Path,
    *,
    reason: str,
    backend: str,
    session: SessionSummary,
    events: list[TelemetryEventV3],
    metadata: dict[str, Any],
    directory: Path | None = None,
) -> Path:
    """Writes ``oom_dump_<UTC>_<pid>_<backend>_<seq>/`` under ``root`` (or ``directory``, from
    ``new_oom_bundle_dir``); returns its path."""
    directory = directory or new_oom_bundle_dir(root, backend)
    directory.mkdir(parents=True, exist_ok=True)
    files = [
        _dump(directory / "metadata.json", metadata),
        _dump(directory / "environment.json", environment_info()),
        _dump(directory / "events.json", events),
        _dump(directory / "allocator_summary.json", _allocator_summary(backend)),
    ]
    snapshot = _memory_snapshot(directory)
    if snapshot:
        files.append(snapshot)
    _dump(
        directory / "manifest.json",
        {
            "schema_version": BUNDLE_SCHEMA_VERSION,
            "kind": "oom_flight_recorder",
            "reason": reason,
            "backend": backend,
            "event_count": len(events),
            "session_id": session.session_id,
            "session_status": session.status,
            "session": session.ledger_entry(),
            "files": files,
        },
    )
    return directory


def write_diagnose_bundle(
    directory: Path,
    *,
    session: SessionSummary,
    timeline: dict[str, list[float]],
    summary: dict[str, Any],
    command_line: list[str],
    exit_code: int,
) -> Path:
    """Writes a standalone diagnose bundle into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    files = [
        _dump(directory / "environment.json", environment_info()),
        _dump(directory / "telemetry_timeline.json", timeline),
        _dump(directory / "diagnostic_summary.json", summary),
        _dump(directory / "report.json", {"session": session.ledger_entry(), **summary}),
    ]
    _dump(
        directory / "manifest.json",
        {
            "schema_version": BUNDLE_SCHEMA_VERSION,
            "kind": "diagnose",
            "files": files,
            "exit_code": exit_code,
            "risk_detected": bool(summary.get("risks")),
            "session_id": session.session_id,
            "session_status": session.status,
            "session": session.ledger_entry(),
            "command_line": command_line,
        },
    )
    return directory
