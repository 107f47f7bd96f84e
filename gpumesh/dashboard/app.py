"""The dashboard's web app: pages rendered on the server from the Python API, kept live by server-sent
events, and the two write actions (cancel, retry) for a credential that may write.

Why it is built this way:

* Every Redis call is redis-py's blocking client, so each runs in Starlette's thread pool and a slow broker
  never stalls the event loop; a live region is re-rendered about once a second, on the server, and the
  page's small script swaps the HTML in. No client-side templating, no build step, no CDN.
* Everything shown comes from tasks, payloads and workers, i.e. from whoever could submit or join: Jinja2
  autoescapes it, the SVG escapes it, the Content-Security-Policy (``default-src 'self'``) forbids inline
  script, and no secret (the broker URL is shown masked) ever reaches a page or a URL.
* A write needs four things: a credential that may write the job index (probed once at start), the
  dashboard's access token (printed once at start, and in a 0600 file: :class:`TokenLogin`), the page's
  per-process form token, and a request from this host (Origin/Referer). The last two stop another site the
  browser has open; the access token stops a process of this machine (a task, over loopback), which can set
  any Origin it likes and read any page.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import re
import secrets
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, quote, urlsplit

import jinja2
import redis
from markupsafe import Markup
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpumesh import api
from gpumesh.dashboard.view import Damaged, View, ago, probe_may_write, safe_filename
from gpumesh.errors import BrokerError, NotFound
from gpumesh.store import keys
from gpumesh.store.connection import translate

log = logging.getLogger("gpumesh.dashboard")
T = TypeVar("T")
HERE = Path(__file__).resolve().parent
LIVE_EVERY_S = 1.0  # how often a live region is re-rendered
LINE_BREAK = re.compile(r"\r\n|\r|\n")
FORM_BYTES = 4096  # a cancel or retry form is one short field
STREAM_ID = re.compile(r"\d{1,20}-\d{1,20}")  # a Redis stream entry id: where a log page's stream goes on
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}


class BrokerDown(Exception):
    """The broker did not answer, or refused: what a page shows in one line (masked)."""


class Forbidden(Exception):
    """A write refused: its one-line reason goes back with 403."""


# -- HTTP -------------------------------------------------------------------------------------------


class SecurityHeaders:
    """Adds the same security headers to every response, streamed ones included (pure ASGI: Starlette's
    BaseHTTPMiddleware would buffer or break the event streams)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                have = {k.lower() for k, _v in message["headers"]}
                message["headers"] = [
                    *message["headers"],
                    *[(k.lower().encode(), v.encode()) for k, v in HEADERS.items() if k.lower().encode() not in have],
                ]
            await send(message)

        await self.app(scope, receive, with_headers)


