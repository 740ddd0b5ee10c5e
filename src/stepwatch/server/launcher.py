"""``stepwatch run``: the aggregator as its own process, then the training ranks (through
torchrun for several), an env contract between them, signals forwarded, the final summary.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from ..artifacts.run_manifest import RunManifest, current_versions, write_run_manifest, write_run_manifest_in_place
from ..lifetime import LAUNCHER_PID_ENV, preexec_die_with_parent
from ..log import logger
from ..schema import SessionStatus, new_session_id, worst_status

__all__ = ["KILL_GRACE_S", "STALL_KILL_EXIT", "TORCHRUN_PORT", "JobView", "LaunchOptions", "launch", "master_port"]

AUTOSTART_DIR = Path(__file__).resolve().parent.parent / "capture" / "_autostart"
REMOTE_DRAIN_S = 60.0  # how long node 0 waits for other nodes' ranks after its own are done
# ``--on-stall kill``: ``run``'s exit code when the watchdog ended a stalled job (as timeout(1)
# says a command ran too long), and how long the job has between SIGTERM and SIGKILL
STALL_KILL_EXIT = 124
KILL_GRACE_S = 5.0
# the store URL the aggregator writes to (``--store``): in its environment, not on its command
# line, where a password in it would show in `ps` to every user of the machine
AGGREGATOR_STORE_ENV = "STEPWATCH_AGGREGATOR_STORE"
TORCHRUN_PORT = 29500  # torchrun's default rendezvous port: what every node of a multi-node job names


class LaunchOptions:
    def __init__(self, *, script: Sequence[str], nproc_per_node: int = 1, nnodes: int = 1, node_rank: int = 0,
                 master_addr: str = "127.0.0.1", master_port: int | None = None, use_torchrun: bool = False,
                 host: str = "127.0.0.1", port: int = 0, http_port: int | None = None, aggregator: str | None = None,
                 session_id: str | None = None, out: Path | None = None, interval_ms: int = 1000,
                 token_env: str | None = None, stall_after: float = 180.0, throughput_window: float = 10.0,
                 on_stall: str = "dump", on_nonfinite: str = "alert", ui_port: int | None = None,
                 metrics_port: int | None = None, alert_webhook: str | None = None,
                 otlp_endpoint: str | None = None, store: str | None = None, metrics_host: str | None = None,
                 ui_host: str | None = None) -> None:
        self.script = list(script)
        # a store URL the history goes to instead of the run directory's history.sqlite
        # (docs/clickhouse.md); the run directory keeps the artifacts and the summary files
        self.store = store
        # the watchdog (docs/watchdog.md): its thresholds go to the aggregator, the actions are ours
        self.stall_after = stall_after
        self.throughput_window = throughput_window
        self.on_stall = on_stall
        self.on_nonfinite = on_nonfinite
        self.nproc_per_node = nproc_per_node
        self.nnodes = nnodes
        self.node_rank = node_rank
        self.master_addr = master_addr
        self.master_port = master_port  # None: see ``master_port()``
        self.use_torchrun = use_torchrun or nproc_per_node > 1 or nnodes > 1
        self.host = host
        self.port = port
        self.http_port = http_port
        self.aggregator = aggregator
        self.session_id = session_id or new_session_id()
        self.out = out
        self.interval_ms = interval_ms
        self.token_env = token_env
        self.ui_port = ui_port  # the aggregator also serves the dashboard (docs/dashboard.md)
        # where the dashboard and /metrics bind (None: the aggregator's host, loopback without a token)
        self.ui_host = ui_host
        self.metrics_host = metrics_host
        # the aggregator's feeds (docs/metrics.md)
        self.metrics_port = metrics_port
        self.alert_webhook = alert_webhook
        self.otlp_endpoint = otlp_endpoint


def _start_aggregator(run_dir: Path, options: LaunchOptions) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    command = [sys.executable, "-m", "stepwatch.server", "--out", str(run_dir), "--host", options.host,
               "--port", str(options.port), "--launched", "--stall-after", repr(float(options.stall_after)),
               "--throughput-window", repr(float(options.throughput_window)), "--on-stall", options.on_stall,
               "--on-nonfinite", options.on_nonfinite]
    if options.http_port is not None:
        command += ["--http-port", str(options.http_port)]
    if options.token_env:
        command += ["--token-env", options.token_env]
    if options.ui_port is not None:
        command += ["--ui-port", str(options.ui_port)]
    if options.metrics_port is not None:
        command += ["--metrics-port", str(options.metrics_port)]
    for flag, value in (("--ui-host", options.ui_host), ("--metrics-host", options.metrics_host)):
        if value is not None:
            command += [flag, value]
    if options.alert_webhook:
        command += ["--alert-webhook", options.alert_webhook]
    if options.otlp_endpoint:
        command += ["--otlp-endpoint", options.otlp_endpoint]
    env = {k: v for k, v in os.environ.items() if k != AGGREGATOR_STORE_ENV}
    if options.store:
        env[AGGREGATOR_STORE_ENV] = options.store  # not --store: its password would show in `ps`
    # preexec_fn only calls prctl (libc loaded before the fork): nothing a thread could hold a lock for
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, start_new_session=True, env=env,
                               preexec_fn=preexec_die_with_parent())
    assert process.stdout is not None
    line = process.stdout.readline()  # the ready line (or EOF if it failed to start)
    if not line:
        process.wait(5)
        raise RuntimeError(f"the aggregator did not start (exit code {process.returncode})")
    return process, json.loads(line)


def master_port(options: LaunchOptions, env: Mapping[str, str]) -> int | None:
    """The port of torchrun's rendezvous: the user's (``--master-port``, else ``MASTER_PORT``);
    None where torchrun's own variables name one (``PET_MASTER_PORT``, ``PET_RDZV_ENDPOINT``: it
    reads them itself); ``TORCHRUN_PORT`` across nodes (every node must name the same, and
    torchrun's default is what they name); else, on a single node, a free port, as ``torchrun
    --standalone`` takes one: a second job on the machine must not find 29500 taken by the first.
    ConfigError for a ``MASTER_PORT`` that is not a port (before anything is started)."""
    from ..errors import ConfigError

    if options.master_port is not None:
        return options.master_port
    named = env.get("MASTER_PORT", "").strip()
    if named:
        if not named.isdigit() or not 0 < int(named) < 65536:
            raise ConfigError(f"MASTER_PORT={named!r} is not a port (1-65535); unset it or give --master-port")
        return int(named)
    if env.get("PET_MASTER_PORT") or env.get("PET_RDZV_ENDPOINT"):
        return None
    if options.nnodes > 1:
        return TORCHRUN_PORT
    return _free_port(options.master_addr)


def _free_port(address: str) -> int:
    """A port nothing listens on, on ``address`` (any local address if it cannot be bound)."""
    with socket.socket() as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            probe.bind(("", 0))
        return int(probe.getsockname()[1])


def _training_command(options: LaunchOptions, port: int | None) -> list[str]:
    if not options.use_torchrun:
        return [sys.executable, *options.script]
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={options.nproc_per_node}",
        f"--nnodes={options.nnodes}", f"--node-rank={options.node_rank}", f"--master-addr={options.master_addr}",
        *([f"--master-port={port}"] if port is not None else []), *options.script,
    ]


def _start_job(command: list[str], env: dict[str, str], stdout: int | None = None,
               stderr: int | None = None) -> subprocess.Popen[bytes]:
    """The training (python or torchrun, and the ranks under it) in a process group of its own,
    with SIGTERM from the kernel should the launcher die (``kill -9``, a closed terminal): the
    job never outlives ``stepwatch run``. Ranks ask the same of torchrun (``Runtime``).
    ``stdout``/``stderr``: file descriptors for its output (a live view's terminal); None: ours."""
    return subprocess.Popen(command, env=env, start_new_session=True, stdout=stdout, stderr=stderr,
                            preexec_fn=preexec_die_with_parent())


class JobView(Protocol):
    """What ``launch`` asks of a view of the running job (the live terminal view, ui/live/run_view.py):
    ``begin`` once the run directory and the aggregator exist; ``streams``, the file descriptors
    the job's stdout and stderr go to (None: inherited); ``job_started`` once the job runs;
    ``end`` once it has ended, before the summary is built. The view runs on threads of its own
    and reads only the run directory's files: nothing here waits for it, and nothing it does
    reaches the aggregator or the ranks."""

    def begin(self, run_dir: Path, session_id: str) -> None: ...

    def streams(self) -> tuple[int | None, int | None]: ...

    def job_started(self) -> None: ...

    def end(self) -> None: ...


def _signal_forwarder(training: subprocess.Popen[bytes], hangup: list[int], forwarded: list[int]) -> Any:
    """Ctrl-C reaches the launcher only (the job has its own process group): SIGINT goes to the
    job's whole group, as the terminal would have sent it; SIGTERM to its leader (torchrun stops
    its ranks); SIGHUP, the terminal closing, stops the job with SIGTERM and is noted in run.json."""
    def forward(signum: int, _frame: object) -> None:
        forwarded.append(signum)
        if training.poll() is not None:
            return
        if signum == signal.SIGHUP:
            hangup.append(signum)
            signum = signal.SIGTERM
        try:
            if signum == signal.SIGINT:
                os.killpg(training.pid, signum)
            else:
                training.send_signal(signum)
        except ProcessLookupError:
            pass

    return forward


class AggregatorEvents:
    """Follows the aggregator's stdout after its ready line, on a thread of its own: each live
    event line (``{"event": "verdict" | "alert", "line": ..., ...}``) is handed to ``handle`` as
    it comes (``run`` prints it, and acts on an alert); the last line, ``stopped``, carries the
    aggregator's counters, which reach us even when the disk is too full for
    aggregator_stats.json."""

    def __init__(self, process: subprocess.Popen[str], handle: Callable[[dict[str, Any]], None]) -> None:
        self.stats: dict[str, Any] = {}
        self._process = process
        self._handle = handle
        self._thread = threading.Thread(target=self._follow, name="stepwatch-aggregator-events", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        if self._process.stdout is None:
            return
        try:
            for line in self._process.stdout:
                try:
                    message = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(message, dict):
                    continue
                if message.get("event") == "stopped" and isinstance(message.get("stats"), dict):
                    self.stats = message["stats"]
                    continue
                try:
                    self._handle(message)
                except Exception as exc:  # noqa: BLE001 - a live line must never end the run
                    logger.warning("could not act on the aggregator's %r line: %s", message.get("event"), exc)
        except (OSError, ValueError):
            pass

    def join(self, timeout: float = 10.0) -> dict[str, Any]:
        """The counters, once the aggregator has exited (its stdout closed)."""
        self._thread.join(timeout)
        return self.stats


def _echo_event(echo: Any, actions: JobActions | None = None) -> Callable[[dict[str, Any]], None]:
    """Prints each live event's ``line`` (a verdict change, an alert) as the run goes, and hands
    alerts to ``actions`` (``--on-stall kill``, ``--on-nonfinite halt``)."""
    def handle(message: dict[str, Any]) -> None:
        if isinstance(message.get("line"), str):
            echo(message["line"])
        if actions is not None and message.get("event") == "alert" and isinstance(message.get("alert"), dict):
            actions.on_alert(message["alert"])

    return handle


class JobActions:
    """What ``run`` does about an alert (docs/watchdog.md): ``--on-stall kill`` ends the job
    (SIGTERM to the training and every process under it, SIGKILL to those left after
    ``KILL_GRACE_S``; ``run`` then exits ``STALL_KILL_EXIT``); ``--on-nonfinite halt`` asks every
    rank to stop at the same step boundary (the controls' coherent halt). Once each."""

    def __init__(self, run_dir: Path, on_stall: str, on_nonfinite: str, echo: Any) -> None:
        self.run_dir = run_dir
        self.on_stall = on_stall
        self.on_nonfinite = on_nonfinite
        self.echo = echo
        self.training: subprocess.Popen[bytes] | None = None
        self.killed_for: dict[str, Any] | None = None
        self.halted_for: dict[str, Any] | None = None
        self.killed_at_ns: int | None = None
        self._lock = threading.Lock()
        self._killer: threading.Thread | None = None

    def on_alert(self, alert: dict[str, Any]) -> None:
        with self._lock:
            if alert.get("kind") == "STALL" and self.on_stall == "kill" and self.killed_for is None:
                self.killed_for = alert
            elif alert.get("kind") == "NONFINITE" and self.on_nonfinite == "halt" and self.halted_for is None:
                self.halted_for = alert
            else:
                return
        if alert.get("kind") == "STALL":
            self.echo(f"[stepwatch] --on-stall kill: ending the job (SIGTERM, then SIGKILL after {KILL_GRACE_S:g} s)")
            self._killer = threading.Thread(target=self._end_job, name="stepwatch-stall-kill", daemon=True)
            self._killer.start()
        else:
            self._halt(alert)

    def _halt(self, alert: dict[str, Any]) -> None:
        from .watchdog import halt_on_nonfinite

        self.echo(halt_on_nonfinite(self.run_dir, alert.get("message"), by="stepwatch run"))

    def _end_job(self) -> None:
        import psutil

        training = self.training
        if training is None or training.poll() is not None:
            return
        self.killed_at_ns = time.time_ns()
        try:
            leader = psutil.Process(training.pid)
            processes = [leader, *leader.children(recursive=True)]  # torchrun's ranks have sessions of their own
        except psutil.NoSuchProcess:
            return
        for process in processes:
            try:
                process.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(processes, timeout=KILL_GRACE_S)
        for process in alive:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass

    def fold(self, manifest: RunManifest) -> None:
        """The run's outcome says why it ended: ``killed`` by the watchdog, with the stall, or
        ``halted`` on a non-finite value (the ranks' end records say they halted)."""
        if self.halted_for is not None and manifest.outcome == "succeeded":
            from ..artifacts.run_outcome import read_rank_ends

            ends, _ = read_rank_ends(self.run_dir, manifest.session_id)
            halts = [end.get("halt") for end in ends.values() if end.get("outcome") == "halted"]
            if halts:
                manifest.outcome = "halted"
                manifest.error = halts[0] if isinstance(halts[0], dict) else None
                manifest.extra["halted_by"] = {"alert": self.halted_for.get("kind"),
                                               "message": self.halted_for.get("message")}
        if self._killer is not None:
            self._killer.join(KILL_GRACE_S + 1)
        alert = self.killed_for
        if alert is None or self.killed_at_ns is None:
            return
        ranks = alert.get("ranks") or []
        error = {"kind": "watchdog", "type": "STALL", "rank": ranks[0] if len(ranks) == 1 else None,
                 "message": f"stepwatch ended the job (--on-stall kill): {alert.get('message')}",
                 "traceback": None, "fatal": True, "seen_by": "watchdog",
                 "at_ns": self.killed_at_ns or int(float(alert.get("ts") or 0) * 1e9),
                 "stacks": (alert.get("evidence") or {}).get("stacks") or []}
        manifest.outcome = "killed"
        manifest.error = error
        manifest.errors = [*(manifest.errors or []), error]
        manifest.extra["ended_by"] = "watchdog_stall"


def _write_manifest_or_say(run_dir: Path, manifest: RunManifest, echo: Any) -> None:
    """run.json's final state; a full disk is said, not raised (the run's outcome stands)."""
    error = write_run_manifest_in_place(run_dir, manifest)
    if error is not None:
        echo(f"[stepwatch] could not update {run_dir / 'run.json'}: {error.strerror or error}")


def _report_disk_losses(run_dir: Path, stats: dict[str, Any], summary: dict[str, Any] | None, echo: Any) -> None:
    """A full disk is one line: what the history lost (counted), and whether the final summary
    could be written; the summary, printed after, carries the same counts."""
    from ..analysis.summary import STORE_COUNTERS

    lost = int(stats.get("rows_lost") or 0)
    if summary is not None and stats:
        aggregator = summary.setdefault("aggregator", {})
        for key in ("rows_written", "rows_lost", "write_errors", "disk_full_errors", "frames_accepted",
                    *STORE_COUNTERS):
            if key in stats:
                aggregator.setdefault(key, stats[key])
    if stats.get("store_spill_pending_rows"):  # --store: the server did not take them before the end
        echo(f"[stepwatch] {stats['store_spill_pending_rows']} rows wait in {stats.get('store_spill_path')} for the "
             f"history store (it was down or slow at the end): `stepwatch serve --out {run_dir} --store URL` "
             f"replays them, or `stepwatch import {run_dir} --into URL` adds the ranks' own rows")
    unwritten = summary.get("unwritten") if summary is not None else None
    if not stats.get("write_errors") and not unwritten:
        return
    full = stats.get("disk_full_errors") or (unwritten and "space" in unwritten)
    cause = f"the disk of {run_dir} is full" if full else f"writes into {run_dir} failed"
    parts = []
    if stats.get("write_errors"):
        parts.append(f"{lost} of {stats.get('rows_accepted', 0)} rows did not reach history.sqlite "
                     f"({stats['write_errors']} failed writes)")
    if unwritten:
        parts.append("final_summary.json/.txt could not be written (the summary is printed below)")
    echo(f"[stepwatch] {cause}: " + "; ".join(parts)
         + "; the ranks' own files keep what fit")


def _close_rank_sessions(run_dir: Path, session_id: str) -> SessionStatus:
    """Recovers any rank session a killed process left running; returns the run's status
    (the worst of this session's ranks: a reused run directory holds earlier sessions too)."""
    from ..artifacts.sink import TelemetrySink

    statuses: list[str] = []
    for sink_dir in sorted((run_dir / "telemetry").glob("rank*")):
        try:
            ledger = TelemetrySink(sink_dir).ledger  # opening recovers: running -> interrupted
        except OSError:  # a full disk cannot take the recovered manifest: this rank's is unknown
            statuses.append("incomplete")
            continue
        mine = [entry.status for entry in ledger if entry.session_id == session_id]
        if mine:
            statuses.append(mine[-1])
    if not statuses:
        return "incomplete"
    return worst_status(statuses)  # type: ignore[return-value]


def launch(options: LaunchOptions, *, echo: Any = print,
           view: JobView | None = None) -> tuple[int, Path, dict[str, Any] | None]:
    """Runs the whole job; returns (training exit code, run dir, summary or None). ``view``
    shows the job while it trains (``JobView``)."""
    rendezvous = master_port(options, os.environ) if options.use_torchrun else None
    run_dir = options.out or Path("stepwatch_runs") / f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{options.session_id[:8]}"
    run_dir.mkdir(parents=True, exist_ok=True)
    manifest = RunManifest(session_id=options.session_id, started_at_ns=time.time_ns(), command_line=options.script,
                           launcher="run", world_size=options.nproc_per_node * options.nnodes,
                           versions=current_versions(), extra={"nnodes": options.nnodes, "node_rank": options.node_rank,
                                                               **({"master_port": rendezvous} if rendezvous is not None else {})})
    if options.store:  # where the history is (without the password), for whoever reads the run later
        from ..store.clickhouse_url import parse_clickhouse_url

        manifest.extra["store"] = str(parse_clickhouse_url(options.store))
    write_run_manifest(run_dir, manifest)
    aggregator_process = None
    events: AggregatorEvents | None = None
    actions = JobActions(run_dir, options.on_stall, options.on_nonfinite, echo)
    address = options.aggregator
    local_history = address is None  # this node keeps the history (else the remote aggregator does)
    if address is None:
        try:
            aggregator_process, ready = _start_aggregator(run_dir, options)
        except (RuntimeError, OSError, ValueError) as exc:
            # fail open: the training runs anyway; the history is built from its artifacts after
            echo(f"[stepwatch] {exc}; training runs without it and history.sqlite is built from the "
                 "local artifacts at the end")
        else:
            host, _, port = ready["tcp"].rpartition(":")
            address = f"{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
            echo(f"[stepwatch] aggregator on {ready['tcp']}" + (f", HTTP on {ready['http']}" if ready.get("http") else ""))
            if ready.get("ui"):
                echo(f"[stepwatch] dashboard: {ready['ui']}run/{options.session_id}")
            events = AggregatorEvents(aggregator_process, _echo_event(echo, actions))
    env = dict(os.environ)
    env.update(
        STEPWATCH_AUTOSTART="1", STEPWATCH_RUN_DIR=str(run_dir.resolve()), STEPWATCH_SESSION_ID=options.session_id,
        STEPWATCH_LAUNCHER="run", STEPWATCH_INTERVAL_MS=str(options.interval_ms),
        PYTHONPATH=os.pathsep.join(p for p in (str(AUTOSTART_DIR), env.get("PYTHONPATH")) if p),
    )
    if address is not None:
        env["STEPWATCH_AGGREGATOR"] = address
    if not options.use_torchrun:
        env.update(STEPWATCH_RANK="0", STEPWATCH_LOCAL_RANK="0", STEPWATCH_WORLD_SIZE="1")
    env[LAUNCHER_PID_ENV] = str(os.getpid())
    try:
        if view is not None:
            view.begin(run_dir, options.session_id)
        stdout, stderr = view.streams() if view is not None else (None, None)
        training = _start_job(_training_command(options, rendezvous), env, stdout, stderr)
        if view is not None:
            view.job_started()
        actions.training = training
        hangup: list[int] = []
        forwarded: list[int] = []  # the signals this launcher was sent and passed on: the run's outcome
        forward = _signal_forwarder(training, hangup, forwarded)
        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            returncode = training.wait()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
    finally:
        if view is not None:
            view.end()  # the terminal back as it was, whatever happened
    code = 128 - returncode if returncode < 0 else returncode
    if actions.killed_at_ns is not None:
        code = STALL_KILL_EXIT  # the watchdog ended it: a scheduler may restart it
    manifest.extra["training_ended_ns"] = time.time_ns()  # the summary's bound on a killed rank's unrecorded tail
    if local_history and aggregator_process is None:
        _rebuild_history(run_dir, echo, options.store)
    if aggregator_process is not None and options.nnodes > 1 and aggregator_process.poll() is None:
        _wait_for_remote_ranks(run_dir, options.session_id, options.nproc_per_node * options.nnodes, echo,
                               store=options.store)
    aggregator_stats: dict[str, Any] = {}
    if aggregator_process is not None and events is not None:
        died = aggregator_process.poll()  # before our SIGTERM: did it die during the run?
        aggregator_process.send_signal(signal.SIGTERM)
        try:
            aggregator_process.wait(60)
        except subprocess.TimeoutExpired:
            aggregator_process.kill()
            aggregator_process.wait()
        aggregator_stats = events.join()
        if died is not None:
            echo(f"[stepwatch] the aggregator died during the run (exit code {died}); "
                 "rebuilding history.sqlite from the local artifacts")
            _rebuild_history(run_dir, echo, options.store)
    if local_history:
        _fill_from_ledgers(run_dir, options.session_id, echo, options.store)
    status = _close_rank_sessions(run_dir, options.session_id)
    manifest.status, manifest.exit_code, manifest.ended_at_ns = status, code, time.time_ns()
    if hangup:  # the terminal closed: the job was stopped, whatever the ranks' SIGTERM handler said
        manifest.extra["ended_by"] = "launcher_hangup"
        status = manifest.status = "interrupted" if status == "completed" else status
    fold_outcome(run_dir, manifest, returncode, forwarded, torchrun=options.use_torchrun, echo=echo)
    actions.fold(manifest)
    _write_manifest_or_say(run_dir, manifest, echo)
    summary = None
    if local_history:
        summary = write_final_summary(run_dir, options.session_id, status, manifest.ended_at_ns,
                                      options.nproc_per_node * options.nnodes, options.script, lenient=True,
                                      store=options.store, across_nodes=options.nnodes > 1)
        _note_processes(run_dir, manifest, summary)
    _report_disk_losses(run_dir, aggregator_stats, summary, echo)
    return code, run_dir, summary


def fold_outcome(run_dir: Path, manifest: RunManifest, returncode: int, forwarded: list[int], *, torchrun: bool,
                 echo: Any = print) -> None:
    """Sets the manifest's ``outcome``, ``error`` and ``errors`` (docs/run-outcome.md)."""
    from ..artifacts.run_outcome import fold_run_outcome

    for problem in fold_run_outcome(run_dir, manifest, returncode, forwarded, single_process=not torchrun):
        echo(f"[stepwatch] {problem}")


def _note_processes(run_dir: Path, manifest: RunManifest, summary: dict[str, Any]) -> None:
    """run.json names the world the ranks reported (a script that starts its own ranks with
    ``torch.multiprocessing.spawn`` is one process to the launcher) and the workers, if any."""
    world, workers = summary.get("world_size"), summary.get("workers") or []
    if (isinstance(world, int) and world != manifest.world_size) or workers:
        manifest.world_size = world if isinstance(world, int) else manifest.world_size
        manifest.extra = {**(manifest.extra or {}), "ranks": summary.get("ranks"), "workers": workers}
        write_run_manifest(run_dir, manifest)


def _fill_from_ledgers(run_dir: Path, session_id: str, echo: Any, store_url: str | None = None) -> None:
    """Steps a killed rank closed after its last send are in its step ledger only: into the
    history with them, before the summary is built (the aggregator has stopped: one writer)."""
    import sqlite3

    from ..errors import StepwatchError
    from ..store import open_store
    from ..store.importers import import_ledgers

    try:
        store = open_store(store_url or run_dir / "history.sqlite")
        try:
            added = import_ledgers(run_dir, session_id, store)
        finally:
            store.close()
    except (StepwatchError, OSError, sqlite3.Error) as exc:
        echo(f"[stepwatch] could not add the step ledgers' steps to the history: {exc}")
        return
    if added:
        echo(f"[stepwatch] {added} steps recorded only in the ranks' step ledgers (a rank ended before sending "
             "them) were added to the history")


def _wait_for_remote_ranks(run_dir: Path, session_id: str, world_size: int, echo: Any,
                           timeout_s: float = REMOTE_DRAIN_S, store: str | None = None) -> None:
    """This node's ranks are done, but other nodes' may still be sending: keep the aggregator up
    until every rank's ``stop`` record is in the history, or ``timeout_s`` has passed."""
    import sqlite3

    history = run_dir / "history.sqlite"
    deadline = time.monotonic() + timeout_s
    stopped = 0
    while time.monotonic() < deadline:
        if store is not None:
            stopped = _stopped_ranks(store, session_id)
            if stopped >= world_size:
                return
            time.sleep(0.25)
            continue
        try:
            db = sqlite3.connect(f"{history.resolve().as_uri()}?mode=ro", uri=True)
            try:
                (stopped,), = db.execute(
                    "SELECT COUNT(DISTINCT rank) FROM telemetry WHERE session_id = ? AND event_type = 'stop'",
                    (session_id,)).fetchall()
            finally:
                db.close()
        except sqlite3.Error:
            pass  # not created yet, or busy: ask again
        if stopped >= world_size:
            return
        time.sleep(0.25)
    echo(f"[stepwatch] {stopped} of {world_size} ranks reported their end within {timeout_s:.0f} s; "
         "the others' local artifacts hold the rest")


def _stopped_ranks(store_url: str, session_id: str) -> int:
    """How many ranks of the session have a ``stop`` record in the store a URL names (0 when it
    cannot be read now: asked again)."""
    from ..errors import StepwatchError
    from ..store import open_store

    try:
        store = open_store(store_url, read_only=True)
    except StepwatchError:
        return 0
    try:
        rows = store.query("SELECT COUNT(DISTINCT rank) AS n FROM telemetry WHERE session_id = ? "
                           "AND event_type = 'stop'", (session_id,))
        return int(rows[0]["n"]) if rows else 0
    except StepwatchError:
        return 0
    finally:
        store.close()


def _rebuild_history(run_dir: Path, echo: Any, store_url: str | None = None) -> None:
    """The history a dead aggregator left holds only what arrived before it died; the ranks'
    local artifacts hold everything. Import them into a new history.sqlite, keeping the partial
    one beside it as history.partial.sqlite; into a store a URL names, import them as they are
    (the store keeps each row once)."""
    import sqlite3

    from ..errors import StepwatchError
    from ..store.importers import import_path
    from ..store.sqlite import SqliteStore

    if store_url is not None:
        from ..store import open_store

        try:
            store = open_store(store_url)
            try:
                import_path(run_dir, store)
            finally:
                store.close()
        except (StepwatchError, OSError) as exc:
            echo(f"[stepwatch] could not import the local artifacts into {store_url}: {exc}")
        return

    history = run_dir / "history.sqlite"
    partial = run_dir / "history.partial.sqlite"
    try:
        if history.exists():
            db = sqlite3.connect(history)  # the last connection's clean close folds the WAL into the file
            db.execute("PRAGMA user_version").fetchall()
            db.close()
            for suffix in ("", "-wal", "-shm"):
                if Path(f"{history}{suffix}").exists():
                    os.replace(f"{history}{suffix}", f"{partial}{suffix}")
        with SqliteStore(history) as store:
            import_path(run_dir, store)
    except (StepwatchError, OSError, sqlite3.Error) as exc:
        echo(f"[stepwatch] could not rebuild the history from the local artifacts: {exc}")


def write_final_summary(run_dir: Path, session_id: str | None, status: str | None, ended_at_ns: int | None,
                        world_size: int | None, command_line: list[str] | None, *,
                        lenient: bool = False, policy: Any = None, store: str | None = None,
                        across_nodes: bool = False) -> dict[str, Any]:
    """Writes final_summary.json and final_summary.txt from the run's history store.

    ``across_nodes``: one node of a multi-node job, whose session the other nodes' ranks share
    (in the hub's history, or a store every node writes): the session's status is the worst of
    this node's and the one stored, which the aggregators and the other nodes' launchers left.

    A full disk does not lose the summary: it is built all the same (the status given here
    overrides the stored one, which the full disk may have kept from being updated) and
    returned with ``unwritten`` naming what could not be written, for ``launch`` to say. Without
    ``lenient`` the error is raised (``stepwatch summary --write``)."""
    from ..analysis.summary import build_summary, render_summary_text
    from ..errors import StoreError
    from ..store import open_store

    def summarise(history: Any) -> dict[str, Any]:
        nonlocal status
        if session_id is not None and status is not None:
            if across_nodes:
                status = _worst_with_stored(history, session_id, status)
            session = {"session_id": session_id, "status": status, "started_at_ns": None,
                       "ended_at_ns": ended_at_ns, "host": None, "world_size": world_size,
                       "source": None, "command_line": command_line}
            try:
                history.upsert_session(session)
            except StoreError:
                if not lenient:
                    raise
        return build_summary(history, session_id, run_dir, policy=policy)  # policy: of the verdicts

    try:
        opened = open_store(store or run_dir / "history.sqlite")
    except StoreError as exc:
        if not (lenient and store):
            raise
        # the store a URL names cannot be reached now: the summary from the run's own artifacts
        import tempfile

        from ..store.importers import import_path
        from ..store.sqlite import SqliteStore

        logger.warning("final summary: %s; built from the run directory's artifacts instead", exc)
        with tempfile.TemporaryDirectory(prefix="stepwatch-summary-") as tmp, \
                SqliteStore(Path(tmp) / "history.sqlite") as local:
            import_path(run_dir, local)
            summary = summarise(local)
    else:
        with contextlib.closing(opened) as history:
            summary = summarise(history)
    if status is not None and summary.get("session_id") == session_id:
        summary["status"] = status
        summary["ended_at_ns"] = summary.get("ended_at_ns") or ended_at_ns
    try:
        _write_summary_files(run_dir, summary, render_summary_text(summary))
    except OSError as exc:
        if not lenient:
            raise
        summary["unwritten"] = f"final_summary.json/.txt: {exc.strerror or exc}"  # launch() says it
    return summary


def _worst_with_stored(history: Any, session_id: str, status: str) -> str:
    """The worse of ``status`` and the session's stored one (a stored ``running`` or none: this
    node's)."""
    from ..errors import StoreError

    try:
        rows = history.query("SELECT status FROM sessions WHERE session_id = ?", (session_id,))
    except StoreError:
        return status
    stored = rows[0]["status"] if rows else None
    if stored is None or stored == "running":
        return status
    return worst_status((status, str(stored)))


def _write_summary_files(run_dir: Path, summary: dict[str, Any], text: str) -> None:
    """Both files whole or neither half-written: each goes through a temporary file."""
    from ..artifacts._files import atomic_write_bytes

    atomic_write_bytes(run_dir / "final_summary.json", (json.dumps(summary, indent=2) + "\n").encode())
    atomic_write_bytes(run_dir / "final_summary.txt", text.encode())
