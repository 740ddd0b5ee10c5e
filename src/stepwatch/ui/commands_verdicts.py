"""``stepwatch explain``: the verdicts on a finished run, recomputed from its history (or from its
artifacts when it has none), and the verdict-policy options ``explain`` and ``summary`` share.

Exit codes: 0 the verdicts were computed (whatever they say); 2 the input cannot be read (not a
run directory, a damaged history, an unknown session, a bad policy file or ``--set``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import click

from .base import StoreTarget, _fit_text, _print_json, _reports_errors

__all__ = ["explain", "load_cli_policy", "open_run_history", "policy_options"]

F = TypeVar("F", bound=Callable[..., Any])


def policy_options(func: F) -> F:
    """``--policy FILE`` and ``--set KEY=VALUE`` (docs/verdicts.md lists the keys)."""
    func = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                        help="Override one threshold of the verdict policy (repeatable), e.g. input_share_warn=0.15.")(func)
    return click.option("--policy", "policy_file", type=click.Path(path_type=Path),
                        help="Verdict policy file (TOML or JSON) over the defaults (docs/verdicts.md).")(func)


def load_cli_policy(policy_file: Path | None, overrides: tuple[str, ...]) -> Any:
    """The verdict policy of ``--policy``/``--set`` (None: the engine's defaults). A file that
    cannot be read or a bad key or value is an ``error:`` line naming it (exit code 2)."""
    if policy_file is None and not overrides:
        return None
    from ..analysis import verdicts
    from ..errors import ArtifactError

    loader = getattr(verdicts, "load_policy", None)
    if loader is None:
        raise ArtifactError(str(policy_file or "--set"), "this build's verdict engine takes no policy overrides")
    try:
        return loader(policy_file, list(overrides))
    except (ValueError, OSError) as exc:
        where = str(policy_file) if policy_file is not None and not str(exc).startswith("--set") else "--set"
        message = getattr(exc, "strerror", None) or str(exc)
        raise ArtifactError(where if where not in message else "policy", message) from None


def _pick_session(store: Any, target: Path | str, session_id: str | None) -> str:
    """The session asked for (an error naming the ones there when it is not), else the run's own
    (run.json), else the newest in the store."""
    from ..artifacts.run_manifest import run_session_id
    from ..errors import ArtifactError

    sessions = store.sessions()
    known = {s["session_id"] for s in sessions}
    if session_id is not None:
        if session_id not in known:
            listed = ", ".join(f"{s['session_id']} ({s.get('status')})" for s in sessions) or "none"
            raise ArtifactError(target, f"no session {session_id!r} here; its sessions: {listed}")
        return session_id
    own = run_session_id(target) if isinstance(target, Path) and target.is_dir() else None
    if own in known:
        return own  # type: ignore[return-value]
    if not sessions:
        raise ArtifactError(target, "the history holds no session")
    return str(sessions[0]["session_id"])


@contextmanager
def open_run_history(target: Path | str, session_id: str | None) -> Iterator[tuple[Any, str, str]]:
    """(store, session id, source) of a run directory, a history store or a store URL: its history.sqlite,
    read-only, or, for a run with no history (``track``, ``stepwatch.init`` alone), a temporary
    store its artifacts are imported into (nothing is written into the run directory)."""
    import tempfile

    from ..errors import ArtifactError
    from ..store.sqlite import SqliteStore

    if isinstance(target, str):  # a store URL (clickhouse://...), read-only
        from ..store import open_store

        with contextlib.closing(open_store(target, read_only=True)) as store:
            yield store, _pick_session(store, target, session_id), str(getattr(store, "path", target))
        return
    if target.is_file() and target.suffix in (".sqlite", ".db"):
        history = target
    elif target.is_dir():
        history = target / "history.sqlite"
    elif not target.exists():
        raise ArtifactError(target, "no such file or directory")
    else:
        raise ArtifactError(target, "not a run directory or a history store (history.sqlite)")
    if history.is_file():
        with SqliteStore(history, read_only=True) as store:
            yield store, _pick_session(store, target, session_id), "history.sqlite"
        return
    from ..store.importers import import_path

    with tempfile.TemporaryDirectory(prefix="stepwatch-explain-") as tmp, \
            SqliteStore(Path(tmp) / "history.sqlite") as store:
        try:
            import_path(target, store)
        except ArtifactError as exc:
            raise ArtifactError(target, f"not a run directory (no history.sqlite; {exc.reason})") from None
        yield store, _pick_session(store, target, session_id), "the run's artifacts (no history.sqlite)"


@click.command()
@click.argument("run_dir", type=StoreTarget())
@click.option("--session", "session_id", help="Session id (default: the run's own, else the newest).")
@click.option("--window", type=click.IntRange(1, 10_000_000), default=None,
              help="Only the last N steps completed on every rank (default: every step).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@policy_options
@_reports_errors
def explain(run_dir: Path | str, session_id: str | None, window: int | None, as_json: bool, policy_file: Path | None,
            overrides: tuple[str, ...]) -> None:
    """Why the run's steps took the time they did: the verdicts, with their evidence.

    Recomputed from the run's history.sqlite, or from its artifacts when it has none (a run
    captured with ``track`` or ``stepwatch.init`` alone). Exit codes: 0 done, 2 unreadable input.
    """
    from ..analysis.verdicts.inputs import diagnose_store

    policy = load_cli_policy(policy_file, overrides)
    with open_run_history(run_dir, session_id) as (store, chosen, source):
        diagnosis = diagnose_store(store, chosen, window=window, policy=policy).to_dict()
    result = {"session_id": chosen, "source": source, "window_steps": window, "diagnosis": diagnosis}
    if policy is not None and hasattr(policy, "to_dict"):
        result["policy"] = policy.to_dict()
    if as_json:
        _print_json(result)
        return
    sys.stdout.write(_fit_text(render_explain_text(result)))


def render_explain_text(result: Mapping[str, Any]) -> str:
    from ..analysis.verdicts.diagnosis import diagnosis_lines, evidence_text, verdict_line

    window = f"the last {result['window_steps']} steps of every rank" if result.get("window_steps") else "every step"
    lines = [f"stepwatch explain  session {result['session_id']}  from {result['source']}, over {window}"]
    diagnosis = result["diagnosis"]
    lines += diagnosis_lines(diagnosis)
    for group, title in (("step_time", "step time"), ("memory", "memory"), ("system", "system")):
        found = diagnosis.get(group) or []
        lines.append(f"{title}: " + ("no finding" if not found else f"{len(found)} finding{'s' * (len(found) > 1)}"))
        for verdict in found:
            lines.append(f"  {verdict_line(verdict)}")
            if verdict.get("evidence"):
                lines.append(f"    evidence: {evidence_text(verdict['evidence'])}")
            if verdict.get("next_step"):
                lines.append(f"    next step: {verdict['next_step']}")
    return "\n".join(lines) + "\n"