class TokenLogin:
    """A dashboard's access token, as Jupyter's: the address `gpumesh dashboard` prints carries it (``?token=``);
    opening it sets a cookie (HttpOnly, SameSite=Strict) and leads to the same page without it. Pages then offer
    cancel and retry, with their form token, only to a request with that cookie (or ``Authorization: token ...``),
    and every write needs it: a process on this machine that reads a page (a task, over loopback) gets no form
    token, and its POST is refused, whatever Origin it sets."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token
        self.cookie = cookie_name(token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and b"token=" in scope.get("query_string", b""):
            given = (parse_qs(scope["query_string"].decode("latin-1")).get("token") or [""])[0]
            if hmac.compare_digest(given.encode(), self.token.encode()):
                response = RedirectResponse(quote(scope.get("path", "/")) or "/", status_code=303)
                response.set_cookie(self.cookie, self.token, httponly=True, samesite="strict", path="/")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def cookie_name(token: str) -> str:
    """The cookie that holds ``token``: named after it, so two dashboards of one host (other ports) keep theirs."""
    return "gpumesh-dashboard-" + hashlib.sha256(token.encode()).hexdigest()[:12]


def same_origin(request: Request) -> bool:
    """Whether a POST comes from a page of this host: its Origin, else its Referer, names this Host."""
    host = request.headers.get("host", "")
    for header in ("origin", "referer"):
        value = request.headers.get(header)
        if value:
            return value != "null" and bool(host) and urlsplit(value).netloc == host
    return False


def sse(data: str, event: str | None = None) -> str:
    lines = [f"event: {event}"] if event else []
    # EventSource ends a line at CR, LF or CRLF: split on all three, or a CR in a task's output (a
    # progress bar's) would end the data line there and let the rest read as fields (a forged event)
    lines += [f"data: {line}" for line in (LINE_BREAK.split(data) if data else [""])]
    return "\n".join(lines) + "\n\n"


class Dashboard:
    """The routes, bound to one View and the templates."""

    def __init__(self, view: View, token: str | None = None) -> None:
        self.view = view
        self.token = token  # the access token (TokenLogin); None: none asked (an app made without one)
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True, undefined=jinja2.StrictUndefined
        )
        self.env.filters["ago"] = ago

    def html(self, template: str, status_code: int = 200, **context: Any) -> HTMLResponse:
        text = self.env.get_template(template).render(**self.view.common(), **context)
        return HTMLResponse(text, status_code=status_code, headers={"Cache-Control": "no-store"})

    def fragment(self, template: str, **context: Any) -> str:
        return self.env.get_template(template).render(**self.view.common(), **context)

    async def read(self, call: Callable[[], T]) -> T:
        """``call`` in the thread pool, its broker errors as BrokerDown (one masked line)."""
        try:
            return await run_in_threadpool(call)
        except redis.RedisError as exc:
            raise BrokerDown(str(translate(exc, self.view.mesh.broker.url))) from None
        except NotFound:
            raise
        except BrokerError as exc:
            raise BrokerDown(str(exc)) from None

    def holds_token(self, request: Request) -> bool:
        """Whether ``request`` carries the dashboard's access token (its cookie, or an Authorization header)."""
        if self.token is None:
            return True
        given = request.cookies.get(cookie_name(self.token), "")
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("token "):
            given = auth[6:].strip()
        return hmac.compare_digest(given.encode(), self.token.encode())

    def job_data(self, request: Request, job_id: str) -> dict[str, Any]:
        """The job page's data; its cancel and retry forms (and their form token) only for a holder of the token."""
        data = self.view.job(job_id)
        if not self.holds_token(request):
            data = {**data, "can_cancel": False, "can_retry": False}
        return data

    # pages

    async def mesh_page(self, request: Request) -> Response:
        return self.html("mesh.html", title="Mesh", page="mesh", **await self.read(self.view.workers))

    async def jobs_page(self, request: Request) -> Response:
        return self.html("jobs.html", title="Jobs", page="jobs", **await self.read(self.view.jobs))

    async def job_page(self, request: Request) -> Response:
        job_id = request.path_params["job"]
        data = await self.read(lambda: self.job_data(request, job_id))
        return self.html("job.html", title=f"Job {job_id}", page="jobs", job_id=job_id, **data)

    async def timeline_page(self, request: Request) -> Response:
        job_id = request.path_params["job"]
        svg = await self.read(lambda: self.view.timeline(job_id))
        return self.html("timeline.html", title=f"Timeline of {job_id}", page="jobs", job_id=job_id,
                         svg=Markup(svg))  # fmt: skip  # escaped by timeline.render

    async def timeline_svg(self, request: Request) -> Response:
        job_id = request.path_params["job"]
        svg = await self.read(lambda: self.view.timeline(job_id))
        return Response(svg, media_type="image/svg+xml", headers={"Cache-Control": "no-store"})

    async def log_page(self, request: Request) -> Response:
        task_id = request.path_params["task"]
        cursors: dict[str, str] = {}
        ended, lines = await self.read(lambda: self.view.log(task_id, cursors))
        return self.html("log.html", title=f"Log of {task_id}", page="jobs", task_id=task_id, lines=lines,
                         ended=ended, job_id=keys.job_of_task(task_id), after=cursors.get(task_id, ""))  # fmt: skip

    async def artifact(self, request: Request) -> Response:
        job_id, path = request.path_params["job"], request.path_params["path"]
        index = request.path_params["index"]
        size, chunks = await self.read(lambda: self.view.artifact(job_id, index, path))
        name = safe_filename(path)
        disposition = f"attachment; filename=\"{name}\"; filename*=UTF-8''{quote(path.rsplit('/', 1)[-1], safe='')}"
        headers = {"Content-Disposition": disposition, "Content-Length": str(size), "Cache-Control": "no-store"}
        return StreamingResponse(chunks, media_type="application/octet-stream", headers=headers)

    async def healthz(self, request: Request) -> Response:
        return PlainTextResponse("ok")

    async def favicon(self, request: Request) -> Response:
        return Response(status_code=204)

    # writes

    async def write(self, request: Request, action: Callable[[str], None]) -> Response:
        job_id = request.path_params["job"]
        if not self.view.may_write:
            raise Forbidden("this dashboard's credential is read-only: it may not cancel or retry jobs")
        if not self.holds_token(request):
            raise Forbidden(
                "refused: this dashboard's access token is missing; open the address with ?token= that "
                "`gpumesh dashboard` printed as it started (also in its token file)"
            )
        body = await request.body()
        form = parse_qs(body[:FORM_BYTES].decode("utf-8", "replace")) if len(body) <= FORM_BYTES else {}
        token = (form.get("csrf") or [""])[0]
        if not hmac.compare_digest(token.encode(), self.view.csrf.encode()):
            raise Forbidden("missing or stale form token: reload the page and try again")
        if not same_origin(request):
            raise Forbidden("refused: the request did not come from a page of this dashboard")
        try:
            await self.read(lambda: action(job_id))
        except BrokerDown as exc:
            if "NOPERM" in str(exc) or "permission" in str(exc).lower():
                raise Forbidden(f"the broker refused: {exc}") from None
            raise
        return RedirectResponse(f"/jobs/{quote(job_id, safe='')}", status_code=303)

    async def cancel(self, request: Request) -> Response:
        return await self.write(request, self.view.cancel)

    async def retry(self, request: Request) -> Response:
        return await self.write(request, self.view.retry)

    # live regions

    def stream(self, frames: AsyncIterator[str]) -> StreamingResponse:
        headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        return StreamingResponse(frames, media_type="text/event-stream", headers=headers)

    async def pause(self, seconds: float) -> bool:
        """Sleep ``seconds``, or less if the server begins to shut down; whether the stream goes on."""
        loop = asyncio.get_running_loop()
        until = loop.time() + seconds
        while not self.view.stopping():
            left = until - loop.time()
            if left <= 0:
                return True
            await asyncio.sleep(min(left, 0.1))
        return False

    async def every_second(self, request: Request, render: Callable[[], str]) -> AsyncIterator[str]:
        """The fragment, re-rendered about once a second until the client goes (or the server stops); a
        broker outage is one line in the region, and the stream keeps trying."""
        while not self.view.stopping() and not await request.is_disconnected():
            try:
                html = await self.read(render)
            except BrokerDown as exc:
                html = self.fragment("_broker_down.html", message=str(exc))
            except NotFound as exc:
                yield sse(self.fragment("_broker_down.html", message=str(exc)), event="gone")
                return
            except Exception as exc:  # noqa: BLE001 - data no honest client writes: one line, and keep going
                log.error("dashboard: rendering %s failed: %s: %s", request.url.path, type(exc).__name__, exc)
                html = self.fragment("_broker_down.html", message=f"could not show this ({type(exc).__name__})")
            yield sse(html)
            if not await self.pause(LIVE_EVERY_S):
                return

    async def live_workers(self, request: Request) -> Response:
        return self.stream(self.every_second(request, lambda: self.fragment("_workers.html", **self.view.workers())))

    async def live_jobs(self, request: Request) -> Response:
        return self.stream(self.every_second(request, lambda: self.fragment("_jobs.html", **self.view.jobs())))

    async def live_job(self, request: Request) -> Response:
        job_id = request.path_params["job"]
        await self.read(lambda: self.view.mesh.job(job_id))  # an unknown job: 404 before any stream

        def render() -> str:
            return self.fragment("_job.html", job_id=job_id, **self.job_data(request, job_id))

        return self.stream(self.every_second(request, render))

    async def live_logs(self, request: Request) -> Response:
        task_id = request.path_params["task"]
        after = request.query_params.get("after", "")
        cursors = {task_id: after} if STREAM_ID.fullmatch(after) else {}
        first = await self.read(lambda: self.view.log(task_id, cursors))  # NotFound: 404 before any stream
        return self.stream(self.log_frames(request, task_id, cursors, first))

    async def log_frames(
        self, request: Request, task_id: str, cursors: dict[str, str], first: tuple[bool, list[tuple[str, str]]]
    ) -> AsyncIterator[str]:
        """New log lines as they come (event ``lines``), then ``end`` once the task has ended."""
        ended, lines = first
        while True:
            if lines:
                yield sse(self.fragment("_lines.html", lines=lines), event="lines")
            if ended:
                yield sse("", event="end")
                return
            if not await self.pause(LIVE_EVERY_S / 2) or await request.is_disconnected():
                return
            try:
                ended, lines = await self.read(lambda: self.view.log(task_id, cursors))
            except BrokerDown as exc:
                ended, lines = False, []
                yield sse(self.fragment("_broker_down.html", message=str(exc)), event="trouble")
            except NotFound:
                yield sse("", event="end")
                return

    # errors

    async def not_found(self, request: Request, exc: Exception) -> Response:
        message = str(exc) if isinstance(exc, NotFound) else "no such page"
        return self.html("error.html", status_code=404, title="Not found", page="", message=message)

    async def broker_down(self, request: Request, exc: Exception) -> Response:
        return self.html("error.html", status_code=503, title="Broker unreachable", page="",
                         message=f"broker unreachable: {exc}")  # fmt: skip

    async def damaged(self, request: Request, exc: Exception) -> Response:
        log.error("artifact download refused: %s", exc)
        return PlainTextResponse(f"not sent: {exc}", status_code=502)

    async def forbidden(self, request: Request, exc: Exception) -> Response:
        return PlainTextResponse(str(exc), status_code=403)

    async def http_error(self, request: Request, exc: Exception) -> Response:
        code = exc.status_code if isinstance(exc, HTTPException) else 500
        if code == 404:
            return await self.not_found(request, exc)
        return PlainTextResponse(str(getattr(exc, "detail", "error")), status_code=code)

    async def crashed(self, request: Request, exc: Exception) -> Response:
        log.error("dashboard error on %s: %s: %s", request.url.path, type(exc).__name__, exc)
        return PlainTextResponse("internal error (see the dashboard's log)", status_code=500)


