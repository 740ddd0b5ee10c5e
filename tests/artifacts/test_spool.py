"""The spool (spool-format-v1.md): SpoolWriter files, atomic writes, the byte cap; sealing by
the runtime on its cadence, at shutdown, on SIGTERM and at exit; read_spool; and reading what
the real Cirron SDK (``cirron-sdk`` 0.3.0) writes."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stepwatch
from stepwatch.artifacts.spool import SpoolWriter, read_spool
from stepwatch.errors import ArtifactError
from tests.support import examples
from tests.support.marks import own_marks

pytestmark = pytest.mark.usefixtures("training_test")

NAME = re.compile(r"(\d{20})-([0-9a-f]{32})\.json")
KEYS = {"schema_version", "sdk_version", "batch_id", "created_ns", "spans", "marks", "snapshots"}
SESSION = "stepwatch.session"



def span(i: int, parent: int | None = None, *, pad: int = 0, start: int | None = None) -> dict[str, Any]:
    t = 1_700_000_000_000_000_000 + (i if start is None else start) * 1000
    return {"id": f"{i + 1:032x}", "name": f"s{i}", "parent_id": None if parent is None else f"{parent + 1:032x}",
            "index": None, "start_ns": t, "end_ns": t + 10, "cpu_ns": None, "gpu_ns": None,
            "memory_peak_bytes": None, "thread_id": 1, "pid": 2, "rank": 0, "attrs": {"pad": "x" * pad},
            "mark_ids": []}




def mark(i: int, span_id: str = "root") -> dict[str, Any]:
    return {"id": f"{0xAAAA0000 + i:032x}", "span_id": span_id, "name": "loss", "value_type": "float",
            "value": 0.5, "attrs": {}, "ts_ns": 1_700_000_000_000_000_000 + i, "kind": "point"}


def snap(i: int, span_id: str) -> dict[str, Any]:
    return {"id": f"{0xBBBB0000 + i:032x}", "span_id": span_id, "tensor_name": f"w{i}", "shape": [2],
            "dtype": "float32", "mode": "stats", "stats": None, "blob_uri": None, "ts_ns": 0, "attrs": {}}


def batch_files(root: Path) -> list[Path]:
    return sorted(root.glob("*.json"))


def assert_children_first(spans: list[dict[str, Any]]) -> None:
    position = {s["id"]: i for i, s in enumerate(spans)}
    assert len(position) == len(spans)
    for s in spans:
        if s.get("parent_id") in position:
            assert position[s["parent_id"]] > position[s["id"]], s


# -- SpoolWriter -----------------------------------------------------------------------------


def test_batch_file_name_and_shape(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path, sdk_version="9.8.7")
    before = time.time_ns()
    (path,) = writer.write([span(0)], [mark(0)], [snap(0, span(0)["id"])])
    after = time.time_ns()

    match = NAME.fullmatch(path.name)
    assert match and path.parent == tmp_path
    batch = json.loads(path.read_bytes())
    assert set(batch) == KEYS
    assert batch["schema_version"] == 1 and batch["sdk_version"] == "9.8.7"
    assert batch["created_ns"] == int(match[1]) and before <= batch["created_ns"] <= after
    assert batch["batch_id"] == match[2]
    assert (batch["spans"], batch["marks"], batch["snapshots"]) == ([span(0)], [mark(0)], [snap(0, span(0)["id"])])
    assert writer.write([], [], []) == []  # nothing to seal: no file
    assert batch_files(tmp_path) == [path]


def test_writes_go_through_a_temp_file_and_replace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = SpoolWriter(tmp_path, sdk_version="1")
    real_replace = os.replace
    seen: list[tuple[Path, Path]] = []

    def replace(src: Any, dst: Any) -> None:
        src, dst = Path(src), Path(dst)
        assert src.parent == dst.parent == tmp_path
        assert not NAME.fullmatch(src.name) and not dst.exists()  # never visible under its final name
        assert batch_files(tmp_path) == []
        json.loads(src.read_bytes())  # complete before it is renamed
        seen.append((src, dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    (path,) = writer.write([span(0, pad=100_000)], [], [])
    assert seen == [(seen[0][0], path)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temp file left


def test_a_concurrent_reader_never_sees_a_partial_batch(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path, sdk_version="1", max_bytes=2 << 20)
    done = threading.Event()
    read = 0

    def reader() -> None:
        nonlocal read
        while not done.is_set():
            for path in batch_files(tmp_path):
                try:
                    data = path.read_bytes()
                except FileNotFoundError:
                    continue  # evicted meanwhile
                assert set(json.loads(data)) == KEYS
                read += 1

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        # at least 40 batches, and on until the reader has read some (a loaded machine may not
        # schedule its thread before the first 40 are written)
        deadline = time.monotonic() + 30
        i = 0
        while i < 40 or (read < 10 and time.monotonic() < deadline):
            writer.write([span(j, pad=20_000) for j in range(i, i + 5)], [], [])
            i += 1
    finally:
        done.set()
        thread.join()
    assert read > 0


def test_oldest_batches_are_evicted_first_and_counted(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path, sdk_version="1", max_bytes=4096)
    written = [writer.write([span(3 * i + k, pad=300) for k in range(3)], [mark(i)], [])[0] for i in range(20)]

    kept = batch_files(tmp_path)
    assert sum(p.stat().st_size for p in kept) <= 4096
    assert kept == written[len(written) - len(kept):]  # the newest survive
    assert 1 < len(kept) < 20
    assert writer.evicted_batches == 20 - len(kept)
    assert writer.evicted_records == 4 * (20 - len(kept))
    assert writer.dropped_records == 0


def test_a_restarted_writer_counts_batches_already_on_disk(tmp_path: Path) -> None:
    first = SpoolWriter(tmp_path, sdk_version="1", max_bytes=4096)
    for i in range(3):
        first.write([span(i, pad=900)], [], [])
    second = SpoolWriter(tmp_path, sdk_version="1", max_bytes=4096)
    for i in range(3, 6):
        second.write([span(i, pad=900)], [], [])
    assert sum(p.stat().st_size for p in batch_files(tmp_path)) <= 4096
    assert second.evicted_batches >= 2


def test_a_batch_bigger_than_the_cap_is_split(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path, sdk_version="1", max_bytes=8192)
    spans = [span(i, pad=500) for i in range(40)]  # about 24 KiB in one batch
    marks = [mark(i) for i in range(10)]
    paths = writer.write(spans, marks, [])

    assert len(paths) > 3
    files = batch_files(tmp_path)
    assert all(p.stat().st_size <= 8192 for p in files)
    assert sum(p.stat().st_size for p in files) <= 8192
    kept = [r for p in files for b in [json.loads(p.read_bytes())] for r in b["spans"] + b["marks"]]
    assert len(kept) + writer.evicted_records == 50 and writer.dropped_records == 0
    order = [s["id"] for s in spans] + [m["id"] for m in marks]
    assert [r["id"] for r in kept] == order[len(order) - len(kept):]  # nothing reordered, the newest kept


def test_a_record_bigger_than_the_cap_is_dropped_and_counted(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path, sdk_version="1", max_bytes=4096)
    assert writer.write([span(0, pad=10_000)], [], []) == []
    assert writer.dropped_records == 1 and batch_files(tmp_path) == []

    small = [span(i) for i in range(1, 6)]
    writer.write([*small[:2], span(99, pad=10_000), *small[2:]], [mark(0)], [])
    kept = [r["id"] for p in batch_files(tmp_path) for r in json.loads(p.read_bytes())["spans"]]
    assert kept == [s["id"] for s in small]
    assert writer.dropped_records == 2 and writer.evicted_records == 0


def test_the_writers_reused_buffer_survives_a_write_the_disk_refused(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches are encoded into one buffer the writer keeps; a write that fails half way (a full
    disk) must leave it usable, while the failure's traceback still holds the write's frame."""
    writer = SpoolWriter(tmp_path, sdk_version="1")
    big = [span(i, pad=2000) for i in range(20)]
    writer.write(big, [mark(0)], [])

    def full(fd: int, data: Any) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError) as refused:
        writer.write([span(100)], [], [])
    monkeypatch.undo()
    small = [span(i) for i in range(200, 203)]
    bigger = [*big, span(300, pad=50_000)]
    writer.write(small, [], [])  # the buffer shrinks
    writer.write(bigger, [], [])  # and grows again
    assert refused.value.errno == 28
    batches = [json.loads(p.read_bytes()) for p in batch_files(tmp_path)]
    assert [b["spans"] for b in batches] == [big, small, bigger]
    assert batches[0]["marks"] == [mark(0)]


