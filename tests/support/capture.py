"""stepwatch started and stopped inside the test process, as the in-process capture tests do:
no signal handlers and no OOM hook taken from pytest, the spool read back at the end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import stepwatch
from stepwatch.artifacts.spool import LoadedSpool, read_spool


def start(run_dir: Path, **options: Any) -> Any:
    """``stepwatch.init`` writing to ``run_dir``; its runtime."""
    return stepwatch.init(out=run_dir, handle_signals=False, capture_oom=False, **options)


def finish(run_dir: Path) -> LoadedSpool:
    """``stepwatch.shutdown``, then the spool it sealed."""
    stepwatch.shutdown()
    return read_spool(run_dir)