def create_app(
    mesh: api.Mesh, *, may_write: bool | None = None, hosts: list[str] | None = None, token: str | None = None
) -> Starlette:
    """The dashboard for ``mesh``. ``may_write`` None: probe the credential once (see probe_may_write);
    False shows no cancel or retry button and refuses those requests whatever the credential may do.
    ``hosts``: the only Host names it answers (400 otherwise; None: any). `gpumesh dashboard` gives its own
    (gpumesh.cli.dashboard.own_names), so that a page of another site whose name resolves to the dashboard's
    address (DNS rebinding) reads nothing and, with the token it could then read, writes nothing.
    ``token``: the access token (:class:`TokenLogin`) without which no page offers a write and no write is taken
    (None: none asked; `gpumesh dashboard` always makes one for a dashboard that may write)."""
    view = View(mesh, probe_may_write(mesh) if may_write is None else may_write)
    d = Dashboard(view, token)
    routes = [
        Route("/", d.mesh_page),
        Route("/jobs", d.jobs_page),
        Route("/jobs/{job}", d.job_page),
        Route("/jobs/{job}/timeline", d.timeline_page),
        Route("/jobs/{job}/timeline.svg", d.timeline_svg),
        Route("/jobs/{job}/files/{index:int}/{path:path}", d.artifact),
        Route("/jobs/{job}/cancel", d.cancel, methods=["POST"]),
        Route("/jobs/{job}/retry", d.retry, methods=["POST"]),
        Route("/tasks/{task}/logs", d.log_page),
        Route("/live/workers", d.live_workers),
        Route("/live/jobs", d.live_jobs),
        Route("/live/job/{job}", d.live_job),
        Route("/live/logs/{task}", d.live_logs),
        Route("/healthz", d.healthz),
        Route("/favicon.ico", d.favicon),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    handlers: dict[Any, Any] = {
        NotFound: d.not_found, BrokerDown: d.broker_down, Forbidden: d.forbidden, Damaged: d.damaged,
        HTTPException: d.http_error, Exception: d.crashed,
    }  # fmt: skip
    app = Starlette(routes=routes, exception_handlers=handlers)
    if token is not None:  # inside the Host check: a rebound name never gets the cookie
        app.add_middleware(TokenLogin, token=token)
    if hosts is not None:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=hosts)
    app.add_middleware(SecurityHeaders)
    app.state.view = view
    return app


