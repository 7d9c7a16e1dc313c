"""The worker's start-up guard: refuse to run with a configuration that breaks the guarantees.

Each check names a guarantee: JSON only (a pickle message is code execution), acks late (a
step is acknowledged only once its outcome and undo are recorded), a time limit, and a
visibility timeout above every tool's longest retry delay plus that time limit (or Redis hands
a running step to a second worker), a Redis that never evicts (the stack is workflow state),
and a records database whose schema is not behind the code.
"""

from __future__ import annotations

import base64
import json
import logging
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import redis
from sqlalchemy.exc import SQLAlchemyError

from saga.errors import DatabaseSchemaError
from saga.records import migrations
from saga.retry import RetryPolicy
from saga.settings import Settings

if TYPE_CHECKING:
    from saga.core import Core

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
    problems += _tls_problems(conf)
    for store in stores:
        problems += _eviction_problems(store)
    return problems


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
    too_slow: dict[float, list[str]] = {}
    for tool, policy in retry_policies.items():
        delay = longest_retry_delay(policy)
        if delay + limit + RUN_TIME_MARGIN >= visibility:
            too_slow.setdefault(delay, []).append(tool)
    for delay, tools in sorted(too_slow.items()):
        named = f"tool {tools[0]}" if len(tools) == 1 else f"tools {', '.join(sorted(tools))}"
        problems.append(
            f"{named}: the longest retry delay ({delay:g}s) plus "
            f"task_time_limit ({limit:g}s) plus a {RUN_TIME_MARGIN:g}s margin is not below the "
            f"visibility timeout ({visibility:g}s): a retried step could run on two workers at "
            "once; shorten the tool's RetryPolicy.backoff_max or raise the visibility timeout"
        )
    return problems


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


# -- shapes the deployed code no longer accepts -----------------------------------------------

#: Runs whose stacks one scan reads at most, and messages per queue (and in the unacked hash):
#: a large deployment is scanned in part, and the report says what was left.
SCAN_RUNS = 10_000
SCAN_MESSAGES = 10_000
_BATCH = 200
_MAX_STACK = 1_000
#: kombu's Redis transport: a priority's list is ``<queue><sep><priority>``.
_KOMBU_SEP = "\x06\x16"
_KOMBU_PRIORITY_STEPS = (0, 3, 6, 9)


@dataclass(frozen=True)
class StaleShape:
    """A stack entry or a queued message that names a tool, or carries arguments, the
    deployed code does not accept: an unwind or a delivery would fail on it."""

    where: str
    problem: str

    def __str__(self) -> str:
        return f"{self.where}: {self.problem}"


@dataclass
class ShapeScan:
    stale: list[StaleShape] = field(default_factory=list)
    runs: int = 0
    messages: int = 0
    #: What the scan did not read (past its caps, a broker it cannot read).
    not_scanned: list[str] = field(default_factory=list)


def stale_shapes(
    core: Core, max_runs: int = SCAN_RUNS, max_messages: int = SCAN_MESSAGES
) -> ShapeScan:
    """Undos on live runs' stacks and messages in the broker's queues that the deployed tools
    would refuse: a tool no longer registered, or arguments its signature no longer takes
    (``docs/deploying-changes.md``). Bounded by ``max_runs`` and ``max_messages``."""
    scan = ShapeScan()
    _scan_stacks(core, scan, max_runs)
    _scan_queues(core, scan, max_messages)
    return scan


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


def unknown_tools(core: Core) -> list[str]:
    """The tools callers published (``saga.tool_hosts``) that this app does not register."""
    from saga.tool_hosts import caller_tools

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


def shape_problem(core: Core, tool_name: str, args: dict[str, Any] | None) -> str:
    """Why the deployed registry refuses a call of ``tool_name`` with ``args`` ('' if it
    takes it; ``args`` None: only the name is checked)."""
    from saga.errors import InvalidArgumentsError, UnknownToolError

    try:
        tool = core.registry.get(tool_name)
        if args is not None:
            tool.validate(args)
    except UnknownToolError:
        return f"tool {tool_name!r} is not registered in this deploy"
    except InvalidArgumentsError as exc:
        return str(exc)
    return ""


def _scan_stacks(core: Core, scan: ShapeScan, limit: int) -> None:
    """The undos an unwind (running, unwinding) or a requeue (escalated, failed) may run."""
    from saga.constants import ACTIVE_RUNS_KEY

    client = core.store.client
    batch: list[str] = []
    for member, _ in client.zscan_iter(ACTIVE_RUNS_KEY, count=_BATCH):
        if scan.runs + len(batch) >= limit:
            total = int(client.zcard(ACTIVE_RUNS_KEY))
            scan.not_scanned.append(f"the stacks of {total - limit} run(s) past the first {limit}")
            break
        batch.append(str(member))
        if len(batch) == _BATCH:
            _check_stacks(core, scan, batch)
            batch = []
    _check_stacks(core, scan, batch)


