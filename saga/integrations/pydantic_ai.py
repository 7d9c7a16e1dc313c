"""saga under Pydantic AI: ``SagaToolset`` offers a run's tools to a Pydantic AI agent, and each
call the agent makes is a step of that run.

    run = saga.start_run()
    result = agent.run_sync(prompt, toolsets=[SagaToolset(run)])
    run.finish()

What the model can fix comes back to it as ``ModelRetry`` (bad arguments, a class 5 call asked
for beside writes or before they settled, a reversible call past the pivot, ``ToolRejected``,
a failed read); each counts against the tool's ``max_retries``. A failed write unwinds the
run, and its ``StepFailedError`` is raised out of the agent run. Class 5 tools named in
``approval`` wait for a person with Pydantic AI's deferred tools (``ApprovalRequired``: the
run's output is then ``DeferredToolRequests``; resume it with ``DeferredToolResults``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

try:
    import anyio.to_thread
    from pydantic_ai import ModelRetry, RunContext
    from pydantic_ai.exceptions import ApprovalRequired
    from pydantic_ai.messages import ModelResponse, ToolCallPart
    from pydantic_ai.tools import ToolDefinition
    from pydantic_ai.toolsets import AbstractToolset, ToolsetTool
    from pydantic_core import SchemaValidator, core_schema
except ImportError as exc:  # pragma: no cover - exercised with the framework hidden
    raise ImportError(
        "saga.integrations.pydantic_ai needs Pydantic AI: "
        "pip install 'saga-compensation[pydantic-ai]'"
    ) from exc

from saga.agents.schema import describe, json_schema
from saga.integrations._bridge import Refusal, ToolBridge
from saga.model import OnFailure
from saga.runs import Run
from saga.tools import Tool

#: Any JSON object: the saga validates the arguments itself, strictly, and says what is wrong
#: in words a model acts on (the field, what it should be, what came).
_ANY_OBJECT = SchemaValidator(
    core_schema.dict_schema(
        keys_schema=core_schema.str_schema(), values_schema=core_schema.any_schema()
    )
)
#: Retries a tool gets for refusals in a row, as our own loop's ``max_consecutive_refusals``.
DEFAULT_MAX_RETRIES = 3


class SagaToolset(AbstractToolset[Any]):
    """The tools of ``run``'s saga as a Pydantic AI toolset.

    ``tools``: the names the agent may call (default: every tool the registry offers agents).
    ``approval``: class 5 tools that wait for a person. ``on_failure``: per tool,
    ``"feed_back"`` or ``"unwind"`` (default: a failed read is fed back, a failed write
    unwinds). ``timeout``: seconds one call waits for its step (default ``SAGA_WAIT_TIMEOUT``).
    ``max_retries``: refusals in a row a tool may get before Pydantic AI gives up the run.
    """

    def __init__(
        self,
        run: Run,
        *,
        tools: Iterable[str] | None = None,
        approval: Iterable[str] = (),
        on_failure: Mapping[str, OnFailure | str] | None = None,
        timeout: float | None = None,
        max_retries: int = DEFAULT_MAX_RETRIES,
        id: str | None = "saga",
    ) -> None:
        self.bridge = ToolBridge(
            run,
            owner=f"the toolset of run {run.run_id}",
            tools=tools,
            approval=approval,
            on_failure=on_failure,
            timeout=timeout,
        )
        self.max_retries = max_retries
        self._id = id
        self.definitions = {t.name: tool_definition(t) for t in self.bridge.tools}

    @property
    def id(self) -> str | None:
        return self._id

    async def get_tools(self, ctx: RunContext[Any]) -> dict[str, ToolsetTool[Any]]:
        return {
            name: ToolsetTool(
                toolset=self,
                tool_def=definition,
                max_retries=self.max_retries,
                args_validator=_ANY_OBJECT,
            )
            for name, definition in self.definitions.items()
        }

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        refusal = self.bridge.beside_writes(name, _same_answer(ctx))
        if refusal is not None:
            raise ModelRetry(refusal.message)
        if name in self.bridge.approval and not ctx.tool_call_approved:
            run_id = self.bridge.run.run_id
            raise ApprovalRequired({"run_id": run_id, "reason": "irreversible (class 5)"})
        # The wait blocks on Redis; a cancelled agent leaves the thread to finish its wait
        # (the step itself runs on a worker either way).
        outcome = await anyio.to_thread.run_sync(
            self.bridge.call, name, tool_args, abandon_on_cancel=True
        )
        if isinstance(outcome, Refusal):
            raise ModelRetry(outcome.message)
        return outcome


def tool_definition(tool: Tool) -> ToolDefinition:
    """A saga tool as Pydantic AI offers it: our schema, and our description with its class."""
    return ToolDefinition(
        name=tool.name,
        parameters_json_schema=json_schema(tool),
        description=describe(tool),
        metadata={"saga_tool_class": tool.tool_class},
    )


def _same_answer(ctx: RunContext[Any]) -> list[str]:
    """The other tool calls of the answer this call came in (none when a deferred call is
    resumed: its answer's other calls have settled by then)."""
    last = ctx.messages[-1] if ctx.messages else None
    if not isinstance(last, ModelResponse):
        return []
    return [
        part.tool_name
        for part in last.parts
        if isinstance(part, ToolCallPart) and part.tool_call_id != ctx.tool_call_id
    ]
