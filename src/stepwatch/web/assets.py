"""The page's files, all package data beside this module (``assets/``): the shell HTML, its
script and style, and the charting library, uPlot (https://github.com/leeoniya/uPlot, MIT
licence): its released ``dist/uPlot.iife.min.js`` and ``dist/uPlot.min.css`` of v1.6.32, unchanged,
with its licence text in ``assets/uPlot.LICENSE``. Nothing is fetched from a CDN."""

from __future__ import annotations

import html
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = ["ASSETS", "UPLOT_NOTICE", "UPLOT_VERSION", "asset_bytes", "asset_text", "shell_html", "uplot_licence"]

ASSETS = Path(__file__).resolve().parent / "assets"
UPLOT_VERSION = "1.6.32"
UPLOT_NOTICE = f"uPlot v{UPLOT_VERSION} (https://github.com/leeoniya/uPlot), MIT licence, (c) Leon Sorokin"


@lru_cache(maxsize=16)
def asset_text(name: str) -> str:
    return (ASSETS / name).read_text(encoding="utf-8")


@lru_cache(maxsize=16)
def asset_bytes(name: str, gzipped: bool = False) -> bytes:
    """The file's bytes, gzip-compressed once when ``gzipped`` (served as they are to every
    browser that accepts gzip)."""
    data = (ASSETS / name).read_bytes()
    if not gzipped:
        return data
    import gzip

    return gzip.compress(data, compresslevel=9, mtime=0)


def uplot_licence() -> str:
    """uPlot's licence text, as an HTML comment for the pages that carry the library."""
    return "<!-- " + UPLOT_NOTICE + "\n" + asset_text("uPlot.LICENSE").replace("--", "- -") + "-->"


def _script_json(value: Any) -> str:
    """JSON safe inside a <script> element (no ``</script>``, no ``<!--``)."""
    return json.dumps(value, separators=(",", ":")).replace("<", "\\u003c").replace(">", "\\u003e") \
        .replace("&", "\\u0026").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def shell_html(config: dict[str, Any], *, title: str, head: str, body_end: str = "") -> str:
    """The page: ``config`` as ``window.STEPWATCH``, ``head`` the style and script elements."""
    return (asset_text("page.html")
            .replace("{{title}}", html.escape(title))
            .replace("{{head}}", head)
            .replace("{{config}}", _script_json(config))
            .replace("{{body_end}}", body_end))
