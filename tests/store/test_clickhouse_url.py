"""The store URL parser and the SQL parameter binder: property tests (no server needed)."""

from __future__ import annotations

import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepwatch.errors import StoreError
from stepwatch.store.clickhouse_url import DEFAULT_DATABASE, DEFAULT_PORT, parse_clickhouse_url

users = st.text(string.ascii_letters + string.digits + "_.-", min_size=1, max_size=20)
hosts = st.one_of(st.from_regex(r"[a-z][a-z0-9-]{0,20}(\.[a-z0-9-]{1,10}){0,3}", fullmatch=True),
                  st.ip_addresses(v=4).map(str))
databases = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,30}", fullmatch=True)
ports = st.integers(1, 65535)


@given(users, st.text(string.ascii_letters + string.digits, max_size=12), hosts, ports, databases)
def test_every_well_formed_url_parses_back_to_its_parts(user: str, password: str, host: str, port: int,
                                                         database: str) -> None:
    auth = f"{user}:{password}" if password else user
    url = parse_clickhouse_url(f"clickhouse://{auth}@{host}:{port}/{database}")
    assert url == (user, password, host, port, database)
    assert str(url) == f"clickhouse://{user}@{host}:{port}/{database}"  # never the password
    assert parse_clickhouse_url(str(url)) == url._replace(password="")


@given(hosts)
def test_defaults_fill_what_is_left_out(host: str) -> None:
    assert parse_clickhouse_url(f"clickhouse://{host}") == ("default", "", host, DEFAULT_PORT, DEFAULT_DATABASE)


@pytest.mark.parametrize(("url", "part"), [
    ("http://h:9000/db", "scheme"), ("clickhouse://", "host"), ("clickhouse://h:port/db", "port"),
    ("clickhouse://h:0/db", "port"), ("clickhouse://h:70000/db", "port"), ("clickhouse://h/my-db", "database"),
    ("clickhouse://h/a/b", "database"), ("clickhouse://h/db?x=1", "query"), ("clickhouse://us er@h/db", "URL"),
    ("clickhouse://u;drop@h/db", "user"), ("clickhouse://h!/db", "host"), ("clickhouse://[::1/db", "host"),
])
def test_a_bad_part_is_named(url: str, part: str) -> None:
    with pytest.raises(StoreError, match=rf"{part}:"):
        parse_clickhouse_url(url)


@given(st.text(max_size=60))
def test_any_text_parses_or_raises_store_error(text: str) -> None:
    for candidate in (text, "clickhouse://" + text):
        try:
            url = parse_clickhouse_url(candidate)
        except StoreError as exc:
            assert "store URL" in str(exc)
        else:
            assert 0 < url.port < 65536 and url.database and url.host


def test_password_is_not_in_errors() -> None:
    with pytest.raises(StoreError) as caught:
        parse_clickhouse_url("clickhouse://user:s3cret@h:99999/db")
    assert "s3cret" not in str(caught.value)