def serve(url: str | None, host: str, port: int, hosts: list[str] | None = None, read_only: bool = False) -> None:
    """Serve the dashboard of the mesh at ``url`` (settings layering as every command) until SIGINT or
    SIGTERM; prints one line once it listens. Open event streams are cut after 2 s at shutdown. ``hosts``:
    the Host names answered (None: any; the command gives its own, see gpumesh.cli.dashboard.own_names);
    ``read_only``: never write, whatever the credential."""
    import uvicorn

    mesh = api.connect(url)
    may_write = False if read_only else probe_may_write(mesh)
    token = secrets.token_urlsafe(32) if may_write else None
    app = create_app(mesh, hosts=hosts, may_write=may_write, token=token)
    mode = "may cancel and retry" if may_write else "read-only"
    token_file = write_token(token) if token is not None else None

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            try:
                await super().shutdown(sockets)
            finally:  # here: uvicorn raises the signal that stopped it again once this returns
                if token_file is not None:
                    token_file.unlink(missing_ok=True)

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                bound = self.servers[0].sockets[0].getsockname()[1] if self.servers else port
                shown = f"[{host}]" if ":" in host else host
                print(f"gpumesh dashboard: http://{shown}:{bound}/ ({mode})", flush=True)
                if token is not None:
                    print(f"    to cancel and retry, open http://{shown}:{bound}/?token={token}\n"
                          f"    (its access token, also in {token_file}, which only you can read)", flush=True)  # fmt: skip

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off", access_log=False,
                            timeout_graceful_shutdown=2, server_header=False)  # fmt: skip
    server = Server(config)
    app.state.view.stopping = lambda: server.should_exit
    try:
        server.run()
    finally:
        mesh.close()
        if token_file is not None:
            token_file.unlink(missing_ok=True)
        sys.stdout.flush()


def write_token(token: str) -> Path:
    """The access token in a file only this user may read (0600, in a 0700 directory of the cache dir), as Jupyter
    keeps its own: ``dashboard-PID.token``, removed as the dashboard stops."""
    from gpumesh.settings import Settings

    directory = Settings.load().cache_dir / "dashboard"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    path = directory / f"dashboard-{os.getpid()}.token"
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return path
