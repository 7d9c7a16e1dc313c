"""``saga doctor``: is this deployment able to keep its promises?

Each check names what it protects: the stack's Redis must answer, persist (AOF) and never evict;
the broker must answer, and its queues be of the type saga declares (``saga.cli.doctor_broker``,
which also counts their messages and consumers); the records database must answer and be
migrated; workers must be online for the tools (and the turns), beat must be scheduling the
reaper; and the start-up guard must find nothing wrong with the app's settings. Exit 4 when a
service does not answer, 1 when a check fails, 0 otherwise (warnings included).
"""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, cast

import click

from saga.cli.context import Env, ExitCode, Failure, emit_json, mask
from saga.cli.doctor_broker import (
    TIMEOUT,
    Check,
    bare_app,
    broker_check,
    broker_url,
    queues_check,
)
from saga.cli.doctor_broker import (
    probe as _probe,
)
from saga.constants import TOOL_TASK_PREFIX, TURN_QUEUE
from saga.errors import DatabaseSchemaError

# Types only: a command imports these on use (``saga --help`` loads none of them).
if TYPE_CHECKING:
    from celery import Celery

    from saga.engine import Saga

_MARK = {"ok": ("✓", "green"), "warn": ("!", "yellow"), "fail": ("✗", "red"), "skip": ("-", "dim")}
_RECORD_TABLES = ("saga_runs", "saga_escalations")


@click.command()
@click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")
@click.pass_obj
def doctor(env: Env, as_json: bool) -> None:
    """Check Redis (reachable, AOF, noeviction), the broker, the database (reachable,
    migrated), workers and beat online, and the start-up guard's findings."""
    # Imported on use: `saga --help` loads none of a command's imports.
    from rich.table import Table
    from rich.text import Text

    checks = run_checks(env)
    failed = [c for c in checks if c.status == "fail"]
    code = ExitCode.OK
    if failed:
        code = ExitCode.UNREACHABLE if any(c.unreachable for c in failed) else ExitCode.BAD_STATE
    if as_json:
        items = [asdict(c) for c in checks]
        emit_json({"schema_version": 1, "ok": not failed, "exit_code": int(code), "checks": items})
    else:
        table = Table("", "check", "finding", show_header=False, box=None)
        for check in checks:
            mark, style = _MARK[check.status]
            table.add_row(Text(mark, style=style), check.name, check.detail)
        env.console.print(table)
    if failed:
        raise Failure(f"{len(failed)} check(s) failed: {', '.join(c.name for c in failed)}", code)


def run_checks(env: Env) -> list[Check]:
    saga = env.saga_if_any()
    settings = env.settings
    checks = _redis_checks(settings.redis_url, settings.redis_options)
    redis_up = checks[0].status == "ok"
    if redis_up:
        checks.append(_indexes_check(env))
    url = broker_url(saga, settings.redis_url)
    app = saga.app if saga is not None else bare_app(url)
    checks.append(broker_check(app, url))
    broker_up = checks[-1].status == "ok"
    checks += _database_checks(settings.database_url)
    if broker_up:
        worker_checks, served = _worker_checks(app, saga)
        checks += worker_checks
        checks.append(queues_check(app, served))
        checks.append(_tools_check(env, app, saga, redis_up))
    else:
        checks.append(Check("workers", "skip", "the broker does not answer"))
    checks.append(_beat_check(env, saga) if redis_up else Check("beat", "skip", "no Redis"))
    checks.append(_guard_check(saga))
    checks.append(
        _stale_shapes_check(saga) if redis_up else Check("stale shapes", "skip", "no Redis")
    )
    return checks


# -- Redis -------------------------------------------------------------------------------------


def _redis_checks(url: str, options: dict[str, Any]) -> list[Check]:
    # Imported on use: `saga --help` loads none of a command's imports.
    import redis

    from saga.errors import StoreUnavailableError
    from saga.redis_urls import is_cluster, redis_client

    try:
        client = redis_client(
            url,
            socket_timeout=TIMEOUT,
            socket_connect_timeout=TIMEOUT,
            decode_responses=True,
            **options,
        )
        client.ping()
    except redis.AuthenticationError as exc:
        return [Check("redis", "fail", f"{mask(url)} refused the credentials: {exc}", True)]
    except (redis.RedisError, StoreUnavailableError) as exc:
        return [Check("redis", "fail", f"{mask(url)} does not answer: {exc}", True)]
    # On a cluster, each master's own settings: the worst of them is the store's.
    servers = [client]
    if is_cluster(url):
        servers = [node.redis_connection for node in client.get_primaries()]  # type: ignore[attr-defined]
    shape = f", a cluster of {len(servers)} masters" if is_cluster(url) else ""
    checks = [Check("redis", "ok", f"{mask(url)} answers{shape}")]
    try:
        config: dict[str, str] = {}
        for server in servers:
            for name in ("appendonly", "appendfsync", "maxmemory-policy"):
                found = cast(dict[str, str], server.config_get(name))
                if config.get(name) in (None, "yes", "always", "noeviction"):
                    config.update(found)
    except redis.ResponseError as exc:
        unknown = f"CONFIG is not allowed here ({exc}): check appendonly and maxmemory-policy"
        return [*checks, Check("redis persistence", "warn", unknown)]
    finally:
        client.close()
    checks.append(_persistence(config))
    policy = config.get("maxmemory-policy", "")
    if policy in ("", "noeviction"):
        checks.append(Check("redis eviction", "ok", "maxmemory-policy noeviction"))
    else:
        evicts = f"maxmemory-policy {policy}: it may evict a compensation stack (workers refuse)"
        checks.append(Check("redis eviction", "fail", evicts))
    return checks


