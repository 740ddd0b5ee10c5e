"""``stepwatch.phase``: scopes as context manager and decorator, per-thread nesting, the exact
``phase_scope`` payload (spec: "Structured phase metadata"), and fail-open behaviour.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import stepwatch
from stepwatch.guard import reset_swallowed, swallowed
from stepwatch.schema import TelemetryEventV3
from stepwatch.telemetry import load_telemetry_sessions


@pytest.fixture(autouse=True)
def nothing_swallowed() -> Iterator[None]:
    """A bug hidden by the fail-open guard still fails the test."""
    reset_swallowed()
    yield
    assert swallowed() == {}


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[Any]:
    rt = stepwatch.init(out=tmp_path / "run", interval=0.05, auto_instrument=False, handle_signals=False,
                        capture_oom=False)
    assert rt.active
    try:
        yield rt
    finally:
        stepwatch.shutdown()


def phase_events(rt: Any) -> list[TelemetryEventV3]:
    """Shuts the runtime down and returns its phase records in sequence order."""
    stepwatch.shutdown()
    (session,) = load_telemetry_sessions(rt.run_dir)
    events = [e for e in session.events if e.event_type in ("phase_enter", "phase_exit")]
    return sorted(events, key=lambda e: e.metadata["phase_scope"]["sequence"])


def scopes(rt: Any) -> list[dict[str, Any]]:
    return [e.metadata["phase_scope"] for e in phase_events(rt)]


def test_nested_context_managers_write_the_exact_phase_scope_payload(runtime: Any) -> None:
    sid = runtime.session_id
    me = threading.current_thread()
    with stepwatch.phase("train", epoch=3):
        with stepwatch.phase("forward"):
            pass
    events = phase_events(runtime)
    assert [e.event_type for e in events] == ["phase_enter", "phase_enter", "phase_exit", "phase_exit"]
    common = {"thread_id": me.ident, "thread_name": me.name}
    assert [e.metadata["phase_scope"] for e in events] == [
        {"action": "enter", "name": "train", "path": ["train"], "depth": 1, "scope_id": f"{sid}:1",
         "parent_scope_id": None, "sequence": 1, "attributes": {"epoch": 3}, **common},
        {"action": "enter", "name": "forward", "path": ["train", "forward"], "depth": 2, "scope_id": f"{sid}:2",
         "parent_scope_id": f"{sid}:1", "sequence": 2, **common},
        {"action": "exit", "name": "forward", "path": ["train", "forward"], "depth": 2, "scope_id": f"{sid}:2",
         "parent_scope_id": f"{sid}:1", "sequence": 3, **common},
        {"action": "exit", "name": "train", "path": ["train"], "depth": 1, "scope_id": f"{sid}:1",
         "parent_scope_id": None, "sequence": 4, "attributes": {"epoch": 3}, **common},
    ]
    stamps = [e.timestamp_ns for e in events]
    assert stamps == sorted(stamps)
    for e in events:
        assert e.session_id == sid
        assert e.context is not None and e.context.startswith("Phase ")


def test_phase_as_a_decorator_returns_the_result(runtime: Any) -> None:
    @stepwatch.phase("evaluate", split="val")
    def evaluate(x: int, *, y: int) -> int:
        """Doc kept."""
        return x + y

    assert evaluate(1, y=2) == 3
    assert evaluate.__name__ == "evaluate" and evaluate.__doc__ == "Doc kept."
    assert evaluate(2, y=2) == 4
    got = scopes(runtime)
    assert [(s["action"], s["name"], s.get("attributes")) for s in got] == [
        ("enter", "evaluate", {"split": "val"}), ("exit", "evaluate", {"split": "val"})] * 2
    assert got[0]["scope_id"] != got[2]["scope_id"]  # one scope per call


def test_phase_as_an_async_decorator(runtime: Any) -> None:
    @stepwatch.phase("fetch")
    async def fetch(n: int) -> int:
        with stepwatch.phase("decode"):
            await asyncio.sleep(0)
        return n * 2

    assert inspect.iscoroutinefunction(fetch)
    assert asyncio.run(fetch(21)) == 42
    got = scopes(runtime)
    assert [(s["action"], s["path"]) for s in got] == [
        ("enter", ["fetch"]), ("enter", ["fetch", "decode"]), ("exit", ["fetch", "decode"]), ("exit", ["fetch"])]


def test_concurrent_async_tasks_keep_their_own_scopes(runtime: Any) -> None:
    """Two tasks interleaving on one thread: neither nests under nor closes the other's scope."""

    @stepwatch.phase("task")
    async def task(name: str, first: asyncio.Event, second: asyncio.Event) -> None:
        with stepwatch.phase(name):
            first.set()
            await second.wait()

    async def main() -> None:
        a_in, b_in = asyncio.Event(), asyncio.Event()
        run_a = asyncio.create_task(task("a", a_in, b_in))
        await a_in.wait()
        run_b = asyncio.create_task(task("b", b_in, asyncio.Event()))
        await b_in.wait()  # both scopes open now; a leaves first
        await run_a
        run_b.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run_b

    asyncio.run(main())
    by_scope: dict[str, list[dict[str, Any]]] = {}
    for s in scopes(runtime):
        by_scope.setdefault(s["scope_id"], []).append(s)
    paths = sorted(tuple(v[0]["path"]) for v in by_scope.values())
    assert paths == [("task",), ("task",), ("task", "a"), ("task", "b")]
    for pair in by_scope.values():  # every scope closes itself, with its own path
        assert [s["action"] for s in pair] == ["enter", "exit"]
        assert pair[0]["path"] == pair[1]["path"]
        assert pair[0]["parent_scope_id"] == pair[1]["parent_scope_id"]


