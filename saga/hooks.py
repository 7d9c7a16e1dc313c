"""The one extension point: what happens when a run ends or escalates.

Subclass ``SagaHooks`` and override what you need (page someone, post to a channel). Every
method is a no-op here, so a hook that forgets one breaks nothing. A hook that raises is logged
and does not undo the recording: the record in the database is the source of truth.
"""

from __future__ import annotations

import logging

from saga.picture import RunPicture
from saga.records import EscalationRecord

logger = logging.getLogger("saga")


class SagaHooks:
    def on_run_ended(self, picture: RunPicture, state: str, reason: str) -> None:
        """Called once a run is completed, compensated or escalated (and recorded)."""

    def on_escalation(self, escalation: EscalationRecord) -> None:
        """Called when a person must take over: the record holds the whole picture."""


class RunListener:
    """What the run transitions (``saga.core``) tell the parts that act on them (the hosted
    agent loop, the notifier): a typed base with no-op methods, registered on
    ``Saga.listeners``, so the core announces without knowing who listens.

    Called from inside Celery tasks; a listener must never block on another task. What
    ``step_settled`` and ``run_idle`` raise is logged and dropped (each call is repeated by a
    redelivery or by the reaper), and so is what ``reversal_asked`` raises; what
    ``run_escalated`` raises is not (see there).
    """

    def step_settled(self, run_id: str, step: int, turn_done: int | None = None) -> None:
        """A step's outcome is recorded: succeeded, failed, rejected, skipped or judged.
        ``turn_done``: the hosted turn the recording script completed (0: none), or None if
        it did not check."""

    def reversal_asked(self, run_id: str, step: int) -> None:
        """The unwind waits for a person's answer about reversing step ``step`` (its tool's
        ``reversal`` policy asked). Told by every delivery that finds the question open, so
        a redelivery tells it again: act once per question. What it raises is logged and
        dropped."""

    def run_idle(self, run_id: str) -> bool:
        """The reaper found the run running, nothing in flight, idle past its deadline.
        Return True if the listener set it moving again (else the run is aborted)."""
        return False

    def run_escalated(self, escalation: EscalationRecord) -> None:
        """A person must take over: the escalation's row is written, the run not yet marked
        recorded. What this raises leaves the run unrecorded, so it is recorded (and this
        called) again: a notice is written at least once."""


class RunListeners(list[RunListener]):
    """The listeners the core tells of a run's moves, each told whatever another did: what one
    raises is logged and dropped here (each call is repeated by a redelivery or the reaper).
    ``run_escalated`` is not told through here: what it raises must reach the recording."""

    def step_settled(self, run_id: str, step: int, turn_done: int | None = None) -> None:
        for listener in self:
            try:
                listener.step_settled(run_id, step, turn_done)
            except Exception:
                logger.exception("run %s: listener failed on step %d settling", run_id, step)

    def reversal_asked(self, run_id: str, step: int) -> bool:
        """Whether every listener took the question."""
        told = True
        for listener in self:
            try:
                listener.reversal_asked(run_id, step)
            except Exception:
                told = False
                logger.exception("run %s: listener failed on the question of step %d", run_id, step)
        return told

    def run_idle(self, run_id: str) -> bool:
        """Whether a listener set the idle run moving again (the others are not asked)."""
        for listener in self:
            try:
                if listener.run_idle(run_id):
                    return True
            except Exception:
                logger.exception("run %s: listener failed to revive it", run_id)
        return False
