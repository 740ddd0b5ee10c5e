"""Processes the training process starts itself (``torch.multiprocessing.spawn``, ``mp.Process``
with fork, spawn or forkserver) are captured into the same session; DataLoader workers are not.

Where it starts: every multiprocessing child runs ``BaseProcess._bootstrap``, which calls the
``multiprocessing.util.register_after_fork`` callbacks before the target; there the child knows
its target (so a DataLoader worker is told apart) and its place among its siblings. A forked
child inherits the callback from its captured parent (registered at ``init``); a spawned child,
or one forked by the forkserver, gets it from ``sitecustomize`` under ``stepwatch run``/``track``.

Identity: the child's own environment when it names a rank the parent does not have (a parent
that set ``RANK`` before ``start()``); else the rank and world size of ``init_process_group``
once it is called; else, at its first step, a worker index: the first key from the parent's world
size up that no other process of the session holds. Until one of these is known nothing is
written (see ``Runtime.open_child``), so the rows are never re-keyed, and a child that neither
steps nor joins a process group (a pool worker doing I/O) leaves no trace.

Keys are claimed with the files ``sitecustomize`` uses (``.autostart-<session>-rank<N>``). A
rank whose claim is held by another process (the process that started the ranks holds
rank 0 under ``stepwatch run``) shares the rank in the history; its local files get a
``-p<pid>`` suffix so that no two processes write one file.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .identity import DistributedIdentity, resolve_distributed_identity

__all__ = ["ChildProcess", "install_bootstrap_hook", "is_data_loader_worker", "note_captured",
           "note_process_group", "settle_identity"]

# "<pid>:<rank>:<world size>" of the nearest captured ancestor, set when a runtime opens.
CAPTURED_ENV = "STEPWATCH_CAPTURED"
# The launcher's contract for its own first process: a child inherits it, it does not name the child.
_CONTRACT = ("STEPWATCH_RANK", "STEPWATCH_LOCAL_RANK", "STEPWATCH_WORLD_SIZE", "STEPWATCH_JOB_ID")


class ChildProcess:
    """What a child knows about itself and its parent; ``identity`` is None while pending."""

    def __init__(self, *, parent_identity: DistributedIdentity, parent_pid: int | None, start_method: str | None,
                 name: str, spawn_index: int | None) -> None:
        self.parent_identity = parent_identity
        self.parent_pid = parent_pid
        self.start_method = start_method
        self.name = name
        self.spawn_index = spawn_index  # torch.multiprocessing.spawn's process index, if started by it
        self.identity: DistributedIdentity | None = None
        self.role = "pending"
        self.suffix = ""

    def record(self) -> dict[str, Any]:
        """The ``process`` object of the start record: how this process got its identity."""
        record: dict[str, Any] = {"role": self.role, "identity_source": self.identity.source if self.identity else None,
                                  "parent_pid": self.parent_pid, "start_method": self.start_method, "name": self.name}
        if self.identity is not None and self.role == "rank":
            record["rank"], record["world_size"] = self.identity.rank, self.identity.world_size
        return record


class _Hook:
    """``register_after_fork`` keeps a weak reference to its owner: this one lives forever."""


_HOOK = _Hook()
_installed = False
_inherited: Any = None  # the runtime a forked child inherited from its parent (set by api._after_fork)


def install_bootstrap_hook(*, spawned: bool = False) -> None:
    """Makes every multiprocessing child of this process decide at its start whether to capture.

    ``spawned``: this interpreter is a spawned child itself. Its bootstrap skips the after-fork
    callbacks (``SpawnProcess._after_fork`` does nothing), so that no-op, called at the same
    moment (the process object current, its target known, before the target runs), decides.
    """
    global _installed
    if _installed:
        return
    import multiprocessing.context
    import multiprocessing.util

    multiprocessing.util.register_after_fork(_HOOK, _on_bootstrap)
    if spawned:
        spawn_process = getattr(multiprocessing.context, "SpawnProcess", None)
        if spawn_process is not None:
            original = spawn_process._after_fork  # noqa: SLF001 - where a spawned child starts; no public hook

            def _after_fork() -> None:
                _on_bootstrap(_HOOK)
                original()

            spawn_process._after_fork = staticmethod(_after_fork)  # noqa: SLF001
    _installed = True


def forked_from(runtime: Any) -> None:
    """Called in a forked child: the parent's runtime, whose files the child must not touch."""
    global _inherited
    _inherited = runtime if getattr(runtime, "active", False) else None


def is_data_loader_worker(target: Any) -> bool:
    """torch starts its loader workers with ``torch.utils.data._utils.worker._worker_loop``."""
    return (getattr(target, "__module__", None) or "").startswith("torch.utils.data")


# The capture API, bound by ``api`` when it is imported (``bind``): this module sits below it, so
# that the patches and the runtime can call in here without an import cycle.
def _no_runtime() -> Any:
    return None


_current_runtime: Callable[[], Any] = _no_runtime
_start: Callable[[Any, ChildProcess], Any] | None = None


def bind(current_runtime: Callable[[], Any], start_child: Callable[[Any, ChildProcess], Any]) -> None:
    """The API's ``current_runtime`` and ``start_child``, for the hooks below."""
    global _current_runtime, _start
    _current_runtime, _start = current_runtime, start_child


