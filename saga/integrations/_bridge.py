"""What every integration shares: the tools a framework's agent is offered, and one call of a
tool through the run's dispatcher, its answer sorted three ways.

- a result: the step succeeded;
- a ``Refusal``: nothing happened and the model can act on why (an unknown tool, bad arguments,
  a class 5 call before the writes settled, a reversible call past the pivot, a tool's
  ``ToolRejected``, a failure the tool's mode feeds back, a result that could not be recorded
  where failures are fed back); the run goes on;
- an exception: a failed write is unwinding the run (``StepFailedError``), or the run ended,
  or the wait ran out (``WaitTimeoutError``). The agent must stop: the run takes no more calls.

No framework is imported here; each integration turns these into its framework's words.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from saga import rules
from saga.agents.agent import check_approval
from saga.agents.schema import offered_tools
from saga.errors import (
    CallRefusedError,
    InvalidArgumentsError,
    PayloadError,
    StepFailedError,
    ToolDefinitionError,
    UnknownToolError,
)
from saga.model import OnFailure, ToolClass
from saga.rules import check_on_failure, failure_mode
from saga.runs import Run
from saga.tools import Tool

#: The dispatcher's refusals: nothing was reserved, nothing was sent, and the model can fix each.
_REFUSED = (CallRefusedError, InvalidArgumentsError, UnknownToolError, PayloadError)


@dataclass(frozen=True)
class Refusal:
    """A call that was not run, or was rejected: what the model is told."""

    message: str


class ToolBridge:
    """The tools of ``run`` one framework agent may call, and the calls it makes.

    ``tools``: the names it may call (default: every tool its registry offers; compensations
    never). ``approval``: class 5 tools that wait for a person, in the framework's own way.
    ``on_failure``: per tool, ``"feed_back"`` or ``"unwind"`` (default: a failed read is fed
    back, a failed write unwinds, as in our own loop). ``timeout``: seconds one call may wait
    for its step (default ``SAGA_WAIT_TIMEOUT``).
    """

    def __init__(
        self,
        run: Run,
        *,
        owner: str,
        tools: Iterable[str] | None = None,
        approval: Iterable[str] = (),
        on_failure: Mapping[str, OnFailure | str] | None = None,
        timeout: float | None = None,
    ) -> None:
        self.run = run
        self.tools = offered_tools(run.core.registry, tools)
        if not self.tools:
            raise ToolDefinitionError(f"{owner} is offered no tools")
        self.approval = check_approval(owner, approval, self.tools)
        self._on_failure = check_on_failure(owner, on_failure, self.tools)
        if timeout is not None and not timeout > 0:
            raise ToolDefinitionError(f"the timeout of {owner} must be positive, not {timeout}")
        self.timeout = timeout or run.core.settings.wait_timeout
        self._by_name = {t.name: t for t in self.tools}

    def tool(self, name: str) -> Tool | None:
        return self._by_name.get(name)

    def class_of(self, name: str) -> ToolClass | None:
        tool = self._by_name.get(name)
        return None if tool is None else tool.tool_class

    def beside_writes(self, name: str, others: Iterable[str]) -> Refusal | None:
        """Refuse a class 5 call asked for in the same answer as writes to undo (our loop's
        rule): run first, it would be the pivot, and the writes beside it would be refused."""
        klass = self.class_of(name)
        classes = [(other, self.class_of(other)) for other in others]
        known = [(other, k) for other, k in classes if k is not None]
        message = "" if klass is None else rules.beside_writes(name, klass, known)
        return Refusal(message) if message else None

    def call(self, name: str, args: dict[str, Any]) -> Any:
        """Dispatch one call and wait for its step: its result, or a ``Refusal``. Blocks (on
        Redis): async code runs it in a thread."""
        tool = self.tool(name)
        if tool is None:
            known = ", ".join(self._by_name)
            return Refusal(f"unknown tool {name!r}; you may call: {known}")
        feed_back = failure_mode(tool, self._on_failure) is OnFailure.FEED_BACK
        try:
            handle = self.run.dispatch(name, args, feed_back_failure=feed_back)
        except _REFUSED as exc:
            return Refusal(str(exc))
        try:
            return handle.result(timeout=self.timeout)
        except StepFailedError as exc:
            if not exc.run_goes_on:  # unwinding or escalating: the agent must stop
                raise
            # Rejected, fed back, or a result that could not be recorded (its effect
            # happened; the undo is on the stack): the model is told and may go on.
            return Refusal(exc.error or f"{name} was rejected")
