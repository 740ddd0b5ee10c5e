"""The main job: a demo training run under stepwatch, then its summary and where to look."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    run_dir = Path("stepwatch_runs") / f"demo-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    stepwatch = [sys.executable, "-m", "stepwatch"]
    print(f"== training under stepwatch (run directory {run_dir})", flush=True)
    code = subprocess.call([*stepwatch, "track", "--interval", "200", "--out", str(run_dir), "--",
                            sys.executable, str(HERE / "train_demo.py"), "--steps", "300"])
    if code != 0:
        print(f"demo training failed with exit code {code}", file=sys.stderr)
        return code
    print("\n== sessions", flush=True)
    subprocess.call([*stepwatch, "sessions", str(run_dir)])
    print("\n== summary of the default session", flush=True)
    subprocess.call([*stepwatch, "inspect", str(run_dir)])
    print(f"\nWhere to look: {run_dir.resolve()}")
    print(f"  run.json, telemetry/rank0/ (manifest + segments), heartbeat_rank0.jsonl")
    print(f"  stepwatch validate {run_dir}    stepwatch inspect {run_dir} --json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
