"""The dashboard's HTTP server: an aiohttp app over a ``views.Catalog``, read-only.

Pages: ``/`` (the runs), ``/run/<session id>`` (one run), ``/compare?a=<id>&b=<id>``; their data
under ``/api/``; the script, style and the charting library (uPlot) under ``/static/``, read
once as the server starts. Every read of a store runs on the app's own two threads (and
``stepwatch ui``'s first build of its default session's page on one more), so a slow page never
holds the event loop. With the aggregator (``--ui-port``) the app runs in a process of its own
(``web/process.py``), so it never shares the writer's GIL or heap either (SQLite in WAL mode
lets readers and the writer go on together). A finished session's page is kept in memory and
on disk (``views.page_cache``): a later server reads it back.

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
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import StepwatchError
from ..views.sources import Catalog, NoSuchSession, check_session_id
from .addresses import is_loopback
from .assets import UPLOT_NOTICE, asset_bytes, shell_html

__all__ = ["Dashboard", "serve_ui"]

POLL_MS = 1000  # how often a live run's page asks for what is new
_COOKIE = "stepwatch_token"
_CACHE = 16  # run pages kept (keyed by the store's size and time: a finished run is read once)
# the page's files: name -> (content type, browser cache seconds); app.js and app.css change with
# stepwatch (not cached), uPlot's files only with its version
_STATIC = {"app.js": ("text/javascript", 0), "app.css": ("text/css", 0),
           "uPlot.iife.min.js": ("text/javascript", 86400), "uPlot.min.css": ("text/css", 86400),
           "uPlot.LICENSE": ("text/plain", 86400)}
# A running run's store changes at every write, so its page would be built again for each reload
# (4-5 s of CPU at 64 ranks while it ingests): the page built last is served again while younger
# than this many times its build time (2 s at least), so a page open during a burst costs the
# machine at most about a fifth of a core.
_LIVE_REUSE_FACTOR, _LIVE_REUSE_MIN_S = 4.0, 2.0


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

    def __init__(self, catalog: Catalog, *, token: str | None = None, poll_ms: int = POLL_MS,
                 page_cache: Path | None | bool = True, prewarm: bool = False) -> None:
        """``page_cache``: the folder finished sessions' pages are kept in across servers
        (``views.page_cache``), True for the user's (``cache_folder()``), False or None for none.
        ``prewarm``: read the default session's page as the server starts (``stepwatch ui``: the
        browser opened a moment later finds it built)."""
        from ..views.page_cache import PageCache, cache_folder

        self.catalog = catalog
        self.page_cache = PageCache(cache_folder() if page_cache is True else page_cache or None)
        self.token = token
        self.poll_ms = poll_ms
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="stepwatch-ui")
        self._pages: OrderedDict[tuple[Any, ...], dict[str, Any]] = OrderedDict()
        self._live_pages: dict[str, tuple[float, float, dict[str, Any]]] = {}  # session -> (built at, took, page)
        self._building: dict[str, threading.Lock] = {}  # one build of a session's page at a time
        self._building_lock = threading.Lock()
        self.prewarm = prewarm
        self.requests = 0

    def build(self) -> Any:
        from aiohttp import web

        app = web.Application(middlewares=[self._guard])
        app.router.add_get("/", self._page_runs)
        app.router.add_get("/run/{session}", self._page_run)
        app.router.add_get("/compare", self._page_compare)
        for name in _STATIC:
            app.router.add_get(f"/static/{name}", self._static(name))
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
        """Reads (and compresses) the page's files before the server listens (about 10 ms: then
        a static request never waits for a thread, even while a page is being built), and starts
        building the default session's page on a thread of its own when asked to (``prewarm``)."""
        await asyncio.get_running_loop().run_in_executor(self._pool, lambda: [asset_bytes(n, z) for n in _STATIC
                                                                               for z in (False, True)])
        if self.prewarm:
            threading.Thread(target=self._prewarm, name="stepwatch-ui-prewarm", daemon=True).start()

    def _prewarm(self) -> None:
        """Builds (or loads from the page cache) the default session's page, unless it is running."""
        try:
            session = self.catalog.default_session()
            if session is None:
                return
            with self.catalog.open_session(session) as (store, _):
                rows = store.query("SELECT status FROM sessions WHERE session_id = ?", (session,))
            if rows and rows[0]["status"] != "running":
                self._run_page(session)
        except Exception:  # noqa: BLE001 - only a head start lost: the page's request builds it and says what failed
            pass

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

        head = ('<link rel="stylesheet" href="/static/uPlot.min.css"><link rel="stylesheet" href="/static/app.css">'
                f'<!-- {UPLOT_NOTICE}: /static/uPlot.LICENSE -->'
                '<script src="/static/uPlot.iife.min.js" defer></script><script src="/static/app.js" defer></script>')
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

    def _static(self, name: str) -> Any:
        from aiohttp import web

        content_type, max_age = _STATIC[name]

        async def handler(request: Any) -> Any:
            gzipped = "gzip" in request.headers.get("Accept-Encoding", "").lower()
            body = asset_bytes(name, gzipped)  # read and compressed as the server started (_warm)
            response = web.Response(body=body, content_type=content_type, charset="utf-8")
            if max_age:
                response.headers["Cache-Control"] = f"max-age={max_age}"
            if gzipped:
                response.headers["Content-Encoding"] = "gzip"
            return response

        return handler

    async def _health(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"ok": True, "path": str(self.catalog.path), "pid": os.getpid()})

    # -- data ---------------------------------------------------------------------------------

    async def _api_runs(self, request: Any) -> Any:
        from ..views.runs import runs_list

        return _json(await self._run(runs_list, self.catalog))

    def _run_page(self, session: str) -> dict[str, Any]:
        """The session's page; a second request while it is being built waits for that build
        (the prewarm and the browser's first request) instead of building it again."""
        with self._building_lock:
            lock = self._building.setdefault(session, threading.Lock())
        with lock:
            return self._run_page_once(session)

    def _run_page_once(self, session: str) -> dict[str, Any]:
        from ..views.page_cache import page_key
        from ..views.run_page import run_page

        located = self.catalog.locate(session)
        # a store on a server (a URL) has no file stamp that every write changes: its pages are
        # built on each request, kept neither here nor on disk (docs/dashboard.md)
        key = None if located.is_url else (session, *_stamp(located.store), *_stamp(
            located.run_dir / "final_summary.json" if located.run_dir else None))
        cached = self._pages.get(key) if key is not None else None
        if cached is not None:
            self._pages.move_to_end(key)
            return cached
        live = self._live_pages.get(session)
        started = time.monotonic()
        kept = None
        with self.catalog.open(located) as store:
            if live is not None and started - live[0] < max(_LIVE_REUSE_MIN_S, _LIVE_REUSE_FACTOR * live[1]):
                # still running (a run that ended is built again at once: its page's end is exact)
                status = store.query("SELECT status FROM sessions WHERE session_id = ?", (session,))
                if status and status[0]["status"] == "running":
                    return live[2]
            if self.page_cache.folder is not None and not located.is_url and not self.catalog.imported(located):
                # a finished session's page, kept on disk by an earlier server (views.page_cache)
                kept = page_key(store, located.store, session, located.run_dir)
                page = self.page_cache.get(located.store, session, kept)
                if page is not None:
                    self._remember(key, page)
                    return page
            page = run_page(store, session, located.run_dir)
            if kept is not None and page_key(store, located.store, session, located.run_dir) != kept:
                kept = None  # the history was written during the build (another session's run): not kept
        if (page.get("session") or {}).get("status") == "running":
            self._live_pages[session] = (time.monotonic(), time.monotonic() - started, page)
        else:
            self._live_pages.pop(session, None)
            if key is not None:
                self.page_cache.put(located.store, session, kept, page)
        if key is not None:
            self._remember(key, page)
        return page

    def _remember(self, key: tuple[Any, ...], page: dict[str, Any]) -> None:
        self._pages[key] = page
        while len(self._pages) > _CACHE:
            self._pages.popitem(last=False)

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
        if not isinstance(path, Path) or not path.is_dir():
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


