"""Which tools the workers run and which the callers know, as each publishes them in Redis.

A worker drops the message of a task it has not registered, so a tool the caller knows and no
worker runs would leave its step waiting for the reaper. Each worker publishes its tools as it
starts (``WORKER_TOOLS_KEY``) and each caller publishes its own on its first call
(``CALLER_TOOLS_KEY``): the caller refuses a call no worker would take, the worker's start-up
names the tools callers know and it lacks, and ``saga doctor`` compares both with the workers'
registered tasks. Entries are added or refreshed, never removed: a worker of another deploy
may still run a tool this one dropped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import redis

from saga.constants import CALLER_TOOLS_KEY, WORKER_APP_KEY, WORKER_TOOLS_KEY
from saga.errors import UnknownToolError


def publish_worker_tools(client: redis.Redis, names: Iterable[str]) -> None:
    _publish(client, WORKER_TOOLS_KEY, names)


def publish_caller_tools(client: redis.Redis, names: Iterable[str]) -> None:
    _publish(client, CALLER_TOOLS_KEY, names)


def publish_worker_app(client: redis.Redis, spec: str) -> None:
    """How this worker's ``Saga`` is imported; the last worker to start is the one named."""
    client.set(WORKER_APP_KEY, spec)


def worker_app(client: redis.Redis) -> str:
    """The ``module:attr`` a worker published, or "" (none has, or it is unknown)."""
    spec = client.get(WORKER_APP_KEY)
    return spec.decode() if isinstance(spec, bytes) else str(spec or "")


def worker_tools(client: redis.Redis) -> set[str]:
    """The tools some worker said it runs; empty when none has published (nothing is known)."""
    return _names(client, WORKER_TOOLS_KEY)


def caller_tools(client: redis.Redis) -> set[str]:
    return _names(client, CALLER_TOOLS_KEY)


def _publish(client: redis.Redis, key: str, names: Iterable[str]) -> None:
    now = f"{time.time():.3f}"
    mapping: dict[str | bytes, str | bytes] = dict.fromkeys(names, now)
    if mapping:
        client.hset(key, mapping=mapping)  # type: ignore[arg-type]


def _names(client: redis.Redis, key: str) -> set[str]:
    return {n.decode() if isinstance(n, bytes) else str(n) for n in client.hkeys(key)}


class CallerTools:
    """One caller's side: publish what it knows once (again after a late registration), and
    refuse a call of a tool registered after the ``Saga`` was built that workers have
    published and none of them runs. A tool seen published is remembered, so the steady
    state costs no command per call.

    Only late tools are checked at the call: the published sets are never pruned (a worker
    of another deploy, or another app on the same Redis, may still be running), so they can
    vouch for a tool but cannot prove that a tool known from the start is missing; the
    worker's start-up and ``saga doctor`` name those."""

    def __init__(self, client: redis.Redis, known: Callable[[], Iterable[str]]) -> None:
        self._client = client
        self._known = known
        self._hosted: set[str] = set()
        self._late: set[str] = set()
        self._published = False

    def tool_added(self, name: str) -> None:
        self._late.add(name)
        self._published = False

    def check(self, tool_name: str) -> None:
        """``UnknownToolError`` when ``tool_name`` was registered late, workers published
        their tools and it is not one of them; nothing when Redis cannot say (the call's own
        writes will tell)."""
        try:
            if not self._published:
                publish_caller_tools(self._client, self._known())
                self._published = True
            if tool_name not in self._late or tool_name in self._hosted:
                return
            self._hosted = worker_tools(self._client)
        except redis.RedisError:
            return
        if self._hosted and tool_name not in self._hosted:
            runs = ", ".join(sorted(self._hosted))
            raise UnknownToolError(
                f"no worker runs tool {tool_name!r} (the workers run: {runs}): register it "
                "where the workers' app module (celery -A) registers its tools, and restart "
                "them; its message would be dropped as unregistered"
            )
