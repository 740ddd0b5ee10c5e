"""``stepwatch track``: capture a command (in-process, through the env contract) or an existing
process (from outside, by pid) into a run directory.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..artifacts.heartbeat import HeartbeatWriter, heartbeat_record
from ..artifacts.run_manifest import RunManifest, current_versions, write_run_manifest, write_run_manifest_in_place
from ..artifacts.sink import TelemetrySink
from ..schema import SessionStatus, SessionSummary, new_session_id
from .collectors import CollectorHealth, CpuCollector, discover_nvml
from .events import EventFactory
from .identity import DistributedIdentity

__all__ = ["check_command", "default_run_dir", "python_script_of", "sample_process", "track_command"]

AUTOSTART_DIR = Path(__file__).parent / "_autostart"
_RUNTIME_GRACE_S = 3.0  # how long a Python child has to start capture before it is sampled from outside
_LAUNCHER_GRACE_S = 20.0  # the same for torchrun & co., whose workers start seconds later
# the same names _autostart/sitecustomize.py treats as launchers (it cannot import this module)
_LAUNCHERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch", "accelerate", "deepspeed")


def default_run_dir(session_id: str) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return Path("stepwatch_runs") / f"{stamp}-{session_id[:8]}"


def _runs_python(command: list[str]) -> bool:
    """Whether the command starts a Python interpreter (directly or through a shebang)."""
    executable = shutil.which(command[0]) or command[0]
    if os.path.basename(executable).startswith("python"):
        return True
    try:
        with open(executable, "rb") as handle:
            head = handle.readline(200)
    except OSError:
        return False
    return head.startswith(b"#!") and b"python" in head


def _capture_grace_s(command: list[str]) -> float:
    if not _runs_python(command):
        return 0.0
    words = {os.path.basename(word) for word in command[:3]}
    return _LAUNCHER_GRACE_S if words & set(_LAUNCHERS) else _RUNTIME_GRACE_S


# Interpreter options that take a value (``-W error``, ``-X dev``): the script comes after it.
_PYTHON_VALUE_OPTIONS = frozenset({"-W", "-X", "--check-hash-based-pycs"})


def python_script_of(command: list[str]) -> str | None:
    """The script a ``python [OPTIONS] SCRIPT [ARGS]`` command runs, or None when it runs none
    (``-m MODULE``, ``-c CODE``, ``-`` or stdin, a REPL) or is not a Python interpreter."""
    if not command or not os.path.basename(command[0]).startswith("python"):
        return None
    words = iter(command[1:])
    for word in words:
        if word in ("-m", "-c", "-") or word.startswith(("-m", "-c")) and not word.startswith("--"):
            return None
        if word in _PYTHON_VALUE_OPTIONS:
            next(words, None)
            continue
        if word.startswith("-"):
            continue
        return word
    return None


def check_command(command: list[str]) -> None:
    """Raises FileNotFoundError, before anything is started or created, for a program that is
    not there or a Python script that does not exist."""
    program = command[0]
    if shutil.which(program) is None and not (os.sep in program and os.path.exists(program)):
        raise FileNotFoundError(f"cannot start {program!r}: no such program (nothing was started)")
    script = python_script_of(command)
    if script is not None and not os.path.exists(script):
        raise FileNotFoundError(f"{script}: no such script (nothing was started)")


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def track_command(command: list[str], *, out: Path | None, interval_ms: int) -> tuple[int, Path, str]:
    """Runs ``command`` with capture on; returns (exit code, run dir, session status)."""
    check_command(command)
    session_id = new_session_id()
    run_dir = out or default_run_dir(session_id)
    run_dir.mkdir(parents=True, exist_ok=True)
    manifest = RunManifest(session_id=session_id, started_at_ns=time.time_ns(), command_line=command,
                           launcher="track", versions=current_versions())
    write_run_manifest(run_dir, manifest)
    env = dict(os.environ)
    env.update(
        STEPWATCH_AUTOSTART="1", STEPWATCH_RUN_DIR=str(run_dir.resolve()), STEPWATCH_SESSION_ID=session_id,
        STEPWATCH_INTERVAL_MS=str(interval_ms), STEPWATCH_LAUNCHER="track",
        PYTHONPATH=os.pathsep.join(p for p in (str(AUTOSTART_DIR), env.get("PYTHONPATH")) if p),
    )
    try:
        child = subprocess.Popen(command, env=env)
    except OSError as exc:
        manifest.status, manifest.exit_code, manifest.ended_at_ns = "incomplete", 127, time.time_ns()
        write_run_manifest(run_dir, manifest)
        raise FileNotFoundError(f"cannot start {command[0]!r}: {exc.strerror}") from exc

    forwarded: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        # SIGTERM goes straight on; SIGINT from a terminal already reached the child (same
        # process group), so it is re-sent only if the child is still running a second later.
        forwarded.append(signum)
        if signum != signal.SIGINT and child.poll() is None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        deadline = time.monotonic() + _capture_grace_s(command)
        claims = f".autostart-{session_id}-rank*"
        while child.poll() is None and time.monotonic() < deadline and not any(run_dir.glob(claims)):
            time.sleep(0.02)
        if child.poll() is None and not any(run_dir.glob(claims)):
            # not a Python program (or it never imported site): sample it from outside
            sample_process(child.pid, run_dir=run_dir, interval_ms=interval_ms, session_id=session_id,
                           stop_when=lambda: child.poll() is not None, write_manifest=False)
        interrupted_at: float | None = None
        while child.poll() is None:
            if signal.SIGINT in forwarded and interrupted_at is None:
                interrupted_at = time.monotonic()
            if interrupted_at is not None and time.monotonic() - interrupted_at > 1.0:
                child.send_signal(signal.SIGINT)
                interrupted_at = float("inf")
            time.sleep(0.05)
        returncode = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    status = _close_child_session(run_dir, session_id)
    manifest.status, manifest.exit_code, manifest.ended_at_ns = status, _exit_code(returncode), time.time_ns()
    _fold_outcome(run_dir, manifest, returncode, forwarded, command)
    error = write_run_manifest_in_place(run_dir, manifest)
    if error is not None:
        sys.stderr.write(f"[stepwatch] could not record the end of the run in {run_dir / 'run.json'}: "
                         f"{error.strerror or error}\n")
    return _exit_code(returncode), run_dir, status


def _fold_outcome(run_dir: Path, manifest: RunManifest, returncode: int, forwarded: list[int],
                  command: list[str]) -> None:
    """The run's ``outcome``/``error``/``errors`` (docs/run-outcome.md): the child is rank 0
    itself unless it is a launcher of ranks (torchrun & co.)."""
    from ..artifacts.run_outcome import fold_run_outcome

    launcher = bool({os.path.basename(word) for word in command[:3]} & set(_LAUNCHERS))
    try:
        fold_run_outcome(run_dir, manifest, returncode, forwarded, single_process=not launcher)
    except OSError:  # the run directory went away: run.json says what the exit code says
        pass


def _close_child_session(run_dir: Path, session_id: str) -> SessionStatus:
    """A child killed before it could close its session leaves it running: recover it.

    Only this session's entry counts: a reused run directory holds earlier sessions too.
    """
    sink_dir = run_dir / "telemetry" / "rank0"
    if not sink_dir.exists():
        return "incomplete"
    try:
        ledger = TelemetrySink(sink_dir).ledger  # opening recovers: running -> interrupted
    except OSError as exc:  # a full disk cannot take the recovered manifest
        sys.stderr.write(f"[stepwatch] {sink_dir}: the session could not be closed ({exc.strerror or exc}); "
                         "what the capture could not write is counted in its stop record where that fit\n")
        return "incomplete"
    mine = [entry.status for entry in ledger if entry.session_id == session_id]
    return mine[-1] if mine else "incomplete"


def sample_process(
    pid: int, *, run_dir: Path, interval_ms: int, session_id: str | None = None,
    stop_when: object = None, write_manifest: bool = True, heartbeat_interval: float = 5.0,
) -> SessionStatus:
    """Samples process ``pid`` from outside (RSS, and NVML per-process GPU memory) until it exits
    or Ctrl-C; writes a session into ``run_dir/telemetry/rank0`` and the process's liveness into
    ``heartbeat_rank0.jsonl`` (boot, a ``heartbeat`` every ``heartbeat_interval`` s, stop).

    ``write_manifest``: also write ``run.json`` (launcher "track", the pid, status, end time), as
    ``stepwatch track --pid`` does; ``track_command`` writes its own.
    """
    import psutil

    session_id = session_id or new_session_id()
    started_ns = time.time_ns()
    manifest: RunManifest | None = None
    if write_manifest:
        try:
            command_line = psutil.Process(pid).cmdline()
        except psutil.Error:
            command_line = []
        manifest = RunManifest(session_id=session_id, started_at_ns=started_ns, command_line=command_line,
                               launcher="track", pid=pid, versions=current_versions(),
                               extra={"sampled_from_outside": True})
        write_run_manifest(run_dir, manifest)
    cpu = CpuCollector(pid)
    collectors = [CollectorHealth(cpu)]
    nvml = discover_nvml(pid)
    if nvml is not None:
        collectors.append(CollectorHealth(nvml))
    sink = TelemetrySink(run_dir / "telemetry" / "rank0")
    host = socket.gethostname()
    sink.start_session(SessionSummary(session_id=session_id, status="running", started_at_ns=started_ns,
                                      host=host, pid=pid, source="stepwatch.track_pid"))
    factory = EventFactory(session_id=session_id, identity=DistributedIdentity(), host=host, pid=pid,
                           interval_ms=interval_ms)
    heartbeat = HeartbeatWriter(run_dir, 0)
    status: SessionStatus = "completed"

    def beat(msg: str, **fields: object) -> None:
        heartbeat.write(heartbeat_record(ts=time.time(), pid=pid, rank=0, step=0, msg=msg, **fields))

    def alive() -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def sample() -> bool:
        if not alive():
            return False
        now = time.time()
        for health in collectors:
            readings, transition = health.poll(now)
            if transition:
                sink.append(factory.point(transition, context=health.last_error, metadata=health.metadata(),
                                          collector=health.collector.name))
            for r in readings:
                sink.append(factory.sample(health.collector.name, r, health.metadata(), int(now * 1e9),
                                           primary=health.collector.backend != "cpu"))
        return True

    beat("boot", phase="start", sampled_from_outside=True)
    heartbeat.flush()
    next_beat = time.monotonic() + heartbeat_interval
    next_flush = time.monotonic() + 1.0
    try:
        if sample():
            sink.append(factory.point("start", context=f"sampling pid {pid} from outside"))
        while sample() and not (callable(stop_when) and stop_when()):
            sink.maybe_flush()
            mono = time.monotonic()
            if mono >= next_beat:
                next_beat = mono + heartbeat_interval
                beat("heartbeat")
            if mono >= next_flush:  # at least once a second, as the in-process writer does
                next_flush = mono + 1.0
                heartbeat.flush()
            time.sleep(interval_ms / 1000)
    except KeyboardInterrupt:
        pass  # Ctrl-C ends sampling; the session still closes cleanly
    sink.append(factory.point("stop", context=f"pid {pid} sampling ended"))
    sink.close(status)
    beat("stop", status=status)
    heartbeat.close()
    if manifest is not None:
        # a process that is not our child: its exit status cannot be seen (docs/run-outcome.md)
        manifest.status, manifest.ended_at_ns, manifest.outcome = status, time.time_ns(), "exited"
        write_run_manifest(run_dir, manifest)
    return status
