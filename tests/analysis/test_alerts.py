"""The watchdog's rules (analysis/alerts.py): each alert's condition, its culprit, once per
episode, and properties over any observations (hypothesis)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.analysis.alerts import (
    ALERT_KINDS,
    Alert,
    AlertPolicy,
    AlertRules,
    alert_from_dict,
    is_nonfinite,
    iso_time,
)
from stepwatch.analysis.markers import derive_alert_markers
from tests.support import examples

T0 = 1_700_000_000.0


def hb(step: int, ts: float, msg: str = "heartbeat", **fields: Any) -> dict[str, Any]:
    return {"ts": ts, "pid": 100, "rank": 0, "step": step, "msg": msg, **fields}


def stepped(rules: AlertRules, ranks: list[int], steps: int, *, dt: float = 0.1, t: float = T0) -> float:
    """Every rank completes ``steps`` steps, ``dt`` apart; returns the time of the last."""
    for i in range(1, steps + 1):
        t += dt
        for rank in ranks:
            rules.observe_step(rank, i, end_ts=t, at=t)
    return t


def kinds(alerts: list[Alert]) -> list[str]:
    return [a.kind for a in alerts]


def test_a_rank_that_stops_stepping_stalls_once_and_again_after_it_steps() -> None:
    rules = AlertRules(AlertPolicy(stall_after_s=3))
    rules.observe_heartbeat(0, hb(0, T0, "boot"), at=T0)
    t = stepped(rules, [0], 5)
    assert rules.check(t + 2.9) == []
    [alert] = rules.check(t + 3.1)
    assert alert.kind == "STALL" and alert.ranks == (0,) and alert.step == 5 and alert.severity == "crit"
    assert rules.check(t + 10) == []  # once per episode
    rules.observe_step(0, 6, end_ts=t + 11, at=t + 11)
    assert rules.check(t + 12) == []
    assert kinds(rules.check(t + 14.5)) == ["STALL"]  # a new episode


def test_no_stall_before_the_first_step_within_the_startup_grace() -> None:
    rules = AlertRules(AlertPolicy(stall_after_s=3, startup_grace_s=60))
    rules.observe_heartbeat(0, hb(0, T0, "boot"), at=T0)
    assert rules.check(T0 + 30) == []
    assert kinds(rules.check(T0 + 61)) == ["STALL"]


def test_a_stopped_rank_never_stalls() -> None:
    rules = AlertRules(AlertPolicy(stall_after_s=3))
    t = stepped(rules, [0], 5)
    rules.observe_heartbeat(0, hb(5, t, "stop"), at=t)
    assert rules.check(t + 100) == [] and rules.all_ended()


def test_under_ddp_the_culprit_is_the_rank_outside_a_collective_and_the_other_waits() -> None:
    rules = AlertRules(AlertPolicy(stall_after_s=3))
    t = stepped(rules, [0, 1], 5)
    # rank 0 went on into step 6 and blocks in backward's all-reduce; rank 1 sleeps between steps
    rules.observe_heartbeat(0, {**hb(5, t + 1.5), "rank": 0, "phase": "backward"}, at=t + 1.5)
    rules.observe_heartbeat(1, {**hb(5, t + 1.5), "rank": 1, "phase": None}, at=t + 1.5)
    [alert] = rules.check(t + 3.5)
    assert alert.ranks == (1,)
    assert alert.evidence["culprit_rule"] == "phase outside collectives"
    assert [w["rank"] for w in alert.evidence["waiting"]] == [0]
    assert "rank 0 waits for it" in alert.message


def test_the_lowest_step_is_the_culprit() -> None:
    rules = AlertRules(AlertPolicy(stall_after_s=3))
    t = stepped(rules, [0, 1], 5)
    rules.observe_step(0, 6, end_ts=t + 0.1, at=t + 0.1)
    [alert] = rules.check(t + 4)
    assert alert.ranks == (1,) and alert.evidence["culprit_rule"] == "lowest last step"


def test_a_rank_whose_heartbeat_stopped_is_the_culprit() -> None:
    rules = AlertRules(AlertPolicy(stall_after_s=3, heartbeat_interval_s=1))
    t = stepped(rules, [0, 1], 5)
    for k in range(1, 6):  # rank 0 still beats (blocked in a collective, GIL released); rank 1 is silent
        rules.observe_heartbeat(0, {**hb(5, t + k), "rank": 0}, at=t + k)
    [alert] = rules.check(t + 5.5)
    assert alert.ranks == (1,) and alert.evidence["culprit_rule"] == "heartbeat silent"


def test_a_tie_waits_for_current_phases_then_decides() -> None:
    rules = AlertRules(AlertPolicy(stall_after_s=3, heartbeat_interval_s=5))
    t = stepped(rules, [0, 1], 5)
    for rank in (0, 1):  # phases seen before the stall: stale
        rules.observe_heartbeat(rank, {**hb(5, t - 0.2), "rank": rank, "phase": "forward"}, at=t - 0.2)
    assert rules.check(t + 3.5) == []  # deferred: no heartbeat since the ranks stopped
    rules.observe_heartbeat(0, {**hb(5, t + 4), "rank": 0, "phase": "backward"}, at=t + 4)
    rules.observe_heartbeat(1, {**hb(5, t + 4), "rank": 1, "phase": "data_load"}, at=t + 4)
    [alert] = rules.check(t + 4.5)
    assert alert.ranks == (1,)


def test_an_undecidable_tie_names_every_tied_rank_after_the_grace() -> None:
    rules = AlertRules(AlertPolicy(stall_after_s=3, heartbeat_interval_s=1))
    t = stepped(rules, [0, 1], 5)
    for k in range(1, 4):
        for rank in (0, 1):
            rules.observe_heartbeat(rank, {**hb(5, t + k), "rank": rank}, at=t + k)
    [alert] = rules.check(t + 3.5)
    assert alert.ranks == (0, 1) and alert.evidence["culprit_rule"] == "undecided"


def test_an_advancing_rank_is_neither_culprit_nor_waiting() -> None:
    rules = AlertRules(AlertPolicy(stall_after_s=3))
    t = stepped(rules, [0, 1], 5)
    for i in range(6, 60):
        rules.observe_step(1, i, end_ts=t + (i - 5) * 0.1, at=t + (i - 5) * 0.1)
    [alert] = rules.check(t + 5.5)
    assert alert.ranks == (0,) and alert.evidence["waiting"] == [] and alert.evidence["advancing"] == [1]


def test_rank_lost_needs_the_grace_and_no_stop_record() -> None:
    rules = AlertRules(AlertPolicy(lost_grace_s=2))
    t = stepped(rules, [0, 1], 3)
    rules.observe_gone(0, at=t + 1)
    rules.observe_gone(1, at=t + 1)
    rules.observe_stop(1, at=t + 1.5)  # its stop record came after all
    assert rules.check(t + 2) == []
    [alert] = rules.check(t + 3.1)
    assert alert.kind == "RANK_LOST" and alert.ranks == (0,) and rules.check(t + 10) == []
    assert rules.all_ended()


def test_rank_lost_at_the_end_is_said_at_once() -> None:
    rules = AlertRules(AlertPolicy(lost_grace_s=2))
    rules.observe_heartbeat(0, hb(1, T0), at=T0)
    rules.observe_gone(0, at=T0 + 1)
    assert kinds(rules.check(T0 + 1, final=True)) == ["RANK_LOST"]


def test_a_lost_rank_is_not_also_a_stall() -> None:
    rules = AlertRules(AlertPolicy(stall_after_s=3, lost_grace_s=1))
    t = stepped(rules, [0, 1], 3)
    rules.observe_gone(1, at=t + 0.5)
    assert kinds(rules.check(t + 10)) == ["RANK_LOST"]


def beating(rules: AlertRules, ranks: list[int], until: float, *, every: float = 0.5, host: str = "node-b") -> None:
    """Each rank's frames reach the aggregator with a heartbeat every ``every`` s, T0 to ``until``."""
    t = T0
    while t <= until:
        for rank in ranks:
            rules.observe_frame(rank, t, host=host)
            rules.observe_heartbeat(rank, {**hb(3, t), "rank": rank, "pid": 200 + rank}, at=t)
        t += every


