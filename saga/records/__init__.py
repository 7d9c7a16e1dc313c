"""The SQL record of runs, for people: what happened once a run's Redis keys have expired,
and what a requeue rebuilds a run from then.

``models`` holds the tables, ``store`` the ``RecordStore`` that writes and reads them, ``rows``
the translation between a run's picture and its rows, ``migrations`` the schema's revisions
(``migrations.upgrade(url)``, ``migrations.status(url)``).
"""

from saga.records.models import (
    ActionRecord,
    EscalationRecord,
    RunCompensationRecord,
    RunRecord,
    RunStepRecord,
    TranscriptRecord,
)
from saga.records.store import RecordStore

__all__ = [
    "ActionRecord",
    "EscalationRecord",
    "RecordStore",
    "RunCompensationRecord",
    "RunRecord",
    "RunStepRecord",
    "TranscriptRecord",
]
