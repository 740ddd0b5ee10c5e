"""The feeds' options (docs/metrics.md): ``--metrics-port``, ``--metrics-host``,
``--alert-webhook`` and ``--otlp-endpoint`` on ``run`` and ``serve``; ``--alert-webhook`` alone on
``watch``. And what guards the aggregator's HTTP surfaces on both: ``--token-env`` (the variable
holding the bearer token) and ``check_binds``, which refuses a bind beyond loopback without one."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import click

__all__ = ["check_binds", "feed_options", "read_token", "token_env_option", "webhook_option"]

F = TypeVar("F", bound=Callable[..., Any])


def _url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not value.startswith(("http://", "https://")):
        raise click.BadParameter(f"{value!r} is not an http:// or https:// URL")
    return value


def webhook_option(func: F) -> F:
    return click.option("--alert-webhook", metavar="URL", default=None, callback=_url,
                        help="POST each alert (and verdict change) as JSON with a `text` field, the payload Slack "
                             "and Mattermost incoming webhooks take (docs/metrics.md).")(func)


def feed_options(func: F) -> F:
    """The three feeds, in the order ``--help`` lists them."""
    func = click.option("--otlp-endpoint", metavar="URL", default=None, callback=_url,
                        help="Export metrics and spans over OTLP/HTTP to URL/v1/metrics and URL/v1/traces while "
                             "the run trains (needs stepwatch[otlp]).")(func)
    func = webhook_option(func)
    func = click.option("--metrics-host", metavar="ADDRESS", default=None,
                        help="The address /metrics binds (default: --host when that is loopback or a token is set, "
                             "else 127.0.0.1); anything but loopback needs --token-env.")(func)
    return click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
                        help="Serve Prometheus /metrics on this port (0: any free; loopback unless a token is "
                             "set; needs stepwatch[metrics]).")(func)


def token_env_option(func: F) -> F:
    return click.option("--token-env", metavar="VAR",
                        help="Name of the environment variable holding the bearer token: HTTP ingestion, the "
                             "dashboard and /metrics then ask for it, and may bind beyond loopback.")(func)


def read_token(token_env: str | None) -> str | None:
    """The token ``--token-env`` names; a usage error (nothing started) when the variable is
    empty or unset: a token the user meant to set must not silently be none."""
    if not token_env:
        return None
    token = os.environ.get(token_env)
    if not token:
        raise click.UsageError(f"--token-env {token_env}: that variable is empty or unset")
    return token


def check_binds(token: str | None, **binds: tuple[str | None, int | None]) -> None:
    """``binds``: option name (``metrics_host``) -> (the address asked for, its port option's
    value). A usage error for an address without its port, and for one beyond loopback with no
    token (the dashboard and /metrics are never open to a network without one)."""
    from ..web.addresses import is_loopback

    for name, (host, port) in binds.items():
        if host is None:
            continue
        option = "--" + name.replace("_", "-")
        if port is None:
            raise click.UsageError(f"{option} says where {option.replace('-host', '-port')} binds; give that too")
        if token is None and not is_loopback(host):
            raise click.UsageError(f"{option} {host} is not loopback: it then needs a token (--token-env VAR, the "
                                   "variable holding it; clients send Authorization: Bearer TOKEN)")
