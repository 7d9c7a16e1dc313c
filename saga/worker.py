"""The Celery side: what a ``Saga`` installs on its app so that a worker runs it. One task per
tool (``tools.<name>``, run forward as a step by ``saga.forward`` or backward as a
compensation by ``saga.compensation``), ``saga.conclude_unwind`` and the reaper's task, and the
worker's signals: the start-up guard, the revoke handler (``saga.revoke``), the metrics
endpoint, and what the worker publishes once it is ready.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import click
from celery import Celery, Task
from celery.signals import (
    celeryd_after_setup,
    task_revoked,
    worker_init,
    worker_ready,
    worker_shutdown,
)
from sqlalchemy import func, select

from saga import extras, metrics
from saga.agents.agent import AgentRegistry
from saga.agents.hosted import install_turn_tasks, publish_hosted_agents
from saga.celery_amqp import broker_countdown, consume_turns_only_when_named
from saga.compensation import compensate
from saga.constants import (
    CONCLUDE_UNWIND_TASK,
    NOTIFY_TASK,
    REAP_TASK,
    TURN_QUEUE,
    tool_task_name,
)
from saga.core import Core
from saga.delivery import BUSY_WAIT, from_the_tool
from saga.errors import InvalidArgumentsError
from saga.escalations.invocation import app_spec_of
from saga.fault_points import FAULTS_ENV, faults_enabled
from saga.forward import run_step
from saga.guard import (
    broker_queue_problems,
    configuration_problems,
    index_layout_problems,
    records_schema_problems,
    warn_lease_outlasted_by_failover,
    warn_stale_shapes,
    warn_unconfirmable_writes,
    warn_unknown_tools,
)
from saga.notifications import task as notify_task
from saga.notifications.notifier import Notifier
from saga.reaper import ReapReport
from saga.records import EscalationRecord
from saga.retry import RetryPolicy
from saga.revoke import on_revoked
from saga.soft_limit import kept_for_the_call
from saga.telemetry import traced_tool
from saga.tool_hosts import publish_worker_app, publish_worker_tools
from saga.tools import Tool

logger = logging.getLogger("saga.worker")

_TASK_OPTIONS: dict[str, Any] = {
    "bind": True,
    "acks_late": True,
    "reject_on_worker_lost": True,
    "max_retries": None,  # the tool's RetryPolicy decides, counted in Redis across redeliveries
    "ignore_result": True,  # outcomes live in the saga store, where the agent reads them
    "shared": False,
}


def install(
    app: Celery,
    core: Core,
    *,
    agents: AgentRegistry,
    notifier: Notifier,
    reap: Callable[[], ReapReport],
) -> None:
    """Register every tool of ``core.registry``, the hosted loop's and the notices' tasks, the
    conclude and reap tasks (``reap``: the facade's pass), the start-up guard and the revoke
    handler on ``app``."""
    for tool in core.registry:
        install_tool(app, core, tool)
    install_turn_tasks(app, core, agents)
    worker_ready.connect(
        lambda sender=None, **_: publish_hosted_agents(core, agents),
        weak=False,
        dispatch_uid=f"saga-agents-{id(app)}",
    )
    worker_ready.connect(
        lambda sender=None, **_: publish_worker_tools_of(core),
        weak=False,
        dispatch_uid=f"saga-tools-{id(app)}",
    )
    notify_task.install_notify_task(app, notifier)
    _install_metrics(app, core)

    @app.task(name=REAP_TASK, bind=True, ignore_result=True, shared=False)
    def reap_task(self: Task) -> dict[str, int]:
        report = reap()
        # Only the scheduled task marks a pass (not ``saga reap`` by hand): it shows beat runs.
        core.store.note_reaper_pass()
        return {
            "examined": report.examined,
            "abandoned": len(report.abandoned),
            "in_doubt": len(report.in_doubt),
            "never_started": len(report.never_started),
            "resumed": len(report.resumed),
        }

    def refuse_unsafe_configuration(sender: Any = None, **_: Any) -> None:
        try:
            problems = guard_problems(core)
            # Only here, not in guard_problems: ``saga doctor`` asks that, and must not migrate.
            problems += records_schema_problems(core.settings)
        except Exception as exc:  # a guard that cannot look must not wave the worker through
            problems = [f"the configuration could not be checked: {exc!r}"]
        if faults_enabled():
            logger.warning("FAULT INJECTION IS ENABLED (%s=1): never in production", FAULTS_ENV)
        for warn in (
            warn_stale_shapes,  # logs what an unwind would meet; never refuses
            warn_unknown_tools,  # names what callers know and this worker lacks
            warn_unconfirmable_writes,  # too few replicas for SAGA_REDIS_CONFIRM_REPLICAS
            warn_lease_outlasted_by_failover,  # a turn's lease shorter than a failover
        ):
            try:  # a warning that cannot look must not skip the refusal below
                warn(core)
            except Exception:
                logger.exception("saga: the start-up check %s failed", warn.__name__)
        if problems:
            message = "saga: refusing to start the worker:\n  - " + "\n  - ".join(problems)
            logger.critical(message)
            print(message, file=sys.stderr)
            # Celery's signal dispatch swallows exceptions, not SystemExit.
            raise SystemExit(78)

    def consume_as_on_redis(sender: Any = None, instance: Any = None, **_: Any) -> None:
        if instance is not None and consume_turns_only_when_named(instance.app.amqp.queues):
            logger.info(
                "not consuming %s (no -Q given): start a turn worker with -Q %s, or name both "
                "queues (-Q celery,%s)",
                TURN_QUEUE,
                TURN_QUEUE,
                TURN_QUEUE,
            )

    def step_revoked(sender: Any = None, request: Any = None, **info: Any) -> None:
        killed = bool(info.get("terminated")) and info.get("signum") == signal.SIGKILL
        on_revoked(core, request, bool(info.get("terminated")), killed=killed)

    # After logging is set up (so the refusal reaches --logfile), before the pool starts.
    celeryd_after_setup.connect(
        refuse_unsafe_configuration, weak=False, dispatch_uid=f"saga-guard-{id(app)}"
    )
    celeryd_after_setup.connect(
        consume_as_on_redis, weak=False, dispatch_uid=f"saga-turn-queue-{id(app)}"
    )
    task_revoked.connect(step_revoked, weak=False, dispatch_uid=f"saga-revoked-{id(app)}")

    @app.task(name=CONCLUDE_UNWIND_TASK, **{**_TASK_OPTIONS, "max_retries": 20})
    def conclude_unwind(
        self: Task, run_id: str, owner: str = "", sent_at: float | None = None
    ) -> str:
        try:
            return core.conclude(run_id, owner, sent_at).value
        except Exception as exc:
            # The records database may be down: keep the run unwinding and try again.
            attempt = self.request.retries + 1
            countdown = broker_countdown(self.app.conf, _CONCLUDE_RETRY.delay(attempt))
            raise self.retry(exc=exc, countdown=countdown) from exc


def guard_problems(core: Core, check_redis: bool = True, check_broker: bool = True) -> list[str]:
    """What the start-up guard finds wrong with ``saga``'s app (``saga doctor`` asks too,
    ``check_redis=False`` and ``check_broker=False`` when it has looked at the stack's Redis
    and the broker's queues itself)."""
    stores = core.store.servers() if check_redis else []
    problems = configuration_problems(core.app.conf, _delays(core), stores)
    if check_redis:
        problems += index_layout_problems(core.store)
    if check_broker:
        problems += broker_queue_problems(core.app)
    return problems + notify_task.configuration_problems(core.settings.notifications, core.app.conf)


#: Retrying a conclusion (its records database was away): short delays, well below any
#: visibility timeout, so the message is never handed to a second worker meanwhile.
_CONCLUDE_RETRY = RetryPolicy(attempts=20, backoff=0.5, backoff_max=1.0)


def _delays(core: Core) -> dict[str, RetryPolicy]:
    """Every delay a worker may hold a message for, by who asks for it (the guard's input)."""
    delays = {
        **{tool.name: tool.retry for tool in core.registry},
        CONCLUDE_UNWIND_TASK: _CONCLUDE_RETRY,
        "a delivery waiting for another's lease": BUSY_WAIT,
    }
    if core.settings.notifications.sinks:  # else this worker has no notice to deliver
        delays[f"{NOTIFY_TASK} (SAGA_NOTIFY_BACKOFF_MAX)"] = notify_task.retry_policy(
            core.settings.notifications
        )
    return delays


#: ``celery worker --metrics-port N`` (or ``SAGA_METRICS_PORT``): serve Prometheus metrics.
METRICS_PORT_OPTION = "--metrics-port"


def _metrics_port_needs_the_client(ctx: Any, param: Any, value: int | None) -> int | None:
    """Refuse ``--metrics-port`` (or ``SAGA_METRICS_PORT``) at once, naming the extra, when
    prometheus-client is not installed: a worker without the endpoint it was asked for would
    look healthy while nothing scrapes it."""
    if value is not None and not metrics.installed():
        raise click.BadParameter(
            f"needs prometheus-client, which is not installed: {extras.install_hint('metrics')}",
            ctx,
            param,
        )
    return value


def _install_metrics(app: Celery, core: Core) -> None:
    """The worker option, and the server started in the worker's main process before the
    pool forks (its children write multiprocess files the server sums)."""
    options = app.user_options["worker"]
    if not any(METRICS_PORT_OPTION in getattr(o, "opts", ()) for o in options):
        options.add(
            click.Option(
                [METRICS_PORT_OPTION],
                type=int,
                default=None,
                envvar="SAGA_METRICS_PORT",
                callback=_metrics_port_needs_the_client,
                help="Serve saga's Prometheus metrics on this port (SAGA_METRICS_ADDR: address).",
            )
        )
    servers: list[metrics.MetricsServer] = []

    def start(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is not app:
            return
        port = (getattr(sender, "options", None) or {}).get("metrics_port")
        if port is None:
            return
        address = os.environ.get("SAGA_METRICS_ADDR") or "127.0.0.1"
        try:
            server = metrics.MetricsServer(int(port), address, lambda: _open_escalations(core))
        except Exception as exc:  # Celery logs a signal handler's error and starts anyway
            raise SystemExit(
                f"saga: refusing to start: {METRICS_PORT_OPTION} {port}: {exc}"
            ) from exc
        servers.append(server)

    def stop(**_: Any) -> None:
        while servers:
            servers.pop().close()

    worker_init.connect(start, weak=False, dispatch_uid=f"saga-metrics-{id(app)}")
    worker_shutdown.connect(stop, weak=False, dispatch_uid=f"saga-metrics-stop-{id(app)}")


def _open_escalations(core: Core) -> int:
    query = select(func.count()).where(EscalationRecord.resolved.is_(False))
    with core.records.engine.connect() as connection:
        return int(connection.execute(query).scalar_one())


def publish_worker_tools_of(core: Core) -> None:
    """Say which tools this worker runs, once it is ready (after every import of the app, so
    a tool registered late is in), for callers to refuse the others at once; and how its
    ``Saga`` is imported, for the commands a ``saga`` run without ``--app`` prints."""
    try:
        publish_worker_tools(core.store.client, [tool.name for tool in core.registry])
        spec = app_spec_of(core.app_object, core.settings.app)
        if spec:
            publish_worker_app(core.store.client, spec)
    except Exception:
        logger.exception("could not publish the tools this worker runs")


def install_tool(app: Celery, core: Core, tool: Tool) -> None:
    @app.task(name=tool_task_name(tool.name), **_TASK_OPTIONS)
    @traced_tool(tool)  # timed by outcome, and a span (saga.telemetry)
    def run_tool(
        self: Task,
        run_id: str,
        step: int | None = None,
        args: dict[str, Any] | None = None,
        compensates: int | None = None,
        unwind: str = "",
    ) -> Any:
        try:
            with kept_for_the_call(f"{tool.name}[{self.request.id}]"):
                if compensates is not None:
                    return compensate(core, self, tool, run_id, compensates, unwind)
                if step is None:
                    raise InvalidArgumentsError(f"{tool.name} task needs a step or a compensation")
                return run_step(core, self, tool, run_id, step, args or {})
        except Exception as exc:
            # A tool's failure, recorded: Celery copies, formats, logs, pickles to the pool's
            # parent and sends in its ``task-failed`` event the traceback of what the task
            # raised, and saga's delivery between this frame and the tool's code was most of
            # it. They get the tool's own frames, under this one.
            raised = from_the_tool(exc)
            if raised is None:
                raise
            raise exc.with_traceback(raised)  # noqa: B904 - itself: its cause and context kept
