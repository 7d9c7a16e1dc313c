"""``saga.client`` for asyncio web apps (FastAPI, Starlette, any ASGI app): the same calls,
awaited, and none of them blocks the event loop.

    from saga.aio import AsyncClient
    client = AsyncClient()                  # SAGA_BROKER_URL, SAGA_REDIS_URL, ...
    run_id = await client.enqueue_run("refund", "Refund order 4921, it arrived late.")
    status = await client.wait_run(run_id)  # RunStatus, once the run has ended

Redis is spoken to with redis-py's asyncio client, running the very scripts the workers and
the sync client run (``saga.stack.script_sources``: same text, same SHA; loaded again when
Redis answers NOSCRIPT). kombu has no asyncio, so a message (a turn, an unwind) is published
on a small pool of threads of this client's own: at most ``publish_threads`` publishes at a
time, each bounded by ``publish_timeout`` seconds, after which the call raises
``MessageNotSentError`` as the sync client does when the broker refuses (the run is recorded;
the same call again sends it, and the reaper does at the run's deadline).

Names, arguments, answers and errors are the sync client's (``saga.client``), whose checks,
messages and decisions this module calls rather than repeats.
"""

from __future__ import annotations

import asyncio
import functools
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any, cast

import redis.asyncio as aioredis

from saga import metrics
from saga.agents.launch import (
    checked_run,
    first_turn_due,
    first_turn_not_sent,
    published_entry,
    send_turn,
)
from saga.client import (
    RunStatus,
    RunSummary,
    abort_reason,
    approval_refused,
    broker_app,
    check_decision,
    decision_not_sent,
    decision_refusal,
    must_unwind,
    no_run,
    resolved,
    run_deadline,
    send_unwind,
    status_of,
    summaries,
    turn_of,
    unwind_not_sent,
)
from saga.constants import (
    AGENTS_KEY,
    CREATED_RUNS_KEY,
    agent_key,
    ended_key,
    run_keys,
    script_keys,
)
from saga.errors import ConfigurationError, UnknownRunError, WaitTimeoutError
from saga.listing import _HEAD_FIELDS, Position, RunFilter, RunRow, _row_of_head, _score, micros
from saga.model import RunState
from saga.picture import RunPicture
from saga.settings import Settings
from saga.stack import (
    HEAD_FIELDS,
    RunHead,
    head_of,
    outcome_of,
    picture_of,
    queue_create,
    raise_first_error,
    reachable,
    read_picture,
    script_missing,
    script_sources,
)
from saga.validation import check_agent_name

__all__ = [
    "AsyncClient",
    "abort_run",
    "approve",
    "deny",
    "enqueue_run",
    "get_run",
    "list_runs",
    "wait_run",
]

#: Seconds a Redis command may go unanswered before the call is ``StoreUnavailableError``
#: (``socket_timeout`` in ``SAGA_*`` Redis options overrides it): a Redis that accepts and
#: never answers must not hold a request forever.
_SOCKET_TIMEOUT = 10.0
#: As the sync store: connections at most, and how long a call waits for a free one.
_MAX_CONNECTIONS = 512
_POOL_WAIT = 30.0
#: Seconds between two measurements of this host's clock against the Redis server's.
_CLOCK_RESYNC = 60.0
#: Index entries read at most in one round trip of ``list_runs`` (as ``saga.listing``).
_BATCH = 500


