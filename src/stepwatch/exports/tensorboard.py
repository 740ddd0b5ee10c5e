"""``stepwatch export tensorboard``: event files TensorBoard reads, one run folder per rank
(``rank_0/``, ``rank_1/``...), so its charts draw the ranks over each other, every scalar of
``tracker_data`` at its step and with the step's end as wall time.

Written with tensorboard's own ``EventFileWriter`` (the ``tensorboard`` package, not torch:
``torch.utils.tensorboard`` writes the same records through it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .tracker_data import StepPoint, points_by_rank
from .trackers import require

__all__ = ["TensorboardStats", "write_tensorboard"]


@dataclass(slots=True)
class TensorboardStats:
    folders: list[Path]
    scalars: int


def write_tensorboard(points: list[StepPoint], out: Path, *, final: Mapping[str, float] | None = None,
                      text: Mapping[str, str] | None = None) -> TensorboardStats:
    """One event file per rank under ``out/rank_N``; ``final`` (the summary's figures) and
    ``text`` (params, shown in TensorBoard's text tab) go to ``out/summary`` at the last step."""
    require("tensorboard", "tensorboard")
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    folders: list[Path] = []
    scalars = 0
    last_step, last_ns = 0, 0
    for rank, series in sorted(points_by_rank(points).items()):
        folder = out / f"rank_{rank}"
        writer = EventFileWriter(str(folder), max_queue_size=1024, flush_secs=3600)
        try:
            for point in series:
                values = [Summary.Value(tag=tag, simple_value=value) for tag, value in sorted(point.values.items())]
                writer.add_event(Event(wall_time=point.end_ns / 1e9, step=point.step, summary=Summary(value=values)))
                scalars += len(values)
                last_step, last_ns = max(last_step, point.step), max(last_ns, point.end_ns)
        finally:
            writer.close()
        folders.append(folder)
    if final or text:
        folder = out / "summary"
        writer = EventFileWriter(str(folder), flush_secs=3600)
        try:
            values = [Summary.Value(tag=tag, simple_value=value) for tag, value in sorted((final or {}).items())]
            if text:
                values.append(_text_value(Summary, "params", text))
            writer.add_event(Event(wall_time=last_ns / 1e9, step=last_step, summary=Summary(value=values)))
            scalars += len(final or {})
        finally:
            writer.close()
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
