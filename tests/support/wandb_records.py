"""Reads a W&B offline run file (``run-ID.wandb``) back into ``wandb_internal_pb2.Record``
messages. wandb 0.31 ships no Python reader (its internals moved to the Go core), but the
format is small: a 7-byte header (``:W&B``, two magic bytes, a version byte), then LevelDB-log
records in 32 KiB blocks, each chunk a little-endian crc32c (u32), a length (u16) and a type
(u8: 1 full, 2 first, 3 middle, 4 last); a block's tail under 7 bytes is padding."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list[Any]:
    """Every record of the file, in order; AssertionError on a broken frame (the test fails)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: no W&B header"
    records: list[Any] = []
    pos, pending = HEADER, b""
    while pos + CHUNK_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:  # the block's padding
            pos += left
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, pos)
        if length == 0 and kind == 0:  # zeroed tail of the last block
            break
        body = data[pos + CHUNK_HEADER:pos + CHUNK_HEADER + length]
        assert len(body) == length, f"{path}: a chunk runs past the end at {pos}"
        pos += CHUNK_HEADER + length
        assert kind in (FULL, FIRST, MIDDLE, LAST), f"{path}: chunk type {kind} at {pos}"
        if kind == FULL:
            pending = body
        elif kind == FIRST:
            pending = body
            continue
        else:
            pending += body
            if kind == MIDDLE:
                continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        records.append(record)
        pending = b""
    return records


def history_rows(path: Path) -> list[dict[str, Any]]:
    """The logged rows, each ``{key: value}`` (values JSON-decoded) with its ``_step``."""
    import json

    rows = []
    for record in read_records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({".".join(item.nested_key) or item.key: json.loads(item.value_json)
                         for item in record.history.item})
    return rows
