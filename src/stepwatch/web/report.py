"""``stepwatch report``: one HTML file that opens anywhere (a mail attachment, a CI artifact) with
no server and no network: the run page's summary, diagnosis, charts, alerts, epochs and
environment, with every script, style and byte of data inside it.

The charting library, uPlot (51 KB, MIT licence: its licence text is in the page), is inlined as
it is; the data is gzip-compressed and base64-encoded into the page, which inflates it with the
browser's own ``DecompressionStream``: a 64-rank x 20,000-step run's report is about 0.5 MB
(bench/bench_dashboard.py), where the JSON alone would be 1.2 MB.
"""

from __future__ import annotations

import base64
import gzip
import json
from pathlib import Path
from typing import Any

from .assets import asset_text, shell_html, uplot_licence

__all__ = ["build_report", "write_report"]


def _packed(data: bytes, element_id: str) -> str:
    text = base64.b64encode(gzip.compress(data, compresslevel=9, mtime=0)).decode("ascii")
    return f'<script type="application/octet-stream" id="{element_id}">{text}</script>'


def build_report(run_dir: Path | str, session_id: str | None = None) -> str:
    """The report's HTML for ``run_dir`` (a run directory, a history store or a store URL) and ``session_id``
    (default: the run's own, else the newest)."""
    from ..errors import ArtifactError
    from ..views.page_cache import PageCache, cache_folder, page_key
    from ..views.run_page import run_page, step_spans
    from ..views.sources import Catalog, run_json_of

    catalog = Catalog(run_dir)
    try:
        chosen = session_id or catalog.default_session()
        if chosen is None:
            raise ArtifactError(run_dir, "holds no session to report on")
        located = catalog.locate(chosen)
        # the dashboard's page cache both ways: a page a dashboard kept is not built again, and
        # the page built here (run --report, at the run's end) is the next `stepwatch ui`'s
        cache = PageCache(None if located.is_url or catalog.imported(located) else cache_folder())
        with catalog.open(located) as store:
            located_dir = located.run_dir
            key = page_key(store, located.store, chosen, located_dir) if cache.folder is not None else None
            page = cache.get(located.store, chosen, key)
            if page is None:
                page = run_page(store, chosen, located_dir)
                cache.put(located.store, chosen, key, page)
            page["environment"] = run_json_of(located_dir, chosen) or None
            spans = step_spans(store, chosen, page["slowest_step"]) if page["slowest_step"] is not None else None
    finally:
        catalog.close()
    data = json.dumps({"run": page, "spans": spans}, separators=(",", ":"), default=str).encode()
    style = f"<style>{asset_text('uPlot.min.css')}\n{asset_text('app.css')}</style>"
    library = asset_text("uPlot.iife.min.js").replace("</script", "<\\/script")
    script = asset_text("app.js").replace("</script", "<\\/script")
    head = f"{style}{uplot_licence()}"
    body_end = _packed(data, "sw-data") + f"<script>{library}</script><script>{script}</script>"
    config: dict[str, Any] = {"mode": "report", "page": "run", "session": chosen}
    return shell_html(config, title=f"stepwatch report: {chosen}", head=head, body_end=body_end)


def write_report(run_dir: Path | str, out: Path | None = None, session_id: str | None = None) -> Path:
    """Writes the report (default ``<run_dir>/report.html``, ``./report.html`` for a store URL)
    and returns its path."""
    from ..artifacts._files import atomic_write_bytes

    if out is not None:
        target = out
    elif isinstance(run_dir, str):  # a store URL: no run directory
        target = Path.cwd() / "report.html"
    else:
        target = (run_dir if run_dir.is_dir() else run_dir.parent) / "report.html"
    atomic_write_bytes(target, build_report(run_dir, session_id).encode("utf-8"), fsync=False)
    return target
