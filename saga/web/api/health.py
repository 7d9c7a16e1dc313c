"""``/health/live`` and ``/health/ready``: unauthenticated, so a load balancer or compose's
healthcheck can ask, and so they say nothing but whether each dependency answers (no URL, no
version, no error text: those go to the server's log).

Ready (200, else 503) needs Redis, the broker, the records database and its schema at this
version's head. The reaper's last pass is reported but does not make the server unready: a
stopped beat is for ``saga doctor`` and the on-call engineer, and restarting the API would
not fix it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text

from saga.records import migrations
from saga.web.auth import Context
from saga.web.context import WebContext

router = APIRouter(prefix="/health", tags=["health"])
logger = logging.getLogger("saga.web")

#: Seconds a probe of the broker may take.
_TIMEOUT = 3.0


@router.get("/live")
def live() -> Any:
    """The process answers."""
    return {"status": "ok"}


@router.get("/ready", responses={503: {"description": "a dependency does not answer"}})
def ready(ctx: Context) -> Any:
    """Redis, the broker, the records database and its schema; the reaper's last pass."""
    checks = {
        "redis": _probe("redis", lambda: bool(ctx.store.client.ping())),
        "broker": _probe("broker", lambda: _broker(ctx)),
        "database": _probe("database", lambda: _database(ctx)),
        "schema": _probe("schema", lambda: _schema(ctx)),
    }
    ok = all(v == "ok" for v in checks.values())
    body: dict[str, Any] = {"status": "ready" if ok else "unready", "checks": checks}
    body["reaper"] = _reaper(ctx) if checks["redis"] == "ok" else {"status": "unknown"}
    return JSONResponse(body, status_code=200 if ok else 503)


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
    current, head = migrations.status(ctx.records.engine.url.render_as_string(False))
    return current == head


def _reaper(ctx: WebContext) -> dict[str, Any]:
    interval = float(os.environ.get("SAGA_REAP_INTERVAL") or 30)
    last = ctx.store.last_reaper_pass()
    if last is None:
        return {"status": "never"}
    age = max(0.0, ctx.store.now() - last)
    status = "ok" if age <= 3 * interval + 30 else "stale"
    return {"status": status, "age_seconds": round(age)}
