"""The dashboard and the report on a big run: 64 ranks x 20,000 steps (1.28M step rows, one memory
sample every 10 steps per rank) in a real ``history.sqlite``.

Usage::

    .venv/bin/python bench/bench_dashboard.py [--ranks R] [--steps N] [--repeat K] [--tmp-dir DIR]
                                              [--no-browser]

Measures, each on a fresh ``stepwatch ui`` process, best and median of ``K``:

  * ``run page data (built)``: ``GET /api/run/<session>`` on a cold server with an empty page cache
    (``STEPWATCH_CACHE_DIR``, views/page_cache.py): time to the first byte, time to the whole
    body, and the payload's size (targets: the page loads in < 2 s, its data < 2 MB);
  * ``run page data: server CPU time``: the CPU seconds the server spent on that request (user +
    system, all its threads): on a busy machine the wall time stretches, this much less;
  * ``run page data, cached``: the same request again on the same server (kept in memory);
  * ``run page data (kept on disk)``: a second cold server over the page cache the first wrote;
  * ``run page in Chromium``: from navigation to the first view (header, diagnosis, step-time
    chart: the app's ``data-first``) and to every chart drawn (``data-ready``), the charting
    library's load included, with the page's own timings of each part (Debian's chromium under
    Playwright; skipped without it); once on a cold server that builds the page, once on a cold
    server whose page cache holds it;
  * ``report``: ``stepwatch report``'s build time (in-process, ``write_report``, the page cache off)
    and the file's size (target < 5 MB).

The history is written once into ``--tmp-dir`` (default: a temporary directory) with the same
rows as bench/bench_verdicts.py (rank 17 a compute straggler), and reused when it is there.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO_ROOT, load_average, machine_header, print_header, print_table, write_results

SESSION = "5b0c8f4e-3a1d-4c2b-9e7f-0123456789ab"


def build_history(path: Path, ranks: int, steps: int) -> float:
    """Writes the history (bench_verdicts' rows); returns the seconds it took (0 when reused)."""
    if path.exists():
        return 0.0
    from bench_verdicts import worker_sqlite

    started = time.perf_counter()
    worker_sqlite([str(path), str(ranks), str(steps), "1"])
    return time.perf_counter() - started


def _start_ui(path: Path, cache: Path) -> tuple[subprocess.Popen[str], str]:
    """A cold ``stepwatch ui`` whose page cache is ``cache`` (emptied first when it is named ``*-empty``)."""
    if cache.name.endswith("-empty"):
        shutil.rmtree(cache, ignore_errors=True)
    proc = subprocess.Popen([sys.executable, "-m", "stepwatch", "ui", str(path), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT / "src"), "STEPWATCH_CACHE_DIR": str(cache)})
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"stepwatch ui did not start: {proc.communicate(timeout=10)[1]}")
    return proc, json.loads(line)["url"]


def _get(url: str) -> tuple[float, float, int]:
    """(seconds to the first byte, seconds to the whole body, body bytes) of one GET."""
    parsed = urlparse(url)
    connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=300)
    started = time.perf_counter()
    connection.request("GET", parsed.path)
    response = connection.getresponse()
    first = response.read(1)
    ttfb = time.perf_counter() - started
    body = first + response.read()
    total = time.perf_counter() - started
    if response.status != 200:
        raise SystemExit(f"GET {url}: {response.status} {body[:300]!r}")
    connection.close()
    return ttfb, total, len(body)


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    proc.communicate(timeout=30)


_TIMINGS_JS = """() => {
  const nav = performance.getEntriesByType("navigation")[0];
  const res = (part) => performance.getEntriesByType("resource").find((r) => r.name.includes(part));
  const mark = (name) => { const m = performance.getEntriesByName(name)[0]; return m ? m.startTime : null; };
  const library = res("uPlot.iife.min.js"), data = res("/api/run/");
  const plots = {};
  for (const m of performance.getEntriesByType("measure")) if (m.name.startsWith("sw:plot:")) plots[m.name.slice(8)] = m.duration;
  return { html: nav.responseEnd, library_fetched: library ? library.responseEnd : null,
    dom_content_loaded: nav.domContentLoadedEventEnd, data_fetched: data ? data.responseEnd : null,
    data_in_app: mark("sw:data"), first_view: mark("sw:first-view"), ready: mark("sw:ready"), plots: plots };
}"""


