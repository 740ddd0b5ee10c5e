"""``stepwatch export wandb``: a session as a W&B offline run (``wandb`` in offline mode, no
login, no network) that ``wandb sync DIR/wandb/offline-run-*`` uploads later: the params as its
config, a history row per step with every rank's scalars (``rank_N/<name>``), the summary's
figures in its summary, and the summary, diagnosis, report.html and trace.json as run files.

W&B's ``_step`` only grows, so the rows are by step number, all ranks' values in one row; the
step's end on each rank is not W&B's ``_timestamp`` (the time of the export) but is kept as
``rank_N/step_end_unix_s``.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .tracker_data import StepPoint
from .trackers import require

__all__ = ["WandbExport", "export_wandb"]


@dataclass(slots=True)
class WandbExport:
    run_dir: Path  # DIR/wandb/offline-run-<time>-<id>: what `wandb sync` takes
    run_id: str
    rows: int


def export_wandb(points: list[StepPoint], params: Mapping[str, str], final: Mapping[str, float],
                 tags: Iterable[str], artifacts: Iterable[Path], *, out: Path, project: str, name: str,
                 exit_code: int = 0) -> WandbExport:
    """Writes the offline run under ``out/wandb`` and finishes it with ``exit_code`` (non-zero:
    W&B shows the run as failed)."""
    require("wandb", "wandb")
    import wandb

    rows: dict[int, dict[str, float]] = {}
    for point in points:
        row = rows.setdefault(point.step, {})
        for key, value in point.values.items():
            row[f"rank_{point.rank}/{key}"] = value
        row[f"rank_{point.rank}/step_end_unix_s"] = point.end_ns / 1e9
    out.mkdir(parents=True, exist_ok=True)
    settings = wandb.Settings(mode="offline", console="off", silent=True, save_code=False, disable_git=True,
                              x_disable_stats=True, x_disable_meta=True)
    run = wandb.init(dir=str(out), project=project, name=name, config=dict(params), tags=list(tags),
                     settings=settings, reinit="create_new")
    try:
        for step in sorted(rows):
            run.log(rows[step], step=step)
        for key, value in final.items():
            run.summary[key] = value
        files = Path(run.dir)
        for path in artifacts:  # into the run's files/ folder, with the record `wandb sync` uploads them by
            shutil.copyfile(path, files / path.name)
            run.save(str(files / path.name), base_path=str(files), policy="now")
    except BaseException:
        run.finish(exit_code=1)
        raise
    run.finish(exit_code=exit_code)
    return WandbExport(files.parent, run.id, len(rows))
