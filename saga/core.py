"""The run transitions: what moves a run from one state to the next, over the store (Redis),
the rules (``saga.rules``) and the records (SQL).

It dispatches an agent's call under the pivot rules, completes a run, aborts it, starts its
unwind (the reverse-order chain of compensation tasks) and concludes it: the fenced state
change, then its SQL records, retried (by the reaper if need be) until they are written; the
run's keys expire only after that. Ends are announced to the ``RunListener``s (the hosted
loop, the notifier) and the app's ``SagaHooks``; the core imports neither.

Every moving part (the worker, the reaper, ``Run``, the operations, the notifier, the start-up
guard, the hosted loop) depends on this, never on the ``Saga`` facade that builds it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

from celery import Celery
from sqlalchemy.exc import SQLAlchemyError

from saga import metrics, rules, telemetry
from saga.dispatch import Dispatcher
from saga.divergence import behind_records
from saga.effects import encode_effect
from saga.errors import (
    RunContendedError,
    RunEndedError,
    StaleRecordError,
    StepsInFlightError,
    StoreUnavailableError,
    UnknownRunError,
)
from saga.fault_points import FaultPoints, faults_enabled
from saga.hooks import RunListeners, SagaHooks
from saga.model import RunState
from saga.picture import RunPicture
from saga.prepared_publish import PreparedPublisher
from saga.records import EscalationRecord, RecordStore
from saga.records.rows import escalation_id
from saga.rules import REASON_STORE_BEHIND
from saga.settings import Settings
from saga.stack import RunStore
from saga.tool_hosts import CallerTools
from saga.tools import Tool, ToolRegistry
from saga.unwind import PreparedUnwind, prepared_unwind, send_unwind, unwind_chain

logger = logging.getLogger("saga")
# The workers' logger (``saga.delivery``'s), for what a worker waits out.
_worker_logger = logging.getLogger("saga.worker")
T = TypeVar("T")

#: How often a conclusion re-reads a run that changed under it before leaving it to the reaper.
_CONCLUDE_ATTEMPTS = 100
#: Seconds a delivery's lease outlasts its hard time limit: time to record its outcome.
LEASE_MARGIN_SECONDS = 2.0
#: The lease when the app sets no time limit (the start-up guard refuses that on Redis).
_DEFAULT_TIME_LIMIT = 300.0
#: How soon the reaper tells the listeners again of a question one of them failed to take.
RETELL_SECONDS = 30.0


class Core(Dispatcher):
    """The transitions of one application's runs, over its store, rules and records."""

    def __init__(
        self, app: Celery, registry: ToolRegistry, settings: Settings, hooks: SagaHooks
    ) -> None:
        self.app = app
        self.registry = registry
        self.settings = settings
        self.hooks = hooks
        self.store = RunStore.for_settings(settings)
        self._records: RecordStore | None = None
        self._records_lock = threading.Lock()
        #: Publish options by task name (``_publish_options``), worked out on first use.
        self._publish_extra: dict[str, dict[str, Any]] = {}
        self._next_steps: dict[str, int] = {}
        self._next_steps_lock = threading.Lock()
        self.prepared = PreparedPublisher(
            app, settings.redis_url, lambda: self.store.client, self._publish_options
        )
        #: Fault injection for tests; None unless SAGA_TESTING_FAULTS=1 is set explicitly.
        self.faults: FaultPoints | None = None
        if faults_enabled():
            self.faults = FaultPoints(self.store.client)
        #: Told when steps settle, when the reaper finds a run idle and when a run escalates
        #: (the hosted loop, the notifier: the facade registers them).
        self.listeners = RunListeners()
        #: What this caller knows against what the workers run (``saga.tool_hosts``).
        self.caller_tools = CallerTools(self.store.client, lambda: [t.name for t in registry])
        #: The object the app's module holds (its ``Saga``, which sets this): what a printed
        #: ``saga --app module:attr`` command names (``saga.escalations.invocation``).
        self.app_object: object = self

    @property
    def records(self) -> RecordStore:
        """Created on first use, so importing the app never touches the database."""
        with self._records_lock:
            if self._records is None:
                self._records = RecordStore(
                    self.settings.database_url, upgrade=self.settings.database_auto_upgrade
                )
            return self._records

    def step_settled(self, run_id: str, step: int, turn_done: int | None = None) -> None:
        """The worker recorded a step's outcome: tell the listeners. Never raises: a lost
        notice is repeated by the step's redelivery, or found by the reaper.

        ``turn_done``: what the script that recorded it found about the hosted turn the step
        belongs to (the turn it completed, or 0), or None if it did not look."""
        self.listeners.step_settled(run_id, step, turn_done)

    def reversal_asked(self, run_id: str, step: int) -> None:
        """An undo's reversal policy asks a person, and the unwind waits at it: tell the
        listeners (the notifier sends the question's notices). Called by every delivery that
        finds the question open, a redelivery too (a listener acts once per question). Never
        raises: the question waits whatever a listener does, and escalates if unanswered.

        A listener that failed (the notices' database away) is told again by the reaper,
        brought forward to ``RETELL_SECONDS`` from now: no delivery comes back to an open
        question, and a person must not first hear of it when it expires."""
        if not self.listeners.reversal_asked(run_id, step):
            try:
                self.store.schedule_sooner(run_id, self.store.now() + RETELL_SECONDS)
            except StoreUnavailableError:
                logger.warning("run %s: the question of step %d is told again at its expiry",
                               run_id, step)  # fmt: skip

    def revive_idle(self, run_id: str) -> bool:
        """The reaper's question before abandoning an idle run: does a listener resume it?"""
        return self.listeners.run_idle(run_id)

    def picture(self, run_id: str) -> RunPicture:
        picture = self.store.picture(run_id)
        if picture is None:
            raise UnknownRunError(f"no run {run_id}")
        return picture

    @property
    def lease_seconds(self) -> float:
        """How long one delivery of a task may still be running: its hard time limit (the
        start-up guard insists on one), plus a margin for the worker to record the outcome."""
        limit = float(self.app.conf.get("task_time_limit") or _DEFAULT_TIME_LIMIT)
        return limit + LEASE_MARGIN_SECONDS

    def patiently(self, what: str, call: Callable[..., T], *args: Any) -> T:
        """Call ``call`` again while the stack's Redis is unreachable (or a write that counts
        is not yet on a replica), for ``store_outage_patience`` at most. Every script answers
        a repeat with what its first call decided, so a call whose reply was lost (it ran on
        the server) is safe to repeat."""
        delay, waited = 0.1, 0.0
        while True:
            try:
                return call(*args)
            except StoreUnavailableError as unavailable:
                if waited >= self.settings.store_outage_patience:
                    raise
                # Why it waits: an unreachable server and an unconfirmed write (no replica
                # holds it yet) call for different fixes.
                _worker_logger.warning(
                    "%s: stack unavailable (%s), trying again", what, unavailable
                )
                time.sleep(delay)
                waited += delay
                delay = min(delay * 2, 2.0)

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

    def start_unwind(self, run_id: str, owner: str, picture: RunPicture | None = None) -> bool:
        """Queue the compensations still to run, most recent first, as one Celery chain ending
        in ``saga.conclude_unwind`` (which the last compensation's task makes itself when it
        can: ``saga.compensation``); past the pivot, conclude at once (escalate, no unwinding).

        Only the owner of the unwind calls this. The chain is sent and marked sent
        (``saga.unwind.send_unwind``): a crash in between makes the redelivered owner send
        again, never zero times, or, where its message is prepared, the mark's script pushes
        it. False when the broker refused the chain (logged; the reaper sends it at the run's
        deadline), and when the run's keys are older than its SQL record (``behind_records``):
        nothing is undone from a store that went back in time. ``picture``: the run as read
        in the transaction that made ``owner`` the owner (not read again).
        """
        picture = picture or self.picture(run_id)
        try:
            behind = self.behind_records(
                run_id, picture.state, picture.version, picture.recorded_version
            )
        except SQLAlchemyError as exc:  # unjudged: the reaper sends it once SQL is back
            logger.error("run %s: its record could not be read (%s); unwind not sent", run_id, exc)
            return False
        if behind:
            self.escalate_behind(run_id, behind)
            return False
        if picture.pivot_step is not None:
            self.conclude(run_id, owner)
            return True
        signatures = unwind_chain(
            self.app, self.registry, self.store, picture, owner, self._publish_options
        )
        return send_unwind(self.store, self.prepared, picture, owner, signatures)

    def prepared_unwind(self, picture: RunPicture, owner: str) -> PreparedUnwind | None:
        """``start_unwind``'s chain from ``picture``, prepared for the script that makes
        ``owner`` the owner to push (``saga.unwind.prepared_unwind``)."""
        parts = (self.app, self.registry, self.store, self.prepared, self._publish_options)
        return prepared_unwind(*parts, picture, owner)

    def conclude(
        self,
        run_id: str,
        owner: str = "",
        sent_at: float | None = None,
        picture: RunPicture | None = None,
    ) -> RunState:
        """End an unwinding run: compensated, or escalated with the whole picture.

        ``owner`` is the unwind whose chain concludes: a chain the reaper has since replaced
        (its owner died, then its messages came back late) must not end the run early. An
        undo pushed after the chain was sent (an effect that landed late) is sent first.
        ``sent_at``: when the chain was sent (Redis clock), to time the unwind.

        The verdict is judged on one reading of the run and concluded only if the run is still
        at that version; the record is then written from the same reading, with what the
        conclusion changed, instead of reading the run again. ``picture``: that reading, as
        the transaction that recorded the last undo made it (a run that moved since is read
        again, as any reading found stale)."""
        known = picture
        for _ in range(_CONCLUDE_ATTEMPTS):
            picture, known = known or self.picture(run_id), None
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
        if outcome.status == "asked":  # a person decides about an undo first: nothing ends
            return RunState.UNWINDING
        if outcome.status == "stale":
            logger.info("run %s: a stale unwind (%s) does not conclude", run_id, owner)
        if outcome.status != "ok":
            return self.picture(run_id).state
        return self.concluded(picture.concluded(state, outcome.values), sent_at)

    def concluded(self, picture: RunPicture, sent_at: float | None = None) -> RunState:
        """What follows the end a script made (``picture``: the run as it ended): the unwind
        timed, a run kept on purpose resolved, its SQL record written."""
        if sent_at is not None:
            metrics.unwind_ended(picture.state.value, self.store.now() - sent_at)
        if self.faults is not None:
            self.faults.strike("after_conclusion", "")
        if picture.reason == rules.REASON_KEPT:
            # Kept on purpose: the escalation is the books' line, resolved by who kept it.
            self._resolve_as_kept(picture)
            self._record_or_leave_to_reaper(picture.run_id)
            return picture.state
        self._record_or_leave_to_reaper(picture.run_id, picture)
        return picture.state

    def _resolve_as_kept(self, picture: RunPicture) -> None:
        """Resolve the escalation of a run whose undos a person chose to keep, with their
        decisions as the resolution (who, and each kept step's note)."""
        generation = picture.generation
        resolution = rules.kept_resolution(picture)
        resolution["escalation_id"] = escalation_id(picture.run_id, generation)
        self.store.resolve(picture.run_id, generation, json.dumps(resolution, ensure_ascii=False))

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
        if picture.reason == rules.REASON_KEPT and picture.resolution is None:
            # Kept on purpose, yet not resolved: the worker that concluded it died (or lost the
            # store) between the conclusion and its resolution. Whoever records it resolves it
            # first: a person's decision never comes back as an open escalation.
            self._resolve_as_kept(picture)
            picture = self.picture(run_id)
        # The end may have been read from a master no replica confirmed it from yet (another
        # process's conclusion, standing there only): recorded in SQL and then lost with a
        # failover, SQL would tell of an end Redis never reached. Unconfirmed in time, it is
        # StoreUnavailableError and the record is written later (the reaper tries again).
        self.store.confirm("the run's end, before its record", run_id)
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
        return replace(picture, recorded=True, recorded_version=picture.version)

    def behind_records(
        self, run_id: str, state: RunState, version: str, recorded_version: str | None
    ) -> str:
        """What diverged, if the run's keys are older than its SQL record (a store that went
        back in time: ``saga.divergence``); ``""`` when they are not."""
        return behind_records(self.records, self.store, run_id, state, version, recorded_version)

    def escalate_behind(self, run_id: str, problem: str) -> None:
        """Tell a person, once per divergence (not again once they closed it, while nothing
        changed), that the run's keys went back in time: the reaper's escalation of the run,
        which no script fences. Nothing is done to the run: SQL and the effects stand."""
        logger.error("run %s went back in time in Redis (%s): left to a person", run_id, problem)
        told = self.records.escalation(escalation_id(run_id, None))
        if told is None or told.cause != problem:
            self.escalated(self.records.record_unreadable(run_id, problem, REASON_STORE_BEHIND))

    def escalated(self, escalation: EscalationRecord) -> None:
        """A person must take over: the ERROR log and the notices (``saga.notifications``),
        then the hook. Called before the run counts as recorded: a crash in here leaves it
        unrecorded, so it is recorded again and the notices are written then."""
        if self.faults is not None:
            self.faults.strike("after_escalation_recorded", "")
        self.announce_escalation(escalation)
        self._call_hook(self.hooks.on_escalation, escalation)

    def announce_escalation(self, escalation: EscalationRecord) -> None:
        """Tell the listeners (the notifier writes and sends its notices). What they raise is
        not caught: the recording is then unfinished, and done again."""
        for listener in self.listeners:
            listener.run_escalated(escalation)

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

    def encode_effect(
        self, tool: Tool, run_id: str, step: int, args: dict[str, Any], result: Any
    ) -> tuple[str, str, dict[str, Any] | None]:
        """The result and the undo as stored (``saga.effects``), within this app's limit."""
        limit = self.settings.max_payload_bytes
        return encode_effect(self.registry, limit, tool, run_id, step, args, result)

    def _call_hook(self, hook: Any, *args: Any) -> None:
        try:
            hook(*args)
        except Exception:
            logger.exception("saga hook %s failed", getattr(hook, "__name__", hook))
