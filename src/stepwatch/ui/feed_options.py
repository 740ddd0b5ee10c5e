"""The feeds' options (docs/metrics.md): ``--metrics-port``, ``--alert-webhook`` and
``--otlp-endpoint`` on ``run`` and ``serve``; ``--alert-webhook`` alone on ``watch``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

__all__ = ["feed_options", "webhook_option"]

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
    return click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
                        help="Serve Prometheus /metrics on this port (0: any free; loopback unless a token is "
                             "set; needs stepwatch[metrics]).")(func)
