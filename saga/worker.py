"""The Celery side: one task per tool (``tools.<name>``), run forward as a step or backward as
a compensation, plus ``saga.conclude_unwind``.

The compensation is pushed inside the step's own task, before the message is acknowledged
(``task_acks_late``): a ``link`` callback would be a separate message sent before the result is
stored and the message acked, so a crash could lose the push or make it twice.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from celery import Celery, Task
from celery.canvas import signature
from celery.exceptions import Ignore
from celery.signals import (
    celeryd_after_setup,
    task_revoked,
    worker_init,
    worker_ready,
    worker_shutdown,
)

from saga import extras, metrics, payload
from saga.agents.hosted import install_turn_tasks, publish_hosted_agents
from saga.constants import (
    CONCLUDE_UNWIND_TASK,
    NOTIFY_TASK,
    REAP_TASK,
    TOOL_TASK_PREFIX,
    step_idempotency_key,
    tool_task_name,
)
from saga.effects import UNDO_PROBLEM
from saga.errors import (
    InvalidArgumentsError,
    StepFailedError,
    StepInDoubtError,
    StoreUnavailableError,
    ToolRejected,
)
from saga.fault_points import FAULTS_ENV, faults_enabled
from saga.guard import (
    configuration_problems,
    records_schema_problems,
    warn_stale_shapes,
    warn_unknown_tools,
)
from saga.model import StepContext, ToolClass
from saga.notifications import task as notify_task
from saga.reaper import mark_in_doubt, reconcile
from saga.retry import RetryPolicy
from saga.stack import REVOKE_KILLED
from saga.telemetry import traced_tool
from saga.tool_hosts import publish_worker_app, publish_worker_tools

if TYPE_CHECKING:
    from saga.agents.agent import AgentRegistry
    from saga.core import Core
    from saga.notifications.notifier import Notifier
    from saga.reaper import ReapReport
    from saga.tools import Tool

logger = logging.getLogger("saga.worker")

T = TypeVar("T")

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
        warn_stale_shapes(core)  # logs what an unwind would meet; never refuses
        warn_unknown_tools(core)  # names what callers know and this worker lacks
        if problems:
            message = "saga: refusing to start the worker:\n  - " + "\n  - ".join(problems)
            logger.critical(message)
            print(message, file=sys.stderr)
            # Celery's signal dispatch swallows exceptions, not SystemExit.
            raise SystemExit(78)

    def step_revoked(sender: Any = None, request: Any = None, **info: Any) -> None:
        killed = bool(info.get("terminated")) and info.get("signum") == signal.SIGKILL
        _on_revoked(core, request, bool(info.get("terminated")), killed=killed)

    # After logging is set up (so the refusal reaches --logfile), before the pool starts.
    celeryd_after_setup.connect(
        refuse_unsafe_configuration, weak=False, dispatch_uid=f"saga-guard-{id(app)}"
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
            raise self.retry(exc=exc, countdown=_CONCLUDE_RETRY.delay(attempt)) from exc


def guard_problems(core: Core, check_redis: bool = True) -> list[str]:
    """What the start-up guard finds wrong with ``saga``'s app (``saga doctor`` asks too,
    ``check_redis=False`` when it has looked at the stack's Redis itself)."""
    stores = [core.store.client] if check_redis else []
    problems = configuration_problems(core.app.conf, _delays(core), stores)
    return problems + notify_task.configuration_problems(core.settings.notifications, core.app.conf)


#: Arguments already crossed the broker within the dispatcher's limit: no second limit here.
_NO_LIMIT = 1 << 40

#: Retrying a conclusion (its records database was away): short delays, well below any
#: visibility timeout, so the message is never handed to a second worker meanwhile.
_CONCLUDE_RETRY = RetryPolicy(attempts=20, backoff=0.5, backoff_max=1.0)
#: A delivery that finds another holding the step's (or undo's) lease looks again this soon:
#: short, because every delay a worker holds a message for counts against the visibility
#: timeout (the start-up guard adds it to the time limit).
_BUSY_WAIT = RetryPolicy(attempts=2, backoff=1.0, backoff_max=1.0, jitter=False)


