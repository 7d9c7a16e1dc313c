"""What a notice says: the escalation as a JSON document (``schema_version`` 1).

One function builds it, so the webhook and the callable sink always agree, and so the document
can grow (or be replaced by a richer one) in one place. Its ``id`` is the escalation id, the
same on every retry of the notice: receivers deduplicate on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from saga.records import EscalationRecord

SCHEMA_VERSION = 1
NOTICE_TYPE = "saga.escalation"


def notification_body(record: EscalationRecord) -> dict[str, Any]:
    """The escalation as a person (or a pager) needs it: verdict, cause, and what is live."""
    created = record.created_at
    return {
        "schema_version": SCHEMA_VERSION,
        "type": NOTICE_TYPE,
        "id": record.escalation_id,
        "escalation_id": record.escalation_id,
        "run_id": record.run_id,
        "reason": record.reason,
        "cause": record.cause or "",
        "created_at": created.isoformat() if created is not None else None,
        "resolved": bool(record.resolved),
        "resolution": record.resolution or "",
        "steps_done": list(record.steps_done or []),
        "stack": list(record.stack or []),
        "failed_compensations": list(record.failed_compensations or []),
        "not_undone": list(record.not_undone or []),
    }
