"""Runs whose outcome nobody is going to report: steps in doubt, and the periodic reaper.

A step is *in doubt* when a delivery began it and nobody will report its outcome: its worker
died over and over, it was revoked while running, or its lease ran out with no outcome. Its
effect may or may not have happened. It is reconciled before any unwind, by asking the tool's
``lookup`` (by idempotency key) whether the effect exists, and only once no delivery may still
be running it (its lease, on the Redis clock, has run out).

The reaper (Celery beat, ``saga.reap``) looks only at runs that are due: the index holds, per
run, when to look next (its deadline past its last change; for an ended run, when its keys
expire). Each due run is handled on its own: one it cannot read is logged, escalated and looked
at again later, and the others are still reaped.

A step no delivery is on by its run's deadline (none began it, or its retry never came) is
sent again, once, before it is judged (never started, or in doubt): the store holds every
step's call, so a broker that lost its queued messages (one without persistence, restarted:
the split topology of ``docs/deployment.md``) loses no run. An unwind's chain is sent again by
the take-over, a hosted loop's turn by its revival.

What SQL recorded is never overruled by a store that went back in time (a failover to a
replica that had not received the last writes, an old master that resynced): before the reaper
acts on a run (reconciles a step, abandons, takes over an unwind, records an end) it checks that
the run's keys are not older than its SQL record. A run whose keys are is escalated to a
person (``<run_id>:reaper``, naming both versions) and never acted on: nothing is undone and
nothing is concluded again from the older picture.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from kombu.exceptions import OperationalError as BrokerUnavailableError
from sqlalchemy.exc import DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from saga import metrics
from saga.constants import LOOK_AFTER_EXPIRY, step_idempotency_key
from saga.core import Core
from saga.errors import RunEndedError, StoreUnavailableError, UnknownToolError
from saga.model import CompensationState, RunState, StepState, ToolClass
from saga.notifications.notifier import Notifier
from saga.picture import RunPicture
from saga.soft_limit import call_time
from saga.stack import RunHead
from saga.tools import Tool

logger = logging.getLogger("saga.reaper")

#: An index entry with no keys is dropped once it is this long overdue: the run's keys are
#: created right after it is indexed, so by then they never will be.
_KEYLESS_GRACE = 60.0
#: A run the reaper could not handle is looked at again after this long (never every pass).
_RETRY_BROKEN = 300.0
#: ... unless only the stack's Redis was away (a restart, a failover, a write no replica
#: confirmed in time): then as soon as the next pass. Waiting five minutes would leave a run
#: whose abort stood on the master unconfirmed "unwinding" with no chain sent for that long.
_RETRY_STORE_AWAY = 1.0
#: How many times a step no delivery began is sent again (``_sent_again``) before it is
#: judged never started: each waits a deadline.
STEP_RESENDS = 1


@dataclass
class ReapReport:
    """What one pass of the reaper did, for logs and tests."""

    examined: int = 0
    forgotten: int = 0
    abandoned: list[str] = field(default_factory=list)
    never_started: list[tuple[str, int]] = field(default_factory=list)
    #: Steps no delivery began by the deadline, whose message was sent again: (run id, step).
    resent: list[tuple[str, int]] = field(default_factory=list)
    in_doubt: list[tuple[str, int, str]] = field(default_factory=list)
    resumed: list[str] = field(default_factory=list)
    recorded: list[str] = field(default_factory=list)
    #: Escalation notices sent by the sweep (their message lost or refused, or never written).
    notices: list[str] = field(default_factory=list)
    #: Runs it could not handle: (run id, what went wrong). Each is escalated.
    broken: list[tuple[str, str]] = field(default_factory=list)
    #: Runs whose keys are older than their SQL record: (run id, what diverged). Each is
    #: escalated once and left as it is.
    behind: list[tuple[str, str]] = field(default_factory=list)
    #: Undos a person was asked about and did not answer in time: (run id, step). Each failed
    #: ("not answered"), so its run escalates once the older undos have run.
    unanswered: list[tuple[str, int]] = field(default_factory=list)


def mark_in_doubt(core: Core, run_id: str, step: int, error: dict[str, Any]) -> str:
    """Mark a step in doubt and reconcile it at once; returns the lookup's verdict. Only for
    a caller that knows no delivery is running the step (the crash-looping delivery itself)."""
    core.store.mark_in_doubt(run_id, step, error)
    return reconcile(core, run_id, step)


def reconcile(core: Core, run_id: str, step: int) -> str:
    """Settle an in-doubt step by what its lookup finds: ``happened`` (its undo is pushed),
    ``not_happened`` (nothing to undo) or ``unknown`` (no lookup, or it failed: a person must
    look). Never raises for the tool's sake: a lookup that fails, a result that cannot be
    recorded or a tool gone from this deploy all end in a recorded, escalated verdict."""
    picture = core.picture(run_id)
    record = picture.step(step)
    if record.state is not StepState.IN_DOUBT:
        # Settled already: by this caller's own first try, whose reply was lost, maybe. If that
        # try came to own the unwind and nobody sent it, send it now.
        owner = f"step:{step}"
        unsent = picture.extra.get("owner") == owner and picture.extra.get("sent") == "0"
        if picture.state is RunState.UNWINDING and unsent:
            core.start_unwind(run_id, owner)
        return "settled"
    verdict, result, why = "unknown", None, "nothing could tell whether it happened"
    tool: Tool | None = None
    try:
        tool = core.registry.get(record.tool)
    except UnknownToolError:
        why = f"tool {record.tool!r} is not registered in this deploy, so nothing can look"
    if tool is not None and tool.tool_class is ToolClass.READ:
        verdict = "not_happened"  # a read has no effect to find, nor to undo
    elif tool is not None and tool.lookup is not None:
        try:
            with call_time():
                result = tool.lookup(step_idempotency_key(run_id, step), record.args)
            verdict = "not_happened" if result is None else "happened"
        except Exception as exc:
            logger.exception("run %s: lookup of step %d (%s) failed", run_id, step, record.tool)
            why = f"its lookup failed: {type(exc).__name__}: {exc}"
    result_json = entry_json = ""
    if verdict == "happened" and tool is not None:
        result_json, entry_json, _ = core.encode_effect(tool, run_id, step, record.args, result)
    irreversible = record.tool_class is ToolClass.IRREVERSIBLE_WRITE
    doubt = ""
    if irreversible:
        doubt = f"irreversible step {step} ({record.tool}) in doubt (lookup: {verdict})"
    elif verdict == "unknown":
        doubt = f"step {step} ({record.tool}) in doubt: {why}"
    word = {"happened": "found", "not_happened": "not_found", "unknown": "unknown"}[verdict]
    outcome = core.store.resolve_in_doubt(
        run_id, step, word, result_json, entry_json, irreversible, doubt
    )
    logger.warning("run %s: step %d (%s) was in doubt: %s", run_id, step, record.tool, verdict)
    metrics.step(record.tool, "in_doubt")
    if outcome.owns_unwind:
        core.start_unwind(run_id, f"step:{step}")
    core.step_settled(run_id, step)
    return verdict


def reap(core: Core, notifier: Notifier, now: float | None = None) -> ReapReport:
    """One pass over the runs that are due, then the ``notifier``'s sweep of the escalation
    notices; ``now`` (Redis clock) lets a test look ahead."""
    report = ReapReport()
    now = core.store.now(exact=True) if now is None else now
    for run_id, due in core.store.due_runs(now):
        report.examined += 1
        try:
            _reap_one(core, run_id, due, now, report)
        except Exception as exc:
            _broken(core, notifier, run_id, exc, now, report)
    try:
        report.notices = notifier.sweep(now)
    except Exception:  # the records database is away: the next pass sweeps
        logger.exception("reaper: could not sweep the escalation notices")
    return report


def _reap_one(core: Core, run_id: str, due: float, now: float, report: ReapReport) -> None:
    head = core.store.head(run_id)
    if head is None:
        if now - due >= _KEYLESS_GRACE:
            core.store.forget(run_id)  # expired (or never created): nothing left to watch
            report.forgotten += 1
        else:
            core.store.schedule(run_id, due + _KEYLESS_GRACE)
        return
    if head.state.ended:
        if not head.recorded:
            if _behind_records(core, run_id, head, now, report):
                return
            core.record_end(run_id)  # raises while the database is away: tried again later
            report.recorded.append(run_id)
        else:
            look = core.store.retention_seconds + LOOK_AFTER_EXPIRY
            core.store.schedule(run_id, (head.ended or now) + look)
        return
    # An unwinding run is read whole once per pass: for a question to a person, for steps in
    # doubt, and (past its deadline) to be resolved.
    unwinding = core.picture(run_id) if head.state is RunState.UNWINDING else None
    if unwinding is not None and _awaits_a_person(core, unwinding, now, report):
        return
    if now - head.updated < head.deadline:
        next_look = head.updated + head.deadline
        if unwinding is not None:  # a step in doubt may wait for its lease only
            waiting = _reconcile_doubts(core, unwinding, now, report)
            if waiting is None:
                return
            next_look = min([next_look, *waiting])
        core.store.schedule(run_id, next_look)
        return
    picture = unwinding or core.picture(run_id)
    if _behind_records(core, run_id, picture, now, report):
        return
    _resolve(core, picture, now, report)
    # Look again a deadline from now, unless progress moves it on (it is re-read then).
    core.store.schedule(run_id, now + max(picture.deadline, 1.0))


def _awaits_a_person(core: Core, picture: RunPicture, now: float, report: ReapReport) -> bool:
    """Whether the unwind waits for a person's answer about an undo (its tool's reversal
    policy asked): not stalled, so it is not taken over; looked at again when the question
    expires. An expired one fails ("a person was asked and did not answer") and the unwind
    goes on with the older undos under a new owner, to end escalated."""
    asked = [c for c in picture.compensations if c.state is CompensationState.ASKED]
    if not asked:
        return False
    run_id = picture.run_id
    waiting = []
    for undo in asked:
        if undo.ask_expires is not None and undo.ask_expires > now:
            waiting.append(undo.step)
            continue
        owner = f"reaper:{uuid.uuid4().hex[:8]}"
        note = "nobody answered before the question expired"
        outcome = core.store.decide_reversal(run_id, undo.step, "expire", "", "reaper", note, owner)
        if outcome.status == "ok":
            logger.error("run %s: nobody answered about reversing step %d", run_id, undo.step)
            report.unanswered.append((run_id, undo.step))
            core.start_unwind(run_id, owner)
            return True
    soonest = min((u.ask_expires for u in asked if u.ask_expires is not None), default=now + 60)
    core.store.schedule(run_id, soonest)
    for step in waiting:
        # Looked at before the question expires: told again, for a listener that failed to
        # take it (the notices' database away; failing again, it brings this look forward
        # again). Once per question: a listener that took it does nothing more.
        core.reversal_asked(run_id, step)
    return True


def _reconcile_doubts(
    core: Core, picture: RunPicture, now: float, report: ReapReport
) -> list[float] | None:
    """Reconcile the steps in doubt whose delivery's lease has run out (the run need not be
    idle: nobody else will settle them); return when the others' leases end, or None when the
    run's keys are older than its SQL record (escalated, left alone)."""
    waiting = []
    checked = False
    for record in picture.steps:
        if record.state is not StepState.IN_DOUBT or record.step not in picture.in_flight:
            continue
        if not checked:
            checked = True
            if _behind_records(core, picture.run_id, picture, now, report):
                return None
        error = {"type": "NoOutcome", "message": "in doubt"}
        marked = core.store.mark_in_doubt(picture.run_id, record.step, error, respect_lease=True)
        if marked.status == "in_doubt" and str(marked.values[0]) == "0":
            verdict = reconcile(core, picture.run_id, record.step)
            report.in_doubt.append((picture.run_id, record.step, verdict))
        elif record.lease is not None:
            waiting.append(record.lease)
    return waiting


