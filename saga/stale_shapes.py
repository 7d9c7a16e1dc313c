"""Shapes the deployed code no longer accepts: undos on live runs' stacks, and messages in the
broker's queues, that name a tool this deploy does not register or carry arguments its
signature no longer takes (``docs/deploying-changes.md``).

Its own module because the scan is read by two callers for two reasons: ``saga doctor`` lists
what it finds before a deploy, and the worker's start-up guard (``saga.guard``) warns about
it; an unwind, or a delivery, would otherwise be the first to find a stale shape, by failing
on it.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

import redis

from saga.constants import TOOL_TASK_PREFIX, TURN_QUEUE, run_keys
from saga.core import Core
from saga.errors import InvalidArgumentsError, UnknownToolError

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


def shape_problem(core: Core, tool_name: str, args: dict[str, Any] | None) -> str:
    """Why the deployed registry refuses a call of ``tool_name`` with ``args`` ('' if it
    takes it; ``args`` None: only the name is checked)."""
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
    client = core.store.client
    batch: list[str] = []
    members = (
        member
        for key in core.store.layout.every("active")
        for member, _ in client.zscan_iter(key, count=_BATCH)
    )
    for member in members:
        if scan.runs + len(batch) >= limit:
            total = core.store.active_count()
            scan.not_scanned.append(f"the stacks of {total - limit} run(s) past the first {limit}")
            break
        batch.append(str(member))
        if len(batch) == _BATCH:
            _check_stacks(core, scan, batch)
            batch = []
    _check_stacks(core, scan, batch)


def _check_stacks(core: Core, scan: ShapeScan, run_ids: list[str]) -> None:
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
    if not url.startswith(("redis://", "rediss://", "unix://", "sentinel://")):
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
