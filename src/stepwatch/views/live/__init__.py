"""The live view's data: what every rank of a running job is doing now, the run's current primary
verdict and its latest alerts, as one pure ``LiveSnapshot``, and the rule that folds many ranks
down to the few worth a row (``fold_ranks``).

``LiveReader`` builds snapshots from the run directory's own files, the ones the ranks write
whatever else runs, so the same view works under ``stepwatch run``, for ``stepwatch top`` of a job
started elsewhere (``init``, ``track``, another terminal) and for a finished run. One module a
source, composed by ``reader``:

- ``ledger``: ``ledger/rank<R>-<pid>.steps`` (each rank's step ledger, a memory-mapped ring
  written on every step): the latest step, the last 100 steps' times and phase times, and the
  sampler's sign of life (``alive_ns``, every tick) and clean stop (``closed_ns``). Mapped
  read-only and read with numpy: a refresh costs the same at step 100 and step 10 million;
- ``heartbeats``: ``heartbeat_rank<N>.jsonl``, the ranks of a run captured before the ledger
  existed (or on a disk with no room for one);
- ``tails``: ``telemetry/rank<N>/segment-*.jsonl`` (the memory samples: device, else the
  process's RSS, for the current value and the peak) and ``alerts.jsonl`` (the watchdog's
  alerts), each followed from where the last refresh stopped;
- ``history``: ``history.sqlite`` (read-only, when there is one): the live verdicts the
  aggregator stored, and the ranks no local file describes (another node's; a ``serve --out``
  directory's);
- ``verdicts``: ``final_summary.json``, the diagnosis of a run that has ended; with neither it
  nor a history (``init``, ``track``), the verdict engine over the ledgers' last steps, every 10 s;
- ``plan``: ``spool/`` batch files, the ``stepwatch.plan`` and ``stepwatch.dataloader`` marks that
  make the run's total steps known (read only until it is known).

``model`` holds the snapshot and the folding rule, ``figures`` the one computation of a rank's
step time, rate and phase shares over a window of steps (the ledger's and the history's alike).
Nothing here writes, talks to the aggregator or imports torch; reading is fail-open: a file that
is missing, torn or damaged leaves its part of the snapshot empty, never an exception.
"""

from .model import FOLD_ABOVE, SHARE_NAMES, WINDOW, LiveSnapshot, RankLive, fold_ranks, named_ranks
from .reader import LiveReader

__all__ = ["FOLD_ABOVE", "SHARE_NAMES", "WINDOW", "LiveReader", "LiveSnapshot", "RankLive", "fold_ranks",
           "named_ranks"]
