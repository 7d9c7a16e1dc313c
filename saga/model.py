"""The vocabulary: tool classes, run and step states, the undo a step leaves behind.

States are ``str`` enums so Redis and the database hold the readable value, never an ordinal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Any


class ToolClass(IntEnum):
    """How a tool's effect can be taken back; this decides what the saga must do with it."""

    READ = 1
    CONVERGENT_WRITE = 2
    REVERSIBLE_WRITE = 3
    COMPENSATABLE_WRITE = 4
    IRREVERSIBLE_WRITE = 5

    @property
    def needs_compensation(self) -> bool:
        return self in (ToolClass.REVERSIBLE_WRITE, ToolClass.COMPENSATABLE_WRITE)

    @property
    def is_write(self) -> bool:
        return self is not ToolClass.READ


class RunState(StrEnum):
    RUNNING = "running"
    UNWINDING = "unwinding"
    COMPLETED = "completed"
    COMPENSATED = "compensated"
    ESCALATED = "escalated"
    #: A hosted run whose agent no worker hosts ended before its first step: nothing ran,
    #: so nothing is undone (it is no compensation).
    FAILED_TO_START = "failed_to_start"

    @property
    def ended(self) -> bool:
        return self in (
            RunState.COMPLETED,
            RunState.COMPENSATED,
            RunState.ESCALATED,
            RunState.FAILED_TO_START,
        )


class StepState(StrEnum):
    DISPATCHED = "dispatched"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    #: Its worker died, it timed out or was revoked: whether the effect happened is unknown.
    IN_DOUBT = "in_doubt"
    SKIPPED = "skipped"
    NOT_DISPATCHED = "not_dispatched"
    #: The tool refused (``ToolRejected``), or failed where its agent feeds failures back to the
    #: model: nothing happened, and the run goes on.
    REJECTED = "rejected"


class OnFailure(StrEnum):
    """What a tool's final failure does to its run: hosted, driven from Python, or bridged."""

    #: The caller (or the model) gets the error and decides; the run goes on.
    FEED_BACK = "feed_back"
    #: The run unwinds (or escalates past the pivot): the seed's rule for writes.
    UNWIND = "unwind"


class CompensationState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    #: Its tool's reversal policy asks a person first: the unwind waits here, holding no worker.
    ASKED = "asked"
    #: A person decided to keep the effect (with a note): live on purpose, never undone.
    KEPT = "kept"


@dataclass(frozen=True)
class Undo:
    """What a step pushes on the stack: the call that takes its effect back.

    ``args`` hold the references the step captured (the credit id, the previous status), so the
    compensation never has to re-derive what to undo from a world that has moved on.
    """

    tool: str
    args: dict[str, Any] = field(default_factory=dict)
    description: str = ""


@dataclass(frozen=True)
class StepContext:
    """What a tool receives besides its arguments.

    ``idempotency_key`` is the same on every delivery of the same step (or compensation), so a
    tool that records it can answer a redelivery with the effect it already applied.
    """

    run_id: str
    step: int
    idempotency_key: str
    attempt: int
    compensating: bool = False
