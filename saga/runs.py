"""What the agent holds: a ``Run`` to call tools on, and a ``StepHandle`` per call.

Waiting reads the saga's own record of the step in Redis, not Celery's result backend: the
record is what the core acts on, so it is also what the agent should see.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from saga import payload
from saga.constants import ended_key, settled_key
from saga.core import Core
from saga.effects import PROBLEMS, UNDO_PROBLEM
from saga.errors import (
    CompensationNotBuiltError,
    InvalidRunOptionError,
    StepFailedError,
    StepInDoubtError,
    StepRejectedError,
    StepsInFlightError,
    StepSkippedError,
    ToolResultError,
    UnknownRunError,
    WaitTimeoutError,
)
from saga.model import OnFailure, RunState, StepState
from saga.picture import RunPicture
from saga.rules import check_on_failure, failure_mode
from saga.validation import check_text


class StepHandle:
    """One dispatched call. ``result()`` waits for it to settle."""

    def __init__(self, core: Core, run_id: str, step: int, tool: str) -> None:
        self.core = core
        self.run_id = run_id
        self.step = step
        self.tool = tool
        #: Once the step is known settled, reads need not wait for the signal any more.
        self._settled = False

    def __repr__(self) -> str:
        return f"<StepHandle run={self.run_id} step={self.step} tool={self.tool}>"

    @property
    def idempotency_key(self) -> str:
        return f"{self.run_id}:{self.step}"

    def state(self) -> StepState:
        raw = self.core.store.step_outcome(self.run_id, self.step)[0]
        if raw is None:
            raise UnknownRunError(f"no step {self.step} in run {self.run_id}")
        return StepState(raw)

    def result(self, timeout: float | None = None) -> Any:
        """The tool's result once the step succeeded; ``StepFailedError`` if it failed for good:
        ``StepRejectedError`` when it was fed back (the run goes on; hand ``error`` to the
        model), ``ToolResultError`` when the effect happened but its result could not be
        recorded, ``CompensationNotBuiltError`` when it happened with no undo (the run
        escalates). ``run_goes_on`` says, for each, whether the run takes more calls."""
        deadline = time.monotonic() + (timeout or self.core.settings.wait_timeout)
        while True:
            store = self.core.store
            if self._settled:
                state, result, error = store.step_outcome(self.run_id, self.step)
            else:
                # Woken by the script that settles the step (the signal waits in a list if
                # it came first); re-read at least once a second in case another waiter
                # took the signal.
                remaining = max(0.0, deadline - time.monotonic())
                state, result, error = store.wait_outcome(
                    self.run_id, self.step, min(remaining, 1.0)
                )
            self._settled = state not in (StepState.DISPATCHED, StepState.RUNNING)
            if state == StepState.SUCCEEDED:
                _raise_if_unrecorded(self, payload.loads(error))
                return payload.loads(result)
            if state == StepState.FAILED:
                message = (payload.loads(error) or {}).get("message", "failed")
                raise StepFailedError(self.run_id, self.step, self.tool, message)
            if state == StepState.REJECTED:
                message = (payload.loads(error) or {}).get("message", "rejected")
                raise StepRejectedError(self.run_id, self.step, self.tool, message)
            if state in (StepState.SKIPPED, StepState.NOT_DISPATCHED):
                raise StepSkippedError(f"step {self.step} ({self.tool}) never ran: {state}")
            if state is None:
                raise UnknownRunError(f"no step {self.step} in run {self.run_id}")
            if state == StepState.IN_DOUBT:
                if self.core.store.in_flight(self.run_id, self.step):
                    self._settled = False  # being reconciled: the verdict wakes us
                else:
                    message = f"step {self.step} ({self.tool}) is in doubt: {error}"
                    raise StepInDoubtError(message)
            if time.monotonic() >= deadline:
                raise WaitTimeoutError(f"step {self.step} ({self.tool}) still {state!s}")


def _raise_if_unrecorded(handle: StepHandle, error: Any) -> None:
    """A step that succeeded with a problem (``saga.effects``): its effect happened, but the
    caller must not take the placeholder result for the tool's answer. (A succeeded step's
    error may also be an earlier attempt's, retried: only these two types say so.)"""
    kind = error.get("type") if isinstance(error, dict) else None
    if kind not in PROBLEMS:
        return
    message = str(error.get("message", ""))
    if kind == UNDO_PROBLEM:
        raise CompensationNotBuiltError(handle.run_id, handle.step, handle.tool, message)
    goes_on = bool(error.get("run_goes_on"))
    raise ToolResultError(handle.run_id, handle.step, handle.tool, message, run_goes_on=goes_on)


