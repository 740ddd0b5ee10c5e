"""Tensor snapshots (spool-format-v1.md "snapshots[]"): per-parameter statistics, and
safetensors blobs for ``sampled``/``full`` modes written off the training thread.

Statistics are computed where the tensor lives with one host transfer per tensor; blobs are
CPU copies handed to the background thread, which writes
``<run>/snapshots/<span_id>/{weights,gradients}.safetensors`` keyed by the tensor name. A further
snapshot with blobs on the same span writes ``weights-<n>.safetensors`` (n = 2, 3, ...), so that
no file is overwritten and every record's ``blob_uri`` names the tensors it was taken with.
``load_snapshot_tensor`` reads a record's tensor back.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

__all__ = ["HISTOGRAM_BINS", "SnapshotJob", "blob_path", "load_snapshot_tensor", "snapshot_model", "tensor_stats"]

HISTOGRAM_BINS = 16
MODES = ("stats", "sampled", "full")


def tensor_stats(tensor: Any) -> dict[str, Any]:
    """mean, population std, min, max, L2 norm and a 16-bin histogram over 17 even edges.

    A constant tensor has 17 equal edges and all its values in the last (closed) bin; an empty
    tensor has null moments, zero norm and zero counts.
    """
    import torch

    t = tensor.detach()
    numel = t.numel()
    if numel == 0:
        return {"mean": None, "std": None, "min": None, "max": None, "norm": 0.0,
                "histogram": {"bins": [0.0] * (HISTOGRAM_BINS + 1), "counts": [0] * HISTOGRAM_BINS}}
    t = t.float() if not t.is_floating_point() or t.dtype in (torch.float16, torch.bfloat16) else t
    values = t
    low, high = torch.stack(torch.aminmax(t)).double().tolist()
    if not (math.isfinite(low) and math.isfinite(high)):
        # A diverged tensor (nan/inf): range and histogram over its finite values. histc rejects
        # a non-finite range, and that error used to lose the snapshot of every parameter.
        values = t[torch.isfinite(t)]
        if values.numel() == 0:
            moments = torch.stack([t.mean(), t.std(unbiased=False), torch.linalg.vector_norm(t)])
            mean, std, norm = moments.double().tolist()
            return {"mean": mean, "std": std, "min": None, "max": None, "norm": norm,
                    "histogram": {"bins": [0.0] * (HISTOGRAM_BINS + 1), "counts": [0] * HISTOGRAM_BINS}}
        low, high = torch.stack(torch.aminmax(values)).double().tolist()
    # Past 2**32 in magnitude float32 sums of values and squares overflow (mean, std and norm
    # became inf, histc's range too); below 2**-32 squares underflow (the norm of vanishing
    # gradients became 0): compute on the tensor divided by its largest magnitude.
    scale = max(abs(low), abs(high))
    if scale > 2.0 ** 32 or 0.0 < scale < 2.0 ** -32:
        t, values = t / scale, values / scale
    else:
        scale = 1.0
    moments = torch.stack([t.mean(), t.std(unbiased=False) if numel > 1 else t.new_zeros(()),
                           torch.linalg.vector_norm(t)])
    mean, std, norm = (m * scale for m in moments.double().tolist())
    finite = values.numel()
    if low == high:
        counts = [0] * (HISTOGRAM_BINS - 1) + [finite]
    else:
        lo, hi = (low, high) if scale == 1.0 else torch.stack(torch.aminmax(values)).double().tolist()
        counts = [int(c) for c in torch.histc(values, bins=HISTOGRAM_BINS, min=lo, max=hi).tolist()]
        counts[-1] += finite - sum(counts)  # histc drops nothing in range; guard float edge cases
    step = (high - low) / HISTOGRAM_BINS
    bins = [low + step * i for i in range(HISTOGRAM_BINS)] + [high]
    return {"mean": mean, "std": std, "min": low, "max": high, "norm": norm,
            "histogram": {"bins": bins, "counts": counts}}


class SnapshotJob:
    """Blobs to write for one span: name -> CPU tensor, per kind ("weights" or "gradients")."""

    __slots__ = ("span_id", "weights", "gradients", "suffix")

    def __init__(self, span_id: str, suffix: str = "") -> None:
        self.span_id = span_id
        self.weights: dict[str, Any] = {}
        self.gradients: dict[str, Any] = {}
        self.suffix = suffix  # "" for a span's first snapshot with blobs, then "-2", "-3", ...


def snapshot_model(
    model: Any, *, span_id: str, mode: str, sample_rate: float, blob_uri: Any, ts_ns: int,
    attrs: dict[str, Any] | None, new_id: Any, blob_index: int = 0,
) -> tuple[list[dict[str, Any]], SnapshotJob | None]:
    """Records for every parameter (and its ``.grad``), plus the blob job when this one keeps blobs.

    ``blob_uri(span_id, file_stem)`` gives the URI written in records that carry a blob;
    ``blob_index`` is how many snapshots with blobs this span has had (their files are kept).
    """
    if mode not in MODES:
        raise ValueError(f"snapshot mode must be one of {', '.join(MODES)}, got {mode!r}")
    keep_blobs = mode == "full" or (mode == "sampled" and random.random() < sample_rate)
    job = SnapshotJob(span_id, f"-{blob_index + 1}" if blob_index else "") if keep_blobs else None
    records: list[dict[str, Any]] = []
    for name, param in model.named_parameters():
        entries = [(name, param, "weights")]
        if param.grad is not None:
            entries.append((f"{name}.grad", param.grad, "gradients"))
        for tensor_name, tensor, kind in entries:
            if job is not None:
                getattr(job, kind)[tensor_name] = tensor.detach().to("cpu", copy=True).contiguous()
            records.append({
                "id": new_id(),
                "span_id": span_id,
                "tensor_name": tensor_name,
                "shape": list(tensor.shape),
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "mode": mode if job is not None else "stats",
                "stats": tensor_stats(tensor),
                "blob_uri": blob_uri(span_id, kind + job.suffix) if job is not None else None,
                "ts_ns": ts_ns,
                "attrs": attrs or {},
            })
    return records, job


def write_blobs(job: SnapshotJob, directory: Any) -> None:
    """Background thread: one safetensors file per kind, keyed by the tensor name verbatim."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    for kind in ("weights", "gradients"):
        tensors = getattr(job, kind)
        if tensors:
            save_file(tensors, str(directory / f"{kind}{job.suffix}.safetensors"))