async def start_ui(catalog: Catalog, host: str, port: int, token: str | None, *,
                   prewarm: bool = False) -> tuple[Any, int]:
    """Starts the dashboard on the running loop (``stepwatch ui``'s): (its runner, the bound port).
    Raises ValueError for a non-loopback bind without a token, OSError when it cannot listen."""
    from aiohttp import web

    if token is None and not is_loopback(host):
        raise ValueError(f"the dashboard binds {host} (not loopback) only with a token: pass --token-env")
    runner = web.AppRunner(Dashboard(catalog, token=token, prewarm=prewarm).build(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    bound = runner.addresses[0][1] if runner.addresses else port
    return runner, int(bound)


def serve_ui(path: Path | str, *, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
             ready: Any = None) -> None:
    """``stepwatch ui``: serves until SIGINT/SIGTERM. Writes one line with the URL to ``ready``."""
    import signal
    import sys

    catalog = Catalog(path)

    async def main() -> None:
        runner, bound = await start_ui(catalog, host, port, token, prewarm=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        shown = f"[{host}]" if ":" in host else host
        out = ready or sys.stdout
        out.write(json.dumps({"event": "ready", "url": f"http://{shown}:{bound}/", "pid": os.getpid(),
                              "path": str(catalog.path), "at": time.time()}) + "\n")
        out.flush()
        print(f"[stepwatch] dashboard of {catalog.path} on http://{shown}:{bound}/ (Ctrl-C stops it)", file=sys.stderr,
              flush=True)
        await stop.wait()
        await runner.cleanup()

    try:
        asyncio.run(main())
    finally:
        catalog.close()
