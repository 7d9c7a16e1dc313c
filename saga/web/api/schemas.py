"""The bodies the API accepts and the listings it answers, as pydantic models: the OpenAPI
schema is the contract, and a body that breaks it is refused (422) naming the field, before
anything happens. Unknown fields are refused too: a typo must not pass for an omission.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
)

from saga.errors import InvalidRunIdError, InvalidTextError
from saga.validation import (
    AGENT_NAME,
    REASON_MAX_LENGTH,
    RUN_ID_MAX_LENGTH,
    check_run_id,
    check_text,
)


def _plain(value: str) -> str:
    """Saga's own check of free text (no NUL), so what the schema takes saga takes too; the
    length is each field's own."""
    try:
        return check_text("the text", value, max_length=len(value))
    except InvalidTextError as exc:  # a ValueError names the field: body.input
        raise ValueError(str(exc)) from None


#: What a person types: bounded, never blank (a note or a reason is kept with the record).
Note = Annotated[
    str,
    StringConstraints(strip_whitespace=True, min_length=1, max_length=REASON_MAX_LENGTH),
    AfterValidator(_plain),
]
ArgsHash = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
#: ``saga.validation.AGENT_NAME``: the names ``saga.agent(...)`` accepts.
AgentName = Annotated[str, StringConstraints(pattern=AGENT_NAME.pattern)]


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CreateRun(Body):
    """A hosted run: ``agent`` declared on the workers, the user's ``input``; ``run_id``
    makes the request idempotent (the same body again answers the same run)."""

    agent: AgentName
    input: Annotated[str, StringConstraints(min_length=1), AfterValidator(_plain)]
    run_id: Annotated[str | None, Field(max_length=RUN_ID_MAX_LENGTH)] = None

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, value: str | None) -> str | None:
        try:
            return None if value is None else check_run_id(value)
        except InvalidRunIdError as exc:  # a ValueError names the field: body.run_id
            raise ValueError(str(exc)) from None


class Abort(Body):
    reason: Note = "aborted by an operator"


class Approve(Body):
    """The hash of the arguments the person saw (``pending_approvals[].args_hash``)."""

    args_hash: ArgsHash


class Deny(Body):
    args_hash: ArgsHash
    reason: Note


#: A note that may be empty (a reverse or a later needs none; a keep is refused without one).
OptionalNote = Annotated[
    str, StringConstraints(strip_whitespace=True, max_length=REASON_MAX_LENGTH)
]


class ReversalAnswer(Body):
    """A person's answer about reversing an undo: ``reverse``, ``keep`` (with a ``note``
    saying why, for the books) or ``later``; ``args_hash`` as ``GET .../reversals`` showed it."""

    decision: Literal["reverse", "keep", "later"]
    args_hash: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{40}$")]
    note: OptionalNote = ""


class Requeue(Body):
    """``corrections``: step number → arguments merged into that step's undo first, e.g.
    ``{"3": {"ticket_id": 9105}}``."""

    corrections: dict[
        Annotated[str, StringConstraints(pattern=r"^[0-9]{1,9}$")], dict[str, Any]
    ] = Field(default_factory=dict)

    def steps(self) -> dict[int, dict[str, Any]]:
        return {int(step): fix for step, fix in self.corrections.items()}


class Resolve(Body):
    note: Note


class RunRowOut(BaseModel):
    run_id: str
    state: str
    reason: str
    agent: str
    created_at: str | None
    ended_at: str | None
    tools: list[str]
    open_escalation: str | None
    source: str


class RunList(BaseModel):
    runs: list[RunRowOut]
    #: Pass as ``cursor`` for the next page; null when there is nothing older.
    next_cursor: str | None


class EscalationRowOut(BaseModel):
    escalation_id: str
    run_id: str
    reason: str
    cause: str
    created_at: str | None
    open: bool
    resolution: str
    live: int
    failed_compensations: int


class EscalationList(BaseModel):
    escalations: list[EscalationRowOut]


class Requeued(BaseModel):
    escalation_id: str
    run_id: str
    requeued: int
    by: str


class Decided(BaseModel):
    run_id: str
    approval_id: str
    verdict: str
    by: str
    #: True when an earlier request took this very decision (this one changed nothing).
    repeated: bool = False
