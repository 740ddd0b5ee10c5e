"""Runtime options, validated before anything is installed."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from ..artifacts.sink import SinkConfig
from ..errors import ConfigError

__all__ = ["RUNTIME_SINK", "RuntimeConfig"]

# The runtime's sink writes from the background thread at most once a second and syncs at
# rollover and close: a killed process loses nothing written (the page cache survives it), and
# the sampler is never held up by an fsync every few records (bench/bench_capture_overhead.py).
# Its manifest's counts are rewritten every 10 s, not at each of those writes (a file written and
# renamed every second was a third of the sampler's idle work); segments and sessions at once.
RUNTIME_SINK = SinkConfig(flush_every_events=2000, flush_every_seconds=1.0, fsync="close", manifest_every_seconds=10.0)


class RuntimeConfig(msgspec.Struct, kw_only=True, frozen=True):
    """What ``stepwatch.init`` accepts.

    Example::

        RuntimeConfig(out="runs/exp1", interval=0.5)

    Attributes:
        out: the run directory (default ``./stepwatch_runs/<UTC time>-<short session id>/``; for
            the ranks of a multi-rank job, a name they all derive alike: the agent's start time
            and the shared session id, or the session id alone when only a job id is shared).
        interval: seconds between memory samples (sub-second allowed, >= 0.01).
        heartbeat_interval: seconds between liveness records in the heartbeat file.
        table_rows: bound of each in-memory table; the oldest rows are evicted past it, and
            counted (``*_rows_evicted`` in the stop record). Sized by bytes: a phase row takes
            ~215 B and a progress row ~360 B (one metric), so the default 16,384 keeps both
            tables full under ~10 MB (the runtime stays under 30 MB of RSS). The sampler drains
            them at least once a second, every 50 ms while one is a quarter full.
        oom_ring: how many recent records an OOM bundle keeps.
        handle_signals: close the session as completed on SIGTERM, then end as before.
        capture_oom: record OOM errors that end the program (``sys.excepthook`` chain).
        memory_history: record the CUDA allocator's history (``torch.cuda.memory``) from init,
            so memory snapshots taken on request hold each allocation's stack (docs/stacks.md);
            also ``STEPWATCH_MEMORY_HISTORY=1``.
    """

    out: str | None = None
    interval: float = 1.0
    heartbeat_interval: float = 5.0
    table_rows: int = 16_384
    oom_ring: int = 512
    handle_signals: bool = True
    capture_oom: bool = True
    session_id: str | None = None
    job_id: str | None = None
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    sink: SinkConfig = msgspec.field(default_factory=lambda: RUNTIME_SINK)
    auto_instrument: bool = True
    spool_interval: float = 2.0
    spool_max_bytes: int = 256 * 1024 * 1024
    endpoint: str | None = None
    api_key: str | None = None
    aggregator: str | None = None
    memory_history: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.interval, (int, float)) and 0.01 <= self.interval <= 3600):
            raise ConfigError(f"interval must be between 0.01 and 3600 seconds, got {self.interval!r}")
        if not (isinstance(self.heartbeat_interval, (int, float)) and 0.05 <= self.heartbeat_interval <= 3600):
            raise ConfigError(f"heartbeat_interval must be between 0.05 and 3600 s, got {self.heartbeat_interval!r}")
        if not isinstance(self.table_rows, int) or self.table_rows < 16:
            raise ConfigError(f"table_rows must be an integer >= 16, got {self.table_rows!r}")
        if not isinstance(self.oom_ring, int) or self.oom_ring < 1:
            raise ConfigError(f"oom_ring must be an integer >= 1, got {self.oom_ring!r}")
        if not (isinstance(self.spool_interval, (int, float)) and 0.05 <= self.spool_interval <= 3600):
            raise ConfigError(f"spool_interval must be between 0.05 and 3600 s, got {self.spool_interval!r}")
        if not isinstance(self.spool_max_bytes, int) or self.spool_max_bytes < 64 * 1024:
            raise ConfigError(f"spool_max_bytes must be an integer >= 65536, got {self.spool_max_bytes!r}")
        if self.endpoint is not None and not str(self.endpoint).startswith(("http://", "https://")):
            raise ConfigError(f"endpoint must be an http(s) URL, got {self.endpoint!r}")
        if self.out is not None and not isinstance(self.out, (str, os.PathLike)):
            raise ConfigError(f"out must be a path, got {type(self.out).__name__}")

    @classmethod
    def from_env(cls, env: dict[str, str] | os._Environ[str], **overrides: object) -> RuntimeConfig:
        """Options from the ``STEPWATCH_*`` env contract (set by ``stepwatch track``/``run``)."""
        values: dict[str, object] = {}
        if env.get("STEPWATCH_RUN_DIR"):
            values["out"] = env["STEPWATCH_RUN_DIR"]
        if env.get("STEPWATCH_SESSION_ID"):
            values["session_id"] = env["STEPWATCH_SESSION_ID"]
        if env.get("STEPWATCH_INTERVAL_MS"):
            try:
                values["interval"] = int(env["STEPWATCH_INTERVAL_MS"]) / 1000
            except ValueError:
                raise ConfigError(f"STEPWATCH_INTERVAL_MS={env['STEPWATCH_INTERVAL_MS']!r} is not an integer") from None
        if env.get("STEPWATCH_AGGREGATOR"):
            values["aggregator"] = env["STEPWATCH_AGGREGATOR"]
        if env.get("STEPWATCH_ENDPOINT"):
            values["endpoint"] = env["STEPWATCH_ENDPOINT"]
        if env.get("STEPWATCH_API_KEY"):
            values["api_key"] = env["STEPWATCH_API_KEY"]
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**values)  # type: ignore[arg-type]
        except TypeError as exc:
            raise ConfigError(str(exc)) from None

    def run_dir(self, session_id: str, started_ns: int | None) -> Path:
        """``out``, else ``stepwatch_runs/<UTC time of started_ns>-<session id[:8]>``, or
        ``stepwatch_runs/<session id[:8]>`` when no start time is shared by all ranks (None)."""
        if self.out is not None:
            return Path(self.out)
        if started_ns is None:
            return Path("stepwatch_runs") / session_id[:8]
        import time as _time

        stamp = _time.strftime("%Y%m%dT%H%M%SZ", _time.gmtime(started_ns / 1e9))
        return Path("stepwatch_runs") / f"{stamp}-{session_id[:8]}"
