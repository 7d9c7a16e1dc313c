"""``/health/live`` and ``/health/ready``: unauthenticated, so a load balancer or compose's
healthcheck can ask, and so they say nothing but whether each dependency answers (no URL, no
version, no error text: those go to the server's log).

Ready (200, else 503) needs Redis, the broker, the records database and its schema at this
version's head. The reaper's last pass is reported but does not make the server unready: a
stopped beat is for ``saga doctor`` and the on-call engineer, and restarting the API would
not fix it.

Anyone may probe, so a probe costs the server next to nothing: one check at a time runs (in
one worker thread, over the records' pool), every probe meanwhile awaits that one, and its
answer serves every probe for ``FRESH`` seconds. Probes never hold the worker threads the
other routes need, however slow a dependency is to fail.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from anyio import to_thread
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text

from saga.records import migrations
from saga.web.auth import context
from saga.web.context import WebContext

router = APIRouter(prefix="/health", tags=["health"])
logger = logging.getLogger("saga.web")

#: Seconds a probe of the broker may take.
_TIMEOUT = 3.0
#: Seconds one readiness answer serves every probe.
FRESH = 2.0
#: Seconds a probe waits for the check in flight before answering unready.
_WAIT = 10.0
_CHECKS = ("redis", "broker", "database", "schema")


@router.get("/live")
def live() -> Any:
    """The process answers."""
    return {"status": "ok"}


@dataclass
class _Readiness:
    """The app's last answer, and the check in flight (one at a time)."""

    answered_at: float = -FRESH
    body: dict[str, Any] | None = None
    check: asyncio.Task[dict[str, Any]] | None = None


@router.get("/ready", responses={503: {"description": "a dependency does not answer"}})
async def ready(request: Request) -> Any:
    """Redis, the broker, the records database and its schema; the reaper's last pass."""
    shared = _readiness(request)
    body = shared.body
    if body is None or time.monotonic() - shared.answered_at >= FRESH:
        check = shared.check
        if check is None or check.done() or check.get_loop() is not asyncio.get_running_loop():
            check = shared.check = asyncio.ensure_future(_check(shared, context(request)))
        try:
            body = await asyncio.wait_for(asyncio.shield(check), _WAIT)
        except TimeoutError:
            logger.warning("health: the readiness check takes over %gs", _WAIT)
            body = {
                "status": "unready",
                "checks": dict.fromkeys(_CHECKS, "unknown"),
                "reaper": {"status": "unknown"},
            }
    return JSONResponse(body, status_code=200 if body["status"] == "ready" else 503)


def _readiness(request: Request) -> _Readiness:
    state = request.app.state
    if not hasattr(state, "readiness"):
        state.readiness = _Readiness()
    shared: _Readiness = state.readiness
    return shared


async def _check(shared: _Readiness, ctx: WebContext) -> dict[str, Any]:
    body = await to_thread.run_sync(_checks, ctx)
    shared.body, shared.answered_at = body, time.monotonic()
    return body


def _checks(ctx: WebContext) -> dict[str, Any]:
    checks = {
        "redis": _probe("redis", lambda: bool(ctx.store.client.ping())),
        "broker": _probe("broker", lambda: _broker(ctx)),
        "database": _probe("database", lambda: _database(ctx)),
        "schema": _probe("schema", lambda: _schema(ctx)),
    }
    ok = all(v == "ok" for v in checks.values())
    body: dict[str, Any] = {"status": "ready" if ok else "unready", "checks": checks}
    body["reaper"] = {"status": "unknown"}
    if checks["redis"] == "ok":
        try:
            body["reaper"] = _reaper(ctx)
        except Exception as exc:  # Redis went away since its check: the answer stands
            logger.warning("health: the reaper's last pass unread: %s", exc)
    return body


def _probe(name: str, probe: Callable[[], bool]) -> str:
    try:
        return "ok" if probe() else "fail"
    except Exception as exc:
        logger.warning("health: %s does not answer: %s", name, exc)
        return "fail"


def _broker(ctx: WebContext) -> bool:
    connection = ctx.client.app.connection_for_write()
    try:
        connection.ensure_connection(
            max_retries=1, interval_start=0, interval_step=0.2, interval_max=0.2, timeout=_TIMEOUT
        )
    finally:
        connection.release()
    return True


def _database(ctx: WebContext) -> bool:
    with ctx.records.engine.connect() as connection:
        connection.execute(text("SELECT 1"))
    return True


def _schema(ctx: WebContext) -> bool:
    return migrations.current(ctx.records.engine) == migrations.head()


def _reaper(ctx: WebContext) -> dict[str, Any]:
    interval = float(os.environ.get("SAGA_REAP_INTERVAL") or 30)
    last = ctx.store.last_reaper_pass()
    if last is None:
        return {"status": "never"}
    age = max(0.0, ctx.store.now() - last)
    status = "ok" if age <= 3 * interval + 30 else "stale"
    return {"status": status, "age_seconds": round(age)}
