"""The dashboard's HTTP server: an aiohttp app over a ``views.Catalog``, read-only.

Pages: ``/`` (the runs), ``/run/<session id>`` (one run), ``/compare?a=<id>&b=<id>``; their data
under ``/api/``; the script, style and Plotly's bundle under ``/static/``. Every read of a store
runs on the app's own two threads, so a slow page never holds the event loop. With the
aggregator (``--ui-port``) the app runs in a process of its own (``web/process.py``), so it
never shares the writer's GIL or heap either (SQLite in WAL mode lets readers and the writer go
on together).

Security: with no token only loopback clients are answered, and ``serve_ui`` refuses to bind
anything but loopback without one. A token is compared in constant time (``hmac.compare_digest``)
from an ``Authorization: Bearer`` header, a ``stepwatch_token`` cookie, or once from
``?token=`` (which sets the cookie). A session id in a URL is checked as the ingestion path
checks ids (``schema.limits.id_problem``) before it reaches a query, and every query binds its
values as parameters. Errors come back as one JSON line, never a traceback.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import os
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import StepwatchError
from ..views.sources import Catalog, NoSuchSession, check_session_id
from .assets import PLOTLY_LICENCE, PlotlyMissing, asset_text, plotly_js, plotly_js_gzip, shell_html

__all__ = ["Dashboard", "is_loopback", "serve_ui"]

POLL_MS = 1000  # how often a live run's page asks for what is new
_COOKIE = "stepwatch_token"
_CACHE = 16  # run pages kept (keyed by the store's size and time: a finished run is read once)
# A running run's store changes at every write, so its page would be built again for each reload
# (4-5 s of CPU at 64 ranks while it ingests): the page built last is served again while younger
# than this many times its build time (2 s at least), so a page open during a burst costs the
# machine at most about a fifth of a core.
_LIVE_REUSE_FACTOR, _LIVE_REUSE_MIN_S = 4.0, 2.0


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind address) reaches only this machine."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Dashboard:
    """Example::

        app = Dashboard(Catalog(run_dir)).build()
        web.run_app(app, host="127.0.0.1", port=8050)
    """

    def __init__(self, catalog: Catalog, *, token: str | None = None, poll_ms: int = POLL_MS) -> None:
        self.catalog = catalog
        self.token = token
        self.poll_ms = poll_ms
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="stepwatch-ui")
        self._pages: OrderedDict[tuple[Any, ...], dict[str, Any]] = OrderedDict()
        self._live_pages: dict[str, tuple[float, float, dict[str, Any]]] = {}  # session -> (built at, took, page)
        self.requests = 0

    def build(self) -> Any:
        from aiohttp import web

        app = web.Application(middlewares=[self._guard])
        app.router.add_get("/", self._page_runs)
        app.router.add_get("/run/{session}", self._page_run)
        app.router.add_get("/compare", self._page_compare)
        app.router.add_get("/static/app.js", self._static("app.js", "text/javascript"))
        app.router.add_get("/static/app.css", self._static("app.css", "text/css"))
        app.router.add_get("/static/plotly.min.js", self._plotly)
        app.router.add_get("/api/runs", self._api_runs)
        app.router.add_get("/api/run/{session}", self._api_run)
        app.router.add_get("/api/run/{session}/updates", self._api_updates)
        app.router.add_get("/api/run/{session}/step/{step}", self._api_step)
        app.router.add_get("/api/run/{session}/stacks/{name}", self._api_stack)
        app.router.add_get("/api/compare", self._api_compare)
        app.router.add_get("/healthz", self._health)
        app.on_startup.append(self._warm)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _warm(self, app: Any) -> None:
        """Compresses Plotly's bundle on the app's threads as the server starts, so the first
        browser does not wait for it."""

        def warm() -> None:
            try:
                plotly_js_gzip()
            except PlotlyMissing:  # said in the page when asked for
                pass

        asyncio.get_running_loop().run_in_executor(self._pool, warm)

    async def _cleanup(self, app: Any) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- guard: authorisation, errors --------------------------------------------------------

    def _authorised(self, request: Any) -> tuple[bool, bool]:
        """(allowed, set the cookie)."""
        if self.token is None:
            try:
                return ipaddress.ip_address(request.remote or "").is_loopback, False
            except ValueError:
                return False, False
        expected = self.token.encode()
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), expected):
            return True, False
        cookie = request.cookies.get(_COOKIE)
        if cookie is not None and hmac.compare_digest(cookie.encode(), expected):
            return True, False
        query = request.query.get("token")
        if query is not None and hmac.compare_digest(query.encode(), expected):
            return True, True
        return False, False

    @property
    def _guard(self) -> Any:
        from aiohttp import web

        @web.middleware
        async def guard(request: Any, handler: Any) -> Any:
            self.requests += 1
            allowed, set_cookie = self._authorised(request)
            if not allowed:
                return _error_response(401 if self.token else 403,
                                       "a token is needed: open the page with ?token=... or send "
                                       "'Authorization: Bearer ...'" if self.token else
                                       "no token is configured, so only loopback clients are answered")
            try:
                response = await handler(request)
            except _HttpError as exc:
                return _error_response(exc.status, exc.message)
            except NoSuchSession as exc:
                return _error_response(404, str(exc))
            except web.HTTPException:
                raise
            except StepwatchError as exc:  # a damaged or unreadable store: said, not a traceback
                return _error_response(500, str(exc))
            if set_cookie:
                response.set_cookie(_COOKIE, self.token, httponly=True, samesite="Strict")
            response.headers.setdefault("Cache-Control", "no-store")
            response.headers["X-Content-Type-Options"] = "nosniff"
            return response

        return guard

    async def _run(self, func: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, func, *args)

    # -- pages --------------------------------------------------------------------------------

    def _shell(self, page: str, title: str, **extra: Any) -> Any:
        from aiohttp import web

        head = ('<link rel="stylesheet" href="/static/app.css">'
                f'<script src="/static/plotly.min.js"></script><!-- {PLOTLY_LICENCE} -->'
                '<script src="/static/app.js" defer></script>')
        config = {"mode": "server", "page": page, "poll_ms": self.poll_ms, "path": str(self.catalog.path), **extra}
        return web.Response(text=shell_html(config, title=title, head=head), content_type="text/html")

    async def _page_runs(self, request: Any) -> Any:
        return self._shell("runs", "stepwatch: runs")

    async def _page_run(self, request: Any) -> Any:
        session = _session_param(request.match_info["session"])
        return self._shell("run", f"stepwatch: {session}", session=session)

    async def _page_compare(self, request: Any) -> Any:
        a = _session_param(request.query.get("a", ""))
        b = _session_param(request.query.get("b", ""))
        return self._shell("compare", "stepwatch: compare", a=a, b=b)

    def _static(self, name: str, content_type: str) -> Any:
        from aiohttp import web

        async def handler(request: Any) -> Any:
            return web.Response(text=asset_text(name), content_type=content_type)

        return handler

    async def _plotly(self, request: Any) -> Any:
        from aiohttp import web

        gzipped = "gzip" in request.headers.get("Accept-Encoding", "").lower()
        try:  # read (and compressed) once, on the app's threads: never on the event loop
            body = await self._run(plotly_js_gzip if gzipped else plotly_js)
        except PlotlyMissing as exc:  # the page says why its charts are missing
            message = json.dumps(str(exc))
            return web.Response(text=f"window.STEPWATCH_PLOTLY_MISSING = {message};", content_type="text/javascript")
        response = web.Response(body=body, content_type="text/javascript")
        response.headers["Cache-Control"] = "max-age=86400"
        if gzipped:
            response.headers["Content-Encoding"] = "gzip"
        return response

    async def _health(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"ok": True, "path": str(self.catalog.path), "pid": os.getpid()})

    # -- data ---------------------------------------------------------------------------------

    async def _api_runs(self, request: Any) -> Any:
        from ..views.runs import runs_list

        return _json(await self._run(runs_list, self.catalog))

    def _run_page(self, session: str) -> dict[str, Any]:
        from ..views.run_page import run_page

        located = self.catalog.locate(session)
        key = (session, *_stamp(located.store), *_stamp(located.run_dir / "final_summary.json"
                                                        if located.run_dir else None))
        cached = self._pages.get(key)
        if cached is not None:
            self._pages.move_to_end(key)
            return cached
        live = self._live_pages.get(session)
        started = time.monotonic()
        with self.catalog.open(located) as store:
            if live is not None and started - live[0] < max(_LIVE_REUSE_MIN_S, _LIVE_REUSE_FACTOR * live[1]):
                # still running (a run that ended is built again at once: its page's end is exact)
                status = store.query("SELECT status FROM sessions WHERE session_id = ?", (session,))
                if status and status[0]["status"] == "running":
                    return live[2]
            page = run_page(store, session, located.run_dir)
        if (page.get("session") or {}).get("status") == "running":
            self._live_pages[session] = (time.monotonic(), time.monotonic() - started, page)
        else:
            self._live_pages.pop(session, None)
        self._pages[key] = page
        while len(self._pages) > _CACHE:
            self._pages.popitem(last=False)
        return page

    async def _api_run(self, request: Any) -> Any:
        session = _session_param(request.match_info["session"])
        try:
            return _json(await self._run(self._run_page, session))
        except NoSuchSession:
            if session != self._starting_session():
                raise
            # the run this dashboard serves (run --ui-port), before its ranks sent anything
            return _json({"pending": True, "message": f"session {session} has sent no data yet"})

    def _starting_session(self) -> str | None:
        """The session of the run directory this dashboard serves (its run.json), if it is one."""
        path = self.catalog.path
        if not path.is_dir():
            return None
        try:
            value = json.loads((path / "run.json").read_text()).get("session_id")
        except (OSError, ValueError, AttributeError):
            return None
        return value if isinstance(value, str) else None

    async def _api_updates(self, request: Any) -> Any:
        from ..views.run_page import run_updates

        session = _session_param(request.match_info["session"])
        cursor = _cursor_param(request.query.get("cursor", "{}"))

        def read() -> dict[str, Any]:
            with self.catalog.open_session(session) as (store, run_dir):
                return run_updates(store, session, run_dir, cursor)

        return _json(await self._run(read))

    async def _api_step(self, request: Any) -> Any:
        from ..views.run_page import step_spans

        session = _session_param(request.match_info["session"])
        step = _int_param(request.match_info["step"], "step")

        def read() -> dict[str, Any]:
            with self.catalog.open_session(session) as (store, _):
                return step_spans(store, session, step)

        return _json(await self._run(read))

    async def _api_stack(self, request: Any) -> Any:
        from aiohttp import web

        session = _session_param(request.match_info["session"])
        name = request.match_info["name"]
        if not name.endswith(".txt") or "/" in name or "\\" in name or name.startswith(".") or len(name) > 200:
            raise _HttpError(400, "not a stack dump's name")
        located = self.catalog.locate(session)
        if located.run_dir is None:
            raise _HttpError(404, "this session has no run directory (no stack dumps)")
        path = located.run_dir / "stacks" / name
        if not path.is_file():
            raise _HttpError(404, f"no stack dump {name}")
        return web.Response(text=path.read_text(errors="replace"), content_type="text/plain")

    async def _api_compare(self, request: Any) -> Any:
        from ..views.compare_page import compare_page

        a = _session_param(request.query.get("a", ""))
        b = _session_param(request.query.get("b", ""))
        return _json(await self._run(compare_page, self.catalog, a, b))


def _stamp(path: Path | None) -> tuple[Any, ...]:
    """What changes when a file (and its WAL) is written: sizes and times."""
    if path is None:
        return (None,)
    out: list[Any] = []
    for p in (path, path.with_name(path.name + "-wal")):
        try:
            st = p.stat()
            out += [st.st_size, st.st_mtime_ns]
        except OSError:
            out += [None, None]
    return tuple(out)


def _session_param(value: str) -> str:
    try:
        return check_session_id(value)
    except ValueError as exc:
        raise _HttpError(400, str(exc)) from None


def _int_param(value: str, what: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise _HttpError(400, f"{what} must be an integer, got {value[:40]!r}") from None
    if not -(1 << 62) < number < (1 << 62):
        raise _HttpError(400, f"{what} out of range")
    return number


def _cursor_param(text: str) -> dict[str, Any]:
    """The page's cursor (``run_page``'s ``cursor``), checked field by field: integers only."""
    if len(text) > 200_000:
        raise _HttpError(400, "cursor too long")
    try:
        value = json.loads(text)
    except ValueError:
        raise _HttpError(400, "cursor is not JSON") from None
    if not isinstance(value, dict):
        raise _HttpError(400, "cursor must be an object")
    steps = value.get("steps") or {}
    if not isinstance(steps, dict) or len(steps) > 1 << 16:
        raise _HttpError(400, "cursor.steps must be an object of rank -> step")
    out: dict[str, Any] = {"steps": {str(_int_param(str(k), "rank")): _int_param(str(v), "step")
                                     for k, v in steps.items()}}
    for key in ("memory_ns", "alerts", "verdicts"):
        if value.get(key) is not None:
            out[key] = _int_param(str(value[key]), key)
    return out


def _json(value: Any) -> Any:
    from aiohttp import web

    response = web.Response(text=json.dumps(value, separators=(",", ":"), default=str),
                            content_type="application/json")
    return response


def _error_response(status: int, message: str) -> Any:
    from aiohttp import web

    return web.json_response({"error": message}, status=status)


async def start_ui(catalog: Catalog, host: str, port: int, token: str | None) -> tuple[Any, int]:
    """Starts the dashboard on the running loop (``stepwatch ui``'s): (its runner, the bound port).
    Raises ValueError for a non-loopback bind without a token, OSError when it cannot listen."""
    from aiohttp import web

    if token is None and not is_loopback(host):
        raise ValueError(f"the dashboard binds {host} (not loopback) only with a token: pass --token-env")
    runner = web.AppRunner(Dashboard(catalog, token=token).build(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    bound = runner.addresses[0][1] if runner.addresses else port
    return runner, int(bound)


def serve_ui(path: Path, *, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
             ready: Any = None) -> None:
    """``stepwatch ui``: serves until SIGINT/SIGTERM. Writes one line with the URL to ``ready``."""
    import signal
    import sys

    catalog = Catalog(path)

    async def main() -> None:
        runner, bound = await start_ui(catalog, host, port, token)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        shown = f"[{host}]" if ":" in host else host
        out = ready or sys.stdout
        out.write(json.dumps({"event": "ready", "url": f"http://{shown}:{bound}/", "pid": os.getpid(),
                              "path": str(path), "at": time.time()}) + "\n")
        out.flush()
        print(f"[stepwatch] dashboard of {path} on http://{shown}:{bound}/ (Ctrl-C stops it)", file=sys.stderr,
              flush=True)
        await stop.wait()
        await runner.cleanup()

    try:
        asyncio.run(main())
    finally:
        catalog.close()