def test_a_connection_closed_without_stop_is_lost_after_the_heartbeat_grace_saying_how() -> None:
    rules = AlertRules(AlertPolicy(stall_after_s=3, lost_grace_s=1))
    stepped(rules, [0, 1], 3)
    t = T0 + 5
    beating(rules, [0, 1], t)
    rules.observe_disconnect(1, at=t + 0.2)
    grace = max(1.0, 2.5 * 0.5, 0.5 + 2.0)  # the rank's heartbeat may be silent this long
    assert rules.check(t + 0.2 + grace - 0.1) == []
    [alert] = rules.check(t + 0.2 + grace)
    assert alert.kind == "RANK_LOST" and alert.ranks == (1,) and alert.step == 3
    evidence = alert.evidence
    assert evidence["lost_by"] == "connection" and evidence["host"] == "node-b" and evidence["pid"] == 201
    assert evidence["connection_dropped_at"] == iso_time(t + 0.2) and evidence["grace_s"] == grace
    assert evidence["last_heartbeat"] is not None and evidence["last_frame_at"] is not None
    assert "on node-b, pid 201" in alert.message and "connection to the aggregator closed at" in alert.message
    assert rules.check(t + 60) == []  # once; and no STALL of the rank that waits for it


@pytest.mark.parametrize("then", ["frame", "alive", "stop"])
def test_a_dropped_connection_is_no_loss_once_the_rank_is_heard_seen_alive_or_stopped(then: str) -> None:
    rules = AlertRules(AlertPolicy(stall_after_s=30, lost_grace_s=1))
    beating(rules, [0], T0 + 5)
    rules.observe_disconnect(0, at=T0 + 5.2)
    if then == "frame":
        rules.observe_frame(0, T0 + 6.5)  # its sender reconnected
    elif then == "alive":
        rules.observe_process_alive(0)  # its pid, on this host, is alive
    else:
        rules.observe_stop(0, at=T0 + 5.3)
    assert rules.check(T0 + 20) == []
    assert rules.check(T0 + 21, final=True) == []


