"""Where the aggregator's HTTP surfaces bind (the dashboard, Prometheus /metrics): one rule for
both, so that neither is ever open to a network without a token (docs/metrics.md,
docs/dashboard.md)."""

from __future__ import annotations

from ..errors import StepwatchError

__all__ = ["http_bind"]


def http_bind(host: str, token: str | None, asked: str | None, option: str) -> str:
    """Where an HTTP surface of the aggregator (the dashboard, /metrics) binds: ``asked`` (its
    ``--ui-host``, ``--metrics-host``) when given, else ``host`` when that is loopback or a token
    is set, else 127.0.0.1. StepwatchError for an ``asked`` beyond loopback with no token (the
    CLI refuses it first; this guards every other caller)."""
    from ..web.addresses import is_loopback

    if asked is not None:
        if token is None and not is_loopback(asked):
            raise StepwatchError(f"{option} {asked} is not loopback: it then needs a token (--token-env VAR)")
        return asked
    return host if token is not None or is_loopback(host) else "127.0.0.1"
