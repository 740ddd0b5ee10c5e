"""``stepwatch export wandb``: a session as a W&B offline run (``wandb`` in offline mode, no
login, no network) that ``wandb sync DIR/wandb/offline-run-*`` uploads later: the params as its
config, a history row per step with every rank's scalars (``rank_N/<name>``), the summary's
figures in its summary, and the summary, diagnosis, report.html and trace.json as run files.

W&B's ``_step`` only grows, so the rows are by step number, all ranks' values in one row; the
step's end on each rank is not W&B's ``_timestamp`` (the time of the export) but is kept as
``rank_N/step_end_unix_s``.

The run's id is the session's (``wandb_run_id``), so exporting a session again writes the same
run: the offline folders an earlier export of it left under ``out/wandb`` are removed first
(one folder a run), and ``wandb sync`` of the new one goes to the same W&B run, not a second one.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .tracker_data import StepPoint
from .trackers import require

__all__ = ["WandbExport", "export_wandb", "wandb_run_id"]


@dataclass(slots=True)
class WandbExport:
    run_dir: Path  # DIR/wandb/offline-run-<time>-<id>: what `wandb sync` takes
    run_id: str
    rows: int
    replaced: bool  # an earlier export of the session was there (and is gone)


def wandb_run_id(session_id: str) -> str:
    """The W&B run id of a session: its letters and digits, lower case (a uuid's 32), or a hash
    of it where that would be empty or longer than 64 (W&B's limit)."""
    plain = re.sub(r"[^a-z0-9]", "", session_id.lower())
    return plain if 0 < len(plain) <= 64 else hashlib.sha256(session_id.encode()).hexdigest()[:32]


def _remove_earlier(out: Path, run_id: str) -> list[Path]:
    """The run folders of ``run_id`` an earlier export wrote (``offline-run-<time>-<id>``)."""
    gone = []
    for folder in (out / "wandb").glob(f"offline-run-*-{run_id}"):
        if folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder)
            gone.append(folder)
    return gone


def export_wandb(points: list[StepPoint], params: Mapping[str, str], final: Mapping[str, float],
                 tags: Iterable[str], artifacts: Iterable[Path], *, out: Path, project: str, name: str,
                 session_id: str, exit_code: int = 0) -> WandbExport:
    """Writes the offline run of ``session_id`` under ``out/wandb`` (in place of an earlier
    export's) and finishes it with ``exit_code`` (non-zero: W&B shows the run as failed)."""
    require("wandb", "wandb")
    import wandb

    rows: dict[int, dict[str, float]] = {}
    for point in points:
        row = rows.setdefault(point.step, {})
        for key, value in point.values.items():
            row[f"rank_{point.rank}/{key}"] = value
        row[f"rank_{point.rank}/step_end_unix_s"] = point.end_ns / 1e9
    out.mkdir(parents=True, exist_ok=True)
    run_id = wandb_run_id(session_id)
    replaced = _remove_earlier(out, run_id)
    settings = wandb.Settings(mode="offline", console="off", silent=True, save_code=False, disable_git=True,
                              x_disable_stats=True, x_disable_meta=True)
    run = wandb.init(dir=str(out), project=project, name=name, id=run_id, config=dict(params), tags=list(tags),
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
    return WandbExport(files.parent, run.id, len(rows), bool(replaced))
