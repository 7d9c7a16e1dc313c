"""What a listing of runs is made of, apart from how a page of it is found.

A listed run is one ``RunRow`` whether it was read from a run's Redis keys or from its SQL
record; rows sort by ``Position`` (creation time in whole microseconds, then the run id, both
descending), the same number in Redis's creation index, the run's hash and its SQL row, and a
cursor is a position encoded; a ``RunFilter`` says which rows a listing keeps, and ``since``
is written by people as ``parse_since`` reads it. The sync walk over Redis and SQL
(``saga.listing``) and the asyncio client's walk over Redis (``saga.aio``) share these, so
both order, page and filter alike.
"""

from __future__ import annotations

import base64
import binascii
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from saga.errors import InvalidCursorError

__all__ = [
    "ROW_FIELDS",
    "Position",
    "RunFilter",
    "RunPage",
    "RunRow",
    "datetime_of",
    "micros",
    "micros_of",
    "parse_since",
    "row_of_head",
    "index_score",
]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICRO = timedelta(microseconds=1)
#: The first and last moments a datetime holds, as microseconds since the epoch.
_FIRST_US = (datetime.min.replace(tzinfo=UTC) - _EPOCH) // _MICRO
_LAST_US = (datetime.max.replace(tzinfo=UTC) - _EPOCH) // _MICRO
#: The fields of a run's hash a row is made of (``row_of_head``), in its order.
ROW_FIELDS = ["state", "reason", "created", "ended", "generation", "resolved", "version"]


@dataclass(frozen=True, order=True)
class Position:
    """Where a row sorts: creation time in microseconds, then the run id."""

    created_us: int
    run_id: str

    def encode(self) -> str:
        raw = f"{self.created_us}:{self.run_id}".encode()
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @classmethod
    def decode(cls, cursor: str) -> Position:
        """The position a cursor names; ``InvalidCursorError`` for anything else."""
        try:
            raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
            micros, _, run_id = raw.partition(":")
            position = cls(int(micros), run_id)
        except (ValueError, UnicodeDecodeError, binascii.Error):
            raise InvalidCursorError(f"cursor {cursor[:40]!r} is not one a listing gave") from None
        if not run_id or not 0 <= position.created_us <= _LAST_US:
            raise InvalidCursorError(f"cursor {cursor[:40]!r} is not one a listing gave")
        return position


_SINCE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_EARLIEST = datetime(1, 1, 2, tzinfo=UTC).timestamp()
_DURATION = re.compile(r"(\d{1,9}(?:\.\d{1,6})?)([smhdw])")


def parse_since(text: str, now: float | None = None) -> float:
    """A ``since`` as a person writes it, the same for the ``saga`` command and the API:
    ``30m``, ``2h``, ``7d``, ``1w`` (that long before ``now``), or an ISO 8601 date/time
    (UTC unless it says otherwise) → seconds since the epoch. ``ValueError`` otherwise."""
    value = text.strip()
    match = _DURATION.fullmatch(value)
    if match:
        ago = (time.time() if now is None else now) - float(match[1]) * _SINCE_UNITS[match[2]]
        if ago < _EARLIEST:  # what a date can say; SQL's columns hold no earlier one
            raise ValueError(f"{value!r} reaches back before the year 1")
        return ago
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"{value!r} is neither a duration (30m, 2h, 7d) nor an ISO date") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def micros(timestamp: float) -> int:
    return round(timestamp * 1_000_000)


def micros_of(value: datetime) -> int:
    """A SQL column's moment as a position's microseconds (naive: UTC)."""
    return ((value if value.tzinfo else value.replace(tzinfo=UTC)) - _EPOCH) // _MICRO


def datetime_of(created_us: int) -> datetime:
    """A position's microseconds as a SQL column's moment."""
    # A bound past the calendar's ends (since 0001-01-01+14:00) is that end: nothing is older.
    return _EPOCH + min(max(created_us, _FIRST_US), _LAST_US) * _MICRO


def index_score(created_us: int) -> str:
    """A score bound that includes the entries of exactly that microsecond."""
    return f"{created_us / 1_000_000:.6f}"


@dataclass(frozen=True)
class RunRow:
    run_id: str
    state: str
    reason: str
    agent: str
    created: float | None
    ended: float | None
    tools: tuple[str, ...]
    #: Where the row was read: "redis" (live keys) or "database".
    source: str
    #: The open escalation of the run, if any.
    escalation: str = ""
    created_us: int = 0

    @property
    def position(self) -> Position:
        return Position(self.created_us, self.run_id)

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "state": self.state,
            "reason": self.reason,
            "agent": self.agent,
            "created_at": _iso(self.created),
            "ended_at": _iso(self.ended),
            "tools": list(self.tools),
            "open_escalation": self.escalation or None,
            "source": self.source,
        }


def _iso(timestamp: float | None) -> str | None:
    return None if timestamp is None else datetime.fromtimestamp(timestamp, UTC).isoformat()


def row_of_head(
    run_id: str, head: Sequence[str | None], agent: str | None, created_us: int | None = None
) -> RunRow | None:
    """The row of a run from its hash's ``ROW_FIELDS`` and its agent's name; None if the
    run's keys are gone."""
    state, reason, created, ended, generation, resolved, version = head
    if state is None:
        return None
    created_at = float(created) if created else 0.0
    open_ = state == "escalated" and not (resolved and resolved == version)
    return RunRow(
        run_id,
        state,
        reason or "",
        agent or "",
        created_at,
        float(ended) if ended else None,
        (),
        "redis",
        f"{run_id}:{generation or 0}" if open_ else "",
        micros(created_at) if created_us is None else created_us,
    )


@dataclass(frozen=True)
class RunFilter:
    """What a listing keeps. ``escalated``: True for runs with an open escalation, False for
    runs without one, None for both. ``since``/``until``: creation time, seconds since the
    epoch, ``since`` inclusive and ``until`` exclusive."""

    states: tuple[str, ...] = ()
    agent: str | None = None
    tool: str | None = None
    since: float | None = None
    until: float | None = None
    escalated: bool | None = None
    limit: int = 50

    def keeps(self, row: RunRow) -> bool:
        return (
            (not self.states or row.state in self.states)
            and (self.agent is None or row.agent == self.agent)
            and (self.tool is None or self.tool in row.tools)
            and (self.since is None or row.created_us >= micros(self.since))
            and (self.until is None or row.created_us < micros(self.until))
            and (self.escalated is None or bool(row.escalation) == self.escalated)
        )


@dataclass(frozen=True)
class RunPage:
    rows: list[RunRow]
    #: Pass it back for the next page; None when there is nothing older.
    next_cursor: str | None = None
