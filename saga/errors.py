"""Every error saga raises, under one root.

Whether a failure is worth retrying is an attribute (``retryable``), not a branch of the tree:
the worker asks the error, never its type.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class SagaError(Exception):
    """Root of every error saga raises."""

    retryable: bool = False


class ToolDefinitionError(SagaError):
    """A tool was declared with a class, option or compensation that breaks the rules."""


class UnknownToolError(SagaError):
    """The agent asked for a tool that is not registered (or one not offered to it: below)."""


class ToolNotOfferedError(UnknownToolError):
    """The tool is registered but not offered to agents (a compensation, or ``offered=False``)."""


class InvalidArgumentsError(SagaError):
    """A call's arguments do not match the tool's schema; nothing was dispatched."""


class PayloadError(SagaError):
    """A value is not JSON, or is larger than the configured limit."""


class UnknownRunError(SagaError):
    """No run with this id exists (never started, or expired after its retention)."""


class RunExistsError(SagaError):
    """``start_run`` was given the id of a run that already exists; nothing was changed."""


class InvalidRunIdError(SagaError):
    """A run id is not 1-128 characters of ``[A-Za-z0-9._-]`` starting with a letter or digit."""


class InvalidEscalationIdError(InvalidRunIdError):
    """An escalation id is not ``<run_id>:<generation>`` nor the reaper's ``<run_id>:reaper``."""


class InvalidRunOptionError(SagaError):
    """An option of ``start_run`` (``deadline``, ``allow_reversible_after_pivot``) is invalid."""


class RunEndedError(SagaError):
    """The run is unwinding or has ended, so it takes no more calls (``state`` says which)."""

    def __init__(self, run_id: str, state: str) -> None:
        if state == "unwinding":
            message = f"run {run_id} is unwinding (it ends once its undos have run)"
        else:
            message = f"run {run_id} has ended ({state})"
        super().__init__(f"{message}: it takes no more calls")
        self.run_id = run_id
        self.state = state

    @property
    def ended(self) -> bool:
        """False while the run is still unwinding."""
        return self.state != "unwinding"


class CallRefusedError(SagaError):
    """The dispatcher refused a call because of the pivot rules; nothing was dispatched."""

    def __init__(self, message: str, unsettled_steps: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.unsettled_steps = tuple(unsettled_steps)


class StepsInFlightError(SagaError):
    """The run cannot end yet: some steps have not settled."""

    def __init__(self, run_id: str, steps: Sequence[int]) -> None:
        listed = ", ".join(str(s) for s in steps)
        super().__init__(f"run {run_id} still has steps in flight: {listed}")
        self.steps = tuple(steps)


class StepFailedError(SagaError):
    """A step failed for good (after its retries); the run unwinds or escalates."""

    #: Whether the run still takes calls: the caller may hand ``error`` to its model.
    run_goes_on: bool = False
    #: What the message says became of the step (its effect may have happened: below).
    _outcome = "failed:"

    def __init__(self, run_id: str, step: int, tool: str, error: str) -> None:
        super().__init__(f"step {step} ({tool}) of run {run_id} {self._outcome} {error}")
        self.run_id = run_id
        self.step = step
        self.tool = tool
        self.error = error


class StepRejectedError(StepFailedError):
    """The tool refused the call, or failed where the caller is told instead; the run goes on."""

    run_goes_on = True


class ToolResultError(StepFailedError):
    """The tool ran (its effect happened, its undo is pushed) but its result is not JSON or is
    over the size limit; ``run_goes_on`` when its failures are fed back, else the run unwinds."""

    _outcome = "ran, but"

    def __init__(
        self, run_id: str, step: int, tool: str, error: str, *, run_goes_on: bool = False
    ) -> None:
        super().__init__(run_id, step, tool, error)
        self.run_goes_on = run_goes_on


class CompensationNotBuiltError(StepFailedError):
    """The step's effect happened but its compensation could not be built: it stays live with
    no undo, so the run escalates once what can be undone is."""

    _outcome = "ran, but"


class ToolRejected(SagaError):
    """A tool raises this for a business refusal: nothing happened, and the model is told why."""


class StepSkippedError(SagaError):
    """The step never ran: the run started unwinding before it was picked up."""


class CompensationBuildError(SagaError):
    """A tool's compensation function failed or returned something unusable."""


class DispatchError(SagaError):
    """The broker did not take the task; the step was released and nothing ran."""

    retryable = True


class MessageNotSentError(SagaError):
    """What the call asked for is applied, but the broker did not take the message that acts
    on it; the same call again sends it (the reaper does at the run's deadline)."""

    retryable = True

    def __init__(self, run_id: str, applied: str, pending: str, again: str) -> None:
        # The broker's own error (its address among it) goes to the log, never in here: this
        # message is what an API client reads.
        super().__init__(
            f"run {run_id}: {applied}, but the broker did not take its {pending}: {again} "
            "sends it (the reaper does at the run's deadline)"
        )
        #: The run this applies to: a caller that retries names it (``run_id=...``).
        self.run_id = run_id
        #: What is recorded and stands: ``created``, ``approved``, ``aborted``, ...
        self.applied = applied
        #: The message still to send: ``turn 1``, ``unwind``.
        self.pending = pending
        self.again = again

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.run_id, self.applied, self.pending, self.again))