def test_a_stop_before_the_drop_keeps_it_from_counting_and_the_end_judges_a_drop_at_once() -> None:
    rules = AlertRules(AlertPolicy(lost_grace_s=2))
    beating(rules, [0, 1], T0 + 2)
    rules.observe_stop(0, at=T0 + 2.1)
    rules.observe_disconnect(0, at=T0 + 2.2)
    rules.observe_disconnect(1, at=T0 + 2.2)
    [alert] = rules.check(T0 + 2.3, final=True)
    assert alert.kind == "RANK_LOST" and alert.ranks == (1,) and alert.evidence["lost_by"] == "connection"


def test_no_stall_is_judged_while_a_dropped_rank_may_be_lost() -> None:
    rules = AlertRules(AlertPolicy(stall_after_s=1, lost_grace_s=1, heartbeat_interval_s=5))
    t = stepped(rules, [0, 1], 3)
    rules.observe_disconnect(1, at=t + 0.1)
    assert rules.check(t + 12) == []  # rank 0 waits for rank 1: no stall while 2.5 heartbeats may pass
    assert kinds(rules.check(t + 0.1 + 12.5)) == ["RANK_LOST"]
    assert rules.check(t + 30) == []


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "nan", "-inf"])
def test_a_nonfinite_loss_mark_alerts_once_until_it_is_finite_again(value: Any) -> None:
    rules = AlertRules()
    rules.observe_mark(0, "loss", 1.5, key="s1", at=T0)
    rules.observe_mark(0, "loss", value, step=2, key="s2", ts=T0 + 1, at=T0 + 1)
    [alert] = rules.check(T0 + 1)
    assert alert.kind == "NONFINITE" and alert.ranks == (0,) and alert.step == 2
    assert alert.evidence["metric"] == "loss"
    rules.observe_mark(0, "loss", value, step=3, key="s3", at=T0 + 2)
    assert rules.check(T0 + 2) == []
    rules.observe_mark(0, "loss", 1.0, step=4, key="s4", at=T0 + 3)
    assert rules.check(T0 + 3) == []
    rules.observe_mark(0, "loss", value, step=5, key="s5", at=T0 + 4)
    assert kinds(rules.check(T0 + 4)) == ["NONFINITE"]


def test_a_null_progress_loss_is_nonfinite_and_other_marks_are_ignored() -> None:
    rules = AlertRules()
    rules.observe_mark(0, "learning_rate", float("nan"), at=T0)
    assert rules.check(T0) == []
    rules.observe_heartbeat(0, hb(7, T0, "progress", loss=None), at=T0)  # how the writer keeps NaN
    [alert] = rules.check(T0)
    assert alert.kind == "NONFINITE" and alert.step == 7


def test_zero_grad_after_ten_zero_steps_not_nine() -> None:
    rules = AlertRules()
    for step in range(1, 10):
        rules.observe_mark(0, "grad_norm", 0.0, step=step, key=step, at=T0 + step)
        rules.observe_heartbeat(0, hb(step, T0 + step, "progress", grad_norm=0.0), at=T0 + step)  # same step
    assert rules.check(T0 + 10) == []
    rules.observe_mark(0, "grad_norm", 0.0, step=10, key=10, at=T0 + 10)
    [alert] = rules.check(T0 + 10)
    assert alert.kind == "ZERO_GRAD" and alert.severity == "warn" and alert.step == 10
    rules.observe_mark(0, "grad_norm", 0.0, step=11, key=11, at=T0 + 11)
    assert rules.check(T0 + 11) == []


