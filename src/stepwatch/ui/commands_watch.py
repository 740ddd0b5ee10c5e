"""``stepwatch watch RUN_DIR``: the watchdog for a job stepwatch did not launch (docs/watchdog.md)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from ..analysis.alerts import AlertPolicy
from .base import _console, _reports_errors
from .feed_options import webhook_option

__all__ = ["watch", "watchdog_options"]

F = TypeVar("F", bound=Callable[..., Any])


def watchdog_options(func: F) -> F:
    """``--stall-after`` and ``--throughput-window``: the same on ``run``, ``serve`` and ``watch``
    (the defaults are ``AlertPolicy``'s, docs/watchdog.md)."""
    func = click.option("--throughput-window", type=click.FloatRange(min=0, min_open=True),
                        default=AlertPolicy.throughput_window_s,
                        show_default=True, metavar="SECONDS", help="Length of a THROUGHPUT_DROP window.")(func)
    return click.option("--stall-after", type=click.FloatRange(min=0, min_open=True),
                        default=AlertPolicy.stall_after_s, show_default=True,
                        metavar="SECONDS",
                        help="Alert STALL when a rank makes no progress this long (docs/watchdog.md).")(func)


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@watchdog_options
@click.option("--no-dump", is_flag=True, help="Do not ask the ranks for stack dumps on a STALL.")
@click.option("--on-nonfinite", type=click.Choice(["alert", "halt"]), default="alert", show_default=True,
              help="On NONFINITE: alert only, or halt every rank at the same step (docs/halt.md).")
@click.option("--json", "as_json", is_flag=True, help="Print each alert as its alerts.jsonl line.")
@webhook_option
@_reports_errors
def watch(run_dir: Path, stall_after: float, throughput_window: float, no_dump: bool, on_nonfinite: str,
          as_json: bool, alert_webhook: str | None = None) -> None:
    """Watch a running job's run directory and alert on STALL, RANK_LOST, THROUGHPUT_DROP,
    NONFINITE and ZERO_GRAD (into RUN_DIR/alerts.jsonl, and printed).

    Ends when every rank has stopped, or on Ctrl-C. Exit codes: 0 no alert, 1 one alert or
    more, 2 RUN_DIR is no run directory or cannot take alerts.jsonl.
    """
    from ..server.watch import RunWatcher, check_run_dir, exit_code
    from ..server.watchdog import halt_on_nonfinite

    check_run_dir(run_dir)
    watcher = RunWatcher(run_dir, AlertPolicy(stall_after_s=stall_after, throughput_window_s=throughput_window),
                         dump_stacks=not no_dump, actions={"NONFINITE": on_nonfinite})
    console = _console(stderr=True)
    if not as_json:
        console.print(f"[stepwatch] watching {run_dir} (stall after {stall_after:g} s); Ctrl-C ends", markup=False)
    raised: list[Any] = []
    halt = on_nonfinite == "halt"
    hook = None
    if alert_webhook:
        from ..server.webhooks import WebhookSender

        hook = WebhookSender(alert_webhook)

    def say(alert: Any) -> None:
        nonlocal halt
        raised.append(alert)
        if hook is not None:
            from ..server.webhooks import alert_payload

            hook.send(alert_payload(alert.to_dict(), alert.line()))
        if as_json:
            sys.stdout.write(json.dumps(alert.to_dict()) + "\n")
            sys.stdout.flush()
        else:
            console.print(alert.line(), markup=False, soft_wrap=True)
        if halt and alert.kind == "NONFINITE":
            halt = False  # once
            console.print(halt_on_nonfinite(run_dir, alert.message, by="stepwatch watch"), markup=False)

    try:
        while True:
            for alert in watcher.poll():
                say(alert)
            if watcher.done:
                break
            time.sleep(0.5)
        for alert in watcher.poll(final=True):
            say(alert)
    except KeyboardInterrupt:
        pass
    if hook is not None and not hook.close(timeout=10.0):
        console.print(f"[stepwatch] alert webhook: {hook.dropped} post(s) not delivered in time", markup=False)
    if not as_json:
        console.print(f"[stepwatch] {len(raised)} alert(s); every rank has stopped" if watcher.done
                      else f"[stepwatch] {len(raised)} alert(s); stopped watching", markup=False)
    sys.exit(exit_code(raised))
