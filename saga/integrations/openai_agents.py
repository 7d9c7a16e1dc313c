"""saga under the OpenAI Agents SDK: ``function_tools`` turns a run's tools into ``FunctionTool``s
whose ``on_invoke_tool`` makes each call a step of that run.

    run = saga.start_run()
    agent = Agent(name="refunds", instructions="...", tools=function_tools(run))
    result = await Runner.run(agent, prompt)
    run.finish()

What the model can fix comes back to it as the call's output, ``{"error": "..."}``, the way the
SDK's ``failure_error_function`` answers (bad arguments or JSON, a class 5 call asked for beside
writes or before they settled, a reversible call past the pivot, ``ToolRejected``, a failed
read). A failed write unwinds the run and stops the agent: the SDK raises its ``UserError``,
whose ``__cause__`` is the saga's ``StepFailedError``. Class 5 tools named in ``approval`` get
``needs_approval``: the run stops with ``interruptions`` until a person approves or rejects.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

try:
    from agents import FunctionTool
    from agents.tool_context import ToolContext
except ImportError as exc:  # pragma: no cover - exercised with the framework hidden
    raise ImportError(
        "saga.integrations.openai_agents needs the OpenAI Agents SDK: "
        "pip install 'saga-compensation[openai-agents]'"
    ) from exc

from saga.agents.messages import ToolResult
from saga.agents.schema import check_strict, describe, json_schema
from saga.agents.wire import parse_arguments
from saga.integrations._bridge import Refusal, ToolBridge
from saga.model import OnFailure, ToolClass
from saga.runs import Run
from saga.tools import Tool


def function_tools(
    run: Run,
    *,
    tools: Iterable[str] | None = None,
    approval: Iterable[str] = (),
    on_failure: Mapping[str, OnFailure | str] | None = None,
    timeout: float | None = None,
    strict: bool = False,
) -> list[FunctionTool]:
    """The tools of ``run``'s saga as function tools, for an ``Agent`` of that run.

    ``tools``: the names the agent may call (default: every tool the registry offers agents).
    ``approval``: class 5 tools that wait for a person (``needs_approval``). ``on_failure``:
    per tool, ``"feed_back"`` or ``"unwind"`` (default: a failed read is fed back, a failed
    write unwinds). ``timeout``: seconds one call waits for its step (default
    ``SAGA_WAIT_TIMEOUT``). ``strict`` asks OpenAI to hold the model to each schema, which
    needs every parameter required (``ToolDefinitionError`` otherwise).
    """
    bridge = ToolBridge(
        run,
        owner=f"the function tools of run {run.run_id}",
        tools=tools,
        approval=approval,
        on_failure=on_failure,
        timeout=timeout,
    )
    running = _Running()
    return [_function_tool(bridge, running, tool, strict) for tool in bridge.tools]


class _Running:
    """The calls of these tools that have started and not finished, by call id.

    The SDK starts the calls of one answer together, in the model's order, each running up to
    its first wait before the next starts; so once a call has let the loop go round once, every
    call of its answer is listed here, and nothing of the next answer can be (the SDK asks the
    model again only once all have finished).
    """

    def __init__(self) -> None:
        self.calls: dict[str, str] = {}

    @contextmanager
    def call(self, call_id: str, name: str) -> Iterator[None]:
        self.calls[call_id] = name
        try:
            yield
        finally:
            self.calls.pop(call_id, None)

    def besides(self, call_id: str) -> list[str]:
        return [name for other, name in self.calls.items() if other != call_id]


def _function_tool(bridge: ToolBridge, running: _Running, tool: Tool, strict: bool) -> FunctionTool:
    schema = json_schema(tool)
    if strict:
        check_strict(tool, schema)

    async def invoke(ctx: ToolContext[Any], arguments: str) -> str:
        call_id = ctx.tool_call_id
        with running.call(call_id, tool.name):
            if tool.tool_class is ToolClass.IRREVERSIBLE_WRITE:
                await asyncio.sleep(0)  # let the answer's later calls start (see _Running)
                refusal = bridge.beside_writes(tool.name, running.besides(call_id))
                if refusal is not None:
                    return ToolResult.failure(call_id, refusal.message).text()
            args, problem = parse_arguments(arguments)
            if problem is not None:
                return ToolResult.failure(call_id, problem).text()
            # The wait blocks on Redis, so it runs in a thread; a cancelled agent leaves the
            # thread to finish its wait (the step itself runs on a worker either way).
            outcome = await asyncio.to_thread(bridge.call, tool.name, args)
        if isinstance(outcome, Refusal):
            return ToolResult.failure(call_id, outcome.message).text()
        return ToolResult(call_id, outcome).text()

    return FunctionTool(
        name=tool.name,
        description=describe(tool),
        params_json_schema=schema,
        on_invoke_tool=invoke,
        strict_json_schema=strict,
        needs_approval=tool.name in bridge.approval,
    )
