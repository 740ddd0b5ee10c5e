"""Small file primitives shared by the artifact writers: atomic replace, torn-tail repair."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["atomic_write_bytes", "cut_torn_tail"]


def atomic_write_bytes(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """Replaces ``path`` so a reader sees the old or the new content, never a mix.

    Write to a temp file beside it, fsync it, rename over, then fsync the directory so the
    rename itself survives a power cut.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if fsync:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def cut_torn_tail(path: Path, chunk: int = 1 << 16) -> int:
    """Truncates a line file after its last newline (a write torn by a crash); returns bytes cut."""
    size = path.stat().st_size
    if size == 0:
        return 0
    with path.open("r+b") as handle:
        end = size
        while end > 0:
            start = max(0, end - chunk)
            handle.seek(start)
            block = handle.read(end - start)
            newline = block.rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            end = start
        else:
            keep = 0
        if keep < size:
            handle.truncate(keep)
            handle.flush()
            os.fsync(handle.fileno())
        return size - keep