class RunContendedError(SagaError):
    """The run kept changing under a dispatch (other calls settling at once); call it again."""


class InvalidTextError(SagaError):
    """A name, note or reason a person or an app gave is too long, empty or not plain text;
    nothing was changed (the message names the field)."""


class StaleRecordError(SagaError):
    """A run's record was not written: a later version of the run is recorded already."""


class StoreUnavailableError(SagaError):
    """The Redis holding the compensation stack did not answer."""

    retryable = True


class WaitTimeoutError(SagaError):
    """A bounded wait for a step or a run ran out of time."""


class NonRetryableToolError(SagaError):
    """A tool raises this to fail its step at once, without using its retries."""


class ConfigurationError(SagaError):
    """The worker's configuration would break the saga's guarantees; it refuses to start."""


class MissingExtraError(SagaError):
    """An optional dependency is not installed; the message names the extra that brings it."""

    def __init__(self, message: str, *, extra: str = "", module: str = "") -> None:
        super().__init__(message)
        self.extra = extra
        self.module = module


class InjectedFaultError(SagaError):
    """A failure injected by ``saga.testing.Faults``; only ever raised in tests."""

    retryable = True


class FaultInjectionDisabledError(SagaError):
    """Fault injection was asked for without being explicitly enabled (SAGA_TESTING_FAULTS=1)."""


class OperationRefusedError(SagaError):
    """An operator's requeue or resolve was refused and changed nothing (the message says why)."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable

    def __reduce__(self) -> tuple[Any, ...]:
        return (_refused, (type(self), str(self), self.retryable))


def _refused(cls: type[OperationRefusedError], message: str, retryable: bool) -> SagaError:
    return cls(message, retryable=retryable)


class NothingToRequeueError(OperationRefusedError):
    """``requeue_failed_compensations`` found no failed compensation to run again."""


class InvalidCorrectionError(OperationRefusedError):
    """A requeue's correction names no failed undo, or its compensation tool refuses it."""


class UnknownEscalationError(OperationRefusedError):
    """No escalation with this id is recorded."""


class EscalationResolvedError(OperationRefusedError):
    """The escalation is closed (resolved by a person, superseded or compensated already)."""


class DatabaseSchemaError(SagaError):
    """The records database's schema is behind this version of saga (run ``saga db upgrade``)."""


class StepInDoubtError(SagaError):
    """Nobody knows whether the step's effect happened; it is reconciled before any unwind."""


class ModelCallError(SagaError):
    """The model could not be asked or did not answer; ``retryable`` says if trying again helps."""

    def __init__(
        self,
        message: str,
        *,
        retryable: bool = False,
        retry_after: float | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        #: Seconds the provider asked us to wait (``Retry-After``), when it said.
        self.retry_after = retry_after
        #: The HTTP status of the failed request; ``None`` when no response came back.
        self.status = status

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only attributes would be lost on a copy or a pickle round trip otherwise.
        attributes = {"retryable": self.retryable, "retry_after": self.retry_after}
        return (_model_call_error, (str(self), attributes, self.status))


def _model_call_error(message: str, attributes: dict[str, Any], status: int | None) -> SagaError:
    return ModelCallError(message, status=status, **attributes)


class UnknownAgentError(SagaError):
    """No agent of this name is declared on this app (a typo, or a worker on an old deploy)."""


class ApprovalError(SagaError):
    """A decision on a call awaiting approval was refused: unknown, decided, stale or expired."""


class ConversationError(SagaError):
    """Tool results do not answer the model's pending calls, so no model would accept the turn."""


class NotificationError(SagaError):
    """A notification sink did not take an escalation's notice (retried, then recorded)."""

    retryable = True


class SignatureError(SagaError):
    """A webhook's ``Saga-Signature`` is missing, malformed, too old or does not match."""


class InvalidCursorError(SagaError):
    """A listing's cursor is not one a listing gave (it names a creation time and a run id)."""


class TokenError(SagaError):
    """An API token's name or scope is invalid, or no token of that name exists to revoke."""


class NoAppError(ConfigurationError):
    """The server has no application ``Saga`` (``SAGA_APP``), which requeue and resolve need."""
