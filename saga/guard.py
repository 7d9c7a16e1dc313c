"""The worker's start-up guard: refuse to run with a configuration that breaks the guarantees.

Each check names a guarantee: JSON only (a pickle message is code execution), acks late (a
step is acknowledged only once its outcome and undo are recorded), a visibility timeout above
every time limit and retry delay (or Redis hands a running step to a second worker), and a
Redis that never evicts (the stack is workflow state).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import redis

from saga.retry import RetryPolicy

logger = logging.getLogger("saga.guard")

#: Celery's default visibility timeout for the Redis transport.
_REDIS_DEFAULT_VISIBILITY = 3600
_SAFE_EVICTION = ("noeviction",)


def configuration_problems(
    conf: Any, policies: Iterable[RetryPolicy], stores: Iterable[redis.Redis]
) -> list[str]:
    """Every reason the worker must not start; empty if it may."""
    problems = []
    for setting in ("accept_content", "result_accept_content"):
        accepted = set(conf.get(setting) or [])
        unsafe = sorted(accepted - {"json", "application/json"})
        if unsafe:
            problems.append(f"{setting} accepts {', '.join(unsafe)}: only json is safe")
    for setting in ("task_serializer", "result_serializer"):
        if conf.get(setting) != "json":
            problems.append(f"{setting} is {conf.get(setting)!r}: it must be 'json'")
    if not conf.get("task_acks_late"):
        problems.append("task_acks_late is off: a crash after the effect would lose the push")
    if str(conf.get("broker_url") or "").startswith(("redis", "rediss", "sentinel")):
        problems += _visibility_problems(conf, policies)
    for store in stores:
        problems += _eviction_problems(store)
    return problems


def _visibility_problems(conf: Any, policies: Iterable[RetryPolicy]) -> list[str]:
    options = conf.get("broker_transport_options") or {}
    visibility = float(options.get("visibility_timeout", _REDIS_DEFAULT_VISIBILITY))
    limits = {
        "task_time_limit": conf.get("task_time_limit"),
        "task_soft_time_limit": conf.get("task_soft_time_limit"),
        "the longest retry delay of a tool": max((p.backoff_max for p in policies), default=0),
    }
    return [
        f"{name} ({value}s) is not below the visibility timeout ({visibility:g}s): Redis would "
        "hand the task to a second worker while the first still has it"
        for name, value in limits.items()
        if value is not None and float(value) >= visibility
    ]


def _eviction_problems(store: redis.Redis) -> list[str]:
    try:
        policy = str(store.config_get("maxmemory-policy").get("maxmemory-policy", ""))
    except redis.ResponseError:
        logger.warning("cannot read the Redis maxmemory-policy (CONFIG is not allowed); check it")
        return []
    if policy and policy not in _SAFE_EVICTION:
        return [f"Redis maxmemory-policy is {policy}: it may evict the compensation stack"]
    return []
