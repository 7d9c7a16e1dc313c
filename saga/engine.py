"""``Saga``: the one object an application builds, shared by the web app that starts runs and
the worker that executes them.

It owns the dispatcher (agent call → Celery task, under the pivot rules), the start of an
unwind (the reverse-order chain of compensation tasks) and a run's conclusion: the fenced state
change, then its SQL records, retried (by the reaper if need be) until they are written; the
run's keys expire only after that.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from celery import Celery
from sqlalchemy.exc import SQLAlchemyError

from saga import metrics, payload, rules, telemetry
from saga.constants import tool_task_name
from saga.effects import encode_effect
from saga.errors import (
    DispatchError,
    RunContendedError,
    RunEndedError,
    RunExistsError,
    StaleRecordError,
    StepsInFlightError,
    UnknownRunError,
)
from saga.hooks import RunListener, SagaHooks
from saga.model import OnFailure, RunState, StepState, ToolClass
from saga.notifications.notifier import Notifier
from saga.picture import RunPicture
from saga.records import EscalationRecord, RecordStore
from saga.settings import Settings
from saga.stack import RunStore
from saga.testing import Faults, faults_enabled
from saga.tool_hosts import CallerTools
from saga.transport import declares_nothing, use_pooled_client_transport
from saga.unwind import send_chain, unwind_chain
from saga.validation import check_deadline, check_flag, check_run_id

if TYPE_CHECKING:
    from saga.agents.agent import Agent, AgentRegistry
    from saga.agents.policies import Policy
    from saga.reaper import ReapReport
    from saga.runs import Run, StepHandle
    from saga.tools import Tool, ToolRegistry

logger = logging.getLogger("saga")

#: How often the dispatcher re-reads a run that changed under it before giving up.
_RESERVE_ATTEMPTS = 100
#: Seconds a delivery's lease outlasts its hard time limit: time to record its outcome.
LEASE_MARGIN_SECONDS = 2.0
#: The lease when the app sets no time limit (the start-up guard refuses that on Redis).
_DEFAULT_TIME_LIMIT = 300.0
#: Characters of a step's arguments shown in Flower (Celery's own repr limit).
_REPR = 1024
#: Seconds past a run's retention before the reaper checks its keys are gone.
_EXPIRY_MARGIN = 60.0


class Saga:
    """Tools, stack and records for one application, wired to one Celery app."""

    def __init__(
        self,
        app: Celery,
        registry: ToolRegistry,
        settings: Settings | None = None,
        hooks: SagaHooks | None = None,
    ) -> None:
        from saga.worker import install

        use_pooled_client_transport(app)
        self.app = app
        self.registry = registry
        self.settings = settings or Settings.from_env()
        self.hooks = hooks or SagaHooks()
        self.store = RunStore.from_url(
            self.settings.redis_url, self.settings.retention_seconds, **self.settings.redis_options
        )
        self._records: RecordStore | None = None
        self._records_lock = threading.Lock()
        #: Publish options by task name (``_publish_options``), worked out on first use.
        self._publish_extra: dict[str, dict[str, Any]] = {}
        #: Fault injection for tests; None unless SAGA_TESTING_FAULTS=1 is set explicitly.
        self.faults: Faults | None = None
        if faults_enabled():
            self.faults = Faults(self.store.client)
        from saga.agents.hosted import HostedLoop

        #: Told when steps settle and when the reaper finds a run idle. The hosted loop is
        #: always one: any worker with the tools moves a hosted run on, agents declared or not.
        self.listeners: list[RunListener] = [HostedLoop(self)]
        self._agents: AgentRegistry | None = None
        self._agents_published = False
        #: Escalation notices to the sinks of ``settings.notifications``.
        self.notifier = Notifier(self)
        #: What this caller knows against what the workers run (``saga.tool_hosts``).
        self.caller_tools = CallerTools(self.store.client, lambda: [t.name for t in registry])
        install(app, self)
        registry.watch(self._tool_added)

    def _tool_added(self, tool: Tool) -> None:
        """A tool registered after this ``Saga`` was built: its task is installed at once, as
        the others were, so a worker that imported the registration runs it."""
        from saga.worker import install_tool

        install_tool(self.app, self, tool)
        self.caller_tools.tool_added(tool.name)

    @property
    def records(self) -> RecordStore:
        """Created on first use, so importing the app never touches the database."""
        with self._records_lock:
            if self._records is None:
                self._records = RecordStore(
                    self.settings.database_url, upgrade=self.settings.database_auto_upgrade
                )
            return self._records

    # -- hosted agents --------------------------------------------------------------------

    @property
    def agents(self) -> AgentRegistry:
        """The agents this app hosts, by name (its turn workers must declare them)."""
        from saga.agents.agent import AgentRegistry

        if self._agents is None:
            self._agents = AgentRegistry(self.registry)
        return self._agents

    def agent(self, name: str, policy: Policy, **options: Any) -> Agent:
        """Declare an agent the workers run by name (see ``saga.agents.Agent``)."""
        return self.agents.declare(name, policy, **options)

    def enqueue_run(self, agent: str, input: str, run_id: str | None = None) -> str:
        """Start a hosted run of ``agent`` and enqueue its first turn; return the run id at
        once. The same ``run_id`` twice starts one run."""
        from saga.agents.hosted import publish_hosted_agents
        from saga.agents.launch import enqueue_run

        if not self._agents_published:  # what this process knows, web apps may read too
            publish_hosted_agents(self)
            self._agents_published = True
        deadline = self.agents.get(agent).deadline or self.settings.run_deadline_seconds
        limit = self.settings.max_payload_bytes
        return enqueue_run(self.store, self.app, agent, input, run_id, deadline, limit)

    def step_settled(self, run_id: str, step: int, turn_done: int | None = None) -> None:
        """The worker recorded a step's outcome: tell the listeners. Never raises: a lost
        notice is repeated by the step's redelivery, or found by the reaper.

        ``turn_done``: what the script that recorded it found about the hosted turn the step
        belongs to (the turn it completed, or 0), or None if it did not look."""
        for listener in self.listeners:
            try:
                listener.step_settled(run_id, step, turn_done)
            except Exception:
                logger.exception("run %s: listener failed on step %d settling", run_id, step)

    def revive_idle(self, run_id: str) -> bool:
        """The reaper's question before abandoning an idle run: does a listener resume it?"""
        for listener in self.listeners:
            try:
                if listener.run_idle(run_id):
                    return True
            except Exception:
                logger.exception("run %s: listener failed to revive it", run_id)
        return False

    # -- runs -----------------------------------------------------------------------------

    def start_run(
        self,
        run_id: str | None = None,
        *,
        allow_reversible_after_pivot: bool = False,
        deadline: float | None = None,
        on_failure: Mapping[str, OnFailure | str] | None = None,
    ) -> Run:
        """Start a run. ``deadline``: seconds without progress before the reaper resolves it.
        ``on_failure``: per tool, ``"feed_back"`` or ``"unwind"`` (``saga.runs.Run``).

        ``run_id`` (default: a random one) must be 1-128 characters of ``[A-Za-z0-9._-]``,
        starting with a letter or digit: it becomes part of Redis keys, task ids and a SQL
        column (``saga.validation``). Bad arguments are refused before anything is written.
        """
        from saga.runs import Run

        run_id = uuid.uuid4().hex if run_id is None else check_run_id(run_id)
        if deadline is None:
            deadline = self.settings.run_deadline_seconds
        else:
            deadline = check_deadline(deadline)
        allow = check_flag("allow_reversible_after_pivot", allow_reversible_after_pivot)
        run = Run(self, run_id, on_failure)  # a bad on_failure is refused before the run exists
        if not self.store.create(run_id, deadline, allow):
            raise RunExistsError(f"run {run_id} already exists")
        metrics.run_started()
        return run

    def run(self, run_id: str, on_failure: Mapping[str, OnFailure | str] | None = None) -> Run:
        """Attach to an existing run (from another process, or after a restart), with this
        process's ``on_failure`` for the calls it makes (``start_run``)."""
        from saga.runs import Run

        run = Run(self, run_id, on_failure)
        if self.store.view(run_id) is None:
            raise UnknownRunError(f"no run {run_id}")
        return run

    def picture(self, run_id: str) -> RunPicture:
        picture = self.store.picture(run_id)
        if picture is None:
            raise UnknownRunError(f"no run {run_id}")
        return picture

    # -- dispatch -------------------------------------------------------------------------

    def dispatch(
        self,
        run_id: str,
        tool_name: str,
        args: dict[str, Any],
        *,
        marker: str = "",
        feed_back_failure: bool = False,
    ) -> StepHandle:
        """Turn one agent-chosen call into a Celery task, or refuse it having changed nothing.

        ``marker`` (the hosted loop's ``<turn>:<call>``) is recorded with the step when it is
        reserved: dispatching the same marker again returns that step, sending its message
        again only if no delivery has begun it (the task's check-before-run makes a second
        message a replay). ``feed_back_failure``: a final failure is ``rejected``, not an
        unwind (the agent tells the model)."""
        from saga.runs import StepHandle

        tool = self.registry.offered(tool_name)
        assert tool.tool_class is not None
        self.caller_tools.check(tool_name)
        wire_args = tool.validate(args)
        args_json = payload.dumps(
            wire_args, what=f"arguments of {tool_name}", limit=self.settings.max_payload_bytes
        )
        on_failure = "feed_back" if feed_back_failure else ""
        step, fresh = self._reserve(
            run_id, tool_name, tool.tool_class, args_json, marker, on_failure
        )
        if not fresh and self.store.step_outcome(run_id, step)[0] != StepState.DISPATCHED:
            return StepHandle(self, run_id, step, tool_name)  # begun or settled already
        try:
            self.app.send_task(
                tool_task_name(tool_name),
                kwargs={"run_id": run_id, "step": step, "args": wire_args},
                task_id=f"{run_id}:{step}",
                # The outcome lives in the saga store: no result backend subscription (a
                # SUBSCRIBE and an UNSUBSCRIBE per step). What Flower shows of the arguments is
                # the JSON already encoded, not a second, recursive repr of them.
                ignore_result=True,
                argsrepr="()",
                kwargsrepr=f"{{'run_id': {run_id!r}, 'step': {step}, 'args': {args_json[:_REPR]}}}",
                **self._publish_options(tool_task_name(tool_name)),
            )
        except Exception as exc:
            error = {"type": type(exc).__name__, "message": str(exc)}
            released = self.store.release(run_id, step, error)
            if released.status == "started":
                # The publish raised, yet the message got through and a worker began the step:
                # the truth is "it is running", and calling again would make a second step.
                logger.warning(
                    "run %s step %d (%s): the broker raised %r but the step is %s; "
                    "returning its handle",
                    run_id,
                    step,
                    tool_name,
                    exc,
                    released.values[0],
                )
                return StepHandle(self, run_id, step, tool_name)
            if released.owns_unwind:
                self.start_unwind(run_id, f"step:{step}")
            raise DispatchError(f"the broker did not take {tool_name}: {exc}") from exc
        return StepHandle(self, run_id, step, tool_name)

    def _publish_options(self, task: str) -> dict[str, Any]:
        """What a message of ``task`` is published with besides its own: no declaration of a
        queue the publish does not need declared (``saga.transport.declares_nothing``)."""
        options = self._publish_extra.get(task)
        if options is None:
            skip = declares_nothing(self.app, task)
            options = self._publish_extra[task] = {"declare": []} if skip else {}
        return options

    def _reserve(
        self,
        run_id: str,
        tool_name: str,
        tool_class: ToolClass,
        args_json: str,
        marker: str,
        on_failure: str,
    ) -> tuple[int, bool]:
        """The step reserved, and whether it is new (False: the marker's earlier step)."""
        gate = rules.gate_for(tool_class)
        for _ in range(_RESERVE_ATTEMPTS):
            outcome = self.store.reserve(
                run_id, tool_name, tool_class, args_json, gate, marker, on_failure
            )
            if outcome.status in ("ok", "dup"):
                return int(outcome.values[0]), outcome.status == "ok"
            if outcome.status == "ended":
                raise RunEndedError(run_id, str(outcome.values[0]))
            view = self.store.view(run_id)
            if outcome.status == "unknown" or view is None:
                raise UnknownRunError(f"no run {run_id}")
            # Refused: say exactly why, from a fresh view (if it moved on meanwhile, retry).
            rules.check_call(view, tool_name, tool_class)
        raise RunContendedError(f"run {run_id} kept changing; call {tool_name} again")

    @property
    def lease_seconds(self) -> float:
        """How long one delivery of a task may still be running: its hard time limit (the
        start-up guard insists on one), plus a margin for the worker to record the outcome."""
        limit = float(self.app.conf.get("task_time_limit") or _DEFAULT_TIME_LIMIT)
        return limit + LEASE_MARGIN_SECONDS

    # -- ending ---------------------------------------------------------------------------

    def complete(self, run_id: str) -> RunPicture:
        # Concluded and read back in one round trip; the picture recorded is the one returned.
        outcome, picture = self.store.complete(run_id)
        if outcome.status == "unknown" or picture is None:
            raise UnknownRunError(f"no run {run_id}")
        if outcome.status == "ended":
            self._record_if_pending(run_id)
            raise RunEndedError(run_id, str(outcome.values[0]))
        if outcome.status == "inflight":
            raise StepsInFlightError(run_id, sorted(int(s) for s in outcome.values))
        if outcome.status != "ok":  # refused (logged by the script's table check): as it is
            return self.picture(run_id)
        # Whoever waits for this run's end is this caller: no signal to send.
        recorded = self._record_or_leave_to_reaper(run_id, picture, notify=False)
        return recorded or self.picture(run_id)

    def fail_to_start(self, run_id: str, reason: str) -> bool:
        """End a running run that never reserved a step (``failed_to_start``): nothing ran,
        so there is nothing to undo. False if it had begun (abort it instead)."""
        outcome = self.store.conclude(run_id, RunState.FAILED_TO_START, reason)
        if outcome.status == "ended":
            raise RunEndedError(run_id, str(outcome.values[0]))
        if outcome.status != "ok":
            return False
        self._record_or_leave_to_reaper(run_id)
        return True

    def abort(self, run_id: str, reason: str, *, version: str = "") -> bool:
        """Unwind the run (or escalate, past its pivot). ``version``: only if the run has not
        moved on since it was read at that version (the reaper's stale-read fence); False
        when it had."""
        outcome = self.store.abort(run_id, f"aborted: {reason}", version)
        if outcome.status == "moved":
            return False
        if outcome.status == "unknown":
            raise UnknownRunError(f"no run {run_id}")
        if outcome.status == "ended":
            raise RunEndedError(run_id, str(outcome.values[0]))
        if outcome.owns_unwind:
            self.start_unwind(run_id, "abort")
        return True

    def start_unwind(self, run_id: str, owner: str) -> bool:
        """Queue the compensations still to run, most recent first, as one Celery chain ending
        in ``saga.conclude_unwind`` (which the last compensation's task makes itself when it
        can: ``saga.worker``); past the pivot, conclude at once (escalate, no unwinding).

        Only the owner of the unwind calls this. It sends first and marks sent after, so a
        crash in between makes the redelivered owner send again (the compensations check
        their recorded state and lease before running), never zero times. False when the
        broker refused the chain (logged; the reaper sends it at the run's deadline).
        """
        picture = self.picture(run_id)
        if picture.pivot_step is not None:
            self.conclude(run_id, owner)
            return True
        signatures = unwind_chain(
            self.app, self.registry, self.store, picture, owner, self._publish_options
        )
        try:
            send_chain(signatures)
        except Exception as exc:
            # Nothing is lost: the run stays unwinding, owned and not sent, so the reaper
            # takes it over at its deadline and sends it again.
            logger.error(
                "run %s: the broker did not take its unwind (%r); the reaper will", run_id, exc
            )
            return False
        self.store.mark_sent(run_id, owner)
        metrics.stack_depth(len(picture.stack))
        logger.info("run %s: unwinding %d compensation(s)", run_id, len(signatures) - 1)
        return True

    def conclude(self, run_id: str, owner: str = "", sent_at: float | None = None) -> RunState:
        """End an unwinding run: compensated, or escalated with the whole picture.

        ``owner`` is the unwind whose chain concludes: a chain the reaper has since replaced
        (its owner died, then its messages came back late) must not end the run early. An
        undo pushed after the chain was sent (an effect that landed late) is sent first.
        ``sent_at``: when the chain was sent (Redis clock), to time the unwind.

        The verdict is judged on one reading of the run and concluded only if the run is still
        at that version; the record is then written from the same reading, with what the
        conclusion changed, instead of reading the run again."""
        for _ in range(_RESERVE_ATTEMPTS):
            picture = self.picture(run_id)
            if picture.state.ended:
                self._record_if_pending(run_id)
                return picture.state
            if picture.state is not RunState.UNWINDING:
                return picture.state
            state, reason = rules.conclusion(picture)
            reason = reason or picture.reason
            outcome = self.store.conclude(run_id, state, reason, owner, picture.version)
            if outcome.status != "moved":
                break
        else:
            raise RunContendedError(
                f"run {run_id} kept changing; its conclusion is left to the reaper"
            )
        if outcome.status == "pending":
            logger.warning("run %s: undo(s) %s still to run; sending them", run_id, outcome.values)
            self.start_unwind(run_id, owner)
            return RunState.UNWINDING
        if outcome.status == "stale":
            logger.info("run %s: a stale unwind (%s) does not conclude", run_id, owner)
        if outcome.status != "ok":
            return self.picture(run_id).state
        if sent_at is not None:
            metrics.unwind_ended(state.value, self.store.now() - sent_at)
        version, ended, reason, cause = (str(v) for v in outcome.values[:4])
        concluded = replace(
            picture,
            state=state,
            reason=reason,
            cause=cause,
            ended=float(ended),
            updated=float(ended),
            version=version,
            recorded=False,
            resolution=None,  # a resolution holds only at the version it was made at
        )
        self._record_or_leave_to_reaper(run_id, concluded)
        return state

    def record_end(
        self, run_id: str, picture: RunPicture | None = None, notify: bool = True
    ) -> RunPicture | None:
        """Write an ended run's SQL records (and an escalation's row), call the hooks, then let
        its Redis keys expire. Until this succeeds the run stays unrecorded and the reaper
        tries again: Redis and SQL never end up telling different stories.

        ``picture``: the run as just read (not read again); its version fences the record, so
        a run that moved on since keeps its keys. ``notify``: wake ``Run.wait()``. Returns the
        picture recorded, or None."""
        picture = picture or self.picture(run_id)
        if not picture.state.ended:
            return None
        try:
            escalation = self.records.record_outcome(picture)
        except StaleRecordError as exc:  # read before the run moved on; its newer record stands
            logger.info("run %s: %s", run_id, exc)
            return None
        if escalation is not None and not escalation.resolved:  # resolved: nobody to tell
            self.escalated(escalation)
        self._call_hook(self.hooks.on_run_ended, picture, picture.state.value, picture.reason)
        if not self.store.mark_recorded(run_id, picture.version, notify):
            return None
        metrics.run_ended(picture.state.value)
        telemetry.run_ended(picture)
        # Look again when the keys have expired, to drop the run from the index.
        expiry = self.store.now() + self.store.retention_seconds + _EXPIRY_MARGIN
        self.store.schedule(run_id, expiry)
        return replace(picture, recorded=True)

    def escalated(self, escalation: EscalationRecord) -> None:
        """A person must take over: the ERROR log and the notices (``saga.notifications``),
        then the hook. Called before the run counts as recorded: a crash in here leaves it
        unrecorded, so it is recorded again and the notices are written then."""
        if self.faults is not None:
            self.faults.strike("after_escalation_recorded", "")
        self.notifier.escalated(escalation)
        self._call_hook(self.hooks.on_escalation, escalation)

    def _record_if_pending(self, run_id: str) -> None:
        picture = self.store.picture(run_id)
        if picture is not None and picture.state.ended and not picture.recorded:
            self._record_or_leave_to_reaper(run_id)

    def _record_or_leave_to_reaper(
        self, run_id: str, picture: RunPicture | None = None, notify: bool = True
    ) -> RunPicture | None:
        try:
            return self.record_end(run_id, picture, notify)
        except SQLAlchemyError as exc:
            # The run has ended in Redis; its keys stay until the record is written, and the
            # reaper's next pass tries again.
            logger.error("run %s: record not written yet (%s); the reaper retries", run_id, exc)
            self.store.schedule(run_id, self.store.now())
            return None

    def landed_late(self, run_id: str) -> None:
        """An effect landed after its step was judged and its run ended: the run is reopened
        (unwinding, or escalated with the undo on its stack). Put it back under the reaper's
        eye and record the new picture."""
        logger.error("run %s: an effect landed after the run ended", run_id)
        view = self.store.head(run_id)
        if view is not None:
            self.store.schedule(run_id, self.store.now() + view.deadline)
        if view is not None and view.state.ended:
            self.record_end(run_id)

    def requeue_failed_compensations(
        self,
        run_id: str,
        *,
        corrections: Mapping[int, Mapping[str, Any]] | None = None,
        by: str = "",
    ) -> int:
        """Run an escalated run's failed compensations again (after someone fixed the cause),
        newest first, each with its idempotency key and a fresh retry budget; returns how many
        are sent. ``corrections``: step -> arguments merged into that step's undo first,
        checked against its tool (``InvalidCorrectionError`` before anything runs); recorded
        with ``by``. Works from the SQL record once the run's keys have expired
        (``saga.operations``)."""
        from saga.operations import requeue

        return requeue(self, run_id, corrections or {}, by)

    def resolve_escalation(self, escalation_id: str, *, note: str, by: str) -> EscalationRecord:
        """Close an escalation by hand ("refunded by phone"), recorded with who and when; the
        run then refuses a requeue. ``UnknownEscalationError`` / ``EscalationResolvedError``
        for an id that is not open."""
        from saga.operations import resolve

        return resolve(self, escalation_id, note=note, by=by)

    def encode_effect(
        self, tool: Tool, run_id: str, step: int, args: dict[str, Any], result: Any
    ) -> tuple[str, str, dict[str, Any] | None]:
        """The result and the undo as stored (``saga.effects``), within this app's limit."""
        limit = self.settings.max_payload_bytes
        return encode_effect(self.registry, limit, tool, run_id, step, args, result)

    def reap(self, now: float | None = None) -> ReapReport:
        """Resolve every run with no progress past its deadline (the beat task calls this).

        ``now`` lets a test look at the runs as the clock will see them later."""
        from saga.reaper import reap

        return reap(self, now)

    def _call_hook(self, hook: Any, *args: Any) -> None:
        try:
            hook(*args)
        except Exception:
            logger.exception("saga hook %s failed", getattr(hook, "__name__", hook))
