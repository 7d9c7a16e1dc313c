"""The worker's start-up guard: refuse to run with a configuration that breaks the guarantees.

Each check names a guarantee: JSON only (a pickle message is code execution), acks late (a
step is acknowledged only once its outcome and undo are recorded), a time limit, and a
visibility timeout above every tool's longest retry delay plus that time limit (or Redis hands
a running step to a second worker; on RabbitMQ, its consumer timeout, and no queue of saga's
already declared as another type), a Redis that never evicts (the stack is workflow state),
and a records database whose schema is not behind the code.

It also warns, and never refuses, about what this deploy does not know: undos and queued
messages its tools would refuse (``saga.stale_shapes``), and tools callers know that it does
not register.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import redis
from sqlalchemy.exc import SQLAlchemyError

from saga.agents.lease import TURN_LEASE_SECONDS
from saga.broker_queues import queue_conflicts
from saga.celery_amqp import CONSUMER_TIMEOUT_ENV, consumer_timeout
from saga.core import Core
from saga.errors import ConfigurationError, DatabaseSchemaError, StoreUnavailableError
from saga.records import migrations
from saga.retry import RetryPolicy
from saga.settings import Settings, is_amqp_url
from saga.stack import RunStore
from saga.stale_shapes import stale_shapes
from saga.tool_hosts import caller_tools

logger = logging.getLogger("saga.guard")

#: Celery's default visibility timeout for the Redis transport.
_REDIS_DEFAULT_VISIBILITY = 3600
_SAFE_EVICTION = ("noeviction",)
#: Between Redis delivering a message and the worker starting it, and between the end of the
#: run and the ack, a little time passes; clocks of the hosts involved may differ a little.
RUN_TIME_MARGIN = 1.0


def configuration_problems(
    conf: Any, retry_policies: Mapping[str, RetryPolicy], stores: Iterable[redis.Redis]
) -> list[str]:
    """Every reason the worker must not start; empty if it may.

    ``retry_policies`` maps each tool's name to its retry policy, so a refusal can say which
    tool to change.
    """
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
        problems += _visibility_problems(conf, retry_policies)
    elif is_amqp_url(str(conf.get("broker_url") or "")):
        problems += _consumer_timeout_problems(conf, retry_policies, consumer_timeout())
    problems += _tls_problems(conf)
    for store in stores:
        problems += _eviction_problems(store)
    return problems


def index_layout_problems(store: RunStore) -> list[str]:
    """The store's cross-run indexes sharded otherwise than this worker would shard them
    (``SAGA_INDEX_SHARDS``): it would index its runs where the others never look. A store
    that does not answer is the eviction check's to report."""
    try:
        store.check_layout(force=True)
    except ConfigurationError as exc:
        return [str(exc)]
    except StoreUnavailableError:
        pass
    return []


def records_schema_problems(settings: Settings) -> list[str]:
    """Bring the records' schema to head before the pool starts (once per worker rather than
    once per pool child), or only check it with ``SAGA_DB_AUTO_UPGRADE=0``. A schema behind
    the code never heals by itself: refuse. A database that does not answer is no reason to:
    runs are recorded once it does (the reaper retries)."""
    try:
        if settings.database_auto_upgrade:
            migrations.upgrade(settings.database_url)
        else:
            migrations.check(settings.database_url)
    except DatabaseSchemaError as exc:
        return [str(exc)]
    except SQLAlchemyError as exc:
        logger.warning("saga: the records database did not answer at start-up: %s", exc)
    return []


def longest_retry_delay(policy: RetryPolicy) -> float:
    """The longest countdown ``policy`` ever asks for: a retry follows attempts 1 to
    ``attempts - 1`` only, and jitter only shortens the delay."""
    if policy.attempts < 2:
        return 0.0
    try:
        return replace(policy, jitter=False).delay(policy.attempts - 1)
    except OverflowError:  # thousands of attempts: the doubling has long reached the cap
        return policy.backoff_max


def _visibility_problems(conf: Any, retry_policies: Mapping[str, RetryPolicy]) -> list[str]:
    """Redis hands an unacknowledged message to another worker once the visibility timeout
    has passed since it was delivered. A retry is delivered at once, held by the worker for
    its countdown, then run for up to the time limit; so for every tool the countdown and
    the time limit together must end before the visibility timeout does."""
    options = conf.get("broker_transport_options") or {}
    visibility = float(options.get("visibility_timeout", _REDIS_DEFAULT_VISIBILITY))
    problems = []
    raw_limit = conf.get("task_time_limit")
    limit = float(raw_limit or 0)
    if limit <= 0:
        problems.append(
            f"task_time_limit is {raw_limit!r}: on a Redis broker nothing would bound how long "
            "a step holds its message, so Redis could hand it to a second worker while the "
            "first still runs it; set a time limit below the visibility timeout"
        )
    for name in ("task_time_limit", "task_soft_time_limit"):
        value = conf.get(name)
        if value is not None and float(value) >= visibility:
            problems.append(
                f"{name} ({value}s) is not below the visibility timeout ({visibility:g}s): Redis "
                "would hand the task to a second worker while the first still has it"
            )
    if limit >= visibility:
        return problems  # every tool would be named below for the same reason
    for delay, named in _held_past(retry_policies, limit, visibility):
        problems.append(
            f"{named}: the longest retry delay ({delay:g}s) plus "
            f"task_time_limit ({limit:g}s) plus a {RUN_TIME_MARGIN:g}s margin is not below the "
            f"visibility timeout ({visibility:g}s): a retried step could run on two workers at "
            "once; shorten the tool's RetryPolicy.backoff_max or raise the visibility timeout"
        )
    return problems