def _behind_records(
    core: Core, run_id: str, keys: RunHead | RunPicture, now: float, report: ReapReport
) -> bool:
    """Whether the run's keys are older than its SQL record (``Core.behind_records``); if
    so, it is escalated once and looked at again later, and the reaper does nothing to it."""
    # The database away raises: the run is tried again later.
    problem = core.behind_records(run_id, keys.state, keys.version, keys.recorded_version)
    if not problem:
        return False
    report.behind.append((run_id, problem))
    core.store.schedule(run_id, now + _RETRY_BROKEN)
    core.escalate_behind(run_id, problem)
    return True


#: Errors that say a store (or the broker) is unreachable for now, not that this run's data
#: is wrong.
_AWAY = (
    OperationalError,
    InterfaceError,
    DisconnectionError,
    PoolTimeoutError,
    StoreUnavailableError,
    BrokerUnavailableError,
)


def _broken(
    core: Core, notifier: Notifier, run_id: str, exc: Exception, now: float, report: ReapReport
) -> None:
    """A run the reaper cannot handle must not stop it for the others, nor be retried every
    pass, nor stay silent: log it, escalate it to a person, look again later."""
    message = f"{type(exc).__name__}: {exc}"
    report.broken.append((run_id, message))
    if isinstance(exc, _AWAY):
        # The database or Redis is away: nothing is wrong with the run; try it again later.
        # (A record the database refuses for good, a value too long or a missing table, is
        # not "away": retrying alone would never end, so it is escalated below.)
        logger.error("reaper: run %s waits for %s", run_id, message)
        soon = isinstance(exc, StoreUnavailableError | BrokerUnavailableError)
        retry = _RETRY_STORE_AWAY if soon else _RETRY_BROKEN
        with contextlib.suppress(StoreUnavailableError):
            core.store.schedule(run_id, now + retry)
        return
    logger.exception("reaper could not handle run %s; escalating it", run_id)
    try:
        core.store.schedule(run_id, now + _RETRY_BROKEN)
        notifier.escalated(core.records.record_unreadable(run_id, message))
    except Exception:
        logger.exception("run %s: could not escalate the reaper's failure either", run_id)


