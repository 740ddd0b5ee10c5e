"""``stepwatch export tensorboard``: event files TensorBoard reads, one run folder per rank
(``rank_0/``, ``rank_1/``...), so its charts draw the ranks over each other, every scalar of
``tracker_data`` at its step and with the step's end as wall time.

Each rank's records are one file of a name fixed by the session,
``rank_N/events.out.tfevents.stepwatch-<session>`` (and ``summary/...``): written in a folder of
its own, then moved over the one an earlier export of the session left, so exporting again
replaces it (TensorBoard would draw every file of a folder: a second file would double each point),
and a TensorBoard reading the folder never sees half a file.

Written with tensorboard's own ``EventFileWriter`` (the ``tensorboard`` package, not torch:
``torch.utils.tensorboard`` writes the same records through it).
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .tracker_data import StepPoint, points_by_rank
from .trackers import require

__all__ = ["TensorboardStats", "event_file_name", "write_tensorboard"]


@dataclass(slots=True)
class TensorboardStats:
    folders: list[Path]
    scalars: int


def event_file_name(session_id: str) -> str:
    """The event file of ``session_id`` in each folder: TensorBoard reads a file whose name holds
    ``tfevents``; the session is kept to letters, digits, ``.``, ``_`` and ``-``."""
    return f"events.out.tfevents.stepwatch-{re.sub(r'[^A-Za-z0-9._-]', '_', session_id) or 'session'}"


@contextmanager
def _event_writer(out: Path, folder: Path, name: str, **options: Any) -> Iterator[Any]:
    """An ``EventFileWriter`` in a scratch folder under ``out``; on success its file replaces
    ``folder/name`` (``os.replace``: one step, on the same file system)."""
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".stepwatch-", dir=out))
    try:
        writer = EventFileWriter(str(scratch), flush_secs=3600, **options)
        try:
            yield writer
        finally:
            writer.close()
        (written,) = scratch.iterdir()
        folder.mkdir(parents=True, exist_ok=True)
        written.replace(folder / name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def write_tensorboard(points: list[StepPoint], out: Path, *, final: Mapping[str, float] | None = None,
                      text: Mapping[str, str] | None = None, session_id: str = "session") -> TensorboardStats:
    """One event file per rank, ``out/rank_N/<event_file_name(session_id)>``, replacing the one
    an earlier export of the session wrote; ``final`` (the summary's figures) and ``text``
    (params, shown in TensorBoard's text tab) go to ``out/summary`` at the last step."""
    require("tensorboard", "tensorboard")
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary

    name = event_file_name(session_id)
    folders: list[Path] = []
    scalars = 0
    last_step, last_ns = 0, 0
    for rank, series in sorted(points_by_rank(points).items()):
        folder = out / f"rank_{rank}"
        with _event_writer(out, folder, name, max_queue_size=1024) as writer:
            for point in series:
                values = [Summary.Value(tag=tag, simple_value=value) for tag, value in sorted(point.values.items())]
                writer.add_event(Event(wall_time=point.end_ns / 1e9, step=point.step, summary=Summary(value=values)))
                scalars += len(values)
                last_step, last_ns = max(last_step, point.step), max(last_ns, point.end_ns)
        folders.append(folder)
    if final or text:
        folder = out / "summary"
        with _event_writer(out, folder, name) as writer:
            values = [Summary.Value(tag=tag, simple_value=value) for tag, value in sorted((final or {}).items())]
            if text:
                values.append(_text_value(Summary, "params", text))
            writer.add_event(Event(wall_time=last_ns / 1e9, step=last_step, summary=Summary(value=values)))
            scalars += len(final or {})
        folders.append(folder)
    return TensorboardStats(folders, scalars)


def _text_value(summary: type, tag: str, params: Mapping[str, str]) -> object:
    """A markdown table of the params, as TensorBoard's text plugin stores it."""
    from tensorboard.compat.proto.summary_pb2 import SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

    rows = "\n".join(f"| {k} | {str(v).replace('|', '/')} |" for k, v in sorted(params.items()))
    table = f"| param | value |\n|---|---|\n{rows}".encode()
    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
    tensor = TensorProto(dtype=7, string_val=[table], tensor_shape=TensorShapeProto(dim=[]))  # 7: DT_STRING
    return summary.Value(tag=tag, metadata=metadata, tensor=tensor)  # type: ignore[attr-defined]
