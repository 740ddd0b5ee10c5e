"""The page's files: the shell HTML, its script and style (package data beside this module), and
Plotly's bundle from the installed ``plotly`` package (``plotly/package_data/plotly.min.js``, MIT
licence; its licence text ships in the package's dist-info). Nothing is fetched from a CDN."""

from __future__ import annotations

import html
import importlib.util
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..errors import StepwatchError

__all__ = ["ASSETS", "PlotlyMissing", "asset_text", "plotly_js", "plotly_js_gzip", "plotly_path", "shell_html"]

ASSETS = Path(__file__).resolve().parent / "assets"
PLOTLY_LICENCE = "plotly.js (MIT licence, (c) Plotly, Inc.), from the installed plotly package"


class PlotlyMissing(StepwatchError):
    """The ``plotly`` package (``pip install 'stepwatch[web]'``) is not installed."""


def plotly_path() -> Path:
    """Plotly's bundle in the installed ``plotly`` package."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or not spec.submodule_search_locations:
        raise PlotlyMissing("the dashboard's charts need the plotly package: pip install 'stepwatch[web]'")
    path = Path(next(iter(spec.submodule_search_locations))) / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise PlotlyMissing(f"{path}: plotly's bundle is missing from the installed plotly package")
    return path


@lru_cache(maxsize=1)
def plotly_js() -> bytes:
    return plotly_path().read_bytes()


@lru_cache(maxsize=1)
def plotly_js_gzip() -> bytes:
    """The bundle gzip-compressed once (1.5 MB): served as it is to every browser that accepts
    gzip, so no request compresses 4.8 MB again on the server's event loop."""
    import gzip

    return gzip.compress(plotly_js(), compresslevel=6, mtime=0)


@lru_cache(maxsize=8)
def asset_text(name: str) -> str:
    return (ASSETS / name).read_text(encoding="utf-8")


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