def test_scopes_nest_per_thread(runtime: Any) -> None:
    barrier = threading.Barrier(2)

    def work(name: str) -> None:
        with stepwatch.phase(name):
            barrier.wait(5)  # both outer scopes are open at once
            with stepwatch.phase("inner"):
                barrier.wait(5)

    threads = [threading.Thread(target=work, args=(n,), name=f"worker-{n}") for n in ("A", "B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    idents = {t.name: t.ident for t in threads}
    got = scopes(runtime)
    assert len(got) == 8
    for name in ("A", "B"):
        mine = [s for s in got if s["thread_name"] == f"worker-{name}"]
        assert {s["thread_id"] for s in mine} == {idents[f"worker-{name}"]}
        assert [(s["action"], s["path"]) for s in mine] == [
            ("enter", [name]), ("enter", [name, "inner"]), ("exit", [name, "inner"]), ("exit", [name])]
        assert mine[1]["parent_scope_id"] == mine[0]["scope_id"] == mine[3]["scope_id"]
        assert mine[0]["parent_scope_id"] is None
    assert sorted(s["sequence"] for s in got) == list(range(1, 9))  # one sequence for the session


def test_one_phase_instance_may_be_entered_from_many_threads(runtime: Any) -> None:
    shared = stepwatch.phase("shared")
    barrier = threading.Barrier(3)

    def work() -> None:
        with shared:
            barrier.wait(5)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    got = scopes(runtime)
    assert len({s["scope_id"] for s in got}) == 3
    assert all(s["depth"] == 1 and s["parent_scope_id"] is None for s in got)


def test_user_exceptions_propagate_unchanged(runtime: Any) -> None:
    error = ValueError("the user's own")

    def fails() -> None:
        with stepwatch.phase("step"):
            raise error

    with pytest.raises(ValueError) as caught:
        fails()
    assert caught.value is error
    frames = traceback.extract_tb(caught.value.__traceback__)
    assert frames[-1].name == "fails" and frames[-1].line == "raise error"
    assert error.__context__ is None and error.__cause__ is None

    other = KeyError("another")

    @stepwatch.phase("decorated")
    def decorated() -> None:
        raise other

    with pytest.raises(KeyError) as caught2:
        decorated()
    assert caught2.value is other
    assert traceback.extract_tb(caught2.value.__traceback__)[-1].name == "decorated"
    with pytest.raises(KeyboardInterrupt):
        with stepwatch.phase("interrupted"):
            raise KeyboardInterrupt
    got = scopes(runtime)
    assert [s["action"] for s in got] == ["enter", "exit"] * 3  # the scopes closed anyway


def test_phase_is_a_no_op_before_init_and_after_shutdown(tmp_path: Path) -> None:
    assert not stepwatch.current_runtime().active
    with stepwatch.phase("before") as p:
        assert isinstance(p, stepwatch.phase)

    @stepwatch.phase("decorated")
    def f() -> int:
        return 7

    assert f() == 7
    rt = stepwatch.init(out=tmp_path / "run", interval=0.05, auto_instrument=False, handle_signals=False,
                        capture_oom=False)
    with stepwatch.phase("during"):
        pass
    stepwatch.shutdown()
    with stepwatch.phase("after"):
        assert f() == 7
    (session,) = load_telemetry_sessions(rt.run_dir)
    names = [e.metadata["phase_scope"]["name"] for e in session.events if e.event_type == "phase_enter"]
    assert names == ["during"]


def test_a_failing_internal_is_swallowed_counted_and_the_user_code_continues(
    runtime: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(row: object) -> None:
        raise RuntimeError("table exploded")

    monkeypatch.setattr(runtime.scopes, "_append", broken)
    ran = []
    for _ in range(3):
        with stepwatch.phase("step"):
            ran.append(True)
    assert ran == [True] * 3
    assert swallowed() == {"phase.enter": 3, "phase.exit": 3}
    err = capsys.readouterr().err
    assert err.count("[stepwatch] internal error") == 2  # logged once per site
    assert "table exploded" in err
    monkeypatch.undo()
    with stepwatch.phase("later"):  # the scope stack is balanced again
        pass
    got = scopes(runtime)
    assert [(s["action"], s["path"]) for s in got] == [("enter", ["later"]), ("exit", ["later"])]
    reset_swallowed()


def test_the_calling_thread_only_appends_rows(runtime: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hot path never writes or samples: records are built on the background thread."""
    writers: set[str] = set()
    original = runtime.sink.append

    def spy(event: Any) -> None:
        writers.add(threading.current_thread().name)
        original(event)

    monkeypatch.setattr(runtime.sink, "append", spy)
    for _ in range(50):
        with stepwatch.phase("hot"):
            pass
    deadline = time.monotonic() + 5
    while len(runtime.phase_rows) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert writers == {"stepwatch-sampler"}
    assert len(scopes(runtime)) == 100
