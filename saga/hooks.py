"""The one extension point: what happens when a run ends or escalates.

Subclass ``SagaHooks`` and override what you need (page someone, post to a channel). Every
method is a no-op here, so a hook that forgets one breaks nothing. A hook that raises is logged
and does not undo the recording: the record in the database is the source of truth.
"""

from __future__ import annotations

from saga.picture import RunPicture
from saga.records import EscalationRecord


class SagaHooks:
    def on_run_ended(self, picture: RunPicture, state: str, reason: str) -> None:
        """Called once a run is completed, compensated or escalated (and recorded)."""

    def on_escalation(self, escalation: EscalationRecord) -> None:
        """Called when a person must take over: the record holds the whole picture."""