def _check_stacks(core: Core, scan: ShapeScan, run_ids: list[str]) -> None:
    from saga.constants import run_keys

    with core.store.client.pipeline(transaction=False) as pipe:
        for run_id in run_ids:
            run_key, _, _, stack_key, comps_key = run_keys(run_id)
            pipe.hget(run_key, "state")
            pipe.lrange(stack_key, 0, _MAX_STACK - 1)
            pipe.hgetall(comps_key)
        replies = pipe.execute()
    scan.runs += len(run_ids)
    for i, run_id in enumerate(run_ids):
        state, stack, comps = replies[3 * i : 3 * i + 3]
        if state not in ("running", "unwinding", "escalated"):
            continue
        for raw in stack:
            entry = json.loads(raw)
            step = entry.get("step")
            if entry.get("broken"):
                continue  # never runnable: escalated with the run already
            if state == "escalated" and comps.get(f"{step}:state") != "failed":
                continue  # past the pivot, or done: no requeue runs it
            problem = shape_problem(core, str(entry.get("tool")), entry.get("args") or {})
            if problem:
                where = f"run {run_id} ({state}), the undo of step {step}"
                scan.stale.append(StaleShape(where, problem))


def _scan_queues(core: Core, scan: ShapeScan, limit: int) -> None:
    """The tool and core messages waiting in the broker, and those delivered to a worker but
    not acknowledged yet (kombu's ``unacked`` hash): a worker of this deploy will run them."""
    conf = core.app.conf
    url = str(conf.broker_url or "")
    if not url.startswith(("redis://", "rediss://", "unix://")):
        scan.not_scanned.append(f"the queued messages ({url.partition(':')[0]} broker)")
        return
    options = conf.broker_transport_options or {}
    prefix = str(options.get("global_keyprefix", ""))
    sep = str(options.get("sep", _KOMBU_SEP))
    with core.app.connection_for_read() as connection:
        # kombu's own client (TLS as configured); the keys are prefixed by hand below.
        client = redis.Redis(connection_pool=connection.default_channel.client.connection_pool)
        for queue in sorted(_queues(conf)):
            for priority in options.get("priority_steps", _KOMBU_PRIORITY_STEPS):
                key = f"{queue}{sep}{priority}" if priority else queue
                _scan_list(core, scan, client, prefix + key, f"queue {key!r}", limit)
        unacked = prefix + str(options.get("unacked_key", "unacked"))
        read = 0
        for _, raw in client.hscan_iter(unacked, count=_BATCH):
            if read >= limit:
                left = int(client.hlen(unacked)) - limit
                scan.not_scanned.append(f"{left} unacknowledged message(s) past the first {limit}")
                break
            read += 1
            _check_message(core, scan, raw, "delivered, not acknowledged")
        scan.messages += read


def _queues(conf: Any) -> set[str]:
    from saga.constants import TURN_QUEUE

    names = {str(conf.task_default_queue or "celery"), TURN_QUEUE}
    names.update(str(q.name) for q in conf.task_queues or ())
    routes = conf.task_routes if isinstance(conf.task_routes, dict) else {}
    names.update(str(r["queue"]) for r in routes.values() if isinstance(r, dict) and "queue" in r)
    return names


def _scan_list(
    core: Core, scan: ShapeScan, client: redis.Redis, key: str, where: str, limit: int
) -> None:
    length = int(client.llen(key))
    for start in range(0, min(length, limit), _BATCH):
        for raw in client.lrange(key, start, min(start + _BATCH, limit) - 1):
            _check_message(core, scan, raw, where)
    scan.messages += min(length, limit)
    if length > limit:
        scan.not_scanned.append(f"{length - limit} message(s) of {where} past the first {limit}")


def _check_message(core: Core, scan: ShapeScan, raw: Any, where: str) -> None:
    from saga.constants import TOOL_TASK_PREFIX

    try:
        name, kwargs = _task_call(raw)
    except (ValueError, TypeError, KeyError, IndexError):
        return  # not a Celery message of ours: not this check's business
    if name.startswith(TOOL_TASK_PREFIX):
        compensates = kwargs.get("compensates")
        args = None if compensates is not None else kwargs.get("args") or {}
        problem = shape_problem(core, name[len(TOOL_TASK_PREFIX) :], args)
        what = f"undo of step {compensates}" if compensates is not None else "step"
        what = f"{what} {kwargs.get('step', '')}".strip()
    elif name.startswith("saga.") and name not in core.app.tasks:
        problem, what = f"task {name!r} is not registered in this deploy", "task"
    else:
        return
    if problem:
        run = kwargs.get("run_id", "?")
        scan.stale.append(StaleShape(f"a message in {where} (run {run}, {what})", problem))


def _task_call(raw: Any) -> tuple[str, dict[str, Any]]:
    """The task name and keyword arguments of a kombu Redis message (Celery protocol 2, or 1)."""
    message = json.loads(raw)
    if isinstance(message, list):  # the unacked hash holds [message, exchange, routing key]
        message = message[0]
    body = message["body"]
    if (message.get("properties") or {}).get("body_encoding") == "base64":
        body = base64.b64decode(body)
    decoded = json.loads(body)
    name = (message.get("headers") or {}).get("task")
    if name is None:  # protocol 1: everything is in the body
        return str(decoded["task"]), dict(decoded.get("kwargs") or {})
    return str(name), dict(decoded[1] or {})