def _on_bootstrap(_owner: object) -> None:
    from ..guard import Site, report_internal

    try:
        _start_child()
    except Exception as exc:  # noqa: BLE001 - the child runs on without capture
        report_internal(exc, Site.CHILDREN_BOOTSTRAP)


def _start_child() -> None:
    from .config import RuntimeConfig

    process = multiprocessing.current_process()
    target = getattr(process, "_target", None)
    if is_data_loader_worker(target):
        return  # first: a loader worker loads nothing of the capture API
    if _start is None or getattr(_current_runtime(), "active", False):
        return
    parent = _inherited
    env = os.environ
    if parent is not None:  # forked: the parent's own session and directory, whatever set them
        config = _replace(parent.config, out=str(parent.run_dir), session_id=parent.session_id,
                          rank=None, local_rank=None, world_size=None)
        parent_identity = parent.identity
        parent_pid: int | None = parent.pid
    elif env.get("STEPWATCH_AUTOSTART") == "1" and env.get("STEPWATCH_RUN_DIR"):
        config = RuntimeConfig.from_env(env)
        parent_pid, parent_identity = _captured_parent(env)
    else:
        return
    args = getattr(process, "_args", ())
    spawn_index = args[1] if getattr(target, "__module__", "") == "torch.multiprocessing.spawn" and len(args) > 1 \
        and isinstance(args[1], int) else None
    child = ChildProcess(parent_identity=parent_identity, parent_pid=parent_pid,
                         start_method=getattr(process, "_start_method", None) or multiprocessing.get_start_method(True),
                         name=process.name, spawn_index=spawn_index)
    own = _own_env_identity(env, parent_identity)
    session_id = config.session_id
    if own is not None and session_id is not None and config.out is not None:
        settle_identity(child, own, Path(config.out), session_id)
    _start(config, child)


def _replace(config: Any, **changes: Any) -> Any:
    import msgspec

    return msgspec.structs.replace(config, **changes)


def _captured_parent(env: Any) -> tuple[int | None, DistributedIdentity]:
    """The nearest captured ancestor (pid, identity) from the environment it left, else the
    launcher's contract (what the first process of this rank was given)."""
    raw = env.get(CAPTURED_ENV, "")
    try:
        pid, rank, world = (int(part) for part in raw.split(":")[:3])
        return pid, DistributedIdentity(rank=rank, local_rank=0, world_size=world, source="parent")
    except ValueError:
        pass
    try:
        return None, resolve_distributed_identity(env=env)
    except Exception:  # noqa: BLE001 - a contradictory environment: the default
        return None, DistributedIdentity()


def _own_env_identity(env: Any, parent: DistributedIdentity) -> DistributedIdentity | None:
    """An identity the child's environment gives it that is not just its parent's, inherited."""
    try:
        found = resolve_distributed_identity(env={k: v for k, v in env.items() if k not in _CONTRACT})
    except Exception:  # noqa: BLE001
        return None
    if found.source == "default" or (found.rank, found.world_size) == (parent.rank, parent.world_size):
        return None
    return found


def note_captured(session_id: str, identity: DistributedIdentity) -> None:
    """Leaves this process's identity to the processes it starts (spawned ones read it here)."""
    os.environ[CAPTURED_ENV] = f"{os.getpid()}:{identity.rank}:{identity.world_size}:{session_id}"


def note_process_group(group: Any) -> None:
    """Called when torch sets the default process group: a pending child takes its rank."""
    runtime = _current_runtime()
    child = getattr(runtime, "child", None)
    if child is None or runtime.opened:
        return
    rank, world = int(group.rank()), int(group.size())
    local = child.spawn_index if child.spawn_index is not None and child.spawn_index < world else rank
    runtime.open_child(DistributedIdentity(job_id=child.parent_identity.job_id, rank=rank, local_rank=local,
                                           world_size=world, source="init_process_group"))


def settle_identity(child: ChildProcess, identity: DistributedIdentity | None, run_dir: Path, session_id: str) -> None:
    """Fixes the child's identity and key: ``identity`` as a rank, or (None) the next free worker key."""
    pid = os.getpid()
    if identity is not None:
        child.identity, child.role = identity, "rank"
        if not _claim(run_dir, session_id, identity.rank, pid):
            child.suffix = f"-p{pid}"
        return
    key = max(1, child.parent_identity.world_size)
    while not _claim(run_dir, session_id, key, pid):
        key += 1
    # world_size key + 1 keeps every record's rank < world_size; the role says it is a worker
    child.identity = DistributedIdentity(job_id=child.parent_identity.job_id, rank=key, local_rank=0,
                                         world_size=key + 1, source="worker")
    child.role = "worker"


def _claim(run_dir: Path, session_id: str, key: int, pid: int) -> bool:
    """Takes key ``key`` of the session (the claim files of ``sitecustomize``). False when any
    process, live or not, holds it: a child never takes a claim over (a liveness test by
    ``kill(pid, 0)`` was seen to answer "no such process" for a live sibling under forkserver,
    and two workers then shared a key); a key left by a dead process only costs a higher key."""
    path = run_dir / f".autostart-{session_id}-rank{key}"
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    os.write(fd, str(pid).encode())
    os.close(fd)
    return True
