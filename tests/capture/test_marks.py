"""Marks (spool-format-v1.md "marks[]"): typed values, the 256-byte string cap, where a mark
attaches, the legacy "root" sentinel, and non-finite floats written as strict JSON."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import stepwatch
from stepwatch.artifacts.spool import LoadedSpool, read_spool
from stepwatch.capture.spans import cut_utf8, mark_value
from tests.support.capture import finish, start
from tests.support.marks import own_marks

pytestmark = pytest.mark.usefixtures("training_test")

SESSION = "stepwatch.session"


def span_named(spool: LoadedSpool, name: str) -> dict[str, Any]:
    (span,) = [s for s in spool.spans if s["name"] == name]
    return span


def mark_named(spool: LoadedSpool, name: str) -> dict[str, Any]:
    (mark,) = [m for m in spool.marks if m["name"] == name]
    return mark


# -- values ----------------------------------------------------------------------------------


def test_typed_values(tmp_path: Path) -> None:
    start(tmp_path)
    stepwatch.mark("flag", True)
    stepwatch.mark("count", 7)
    stepwatch.mark("big", 2**62)
    stepwatch.mark("lr", 0.125)
    stepwatch.mark("note", "warm restart")
    stepwatch.mark("tensor_loss", torch.tensor(0.5))
    stepwatch.mark("tensor_steps", torch.tensor(3))
    stepwatch.mark("tensor_flag", torch.tensor(False))
    spool = finish(tmp_path)

    got = {m["name"]: (m["value_type"], m["value"]) for m in spool.marks}
    assert got == {
        "flag": ("bool", True), "count": ("int", 7), "big": ("int", 2**62), "lr": ("float", 0.125),
        "note": ("string", "warm restart"), "tensor_loss": ("float", 0.5), "tensor_steps": ("int", 3),
        "tensor_flag": ("bool", False),
    }
    for mark in spool.marks:
        assert "value_nonfinite" not in mark
        assert mark["kind"] == "point"


def test_point_and_summary_kinds_and_attrs(tmp_path: Path) -> None:
    start(tmp_path)
    stepwatch.mark("loss", 0.5, step=10)
    stepwatch.mark("best", 0.25, kind="summary", split="dev")
    spool = finish(tmp_path)

    assert mark_named(spool, "loss")["kind"] == "point"
    assert mark_named(spool, "loss")["attrs"] == {"step": 10}
    assert mark_named(spool, "best")["kind"] == "summary"
    assert mark_named(spool, "best")["attrs"] == {"split": "dev"}


@pytest.mark.parametrize(("value", "word"), [(float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "-inf"),
                                             (torch.tensor(float("nan")), "nan")])
def test_nonfinite_values_become_null_plus_marker(value: Any, word: str) -> None:
    assert mark_value(value) == ("float", None, word)


def test_nonfinite_marks_are_strict_json(tmp_path: Path) -> None:
    start(tmp_path)
    stepwatch.mark("nan", float("nan"))
    stepwatch.mark("inf", float("inf"))
    stepwatch.mark("ninf", -math.inf)
    stepwatch.mark("finite", 1.5, spread=float("nan"))
    stepwatch.shutdown()

    def reject(constant: str) -> None:
        raise ValueError(f"not strict JSON: {constant}")

    files = sorted((tmp_path / "spool").glob("*.json"))
    assert files
    marks = [m for path in files for m in json.loads(path.read_text(), parse_constant=reject)["marks"]]
    by_name = {m["name"]: m for m in marks}
    for name, word in (("nan", "nan"), ("inf", "inf"), ("ninf", "-inf")):
        assert by_name[name]["value"] is None
        assert by_name[name]["value_type"] == "float"
        assert by_name[name]["value_nonfinite"] == word
    assert "value_nonfinite" not in by_name["finite"]
    assert by_name["finite"]["attrs"] == {"spread": "nan"}


# -- strings ---------------------------------------------------------------------------------


@given(st.text())
def test_cut_utf8_is_a_valid_prefix_of_at_most_256_bytes(text: str) -> None:
    cut = cut_utf8(text)
    raw = cut.encode("utf-8")
    assert len(raw) <= 256
    assert text.startswith(cut)
    raw.decode("utf-8", errors="strict")
    if len(text.encode("utf-8")) <= 256:
        assert cut == text
    else:  # the longest such prefix: the next code point would not fit
        assert len(text[: len(cut) + 1].encode("utf-8")) > 256


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=20, deadline=None)
@given(st.text(min_size=1, alphabet=st.characters(codec="utf-8")))
def test_string_marks_are_cut_in_the_spool(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    run_dir = tmp_path_factory.mktemp("run")
    start(run_dir)
    stepwatch.mark("text", text * 100)
    spool = finish(run_dir)
    mark = mark_named(spool, "text")
    assert mark["value_type"] == "string"
    assert mark["value"] == cut_utf8(text * 100)
    assert len(mark["value"].encode("utf-8")) <= 256


def test_multibyte_cut_keeps_whole_code_points() -> None:
    assert cut_utf8("é" * 200) == "é" * 128  # 2 bytes each: exactly 256
    assert cut_utf8("€" * 100) == "€" * 85  # 3 bytes each: 255, the 86th would split
    assert cut_utf8("a" + "😀" * 100) == "a" + "😀" * 63  # 4 bytes each: 253


def test_unencodable_text_never_raises_into_user_code(tmp_path: Path) -> None:
    """Lone surrogates (what os.fsdecode makes of undecodable bytes) cannot be UTF-8."""
    start(tmp_path)
    with stepwatch.scope("file-\udcff", path="/data/\udcff.bin"):
        stepwatch.mark("path", "/data/\udcff.bin", source="\udcff")
    with stepwatch.scope("unrelated"):
        pass
    spool = finish(tmp_path)  # and the batch holding them is not lost either
    (scope,) = [s for s in spool.spans if s["name"].startswith("file-")]
    mark = mark_named(spool, "path")
    assert mark["span_id"] == scope["id"]
    assert {s["name"] for s in spool.spans} == {scope["name"], "unrelated", SESSION}
    for text in (scope["name"], mark["value"], scope["attrs"]["path"], mark["attrs"]["source"]):
        text.encode("utf-8")
        assert "\udcff" not in text


# -- where a mark attaches -------------------------------------------------------------------


def test_marks_attach_to_the_innermost_open_scope(tmp_path: Path) -> None:
    start(tmp_path)
    stepwatch.mark("top", 0)
    with stepwatch.scope("outer"):
        stepwatch.mark("in_outer", 1)
        with stepwatch.scope("inner"):
            stepwatch.mark("in_inner", 2)
        stepwatch.mark("outer_again", 3)
    spool = finish(tmp_path)

    session, outer, inner = (span_named(spool, n) for n in (SESSION, "outer", "inner"))
    assert mark_named(spool, "top")["span_id"] == session["id"]
    assert mark_named(spool, "in_outer")["span_id"] == outer["id"]
    assert mark_named(spool, "in_inner")["span_id"] == inner["id"]
    assert mark_named(spool, "outer_again")["span_id"] == outer["id"]
    assert outer["mark_ids"] == [mark_named(spool, n)["id"] for n in ("in_outer", "outer_again")]
    assert inner["mark_ids"] == [mark_named(spool, "in_inner")["id"]]
    assert session["mark_ids"] == [mark_named(spool, "top")["id"]]


def test_marks_follow_the_producing_thread(tmp_path: Path) -> None:
    start(tmp_path)
    ready, done = threading.Event(), threading.Event()

    def other() -> None:
        ready.wait(5)
        stepwatch.mark("from_thread", 1)  # nothing open on this thread
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with stepwatch.scope("main_only"):
        ready.set()
        done.wait(5)
        stepwatch.mark("from_main", 2)
    thread.join()
    spool = finish(tmp_path)

    assert mark_named(spool, "from_thread")["span_id"] == span_named(spool, SESSION)["id"]
    assert mark_named(spool, "from_main")["span_id"] == span_named(spool, "main_only")["id"]


@pytest.mark.real
def test_mark_after_optimizer_step_lands_on_the_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(12, 4), torch.randn(12, 1)), batch_size=4)
    start(tmp_path)
    for _ in stepwatch.epochs(1):
        for x, y in loader:
            with stepwatch.trace_step(model):
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                stepwatch.mark("loss", loss)
    spool = finish(tmp_path)

    steps = [s for s in spool.spans if s["name"] == "step"]
    losses = [m for m in own_marks(spool) if m["name"] == "loss"]
    assert len(steps) == len(losses) == 3
    by_id = spool.span_by_id()
    for mark in losses:
        step = by_id[mark["span_id"]]
        assert step["name"] == "step"
        assert mark["id"] in step["mark_ids"]
        assert step["start_ns"] <= mark["ts_ns"] <= step["end_ns"]
        assert mark["value_type"] == "float"


def test_root_sentinel_before_init_and_after_shutdown(tmp_path: Path) -> None:
    stepwatch.mark("before_init", 1)
    start(tmp_path / "first")
    stepwatch.mark("during_first", 2)
    stepwatch.shutdown()
    stepwatch.mark("after_shutdown", 3.5, kind="summary")
    first = read_spool(tmp_path / "first")
    start(tmp_path / "second")
    second = finish(tmp_path / "second")

    before = mark_named(first, "before_init")
    assert before["span_id"] == "root" and before["value"] == 1
    assert mark_named(first, "during_first")["span_id"] == span_named(first, SESSION)["id"]
    assert "after_shutdown" not in {m["name"] for m in first.marks}
    after = mark_named(second, "after_shutdown")
    assert after["span_id"] == "root"
    assert (after["value_type"], after["value"], after["kind"]) == ("float", 3.5, "summary")
    assert len(after["id"]) == 32
    assert "before_init" not in {m["name"] for m in second.marks}  # written once, by one runtime
    assert all(after["id"] not in s["mark_ids"] for s in second.spans)
