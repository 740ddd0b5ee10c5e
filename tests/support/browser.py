"""Chromium under Playwright for the dashboard's tests: Debian's ``chromium`` package driven with
no browser download, and what a page did (console errors, requests) recorded for the asserts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

CHROMIUM = Path(os.environ.get("STEPWATCH_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
# the charts as drawn: each chart's series (name, type, points drawn, rows of a heatmap or a
# timeline), as the page's own window.stepwatchCharts() describes them
CHARTS_JS = "() => window.stepwatchCharts ? window.stepwatchCharts() : {}"


def require_chromium() -> Path:
    """The browser; where it is missing the test is skipped, unless STEPWATCH_REQUIRE_BROWSER=1
    (.ci/run sets it: there a missing browser fails the suite)."""
    if not CHROMIUM.exists():
        if os.environ.get("STEPWATCH_REQUIRE_BROWSER") == "1":
            pytest.fail(f"{CHROMIUM} is missing (apt-get install chromium)")
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)")
    pytest.importorskip("playwright.sync_api")
    return CHROMIUM


class PageLog:
    """Console errors, uncaught exceptions and every request URL of one page."""

    def __init__(self, page: Any) -> None:
        self.errors: list[str] = []
        self.requests: list[str] = []
        page.on("console", lambda m: self.errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        page.on("request", lambda r: self.requests.append(r.url))

    def off_machine(self) -> list[str]:
        """Requests that left this machine (anything but loopback, file:, data: and blob:)."""
        out = []
        for url in self.requests:
            parsed = urlparse(url)
            if parsed.scheme in ("file", "data", "blob", "about"):
                continue
            if parsed.hostname not in ("127.0.0.1", "localhost", "::1"):
                out.append(url)
        return out


def open_page(browser: Any, url: str, *, wait_ready: bool = True, timeout_ms: int = 60_000) -> tuple[Any, PageLog]:
    """A new page at ``url`` with its log, once the app says it has drawn (``body[data-ready]``)."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    log = PageLog(page)
    page.goto(url)
    if wait_ready:
        page.wait_for_selector("body[data-ready='1']", timeout=timeout_ms, state="attached")
    return page, log


def charts(page: Any) -> dict[str, list[dict[str, Any]]]:
    return page.evaluate(CHARTS_JS)
