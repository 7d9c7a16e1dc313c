"""The run page, live: server-sent events carrying the page's run section, rendered again
each time the run moves (its version, state, record, or its agent's hash changed), so an
operator watches an unwind happen. The page works without it (reload); ``console.js``
listens when JavaScript is on.

A stream is for a run that exists (404 otherwise, as the page) and a session that may read
it; one session holds at most ``streams_per_session`` of them (429 beyond). Each tick (every
``_POLL`` seconds) is one pipelined Redis read (the session, the run's head, its agent's
hash) and the token's liveness; it renders only on a change. It sends ``end`` and closes once
the run has ended and been recorded, once the run is gone, and at once when the session is
(logged out, expired, evicted, its token revoked); after ``_LIFETIME`` seconds it just closes
(the browser's ``EventSource`` reconnects by itself, through the same checks).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator

import anyio
import redis
from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import StreamingResponse

from saga.constants import WEB_SESSION_STREAMS_PREFIX, agent_key, run_keys
from saga.errors import UnknownRunError
from saga.web.api.common import RunId
from saga.web.auth import Session, context, still_open
from saga.web.console import render
from saga.web.console.pages import run_values, viewer

router = APIRouter(prefix="/console", include_in_schema=False)

#: Seconds between two looks at the run (and at the session).
_POLL = 1.0
#: Seconds a stream lasts at most.
_LIFETIME = 600.0
#: Seconds after its last look a stream no longer counts against its session (its server
#: process died without saying so).
_STALE = 30.0
_ENDED = ("completed", "compensated", "escalated")
_END = "event: end\ndata: \n\n"


@router.get("/runs/{run_id}/events")
async def run_events(request: Request, run_id: RunId) -> StreamingResponse:
    session = viewer(request)
    client = context(request).store.client
    seen = await anyio.to_thread.run_sync(_mark, client, run_id)
    first = await anyio.to_thread.run_sync(_section, request, run_id, session)  # 404 if none
    stream_id = secrets.token_hex(8)
    limit = context(request).settings.streams_per_session
    if not await anyio.to_thread.run_sync(_claim, client, session, stream_id, limit):
        raise HTTPException(
            429,
            f"this login has {limit} live run pages open already (SAGA_API_STREAMS_PER_SESSION):"
            " close one, or reload this page later",
            headers={"Retry-After": "30"},
        )
    return StreamingResponse(
        _updates(request, run_id, session, stream_id, seen, first),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


async def _updates(
    request: Request,
    run_id: str,
    session: Session,
    stream_id: str,
    seen: tuple[object, ...],
    html: str,
) -> AsyncIterator[str]:
    ctx = context(request)
    ends = time.monotonic() + _LIFETIME
    try:
        yield "retry: 1000\n\n"
        yield _update(html)
        while not (not seen or (seen[1] in _ENDED and seen[2] == "1")):
            if time.monotonic() >= ends or await request.is_disconnected():
                return
            await anyio.sleep(_POLL)
            exists, mark = await anyio.to_thread.run_sync(
                _look, ctx.store.client, session, stream_id, run_id
            )
            if not await anyio.to_thread.run_sync(still_open, ctx, session, exists):
                break
            if mark != seen:
                seen = mark
                try:
                    html = await anyio.to_thread.run_sync(_section, request, run_id, session)
                except UnknownRunError:  # its keys expired with no record: nothing to show
                    break
                yield _update(html)
        yield _END
    finally:
        with anyio.CancelScope(shield=True):  # also when the browser went away mid-sleep
            await anyio.to_thread.run_sync(_release, ctx.store.client, session, stream_id)


def _update(html: str) -> str:
    return "event: update\n" + "".join(f"data: {line}\n" for line in html.splitlines()) + "\n"


def _claim(client: redis.Redis, session: Session, stream_id: str, limit: int) -> bool:
    """Count this stream against its session; False (and not counted) beyond ``limit``."""
    key, now = WEB_SESSION_STREAMS_PREFIX + session.digest, time.time()
    with client.pipeline(transaction=True) as pipe:
        pipe.zremrangebyscore(key, "-inf", now - _STALE)
        pipe.zadd(key, {stream_id: now})
        pipe.expire(key, int(_LIFETIME + _STALE))
        pipe.zcard(key)
        *_, count = pipe.execute()
    if int(count) <= limit:
        return True
    client.zrem(key, stream_id)
    return False


def _release(client: redis.Redis, session: Session, stream_id: str) -> None:
    client.zrem(WEB_SESSION_STREAMS_PREFIX + session.digest, stream_id)


def _look(
    client: redis.Redis, session: Session, stream_id: str, run_id: str
) -> tuple[bool, tuple[object, ...]]:
    """One tick's read, in one round trip: whether the session still exists, and the run's
    mark (also telling the session's count this stream is alive)."""
    with client.pipeline(transaction=False) as pipe:
        pipe.exists(session.key)
        pipe.zadd(WEB_SESSION_STREAMS_PREFIX + session.digest, {stream_id: time.time()}, xx=True)
        _marking(pipe, run_id)
        exists, _, head, agent = pipe.execute()
    return bool(exists), _marked(head, agent)


def _mark(client: redis.Redis, run_id: str) -> tuple[object, ...]:
    """What changes whenever the page would: the run's version, state and record mark, and
    the size of its agent's hash (a turn, an approval asked or decided); () once the run's
    keys are gone."""
    with client.pipeline(transaction=False) as pipe:
        _marking(pipe, run_id)
        head, agent = pipe.execute()
    return _marked(head, agent)


def _marking(pipe: redis.client.Pipeline, run_id: str) -> None:
    pipe.hmget(run_keys(run_id)[0], ["version", "state", "recorded", "resolved"])
    pipe.hlen(agent_key(run_id))


def _marked(head: list[object], agent: object) -> tuple[object, ...]:
    return (*head, agent) if head[1] is not None else ()


def _section(request: Request, run_id: str, session: Session) -> str:
    return render.fragment(request, "_run.html", session, **run_values(request, run_id))
