"""The escalation package's schema, version 1: what scripts, tickets and dashboards may rely on.

A field is only ever added within a version; renaming, removing or changing the meaning of one
makes version 2. Times are ISO 8601 strings in UTC (``null`` when unknown); arguments, results
and errors are the JSON the run recorded, unchanged.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

SCHEMA_VERSION = 1

#: Why a person has the run (``WhyDoc.kind``): the verdict the run ended with.
WhyKind = Literal[
    "compensation_failed",  # an undo gave up after its retries: requeue once the cause is fixed
    "compensation_not_built",  # a compensation function raised: the effect is live, no undo
    "after_pivot",  # a step failed past an irreversible one: nothing was unwound
    "in_doubt",  # nothing could tell whether a step's effect happened
    "deadline",  # no progress before the run's deadline: the reaper ended it
    "late_landing",  # an effect landed after its step was judged, too late to unwind
    "unhandled",  # the reaper could not read or resolve the run
    "unanswered",  # a person was asked whether to reverse an effect, and did not answer in time
    "other",
]

#: Where a run document was read: the live Redis keys (complete), or the SQL records once the
#: keys expired (the unwind is then partly inferred from the run's state and escalations).
Source = Literal["redis", "database"]


class UndoDoc(TypedDict):
    """An undo as pushed: the call that takes a step's effect back, with captured references."""

    tool: str
    args: dict[str, Any]
    description: str
    idempotency_key: str
    #: True when the undo could not be built (its description says why): it cannot run.
    broken: bool


class StackEntryDoc(UndoDoc):
    step: int


class StepDoc(TypedDict):
    step: int
    tool: str
    tool_class: int
    #: "read", "convergent write", "reversible write", "compensatable write", "irreversible write"
    class_name: str
    args: dict[str, Any]
    #: dispatched, running, succeeded, failed, in_doubt, skipped, not_dispatched, rejected
    state: str
    attempts: int
    result: Any
    error: dict[str, Any] | None
    #: For a step that was in doubt: what its lookup found ("happened", "not_happened", ...).
    reconciled: str
    #: Its effect landed after the step had been judged failed or in doubt.
    landed_late: bool
    #: What its success pushed on the stack (None: nothing to undo, or not known).
    undo: UndoDoc | None


class AttemptErrorDoc(TypedDict):
    #: The attempt number as the worker counted it (None when not recorded).
    attempt: int | None
    at: str | None
    type: str
    message: str


class CompensationDoc(TypedDict):
    step: int
    #: None when rebuilt from the database for a run whose undo was never recorded there.
    undo: UndoDoc | None
    #: pending, running, done, failed
    state: str
    #: Every attempt ever made, across requeues.
    attempts: int
    settled_at: str | None
    #: The Celery task that last ran it (what Flower shows).
    task_id: str
    #: Each failed attempt's error, oldest first (the last 20 are kept).
    errors: list[AttemptErrorDoc]
    #: Rounds it was given: 1, plus one per requeue.
    rounds: int
    #: False when the state was inferred from the run's records rather than read.
    recorded: bool


class LiveDoc(TypedDict):
    """An effect still live in the world once the run ended, and why it was not undone."""

    step: int
    tool: str
    result: Any
    why: str


class QuestionDoc(TypedDict):
    """An undo whose reversal a person is asked about (the tool's ``reversal`` policy): the
    unwind waits at it until someone answers reverse, keep (with a note) or later."""

    step: int
    #: The undo that would run, with the references it captured.
    tool: str
    args: dict[str, Any]
    description: str
    #: Why a person is asked (the tool's policy, as judged when the undo was pushed).
    why: str
    #: When it was asked and until when it may be answered (null when not known).
    asked_at: str | None
    until: str | None
    #: What an answer carries: the hash of the undo as it was asked (single-use).
    args_hash: str
    #: Earlier answers (``decision``, ``by``, ``note``, ``at``): a ``later``, oldest first.
    decisions: list[dict[str, Any]]


class RunDoc(TypedDict):
    """A run as the timeline draws it."""

    run_id: str
    state: str
    #: The verdict ("compensation failed", ...) or, while failing, what set it failing.
    reason: str
    cause: str
    pivot_step: int | None
    generation: int
    created_at: str | None
    ended_at: str | None
    #: The hosted agent that drove it ('' for a run driven by ``run.call``).
    agent: str
    steps: list[StepDoc]
    #: Undos still on the stack, oldest first.
    stack: list[StackEntryDoc]
    #: Newest step first: the order the unwind runs them.
    compensations: list[CompensationDoc]
    live: list[LiveDoc]
    #: Undos a person is asked about now, before they run (empty from the records).
    questions: list[QuestionDoc]
    source: Source
    #: True when Redis did not answer, so the run was read from the database although its keys
    #: may not have expired (what is live in Redis is then not shown). Absent: Redis was read.
    redis_unreachable: NotRequired[bool]


class WhyDoc(TypedDict):
    kind: WhyKind
    #: Other kinds that also apply (a run abandoned at its deadline whose undo then failed...).
    also: list[WhyKind]
    #: The verdict as recorded.
    reason: str
    #: One sentence for the person: what it means and what to do.
    summary: str


class AnswerCommandsDoc(TypedDict):
    """The commands that answer one question, ready to copy."""

    step: int
    show: str
    reverse: str
    keep: str
    later: str
    #: The HTTP API's answer (an ``operate`` token; ``decision`` reverse, keep or later).
    api: str


class CommandsDoc(TypedDict):
    show: str
    #: None when there is nothing to requeue (past the pivot, empty stack, resolved).
    requeue: str | None
    #: A requeue that corrects an undo's arguments first (None where not supported).
    requeue_with_correction: str | None
    #: None once resolved.
    resolve: str | None
    #: The commands answering each question the run asks a person now (``reversal="ask"``),
    #: one entry per question: ``step``, ``show``, ``reverse``, ``keep``, ``later``, ``api``.
    answer_reversal: list[AnswerCommandsDoc]


class EscalationDoc(TypedDict):
    schema_version: int
    kind: Literal["saga.escalation"]
    escalation_id: str
    run_id: str
    #: The requeue generation the escalation belongs to (None for the reaper's own escalation).
    generation: int | None
    created_at: str | None
    open: bool
    #: Why it was closed ('' while open).
    resolution: str
    why: WhyDoc
    #: What set the run failing ("step 4 failed", "aborted: ...").
    cause: str
    #: The run now (its timeline): the steps with class, arguments, result and attempts.
    run: RunDoc
    #: Where the run is now, if it moved on since (a requeue...); '' otherwise.
    moved_on: str
    #: As captured when it escalated: the stack, the undos that gave up, what is still live.
    stack: list[StackEntryDoc]
    failed_compensations: list[CompensationDoc]
    live: list[LiveDoc]
    requeueable: bool
    commands: CommandsDoc


class RunJsonDoc(RunDoc):
    """``saga show RUN --json``: a run document with its version."""

    schema_version: int
    kind: Literal["saga.run"]
