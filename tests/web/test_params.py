"""What the dashboard takes from a URL: the live cursor and the session id. Any text is either a
value of the right shape or a 400 saying why (hypothesis), never another exception."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepwatch.web.addresses import is_loopback
from stepwatch.web.app import _cursor_param, _HttpError, _session_param

_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
                     max_leaves=12)


@given(st.text(max_size=200) | _json.map(json.dumps))
def test_any_cursor_text_is_a_cursor_or_a_400(text: str) -> None:
    try:
        cursor = _cursor_param(text)
    except _HttpError as exc:
        assert exc.status == 400 and exc.message
        return
    assert set(cursor) <= {"steps", "memory_ns", "alerts", "verdicts"}
    assert all(isinstance(k, str) and isinstance(v, int) for k, v in cursor["steps"].items())
    assert all(isinstance(cursor[k], int) for k in cursor if k != "steps")


@given(st.dictionaries(st.integers(0, 4096), st.integers(-1, 10**9), max_size=64), st.integers(0, 10**19))
def test_a_page_cursor_reads_back_as_it_was_sent(steps: dict[int, int], memory_ns: int) -> None:
    sent = {"steps": {str(k): v for k, v in steps.items()}, "memory_ns": memory_ns, "alerts": 3, "verdicts": 0}
    try:
        assert _cursor_param(json.dumps(sent)) == sent
    except _HttpError:
        assert memory_ns >= 1 << 62


@given(st.text(max_size=300))
def test_any_session_text_is_an_id_or_a_400(text: str) -> None:
    try:
        assert _session_param(text) == text
    except _HttpError as exc:
        assert exc.status == 400 and "session id" in exc.message


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("::1", True), ("localhost", True),
                                                ("127.8.9.1", True), ("0.0.0.0", False), ("10.0.0.5", False),
                                                ("example.org", False), ("::", False)])
def test_only_loopback_binds_go_without_a_token(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