def _held_past(
    retry_policies: Mapping[str, RetryPolicy], limit: float, timeout: float
) -> list[tuple[float, str]]:
    """The longest retry delays whose hold, with the time limit and the margin, reaches
    ``timeout``: each with the tools that ask for it, named for a refusal."""
    too_slow: dict[float, list[str]] = {}
    for tool, policy in retry_policies.items():
        delay = longest_retry_delay(policy)
        if delay + limit + RUN_TIME_MARGIN >= timeout:
            too_slow.setdefault(delay, []).append(tool)
    return [
        (delay, f"tool {tools[0]}" if len(tools) == 1 else f"tools {', '.join(sorted(tools))}")
        for delay, tools in sorted(too_slow.items())
    ]


def _consumer_timeout_problems(
    conf: Any, retry_policies: Mapping[str, RetryPolicy], timeout: float
) -> list[str]:
    """RabbitMQ closes the channel of a consumer that holds a delivery unacknowledged past its
    ``consumer_timeout`` and gives the message to another worker: a step would run twice, and
    every other delivery of that channel would be redelivered with it. With acks late a step
    holds its message while it runs, and a retry its worker holds for its countdown (on
    classic queues, or a countdown below a second) too: the same sum as Redis's visibility
    timeout, counted conservatively."""
    fix = (
        f"raise consumer_timeout in rabbitmq.conf (milliseconds, e.g. consumer_timeout = "
        f"3600000) and set {CONSUMER_TIMEOUT_ENV} to it in seconds"
    )
    limit = float(conf.get("task_time_limit") or 0)
    if limit <= 0:
        return [
            f"task_time_limit is {conf.get('task_time_limit')!r}: on RabbitMQ a step running "
            f"past the consumer timeout ({timeout:g}s, {CONSUMER_TIMEOUT_ENV}) is handed to a "
            "second worker while the first still runs it; set a time limit below it"
        ]
    if limit + RUN_TIME_MARGIN >= timeout:
        return [
            f"task_time_limit ({limit:g}s) plus a {RUN_TIME_MARGIN:g}s margin is not below "
            f"RabbitMQ's consumer timeout ({timeout:g}s, {CONSUMER_TIMEOUT_ENV}): a step could "
            f"run on two workers at once; lower the time limit or {fix}"
        ]
    return [
        f"{named}: the longest retry delay ({delay:g}s) plus task_time_limit ({limit:g}s) plus "
        f"a {RUN_TIME_MARGIN:g}s margin is not below RabbitMQ's consumer timeout ({timeout:g}s, "
        f"{CONSUMER_TIMEOUT_ENV}): a retried step could run on two workers at once; shorten "
        f"the tool's RetryPolicy.backoff_max or {fix}"
        for delay, named in _held_past(retry_policies, limit, timeout)
    ]


def broker_queue_problems(app: Any) -> list[str]:
    """A saga queue RabbitMQ already has with other arguments (classic where saga declares
    quorum): refused at start-up, with how to migrate, rather than as a consumer failing in a
    loop. A broker that does not answer yet is no reason to refuse: the worker waits for it."""
    try:
        return queue_conflicts(app)
    except Exception as exc:
        logger.warning("saga: could not look at the broker's queues at start-up: %r", exc)
        return []


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


# -- warnings: what this deploy does not know ----------------------------------------------


def warn_stale_shapes(core: Core) -> None:
    """The worker's start-up: warn, never refuse. The deploy being started may be the fix, and
    a stale undo fails loudly at unwind (the run escalates, requeueable with corrected
    arguments); refusing to start would leave every other run without a worker."""
    try:
        scan = stale_shapes(core)
    except Exception as exc:
        logger.warning("saga: could not look for stale stack entries and messages: %r", exc)
        return
    for item in scan.stale[:20]:
        logger.warning("saga: the deployed code does not accept %s", item)
    if len(scan.stale) > 20:
        logger.warning("saga: ... and %d more (`saga doctor` lists them)", len(scan.stale) - 20)
    for part in scan.not_scanned:
        logger.warning("saga: stale shapes not looked for in %s", part)