class AsyncClient:
    """Talks to the saga's Redis over asyncio, and to the broker from threads of its own.
    One per event loop (its connections belong to the loop that first used them); close it
    with ``await client.aclose()`` or ``async with AsyncClient() as client``."""

    def __init__(
        self,
        broker_url: str | None = None,
        redis_url: str | None = None,
        *,
        settings: Settings | None = None,
        publish_threads: int = 4,
        publish_timeout: float = 10.0,
    ) -> None:
        if isinstance(publish_threads, bool) or not isinstance(publish_threads, int):
            raise ConfigurationError(
                f"publish_threads must be a whole number, not {publish_threads!r}"
            )
        if publish_threads < 1 or not publish_timeout > 0:
            raise ConfigurationError(
                "publish_threads and publish_timeout must be positive "
                f"(got {publish_threads!r}, {publish_timeout!r})"
            )
        self.settings, redis_url, broker_url = resolved(broker_url, redis_url, settings)
        options: dict[str, Any] = {
            "max_connections": _MAX_CONNECTIONS,
            "timeout": _POOL_WAIT,
            "socket_timeout": _SOCKET_TIMEOUT,
            "socket_connect_timeout": _SOCKET_TIMEOUT,
            **self.settings.redis_options,
        }
        pool = aioredis.BlockingConnectionPool.from_url(redis_url, decode_responses=True, **options)
        self.redis = aioredis.Redis.from_pool(pool)
        self._scripts = {
            name: self.redis.register_script(text) for name, text in script_sources().items()
        }
        self.app = broker_app(broker_url)
        # A broker that accepts and never answers ends a publish's thread at the timeout too.
        self.app.conf.broker_transport_options = {
            "socket_timeout": publish_timeout,
            "socket_connect_timeout": publish_timeout,
            **(self.app.conf.broker_transport_options or {}),
        }
        self.publish_timeout = publish_timeout
        self._publisher = ThreadPoolExecutor(publish_threads, thread_name_prefix="saga-publish")
        self._offset = 0.0
        self._offset_measured = float("-inf")

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Let the publishes in flight end (each attempt is bounded by ``publish_timeout``:
        a thread is waited for, never the event loop), then close the connections."""
        await asyncio.to_thread(self._publisher.shutdown)
        self.app.close()
        await self.redis.aclose()

    async def enqueue_run(
        self, agent: str, input: str, run_id: str | None = None, deadline: float | None = None
    ) -> str:
        """``saga.client.Client.enqueue_run``, awaited: start a run of ``agent`` and return
        its id once turn 1 is sent; the same ``run_id`` twice starts one run."""
        check_agent_name(agent)
        chosen, open_deadline = run_deadline(await self._published(agent), deadline, self.settings)
        limit = self.settings.max_payload_bytes
        run_id, chosen = checked_run(agent, input, run_id, chosen, limit)
        if await self._create(run_id, chosen, agent, input, open_deadline):
            metrics.run_started()
        else:
            with reachable("enqueue_run"):
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.hget(agent_key(run_id), "name")
                    pipe.hexists(agent_key(run_id), "1:answer")
                    pipe.hmget(run_keys(run_id)[0], HEAD_FIELDS)
                    existing, started, head = await pipe.execute()
            if not first_turn_due(run_id, agent, existing, bool(started), head_of(head)):
                return run_id
        try:
            await self._publish(send_turn, self.app, run_id, 1)
        except Exception as exc:
            raise first_turn_not_sent(run_id, exc) from exc
        return run_id

    async def get_run(self, run_id: str) -> RunStatus:
        return status_of(await self._picture(run_id))

    async def list_runs(self, agent: str | None = None, limit: int = 50) -> list[RunSummary]:
        """Hosted runs whose keys are still in Redis, newest first: ``saga.listing``'s walk of
        the creation index, a batch per round trip."""
        where = RunFilter(agent=agent, limit=limit)
        found: list[RunSummary] = []
        bound: Position | None = None
        batch = limit + 1
        while len(found) < limit:
            top = "+inf" if bound is None else _score(bound.created_us)
            with reachable("list_runs"):
                raw = await self.redis.zrevrangebyscore(
                    CREATED_RUNS_KEY, top, "-inf", start=0, num=batch, withscores=True
                )
            entries = [
                Position(micros(float(score)), str(run)) for run, score in cast(list[Any], raw)
            ]
            fresh = [p for p in entries if bound is None or p < bound]
            if not fresh and len(entries) == batch:
                batch *= 2  # a batch of runs created in the same microsecond as the bound
                continue
            found += summaries(row for row in await self._rows(fresh) if where.keeps(row))
            if len(entries) < batch:
                break  # the index is exhausted
            bound = fresh[-1]
            batch = min(batch * 2, _BATCH)
        return found[:limit]

    async def approve(self, run_id: str, approval_id: str, *, args_hash: str, by: str) -> bool:
        """``saga.client.Client.approve``, awaited."""
        return await self._decide(run_id, approval_id, "approved", by, "", args_hash)

    async def deny(
        self, run_id: str, approval_id: str, reason: str, *, args_hash: str, by: str
    ) -> bool:
        """``saga.client.Client.deny``, awaited."""
        return await self._decide(run_id, approval_id, "denied", by, reason, args_hash)

    async def abort_run(self, run_id: str, reason: str = "aborted by the user") -> bool:
        """``saga.client.Client.abort_run``, awaited."""
        outcome = await self._script("abort", run_id, abort_reason(reason), "")
        if must_unwind(run_id, outcome):
            try:
                await self._publish(send_unwind, self.app, run_id)
            except Exception as exc:
                raise unwind_not_sent(run_id, exc) from exc
        return bool(outcome.status == "ok")

    async def wait_run(self, run_id: str, timeout: float | None = None) -> RunStatus:
        """The run once it has ended (completed, compensated, escalated, failed to start) and
        its record is written, as ``Run.wait`` waits; if only the record is late when
        ``timeout`` (default ``SAGA_WAIT_TIMEOUT``) is up, the ended run. The wait is a
        blocking pop on the run's end signal, a second at a time: other requests go on."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout or self.settings.wait_timeout)
        while True:
            head = await self._head(run_id)
            if head is None:
                raise UnknownRunError(f"no run {run_id}")
            remaining = deadline - loop.time()
            if head.state.ended and (head.recorded or remaining <= 0):
                picture = await self._picture(run_id)
                if picture.state.ended:
                    return status_of(picture)
                continue  # reopened in between (an effect landed late): wait again
            if remaining <= 0:
                raise WaitTimeoutError(f"run {run_id} still {head.state.value}")
            with reachable("wait_run"):
                await self.redis.blpop([ended_key(run_id)], timeout=min(remaining, 1.0))

    # -- Redis --------------------------------------------------------------------------------

    async def _published(self, agent: str) -> dict[str, Any] | None:
        with reachable("published_agent"):
            entry = await self.redis.hget(AGENTS_KEY, agent)
            known = [] if entry is not None else await self.redis.hkeys(AGENTS_KEY)
        return published_entry(agent, entry, known)

    async def _create(
        self, run_id: str, deadline: float, agent: str, input: str, deadline_open: bool
    ) -> bool:
        """``RunStore.create`` for a hosted run: the same commands in one round trip, once
        more after loading the script if Redis did not have it (every one is safe to repeat)."""
        created = f"{await self._now():.6f}"
        args = (0, deadline, agent, input, created, int(deadline_open))
        script = self._scripts["create"]
        with reachable("create"):
            for attempt in (1, 2):
                async with self.redis.pipeline(transaction=False) as pipe:
                    queue_create(pipe, script.sha, run_id, args)
                    answers: list[Any] = await pipe.execute(raise_on_error=False)
                if attempt == 1 and script_missing(answers):
                    await self.redis.script_load(script.script)
                    continue
                break
            raise_first_error(answers)
        return str(answers[-1]) == "1"

    async def _script(self, name: str, run_id: str, *args: Any) -> Any:
        """Script ``name`` on the run's keys (EVALSHA; loaded again on NOSCRIPT)."""
        keys = script_keys(run_id)
        with reachable(name):
            raw = await self._scripts[name](keys=keys, args=list(args))
        return outcome_of(name, run_id, raw, args)

    async def _picture(self, run_id: str) -> RunPicture:
        with reachable("picture"):
            async with self.redis.pipeline(transaction=True) as pipe:
                read_picture(pipe, run_id)
                picture = picture_of(run_id, await pipe.execute())
        if picture is None:
            raise no_run(run_id)
        return picture

    async def _head(self, run_id: str) -> RunHead | None:
        with reachable("head"):
            return head_of(await self.redis.hmget(run_keys(run_id)[0], HEAD_FIELDS))

    async def _rows(self, candidates: Sequence[Position]) -> list[RunRow]:
        """The listing's rows of the runs whose keys are still there."""
        with reachable("list_runs"):
            async with self.redis.pipeline(transaction=False) as pipe:
                for position in candidates:
                    pipe.hmget(run_keys(position.run_id)[0], _HEAD_FIELDS)
                    pipe.hget(agent_key(position.run_id), "name")
                answers = await pipe.execute()
        rows = (
            _row_of_head(p.run_id, answers[2 * i], answers[2 * i + 1], p.created_us)
            for i, p in enumerate(candidates)
        )
        return [row for row in rows if row is not None]

    async def _now(self) -> float:
        """The Redis server's clock, as ``RunStore.now`` reads it (the offset measured with
        ``TIME`` once a minute): a run's creation time is the one its scripts compare with."""
        host = time.time()
        if host - self._offset_measured > _CLOCK_RESYNC:
            with reachable("time"):
                seconds, micros_ = await self.redis.time()
            self._offset = float(seconds) + micros_ / 1_000_000 - time.time()
            self._offset_measured = host
        return time.time() + self._offset

    # -- the broker ---------------------------------------------------------------------------

    async def _decide(
        self, run_id: str, marker: str, verdict: str, by: str, reason: str, args_hash: str
    ) -> bool:
        check_decision(by, reason)
        outcome = await self._script(
            "decide_approval", run_id, marker, verdict, by, reason, args_hash
        )
        if decision_refusal(outcome.status):
            raise approval_refused(run_id, marker, outcome.status)
        if outcome.status == "repeat" and outcome.values[1] != RunState.RUNNING.value:
            return False  # the run went on past that turn, and ended: nothing to send
        try:
            await self._publish(send_turn, self.app, run_id, turn_of(marker))
        except Exception as exc:
            raise decision_not_sent(run_id, marker, verdict, exc) from exc
        return bool(outcome.status == "ok")

    async def _publish(self, send: Callable[..., None], *args: Any) -> None:
        """Run a kombu publish on this client's threads, for ``publish_timeout`` at most (a
        publish that times out may still go out: a second message of a turn only replays it,
        and an unwind's owner starts it once)."""
        loop = asyncio.get_running_loop()
        sending = loop.run_in_executor(self._publisher, functools.partial(send, *args))
        try:
            await asyncio.wait_for(sending, self.publish_timeout)
        except TimeoutError:
            raise TimeoutError(
                f"the broker did not answer within {self.publish_timeout:g} s"
            ) from None


