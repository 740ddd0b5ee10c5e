"""Where the dashboard and /metrics bind (server/binds.py): never beyond loopback without a token,
whatever is asked; an address asked for is taken as given when allowed, refused when not."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepwatch.errors import StepwatchError
from stepwatch.server.binds import http_bind
from stepwatch.web.addresses import is_loopback

hosts = st.sampled_from(["127.0.0.1", "::1", "localhost", "0.0.0.0", "::", "192.0.2.7", "node0", "127.8.9.10"])


@given(hosts, st.none() | st.just("s3cret"), st.none() | hosts)
def test_nothing_binds_beyond_loopback_without_a_token(host: str, token: str | None, asked: str | None) -> None:
    try:
        bound = http_bind(host, token, asked, "--metrics-host")
    except StepwatchError as exc:
        assert asked is not None and token is None and not is_loopback(asked)
        assert str(exc) == f"--metrics-host {asked} is not loopback: it then needs a token (--token-env VAR)"
        return
    assert token is not None or is_loopback(bound)
    assert bound == (asked if asked is not None else host if token is not None or is_loopback(host) else "127.0.0.1")


def test_the_aggregators_host_beyond_loopback_leaves_them_on_loopback_without_a_token() -> None:
    assert http_bind("0.0.0.0", None, None, "--ui-host") == "127.0.0.1"
    assert http_bind("0.0.0.0", "t", None, "--ui-host") == "0.0.0.0"
    with pytest.raises(StepwatchError, match="--ui-host 0.0.0.0 is not loopback"):
        http_bind("127.0.0.1", None, "0.0.0.0", "--ui-host")
