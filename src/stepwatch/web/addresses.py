"""Whether an address reaches only this machine: the rule every HTTP surface binds by (nothing
beyond loopback without a token). Apart from ``web.app`` so that the CLI and the launcher check an
address without importing the dashboard's server."""

from __future__ import annotations

import ipaddress

__all__ = ["is_loopback"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind address) reaches only this machine."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
