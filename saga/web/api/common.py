"""What every API route shares: the checked path parameters."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path
from fastapi.exceptions import RequestValidationError

from saga.errors import InvalidRunIdError
from saga.validation import check_escalation_id, check_run_id


def _run_id(run_id: Annotated[str, Path(max_length=200)]) -> str:
    try:
        return check_run_id(run_id)
    except InvalidRunIdError as exc:
        raise _invalid("run_id", exc) from None


def _escalation_id(
    escalation_id: Annotated[
        str, Path(max_length=200, description="<run_id>:<generation>, or <run_id>:reaper")
    ],
) -> str:
    # saga.validation's reading, the one the command line's ids go through too.
    try:
        return check_escalation_id(escalation_id)
    except InvalidRunIdError as exc:
        raise _invalid("escalation_id", exc) from None


def _invalid(name: str, exc: Exception) -> RequestValidationError:
    return RequestValidationError([{"loc": ("path", name), "msg": str(exc), "type": "value_error"}])


RunId = Annotated[str, Depends(_run_id)]
EscalationId = Annotated[str, Depends(_escalation_id)]
ApprovalId = Annotated[str, Path(pattern=r"^[0-9]{1,9}:[0-9]{1,9}$", description="<turn>:<call>")]