#: The client of each running event loop that the module's functions use.
_defaults: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncClient] = (
    weakref.WeakKeyDictionary()
)


def default_client() -> AsyncClient:
    """This event loop's client from the environment (``SAGA_BROKER_URL``, ...)."""
    loop = asyncio.get_running_loop()
    if loop not in _defaults:
        _defaults[loop] = AsyncClient()
    return _defaults[loop]


async def enqueue_run(
    agent: str, input: str, run_id: str | None = None, deadline: float | None = None
) -> str:
    return await default_client().enqueue_run(agent, input, run_id, deadline)


async def get_run(run_id: str) -> RunStatus:
    return await default_client().get_run(run_id)


async def list_runs(agent: str | None = None, limit: int = 50) -> list[RunSummary]:
    return await default_client().list_runs(agent, limit)


async def wait_run(run_id: str, timeout: float | None = None) -> RunStatus:
    return await default_client().wait_run(run_id, timeout)


async def abort_run(run_id: str, reason: str = "aborted by the user") -> None:
    await default_client().abort_run(run_id, reason)


async def approve(run_id: str, approval_id: str, *, args_hash: str, by: str) -> None:
    await default_client().approve(run_id, approval_id, args_hash=args_hash, by=by)


async def deny(run_id: str, approval_id: str, reason: str, *, args_hash: str, by: str) -> None:
    await default_client().deny(run_id, approval_id, reason, args_hash=args_hash, by=by)