def _resolve(core: Core, picture: RunPicture, now: float, report: ReapReport) -> None:
    run_id, idle = picture.run_id, int(now - picture.updated)
    if picture.in_flight:
        for step in picture.in_flight:
            _resolve_step(core, picture, step, idle, report)
        return
    if picture.state is RunState.RUNNING:
        if core.revive_idle(run_id):  # a hosted loop whose next turn was lost: sent again
            report.resumed.append(run_id)
            return
        try:
            if core.abort(run_id, f"abandoned: no progress for {idle}s", version=picture.version):
                report.abandoned.append(run_id)
        except RunEndedError:
            pass
    elif picture.state is RunState.UNWINDING:
        # The owner died before sending the chain, or the chain was lost: send it again. A
        # compensation still running under its lease is progress: the script refuses then.
        owner = f"reaper:{uuid.uuid4().hex[:8]}"
        # Waited out in place (a failover, a write no replica holds yet): put off, it would
        # stand on the master and, having moved the run on, wait a whole deadline again.
        took = core.patiently(
            f"reaper: run {run_id}: take over", core.store.take_over, run_id, picture.version, owner
        )
        if took:
            core.start_unwind(run_id, owner)
            report.resumed.append(run_id)


def _found_anyway(core: Core, picture: RunPicture, step: int) -> bool:
    """Whether a step the store says never began has an effect its lookup finds. A lookup
    that fails, a read, a tool with no lookup: no (the step is judged never started, as
    without the lookup)."""
    record = picture.step(step)
    try:
        tool = core.registry.get(record.tool)
    except UnknownToolError:
        return False
    if tool.lookup is None or tool.tool_class is ToolClass.READ:
        return False
    try:
        with call_time():
            return tool.lookup(step_idempotency_key(picture.run_id, step), record.args) is not None
    except Exception:
        logger.exception("run %s: lookup of step %d (%s) failed", picture.run_id, step, record.tool)
        return False


