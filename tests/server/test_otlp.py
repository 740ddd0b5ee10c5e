"""OTLP export while the run trains (``--otlp-endpoint``; docs/metrics.md): the live 2-rank run's
spans and metrics, as the receiver the tests started got them, decoded with the official
``opentelemetry-proto`` messages: names, units, attributes, parentage and the sampling rule; and
the sampling rule's properties, whatever order spans arrive in."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepwatch.server.otlp import SpanSampler
from tests.support.feeds import FedRun, fed_run

FULL_FIRST, FULL_EVERY = 3, 10  # the run's STEPWATCH_OTLP_FULL_FIRST / _EVERY
PHASES = {"data_load", "forward", "backward", "optimizer_step"}


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> FedRun:
    return fed_run(tmp_path_factory)


def _attrs(pairs: Any) -> dict[str, Any]:
    out = {}
    for kv in pairs:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


def _spans(fed: FedRun) -> list[dict[str, Any]]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    spans = []
    for path, body, headers in fed.otlp_posts:
        if path != "/v1/traces":
            continue
        assert {k.lower(): v for k, v in headers.items()}["content-type"] == "application/x-protobuf"
        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            resource = _attrs(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                assert scope_spans.scope.name == "stepwatch"
                for span in scope_spans.spans:
                    spans.append({"name": span.name, "trace": span.trace_id, "id": span.span_id,
                                  "parent": span.parent_span_id, "start": span.start_time_unix_nano,
                                  "end": span.end_time_unix_nano, "attrs": _attrs(span.attributes),
                                  "resource": resource})
    return spans


@pytest.mark.real
def test_spans_go_out_while_the_run_trains_with_their_parentage(fed: FedRun) -> None:
    import socket

    assert fed.returncode == 0, fed.stderr[-3000:]
    assert fed.otlp_during > 0  # exported while it trained, not only at its end
    spans = _spans(fed)
    assert {s["trace"] for s in spans} and len({s["trace"] for s in spans}) == 1  # one trace: the session
    by_id = {s["id"]: s for s in spans}
    assert len(by_id) == len(spans)  # no span twice
    for s in spans:
        resource = s["resource"]
        assert resource["service.name"] == "stepwatch" and resource["host.name"] == socket.gethostname()
        assert resource["stepwatch.rank"] in (0, 1) and resource["stepwatch.session"]
        assert s["end"] >= s["start"] > 0
    roots = [s for s in spans if not s["parent"]]
    assert sorted(s["resource"]["stepwatch.rank"] for s in roots) == [0, 1]  # a session span per rank
    assert {s["name"] for s in roots} == {"stepwatch.session"}
    steps = [s for s in spans if s["name"] == "step"]
    for s in spans:
        if s["name"] == "epoch":
            assert by_id[s["parent"]]["name"] == "stepwatch.session"
        elif s["name"] == "step":
            assert by_id[s["parent"]]["name"] == "epoch"
        elif s["name"] in PHASES:
            parent = by_id[s["parent"]]
            assert parent["name"] == "step" and parent["start"] <= s["start"] <= s["end"] <= parent["end"]
        if s["parent"]:  # every child in the parent's rank
            assert by_id[s["parent"]]["resource"]["stepwatch.rank"] == s["resource"]["stepwatch.rank"]
    # every step went out, with its index and phase times
    for rank in (0, 1):
        indexes = sorted(s["attrs"]["stepwatch.step"] for s in steps if s["resource"]["stepwatch.rank"] == rank)
        assert indexes == list(range(len(indexes))) and len(indexes) >= 40
    assert all(s["attrs"]["stepwatch.step_ns"] > 0 for s in steps)
    # the phases only of the first FULL_FIRST steps and every FULL_EVERY-th
    with_phases = {s["parent"] for s in spans if s["name"] in PHASES}
    for s in steps:
        index = s["attrs"]["stepwatch.step"]
        full = index < FULL_FIRST or index % FULL_EVERY == 0
        assert (s["id"] in with_phases) == full, index
    sampler = fed.stats["feeds"]["otlp"]
    assert sampler["spans_exported"] == len(spans) and sampler["spans_dropped"] == 0
    assert sampler["spans_sampled_out"] > 0


@pytest.mark.real
def test_metrics_go_out_with_units_and_rank_attributes(fed: FedRun) -> None:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    seen: dict[str, tuple[str, list[dict[str, Any]]]] = {}
    bodies = [body for path, body, _ in fed.otlp_posts if path == "/v1/metrics"]
    assert len(bodies) >= 2  # periodically, and once more at the end
    for body in bodies:
        for resource_metrics in ExportMetricsServiceRequest.FromString(body).resource_metrics:
            assert _attrs(resource_metrics.resource.attributes)["service.name"] == "stepwatch"
            for scope in resource_metrics.scope_metrics:
                for metric in scope.metrics:
                    data = getattr(metric, metric.WhichOneof("data"))
                    points = [_attrs(p.attributes) | {"value": p.as_double if p.WhichOneof("value") == "as_double"
                                                      else p.as_int} for p in data.data_points]
                    seen.setdefault(metric.name, (metric.unit, []))[1].extend(points)
    units = {name: unit for name, (unit, _) in seen.items()}
    assert units["stepwatch.step_time"] == "s" and units["stepwatch.memory"] == "By"
    assert units["stepwatch.steps_per_second"] == "{step}/s" and units["stepwatch.heartbeat_age"] == "s"
    assert units["stepwatch.phase_share"] == "1" and units["stepwatch.alerts"] == "{alert}"
    for name in ("stepwatch.step_time", "stepwatch.steps_per_second", "stepwatch.loss", "stepwatch.memory"):
        points = seen[name][1]
        assert {p["stepwatch.rank"] for p in points} == {0, 1}, name
        assert all(p["stepwatch.session"] and p["host.name"] for p in points)
    assert {p["quantile"] for p in seen["stepwatch.step_time"][1]} == {0.5, 0.9, 0.99}
    assert {(p["device"], p["kind"]) for p in seen["stepwatch.memory"][1]} == {("rss", "rss")}
    assert any(p["kind"] == "NONFINITE" and p["value"] >= 1 for p in seen["stepwatch.alerts"][1])


# -- the sampling rule, whatever order the rows come in ----------------------------------------------


def _row(span_id: str, parent: str | None, name: str, idx: int | None = None) -> tuple[Any, ...]:
    return ("s", 0, span_id, parent, name, idx, 1, 2, None, None, None, "{}")


@given(steps=st.integers(1, 40), first=st.integers(0, 5), every=st.integers(1, 12), data=st.data())
def test_the_sampler_keeps_every_step_and_the_phases_of_the_sampled_ones(steps: int, first: int, every: int,
                                                                          data: st.DataObject) -> None:
    rows = [_row("root", None, "stepwatch.session"), _row("epoch", "root", "epoch")]
    for i in range(steps):
        rows.append(_row(f"step{i}", "epoch", "step", i))
        rows += [_row(f"step{i}/{p}", f"step{i}", p) for p in ("forward", "backward")]
        rows.append(_row(f"step{i}/forward/scope", f"step{i}/forward", "scope"))
    order = data.draw(st.permutations(rows))
    sampler = SpanSampler(first, every, hold_s=1e9)
    out = [row for row in order for row in sampler.decide(row)] + sampler.expired(everything=True)
    names = {row[2] for row in out}
    assert len(out) == len(names)  # nothing twice
    assert {"root", "epoch"} <= names and all(f"step{i}" in names for i in range(steps))
    for i in range(steps):
        full = i < first or i % every == 0
        for child in (f"step{i}/forward", f"step{i}/backward", f"step{i}/forward/scope"):
            assert (child in names) == full, (i, child)
    assert sampler.held == 0 and sampler.sampled_out == 3 * sum(1 for i in range(steps) if not (i < first
                                                                                                or i % every == 0))


def test_a_span_whose_parent_never_comes_goes_out_after_the_hold_and_held_spans_are_bounded() -> None:
    now = [0.0]
    sampler = SpanSampler(1, 100, hold_s=5, max_held=2, clock=lambda: now[0])
    assert sampler.decide(_row("a", "missing", "forward")) == []
    assert sampler.decide(_row("b", "missing", "backward")) == []
    assert sampler.decide(_row("c", "missing", "optimizer_step")) == [] and sampler.dropped == 1
    assert sampler.expired() == []
    now[0] = 6.0
    assert [row[2] for row in sampler.expired()] == ["a", "b"] and sampler.held == 0


def test_a_row_sent_twice_goes_out_once_and_a_late_parent_still_goes_out() -> None:
    now = [0.0]
    sampler = SpanSampler(1, 100, hold_s=5, clock=lambda: now[0])
    assert sampler.decide(_row("f", "step7", "forward")) == []
    now[0] = 6.0
    assert [row[2] for row in sampler.expired()] == ["f"]
    step = _row("step7", "epoch", "step", 7)
    assert sampler.decide(step) == [step]  # the parent that came late is no duplicate
    assert sampler.decide(step) == [] and sampler.decide(_row("f", "step7", "forward")) == []
    assert sampler.duplicates == 2


def test_a_dead_collector_costs_counted_drops_only(tmp_path: Any) -> None:
    import socket
    import time

    from stepwatch.server.aggregator import Aggregator
    from stepwatch.server.feed_state import FeedState
    from stepwatch.server.otlp import OtlpExporter
    from stepwatch.store.sqlite import SqliteStore

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = SqliteStore(tmp_path / "history.sqlite")
    core = Aggregator(store)
    exporter = OtlpExporter(f"http://127.0.0.1:{port}", FeedState(tmp_path, core), core, interval_s=3600,
                            timeout_s=0.5)
    try:
        rows = [_row(f"step{i}", None, "step", i) for i in range(20)]
        started = time.perf_counter()
        exporter.take_spans("s", 0, "h", rows)
        assert time.perf_counter() - started < 0.01  # the tap only queues
        exporter._export_spans()  # the exporter thread's round, here
        stats = exporter.stats()
        assert (stats["spans_exported"], stats["spans_dropped"], stats["export_failures"]) == (0, 20, 1)
    finally:
        exporter.close(timeout=2)
        store.close()