def test_writer_rejects_a_cap_below_one_kib(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        SpoolWriter(tmp_path, sdk_version="1", max_bytes=1023)


# -- sealing by the runtime ------------------------------------------------------------------


def test_runtime_seals_on_its_cadence_and_at_shutdown(tmp_path: Path) -> None:
    stepwatch.init(out=tmp_path, handle_signals=False, capture_oom=False, interval=0.02, spool_interval=0.05)
    spool_dir = tmp_path / "spool"
    deadline = time.monotonic() + 10
    count = 0
    while (len(batch_files(spool_dir)) < 3 or count < 20) and time.monotonic() < deadline:
        with stepwatch.scope("work", i=count):
            stepwatch.mark("i", count)
        count += 1
        time.sleep(0.01)
    before_shutdown = batch_files(spool_dir)
    assert len(before_shutdown) >= 3  # sealed while running
    stepwatch.shutdown()

    files = batch_files(spool_dir)
    assert files[: len(before_shutdown)] == before_shutdown and len(files) > len(before_shutdown)
    sessions = [[s for s in json.loads(p.read_bytes())["spans"] if s["name"] == SESSION] for p in files]
    assert [len(found) for found in sessions] == [0] * (len(files) - 1) + [1]  # only in the last batch
    spool = read_spool(tmp_path)
    assert spool.batches == len(files)
    assert Counter(s["name"] for s in spool.spans) == {"work": count, SESSION: 1}
    assert len(spool.marks) == count
    assert_children_first(spool.spans)


_SUBPROCESS_TRAINING = """
import os, signal, sys
import torch
from torch import nn
import stepwatch

torch.manual_seed(0)
model = nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(torch.randn(24, 4), torch.randn(24, 1)), batch_size=4)
stepwatch.init(out=sys.argv[1], spool_interval=60)  # no cadence seal: only the exit path seals
n = 0
for _ in stepwatch.epochs(2):
    for x, y in loader:
        with stepwatch.trace_step(model):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if sys.argv[2] == "sigterm" and n == 8:
                os.kill(os.getpid(), signal.SIGTERM)  # mid-step, between backward and optimizer
            optimizer.step()
            optimizer.zero_grad()
            stepwatch.mark("loss", loss)
        n += 1
print("finished")
"""


@pytest.mark.real
@pytest.mark.parametrize("ending", ["exit", "sigterm"])
def test_runtime_seals_on_sigterm_and_at_exit_without_shutdown(tmp_path: Path, ending: str) -> None:
    proc = subprocess.run([sys.executable, "-W", "error", "-c", _SUBPROCESS_TRAINING, str(tmp_path), ending],
                          capture_output=True, text=True, timeout=120)
    assert "internal error" not in proc.stderr
    spool = read_spool(tmp_path)
    names = Counter(s["name"] for s in spool.spans)
    assert names[SESSION] == 1
    steps = [s for s in spool.spans if s["name"] == "step"]
    for step in steps:  # every step has its breakdown, also the one cut short
        assert {"step_ns", "forward_ns", "backward_ns", "wait_ns"} <= set(step["attrs"])
    if ending == "exit":
        assert proc.returncode == 0 and "finished" in proc.stdout, proc.stderr
        assert len(steps) == 12 and len(own_marks(spool)) == 12
        assert not [s for s in spool.spans if "unclosed" in s["attrs"]]
    else:
        assert proc.returncode == -signal.SIGTERM, proc.stderr  # ended as the signal would end it
        assert "finished" not in proc.stdout
        assert len(steps) == 9 and len(own_marks(spool)) == 8
        (cut,) = [s for s in steps if s["attrs"].get("unclosed")]
        assert cut["index"] == 8 and cut["attrs"]["optimizer_step_ns"] == 0
        assert [s["name"] for s in spool.spans if s["parent_id"] == cut["id"]].count("backward") == 1
    assert_children_first(spool.spans)


# -- read_spool ------------------------------------------------------------------------------


def _write_batch(root: Path, spans: list[dict[str, Any]], marks: list[dict[str, Any]] = (),
                 snapshots: list[dict[str, Any]] = (), *, created_ns: int, batch_id: str | None = None,
                 **extra: Any) -> Path:
    batch = {"schema_version": 1, "sdk_version": "0.3.0", "batch_id": batch_id or f"{created_ns:032x}",
             "created_ns": created_ns, "spans": list(spans), "marks": list(marks), "snapshots": list(snapshots),
             **extra}
    path = root / f"{created_ns:020d}-{batch['batch_id']}.json"
    path.write_text(json.dumps(batch))
    return path


def test_read_joins_batches_children_before_parents(tmp_path: Path) -> None:
    root = tmp_path / ".cirron" / "spool"
    root.mkdir(parents=True)
    session, epoch, step, forward, other = span(0), span(1, 0), span(2, 1), span(3, 2), span(4, 0)
    _write_batch(root, [session], created_ns=3)  # the root first, then its descendants
    _write_batch(root, [epoch, other], [mark(0, epoch["id"])], created_ns=2)
    _write_batch(root, [forward, step], [mark(1, step["id"])], [snap(0, epoch["id"])], created_ns=1)

    spool = read_spool(tmp_path)
    assert spool.root == str(root) and spool.batches == 3 and spool.skipped_files == []
    assert [s["name"] for s in spool.spans] == ["s3", "s2", "s1", "s4", "s0"]
    assert_children_first(spool.spans)
    assert [m["id"] for m in spool.marks] == [mark(0)["id"], mark(1)["id"]]  # by ts_ns
    assert len(spool.snapshots) == 1 and spool.sdk_versions == ["0.3.0"]


def test_read_tolerates_unknown_fields(tmp_path: Path) -> None:
    extra_span = {**span(0), "flops": 12, "attrs": {"new": {"nested": [1, 2]}}}
    extra_mark = {**mark(0, extra_span["id"]), "unit": "nats"}
    extra_snap = {**snap(0, extra_span["id"]), "quantiles": [0.1, 0.9]}
    _write_batch(tmp_path, [extra_span], [extra_mark], [extra_snap], created_ns=1, compression=None,
                 producer={"name": "future-sdk"})
    spool = read_spool(tmp_path)
    assert spool.spans == [extra_span] and spool.marks == [extra_mark] and spool.snapshots == [extra_snap]


def test_read_dedupes_re_sent_batches(tmp_path: Path) -> None:
    first = _write_batch(tmp_path, [span(1, 0), span(0)], [mark(0), mark(1)], [snap(0, span(0)["id"])],
                         created_ns=10, batch_id="a" * 32)
    (tmp_path / f"{20:020d}-{'a' * 32}.json").write_bytes(first.read_bytes())  # the same batch, sealed again
    # the same records re-split into a batch of their own (a retry after a crash)
    _write_batch(tmp_path, [span(1, 0)], [mark(1)], [snap(0, span(0)["id"])], created_ns=30, batch_id="b" * 32)

    spool = read_spool(tmp_path)
    assert len(spool.spans) == 2 and len(spool.marks) == 2 and len(spool.snapshots) == 1
    assert spool.batches == 2


def test_read_rejects_an_unsupported_schema_version(tmp_path: Path) -> None:
    _write_batch(tmp_path, [span(0)], created_ns=1)
    newer = _write_batch(tmp_path, [span(1)], created_ns=2)
    newer.write_text(newer.read_text().replace('"schema_version": 1', '"schema_version": 2'))

    with pytest.raises(ArtifactError) as caught:
        read_spool(tmp_path)
    assert caught.value.path == str(newer)
    assert caught.value.field == "$.schema_version"
    assert newer.name in str(caught.value) and "schema_version 2" in str(caught.value)


@st.composite
def forests(draw: Any) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """Span forests (each parent drawn among earlier spans, or none) dealt into random batches."""
    n = draw(st.integers(1, 40))
    parents = [None] + [draw(st.one_of(st.none(), st.integers(0, i - 1))) for i in range(1, n)]
    starts = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    spans = [span(i, parents[i], start=starts[i]) for i in range(n)]
    order = draw(st.permutations(range(n)))
    cuts = sorted(draw(st.sets(st.integers(1, max(1, n - 1)), max_size=5)))
    batches = [list(order[a:b]) for a, b in zip([0, *cuts], [*cuts, n]) if order[a:b]]
    return spans, batches


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(forests(), st.randoms(use_true_random=False))
def test_random_forests_across_batches_read_back_children_first(forest: Any, rng: random.Random) -> None:
    spans, batches = forest
    with tempfile.TemporaryDirectory() as tmp:
        writer = SpoolWriter(Path(tmp), sdk_version="1")
        for indices in batches:
            writer.write([spans[i] for i in indices], [], [])
        if rng.random() < 0.5:  # a re-sent batch must change nothing
            again = rng.choice(batch_files(Path(tmp)))
            (Path(tmp) / f"{9 * 10**19:020d}-{again.name[21:]}").write_bytes(again.read_bytes())
        spool = read_spool(tmp)
    assert sorted(s["id"] for s in spool.spans) == sorted(s["id"] for s in spans)
    assert_children_first(spool.spans)


# -- the real Cirron SDK ---------------------------------------------------------------------

_CIRRON_SCRIPT = """
import sys, time
import torch
import cirron as ci

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(torch.randn(24, 4), torch.randn(24, 1)), batch_size=8)
ci.mark("before_profile", 1.0)                       # the legacy "root" sentinel
ci.profile(snapshots="full", flush_interval=0.1, frameworks=["torch"])
ci.watch(model)
for epoch in ci.epochs(range(3)):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward(); optimizer.step(); optimizer.zero_grad()
        ci.mark("loss", loss.item())
    ci.mark("nan", float("nan")); ci.mark("inf", float("inf")); ci.mark("ninf", float("-inf"))
    with ci.scope("eval", split="dev"):
        ci.mark("note", "e" * 300)
    time.sleep(0.3)                                   # let a flush seal a batch per epoch
ci.shutdown()
"""


@pytest.mark.real
@pytest.mark.slow
def test_reads_the_real_cirron_spool(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CIRRON_")}
    env.update(HOME=str(tmp_path), CIRRON_OUTPUT_DIR=str(tmp_path / ".cirron"))  # no API key: spool only
    proc = subprocess.run([sys.executable, "-c", _CIRRON_SCRIPT], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr

    files = batch_files(tmp_path / ".cirron" / "spool")
    assert len(files) >= 2
    raw = [json.loads(p.read_bytes()) for p in files]
    spool = read_spool(tmp_path)
    assert spool.root == str(tmp_path / ".cirron" / "spool") and spool.skipped_files == []
    assert spool.batches == len(files) and spool.sdk_versions == ["0.3.0"]
    assert len(spool.spans) == sum(len(b["spans"]) for b in raw)
    assert len(spool.marks) == sum(len(b["marks"]) for b in raw)
    assert len(spool.snapshots) == sum(len(b["snapshots"]) for b in raw)
    assert_children_first(spool.spans)
    (session,) = [s for s in spool.spans if s["name"] == "cirron.session"]
    assert spool.spans[-1] is session and session["parent_id"] is None
    # written in the last batch with spans, after its children (cirron's flusher may seal one
    # more batch, of marks or snapshots only, after it: seen on a loaded machine)
    assert session in [batch for batch in raw if batch["spans"]][-1]["spans"]

    marks = {m["name"]: m for m in spool.marks}
    assert marks["before_profile"]["span_id"] == "root"
    for name, word in (("nan", "nan"), ("inf", "inf"), ("ninf", "-inf")):
        assert marks[name]["value"] is None and marks[name]["value_nonfinite"] == word
    assert len(marks["note"]["value"].encode()) <= 256

    grads = [r for r in spool.snapshots if r["tensor_name"].endswith(".grad")]
    assert grads and all(r["blob_uri"].endswith("/gradients.safetensors") for r in grads)
    from safetensors import safe_open

    spool_root = Path(spool.root).parent
    for record in spool.snapshots:  # resolve by the URI's tail relative to the spool root
        tail = Path(*Path(record["blob_uri"].removeprefix("file://")).parts[-3:])
        with safe_open(str(spool_root / tail), framework="pt") as blob:
            keys = set(blob.keys())
        name = record["tensor_name"]
        assert name in keys or name.removesuffix(".grad") in keys  # Cirron drops the .grad suffix


# -- the records the runtime writes: the spec's fields, in the spec's order --------------------

SPAN_FIELDS = ["id", "name", "parent_id", "index", "start_ns", "end_ns", "cpu_ns", "gpu_ns", "memory_peak_bytes",
               "thread_id", "pid", "rank", "attrs", "mark_ids"]
MARK_FIELDS = ["id", "span_id", "name", "value_type", "value", "attrs", "ts_ns", "kind"]


@pytest.mark.real
def test_runtime_records_have_the_spec_fields_in_order(tmp_path: Path) -> None:
    """Spans and marks are encoded from Structs built at the seal (not dicts): the same keys, in
    spool-format-v1.md's order, ``value_nonfinite`` only on a non-finite mark, and a step's
    breakdown after the attrs it was opened with (``error`` last)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stepwatch.init(out=tmp_path, handle_signals=False, capture_oom=False)
    with stepwatch.trace_step(model, lr=0.1, tag="a"):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        stepwatch.mark("loss", 0.5, step=1)
        stepwatch.mark("diverged", float("nan"))
    with pytest.raises(KeyError), stepwatch.trace_step(model):
        raise KeyError("user")
    stepwatch.shutdown()

    raw = [json.loads(p.read_text()) for p in sorted((tmp_path / "spool").glob("*.json"))]
    spans = [s for batch in raw for s in batch["spans"]]
    marks = [m for batch in raw for m in batch["marks"] if not m["attrs"].get("inferred")
             and not m["name"].startswith("stepwatch.")]
    assert spans and all(list(s) == SPAN_FIELDS for s in spans)
    assert all(s["cpu_ns"] is None and s["memory_peak_bytes"] is None for s in spans)
    assert all(re.fullmatch(r"[0-9a-f]{32}", s["id"]) for s in spans)
    by_name = {m["name"]: m for m in marks}
    assert list(by_name["loss"]) == MARK_FIELDS and by_name["loss"]["attrs"] == {"step": 1}
    assert list(by_name["diverged"]) == [*MARK_FIELDS, "value_nonfinite"]
    first, second = sorted((s for s in spans if s["name"] == "step"), key=lambda s: s["index"])
    breakdown = ["step_ns", "data_load_ns", "h2d_ns", "forward_ns", "backward_ns", "optimizer_step_ns", "recompute_ns",
                 "wait_ns"]
    assert list(first["attrs"]) == ["lr", "tag", *breakdown] and first["attrs"]["lr"] == 0.1
    assert [i for i in first["mark_ids"] if i in {m["id"] for m in marks}] == [by_name["loss"]["id"], by_name["diverged"]["id"]]
    assert list(second["attrs"]) == [*breakdown, "error"] and second["attrs"]["error"] == "KeyError"
    assert second["attrs"]["step_ns"] == second["end_ns"] - second["start_ns"]



def test_a_final_batch_over_the_cap_keeps_the_session_span(tmp_path: Path) -> None:
    """Everything of a run sealed at shutdown, far over the cap: the batch is split and its older
    pieces evicted, but the session span, which everything hangs under, stays on disk."""
    stepwatch.init(out=tmp_path, handle_signals=False, capture_oom=False, spool_interval=3600.0,
                   spool_max_bytes=64 * 1024)
    for i in range(1000):
        with stepwatch.scope("work", i=i):
            stepwatch.mark("note", "x" * 200)
    runtime = stepwatch.current_runtime()
    stepwatch.shutdown()
    kept = read_spool(tmp_path)
    assert runtime.spool.evicted_batches > 0
    assert [s["name"] for s in kept.spans if s["parent_id"] is None] == ["stepwatch.session"]
