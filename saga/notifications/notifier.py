"""Telling people about escalations: the ERROR log, then a notice per configured sink; and,
the same way, about an unwind that waits for a person's answer before a costly reversal.

``escalated`` runs inside the recording of an escalated run, before the run counts as recorded
(``Core.record_end`` marks it only afterwards): a crash anywhere before the notices are written
leaves the run unrecorded, so it is recorded again (by a redelivery or the reaper) and the
notices written then. Once written, each notice is a Celery task (``saga.notify``) with its own
retries, so a slow receiver never holds up the worker that recorded the run; a notice whose
message was lost is sent again by the reaper (``sweep``) once it is due.

A question (an undo's ``reversal`` policy asked a person) is told by the compensation's
delivery that found it open (``asked``): one notice per question and sink, keyed
``<run>:<generation>:asked:<step>``, written pending and sent as an escalation's is, so a
redelivery finds it written (or sent) and sends nothing twice.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from saga import metrics
from saga.constants import NOTIFY_TASK, notice_task_id
from saga.core import Core
from saga.errors import NotificationError, StoreUnavailableError
from saga.escalations.invocation import command_for
from saga.hooks import RunListener
from saga.model import CompensationState
from saga.notifications.body import (
    notification_body,
    question_body,
    question_notice_id,
    question_of,
)
from saga.notifications.sinks import SINKS
from saga.notifications.store import NoticeStore
from saga.notify_settings import NotifySettings
from saga.picture import RunPicture
from saga.records import EscalationRecord, RunRecord

logger = logging.getLogger("saga.notifications")

#: How long a sent notice may wait in the queue before the reaper assumes it was lost and
#: sends it again (a duplicate message is harmless: the first delivery's claim wins).
SWEEP_GRACE = 300.0
#: Seconds a delivery's lease outlasts its POST timeout: time to record the outcome.
LEASE_MARGIN = 5.0


@dataclass(frozen=True)
class Delivery:
    """What one delivery of a notice came to: ``sent``, ``failed``, ``retry`` (in
    ``retry_in`` seconds), or a reason it did nothing (``busy``, ``sent`` already, ...)."""

    status: str
    detail: str = ""
    retry_in: float | None = None
    error: BaseException | None = None


class Notifier(RunListener):
    """The notices of one app's escalations, written to its records database; told of each
    escalation by the core as one of its ``RunListener``s."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self._store: NoticeStore | None = None
        self._lock = threading.Lock()

    @property
    def settings(self) -> NotifySettings:
        return self.core.settings.notifications

    @property
    def store(self) -> NoticeStore:
        """Created on first use (the table too), so a deploy without sinks never has it."""
        with self._lock:
            if self._store is None:
                self._store = NoticeStore(self.core.records.engine)
            return self._store

    def run_escalated(self, escalation: EscalationRecord) -> None:
        self.escalated(escalation)

    def escalated(self, record: EscalationRecord) -> list[str]:
        """Log the escalation at ERROR, write its notices, send them; return the sinks sent to.

        Raises what the database raises while the notices are written: the caller's
        recording is then unfinished and is done again. A refused publish is only logged
        (the reaper sends the notice once it is due)."""
        logger.error(
            "run %s escalated (%s): %s%s; `%s escalation show %s`",
            record.run_id,
            record.escalation_id,
            record.reason,
            f"; cause: {record.cause}" if record.cause else "",
            command_for(self.core.app_object),
            record.escalation_id,
        )
        sinks = self.settings.sinks
        if not sinks:
            return []
        now = self.core.store.now()
        pending = self.store.open(record.escalation_id, record.run_id, sinks, now + SWEEP_GRACE)
        return [sink for sink in pending if self.send(record.escalation_id, sink)]

    def reversal_asked(self, run_id: str, step: int) -> None:
        self.asked(run_id, step)

    def asked(self, run_id: str, step: int) -> list[str]:
        """The unwind waits for a person's answer about step ``step``'s undo: write its
        notices (once per question) and send those still pending; return the sinks sent to."""
        sinks = self.settings.sinks
        if not sinks:
            return []
        picture = self.core.store.picture(run_id)
        undo = next((c for c in picture.compensations if c.step == step), None) if picture else None
        if picture is None or undo is None or undo.state is not CompensationState.ASKED:
            return []  # answered (or gone) already: nobody is to be asked
        notice_id = question_notice_id(run_id, picture.generation, step)
        due = self.core.store.now() + SWEEP_GRACE
        pending = self.store.open(notice_id, run_id, sinks, due)
        return [sink for sink in pending if self.send(notice_id, sink)]

    def send(self, escalation_id: str, sink: str) -> bool:
        """Publish one notice's task; False (logged) if the broker refused it."""
        try:
            self.core.app.send_task(
                NOTIFY_TASK,
                kwargs={"escalation_id": escalation_id, "sink": sink},
                task_id=notice_task_id(escalation_id, sink),
            )
        except Exception as exc:
            logger.error(
                "notice of escalation %s to the %s sink not enqueued (%r); the reaper sends it",
                escalation_id,
                sink,
                exc,
            )
            return False
        return True

    def sweep(self, now: float) -> list[str]:
        """Send again every pending notice nobody is expected to act on any more (its
        message lost, its publish refused, its worker gone), and announce the open escalations
        that have none (recorded where no sink was set); return the tasks sent."""
        sinks = self.settings.sinks
        if not sinks:
            return []
        sent = []
        for escalation_id, run_id in self.store.unannounced(sinks):
            logger.warning("escalation %s was never announced: sending its notices", escalation_id)
            for sink in self.store.open(escalation_id, run_id, sinks, now + SWEEP_GRACE):
                if self.send(escalation_id, sink):
                    sent.append(notice_task_id(escalation_id, sink))
        for escalation_id, sink in self.store.due(now):
            self.store.postpone(escalation_id, sink, now + SWEEP_GRACE)
            logger.warning("notice of escalation %s to %s: sending it again", escalation_id, sink)
            if self.send(escalation_id, sink):
                sent.append(notice_task_id(escalation_id, sink))
        return sent

    def resend(self, escalation_id: str) -> list[str]:
        """Send an escalation's failed notices again with a fresh budget (an operator's call,
        once the receiver is fixed); return the sinks."""
        sinks = self.store.reopen(escalation_id, self.core.store.now())
        return [sink for sink in sinks if self.send(escalation_id, sink)]

    def deliver(self, escalation_id: str, sink: str) -> Delivery:
        """One delivery (the ``saga.notify`` task's body): claim, send, record the outcome."""
        settings = self.settings
        now = self.core.store.now()
        lease = settings.timeout + LEASE_MARGIN
        claim = self.store.claim(escalation_id, sink, now, lease, SWEEP_GRACE)
        if claim.status != "run":
            logger.info("notice %s to %s not sent: %s", escalation_id, sink, claim.status)
            return Delivery(claim.status)
        try:
            if sink not in SINKS:
                raise NotificationError(f"no sink named {sink!r} in this deploy")
            body = self._body(escalation_id)
            detail = SINKS[sink](settings, body, escalation_id, claim.attempt)
        except Exception as exc:
            return self._failed(escalation_id, sink, claim.attempt, exc)
        self.store.sent(escalation_id, sink, detail)
        metrics.notice(sink, "sent")
        logger.info("notice %s to %s: %s (attempt %d)", escalation_id, sink, detail, claim.attempt)
        return Delivery("sent", detail)

    def _failed(self, escalation_id: str, sink: str, attempt: int, exc: Exception) -> Delivery:
        error = str(exc) if isinstance(exc, NotificationError) else f"{type(exc).__name__}: {exc}"
        policy = self.settings.retry
        if getattr(exc, "retryable", True) and policy.allows_another(attempt):
            countdown = policy.delay(attempt)
            due = self.core.store.now() + countdown + self.settings.timeout + SWEEP_GRACE
            self.store.retry(escalation_id, sink, error, due)
            metrics.notice(sink, "retried")
            logger.warning(
                "notice %s to %s failed (attempt %d, next in %.1fs): %s",
                escalation_id,
                sink,
                attempt,
                countdown,
                error,
            )
            return Delivery("retry", error, countdown, exc)
        self.store.failed(escalation_id, sink, error)
        metrics.notice(sink, "failed")
        logger.error(
            "notice of escalation %s to the %s sink FAILED for good after %d attempt(s): %s; "
            "a person must be told another way (saga_notices, state 'failed')",
            escalation_id,
            sink,
            attempt,
            error,
        )
        return Delivery("failed", error, None, exc)

    def _body(self, notice_id: str) -> dict[str, Any]:
        """What the notice says: its escalation's package, or the question it tells of."""
        command = command_for(self.core.app_object)
        question = question_of(notice_id)
        if question is not None:
            run_id, step = question
            picture = self.core.store.picture(run_id)
            return question_body(notice_id, run_id, step, picture, command=command)
        record = self._escalation(notice_id)
        return notification_body(record, *self._timeline(record.run_id), command=command)

    def _timeline(self, run_id: str) -> tuple[RunPicture | None, RunRecord | None]:
        """Where the package's timeline comes from: the run's live picture, else its record."""
        try:
            picture = self.core.store.picture(run_id)
        except StoreUnavailableError:
            picture = None
        return picture, None if picture is not None else self.core.records.run(run_id)

    def _escalation(self, escalation_id: str) -> EscalationRecord:
        with Session(self.core.records.engine, expire_on_commit=False) as session:
            record = session.get(EscalationRecord, escalation_id)
        if record is None:
            raise NotificationError(f"no escalation {escalation_id} in the records database")
        return record
