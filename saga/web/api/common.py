"""What every API route shares: the checked path parameters."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path
from fastapi.exceptions import RequestValidationError
from pydantic import BeforeValidator

from saga.errors import InvalidRunIdError
from saga.listing import parse_since
from saga.validation import check_run_id

_ESCALATION_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}:[0-9]{1,31}$"


def _run_id(run_id: Annotated[str, Path(max_length=200)]) -> str:
    try:
        return check_run_id(run_id)
    except InvalidRunIdError as exc:
        error = {"loc": ("path", "run_id"), "msg": str(exc), "type": "value_error"}
        raise RequestValidationError([error]) from None


def _since(value: object) -> object:
    """A query's ``since`` as ``saga runs --since`` takes it (a ValueError is a 422)."""
    return parse_since(value) if isinstance(value, str) else value


RunId = Annotated[str, Depends(_run_id)]
#: ``since``: an ISO 8601 date/time or a duration ago (``30m``, ``2h``, ``7d``), as the CLI's.
Since = Annotated[float | None, BeforeValidator(_since)]
EscalationId = Annotated[str, Path(pattern=_ESCALATION_ID, description="<run_id>:<generation>")]
ApprovalId = Annotated[str, Path(pattern=r"^[0-9]{1,9}:[0-9]{1,9}$", description="<turn>:<call>")]