class Run:
    """One agent run: the tools it calls are the saga's steps, in the order it calls them.

    ``on_failure``: per tool, what its final failure does, as for a hosted agent (default: a
    failed read is fed back, ``StepRejectedError`` from ``result()`` with the run still open;
    a failed write unwinds, ``StepFailedError``). It is this object's choice, not the run's:
    a process that attaches to the run (``Saga.run``) passes its own.
    """

    def __init__(
        self,
        core: Core,
        run_id: str,
        on_failure: Mapping[str, OnFailure | str] | None = None,
    ) -> None:
        self.core = core
        self.run_id = run_id
        self.on_failure: dict[str, OnFailure] = {}
        if on_failure is not None:  # checked against the tools a run may call (no compensation)
            offered = (t for t in core.registry if t.offered and t.tool_class is not None)
            self.on_failure = check_on_failure(
                f"run {run_id}", on_failure, offered, error=InvalidRunOptionError
            )

    def __repr__(self) -> str:
        return f"<Run {self.run_id}>"

    def call(self, tool: str, /, **args: Any) -> StepHandle:
        """Dispatch ``tool`` with ``args``; refused (nothing sent, nothing changed) if the
        tool is unknown, the arguments are invalid, or the pivot rules forbid it now.

        Whether its final failure is fed back or unwinds the run is decided here, when the
        step is reserved (``on_failure``), so the worker that fails it knows."""
        feed_back = failure_mode(self.core.registry.offered(tool), self.on_failure)
        return self.dispatch(tool, args, feed_back_failure=feed_back is OnFailure.FEED_BACK)

    def dispatch(self, tool: str, args: dict[str, Any], *, feed_back_failure: bool) -> StepHandle:
        """``call`` with its failure mode chosen by the caller (an integration has its own)."""
        step = self.core.dispatch(self.run_id, tool, args, feed_back_failure=feed_back_failure)
        return StepHandle(self.core, self.run_id, step, tool)

    def state(self) -> RunState:
        return self.picture().state

    def picture(self) -> RunPicture:
        return self.core.picture(self.run_id)

    def finish(self, timeout: float | None = None) -> RunPicture:
        """Complete the run once every step has settled (waiting up to ``timeout``)."""
        store = self.core.store
        deadline = time.monotonic() + (timeout or self.core.settings.wait_timeout)
        while True:
            try:
                return self.core.complete(self.run_id)
            except StepsInFlightError as exc:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise
                # Woken by the first of them to settle (the signal is put back for whoever
                # waits on that step's result); at least once a second, look again.
                keys = [settled_key(self.run_id, step) for step in exc.steps]
                store.wait_signal(keys, min(remaining, 1.0), keep=True)

    def abort(self, reason: str) -> None:
        """Unwind on the agent's request (or escalate, if the run is past its pivot)."""
        self.core.abort(self.run_id, check_text("reason", reason, max_length=2000))

    def wait(self, timeout: float | None = None) -> RunPicture:
        """Wait until the run has ended (completed, compensated or escalated) and its SQL
        records are written. If only the records are late (their database is away) when the
        time is up, the ended picture is returned: the end itself is final."""
        deadline = time.monotonic() + (timeout or self.core.settings.wait_timeout)
        store = self.core.store
        while True:
            # The run's head says whether it is over (one read); the whole run is read once.
            head = store.head(self.run_id)
            if head is None:
                raise UnknownRunError(f"no run {self.run_id}")
            remaining = deadline - time.monotonic()
            if head.state.ended and (head.recorded or remaining <= 0):
                picture = self.picture()
                if picture.state.ended:
                    return picture
                continue  # reopened in between (an effect landed late): wait again
            if remaining <= 0:
                raise WaitTimeoutError(f"run {self.run_id} still {head.state.value}")
            # Woken when its record is written (mark_recorded); at least once a second, look
            # again (another waiter may have taken the signal).
            self.core.store.wait_signal([ended_key(self.run_id)], min(remaining, 1.0))
