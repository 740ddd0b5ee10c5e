"""The main job: a 2-rank demo training run under ``stepwatch run`` on the embedded SQLite
store, then the final summary, the diagnosis (``stepwatch explain``) and where to look."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    run_dir = Path("stepwatch_runs") / f"demo-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    stepwatch = [sys.executable, "-m", "stepwatch"]
    print(f"== training 2 ranks under stepwatch run\n   run directory {run_dir}", flush=True)
    # one thread per rank, as torchrun would choose, said here so it does not print its warning
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    code = subprocess.call([*stepwatch, "run", "--nproc-per-node", "2", "--interval", "250", "--report",
                            "--out", str(run_dir), str(HERE / "train_demo.py"), "--steps", "300"], env=env)
    if code != 0:
        print(f"demo training failed with exit code {code}", file=sys.stderr)
        return code
    print("\n== sessions", flush=True)
    subprocess.call([*stepwatch, "sessions", str(run_dir)])
    print("\n== diagnosis: why the steps take the time they do (stepwatch explain)", flush=True)
    subprocess.call([*stepwatch, "explain", str(run_dir)])
    # Every line below fits an 80-column terminal (the run directory's name is 29 characters).
    print(f"\nWhere to look: {run_dir}/")
    print("  final_summary.txt, .json   the summary above, its diagnosis first")
    print("  history.sqlite             every rank's rows (sqlite3 history.sqlite .tables)")
    print("  telemetry/rank*/, spool/, heartbeat_rank*.jsonl, run.json")
    print("                             the raw, crash-safe artifacts")
    print(f"  stepwatch inspect {run_dir}")
    print(f"  stepwatch explain {run_dir} --json")
    print(f"  stepwatch compare {run_dir} OTHER_RUN")
    print(f"  stepwatch query {run_dir} --slowest-steps 5")
    print(f"  stepwatch export perfetto {run_dir}")
    print("  (docs/explain.md, docs/compare.md, docs/query.md, docs/export.md)")
    print("\nSee it (docs/dashboard.md):")
    print("  the report, one file, opens in any browser:")
    print(f"    {run_dir / 'report.html'}")
    print("  the dashboard, then open http://127.0.0.1:8050/ :")
    print(f"    stepwatch ui {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
