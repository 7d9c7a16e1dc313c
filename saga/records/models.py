"""The tables of the SQL record: what a person (or a dashboard) reads once a run's Redis keys
have expired, and what a requeue rebuilds the run from.

The schema is owned by the migrations in ``saga/records/migrations``; these models must match
them exactly (a test compares the two with Alembic's autogenerate). Change both together: a new
column here needs a new revision there.

Times are UTC. JSON columns hold what the Redis keys held, decoded.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Boolean, DateTime, Float, Index, Integer, String, Text, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from saga.validation import RUN_ID_MAX_LENGTH

#: ``<run_id>:<generation>``: a generation is a requeue counter, 31 digits is plenty.
ESCALATION_ID_LENGTH = RUN_ID_MAX_LENGTH + 32
#: ``<escalation_id>:requeue`` or ``<escalation_id>:resolve``: the escalation acted on.
ACTION_ID_LENGTH = RUN_ID_MAX_LENGTH + 48
#: Tool names, owners and people's names: identifiers, not prose.
NAME_LENGTH = 200
#: An API token's name (it becomes the ``by`` of what is done with it, within ``NAME_LENGTH``).
TOKEN_NAME_LENGTH = 100


class Base(DeclarativeBase):
    pass


class RunRecord(Base):
    """One row per run, rewritten each time the run ends (again, after a requeue).

    ``steps`` keeps the whole run readable in one row (each ``StepRecord`` as a dict); the same
    steps are rows of ``saga_steps`` too, where they can be queried. The columns after it are
    what a requeue needs to rebuild the run's Redis state once its keys have expired; they are
    empty for a run recorded before they existed (such a run cannot be rebuilt).
    """

    __tablename__ = "saga_runs"

    run_id: Mapped[str] = mapped_column(String(RUN_ID_MAX_LENGTH), primary_key=True)
    state: Mapped[str] = mapped_column(String(16), index=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    steps: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    #: What set a failing run on its way, once ``reason`` holds the verdict.
    cause: Mapped[str] = mapped_column(Text, default="", server_default="")
    #: The hosted agent that ran it ('' for a run driven by ``run.call``).
    agent: Mapped[str] = mapped_column(
        String(NAME_LENGTH), default="", server_default="", index=True
    )
    pivot_step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    #: How many times it was requeued.
    generation: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    #: The Redis version this record describes (None: recorded before it was kept).
    version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    #: Who owned its last unwind (``step:<n>``, ``requeue:<g>``, ...).
    owner: Mapped[str] = mapped_column(String(NAME_LENGTH), default="", server_default="")
    deadline_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    #: Why it had to end escalated whatever its unwind did (a step left in doubt).
    doubt: Mapped[str] = mapped_column(Text, default="", server_default="")
    updated_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class RunStepRecord(Base):
    """One step of a run as it stood when the run's record was written."""

    __tablename__ = "saga_steps"

    run_id: Mapped[str] = mapped_column(String(RUN_ID_MAX_LENGTH), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    tool: Mapped[str] = mapped_column(String(NAME_LENGTH), index=True)
    #: 1-5 (``ToolClass``).
    tool_class: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(Integer)
    args: Mapped[dict[str, Any]] = mapped_column(JSON)
    result: Mapped[Any] = mapped_column(JSON, nullable=True)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    #: For a step that was in doubt: what its lookup found.
    reconciled: Mapped[str] = mapped_column(String(16), default="")
    #: "late" when its effect landed after the step had been judged.
    landed: Mapped[str] = mapped_column(String(16), default="")
    #: For a step a hosted turn dispatched: ``<turn>:<call>``.
    call: Mapped[str] = mapped_column(String(64), default="")
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class RunCompensationRecord(Base):
    """One undo of a run and its attempts: every attempt ever made (``attempts``), where the
    current round's budget starts (``round_start``), each earlier round as it was given up on
    (``history``: ``{"attempts", "error", "at"}``) and each failed attempt's error
    (``errors``)."""

    __tablename__ = "saga_compensations"

    run_id: Mapped[str] = mapped_column(String(RUN_ID_MAX_LENGTH), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    #: The compensation tool ('' for an undo that could not be built).
    tool: Mapped[str] = mapped_column(String(NAME_LENGTH))
    #: The stack entry: ``step``, ``tool``, ``args``, ``idempotency_key``, ``description``.
    entry: Mapped[dict[str, Any]] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(Integer)
    round_start: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    settled_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    #: The Celery task that last ran it (what Flower shows).
    task_id: Mapped[str] = mapped_column(String(NAME_LENGTH + RUN_ID_MAX_LENGTH), default="")
    history: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    #: Each failed attempt's ``{"error", "at"}``, oldest first, across requeues (the last 20).
    errors: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    #: Its place on the stack, oldest first; None once it is done (off the stack).
    stack_position: Mapped[int | None] = mapped_column(Integer, nullable=True)
    #: A person's answers about reversing it (``decision``, ``by``, ``note``, ``at``), oldest
    #: first, when its tool's reversal policy asked (``saga.tools``).
    decisions: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)


class TranscriptRecord(Base):
    """A hosted agent's conversation: its input, each turn's answer (raw response and usage
    included) and what its calls returned; written with the run's record, in one transaction."""

    __tablename__ = "saga_transcripts"

    run_id: Mapped[str] = mapped_column(String(RUN_ID_MAX_LENGTH), primary_key=True)
    agent: Mapped[str] = mapped_column(String(100), index=True)
    input_tokens: Mapped[int] = mapped_column(Integer, default=0)
    output_tokens: Mapped[int] = mapped_column(Integer, default=0)
    model_calls: Mapped[int] = mapped_column(Integer, default=0)
    transcript: Mapped[dict[str, Any]] = mapped_column(JSON)


class EscalationRecord(Base):
    """The whole picture handed to a person: not "the run failed", but what is live and why.

    One row per escalation of a run (``escalation_id`` is ``<run_id>:<generation>``; each
    requeue that escalates again is a new generation, and closes the row before it). The JSON
    fields, as written when the run concluded:

    - ``steps_done``: the steps that succeeded, each a ``StepRecord`` as a dict (``step``,
      ``tool``, ``tool_class`` as 1-5, ``args``, ``state``, ``attempts``, ``result``,
      ``error``, ``reconciled``, ``started``).
    - ``stack``: the undo entries still on the stack, oldest first (``step``, ``tool``,
      ``args``, ``idempotency_key``, ``description``; ``broken`` if it could not be built).
    - ``failed_compensations``: each undo that gave up (``step``, ``undo`` its entry,
      ``attempts``, ``error`` as ``{"type", "message", ...}``, ``state``).
    - ``not_undone``: every effect still live in the world (``step``, ``tool``, ``result``,
      ``why``: irreversible, past the pivot, its compensation failed, in doubt, ...).

    ``resolved`` turns true when a later escalation of the run supersedes it, when a requeued
    unwind ends compensated, or when a person resolves it (``resolved_by`` is then that
    person, ``resolution`` their note); ``resolved_at`` says when.
    """

    __tablename__ = "saga_escalations"

    escalation_id: Mapped[str] = mapped_column(String(ESCALATION_ID_LENGTH), primary_key=True)
    run_id: Mapped[str] = mapped_column(String(RUN_ID_MAX_LENGTH), index=True)
    #: The verdict ("compensation failed", "failed after an irreversible step", ...).
    reason: Mapped[str] = mapped_column(Text)
    #: What set the run failing ("step 5 failed", "aborted: ...").
    cause: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    steps_done: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    stack: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    failed_compensations: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    not_undone: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    resolved: Mapped[bool] = mapped_column(Boolean, default=False)
    #: Why it was closed: superseded by a later escalation of the same run, compensated after
    #: a requeue, a person's note ... ('' while open).
    resolution: Mapped[str] = mapped_column(Text, default="")
    #: The person who resolved it by hand ('' while open, or when the saga closed it).
    resolved_by: Mapped[str] = mapped_column(String(NAME_LENGTH), default="", server_default="")
    resolved_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class ActionRecord(Base):
    """What an operator did to a run, and who: a requeue (with the corrections made to undo
    arguments, each ``{"before", "after"}``) or a resolve (with the note)."""

    __tablename__ = "saga_actions"

    action_id: Mapped[str] = mapped_column(String(ACTION_ID_LENGTH), primary_key=True)
    run_id: Mapped[str] = mapped_column(String(RUN_ID_MAX_LENGTH), index=True)
    #: The escalation acted on.
    escalation_id: Mapped[str] = mapped_column(String(ESCALATION_ID_LENGTH))
    #: "requeue" or "resolve".
    kind: Mapped[str] = mapped_column(String(16))
    by: Mapped[str] = mapped_column(String(NAME_LENGTH))
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    note: Mapped[str] = mapped_column(Text, default="")
    #: Step number (as a string) -> ``{"before": args, "after": args}``; {} for none.
    corrections: Mapped[dict[str, Any]] = mapped_column(JSON)
    #: Compensations a requeue sent again (0 for a resolve).
    count: Mapped[int] = mapped_column(Integer, default=0)


class ApiTokenRecord(Base):
    """A bearer token of the HTTP API (``saga tokens create``). Only the SHA-256 of the token
    is kept: the token is 256 random bits, so its hash cannot be reversed or guessed, and a
    copy of this table lets nobody in. ``token_id`` is the token's public part, what a request
    is looked up by before its digest is compared in constant time."""

    __tablename__ = "saga_api_tokens"
    #: One live token per name (migration 0004): the ``by`` of an action names one holder.
    __table_args__ = (
        Index(
            "ux_saga_api_tokens_live_name",
            "name",
            unique=True,
            postgresql_where=text("revoked_at IS NULL"),
            sqlite_where=text("revoked_at IS NULL"),
        ),
    )

    token_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    digest: Mapped[str] = mapped_column(String(64))
    #: Who acts with it: the ``by`` of every operator action taken with the token.
    name: Mapped[str] = mapped_column(String(TOKEN_NAME_LENGTH), index=True)
    #: "read" or "operate".
    scope: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
