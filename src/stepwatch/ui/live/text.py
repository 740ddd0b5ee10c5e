"""The live view's words: the figures as text (``fmt_seconds``, ``fmt_rate``, ``verdict_text``)
and the plain line a log gets instead of the view (``plain_line``): one line, no escape codes."""

from __future__ import annotations

from typing import Any

from ...views.live import LiveSnapshot

__all__ = ["PLAIN_EVERY_S", "elapsed_text", "fmt_rate", "fmt_seconds", "plain_line", "print_plain", "ranks_text",
           "verdict_text"]

PLAIN_EVERY_S = 10.0  # the plain line's period (no terminal)


def fmt_seconds(value: float | None) -> str:
    """A step time: ms below a second, else seconds."""
    if value is None:
        return "-"
    if value < 1.0:
        return f"{value * 1e3:.3g} ms"
    return f"{value:.3g} s"


def fmt_rate(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if value < 1000 else f"{value:,.0f}"


def elapsed_text(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour."""
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def verdict_text(verdict: dict[str, Any] | None) -> str:
    """``NAME (severity, rank 3)``; ``no verdict yet``."""
    if not verdict or not verdict.get("name"):
        return "no verdict yet"
    who = _who([str(r) for r in verdict.get("ranks") or ()], ", ")
    return f"{verdict['name']} ({verdict.get('severity') or '?'}{who})"


def ranks_text(ranks: Any) -> str:
    """`` (rank 3)``, `` (ranks 1, 5)``; empty for none."""
    who = _who([str(r) for r in ranks or ()], "")
    return f" ({who})" if who else ""


def _who(ranks: list[str], lead: str) -> str:
    """``rank 3``, ``ranks 1, 5``; past 6 ranks, their count (``40 ranks``): one line stays one line."""
    if not ranks:
        return ""
    if len(ranks) > 6:
        return f"{lead}{len(ranks)} ranks"
    return f"{lead}rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}"


def plain_line(snapshot: LiveSnapshot) -> str:
    """``[stepwatch] step N (of M) · X steps/s · step time T · <primary verdict>``: one line with
    no escape codes, for a log (the snapshot's text is stripped of control characters)."""
    step = snapshot.step
    parts = [f"[stepwatch] step {step if step is not None else '-'}"
             + (f" (of {snapshot.total_steps})" if snapshot.total_steps else "")]
    parts.append(f"{fmt_rate(snapshot.steps_per_s)} steps/s")
    parts.append(f"step time {fmt_seconds(snapshot.step_time_s)}")
    parts.append(verdict_text(snapshot.verdict))
    if snapshot.alerts:
        last = snapshot.alerts[-1]
        parts.append(f"alert {last.get('kind')}" + ranks_text(last.get("ranks")))
    return _printable(" · ".join(parts))


def print_plain(console: Any, snapshot: LiveSnapshot) -> None:
    """The plain line on a rich console, as it is (no markup, highlighting or wrapping)."""
    console.print(plain_line(snapshot), markup=False, highlight=False, soft_wrap=True)


def _printable(text: str) -> str:
    """Without control characters (an escape code in a verdict's message would reach the log)."""
    return "".join(ch if ch.isprintable() else " " for ch in text)
