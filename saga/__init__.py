"""saga: make an AI agent's tool calls safe to fail.

Each tool call runs as a Celery task; each successful write pushes its undo onto a Redis-backed
stack; a failure unwinds the stack in reverse order, and past the pivot (the first irreversible
step) a person gets the whole picture instead.
"""

from saga.engine import Saga
from saga.errors import (
    CallRefusedError,
    CompensationBuildError,
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
    UnknownEscalationError,
    UnknownRunError,
    UnknownToolError,
    WaitTimeoutError,
)
from saga.hooks import SagaHooks
from saga.model import CompensationState, RunState, StepContext, StepState, ToolClass, Undo
from saga.picture import CompensationRecord, RunPicture, StepRecord
from saga.reaper import ReapReport
from saga.records import ActionRecord, EscalationRecord, RecordStore, RunRecord
from saga.retry import RetryPolicy
from saga.runs import Run, StepHandle
from saga.settings import Settings
from saga.tools import Tool, ToolRegistry

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
    "UnknownEscalationError",
    "UnknownRunError",
    "UnknownToolError",
    "WaitTimeoutError",
]