def _sent_again(core: Core, picture: RunPicture, step: int, idle: int, report: ReapReport) -> bool:
    """Whether the step's message was sent again, instead of the step being judged (never
    started, or in doubt). A broker without persistence (the split topology of
    ``docs/deployment.md``) loses its queued messages when it restarts, and the store, which
    holds every step's call, is what can send them again: for a step no delivery began, and
    for one whose retry (its claim released by ``record_retry``) had not begun by the end of
    its hold. Only for a run still going forward (an unwinding run's queued step would be
    skipped anyway), and at most ``STEP_RESENDS`` times: a step still not begun a deadline
    later (a queue no worker consumes) is judged as before."""
    run_id = picture.run_id
    if picture.state is not RunState.RUNNING:
        return False
    counted = core.store.count_resend(run_id, step, STEP_RESENDS)
    if counted.status != "sent":  # a delivery is on it (or began it since), or sent enough
        return False
    record = picture.step(step)
    try:
        core.resend(run_id, record)
    except Exception:
        # The broker away: the send does not count, and the run is looked at again at the next
        # pass (``_broken``: the broker's errors are "away", not the run's fault).
        core.store.count_resend(run_id, step, STEP_RESENDS, take_back=True)
        raise
    logger.warning(
        "run %s: no delivery on step %d (%s) %ds after the run's last change: its message "
        "is sent again",
        run_id,
        step,
        record.tool,
        idle,
    )
    report.resent.append((run_id, step))
    return True


