"""How the asyncio client reaches Redis and the broker without blocking its event loop.

Redis is spoken to with redis-py's asyncio client on a bounded pool of connections, running
the very scripts the workers and the sync client run (``saga.stack.script_sources``: same
text, same SHA; loaded again when Redis answers NOSCRIPT), and reading a run's keys as
``RunStore`` reads them. kombu has no asyncio, so a message (a turn, an unwind) is published on
a small pool of threads: at most ``threads`` publishes at a time, each bounded by ``timeout``
seconds. What a call does with these is ``saga.aio``'s.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, cast

import redis
from redis.asyncio.cluster import PipelineCommand, RedisCluster
from redis.exceptions import NoScriptError

from saga.agents.launch import published_entry
from saga.client import no_run
from saga.constants import (
    AGENTS_KEY,
    CONFIRM_PROBE_KEY,
    INDEX_LAYOUT_KEY,
    agent_key,
    confirm_probe_key,
    run_keys,
    script_keys,
)
from saga.errors import ConfigurationError
from saga.picture import RunPicture
from saga.redis_urls import async_client
from saga.run_rows import ROW_FIELDS, Position, RunRow, row_of_head
from saga.settings import Settings
from saga.stack import (
    HEAD_FIELDS,
    UNSHARDED_INDEXES,
    ReplicaConfirmation,
    RunHead,
    head_of,
    layout_mismatch,
    merge_newest,
    outcome_of,
    picture_of,
    queue_create,
    queue_indexes,
    queue_script,
    raise_first_error,
    reachable,
    read_picture,
    script_missing,
    script_sources,
    still_missing,
)

__all__ = ["AsyncRunStore", "Publisher"]

#: Seconds a Redis command may go unanswered before the call is ``StoreUnavailableError``
#: (``socket_timeout`` in ``SAGA_*`` Redis options overrides it): a Redis that accepts and
#: never answers must not hold a request forever.
_SOCKET_TIMEOUT = 10.0
#: As the sync store: connections at most, and how long a call waits for a free one.
_MAX_CONNECTIONS = 512
_POOL_WAIT = 30.0
#: Seconds between two measurements of this host's clock against the Redis server's.
_CLOCK_RESYNC = 60.0


class AsyncRunStore:
    """The runs' Redis keys over asyncio: ``RunStore``'s scripts and reads that a client
    needs, each a call's worth of round trips."""

    def __init__(self, redis_url: str, settings: Settings) -> None:
        options: dict[str, Any] = {
            "max_connections": _MAX_CONNECTIONS,
            "timeout": _POOL_WAIT,
            "socket_timeout": _SOCKET_TIMEOUT,
            "socket_connect_timeout": _SOCKET_TIMEOUT,
            **settings.redis_options,
        }
        self.redis = async_client(redis_url, blocking=True, decode_responses=True, **options)
        self._scripts = {
            name: self.redis.register_script(text) for name, text in script_sources().items()
        }
        self._offset = 0.0
        self._offset_measured = float("-inf")
        self.confirmation = ReplicaConfirmation(
            settings.replicas_to_confirm, settings.replica_confirm_timeout_ms
        )
        self.clustered = isinstance(self.redis, RedisCluster)
        # (the layout of the store this URL names: a cluster's default differs)
        self.layout = replace(settings, redis_url=redis_url).index_layout()
        self._layout_checked = False

    async def _confirm(self, script: str, run_id: str) -> None:
        """``RunStore``'s wait for the replicas (``ReplicaConfirmation``), awaited."""
        if self.confirmation.wanted(script):
            wanted = self.confirmation
            # On one connection, after a write of its own (``StoreCore._wait_for_replicas``);
            # on a cluster, the master of the run's slot.
            if self.clustered:
                await self._wait_on(script, confirm_probe_key(run_keys(run_id)[0]))
                return
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.incr(CONFIRM_PROBE_KEY)
                pipe.wait(wanted.replicas, wanted.timeout_ms)
                confirmed = (await pipe.execute())[-1]
            self.confirmation.check(script, int(confirmed))

    async def _wait_on(self, what: str, probe: str) -> None:
        """``StoreCore._wait_on``, awaited: the node's own pipeline, both commands on one of
        its connections."""
        wanted = self.confirmation
        node = self.redis.get_node_from_key(probe)  # type: ignore[attr-defined]
        commands = [
            PipelineCommand(0, "SET", probe, "1", "PX", max(wanted.timeout_ms * 2, 60_000)),
            PipelineCommand(1, "WAIT", wanted.replicas, wanted.timeout_ms),
        ]
        await node.execute_pipeline(commands)
        raise_first_error([command.result for command in commands])
        wanted.check(what, int(cast(int, commands[-1].result)))

    async def _check_layout(self) -> None:
        """``RunStore.check_layout``, once per client: a mismatch is ``ConfigurationError``."""
        if self._layout_checked:
            return
        with reachable("index_layout"):
            recorded = await self.redis.get(INDEX_LAYOUT_KEY)
            if recorded is None and self.layout.shards > 1:
                if any([await self.redis.exists(key) for key in UNSHARDED_INDEXES]):
                    raise ConfigurationError(layout_mismatch(1, self.layout.shards))
                await self.redis.set(INDEX_LAYOUT_KEY, str(self.layout.shards), nx=True)
                recorded = await self.redis.get(INDEX_LAYOUT_KEY)
        found = int(recorded) if recorded is not None else 1
        if found != self.layout.shards:
            raise ConfigurationError(layout_mismatch(found, self.layout.shards))
        self._layout_checked = True

    async def published(self, agent: str) -> dict[str, Any] | None:
        with reachable("published_agent"):
            entry = await self.redis.hget(AGENTS_KEY, agent)
            known = [] if entry is not None else await self.redis.hkeys(AGENTS_KEY)
        return published_entry(agent, entry, known)

    async def create(
        self, run_id: str, deadline: float, agent: str, input: str, deadline_open: bool
    ) -> bool:
        """``RunStore.create`` for a hosted run: the same commands in one round trip, once
        more after loading the script if Redis did not have it (every one is safe to repeat)."""
        await self._check_layout()
        created = f"{await self.now():.6f}"
        args = (0, deadline, agent, input, created, int(deadline_open))
        script = self._scripts["create"]
        with reachable("create"):
            if self.clustered:  # the index shard and the run on two masters: indexes first
                async with self.redis.pipeline(transaction=False) as pipe:
                    queue_indexes(pipe, self.layout, run_id, args)
                    await pipe.execute()
                if self.confirmation.wanted("create"):  # on their masters, not the run's
                    for probe in dict.fromkeys(
                        confirm_probe_key(key) for key in self.layout.entries_of(run_id)
                    ):
                        await self._wait_on("create", probe)
            for attempt in (1, 2):
                async with self.redis.pipeline(transaction=False) as pipe:
                    if self.clustered:
                        queue_script(pipe, script.sha, run_id, args)
                    else:
                        queue_create(pipe, script.sha, run_id, args, self.layout)
                    answers: list[Any] = await pipe.execute(raise_on_error=False)
                if attempt == 1 and script_missing(answers):
                    await self._load("create")
                    continue
                break
            if script_missing(answers):
                raise still_missing("create")
            raise_first_error(answers)
            await self._confirm("create", run_id)
        return str(answers[-1]) == "1"

    async def script(self, name: str, run_id: str, *args: Any) -> Any:
        """Script ``name`` on the run's keys (EVALSHA; loaded again on NOSCRIPT)."""
        keys = script_keys(run_id)
        sha = self._scripts[name].sha
        with reachable(name):
            try:
                raw = await self.redis.evalsha(sha, len(keys), *keys, *args)
            except NoScriptError:
                await self._load(name)
                try:
                    raw = await self.redis.evalsha(sha, len(keys), *keys, *args)
                except NoScriptError as exc:
                    raise still_missing(name) from exc
            await self._confirm(name, run_id)
        return outcome_of(name, run_id, raw, args)

    async def _load(self, name: str) -> None:
        """``StoreCore._load``: on a cluster, on every node the client knows of."""
        text = self._scripts[name].script
        if not self.clustered:
            await self.redis.script_load(text)
            return
        cluster: Any = self.redis
        for node in cluster.get_nodes():
            try:
                await cluster.execute_command("SCRIPT LOAD", text, target_nodes=node)
            except redis.RedisError:
                continue

    async def picture(self, run_id: str) -> RunPicture:
        with reachable("picture"):
            async with self.redis.pipeline(transaction=True) as pipe:
                read_picture(pipe, run_id)
                picture = picture_of(run_id, await pipe.execute())
        if picture is None:
            raise no_run(run_id)
        return picture

    async def head(self, run_id: str) -> RunHead | None:
        with reachable("head"):
            return head_of(await self.redis.hmget(run_keys(run_id)[0], HEAD_FIELDS))

    async def newest(self, top: str, bottom: str, batch: int) -> list[tuple[str, float]]:
        """``RunStore.newest``, awaited."""
        await self._check_layout()
        with reachable("list_runs"):
            async with self.redis.pipeline(transaction=False) as pipe:
                for key in self.layout.every("created"):
                    pipe.zrevrangebyscore(key, top, bottom, start=0, num=batch, withscores=True)
                return merge_newest(await pipe.execute(), batch)

    async def rows(self, candidates: Sequence[Position]) -> list[RunRow]:
        """The listing's rows of the runs whose keys are still there."""
        with reachable("list_runs"):
            async with self.redis.pipeline(transaction=False) as pipe:
                for position in candidates:
                    pipe.hmget(run_keys(position.run_id)[0], ROW_FIELDS)
                    pipe.hget(agent_key(position.run_id), "name")
                answers = await pipe.execute()
        rows = (
            row_of_head(p.run_id, answers[2 * i], answers[2 * i + 1], p.created_us)
            for i, p in enumerate(candidates)
        )
        return [row for row in rows if row is not None]

    async def now(self) -> float:
        """The Redis server's clock, as ``RunStore.now`` reads it (the offset measured with
        ``TIME`` once a minute): a run's creation time is the one its scripts compare with."""
        host = time.time()
        if host - self._offset_measured > _CLOCK_RESYNC:
            with reachable("time"):
                seconds, micros_ = await self.redis.time()
            self._offset = float(seconds) + micros_ / 1_000_000 - time.time()
            self._offset_measured = host
        return time.time() + self._offset


class Publisher:
    """kombu publishes of ``app`` (a Celery app that only sends) on threads of their own,
    ``threads`` at a time, each awaited for ``timeout`` seconds at most."""

    def __init__(self, app: Any, threads: int, timeout: float) -> None:
        # A broker that accepts and never answers ends a publish's thread at the timeout too.
        app.conf.broker_transport_options = {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            **(app.conf.broker_transport_options or {}),
        }
        self.timeout = timeout
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="saga-publish")

    async def publish(self, send: Callable[..., None], *args: Any) -> None:
        """Run a kombu publish on these threads, for ``timeout`` at most (a publish that
        times out may still go out: a second message of a turn only replays it, and an
        unwind's owner starts it once)."""
        loop = asyncio.get_running_loop()
        sending = loop.run_in_executor(self._threads, functools.partial(send, *args))
        try:
            await asyncio.wait_for(sending, self.timeout)
        except TimeoutError:
            raise TimeoutError(f"the broker did not answer within {self.timeout:g} s") from None

    async def aclose(self) -> None:
        """Let the publishes in flight end (each attempt is bounded by ``timeout``: a
        thread is waited for, never the event loop)."""
        await asyncio.to_thread(self._threads.shutdown)
