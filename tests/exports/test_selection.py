"""``--steps A:B`` and ``--ranks LIST``: what they accept means what it says, and anything else
is a ValueError that says how to write it (never another exception)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepwatch.exports.selection import StepRange, parse_ranks, parse_steps

steps = st.integers(0, 10**9)


@given(steps, steps)
def test_a_range_is_a_python_slice_of_steps(a: int, b: int) -> None:
    if b <= a:
        with pytest.raises(ValueError, match="is empty"):
            parse_steps(f"{a}:{b}")
        return
    chosen = parse_steps(f" {a} : {b} ")
    assert chosen == StepRange(a, b)
    assert a in chosen and b - 1 in chosen and b not in chosen and (a == 0 or a - 1 not in chosen)


@given(steps)
def test_open_ends_and_single_steps(n: int) -> None:
    assert parse_steps(f"{n}:") == StepRange(n, None) and 10**12 in parse_steps(f"{n}:")
    assert parse_steps(f":{n + 1}") == StepRange(None, n + 1) and 0 in parse_steps(f":{n + 1}")
    assert parse_steps(str(n)) == StepRange(n, n + 1)
    assert parse_steps(":") == StepRange(None, None)


@given(st.text(max_size=12))
def test_any_text_parses_or_is_a_value_error_saying_how(text: str) -> None:
    try:
        chosen = parse_steps(text)
    except ValueError as exc:
        assert "A:B" in str(exc)
        return
    assert isinstance(chosen, StepRange)


@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 20)), min_size=1, max_size=8))
def test_a_list_of_ranks_and_ranges_is_their_union(items: list[tuple[int, int]]) -> None:
    text = ",".join(str(first) if width == 0 else f"{first}-{first + width}" for first, width in items)
    expected = {rank for first, width in items for rank in range(first, first + width + 1)}
    assert parse_ranks(text) == expected
    assert parse_ranks(text.replace(",", " , ")) == expected


@given(st.text(max_size=12))
def test_any_text_is_ranks_or_a_value_error_naming_it(text: str) -> None:
    try:
        ranks = parse_ranks(text)
    except ValueError as exc:
        assert "ranks" in str(exc)
        return
    assert ranks and all(isinstance(r, int) and r >= 0 for r in ranks)


@pytest.mark.parametrize(("text", "said"), [("", "no ranks"), ("1,,2", "empty item"), ("3-1", "runs backwards"),
                                            ("a", "'a' is not a rank"), ("99999999", "out of range")])
def test_bad_rank_lists_say_what_is_wrong(text: str, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        parse_ranks(text)
