"""How the store feed joins waiting ticks into one write (server/store_feed.py ``group`` and
``merged``): within the row bound, never past a tick that closes sessions, every row once and
in tick order."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from stepwatch.server.store_feed import group, merged
from stepwatch.store.spill import SpillBatch

_TICK = st.tuples(st.dictionaries(st.sampled_from(["steps", "spans", "marks"]),
                                  st.lists(st.tuples(st.integers(0, 9)), max_size=4), max_size=3),
                  st.lists(st.integers(0, 9), max_size=2), st.booleans(), st.booleans())


def ticks(drawn: list[Any]) -> list[SpillBatch]:
    return [SpillBatch(seq, tables, [f"b{seq}-{i}" for i in ids], [{"session_id": f"o{seq}"}] if opens else [],
                       [{"session_id": f"c{seq}"}] if closes else [])
            for seq, (tables, ids, opens, closes) in enumerate(drawn, 1)]


@given(drawn=st.lists(_TICK, min_size=1, max_size=8), max_rows=st.integers(0, 12))
def test_a_group_fits_its_bound_ends_at_a_close_and_merges_every_row_in_order(drawn: list[Any], max_rows: int) -> None:
    batches = ticks(drawn)
    chosen = group(batches, max_rows)
    assert chosen == batches[:len(chosen)] and chosen  # a prefix, never empty
    assert len(chosen) == 1 or sum(b.rows for b in chosen) <= max_rows
    assert all(not b.closes for b in chosen[:-1])  # a close ends it
    if len(chosen) < len(batches):  # it stopped for a reason
        assert chosen[-1].closes or sum(b.rows for b in chosen) + batches[len(chosen)].rows > max_rows
    one = merged(chosen)
    assert one.seq == chosen[-1].seq and one.rows == sum(b.rows for b in chosen)
    for table in {t for b in chosen for t in b.tables}:
        assert one.tables[table] == [row for b in chosen for row in b.tables.get(table, [])]
    assert one.batch_ids == [i for b in chosen for i in b.batch_ids]
    assert (one.opens, one.closes) == ([o for b in chosen for o in b.opens], [c for b in chosen for c in b.closes])
