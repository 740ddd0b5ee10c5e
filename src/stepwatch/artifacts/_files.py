"""Small file primitives shared by the artifact writers: atomic replace, torn-tail repair, the
sink's writer lock and the liveness of a recorded writer process."""

from __future__ import annotations

import errno
import os
import socket
import threading
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: sinks go unlocked
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "WRITER_LOCK_FILENAME",
    "WriterLockBusy",
    "acquire_writer_lock",
    "atomic_write_bytes",
    "cut_torn_tail",
    "process_alive",
    "release_writer_lock",
]


def atomic_write_bytes(path: Path, data: bytes | bytearray, *, fsync: bool = True) -> None:
    """Replaces ``path`` so a reader sees the old or the new content, never a mix.

    Write to a temp file beside it, fsync it, rename over, then fsync the directory so the
    rename itself survives a power cut. ``data`` may be a caller's reused ``bytearray``: no view
    of it outlives the call, even one that fails, so the caller can resize it afterwards.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view):]
        finally:
            view.release()
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


# -- liveness of a recorded writer -------------------------------------------------------------

# A process that started this long after the session it is said to write cannot be its writer
# (its pid was reused). Generous: boot time is whole seconds and wall clocks get adjusted.
_REUSE_SLACK_S = 2.0


def process_alive(host: str | None, pid: int | None, since_ns: int | None = None) -> bool:
    """Whether ``pid`` on ``host`` may still be the process that started writing at ``since_ns``.

    Another host's pid proves nothing here (False). A zombie is gone. On Linux a live process
    that started after ``since_ns`` is a reused pid, so also False; elsewhere a live pid counts.
    """
    if host != socket.gethostname() or pid is None or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: a pid no process can have
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    started = _linux_start_time(pid)
    if started is None:
        return True
    state, start_s = started
    if state == "Z":
        return False
    return not (since_ns and start_s > since_ns / 1e9 + _REUSE_SLACK_S)


def _linux_start_time(pid: int) -> tuple[str, float] | None:
    """(state, start time in epoch seconds) from ``/proc``; None where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        boot = _boot_time()
    except (OSError, ValueError):
        return None
    fields = stat[stat.rfind(b")") + 2:].split()  # after "pid (comm) ": comm may hold spaces
    try:
        return fields[0].decode(), boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (IndexError, ValueError, OSError):
        return None


def _boot_time() -> float:
    for line in Path("/proc/stat").read_bytes().splitlines():
        if line.startswith(b"btime "):
            return float(line.split()[1])
    raise ValueError("no btime in /proc/stat")


# -- one writer per sink directory ----------------------------------------------------------

WRITER_LOCK_FILENAME = ".writer.lock"

# One descriptor per lock file per process: a POSIX record lock is owned by the process and
# dropped when *any* of its descriptors of that file closes, so two sinks of one process on one
# directory share it (counted) instead of each opening the file. POSIX locks (not flock) are
# not inherited by fork: a DataLoader worker that outlives a killed trainer does not keep the
# directory locked. The OS releases the lock when the process dies, however it dies; a clean
# release also removes the file, so a closed sink directory holds only manifest and segments.
_held: dict[str, tuple[int, int, int]] = {}  # lock path -> (owner pid, fd, users)
_held_lock = threading.Lock()


class WriterLockBusy(Exception):
    """Another live process holds the directory's writer lock; ``holder`` is what it wrote there."""

    def __init__(self, holder: str) -> None:
        self.holder = holder
        super().__init__(holder)


def acquire_writer_lock(directory: Path) -> str | None:
    """Takes the directory's writer lock for this process; returns its key for ``release``.

    Returns None where the file system cannot lock (the caller goes on unlocked).

    Raises:
        WriterLockBusy: another live process holds it.
    """
    if fcntl is None:  # pragma: no cover
        return None
    path = directory / WRITER_LOCK_FILENAME
    key = os.path.realpath(path)
    me = os.getpid()
    with _held_lock:
        held = _held.get(key)
        if held is not None and held[0] == me:
            _held[key] = (me, held[1], held[2] + 1)
            return key
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError:
                return None  # a read-only directory, say: nothing to protect by locking
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EACCES):
                    try:
                        holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
                    finally:
                        os.close(fd)
                    raise WriterLockBusy(holder or "unknown process") from None
                os.close(fd)
                return None  # ENOLCK and friends: this file system does not lock
            # The holder before us unlinks the file as it lets go: the lock is ours only if
            # the name still leads to the file we locked (else lock the new one).
            try:
                same = os.path.samestat(os.stat(path), os.fstat(fd))
            except OSError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {me} on {socket.gethostname()}\n".encode(), 0)
        except OSError:
            pass  # the lock holds without the note
        _held[key] = (me, fd, 1)
        return key


def release_writer_lock(key: str | None) -> None:
    """Gives back one use of the lock taken by ``acquire_writer_lock`` (safe to call twice)."""
    if key is None:
        return
    with _held_lock:
        held = _held.get(key)
        if held is None or held[0] != os.getpid():
            return
        if held[2] > 1:
            _held[key] = (held[0], held[1], held[2] - 1)
            return
        del _held[key]
        try:
            os.unlink(key)  # while still locked: whoever locks the old file next sees it is gone
        except OSError:
            pass
        try:
            os.close(held[1])  # drops the lock
        except OSError:
            pass
