"""The one parser of ``clickhouse://`` store URLs: ``clickhouse://[user[:password]@]host[:port][/database]``.

Kept apart from the store (no ``clickhouse-driver`` import) so that naming a bad URL is an error
that says which part is wrong before anything connects, and so the parser can be tested alone.
"""

from __future__ import annotations

import re
from typing import NamedTuple
from urllib.parse import unquote, urlsplit

from ..errors import StoreError

__all__ = ["DEFAULT_DATABASE", "DEFAULT_PORT", "ClickHouseURL", "is_clickhouse_url", "parse_clickhouse_url"]

SCHEME = "clickhouse"
DEFAULT_PORT = 9000  # the native protocol's port (clickhouse-driver speaks it; HTTP is not used)
DEFAULT_DATABASE = "stepwatch"
# a database name is written into DDL unquoted: letters, digits and underscores only
_DATABASE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_HOST = re.compile(r"[A-Za-z0-9._-]{1,253}|\[[0-9A-Fa-f:.]+\]")
_USER = re.compile(r"[A-Za-z0-9_.@-]{1,64}")


class ClickHouseURL(NamedTuple):
    user: str
    password: str
    host: str
    port: int
    database: str

    def __str__(self) -> str:
        """The URL without its password (for messages and logs)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{SCHEME}://{self.user}@{host}:{self.port}/{self.database}"


def is_clickhouse_url(text: object) -> bool:
    return isinstance(text, str) and text.lower().startswith(f"{SCHEME}://")


def parse_clickhouse_url(text: str) -> ClickHouseURL:
    """The parts of a store URL; a StoreError naming the part that is wrong otherwise."""
    def bad(part: str, why: str) -> StoreError:
        return StoreError(f"store URL {_redacted(text)!r}: {part}: {why} "
                          f"(expected clickhouse://[user[:password]@]host[:port][/database])")

    if not is_clickhouse_url(text):
        raise bad("scheme", "must be clickhouse://")
    if any(ch.isspace() for ch in text):
        raise bad("URL", "contains whitespace")
    try:
        parts = urlsplit(text)
    except ValueError as exc:  # an unbalanced [ or ] ("Invalid IPv6 URL")
        raise bad("host", str(exc)) from None
    if parts.query or parts.fragment:
        raise bad("query" if parts.query else "fragment", "not accepted (settings are not passed in the URL)")
    netloc = parts.netloc
    user, password = "default", ""
    if "@" in netloc:
        auth, _, netloc = netloc.rpartition("@")
        raw_user, colon, raw_password = auth.partition(":")
        user, password = unquote(raw_user), unquote(raw_password) if colon else ""
        if not _USER.fullmatch(user):
            raise bad("user", f"{user!r} is not a user name (letters, digits, _ . @ -)")
    host_port = netloc
    if host_port.startswith("["):
        close = host_port.find("]")
        if close < 0:
            raise bad("host", "an IPv6 address opened with [ is not closed")
        host, rest = host_port[:close + 1], host_port[close + 1:]
    else:
        host, _, port_text = host_port.partition(":")
        rest = f":{port_text}" if _ else ""
    if not host:
        raise bad("host", "missing")
    if not _HOST.fullmatch(host):
        raise bad("host", f"{host!r} is not a host name or address")
    port = DEFAULT_PORT
    if rest:
        if not rest.startswith(":") or not rest[1:].isdigit() or not rest[1:].isascii():
            raise bad("port", f"{rest[1:] or rest!r} is not a number")
        port = int(rest[1:])
        if not 0 < port < 65536:
            raise bad("port", f"{port} is out of range 1-65535")
    path = parts.path
    database = path[1:] if path.startswith("/") else path
    database = database or DEFAULT_DATABASE
    if not _DATABASE.fullmatch(database):
        raise bad("database", f"{database!r} is not a database name (a letter or _, then letters, digits, _)")
    return ClickHouseURL(user, password, host.strip("[]"), port, database)


def _redacted(text: str) -> str:
    """``text`` with any password replaced, for error messages."""
    return re.sub(r"(://[^:/@]*):[^@/]*@", r"\1:***@", text)
