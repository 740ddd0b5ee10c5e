"""``stepwatch query`` as a command (real subprocesses): the three formats, a refused write and an
SQL error as one ``error:`` line with exit code 2, usage errors, and a run with no history."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import sqlite3
from pathlib import Path

import pytest

from tests.support import run_stepwatch
from tests.support.capture import finish, start
from tests.support.trace_run import trace_run

pytestmark = pytest.mark.real  # every test here starts a process

SQL = "SELECT rank, COUNT(*) AS steps, MAX(step_ns) AS worst FROM steps GROUP BY rank ORDER BY rank"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    return trace_run(tmp_path_factory)


def _direct(run: Path, sql: str) -> list[tuple[object, ...]]:
    with sqlite3.connect(f"{(run / 'history.sqlite').as_uri()}?mode=ro", uri=True) as db:
        return db.execute(sql).fetchall()


def test_json_csv_and_table_give_the_same_rows(run: Path) -> None:
    expected = _direct(run, SQL)
    as_json = run_stepwatch("query", str(run), SQL, "--format", "json", cwd=run.parent)
    assert as_json.returncode == 0, as_json.stderr
    assert [tuple(row.values()) for row in json.loads(as_json.stdout)] == expected
    assert list(json.loads(as_json.stdout)[0]) == ["rank", "steps", "worst"]
    as_csv = run_stepwatch("query", str(run / "history.sqlite"), SQL, "--format", "csv", cwd=run.parent)
    assert as_csv.returncode == 0, as_csv.stderr
    rows = list(csv.reader(io.StringIO(as_csv.stdout)))
    assert rows[0] == ["rank", "steps", "worst"] and [tuple(map(int, r)) for r in rows[1:]] == expected
    table = run_stepwatch("query", str(run), SQL, cwd=run.parent, COLUMNS="120")
    assert table.returncode == 0, table.stderr
    assert "worst" in table.stdout and str(expected[0][2]) in table.stdout and "2 rows" in table.stdout


def test_a_refused_write_and_an_sql_error_are_one_line_and_change_nothing(run: Path, tmp_path: Path) -> None:
    history = tmp_path / "history.sqlite"
    history.write_bytes((run / "history.sqlite").read_bytes())
    before = hashlib.sha256(history.read_bytes()).hexdigest()
    for sql, said in (("DELETE FROM steps_rows", "error: query: refused: stepwatch query is read-only"),
                      ("SELECT * FROM step", "error: query: no such table: step")):
        proc = run_stepwatch("query", str(history), sql, cwd=tmp_path)
        assert proc.returncode == 2 and proc.stdout == "", proc
        assert proc.stderr.startswith(said) and proc.stderr.count("\n") == 1, proc.stderr
    assert hashlib.sha256(history.read_bytes()).hexdigest() == before


def test_named_questions_and_usage_errors(run: Path) -> None:
    sid = json.loads((run / "run.json").read_text())["session_id"]
    proc = run_stepwatch("query", str(run), "--slowest-steps", "3", "--session", sid, "--format", "json", cwd=run.parent)
    assert proc.returncode == 0, proc.stderr
    slowest = json.loads(proc.stdout)
    assert len(slowest) == 3 and {row["session_id"] for row in slowest} == {sid}
    for args, said in ((["SELECT 1", "--sessions"], "either SQL or one named question"),
                       ([], "either SQL or one named question"),
                       (["SELECT 1", "--session", sid], "--session narrows a named question"),
                       (["--slowest-steps", "0"], "0 is not in the range")):
        proc = run_stepwatch("query", str(run), *args, cwd=run.parent)
        assert proc.returncode == 2 and said in proc.stderr, (args, proc.stderr)


def test_a_run_with_no_history_is_imported_and_left_as_it_was(tmp_path: Path) -> None:
    import stepwatch

    run_dir = tmp_path / "run"
    start(run_dir)
    for _ in range(3):
        with stepwatch.scope("work"):
            pass
    finish(run_dir)
    files = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    proc = run_stepwatch("query", str(run_dir), "SELECT name, COUNT(*) AS n FROM spans WHERE name = 'work' GROUP BY name",
                         "--format", "csv", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["name,n", "work,3"]
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == files