def test_a_nonzero_grad_norm_resets_the_count() -> None:
    rules = AlertRules()
    for step in range(1, 20):
        value = 0.5 if step == 8 else 0.0
        rules.observe_mark(0, "grad_norm", value, step=step, key=step, at=T0 + step)
    assert kinds(rules.check(T0 + 20)) == ["ZERO_GRAD"]  # steps 9..18 are ten in a row


def test_throughput_drop_after_three_slow_windows() -> None:
    rules = AlertRules(AlertPolicy(throughput_window_s=1.0))
    t, step = T0, 0
    for _ in range(200):  # 20 steps/s for 10 s
        t += 0.05
        step += 1
        rules.observe_step(0, step, end_ts=t, at=t)
        assert rules.check(t) == []
    alerts = []
    for _ in range(20):  # 4 steps/s
        t += 0.25
        step += 1
        rules.observe_step(0, step, end_ts=t, at=t)
        alerts += rules.check(t)
    [alert] = alerts
    assert alert.kind == "THROUGHPUT_DROP" and alert.ranks == (0,) and alert.severity == "warn"
    assert alert.evidence["ranks"][0]["median_steps_per_s"] == pytest.approx(20, rel=0.1)


def test_steady_slow_steps_are_no_drop() -> None:
    rules = AlertRules(AlertPolicy(throughput_window_s=1.0))
    t = T0
    for step in range(1, 80):  # a step every 1.5 s: windows hold 0 or 1 steps, so they are widened
        t += 1.5 + (0.4 if step % 3 == 0 else 0)
        rules.observe_step(0, step, end_ts=t, at=t)
        assert rules.check(t) == []


def test_alert_records_round_trip_and_become_markers() -> None:
    alert = Alert(ts=T0, kind="STALL", severity="crit", ranks=(1,), step=5, message="rank 1 made no progress",
                  evidence={"waiting": [{"rank": 0}]}, session_id="s")
    record = alert.to_dict()
    assert set(record) == {"ts", "iso", "kind", "severity", "ranks", "step", "message", "evidence", "session_id"}
    assert alert_from_dict(record) == alert
    [marker] = derive_alert_markers([record])
    assert marker.kind == "alert" and marker.rank == 1 and marker.severity == "critical"
    assert marker.start_ns == int(T0 * 1e9) and marker.label.startswith("STALL: ")
    assert alert.line() == "[stepwatch] ALERT STALL (crit) rank 1 made no progress"


def test_policy_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        AlertPolicy(stall_after_s=0)
    with pytest.raises(ValueError):
        AlertPolicy(stall_after_s=math.nan)


# -- properties ------------------------------------------------------------------------------------

_values = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5), st.none(),
                    st.sampled_from(["nan", "inf", "-inf", "x", ""]), st.booleans())
_observation = st.one_of(
    st.tuples(st.just("step"), st.integers(0, 3), st.integers(0, 50), st.floats(0, 100)),
    st.tuples(st.just("hb"), st.integers(0, 3), st.integers(0, 50),
              st.sampled_from(["heartbeat", "progress", "boot", "stop", "other"]),
              st.sampled_from([None, "backward", "forward", "optimizer_step", ""]), _values),
    st.tuples(st.just("mark"), st.integers(0, 3), st.sampled_from(["loss", "grad_norm", "lr"]), _values,
              st.integers(0, 50)),
    st.tuples(st.just("gone"), st.integers(0, 3)),
    st.tuples(st.just("drop"), st.integers(0, 3)),
    st.tuples(st.just("frame"), st.integers(0, 3)),
    st.tuples(st.just("alive"), st.integers(0, 3)),
    st.tuples(st.just("stop"), st.integers(0, 3)),
    st.tuples(st.just("activity"), st.integers(0, 3), st.floats(0, 100)),
    st.tuples(st.just("check"), st.floats(0, 20)),
)