def _persistence(config: dict[str, str]) -> Check:
    if config.get("appendonly") != "yes":
        lost = "appendonly no: a Redis crash loses every stack (docs/durability.md)"
        return Check("redis persistence", "warn", lost)
    fsync = config.get("appendfsync", "")
    if fsync != "always":
        late = f"AOF with appendfsync {fsync}: an OS crash may lose the last second of pushes"
        return Check("redis persistence", "warn", late)
    return Check("redis persistence", "ok", "AOF, appendfsync always")


# -- broker, database --------------------------------------------------------------------------


def _database_checks(url: str) -> list[Check]:
    # Imported on use: `saga --help` loads none of a command's imports.
    from sqlalchemy import create_engine, inspect, text
    from sqlalchemy.exc import SQLAlchemyError

    arguments: dict[str, Any] = {}
    if url.startswith("postgresql"):
        arguments["connect_timeout"] = int(TIMEOUT)
    engine = create_engine(url, connect_args=arguments)
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
            tables = set(inspect(connection).get_table_names())
    except SQLAlchemyError as exc:
        detail = f"{mask(url)} does not answer: {str(exc).splitlines()[0]}"
        return [Check("database", "fail", detail, True)]
    finally:
        engine.dispose()
    checks = [Check("database", "ok", f"{mask(url)} answers")]
    missing = [t for t in _RECORD_TABLES if t not in tables]
    if missing:
        detail = f"no {', '.join(missing)} yet (`saga db upgrade`, or a worker, creates them)"
        checks.append(Check("database tables", "warn", detail))
    checks.append(_probe("migrations", lambda: _migrations(url)))
    return checks


def _migrations(url: str) -> Check:
    # Imported on use: `saga --help` loads none of a command's imports.
    from saga.records import migrations

    current, head = migrations.status(url)
    if current == head:
        return Check("migrations", "ok", f"at head ({head})")
    try:
        migrations.check(url)
    except DatabaseSchemaError:
        detail = f"at {current or 'no revision'}, head {head}: run `saga db upgrade`"
        return Check("migrations", "fail", detail)
    return Check("migrations", "warn", f"at {current}, newer than this version's head {head}")


# -- workers, beat, guard ----------------------------------------------------------------------


def _worker_checks(app: Celery, saga: Saga | None) -> tuple[list[Check], dict[str, int]]:
    """The workers' checks, and how many of them consume each queue (for the queues')."""
    try:
        # One broadcast (its replies name the workers too), every reply kept as a list:
        # inspect() keys them by node name, so two workers started under the same name
        # (celery@host) would count as one and hide its queues.
        replies = app.control.broadcast("active_queues", reply=True, timeout=TIMEOUT / 2) or []
    except Exception as exc:
        return [Check("workers", "fail", f"could not ask them: {exc}", True)], {}
    names = sorted(name for reply in replies for name in reply)
    if not names:
        return [Check("workers", "fail", "no worker answered")], {}
    served: dict[str, int] = {}
    for reply in replies:
        for found in reply.values():
            for queue in {q["name"] for q in found or []}:
                served[queue] = served.get(queue, 0) + 1
    checks = [Check("workers", "ok", f"{len(names)} online: {', '.join(names)}")]
    shared = sorted({n for n in names if names.count(n) > 1})
    if shared:
        detail = (
            f"several workers answer as {', '.join(shared)}: give each its own -n "
            "(e.g. -n tools@%h, -n turns@%h), or Flower shows one and remote control "
            "reaches one"
        )
        checks.append(Check("worker names", "warn", detail))
    default = str(app.conf.task_default_queue or "celery")
    if default not in served:
        checks.append(Check("tool queue", "fail", f"no worker consumes {default!r} (tools)"))
    if TURN_QUEUE not in served:
        hosted = saga is not None and len(saga.agents) > 0
        detail = f"no worker consumes {TURN_QUEUE!r}: hosted turns and web aborts would wait"
        checks.append(Check("turn queue", "fail" if hosted else "warn", detail))
    return checks, served


