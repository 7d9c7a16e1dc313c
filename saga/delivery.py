"""What every delivery of a tool's message does, whichever way it runs (forward as a step or
backward as a compensation): it tells itself from any other delivery of the same message,
calls the tool's function between its fault points, judges whether a failure may be retried,
and waits out a brief outage of the stack's Redis rather than lose what it has to record.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

from celery import Task

from saga.core import Core
from saga.errors import InvalidArgumentsError, ToolRejected
from saga.model import StepContext
from saga.retry import RetryPolicy
from saga.tools import Tool

# The workers' logger, whichever of their modules logs: operators and tests match its name.
logger = logging.getLogger("saga.worker")

T = TypeVar("T")

#: A delivery that finds another holding the step's (or undo's) lease looks again this soon:
#: short, because every delay a worker holds a message for counts against the visibility
#: timeout (the start-up guard adds it to the time limit).
BUSY_WAIT = RetryPolicy(attempts=2, backoff=1.0, backoff_max=1.0, jitter=False)


def claim_of(task: Task) -> str:
    """What tells this execution from any other delivery of the same message."""
    return f"{task.request.id or ''}/{uuid.uuid4().hex[:12]}"


def strike(core: Core, point: str, tool: Tool) -> None:
    if core.faults is not None:
        core.faults.strike(point, tool.name)


def error_of(exc: BaseException, attempt: int) -> dict[str, Any]:
    return {"type": type(exc).__name__, "message": str(exc)[:2000], "attempt": attempt}


def retryable(exc: BaseException) -> bool:
    refused = isinstance(exc, InvalidArgumentsError | ToolRejected)
    return bool(getattr(exc, "retryable", True)) and not refused


def call_tool(tool: Tool, ctx: StepContext, args: dict[str, Any]) -> Any:
    kwargs = tool.python_args(args)
    if tool.wants_context:
        kwargs["ctx"] = ctx
    return tool.func(**kwargs)


def from_the_tool(exc: BaseException) -> TracebackType | None:
    """What ``exc`` went through from the tool's own code on (what ``call_tool`` called), to
    report a tool's failure without saga's frames above it; None when it did not come out of
    a call ``call_tool`` made (saga's own error, a fault point, a retry, or the call itself
    refused), which is reported whole."""
    entry = exc.__traceback__
    while entry is not None:
        if entry.tb_frame.f_code is _CALL_TOOL:
            return entry.tb_next
        entry = entry.tb_next
    return None


_CALL_TOOL = call_tool.__code__


def patiently(core: Core, what: str, call: Callable[..., T], *args: Any) -> T:
    """``Core.patiently``: ``call`` again while the stack's Redis is unreachable, bounded (a
    repeat converges: every script answers it with what its first call decided)."""
    return core.patiently(what, call, *args)