def _play(observations: list[tuple[Any, ...]], policy: AlertPolicy) -> list[dict[str, Any]]:
    rules = AlertRules(policy, session_id="s")
    now = T0
    out = []
    for obs in observations:
        now += 0.5
        kind = obs[0]
        if kind == "step":
            rules.observe_step(obs[1], obs[2], end_ts=T0 + obs[3], at=now)
        elif kind == "hb":
            record = {"ts": now, "pid": 7, "rank": obs[1], "step": obs[2], "msg": obs[3], "phase": obs[4],
                      "loss": obs[5], "grad_norm": obs[5]}
            rules.observe_heartbeat(obs[1], record, at=now)
        elif kind == "mark":
            rules.observe_mark(obs[1], obs[2], obs[3], step=obs[4], key=obs[4], ts=now, at=now)
        elif kind == "gone":
            rules.observe_gone(obs[1], at=now)
        elif kind == "drop":
            rules.observe_disconnect(obs[1], at=now)
        elif kind == "frame":
            rules.observe_frame(obs[1], now, host="node-b")
        elif kind == "alive":
            rules.observe_process_alive(obs[1])
        elif kind == "stop":
            rules.observe_stop(obs[1], at=now)
        elif kind == "activity":
            rules.observe_activity(obs[1], ts=T0 + obs[2], at=now)
        else:
            now += obs[1]
            out += [a.to_dict() for a in rules.check(now)]
    out += [a.to_dict() for a in rules.check(now + 1000)]
    out += [a.to_dict() for a in rules.check(now + 1001, final=True)]
    return out


@settings(max_examples=examples(150), deadline=None)
@given(st.lists(_observation, max_size=60))
def test_any_observations_give_well_formed_deterministic_alerts(observations: list[tuple[Any, ...]]) -> None:
    policy = AlertPolicy(stall_after_s=2, throughput_window_s=1, lost_grace_s=1)
    first = _play(observations, policy)
    assert first == _play(observations, policy)  # the same observations, the same alerts
    seen_ranks = {obs[1] for obs in observations if obs[0] != "check"}
    for alert in first:
        assert alert["kind"] in ALERT_KINDS and alert["severity"] in ("warn", "crit")
        assert alert["ranks"] and set(alert["ranks"]) <= seen_ranks
        assert isinstance(alert["message"], str) and alert["message"]
        if alert["kind"] == "RANK_LOST":  # only a process found gone or a connection closed says lost
            assert set(alert["ranks"]) <= {obs[1] for obs in observations if obs[0] in ("gone", "drop")}
            assert alert["evidence"]["lost_by"] in ("process", "connection")
    nonfinite_seen = any(
        (obs[0] == "mark" and obs[2] in ("loss", "grad_norm") and is_nonfinite(obs[3]) is not None)
        or (obs[0] == "hb" and obs[3] == "progress" and is_nonfinite(obs[5], null_is_nonfinite=True) is not None)
        for obs in observations)
    if not nonfinite_seen:
        assert "NONFINITE" not in [a["kind"] for a in first]


@settings(max_examples=examples(60), deadline=None)
@given(st.integers(1, 4), st.integers(20, 120), st.floats(0.02, 0.5), st.integers(0, 1000))
def test_a_healthy_run_raises_nothing(ranks: int, steps: int, dt: float, seed: int) -> None:
    import random

    jitter = random.Random(seed)
    rules = AlertRules(AlertPolicy(stall_after_s=max(3.0, 4 * dt), throughput_window_s=1.0))
    t = T0
    for step in range(1, steps + 1):
        t += dt * jitter.uniform(0.8, 1.2)
        for rank in range(ranks):
            rules.observe_step(rank, step, end_ts=t, at=t)
            rules.observe_mark(rank, "loss", 1.0 / step, step=step, key=step, at=t)
            rules.observe_mark(rank, "grad_norm", jitter.uniform(0.1, 2), step=step, key=step, at=t)
            if step % 10 == 0:
                rules.observe_heartbeat(rank, {"ts": t, "pid": 1, "rank": rank, "step": step, "msg": "heartbeat",
                                               "phase": "forward"}, at=t)
        assert rules.check(t) == []
    for rank in range(ranks):
        rules.observe_stop(rank, at=t + 0.1)
    assert rules.check(t + 1000, final=True) == []


@settings(max_examples=examples(60), deadline=None)
@given(st.integers(1, 4), st.lists(st.floats(0.1, 30), min_size=1, max_size=30))
def test_a_stall_alerts_once_per_episode(ranks: int, gaps: list[float]) -> None:
    rules = AlertRules(AlertPolicy(stall_after_s=3))
    t = stepped(rules, list(range(ranks)), 5)
    alerts = []
    for gap in gaps:
        t += gap
        alerts += rules.check(t)
    assert len([a for a in alerts if a.kind == "STALL"]) <= 1


def test_a_late_heartbeat_count_is_no_progress_once_steps_come() -> None:
    rules = AlertRules(AlertPolicy(stall_after_s=3))
    rules.observe_heartbeat(0, hb(0, T0, "boot"), at=T0)
    t = stepped(rules, [0], 21)  # indexes 1..21 here
    rules.observe_heartbeat(0, hb(21, t + 2), at=t + 2)  # the periodic record, counting the same steps
    [alert] = rules.check(t + 3.1)
    assert alert.kind == "STALL" and alert.step == 21
