"""What every command shares: fitting plain text to the reader's terminal width."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepwatch.ui.base import _columns, _fit_text

LONG = "  evidence: " + ", ".join(f"shares.phase{i} 0.{i:04d}" for i in range(12)) + "; window: steps 0-299"


def test_a_pipe_with_no_width_keeps_one_line_per_fact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    assert _columns() is None  # pytest's stdout is not a terminal
    assert _fit_text(LONG + "\n") == LONG + "\n"


def test_columns_folds_long_lines_under_their_own_indent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    folded = _fit_text("short line\n" + LONG + "\n").splitlines()
    assert folded[0] == "short line"
    assert all(len(line) <= 80 for line in folded)
    assert folded[1].startswith("  evidence: ") and all(line.startswith("    ") for line in folded[2:])
    assert " ".join(line.strip() for line in folded[1:]) == LONG.strip()


@given(st.lists(st.text(alphabet=" abc-/.", max_size=200), max_size=8), st.integers(20, 200))
def test_every_line_fits_and_no_word_is_lost(lines: list[str], width: int) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLUMNS", str(width))
        text = "\n".join(lines) + "\n"
        fitted = _fit_text(text)
    assert all(len(line) <= width for line in fitted.splitlines())
    assert "".join(fitted.split()) == "".join(text.split())
