"""Tensor snapshots (spool-format-v1.md "snapshots[]"): statistics against numpy references,
records per parameter and gradient, the three modes, and safetensors blobs."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from safetensors.torch import load_file
from torch import nn

import stepwatch
from stepwatch.capture.snapshots import tensor_stats
from tests.support import examples
from tests.support.capture import finish, start

pytestmark = pytest.mark.usefixtures("training_test")


# -- statistics ------------------------------------------------------------------------------


def assert_histogram(stats: dict[str, Any], values: np.ndarray) -> None:
    """17 evenly spaced edges from min to max, 16 counts summing to numel, each value in its bin
    (up to values that sit on an edge within float32 rounding)."""
    hist = stats["histogram"]
    bins, counts = hist["bins"], hist["counts"]
    low, high = float(values.min()), float(values.max())
    assert len(bins) == 17 and len(counts) == 16
    assert bins[0] == low and bins[-1] == high
    width = (high - low) / 16
    for i, edge in enumerate(bins):
        assert math.isclose(edge, low + i * width, rel_tol=1e-9, abs_tol=1e-9 * max(abs(low), abs(high)))
    assert all(isinstance(c, int) and c >= 0 for c in counts)
    assert sum(counts) == values.size
    if low == high:
        assert counts == [0] * 15 + [values.size]
        return
    position = (values.astype(np.float64) - low) / (high - low) * 16
    expected = np.bincount(np.clip(np.floor(position), 0, 15).astype(int), minlength=16)
    on_edge = int(np.sum(np.abs(position - np.round(position)) < 1e-4))
    assert int(np.abs(np.asarray(counts) - expected).sum()) <= 2 * on_edge, (counts, expected.tolist())


floats32 = st.one_of(
    st.floats(-10, 10, width=32),
    st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=False),
)


@settings(max_examples=examples(150), deadline=None)
@given(hnp.arrays(np.float32, st.integers(1, 300), elements=floats32))
def test_stats_match_numpy(values: np.ndarray) -> None:
    stats = tensor_stats(torch.from_numpy(values.copy()))
    ref = values.astype(np.float64)
    scale = float(np.abs(ref).max())
    assert stats["min"] == ref.min() and stats["max"] == ref.max()
    assert math.isclose(stats["mean"], ref.mean(), rel_tol=1e-5, abs_tol=1e-5 * scale)
    assert math.isclose(stats["std"], ref.std(), rel_tol=1e-4, abs_tol=1e-5 * scale)  # population std
    assert math.isclose(stats["norm"], float(np.linalg.norm(ref)), rel_tol=1e-5)
    assert_histogram(stats, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64])
def test_stats_of_other_dtypes(dtype: torch.dtype) -> None:
    tensor = torch.arange(-6, 10).reshape(4, 4).to(dtype)
    stats = tensor_stats(tensor)
    ref = np.arange(-6, 10, dtype=np.float64)
    assert (stats["min"], stats["max"]) == (-6.0, 9.0)
    assert math.isclose(stats["mean"], ref.mean()) and math.isclose(stats["std"], ref.std(), rel_tol=1e-6)
    assert math.isclose(stats["norm"], float(np.linalg.norm(ref)), rel_tol=1e-6)
    assert stats["histogram"]["counts"] == [1] * 16


@pytest.mark.parametrize("value", [0.0, -3.5, 1e30])
def test_constant_tensor_is_all_in_the_last_bin(value: float) -> None:
    stats = tensor_stats(torch.full((5, 3), value))
    assert stats["histogram"]["bins"] == [np.float32(value).item()] * 17
    assert stats["histogram"]["counts"] == [0] * 15 + [15]
    assert stats["std"] == 0.0 and stats["min"] == stats["max"] == stats["mean"] == np.float32(value).item()


def test_single_element_and_empty_tensors() -> None:
    one = tensor_stats(torch.tensor([2.0]))
    assert (one["mean"], one["std"], one["min"], one["max"], one["norm"]) == (2.0, 0.0, 2.0, 2.0, 2.0)
    assert one["histogram"]["counts"] == [0] * 15 + [1]
    empty = tensor_stats(torch.empty(0, 3))
    assert (empty["mean"], empty["std"], empty["min"], empty["max"], empty["norm"]) == (None, None, None, None, 0.0)
    assert empty["histogram"] == {"bins": [0.0] * 17, "counts": [0] * 16}


def test_nonfinite_values_do_not_break_the_statistics() -> None:
    """A diverged tensor: range and histogram over the finite values; the moments are NaN
    (written as null) — and no error, which would lose the whole snapshot."""
    stats = tensor_stats(torch.tensor([1.0, float("nan"), 3.0, float("inf"), 2.0]))
    assert (stats["min"], stats["max"]) == (1.0, 3.0)
    assert sum(stats["histogram"]["counts"]) == 3
    assert math.isnan(stats["mean"])
    nothing_finite = tensor_stats(torch.tensor([float("nan"), float("inf")]))
    assert nothing_finite["min"] is None and nothing_finite["histogram"]["counts"] == [0] * 16


# -- records ---------------------------------------------------------------------------------


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 3)
        self.head = nn.Linear(3, 2)
        self.spare = nn.Linear(2, 2)  # never used: its gradients stay None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.encoder(x)))


PARAMS = ["encoder.weight", "encoder.bias", "head.weight", "head.bias", "spare.weight", "spare.bias"]
USED = PARAMS[:4]


@pytest.mark.real
def test_records_per_parameter_and_gradient(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TwoLayers()
    start(tmp_path)
    for epoch in stepwatch.epochs(2):
        if epoch == 1:
            model(torch.randn(5, 4)).sum().backward()
        assert stepwatch.snapshot(model, tag=f"e{epoch}") == (6 if epoch == 0 else 10)
    spool = finish(tmp_path)

    epochs = sorted((s for s in spool.spans if s["name"] == "epoch"), key=lambda s: s["index"])
    first = [r for r in spool.snapshots if r["span_id"] == epochs[0]["id"]]
    # the forward and backward of epoch 1 are a step (docs/step-inference.md): its snapshot is on it
    (probe,) = [s for s in spool.spans if s["name"] == "step" and s["parent_id"] == epochs[1]["id"]]
    second = [r for r in spool.snapshots if r["span_id"] == probe["id"]]
    assert [r["tensor_name"] for r in first] == PARAMS  # no gradients yet
    names = [r["tensor_name"] for r in second]
    assert sorted(names) == sorted(PARAMS + [f"{n}.grad" for n in USED])  # none for the unused layer
    tensors = {**dict(model.named_parameters()), **{f"{n}.grad": p.grad for n, p in model.named_parameters()}}
    for record in first + second:
        tensor = tensors[record["tensor_name"]]
        assert record["shape"] == list(tensor.shape)
        assert record["dtype"] == "float32"
        assert record["mode"] == "stats" and record["blob_uri"] is None
        assert record["attrs"] == {"tag": "e0" if record in first else "e1"}
        assert len(record["id"]) == 32
    for record in second:  # stats of the tensors as they were at epoch 1
        expected = tensor_stats(tensors[record["tensor_name"]])
        assert record["stats"]["histogram"] == expected["histogram"]
        for key in ("mean", "std", "min", "max", "norm"):
            assert math.isclose(record["stats"][key], expected[key], rel_tol=1e-12, abs_tol=1e-12)


def test_a_diverged_parameter_does_not_lose_the_snapshot(tmp_path: Path) -> None:
    model = TwoLayers()
    with torch.no_grad():
        model.head.weight[0, 0] = float("nan")
    start(tmp_path)
    assert stepwatch.snapshot(model) == 6
    spool = finish(tmp_path)
    head = next(r for r in spool.snapshots if r["tensor_name"] == "head.weight")
    assert head["stats"]["mean"] is None  # NaN is written as JSON null
    assert sum(head["stats"]["histogram"]["counts"]) == 5


def test_invalid_mode_is_the_callers_error(tmp_path: Path) -> None:
    start(tmp_path)
    with pytest.raises(ValueError, match="snapshot mode"):
        stepwatch.snapshot(TwoLayers(), "everything")
    spool = finish(tmp_path)
    assert spool.snapshots == []


def test_snapshot_without_a_runtime_records_nothing() -> None:
    assert stepwatch.snapshot(TwoLayers(), "full") == 0


# -- modes and blobs -------------------------------------------------------------------------


def _blob_path(uri: str) -> Path:
    parsed = urlparse(uri)
    assert parsed.scheme == "file"
    return Path(parsed.path)


@pytest.mark.real
def test_sampled_mode_keeps_blobs_only_when_the_roll_wins(tmp_path: Path) -> None:
    seed, rate, calls = 20240607, 0.5, 12
    rolls = random.Random(seed)
    expected = [rolls.random() < rate for _ in range(calls)]
    assert True in expected and False in expected
    model = TwoLayers()
    model(torch.randn(2, 4)).sum().backward()
    start(tmp_path)
    random.seed(seed)
    for i in range(calls):
        with stepwatch.scope("boundary", i=i):
            stepwatch.snapshot(model, "sampled", sample_rate=rate)
    spool = finish(tmp_path)

    boundaries = sorted((s for s in spool.spans if s["name"] == "boundary"), key=lambda s: s["attrs"]["i"])
    for span, kept in zip(boundaries, expected):
        records = [r for r in spool.snapshots if r["span_id"] == span["id"]]
        assert len(records) == 10
        blob_dir = tmp_path / "snapshots" / span["id"]
        if kept:
            assert all(r["mode"] == "sampled" and r["blob_uri"] for r in records)
            assert sorted(p.name for p in blob_dir.iterdir()) == ["gradients.safetensors", "weights.safetensors"]
        else:
            assert all(r["mode"] == "stats" and r["blob_uri"] is None for r in records)
            assert not blob_dir.exists()


@pytest.mark.real
def test_full_mode_blobs_hold_the_tensors_at_snapshot_time(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TwoLayers()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    start(tmp_path)
    expected: dict[str, dict[str, torch.Tensor]] = {}
    for epoch in stepwatch.epochs(2):
        model(torch.randn(8, 4)).pow(2).sum().backward()
        optimizer.step()
        stepwatch.snapshot(model, "full")
        expected[f"e{epoch}"] = {
            **{n: p.detach().clone() for n, p in model.named_parameters()},
            **{f"{n}.grad": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        }
        optimizer.zero_grad()
    spool = finish(tmp_path)

    epochs = sorted((s for s in spool.spans if s["name"] == "epoch"), key=lambda s: s["index"])
    for epoch in epochs:
        records = [r for r in spool.snapshots if r["span_id"] == epoch["id"]]
        assert len(records) == 10 and all(r["mode"] == "full" for r in records)
        for kind in ("weights", "gradients"):
            path = tmp_path / "snapshots" / epoch["id"] / f"{kind}.safetensors"
            mine = [r for r in records if r["tensor_name"].endswith(".grad") == (kind == "gradients")]
            assert {r["blob_uri"] for r in mine} == {path.resolve().as_uri()}
            assert _blob_path(mine[0]["blob_uri"]) == path.resolve()
            blob = load_file(str(path))
            assert set(blob) == {r["tensor_name"] for r in mine}  # keyed by tensor_name, verbatim
            for name, tensor in blob.items():
                assert torch.equal(tensor, expected[f"e{epoch['index']}"][name]), name
    first = load_file(str(tmp_path / "snapshots" / epochs[0]["id"] / "weights.safetensors"))
    assert not torch.equal(first["head.weight"], model.head.weight.detach())  # a copy, not the live tensor
