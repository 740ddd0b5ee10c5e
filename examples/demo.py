"""The main job: a 2-rank demo training run under ``stepwatch run`` on the embedded SQLite
store, then the final summary, the diagnosis (``stepwatch explain``) and where to look."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    run_dir = Path("stepwatch_runs") / f"demo-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    stepwatch = [sys.executable, "-m", "stepwatch"]
    print(f"== training 2 ranks under stepwatch run (run directory {run_dir})", flush=True)
    code = subprocess.call([*stepwatch, "run", "--nproc-per-node", "2", "--interval", "250", "--report",
                            "--out", str(run_dir), str(HERE / "train_demo.py"), "--steps", "300"])
    if code != 0:
        print(f"demo training failed with exit code {code}", file=sys.stderr)
        return code
    print("\n== sessions", flush=True)
    subprocess.call([*stepwatch, "sessions", str(run_dir)])
    print("\n== diagnosis: why the steps take the time they do (stepwatch explain)", flush=True)
    subprocess.call([*stepwatch, "explain", str(run_dir)])
    print(f"\nWhere to look: {run_dir.resolve()}")
    print("  final_summary.txt / final_summary.json   the summary above, its diagnosis first")
    print("  history.sqlite                            every rank's rows (sqlite3 history.sqlite '.tables')")
    print("  telemetry/rank*/, spool/, heartbeat_rank*.jsonl, run.json   the raw, crash-safe artifacts")
    print(f"  stepwatch inspect {run_dir}      stepwatch validate {run_dir}")
    print(f"  stepwatch explain {run_dir} --json")
    print(f"  stepwatch compare {run_dir} OTHER_RUN")
    print("  (docs/explain.md, docs/compare.md)")
    print("\nSee it (docs/dashboard.md):")
    print(f"  report, one file: {(run_dir / 'report.html').resolve()}")
    print(f"  dashboard: stepwatch ui {run_dir}   then open http://127.0.0.1:8050/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