def _resolve_step(
    core: Core, picture: RunPicture, step: int, idle: int, report: ReapReport
) -> None:
    run_id, state = picture.run_id, picture.step(step).state
    if state is StepState.DISPATCHED and _found_anyway(core, picture, step):
        # The store says no delivery began it, yet the tool's own system has its effect: a
        # failover lost the step's begin and its outcome, and its message was acked (a time
        # limit cut the delivery's wait for the store short). Judged "never started", its
        # effect would stand with no undo on any stack: reconcile it as in doubt instead.
        error = {"type": "NoOutcome", "message": f"found by its lookup after {idle}s"}
        marked = core.store.mark_in_doubt(run_id, step, error, respect_lease=True)
        if marked.status == "in_doubt" and str(marked.values[0]) == "0":
            report.in_doubt.append((run_id, step, reconcile(core, run_id, step)))
        return
    if state in (StepState.DISPATCHED, StepState.RUNNING) and _sent_again(
        core, picture, step, idle, report
    ):
        return
    if state is StepState.DISPATCHED:
        # Never started, by this picture. The script refuses the verdict if a delivery has
        # begun it since (the picture is a moment old): then it is running, not lost.
        error = {"type": "NeverStarted", "message": f"not picked up in {idle}s"}
        outcome = core.store.record_failure(run_id, step, error, event="never_started")
        if outcome.status == "ok":
            report.never_started.append((run_id, step))
        if outcome.owns_unwind:
            core.start_unwind(run_id, f"step:{step}")
        # The script checked the step's hosted turn when it settled it: a turn it completed
        # is this caller's to move on (``turn_done``).
        turn_done = int(outcome.values[1]) if outcome.status == "ok" else None
        core.step_settled(run_id, step, turn_done)
        return
    if state in (StepState.RUNNING, StepState.IN_DOUBT):
        error = {"type": "NoOutcome", "message": f"no outcome after {idle}s"}
        marked = core.store.mark_in_doubt(run_id, step, error, respect_lease=True)
        if marked.status == "in_doubt" and str(marked.values[0]) == "0":
            report.in_doubt.append((run_id, step, reconcile(core, run_id, step)))
