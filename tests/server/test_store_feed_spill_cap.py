"""The spill queue's cap, in the feed: while the store is down every batch is spilled until the
file holds ``spill_max_bytes``; past it a batch is counted lost (said once, naming the setting
and where the rows still are), and the run goes on."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from stepwatch.errors import StoreError
from stepwatch.server.store_feed import SPILL_MAX_ENV, SPILL_MAX_MB, StoreFeed, UnopenedStore, spill_max_bytes_from_env
from stepwatch.store.spill import SPILL_FILE, SpillQueue
from tests.support import free_port


def test_a_down_store_spills_up_to_the_cap_then_counts_the_rest_lost(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    url = f"clickhouse://default@127.0.0.1:{free_port()}/db"  # nothing listens there: the server is down
    feed = StoreFeed(UnopenedStore(url, StoreError("connection refused")), tmp_path / SPILL_FILE,
                     backoff_s=(60.0, 60.0), drain_s=0.1, spill_max_bytes=4_000)
    rows = [[step, "rank0", "x" * 40] for step in range(10)]  # ~550 bytes a batch as msgpack
    with caplog.at_level(logging.WARNING, logger="stepwatch.aggregator"):
        for _ in range(20):
            feed.submit({"steps": rows}, [], [], [])
    stats = feed.stats()
    spilled, lost = stats["store_spill_pending_batches"], feed.rows_lost
    assert 0 < spilled < 20 and stats["store_spill_pending_bytes"] <= 4_000
    assert lost == (20 - spilled) * len(rows) and feed.write_errors == 20 - spilled
    said = [r.getMessage() for r in caplog.records if "lost to the history" in r.getMessage()]
    assert len(said) == 1 and SPILL_MAX_ENV in said[0] and "stepwatch import RUN_DIR --into URL" in said[0]
    feed.close()
    queue = SpillQueue(tmp_path / SPILL_FILE)  # what waits for the server is still there, whole
    assert queue.batches == spilled and queue.bytes == stats["store_spill_pending_bytes"]
    queue.close()


def test_past_the_cap_a_batchs_session_upserts_are_still_queued(tmp_path: Path) -> None:
    """Its rows are lost, its session's close is not: else the session would read running for ever."""
    url = f"clickhouse://default@127.0.0.1:{free_port()}/db"
    feed = StoreFeed(UnopenedStore(url, StoreError("connection refused")), tmp_path / SPILL_FILE,
                     backoff_s=(60.0, 60.0), drain_s=0.1, spill_max_bytes=600)
    rows = [[step, "rank0", "x" * 40] for step in range(10)]
    feed.submit({"steps": rows}, [], [], [])  # fits
    close = {"session_id": "s", "status": "completed", "ended_at_ns": 5}
    feed.submit({"steps": rows}, [], [], [close])  # past the cap
    assert feed.rows_lost == len(rows)
    feed.close()
    queue = SpillQueue(tmp_path / SPILL_FILE)
    kept = queue.head(10**9)
    assert [(b.seq, b.rows, b.closes) for b in kept] == [(1, len(rows), []), (2, 0, [close])]
    queue.close()


@pytest.mark.parametrize(("text", "mib"), [(None, SPILL_MAX_MB), ("512", 512), ("0.5", 0.5), ("", SPILL_MAX_MB),
                                           ("lots", SPILL_MAX_MB), ("-1", SPILL_MAX_MB), ("inf", SPILL_MAX_MB)])
def test_the_cap_comes_from_the_environment_and_a_bad_value_keeps_the_default(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, text: str | None, mib: float) -> None:
    if text is None:
        monkeypatch.delenv(SPILL_MAX_ENV, raising=False)
    else:
        monkeypatch.setenv(SPILL_MAX_ENV, text)
    with caplog.at_level(logging.WARNING, logger="stepwatch.aggregator"):
        assert spill_max_bytes_from_env() == int(mib * 2**20)
    warned = [r.getMessage() for r in caplog.records]
    assert warned == ([] if text in (None, "", "512", "0.5") else
                      [f"{SPILL_MAX_ENV}={text!r} is not a positive number of MiB: {SPILL_MAX_MB} is used"])
