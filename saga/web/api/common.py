"""What every API route shares: the checked path parameters."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path
from fastapi.exceptions import RequestValidationError

from saga.errors import InvalidRunIdError
from saga.validation import check_run_id

_ESCALATION_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}:[0-9]{1,31}$"


def _run_id(run_id: Annotated[str, Path(max_length=200)]) -> str:
    try:
        return check_run_id(run_id)
    except InvalidRunIdError as exc:
        error = {"loc": ("path", "run_id"), "msg": str(exc), "type": "value_error"}
        raise RequestValidationError([error]) from None


RunId = Annotated[str, Depends(_run_id)]
EscalationId = Annotated[str, Path(pattern=_ESCALATION_ID, description="<run_id>:<generation>")]
ApprovalId = Annotated[str, Path(pattern=r"^[0-9]{1,9}:[0-9]{1,9}$", description="<turn>:<call>")]
