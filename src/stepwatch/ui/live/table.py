"""The live view drawn with rich: a header, one row a rank (folded above ``FOLD_ABOVE`` ranks), a
progress bar where the total is known, the primary verdict and the latest alerts, as one
renderable (``render_view``) that ``stepwatch run`` and ``stepwatch top`` both redraw."""

from __future__ import annotations

from typing import Any

from ...views.live import FOLD_ABOVE, SHARE_NAMES, LiveSnapshot, RankLive, fold_ranks, named_ranks
from ..format import fmt_bytes
from .text import elapsed_text, fmt_rate, fmt_seconds, ranks_text, verdict_text

__all__ = ["REFRESH_S", "phase_bar", "render_view"]

REFRESH_S = 1.0  # the live view's redraw period
BAR_WIDTH = 16  # characters of a rank's phase bar
# a colour a phase, in stepwatch.phases' order (the residual, wait, last and grey)
_PHASE_STYLE = dict(zip(SHARE_NAMES, ("red", "magenta", "green", "blue", "yellow", "cyan", "bright_black"), strict=False))
_SEVERITY_STYLE = {"crit": "bold red", "critical": "bold red", "warn": "yellow", "warning": "yellow",
                   "info": "cyan", "ok": "green"}
_COLUMNS = (("rank", "right"), ("step", "right"), ("step time", "right"), ("steps/s", "right"), ("phases", "left"),
            ("", "left"), ("memory", "right"), ("peak", "right"), ("heartbeat", "right"))


def phase_bar(shares: dict[str, float], width: int = BAR_WIDTH) -> Any:
    """The phases' shares as one bar of ``width`` cells, a colour a phase (largest remainders
    decide the last cells, so the cells always add up to ``width``)."""
    from rich.text import Text

    bar = Text()
    total = sum(max(0.0, shares.get(name, 0.0)) for name in SHARE_NAMES)
    if total <= 0:
        return Text("·" * width, style="bright_black")
    exact = [(name, max(0.0, shares.get(name, 0.0)) / total * width) for name in SHARE_NAMES]
    cells = {name: int(value) for name, value in exact}
    rest = width - sum(cells.values())
    for name, _ in sorted(exact, key=lambda item: item[1] - int(item[1]), reverse=True)[:rest]:
        cells[name] += 1
    for name in SHARE_NAMES:
        if cells[name]:
            bar.append("█" * cells[name], style=_PHASE_STYLE.get(name, "white"))
    return bar


def render_view(snapshot: LiveSnapshot, *, pending: str | None = None) -> Any:
    """The whole view as one rich renderable; ``pending``: the job's line being written (a
    progress bar redrawn with ``\\r``), shown above the view until it ends."""
    from rich.console import Group
    from rich.text import Text

    parts: list[Any] = []
    if pending:
        parts.append(Text.from_ansi(pending, no_wrap=True, overflow="ellipsis"))
    parts.append(_header(snapshot))
    parts.extend(_ranks(snapshot))
    parts.extend(_progress(snapshot))
    parts.extend(_findings(snapshot))
    return Group(*parts)


def _header(snapshot: LiveSnapshot) -> Any:
    from rich.text import Text

    header = Text("stepwatch ", style="bold")
    header.append(f"{snapshot.run_dir}", style="cyan")
    if snapshot.session_id:
        header.append(f"  session {snapshot.session_id[:8]}")
    header.append(f"  {len(snapshot.ranks)} rank{'s' if len(snapshot.ranks) != 1 else ''}")
    if snapshot.elapsed_s is not None:
        header.append(f"  {elapsed_text(snapshot.elapsed_s)}")
    if snapshot.ended:
        header.append("  ended", style="bold")
    return header


