"""The worker's start-up guard: refuse to run with a configuration that breaks the guarantees.

Each check names a guarantee: JSON only (a pickle message is code execution), acks late (a
step is acknowledged only once its outcome and undo are recorded), a visibility timeout above
every time limit and retry delay (or Redis hands a running step to a second worker), and a
Redis that never evicts (the stack is workflow state).
"""

from __future__ import annotations

import logging
import ssl
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
    problems += _tls_problems(conf)
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


def _tls_problems(conf: Any) -> list[str]:
    """A rediss:// URL without certificate checks is encryption to whoever answers."""
    problems = []
    for url_setting, ssl_setting in (
        ("broker_url", "broker_use_ssl"),
        ("result_backend", "redis_backend_use_ssl"),
    ):
        url = str(conf.get(url_setting) or "")
        if not url.startswith("rediss://"):
            continue
        options = conf.get(ssl_setting) or {}
        in_url = "ssl_cert_reqs=required" in url.lower() or "cert_required" in url.lower()
        if options.get("ssl_cert_reqs") != ssl.CERT_REQUIRED and not in_url:
            problems.append(
                f"{url_setting} is rediss:// without certificate checks: set {ssl_setting} "
                "ssl_cert_reqs=CERT_REQUIRED (SAGA_REDIS_SSL_CA in celeryconfig.py)"
            )
    return problems


def _eviction_problems(store: redis.Redis) -> list[str]:
    try:
        config = store.config_get("maxmemory-policy")
        persistence = store.config_get("appendonly")
    except redis.AuthenticationError as exc:
        return [f"the stack's Redis refused the credentials: {exc}"]
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        return [f"the stack's Redis cannot be reached: {exc}"]
    except redis.ResponseError:
        logger.warning("cannot read the Redis maxmemory-policy (CONFIG is not allowed); check it")
        return []
    policy = str(config.get("maxmemory-policy", ""))
    if persistence.get("appendonly") == "no":
        # Fine for development; in production a Redis crash would lose every stack.
        logger.warning("the stack's Redis runs without AOF (appendonly no): see docs/durability.md")
    if policy and policy not in _SAFE_EVICTION:
        return [f"Redis maxmemory-policy is {policy}: it may evict the compensation stack"]
    return []
