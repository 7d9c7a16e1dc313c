"""``saga.client`` for asyncio web apps (FastAPI, Starlette, any ASGI app): the same calls,
awaited, and none of them blocks the event loop.

    from saga.aio import AsyncClient
    client = AsyncClient()                  # SAGA_BROKER_URL, SAGA_REDIS_URL, ...
    run_id = await client.enqueue_run("refund", "Refund order 4921, it arrived late.")
    status = await client.wait_run(run_id)  # RunStatus, once the run has ended

Redis is spoken to with redis-py's asyncio client, running the very scripts the workers and
the sync client run, and a message (a turn, an unwind) is published on a small pool of threads
of this client's own (``saga.aio_transport``): at most ``publish_threads`` publishes at a
time, each bounded by ``publish_timeout`` seconds, after which the call raises
``MessageNotSentError`` as the sync client does when the broker refuses (the run is recorded;
the same call again sends it, and the reaper does at the run's deadline).

Names, arguments, answers and errors are the sync client's (``saga.client``), whose checks,
messages and decisions this module calls rather than repeats.
"""

from __future__ import annotations

import asyncio
import weakref
from types import TracebackType

from saga import metrics
from saga.agents.launch import checked_run, first_turn_due, first_turn_not_sent, send_turn
from saga.aio_transport import AsyncRunStore, Publisher
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
    resolved,
    run_deadline,
    send_unwind,
    status_of,
    summaries,
    turn_of,
    unwind_not_sent,
)
from saga.constants import agent_key, ended_key, run_keys
from saga.errors import ConfigurationError, UnknownRunError, WaitTimeoutError
from saga.model import RunState
from saga.run_rows import Position, RunFilter, index_score, micros
from saga.settings import Settings
from saga.stack import HEAD_FIELDS, head_of, reachable
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
        self._store = AsyncRunStore(redis_url, self.settings)
        self.redis = self._store.redis
        self.app = broker_app(broker_url, redis_url)
        self._publisher = Publisher(self.app, publish_threads, publish_timeout)

    @property
    def publish_timeout(self) -> float:
        """Seconds a publish is awaited at most."""
        return self._publisher.timeout

    @publish_timeout.setter
    def publish_timeout(self, seconds: float) -> None:
        self._publisher.timeout = seconds

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
        await self._publisher.aclose()
        self.app.close()
        await self.redis.aclose()

    async def enqueue_run(
        self, agent: str, input: str, run_id: str | None = None, deadline: float | None = None
    ) -> str:
        """``saga.client.Client.enqueue_run``, awaited: start a run of ``agent`` and return
        its id once turn 1 is sent; the same ``run_id`` twice starts one run."""
        check_agent_name(agent)
        chosen, open_deadline = run_deadline(
            await self._store.published(agent), deadline, self.settings
        )
        limit = self.settings.max_payload_bytes
        run_id, chosen = checked_run(agent, input, run_id, chosen, limit)
        if await self._store.create(run_id, chosen, agent, input, open_deadline):
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
            await self._publisher.publish(send_turn, self.app, run_id, 1)
        except Exception as exc:
            raise first_turn_not_sent(run_id, exc) from exc
        return run_id

    async def get_run(self, run_id: str) -> RunStatus:
        return status_of(await self._store.picture(run_id))

    async def list_runs(self, agent: str | None = None, limit: int = 50) -> list[RunSummary]:
        """Hosted runs whose keys are still in Redis, newest first: ``saga.listing``'s walk of
        the creation index, a batch per round trip."""
        where = RunFilter(agent=agent, limit=limit)
        found: list[RunSummary] = []
        bound: Position | None = None
        batch = limit + 1
        while len(found) < limit:
            top = "+inf" if bound is None else index_score(bound.created_us)
            raw = await self._store.newest(top, "-inf", batch)
            entries = [Position(micros(score), run_id) for run_id, score in raw]
            fresh = [p for p in entries if bound is None or p < bound]
            if not fresh and len(entries) == batch:
                batch *= 2  # a batch of runs created in the same microsecond as the bound
                continue
            found += summaries(row for row in await self._store.rows(fresh) if where.keeps(row))
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
        outcome = await self._store.script("abort", run_id, abort_reason(reason), "")
        if must_unwind(run_id, outcome):
            try:
                await self._publisher.publish(send_unwind, self.app, run_id)
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
            head = await self._store.head(run_id)
            if head is None:
                raise UnknownRunError(f"no run {run_id}")
            remaining = deadline - loop.time()
            if head.state.ended and (head.recorded or remaining <= 0):
                picture = await self._store.picture(run_id)
                if picture.state.ended:
                    return status_of(picture)
                continue  # reopened in between (an effect landed late): wait again
            if remaining <= 0:
                raise WaitTimeoutError(f"run {run_id} still {head.state.value}")
            with reachable("wait_run"):
                await self.redis.blpop([ended_key(run_id)], timeout=min(remaining, 1.0))

    async def _decide(
        self, run_id: str, marker: str, verdict: str, by: str, reason: str, args_hash: str
    ) -> bool:
        check_decision(by, reason)
        outcome = await self._store.script(
            "decide_approval", run_id, marker, verdict, by, reason, args_hash
        )
        if decision_refusal(outcome.status):
            raise approval_refused(run_id, marker, outcome.status)
        if outcome.status == "repeat" and outcome.values[1] != RunState.RUNNING.value:
            return False  # the run went on past that turn, and ended: nothing to send
        try:
            await self._publisher.publish(send_turn, self.app, run_id, turn_of(marker))
        except Exception as exc:
            raise decision_not_sent(run_id, marker, verdict, exc) from exc
        return bool(outcome.status == "ok")


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
