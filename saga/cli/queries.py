"""What the commands read: ``saga.listing`` (runs, newest first, Redis and SQL together) and
``saga.queries`` (one run, one escalation), shared with the HTTP API and the console."""

from __future__ import annotations

from saga.listing import RunFilter, RunRow, list_runs
from saga.queries import (
    escalation_doc,
    escalation_rows,
    escalation_summary,
    find_escalation,
    run_doc,
)

__all__ = [
    "RunFilter",
    "RunRow",
    "escalation_doc",
    "escalation_rows",
    "escalation_summary",
    "find_escalation",
    "list_runs",
    "run_doc",
]
