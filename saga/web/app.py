"""The web app: the JSON API under ``/api``, the console under ``/console``, health under
``/health``, the OpenAPI schema at ``/openapi.json``.

Standalone (``saga serve``), or mounted in an app of your own, Sidekiq-Web style:

    from fastapi import FastAPI
    from saga.web import create_app

    app = FastAPI()
    app.mount("/saga", create_app())
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.staticfiles import StaticFiles

from saga.client import Client
from saga.errors import SagaError
from saga.records import RecordStore
from saga.settings import Settings
from saga.web import problems
from saga.web.api import ROUTERS
from saga.web.console import forms, live, pages
from saga.web.context import WebContext
from saga.web.settings import WebSettings

_STATIC = Path(__file__).parent / "console" / "static"
_BODY_METHODS = {"POST", "PUT", "PATCH"}
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGI = Callable[[Scope, Receive, Send], Awaitable[None]]


def create_app(
    *,
    client: Client | None = None,
    records: RecordStore | None = None,
    settings: WebSettings | None = None,
    saga: Any = None,
) -> FastAPI:
    """The app over ``client`` (the runs' Redis and the broker) and ``records``; each made
    from the environment when not given (``SAGA_REDIS_URL``, ``SAGA_BROKER_URL``,
    ``SAGA_DATABASE_URL``, ``SAGA_API_*``). ``saga``: the application's ``Saga`` for requeue
    and resolve, else imported from ``SAGA_APP`` on first use."""
    settings = settings or WebSettings.from_env()
    core = Settings.from_env()
    client = client or Client(settings=core)
    if records is None:
        records = RecordStore(core.database_url, upgrade=core.database_auto_upgrade)
    app = FastAPI(
        title="saga",
        summary="Runs, approvals and escalations of saga, over HTTP.",
        version="1",
        docs_url=None,  # Swagger UI loads its assets from a CDN; the schema is the contract
        redoc_url=None,
    )
    app.state.saga = WebContext(client, records, settings, saga)
    for router in ROUTERS:
        app.include_router(router)
    for console in (pages.router, forms.router, live.router):
        app.include_router(console)
    app.mount("/console/static", StaticFiles(directory=_STATIC), name="static")
    app.add_exception_handler(RequestValidationError, pages.or_page(problems.on_validation_error))
    app.add_exception_handler(HTTPException, pages.or_page(problems.on_http_error))
    app.add_exception_handler(SagaError, pages.or_page(problems.on_saga_error))
    for unavailable in problems.UNAVAILABLE:  # a dependency down is a 503, not a bug
        app.add_exception_handler(unavailable, pages.or_page(problems.on_saga_error))
    app.add_exception_handler(Exception, pages.or_page(problems.on_unexpected_error))
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(SecurityHeaders)
    return app


#: The console's own files only: no inline script or style, no frames, forms to itself.
_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'; "
    "object-src 'none'"
)
_EVERY_RESPONSE = [
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
]
_NOT_STORED = [(b"cache-control", b"no-store")]


class SecurityHeaders:
    """Headers on every answer: no sniffing, no framing, no referrer (run ids in URLs stay
    here); and on the console's pages and the API's answers ``Cache-Control: no-store``
    (after logging out, the back button shows no run) and on the console a
    ``Content-Security-Policy``. A header a route set itself is kept."""

    def __init__(self, app: ASGI) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"][len(scope.get("root_path", "")) :]
        extra = list(_EVERY_RESPONSE)
        if not path.startswith("/console/static/"):
            extra += _NOT_STORED
        if path.startswith("/console"):
            extra.append((b"content-security-policy", _CSP.encode()))

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {name.lower() for name, _ in headers}
                headers += [(k, v) for k, v in extra if k not in present]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_headers)


class BodyLimit:
    """Refuses, before any route runs, a body over ``limit`` bytes (413) and, on the API, a
    body that is not JSON (415). A body without a length is counted as it comes."""

    def __init__(self, app: ASGI, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        # Latin-1, as HTTP defines header bytes: a stray non-UTF-8 byte is no reason to fail.
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.limit:
            await _refuse(send, 413, f"the body is over the limit of {self.limit} bytes")
            return
        path = scope["path"][len(scope.get("root_path", "")) :]
        kind = headers.get("content-type", "").split(";")[0].strip().lower()
        has_body = length not in ("", "0") or "transfer-encoding" in headers
        if path.startswith("/api/") and has_body and kind != "application/json":
            await _refuse(send, 415, f"send JSON (Content-Type: application/json), not {kind!r}")
            return
        await self.app(scope, _counted(receive, self.limit), send)


def _counted(receive: Receive, limit: int) -> Receive:
    seen = 0

    async def counted() -> Message:
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > limit:
            raise HTTPException(413, f"the body is over the limit of {limit} bytes")
        return message

    return counted


async def _refuse(send: Send, status: int, message: str) -> None:
    response = problems.problem(status, message, "body")
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": response.raw_headers,
        }
    )
    await send({"type": "http.response.body", "body": response.body})
