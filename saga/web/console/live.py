"""The run page, live: server-sent events carrying the page's run section, rendered again
each time the run moves (its version, state, record, or its agent's hash changed), so an
operator watches an unwind happen. The page works without it (reload); ``console.js``
listens when JavaScript is on.

One stream reads the run's head a few times a second (two small Redis reads) and renders only
on a change; it ends once the run has ended and been recorded, and after ``_LIFETIME``
seconds in any case (the browser's ``EventSource`` reconnects by itself).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import anyio
import redis
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from saga.constants import agent_key, run_keys
from saga.web.api.common import RunId
from saga.web.auth import Session, context
from saga.web.console import render
from saga.web.console.pages import run_values, viewer

router = APIRouter(prefix="/console", include_in_schema=False)

#: Seconds between two looks at the run.
_POLL = 0.3
#: Seconds a stream lasts at most.
_LIFETIME = 600.0


@router.get("/runs/{run_id}/events")
async def run_events(request: Request, run_id: RunId) -> StreamingResponse:
    session = viewer(request)
    return StreamingResponse(
        _updates(request, run_id, session),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


async def _updates(request: Request, run_id: str, session: Session) -> AsyncIterator[str]:
    ctx = context(request)
    seen: tuple[object, ...] = ()
    ends = time.monotonic() + _LIFETIME
    yield "retry: 1000\n\n"
    while time.monotonic() < ends and not await request.is_disconnected():
        mark = await anyio.to_thread.run_sync(_mark, ctx.store.client, run_id)
        if mark != seen:
            seen = mark
            html = await anyio.to_thread.run_sync(_section, request, run_id, session)
            yield "event: update\n" + "".join(f"data: {line}\n" for line in html.splitlines())
            yield "\n"
        if mark and mark[1] in ("completed", "compensated", "escalated") and mark[2] == "1":
            yield "event: end\ndata: \n\n"
            return
        await anyio.sleep(_POLL)


def _mark(client: redis.Redis, run_id: str) -> tuple[object, ...]:
    """What changes whenever the page would: the run's version, state and record mark, and
    the size of its agent's hash (a turn, an approval asked or decided)."""
    with client.pipeline(transaction=False) as pipe:
        pipe.hmget(run_keys(run_id)[0], ["version", "state", "recorded", "resolved"])
        pipe.hlen(agent_key(run_id))
        head, agent = pipe.execute()
    return (*head, agent) if head[1] is not None else ()


def _section(request: Request, run_id: str, session: Session) -> str:
    return render.fragment(request, "_run.html", session, **run_values(request, run_id))