def blob_path(record: dict[str, Any], root: str | Path | None = None) -> Path | None:
    """The local file of a snapshot record's ``blob_uri`` (None for a stats-only record).

    The URI is absolute; when that file is not there (the run directory was moved or copied,
    or the spool came from another machine), it is found by its tail ``snapshots/<span_id>/<file>``
    under ``root``: a run directory, its ``spool`` directory, or a ``.cirron`` directory.
    """
    uri = record.get("blob_uri")
    if not uri:
        return None
    parsed = urlparse(uri)
    path = Path(unquote(parsed.path)) if parsed.scheme in ("file", "") else Path(unquote(parsed.path.lstrip("/")))
    if path.is_file():
        return path
    parts = path.parts
    tail = Path(*parts[-3:]) if len(parts) >= 3 and parts[-3] == "snapshots" else Path("snapshots", *parts[-2:])
    if root is not None:
        base = Path(root)
        for candidate in (base / tail, base.parent / tail, base / ".cirron" / tail):
            if candidate.is_file():
                return candidate
    raise FileNotFoundError(f"snapshot blob not found: {uri} (looked for {tail} under {root})")


def load_snapshot_tensor(record: dict[str, Any], root: str | Path | None = None) -> Any:
    """The tensor a snapshot record's blob holds, as a CPU ``torch.Tensor`` (None for a
    stats-only record). Keys are tried as the record's ``tensor_name`` and with or without its
    ``.grad`` suffix: the real SDK keys gradients by the bare parameter name
    (spool-current-practice.md), stepwatch by the name verbatim.

    Example::

        spool = read_spool(run_dir)
        tensor = load_snapshot_tensor(spool.snapshots[0], run_dir)
    """
    path = blob_path(record, root)
    if path is None:
        return None
    from safetensors import safe_open

    name = str(record["tensor_name"])
    keys = [name, name.removesuffix(".grad")] if name.endswith(".grad") else [name, f"{name}.grad"]
    with safe_open(str(path), framework="pt") as container:
        present = set(container.keys())
        for key in keys:
            if key in present:
                return container.get_tensor(key)
    raise KeyError(f"{name!r} not in {path} (keys tried: {keys})")