def _delays(core: Core) -> dict[str, RetryPolicy]:
    """Every delay a worker may hold a message for, by who asks for it (the guard's input)."""
    delays = {
        **{tool.name: tool.retry for tool in core.registry},
        CONCLUDE_UNWIND_TASK: _CONCLUDE_RETRY,
        "a delivery waiting for another's lease": _BUSY_WAIT,
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
    import click

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
    import click

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
    from sqlalchemy import func, select

    from saga.records import EscalationRecord

    query = select(func.count()).where(EscalationRecord.resolved.is_(False))
    with core.records.engine.connect() as connection:
        return int(connection.execute(query).scalar_one())


def publish_worker_tools_of(core: Core) -> None:
    """Say which tools this worker runs, once it is ready (after every import of the app, so
    a tool registered late is in), for callers to refuse the others at once; and how its
    ``Saga`` is imported, for the commands a ``saga`` run without ``--app`` prints."""
    from saga.escalations.invocation import app_spec_of

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
        if compensates is not None:
            return _compensate(core, self, tool, run_id, compensates, unwind)
        if step is None:
            raise InvalidArgumentsError(f"{tool.name} task needs a step or a compensation")
        return _forward(core, self, tool, run_id, step, args or {})


def _on_revoked(core: Core, request: Any, terminated: bool, killed: bool = False) -> None:
    """A revoked message is decided from the recorded state, not from Celery's flag: a step no
    delivery began never ran (failed); one that began is in doubt, reconciled once no delivery
    may still be running it (right away unless its lease holds, else by the reaper)."""
    kwargs = getattr(request, "kwargs", None) or {}
    name = str(getattr(request, "name", "") or getattr(request, "task", ""))
    run_id = kwargs.get("run_id")
    if not name.startswith(TOOL_TASK_PREFIX) or run_id is None:
        return
    error = {"type": "Revoked", "message": f"{name} was revoked (terminated: {terminated})"}
    try:
        if kwargs.get("compensates") is not None:
            _compensation_revoked(core, request, run_id, kwargs, error, killed)
            return
        step = int(kwargs["step"])
        outcome = core.store.mark_in_doubt(run_id, step, error, event="revoke")
        if outcome.owns_unwind:
            core.start_unwind(run_id, f"step:{step}")
        elif outcome.status == "in_doubt" and str(outcome.values[0]) == "0":
            reconcile(core, run_id, step)
        elif outcome.status == "in_doubt":
            # Its delivery may still be applying the effect: the reaper asks the lookup once
            # the lease has run out, not before.
            lease = core.picture(run_id).step(step).lease or core.store.now()
            core.store.schedule(run_id, lease)
    except Exception:
        logger.exception("run %s: could not record the revoke of %s", run_id, name)


def _compensation_revoked(
    core: Core,
    request: Any,
    run_id: str,
    kwargs: dict[str, Any],
    error: dict[str, Any],
    killed: bool,
) -> None:
    """Fenced by the unwind's owner: a revoke of a stale chain's message changes nothing. An
    execution killed by SIGKILL is gone: its lease ends with it; any other revoked execution
    may still be undoing, and keeps its lease until it reports."""
    step, unwind = int(kwargs["compensates"]), str(kwargs.get("unwind") or "")
    claim = REVOKE_KILLED if killed else ""
    outcome = core.store.record_compensation(
        run_id, step, "revoke", error, claim=claim, owner=unwind
    )
    if outcome.status != "ok":
        logger.warning("run %s: revoke of undo %d not recorded: %s", run_id, step, outcome)
        return
    # The older compensations and the conclusion still have to run.
    remaining = list(getattr(request, "chain", None) or [])
    _send_rest(core.app, remaining, getattr(request, "id", None), getattr(request, "root_id", None))


def _strike(core: Core, point: str, tool: Tool) -> None:
    if core.faults is not None:
        core.faults.strike(point, tool.name)


def _error(exc: BaseException, attempt: int) -> dict[str, Any]:
    return {"type": type(exc).__name__, "message": str(exc)[:2000], "attempt": attempt}


def _retryable(exc: BaseException) -> bool:
    refused = isinstance(exc, InvalidArgumentsError | ToolRejected)
    return bool(getattr(exc, "retryable", True)) and not refused


def _call(tool: Tool, ctx: StepContext, args: dict[str, Any]) -> Any:
    kwargs = tool.python_args(args)
    if tool.wants_context:
        kwargs["ctx"] = ctx
    return tool.func(**kwargs)


def _forward(
    core: Core, task: Task, tool: Tool, run_id: str, step: int, args: dict[str, Any]
) -> Any:
    store = core.store
    # (The dispatcher applied the size limit; this only has to match what it stored.)
    args_json = payload.dumps(args, what="arguments", limit=_NO_LIMIT)
    claim = _claim(task)
    begin = _patiently(
        core,
        f"run {run_id} step {step}: begin",
        store.begin_step,
        run_id,
        step,
        tool.name,
        args_json,
        claim,
        core.lease_seconds,
    )
    if begin.status == "succeeded":  # a redelivery: replay, never re-apply
        _after_success(core, run_id, step, int(begin.values[1]) == 1, int(begin.values[2]) == 1)
        return payload.loads(begin.values[0])
    if begin.status in ("failed", "rejected"):
        if int(begin.values[1]) == 1:  # a redelivered errback whose unwind was never sent
            core.start_unwind(run_id, f"step:{step}")
        core.step_settled(run_id, step)  # its first delivery may have died before telling
        error = (payload.loads(begin.values[0] or None) or {}).get("message", "failed")
        if begin.status == "rejected":
            return {"rejected": error}
        raise StepFailedError(run_id, step, tool.name, f"{error} (redelivered)")
    if begin.status == "busy":  # another delivery holds the step: come back when it may not
        raise task.retry(countdown=min(float(begin.values[0]), _BUSY_WAIT.backoff_max))
    if begin.status != "run":
        if begin.owns_unwind:
            core.start_unwind(run_id, f"step:{step}")
        if begin.status == "skip":
            core.step_settled(run_id, step)
        log = logger.error if begin.status == "mismatch" else logger.warning
        log("run %s step %d (%s) not run: %s", run_id, step, tool.name, begin)
        raise Ignore()
    attempt, feed_back = int(begin.values[0]), begin.values[1] == "feed_back"
    orphaned = len(begin.values) > 2 and str(begin.values[2]) == "1"
    if attempt > tool.retry.attempts + core.settings.max_redeliveries:
        # Only redeliveries push this far (the worker died mid-step each time): stop looping,
        # and let the lookup say whether the effect happened.
        message = f"started {attempt - 1} times without an outcome (a crash loop?)"
        error = {"type": "AttemptsExceeded", "message": message}
        _in_doubt(core, run_id, step, error)
        raise StepInDoubtError(f"run {run_id} step {step} ({tool.name}): {message}")
    ctx = StepContext(run_id, step, step_idempotency_key(run_id, step), attempt)
    try:
        _strike(core, "before_effect", tool)
        result = _call(tool, ctx, args)
        _strike(core, "after_effect", tool)
    except ToolRejected as exc:  # a business refusal: nothing happened, the model is told
        logger.info("run %s step %d (%s) rejected: %s", run_id, step, tool.name, exc)
        _record_failure(core, run_id, step, _error(exc, attempt), "reject")
        metrics.step(tool.name, "rejected")
        return {"rejected": str(exc)}
    except Exception as exc:
        if _retryable(exc) and tool.retry.allows_another(attempt):
            countdown = tool.retry.delay(attempt)
            hold = countdown + core.lease_seconds
            _patiently(
                core,
                f"run {run_id} step {step}: the retry",
                store.record_retry,
                run_id,
                step,
                _error(exc, attempt),
                hold,
            )
            metrics.step(tool.name, "retried")
            raise task.retry(exc=exc, countdown=countdown) from exc
        event = "reject" if feed_back else "fail"
        error = _error(exc, attempt)
        _settle_final_failure(core, tool, run_id, step, args, error, event, orphaned)
        raise
    _settle_success_patiently(core, tool, run_id, step, args, result, feed_back)
    return result


def _claim(task: Task) -> str:
    """What tells this execution from any other delivery of the same message."""
    return f"{task.request.id or ''}/{uuid.uuid4().hex[:12]}"


def _settle_final_failure(
    core: Core,
    tool: Tool,
    run_id: str,
    step: int,
    args: dict[str, Any],
    error: dict[str, Any],
    event: str = "fail",
    orphaned: bool = False,
) -> None:
    """A write that raised may still have had its effect (a timeout after the request went
    out): where the tool declares a lookup, ask it before concluding that nothing happened.
    ``event``: ``fail`` (the run unwinds) or ``reject`` (its agent feeds failures back).

    ``orphaned``: an earlier delivery began the step and died without an outcome. That this
    attempt raised says nothing about what the dead one did: without a lookup to ask, the
    step is in doubt (a person is told), never taken as not applied."""
    writes = tool.tool_class is not None and tool.tool_class.is_write
    if orphaned and writes and tool.lookup is None:
        message = (
            f"{error.get('message', 'failed')}; an earlier delivery began this step and died "
            "without an outcome, and the tool has no lookup to tell whether it happened"
        )
        logger.warning("run %s step %d (%s) failed: %s", run_id, step, tool.name, message)
        error = {**error, "message": message}
        _in_doubt(core, run_id, step, error)
        metrics.step(tool.name, "failed")
        return
    if tool.lookup is not None and writes:
        try:
            found = tool.lookup(step_idempotency_key(run_id, step), args)
        except Exception as exc:
            logger.exception("run %s step %d: lookup after the failure failed", run_id, step)
            error = {**error, "lookup": f"{type(exc).__name__}: {exc}"}
            _in_doubt(core, run_id, step, error)
            return
        if found is not None:
            logger.warning(
                "run %s step %d (%s) failed, but its lookup found the effect: recording it",
                run_id,
                step,
                tool.name,
            )
            _settle_success_patiently(core, tool, run_id, step, args, found, event == "reject")
            return
    _record_failure(core, run_id, step, error, event)
    metrics.step(tool.name, "failed" if event == "fail" else "rejected")


def _in_doubt(core: Core, run_id: str, step: int, error: dict[str, Any]) -> None:
    """Mark the step in doubt and reconcile it, however briefly the stack's Redis is away (a
    repeat whose first call landed resumes what that call decided)."""
    _patiently(
        core, f"run {run_id} step {step}: in doubt", mark_in_doubt, core, run_id, step, error
    )


def _record_failure(core: Core, run_id: str, step: int, error: dict[str, Any], event: str) -> None:
    outcome = _patiently(
        core,
        f"run {run_id} step {step}: the failure",
        core.store.record_failure,
        run_id,
        step,
        error,
        event,
    )
    if outcome.owns_unwind:
        core.start_unwind(run_id, f"step:{step}")
    # The script checked the step's hosted turn when it settled it (not on a repeat).
    turn_done = int(outcome.values[1]) if outcome.status == "ok" else None
    core.step_settled(run_id, step, turn_done)


def _settle_success_patiently(
    core: Core,
    tool: Tool,
    run_id: str,
    step: int,
    args: dict[str, Any],
    result: Any,
    feed_back: bool = False,
) -> None:
    """The effect happened; recording it must not depend on the broker being up.

    When the stack's Redis is away, a Celery retry would have to publish to that same Redis
    and the message would be dropped. So the task keeps trying itself, for a bounded time;
    the step never looks successful before its undo is pushed. A repeat whose first call did
    land (only the reply was lost) answers what that first call decided. If Redis stays away,
    the exception leaves the message unacknowledged for redelivery (or the reaper's lookup).
    """
    _patiently(
        core,
        f"run {run_id} step {step}: the push",
        _settle_success,
        core,
        tool,
        run_id,
        step,
        args,
        result,
        feed_back,
    )


def _patiently(core: Core, what: str, call: Callable[..., T], *args: Any) -> T:
    """Call ``call`` again while the stack's Redis is unreachable, for a bounded time. Every
    script answers a repeat with what its first call decided, so a call whose reply was lost
    (it ran on the server) is safe to repeat."""
    delay, waited = 0.1, 0.0
    while True:
        try:
            return call(*args)
        except StoreUnavailableError:
            if waited >= core.settings.store_outage_patience:
                raise
            logger.warning("%s: stack unreachable, trying again", what)
            time.sleep(delay)
            waited += delay
            delay = min(delay * 2, 2.0)


def _settle_success(
    core: Core,
    tool: Tool,
    run_id: str,
    step: int,
    args: dict[str, Any],
    result: Any,
    feed_back: bool = False,
) -> None:
    """Record the result, push the undo and mark the pivot in one script.

    An effect that cannot be recorded as it is (``saga.effects``) is still a success with its
    undo pushed, its problem kept as the step's error in the same script, and the run set
    failing there too: always when the undo could not be built (the effect is live with no
    undo), and for a result that cannot be recorded unless the step's failures are fed back
    (``feed_back``: the caller is told and the run goes on, the undo on its stack)."""
    result_json, entry_json, problem = core.encode_effect(tool, run_id, step, args, result)
    fails = ""
    if problem is not None and (problem["type"] == UNDO_PROBLEM or not feed_back):
        fails = f"step {step} ({tool.name}): {problem['message']}"
        logger.error("run %s step %d (%s): %s; the run fails", run_id, step, tool.name, fails)
    elif problem is not None:
        logger.error("run %s step %d (%s): %s", run_id, step, tool.name, problem["message"])
        problem = {**problem, "run_goes_on": True}  # what the caller's error says
    irreversible = tool.tool_class is ToolClass.IRREVERSIBLE_WRITE
    outcome = core.store.record_success(
        run_id, step, result_json, entry_json, irreversible, problem, fails
    )
    if outcome.status in ("ok", "dup", "late"):
        metrics.step(tool.name, "succeeded")
        mine = int(outcome.values[0]) == 1
        turn_done = int(outcome.values[2]) if len(outcome.values) > 2 else None
        _after_success(core, run_id, step, mine, int(outcome.values[1]) == 1, turn_done)
    else:  # never silent: the store logged the refused transition; a person must look
        raise StepFailedError(run_id, step, tool.name, f"its success was refused: {outcome}")


def _after_success(
    core: Core, run_id: str, step: int, mine: bool, late: bool, turn_done: int | None = None
) -> None:
    """What the recorded success decided (the first time, or again on a repeat): start the
    unwind this step came to own, put a run an effect reopened back on the record, and move
    a hosted run on (``turn_done``: see ``Saga.step_settled``)."""
    if late:
        core.landed_late(run_id)
    if mine:
        core.start_unwind(run_id, f"step:{step}")
    core.step_settled(run_id, step, turn_done)


def _compensate(core: Core, task: Task, tool: Tool, run_id: str, step: int, unwind: str) -> Any:
    store = core.store
    claim = _claim(task)
    task_id = str(task.request.id or "")
    begin = _patiently(
        core,
        f"run {run_id} undo {step}: begin",
        store.begin_compensation,
        run_id,
        step,
        claim,
        task_id,
        unwind,
        core.lease_seconds,
    )
    if begin.status in ("done", "failed"):  # settled already (a redelivery): pass the chain on
        logger.info("run %s: compensation of step %d already %s", run_id, step, begin.status)
        _conclude_here(core, task, run_id)
        return {"compensated": step, "replayed": True}
    if begin.status == "busy":  # another execution (or a newer undo) still runs: wait for it
        raise task.retry(countdown=min(float(begin.values[0]), _BUSY_WAIT.backoff_max))
    if begin.status != "run":  # a stale chain, or the run is gone: stop this chain here
        logger.warning("run %s: compensation of step %d not run: %s", run_id, step, begin)
        raise Ignore()
    attempt, entry = int(begin.values[0]), payload.loads(begin.values[1])
    if attempt > tool.retry.attempts + core.settings.max_redeliveries:
        message = f"started {attempt - 1} times without an outcome (a crash loop?)"
        error = {"type": "AttemptsExceeded", "message": message}
        _record_compensation(core, run_id, step, "fail", error, claim)
        metrics.compensation(tool.name, "failed")
        _continue_chain(core, task, run_id)
        raise StepInDoubtError(f"run {run_id}: compensation of step {step}: {message}")
    ctx = StepContext(run_id, step, entry["idempotency_key"], attempt, compensating=True)
    try:
        _strike(core, "before_compensation", tool)
        _call(tool, ctx, entry["args"])
        _strike(core, "after_compensation", tool)
    except Exception as exc:
        if _retryable(exc) and tool.retry.allows_another(attempt):
            _record_compensation(core, run_id, step, "retry", _error(exc, attempt), claim)
            metrics.compensation(tool.name, "retried")
            raise task.retry(exc=exc, countdown=tool.retry.delay(attempt)) from exc
        _record_compensation(core, run_id, step, "fail", _error(exc, attempt), claim)
        metrics.compensation(tool.name, "failed")
        logger.error(
            "run %s: compensation %s of step %d failed for good after %d attempt(s): %s",
            run_id,
            tool.name,
            step,
            attempt,
            exc,
        )
        _continue_chain(core, task, run_id)
        raise
    _record_compensation(core, run_id, step, "done", None, claim)
    metrics.compensation(tool.name, "done")
    _conclude_here(core, task, run_id)
    return {"compensated": step}


def _record_compensation(
    core: Core, run_id: str, step: int, outcome: str, error: dict[str, Any] | None, claim: str
) -> None:
    """An undo's outcome, kept however briefly the stack's Redis is away (a repeat whose first
    call landed is answered as a duplicate)."""
    _patiently(
        core,
        f"run {run_id} undo {step}: {outcome}",
        core.store.record_compensation,
        run_id,
        step,
        outcome,
        error,
        claim,
    )


def _conclude_here(core: Core, task: Task, run_id: str) -> None:
    """When all that is left of this unwind's chain is its conclusion, conclude here rather
    than send it: the call ``saga.conclude_unwind`` would make, one Celery message fewer per
    unwind. The compensation's outcome is recorded already, as it is when the tracer sends
    that message, and a redelivery of this task replays its outcome and comes here again.
    If the conclusion raises (the stack's Redis or the records database away), the message is
    sent as before and retries on its own."""
    chain = task.request.chain
    if not chain or len(chain) != 1:
        return
    following = chain[0]
    kwargs = following.get("kwargs") or {}
    if following.get("task") != CONCLUDE_UNWIND_TASK or kwargs.get("run_id") != run_id:
        return
    try:
        core.conclude(run_id, str(kwargs.get("owner") or ""), kwargs.get("sent_at"))
    except Exception as exc:
        logger.warning("run %s: concluding after its last undo failed (%r): sent", run_id, exc)
        return
    task.request.chain = None  # concluded: Celery's tracer has nothing left to send


def _continue_chain(core: Core, task: Task, run_id: str) -> None:
    """Send the rest of the unwind although this compensation failed.

    The seed's rule: a failed compensation is recorded and the older ones still run. Celery
    stops a chain at a failed task, so the task hands the chain on itself, as Celery's tracer
    does on success (concluding here when nothing else is left), and then fails visibly
    (Flower shows it red).
    """
    _conclude_here(core, task, run_id)
    remaining = list(task.request.chain or [])
    task.request.chain = None
    try:
        _send_rest(task.app, remaining, task.request.id, task.request.root_id)
    except Exception:
        # The failure is recorded; the run stays unwinding and the reaper takes the unwind
        # over at its deadline. The task still fails with the compensation's own error.
        logger.exception("run %s: the rest of the unwind could not be sent", task.request.id)


def _send_rest(app: Celery, remaining: list[Any], parent_id: Any, root_id: Any) -> None:
    if not remaining:
        return
    following = signature(remaining[-1], app=app)
    following.apply_async(chain=remaining[:-1], parent_id=parent_id, root_id=root_id)