def warn_unconfirmable_writes(core: Core) -> None:
    """The worker's start-up, with ``replicas_to_confirm`` set: warn, never refuse (a replica
    may be restarting), when the master has fewer replicas than each write that counts waits
    for, or does not refuse writes it cannot replicate (``min-replicas-to-write``)."""
    wanted = core.settings.replicas_to_confirm
    if wanted <= 0:
        return
    servers = core.store.servers()  # on a cluster, every master: the fewest replicas count
    try:
        replicas = min(int(s.info("replication").get("connected_slaves", 0)) for s in servers)
    except redis.RedisError as exc:
        logger.warning("saga: could not count the stack's Redis replicas: %r", exc)
        return
    if replicas < wanted:
        logger.warning(
            "saga: the stack's Redis has %d replica(s), fewer than the %d each write that "
            "counts waits for (SAGA_REDIS_CONFIRM_REPLICAS): those writes are unavailable "
            "until enough replicas answer",
            replicas,
            wanted,
        )
    try:
        floor = min(
            int(s.config_get("min-replicas-to-write").get("min-replicas-to-write") or 0)
            for s in servers
        )
    except redis.RedisError:  # CONFIG not allowed: the deployment's own check
        return
    if floor < wanted:
        logger.warning(
            "saga: the stack's Redis has min-replicas-to-write %d: set it to %d, so a master cut "
            "off from its replicas refuses writes a failover would discard (docs/deployment.md)",
            floor,
            wanted,
        )


#: What a Sentinel failover takes beyond its ``down-after-milliseconds``: the election, the
#: promotion, and the clients finding the new master (about 1-2 s measured here; margin kept).
FAILOVER_BEYOND_DOWN_AFTER = 5.0


def lease_failover_problem(core: Core) -> str | None:
    """On a Sentinel store: whether a failover can outlast a hosted turn's asking lease. The
    keeper cannot renew it while no master answers; a lease that runs out there leaves the
    turn to the asker fence (``saga.agents.lease``): only a keeper that renews within the
    fence keeps another delivery from asking the model again, and a dead asker's turn waits a
    fence longer. On a Redis Cluster the same holds of its ``cluster-node-timeout``."""
    lease = min(core.lease_seconds, TURN_LEASE_SECONDS)
    if core.store.clustered:
        return _cluster_failover_problem(core, lease)
    pool = getattr(core.store.client, "connection_pool", None)
    manager, master = getattr(pool, "sentinel_manager", None), getattr(pool, "service_name", "")
    if manager is None:
        return None
    for sentinel in manager.sentinels:
        try:
            down_after = float(sentinel.sentinel_master(master)["down-after-milliseconds"]) / 1000
        except (redis.RedisError, KeyError, TypeError, ValueError):
            continue  # another sentinel may answer
        if down_after + FAILOVER_BEYOND_DOWN_AFTER < lease:
            return None
        return (
            f"a failover of master {master!r} takes its down-after-milliseconds "
            f"({down_after:g} s) and more, longer than a hosted turn's asking lease "
            f"({lease:g} s, the task time limit plus the lease margin, at most "
            f"{TURN_LEASE_SECONDS:g} s): a model call running across it is kept from being "
            "asked a second time only by its asker renewing within the asker fence. Lower "
            "down-after-milliseconds or raise SAGA_TASK_TIME_LIMIT (docs/durability.md)"
        )
    return None


def _cluster_failover_problem(core: Core, lease: float) -> str | None:
    """``lease_failover_problem`` on a cluster: a master is judged failed after the nodes'
    ``cluster-node-timeout``, then its replica is elected and promoted."""
    try:
        found = core.store.servers()[0].config_get("cluster-node-timeout")
        timeout = float(str(found["cluster-node-timeout"])) / 1000
    except (redis.RedisError, KeyError, IndexError, TypeError, ValueError):
        return None  # CONFIG not allowed: the deployment's own check
    if timeout + FAILOVER_BEYOND_DOWN_AFTER < lease:
        return None
    return (
        f"a Redis Cluster master's failover takes its cluster-node-timeout ({timeout:g} s) and "
        f"more, longer than a hosted turn's asking lease ({lease:g} s, the task time limit "
        f"plus the lease margin, at most {TURN_LEASE_SECONDS:g} s): a model call running "
        "across it is kept from being asked a second time only by its asker renewing within "
        "the asker fence. Lower cluster-node-timeout or raise SAGA_TASK_TIME_LIMIT "
        "(docs/durability.md)"
    )


def warn_lease_outlasted_by_failover(core: Core) -> None:
    """The worker's start-up: warn, never refuse (nothing is applied twice; a model call may
    be paid for twice), when ``lease_failover_problem`` finds one."""
    problem = lease_failover_problem(core)
    if problem is not None:
        logger.warning("saga: %s", problem)


def unknown_tools(core: Core) -> list[str]:
    """The tools callers published (``saga.tool_hosts``) that this app does not register."""
    return sorted(caller_tools(core.store.client) - {tool.name for tool in core.registry})


def warn_unknown_tools(core: Core) -> None:
    """The worker's start-up: warn, never refuse. Callers' entries outlive their deploys (a
    tool removed on purpose stays listed), and a worker refused would take no tool at all."""
    try:
        missing = unknown_tools(core)
    except Exception as exc:
        logger.warning("saga: could not compare the callers' tools with this worker's: %r", exc)
        return
    if missing:
        logger.warning(
            "saga: callers know tools this worker does not register: %s; a message of one of "
            "them would be dropped as unregistered (register them in the app module this "
            "worker imports, or ignore this if they were removed on purpose)",
            ", ".join(missing),
        )
