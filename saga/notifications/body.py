"""What a notice says: the escalation package (``saga.escalations``, ``schema_version`` 1),
the same document ``saga escalation show ID --json`` prints, plus the notice's ``id``.

One function builds it, so the webhook and the callable sink always agree with the card a
person reads. Its ``id`` is the escalation id, the same on every retry of the notice:
receivers deduplicate on it.
"""

from __future__ import annotations

from typing import Any

from saga.escalations.package import escalation_package
from saga.escalations.schema import SCHEMA_VERSION as SCHEMA_VERSION
from saga.picture import RunPicture
from saga.records import EscalationRecord, RunRecord

NOTICE_TYPE = "saga.escalation"


def notification_body(
    record: EscalationRecord,
    picture: RunPicture | None = None,
    run: RunRecord | None = None,
    *,
    command: str = "saga",
) -> dict[str, Any]:
    """The escalation as a person (or a pager) needs it: why, cause, timeline, stack, each
    failed undo's errors, what is live, the commands; ``picture`` or ``run`` give the timeline
    (without either, it is built from what the escalation captured). ``command``: how
    ``saga`` is invoked for this application (``saga --app module:attr``), as the commands
    print it."""
    package = escalation_package(record, picture=picture, run=run, command=command)
    return {**package, "id": record.escalation_id, "type": NOTICE_TYPE}
