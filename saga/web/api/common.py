"""What every API route shares: the checked path parameters."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path
from fastapi.exceptions import RequestValidationError
from pydantic import BeforeValidator

from saga.errors import InvalidRunIdError
from saga.listing import parse_since
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


def _since(value: object) -> object:
    """A query's ``since`` as ``saga runs --since`` takes it (a ValueError is a 422)."""
    return parse_since(value) if isinstance(value, str) else value


RunId = Annotated[str, Depends(_run_id)]
EscalationId = Annotated[str, Depends(_escalation_id)]
#: ``since``: an ISO 8601 date/time or a duration ago (``30m``, ``2h``, ``7d``), as the CLI's.
Since = Annotated[float | None, BeforeValidator(_since)]
ApprovalId = Annotated[str, Path(pattern=r"^[0-9]{1,9}:[0-9]{1,9}$", description="<turn>:<call>")]