def _tools_check(env: Env, app: Celery, saga: Saga | None, redis_up: bool) -> Check:
    """The tools the callers know (as they published them, and the app's own) that a worker
    has not registered: that worker drops their messages, and their steps wait for the
    reaper."""

    def probe() -> Check:
        # Imported on use: `saga --help` loads none of a command's imports.
        from saga.tool_hosts import caller_tools

        known = caller_tools(env.store.client) if redis_up else set()
        if saga is not None:
            known |= {tool.name for tool in saga.registry}
        if not known:
            return Check("tools", "skip", "no caller published its tools, and no app (--app)")
        replies = app.control.inspect(timeout=TIMEOUT / 2).registered() or {}
        if not replies:
            return Check("tools", "skip", "no worker answered")
        lacking = {
            node: sorted(known - _tool_names(tasks or []))
            for node, tasks in sorted(replies.items())
        }
        found = [f"{node} lacks {', '.join(names)}" for node, names in lacking.items() if names]
        if found:
            detail = "; ".join(found)
            return Check(
                "tools",
                "fail",
                f"{detail}: their messages are dropped as unregistered (register them in the "
                "app module the workers import, and restart them)",
            )
        return Check("tools", "ok", f"every worker runs the {len(known)} tool(s) callers know")

    return _probe("tools", probe)


def _tool_names(tasks: list[str]) -> set[str]:
    """Tool names among a worker's registered task names (``tools.<name>``)."""
    return {
        task.split(" ", 1)[0].removeprefix(TOOL_TASK_PREFIX)
        for task in tasks
        if task.startswith(TOOL_TASK_PREFIX)
    }


def _indexes_check(env: Env) -> Check:
    """The cross-run indexes sharded as this process would shard them (``saga indexes``)."""

    def probe() -> Check:
        recorded = env.store.recorded_layout().shards
        configured = env.settings.index_layout().shards
        if recorded != configured:
            detail = (
                f"sharded {recorded} way(s) in the store, {configured} here (SAGA_INDEX_SHARDS): "
                "workers configured so refuse to start; see `saga indexes reshard`"
            )
            return Check("indexes", "fail", detail)
        return Check("indexes", "ok", f"sharded {recorded} way(s), as configured")

    return _probe("indexes", probe)


def _beat_check(env: Env, saga: Saga | None) -> Check:
    interval = _reap_interval(saga)

    def probe() -> Check:
        store = env.store
        last = store.last_reaper_pass()
        module = env.app_spec.partition(":")[0] if saga is not None and env.app_spec else "APP"
        command = f"celery -A {module} beat"
        if last is None:
            return Check("beat", "fail", f"no reaper pass recorded yet: is `{command}` running?")
        age = store.now(exact=True) - last
        if age > 3 * interval + 30:
            stale = f"the last reaper pass was {age:.0f}s ago (every {interval:g}s): `{command}`?"
            return Check("beat", "fail", stale)
        return Check("beat", "ok", f"the reaper ran {age:.0f}s ago (every {interval:g}s)")

    return _probe("beat", probe)


def _reap_interval(saga: Saga | None) -> float:
    if saga is not None:
        entry = (saga.app.conf.beat_schedule or {}).get("saga-reaper") or {}
        schedule = entry.get("schedule")
        if isinstance(schedule, int | float):
            return float(schedule)
    return float(os.environ.get("SAGA_REAP_INTERVAL") or 30)


def _guard_check(saga: Saga | None) -> Check:
    if saga is None:
        return Check("guard", "warn", "skipped: no app to check (--app module:attr or SAGA_APP)")

    def probe() -> Check:
        # Imported on use: `saga --help` loads none of a command's imports.
        from saga.worker import guard_problems

        # Redis and the broker's queues were checked above.
        problems = guard_problems(saga.core, check_redis=False, check_broker=False)
        if problems:
            return Check("guard", "fail", "; ".join(problems))
        return Check("guard", "ok", "the worker's start-up guard finds nothing")

    return _probe("guard", probe)


def _stale_shapes_check(saga: Saga | None) -> Check:
    """Undos on live runs' stacks and queued messages the deployed tools would refuse."""
    if saga is None:
        return Check("stale shapes", "skip", "no app to check them against (--app module:attr)")

    def probe() -> Check:
        # Imported on use: `saga --help` loads none of a command's imports.
        from saga.stale_shapes import stale_shapes

        scan = stale_shapes(saga.core)
        left = f"; not scanned: {'; '.join(scan.not_scanned)}" if scan.not_scanned else ""
        if scan.stale:
            shown = "; ".join(str(s) for s in scan.stale[:10])
            more = f"; and {len(scan.stale) - 10} more" if len(scan.stale) > 10 else ""
            detail = f"{len(scan.stale)} the deployed code refuses: {shown}{more}{left}"
            return Check("stale shapes", "fail", f"{detail} (docs/deploying-changes.md)")
        read = f"{scan.runs} run(s) and {scan.messages} message(s) scanned, all accepted"
        return Check("stale shapes", "warn" if left else "ok", read + left)

    return _probe("stale shapes", probe)