def _browser_load(history: Path, cache: Path) -> dict[str, Any] | None:
    """Seconds from navigation to the first view (header, diagnosis and the step-time chart
    drawn: ``body[data-first]``) and to every chart drawn (``body[data-ready]``), with the page's
    own timings (ms from navigation start): the HTML, the charting library, the data, each chart.
    The server is started once Chromium is up and the page is asked for at once: it has had no
    time to build the page before the browser asks (``stepwatch ui`` starts building its default
    session's page as it starts)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    chromium = Path("/usr/bin/chromium")
    if not chromium.exists():
        return None
    args = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(chromium), args=args)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        proc, url = _start_ui(history, cache)
        try:
            started = time.perf_counter()
            page.goto(f"{url}run/{SESSION}")
            # (a page from before the first view was marked: its first view is every chart drawn)
            page.wait_for_selector("body[data-first='1'], body[data-ready='1']", state="attached", timeout=300_000)
            first = time.perf_counter() - started
            page.wait_for_selector("body[data-ready='1']", state="attached", timeout=300_000)
            took = time.perf_counter() - started
            timings = page.evaluate(_TIMINGS_JS)
        finally:
            _stop(proc)
        browser.close()
    return {"first_view_s": first, "all_charts_s": took, "page_ms": timings}


def _stats(values: list[float]) -> dict[str, float]:
    return {"best": min(values), "median": statistics.median(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tmp-dir", type=Path, default=None)
    parser.add_argument("--no-browser", action="store_true")
    options = parser.parse_args()
    tmp = options.tmp_dir or Path(tempfile.mkdtemp(prefix="stepwatch-bench-dashboard-"))
    tmp.mkdir(parents=True, exist_ok=True)
    header = machine_header(tmp)
    print_header(f"dashboard: run page and report of {options.ranks} ranks x {options.steps:,} steps", header)
    history = tmp / f"history-{options.ranks}x{options.steps}.sqlite"
    built = build_history(history, options.ranks, options.steps)
    if built:
        print(f"history written in {built:.1f} s ({history.stat().st_size / 2**20:.0f} MiB)")
    import psutil

    cold_ttfb, cold_total, cold_cpu, warm_total, browser = [], [], [], [], []
    kept_total, kept_cpu, browser_kept = [], [], []
    payload = 0
    empty, filled = tmp / "page-cache-empty", tmp / "page-cache"
    for _ in range(options.repeat):
        shutil.rmtree(filled, ignore_errors=True)
        proc, url = _start_ui(history, filled)  # builds the page and keeps it in ``filled``
        try:
            server = psutil.Process(proc.pid)
            before = sum(server.cpu_times()[:2])
            ttfb, total, payload = _get(f"{url}api/run/{SESSION}")
            cold_cpu.append(sum(server.cpu_times()[:2]) - before)
            cold_ttfb.append(ttfb)
            cold_total.append(total)
            warm_total.append(_get(f"{url}api/run/{SESSION}")[1])
        finally:
            _stop(proc)
        proc, url = _start_ui(history, filled)  # a cold server: the page from the disk cache
        try:
            server = psutil.Process(proc.pid)
            before = sum(server.cpu_times()[:2])
            kept_total.append(_get(f"{url}api/run/{SESSION}")[1])
            kept_cpu.append(sum(server.cpu_times()[:2]) - before)
        finally:
            _stop(proc)
        if not options.no_browser:
            for cache, into, what in ((empty, browser, "built"), (filled, browser_kept, "kept on disk")):
                took = _browser_load(history, cache)
                if took is not None:
                    into.append(took)
                    print(f"browser ({what}; load {load_average()[0]:.1f}): {json.dumps(took)}", flush=True)
    sys.path.insert(0, str(REPO_ROOT / "src"))
    from stepwatch.web.report import write_report

    os.environ["STEPWATCH_CACHE_DIR"] = "off"  # the report's own build, not a page a server kept

    report_s, report_bytes = [], 0
    for i in range(options.repeat):
        target = tmp / f"report-{i}.html"
        started = time.perf_counter()
        write_report(history, target, SESSION)
        report_s.append(time.perf_counter() - started)
        report_bytes = target.stat().st_size
    rows = [
        ["run page data: first byte (cold, built)", f"{_stats(cold_ttfb)['best']:.2f} s",
         f"{_stats(cold_ttfb)['median']:.2f} s", ""],
        ["run page data: whole body (cold, built)", f"{_stats(cold_total)['best']:.2f} s",
         f"{_stats(cold_total)['median']:.2f} s", f"{payload / 1e6:.2f} MB"],
        ["run page data: server CPU time (cold, built)", f"{_stats(cold_cpu)['best']:.2f} s",
         f"{_stats(cold_cpu)['median']:.2f} s", ""],
        ["run page data (cached in memory)", f"{_stats(warm_total)['best']:.3f} s", f"{_stats(warm_total)['median']:.3f} s", ""],
        ["run page data: whole body (cold, kept on disk)", f"{_stats(kept_total)['best']:.3f} s",
         f"{_stats(kept_total)['median']:.3f} s", ""],
        ["run page data: server CPU time (cold, kept on disk)", f"{_stats(kept_cpu)['best']:.3f} s",
         f"{_stats(kept_cpu)['median']:.3f} s", ""],
    ]
    for runs, what in ((browser, "cold server, page built"), (browser_kept, "cold server, page kept on disk")):
        if not runs:
            continue
        for key, title in (("first_view_s", "run page in Chromium: first view"), ("all_charts_s", "run page in Chromium: every chart drawn")):
            values = [b[key] for b in runs]
            rows.append([f"{title} ({what})", f"{_stats(values)['best']:.2f} s", f"{_stats(values)['median']:.2f} s", ""])
    rows.append(["report build", f"{_stats(report_s)['best']:.2f} s", f"{_stats(report_s)['median']:.2f} s",
                 f"{report_bytes / 1e6:.2f} MB"])
    print_table(["measure", "best", "median", "size"], rows)
    print(f"load average after: {load_average()}")
    path = write_results("bench_dashboard", {
        "header": header, "ranks": options.ranks, "steps": options.steps, "repeat": options.repeat,
        "payload_bytes": payload, "cold_ttfb_s": cold_ttfb, "cold_total_s": cold_total, "cold_cpu_s": cold_cpu, "cached_s": warm_total,
        "kept_total_s": kept_total, "kept_cpu_s": kept_cpu, "browser_s": browser, "browser_kept_s": browser_kept,
        "report_s": report_s, "report_bytes": report_bytes})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
