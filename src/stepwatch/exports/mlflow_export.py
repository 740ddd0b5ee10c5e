"""``stepwatch export mlflow``: a session as an MLflow run (or one run per rank), through
``MlflowClient`` against any tracking URI: params, a metric point per rank per step (the
``tracker_data`` scalars, sent with ``log_batch`` a thousand at a time), the summary's figures
at the last step, tags naming the session and its verdict, and the summary, diagnosis,
report.html and trace.json as artifacts.

Exporting a session again does not duplicate it: its run is found by the ``stepwatch.session_id``
tag (and ``stepwatch.rank`` for ``--per-rank``) in the experiment; one whose ``stepwatch.digest``
tag says it holds these very points and params is kept (its tags and artifacts written again,
its metrics and params not), one that holds anything else (an export of the run while it still
trained, or one cut short) is deleted and made anew. MLflow keeps a param's first value and may
keep every copy of a metric point, so updating a run in place could not be exact on every store.

The default tracking store is SQLite (``sqlite:///RUN_DIR/mlflow.db``): MLflow 3's ``./mlruns``
file store is in maintenance mode and refused unless ``MLFLOW_ALLOW_FILE_STORE`` is set.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path
from typing import Any, TypeVar

from .tracker_data import StepPoint, points_by_rank
from .trackers import require

__all__ = ["MLFLOW_LIMITS", "MlflowExport", "export_digest", "export_mlflow", "mlflow_status",
           "sqlite_artifact_location"]

MLFLOW_LIMITS = {"metrics": 1000, "params": 100, "tags": 100, "param_value": 6000}
"""What one ``log_batch`` call takes (MLflow's documented limits) and a param value's length."""

T = TypeVar("T")


@dataclass(slots=True)
class MlflowExport:
    experiment_id: str
    run_ids: dict[str, str]  # "session" or "rank N" -> run id
    metric_points: int
    kept: list[str]  # the groups whose run held this export already (nothing logged again)
    replaced: list[str]  # the groups whose earlier run held other data: deleted, made anew


def _chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def _metrics(metric: Any, series: Iterable[StepPoint], prefixed: bool) -> Iterator[Any]:
    """The points as MLflow metrics: ``rank_N/<name>`` in a session's run, with the step's end
    (ms) as timestamp."""
    for p in series:
        prefix = f"rank_{p.rank}/" if prefixed else ""
        stamp = p.end_ns // 1_000_000
        for key, value in p.values.items():
            yield metric(f"{prefix}{key}", value, stamp, p.step)


def export_digest(series: Iterable[StepPoint], params: Mapping[str, str], final: Mapping[str, float]) -> str:
    """What one run is sent, as a hash: equal digests, equal runs (the points' steps, times and
    values, the params and the summary's figures; the artifacts are written again whatever it says)."""
    digest = hashlib.sha256()
    for p in series:
        digest.update(f"{p.rank} {p.step} {p.end_ns} {sorted(p.values.items())!r}\n".encode())
    digest.update(repr(sorted(params.items())).encode())
    digest.update(repr(sorted(final.items())).encode())
    return digest.hexdigest()


def _earlier_runs(client: Any, experiment_id: str, session_id: str | None) -> dict[str, Any]:
    """The session's live runs in the experiment by group (``session``, ``rank N``), the newest
    of a group first; the others of a group are older duplicates (an export before this rule)."""
    if not session_id:
        return {}
    from mlflow.entities import ViewType

    quoted = session_id.replace("'", "\\'")
    found: dict[str, list[Any]] = {}
    token = None
    while True:
        page = client.search_runs([experiment_id], f"tags.`stepwatch.session_id` = '{quoted}'",
                                  run_view_type=ViewType.ACTIVE_ONLY, max_results=1000, page_token=token)
        for run in page:
            rank = run.data.tags.get("stepwatch.rank")
            found.setdefault("session" if rank is None else f"rank {rank}", []).append(run)
        token = page.token
        if not token:
            break
    return {group: sorted(runs, key=lambda r: r.info.start_time or 0, reverse=True) for group, runs in found.items()}


def sqlite_artifact_location(tracking_uri: str) -> str | None:
    """For a ``sqlite:///PATH`` store, ``PATH``'s folder ``/mlartifacts`` (MLflow would put the
    artifacts under the working directory's ``mlruns/`` otherwise); None for any other store
    (a tracking server has its own artifact root)."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    return (Path(tracking_uri[len("sqlite:///"):]).parent / "mlartifacts").resolve().as_uri()


def export_mlflow(points: list[StepPoint], params: Mapping[str, str], final: Mapping[str, float],
                  tags: Mapping[str, str], artifacts: Iterable[Path], *, tracking_uri: str, experiment: str,
                  per_rank: bool, run_name: str, start_ms: int | None, end_ms: int | None,
                  status: str = "FINISHED") -> MlflowExport:
    """Creates the runs (in ``experiment``, made if missing), logs everything and ends them with
    ``status``. A session exported before keeps its run, or has it made anew (the module's doc)."""
    require("mlflow", "mlflow")
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    for name in ("mlflow", "alembic"):  # the store's first-use migrations would log a page of INFO lines
        logging.getLogger(name).setLevel(logging.WARNING)

    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found is not None else client.create_experiment(
        experiment, artifact_location=sqlite_artifact_location(tracking_uri))
    groups: dict[str, list[StepPoint]] = {"session": points}
    if per_rank:
        groups = {f"rank {rank}": series for rank, series in sorted(points_by_rank(points).items())}
    limit = MLFLOW_LIMITS["param_value"]
    run_ids: dict[str, str] = {}
    kept: list[str] = []
    replaced: list[str] = []
    sent = 0
    last_step = max((p.step for p in points), default=0)
    earlier = _earlier_runs(client, experiment_id, tags.get("stepwatch.session_id"))
    for group, series in groups.items():
        name = run_name if group == "session" else f"{run_name} {group}"
        digest = export_digest(series, params, final)
        run_tags = {**tags, **({"stepwatch.rank": group.split()[1]} if group != "session" else {})}
        before = earlier.get(group, [])
        if before and before[0].data.tags.get("stepwatch.digest") == digest:
            run_id = before[0].info.run_id  # this very export is there: write its tags and files again, no more
            for key, value in run_tags.items():
                client.set_tag(run_id, key, value[:5000])
            for path in artifacts:
                client.log_artifact(run_id, str(path))
            for stale in before[1:]:
                client.delete_run(stale.info.run_id)
            run_ids[group] = run_id
            kept.append(group)
            continue
        for stale in before:  # other data (an export while it trained, one cut short): made anew
            client.delete_run(stale.info.run_id)
        if before:
            replaced.append(group)
        run = client.create_run(experiment_id, start_time=start_ms, run_name=name,
                                tags={k: v[:5000] for k, v in run_tags.items()})
        run_id = run.info.run_id
        run_ids[group] = run_id
        param_list = [Param(k, str(v)[:limit]) for k, v in sorted(params.items())]
        for chunk in _chunks(param_list, MLFLOW_LIMITS["params"]):
            client.log_batch(run_id, params=list(chunk))
        stamp = end_ms if end_ms is not None else (max((p.end_ns for p in series), default=0) // 1_000_000)
        metrics = chain(_metrics(Metric, series, group == "session"),
                        (Metric(key, value, stamp, last_step) for key, value in sorted(final.items())))
        while batch := list(islice(metrics, MLFLOW_LIMITS["metrics"])):  # a batch at a time: memory stays flat
            client.log_batch(run_id, metrics=batch)
            sent += len(batch)
        for path in artifacts:
            client.log_artifact(run_id, str(path))
        client.set_tag(run_id, "stepwatch.digest", digest)  # last: a run cut short before it is made anew
        client.set_terminated(run_id, status=status, end_time=end_ms)
    return MlflowExport(experiment_id, run_ids, sent, kept, replaced)


def mlflow_status(outcome: Any) -> str:
    """The MLflow run status of a stepwatch outcome (docs/run-outcome.md): FINISHED for a run
    that succeeded or exited (and one from a stepwatch that recorded no outcome), FAILED for one
    that failed, KILLED for one killed, interrupted, halted or never seen to end."""
    if outcome in ("succeeded", "exited", None):
        return "FINISHED"
    return "FAILED" if outcome == "failed" else "KILLED"