def _ranks(snapshot: LiveSnapshot) -> list[Any]:
    """The table of the ranks shown, its legend, and a note of the ranks folded away."""
    from rich.table import Table
    from rich.text import Text

    named = named_ranks(snapshot)
    shown = fold_ranks(snapshot.ranks, named)
    if not shown:
        return [Text("waiting for the ranks' first step...", style="bright_black")]
    table = Table(box=None, pad_edge=False, header_style="bold", expand=False)
    for column, justify in _COLUMNS:
        table.add_column(column, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for rank in shown:
        memory = fmt_bytes(rank.memory_bytes) + (f" {rank.memory_kind}" if rank.memory_kind else "")
        label = Text(str(rank.rank), style="bold red" if rank.rank in named else "")
        table.add_row(label, "-" if rank.step is None else str(rank.step), fmt_seconds(rank.step_time_s),
                      fmt_rate(rank.steps_per_s), phase_bar(rank.phase_shares), _top_phase(rank.phase_shares),
                      memory, fmt_bytes(rank.memory_peak_bytes), _age(rank))
    legend = Text("phases: ", style="bright_black")
    for name in SHARE_NAMES:
        legend.append("█", style=_PHASE_STYLE.get(name, "white"))
        legend.append(f" {name}  ", style="bright_black")
    parts = [table, legend]
    if len(shown) < len(snapshot.ranks):
        parts.append(Text(f"{len(shown)} of {len(snapshot.ranks)} ranks shown (more than {FOLD_ABOVE}): the "
                          "slowest, the fastest and the median rank, and every rank a verdict or alert names",
                          style="bright_black"))
    return parts


def _top_phase(shares: dict[str, float]) -> str:
    if not shares:
        return ""
    name, share = max(shares.items(), key=lambda item: item[1])
    return f"{name} {share * 100:.0f}%"


def _age(rank: RankLive) -> Any:
    from rich.text import Text

    if rank.state == "stopped":
        return Text("stopped", style="bright_black")
    if rank.state == "lost":
        return Text("lost", style="bold red")
    if rank.heartbeat_age_s is None:
        return Text("-")
    text = f"{rank.heartbeat_age_s:.0f} s" if rank.heartbeat_age_s >= 1.5 else "now"
    return Text(text, style="bold red" if rank.state == "silent" else "")


def _progress(snapshot: LiveSnapshot) -> list[Any]:
    """The progress bar where the total is known, else the step alone."""
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    step, total = snapshot.step, snapshot.total_steps
    if total:
        done = min(step or 0, total)
        line = Table.grid(padding=(0, 1))
        line.add_row(ProgressBar(total=total, completed=done, width=40),
                     Text(f"step {step or 0} of {total} ({done / total * 100:.0f}%)" + _eta(snapshot)))
        return [line]
    if step is not None:
        return [Text(f"step {step} (total unknown)", style="bright_black")]
    return []


def _eta(snapshot: LiveSnapshot) -> str:
    step, total, rate = snapshot.step, snapshot.total_steps, snapshot.steps_per_s
    if not total or step is None or not rate or step >= total or snapshot.ended:
        return ""
    return f", about {elapsed_text((total - step) / rate)} left"


def _findings(snapshot: LiveSnapshot) -> list[Any]:
    """The primary verdict with its message, then the three latest alerts."""
    from rich.text import Text

    verdict = Text("verdict ", style="bold")
    if snapshot.verdict:
        verdict.append(verdict_text(snapshot.verdict), style=_SEVERITY_STYLE.get(str(snapshot.verdict.get("severity")), ""))
        if snapshot.verdict.get("message"):
            verdict.append(f": {snapshot.verdict['message']}")
    else:
        verdict.append("none yet", style="bright_black")
    parts = [verdict]
    for alert in snapshot.alerts[-3:]:
        line = Text("alert ", style="bold red")
        line.append(f"{alert.get('kind')} ({alert.get('severity') or '?'})" + ranks_text(alert.get("ranks")),
                    style=_SEVERITY_STYLE.get(str(alert.get("severity")), ""))
        if alert.get("step") is not None:
            line.append(f" step {alert['step']}")
        if alert.get("message"):
            line.append(f": {alert['message']}")
        parts.append(line)
    return parts
