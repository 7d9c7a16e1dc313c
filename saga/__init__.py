"""saga: make an AI agent's tool calls safe to fail.

Each tool call runs as a Celery task; each successful write pushes its undo onto a Redis-backed
stack; a failure unwinds the stack in reverse order, and past the pivot (the first irreversible
step) a person gets the whole picture instead.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from saga.errors import (
    CallRefusedError,
    CompensationBuildError,
    CompensationNotBuiltError,
    ConfigurationError,
    DatabaseSchemaError,
    DispatchError,
    EscalationResolvedError,
    FaultInjectionDisabledError,
    InjectedFaultError,
    InvalidArgumentsError,
    InvalidCorrectionError,
    InvalidRunIdError,
    InvalidRunOptionError,
    InvalidTextError,
    MessageNotSentError,
    NonRetryableToolError,
    NothingToRequeueError,
    OperationRefusedError,
    PayloadError,
    RunContendedError,
    RunEndedError,
    RunExistsError,
    SagaError,
    StepFailedError,
    StepInDoubtError,
    StepRejectedError,
    StepsInFlightError,
    StepSkippedError,
    StoreUnavailableError,
    ToolDefinitionError,
    ToolNotOfferedError,
    ToolRejected,
    ToolResultError,
    UnknownEscalationError,
    UnknownRunError,
    UnknownToolError,
    WaitTimeoutError,
)
from saga.model import (
    CompensationState,
    OnFailure,
    RunState,
    StepContext,
    StepState,
    ToolClass,
    Undo,
)

# For type checkers: these names are exported lazily (``__getattr__`` below), so ``import saga``
# loads neither Celery nor the engine until a name is used.
if TYPE_CHECKING:
    from saga.engine import Saga
    from saga.hooks import SagaHooks
    from saga.picture import CompensationRecord, RunPicture, StepRecord
    from saga.reaper import ReapReport
    from saga.records import ActionRecord, EscalationRecord, RecordStore, RunRecord
    from saga.retry import RetryPolicy
    from saga.runs import Run, StepHandle
    from saga.settings import Settings
    from saga.tools import Tool, ToolRegistry

#: The names whose modules need Celery, Redis, SQLAlchemy or pydantic: imported on first use,
#: so ``import saga`` stays cheap for what needs none of them (the ``saga`` command's
#: read-only path, a web app that only imports ``saga.client``).
_LAZY = {
    "Saga": "saga.engine",
    "SagaHooks": "saga.hooks",
    "CompensationRecord": "saga.picture",
    "RunPicture": "saga.picture",
    "StepRecord": "saga.picture",
    "ReapReport": "saga.reaper",
    "ActionRecord": "saga.records",
    "EscalationRecord": "saga.records",
    "RecordStore": "saga.records",
    "RunRecord": "saga.records",
    "RetryPolicy": "saga.retry",
    "Run": "saga.runs",
    "StepHandle": "saga.runs",
    "Settings": "saga.settings",
    "Tool": "saga.tools",
    "ToolRegistry": "saga.tools",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'saga' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    # Declaring tools
    "RetryPolicy",
    "StepContext",
    "Tool",
    "ToolClass",
    "ToolRegistry",
    "ToolRejected",
    "Undo",
    # Running an agent
    "Run",
    "Saga",
    "SagaHooks",
    "Settings",
    "OnFailure",
    "StepHandle",
    # What a run looks like
    "ActionRecord",
    "CompensationRecord",
    "CompensationState",
    "EscalationRecord",
    "RecordStore",
    "ReapReport",
    "RunPicture",
    "RunRecord",
    "RunState",
    "StepRecord",
    "StepState",
    # Errors
    "CallRefusedError",
    "CompensationBuildError",
    "CompensationNotBuiltError",
    "ConfigurationError",
    "DatabaseSchemaError",
    "DispatchError",
    "EscalationResolvedError",
    "FaultInjectionDisabledError",
    "InjectedFaultError",
    "InvalidArgumentsError",
    "InvalidCorrectionError",
    "InvalidRunIdError",
    "InvalidRunOptionError",
    "InvalidTextError",
    "MessageNotSentError",
    "NonRetryableToolError",
    "NothingToRequeueError",
    "OperationRefusedError",
    "PayloadError",
    "RunContendedError",
    "RunEndedError",
    "RunExistsError",
    "SagaError",
    "StepFailedError",
    "StepInDoubtError",
    "StepRejectedError",
    "StepSkippedError",
    "StepsInFlightError",
    "StoreUnavailableError",
    "ToolDefinitionError",
    "ToolNotOfferedError",
    "ToolResultError",
    "UnknownEscalationError",
    "UnknownRunError",
    "UnknownToolError",
    "WaitTimeoutError",
]
