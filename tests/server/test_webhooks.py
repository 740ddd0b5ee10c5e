"""Alert webhooks (``--alert-webhook``; docs/metrics.md) against real HTTP receivers: the live run's
alerts and verdict changes posted with a ``text`` line (the first posts refused, so retried);
``stepwatch watch`` posting what it finds; a receiver that never answers blocks nobody and its
posts are counted dropped; a 4xx is not retried."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from stepwatch.server.webhooks import WebhookSender, alert_payload
from tests.support import STEPWATCH, clean_env
from tests.support.feeds import FedRun, Receiver, fed_run


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> FedRun:
    return fed_run(tmp_path_factory)


@pytest.mark.real
def test_the_run_posts_its_alert_and_verdicts_retrying_a_failing_receiver(fed: FedRun) -> None:
    assert fed.returncode == 0, fed.stderr[-3000:]
    posts = [json.loads(body) for path, body, _ in fed.webhook_posts]
    assert all(path == "/hook" for path, _, _ in fed.webhook_posts)
    assert all(headers.get("Content-Type") == "application/json" for _, _, headers in fed.webhook_posts)
    delivered = posts[2:]  # the receiver answered 503 to the first two
    alerts = [p for p in delivered if p["event"] == "alert"]
    verdicts = [p for p in delivered if p["event"] == "verdict"]
    [nonfinite] = [p for p in alerts if p["alert"]["kind"] == "NONFINITE"]
    assert nonfinite["text"].startswith("[stepwatch] ALERT NONFINITE (crit)")
    assert nonfinite["alert"]["ranks"] == [1] and nonfinite["alert"]["severity"] == "crit"
    assert nonfinite["text"] in fed.stderr  # the line stepwatch run printed
    assert verdicts and all(p["text"].startswith("[stepwatch] verdict ") for p in verdicts)
    assert all(p["verdict"]["name"] and p["session_id"] == nonfinite["session_id"] for p in verdicts)
    # the two refused posts were the first tries of posts delivered later, not lost
    assert posts[0] in delivered and posts[1] in delivered
    hook = fed.stats["feeds"]["webhook"]
    assert hook["retries"] >= 2 and hook["failed"] == 0 and hook["dropped"] == 0
    assert hook["sent"] == len(delivered) == hook["queued"]


@pytest.mark.real
def test_watch_posts_the_alerts_it_finds(fed: FedRun, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(fed.run_dir, run_dir)
    (run_dir / "alerts.jsonl").unlink(missing_ok=True)  # watch raises them again, from the run's own files
    receiver = Receiver()
    try:
        done = subprocess.run([*STEPWATCH, "watch", str(run_dir), "--json", "--alert-webhook", f"{receiver.url}/w"],
                              env=clean_env(), capture_output=True, text=True, timeout=120)
    finally:
        receiver.close()
    assert done.returncode == 1, done.stderr  # 1: it raised alerts
    printed = [json.loads(line) for line in done.stdout.splitlines()]
    posted = [json.loads(body) for body in receiver.bodies("/w")]
    assert [p["alert"] for p in posted] == printed
    assert any(p["alert"]["kind"] == "NONFINITE" and p["text"].startswith("[stepwatch] ALERT NONFINITE")
               for p in posted)


def test_a_receiver_that_never_answers_blocks_nobody_and_drops_are_counted() -> None:
    receiver = Receiver(lambda n, path: None)  # takes the post, never answers
    sender = WebhookSender(f"{receiver.url}/", max_queue=3, attempts=2, backoff_s=0.05, timeout_s=0.3)
    try:
        started = time.perf_counter()
        accepted = [sender.send(alert_payload({"kind": "STALL", "severity": "crit", "message": f"m{i}"}))
                    for i in range(20)]
        spent = time.perf_counter() - started
        assert spent < 0.1, spent  # queued, never waited on
        assert sum(accepted) <= 4 and sender.dropped == 20 - sum(accepted)
        assert not sender.close(timeout=0.5)  # the posts in flight could not finish
        stats = sender.stats()
        assert stats["dropped"] + stats["failed"] + stats["sent"] >= 16 and stats["sent"] == 0
        assert stats["dropped"] >= 16
    finally:
        receiver.close()


def test_a_refusal_is_not_retried_and_a_late_success_is(tmp_path: Path) -> None:
    refusing = Receiver(lambda n, path: 400)
    flaky = Receiver(lambda n, path: 500 if n < 3 else 200)
    senders = [WebhookSender(f"{r.url}/", attempts=4, backoff_s=0.01) for r in (refusing, flaky)]
    try:
        for sender in senders:
            sender.send({"text": "hello"})
        assert all(sender.close(timeout=10) for sender in senders)
        refused, retried = (s.stats() for s in senders)
        assert (refused["failed"], refused["retries"], refused["sent"]) == (1, 0, 0)
        assert refused["last_error"] == "HTTP 400"
        assert (retried["failed"], retried["retries"], retried["sent"]) == (0, 2, 1)
        assert len(flaky.bodies()) == 3 and len(refusing.bodies()) == 1
    finally:
        refusing.close()
        flaky.close()


def test_a_webhook_url_must_be_http() -> None:
    with pytest.raises(ValueError, match="not an http"):
        WebhookSender("ftp://example.invalid/hook")
