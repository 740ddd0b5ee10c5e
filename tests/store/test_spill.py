"""The aggregator's spill queue (store/spill.py), on real SQLite files: what goes in comes back
the same, lowest sequence first, after a reopen too; a damaged batch is named, not fatal."""

from __future__ import annotations

import sqlite3
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepwatch.store.spill import SpillBatch, SpillFull, SpillQueue, UnreadableBatch

_VALUE = st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False), st.text(max_size=20))
_ROW = st.lists(_VALUE, min_size=1, max_size=5)
_TABLES = st.dictionaries(st.sampled_from(["steps", "spans", "marks", "alerts"]), st.lists(_ROW, max_size=4), max_size=3)
_SESSION = st.fixed_dictionaries({"session_id": st.text(min_size=1, max_size=8), "status": st.sampled_from(
    [None, "running", "completed"]), "started_at_ns": st.one_of(st.none(), st.integers(0, 2**62))})


def batch(seq: int, tables: dict[str, list[Any]], ids: list[Any] = (), opens: list[Any] = (),
          closes: list[Any] = ()) -> SpillBatch:
    return SpillBatch(seq, tables, list(ids), list(opens), list(closes))


@given(batches=st.lists(st.tuples(_TABLES, st.lists(st.tuples(st.text(max_size=32), st.integers(0, 2**62)), max_size=2),
                                  st.lists(_SESSION, max_size=2), st.lists(_SESSION, max_size=2)), min_size=1, max_size=5),
       order=st.randoms())
def test_batches_come_back_as_pushed_lowest_seq_first_after_a_reopen(batches: list[Any], order: Any) -> None:
    pushed = [batch(seq, t, [list(i) for i in ids], o, c) for seq, (t, ids, o, c) in enumerate(batches, 1)]
    shuffled = list(pushed)
    order.shuffle(shuffled)  # a batch spilled late (the one under way when the server went) keeps its place
    with tempfile.TemporaryDirectory() as tmp:
        queue = SpillQueue(Path(tmp) / "spill.sqlite")
        for b in shuffled:
            queue.push(b)
        queue.close()
        queue = SpillQueue(Path(tmp) / "spill.sqlite")
        assert (queue.batches, queue.rows, queue.last_seq) == (len(pushed), sum(b.rows for b in pushed), len(pushed))
        read = []
        while (first := queue.first()) is not None:
            read.append(first)
            queue.remove(first.seq)
        assert read == pushed
        assert (queue.batches, queue.rows) == (0, 0)
        queue.close()


def test_the_same_seq_pushed_twice_is_one_batch(tmp_path: Path) -> None:
    queue = SpillQueue(tmp_path / "spill.sqlite")
    queue.push(batch(7, {"steps": [[1, 2]]}))
    queue.push(batch(7, {"steps": [[1, 2], [3, 4]]}))
    assert (queue.batches, queue.rows) == (1, 2)
    assert queue.first() == batch(7, {"steps": [[1, 2], [3, 4]]})
    queue.close()


def test_a_damaged_batch_is_named_with_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "spill.sqlite"
    queue = SpillQueue(path)
    queue.push(batch(1, {"marks": [[1], [2], [3]]}))
    queue.close()
    db = sqlite3.connect(path)
    db.execute("UPDATE batches SET payload = x'c1c1c1'")
    db.commit()
    db.close()
    queue = SpillQueue(path)
    with pytest.raises(UnreadableBatch, match="batch 1 cannot be read back") as caught:
        queue.first()
    assert (caught.value.seq, caught.value.rows) == (1, 3) and str(path) in str(caught.value)
    queue.remove(1)
    assert queue.first() is None and queue.batches == 0
    queue.close()


def test_the_head_is_the_first_batches_that_fit_and_stops_before_a_damaged_one(tmp_path: Path) -> None:
    path = tmp_path / "spill.sqlite"
    queue = SpillQueue(path)
    for seq, rows in ((1, 3), (2, 4), (3, 2), (4, 5)):
        queue.push(batch(seq, {"steps": [[seq, n] for n in range(rows)]}))
    assert [b.seq for b in queue.head(0)] == [1]  # at least one, however big
    assert [b.seq for b in queue.head(9)] == [1, 2, 3]
    assert [b.seq for b in queue.head(100)] == [1, 2, 3, 4]
    db = sqlite3.connect(path)
    db.execute("UPDATE batches SET payload = x'c1c1c1' WHERE seq = 3")
    db.commit()
    db.close()
    assert [b.seq for b in queue.head(100)] == [1, 2]  # the damaged one is read alone, and named, later
    queue.remove(1)
    queue.remove(2)
    with pytest.raises(UnreadableBatch, match="batch 3"):
        queue.head(100)
    queue.close()


# -- the cap: the queue never holds more than max_bytes of batches --------------------------------

_STEP = st.one_of(st.tuples(st.just("push"), st.integers(1, 12), st.integers(0, 40)),  # seq, rows
                  st.tuples(st.just("remove"), st.integers(1, 12), st.just(0)))


@given(steps=st.lists(_STEP, max_size=30), cap=st.integers(0, 2_000))
def test_a_capped_queue_refuses_what_would_pass_its_cap_and_nothing_else_changes(steps: list[Any], cap: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        queue = SpillQueue(Path(tmp) / "spill.sqlite", max_bytes=cap)
        held: dict[int, SpillBatch] = {}
        for op, seq, rows in steps:
            if op == "remove":
                queue.remove(seq)
                held.pop(seq, None)
                continue
            b = batch(seq, {"steps": [[seq, i, "x" * 10] for i in range(rows)]})
            before = (queue.batches, queue.rows, queue.bytes)
            try:
                queue.push(b)
            except SpillFull as exc:
                assert str(exc).startswith(f"{queue.path}: the spill queue holds ") and f"cap is {cap}" in str(exc)
                assert (queue.batches, queue.rows, queue.bytes) == before  # refused whole
                continue
            held[seq] = b
            assert queue.bytes <= cap
        assert (queue.batches, queue.rows) == (len(held), sum(b.rows for b in held.values()))
        size = queue.bytes
        queue.close()
        queue = SpillQueue(Path(tmp) / "spill.sqlite", max_bytes=cap)  # counted again from the file
        assert (queue.batches, queue.bytes) == (len(held), size)
        assert queue.head(10**9) == [held[seq] for seq in sorted(held)]
        queue.close()


def test_without_a_cap_every_batch_is_queued(tmp_path: Path) -> None:
    queue = SpillQueue(tmp_path / "spill.sqlite")
    for seq in range(1, 6):
        queue.push(batch(seq, {"steps": [[seq, "y" * 1000]]}))
    assert queue.batches == 5 and queue.bytes > 5000
    queue.close()
