"""Policies: whatever decides the agent's next move, given the conversation and its tools.

A policy is any callable ``(transcript, tools) -> ModelTurn``: a real model (``ChatModelPolicy``),
a fixed script for demos and tests (``ScriptedPolicy``), or a plain function. Policies hold no
state between turns; everything they need is in the transcript, so a hosted loop can rebuild
the policy in each Celery task and get the same answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeAlias

from saga.agents.messages import ModelTurn, ToolCall, ToolResult
from saga.agents.transcript import Transcript
from saga.errors import ModelCallError
from saga.tools import Tool


class Policy(Protocol):
    """Given the conversation so far and the tools on offer, the model's next turn."""

    def __call__(self, transcript: Transcript, tools: Sequence[Tool]) -> ModelTurn: ...


#: One step of a script: a final text; one ``(name, args)`` call or a list of them (or
#: ``ToolCall``s); a ready ``ModelTurn``; or a function of the previous turn's results that
#: returns one of those.
ScriptStep: TypeAlias = (
    str
    | ModelTurn
    | tuple[str, dict[str, Any]]
    | Sequence[tuple[str, dict[str, Any]] | ToolCall]
    | Callable[[tuple[ToolResult, ...]], Any]
)


class ScriptedPolicy:
    """A fixed list of turns, played in order: deterministic, offline, free.

    The step played is the number of model turns already in the transcript, so a script
    resumes correctly in whatever process the next turn runs. Asking past its end is a fatal
    ``ModelCallError``, like a model that cannot answer.
    """

    def __init__(self, steps: Sequence[ScriptStep]) -> None:
        self.steps = tuple(steps)

    def __call__(self, transcript: Transcript, tools: Sequence[Tool]) -> ModelTurn:
        index = len(transcript.turns)
        if index >= len(self.steps):
            raise ModelCallError(
                f"the script has {len(self.steps)} turn(s); turn {index + 1} was asked for"
            )
        step = self.steps[index]
        if callable(step):
            step = step(transcript.last_results)
        return _turn(step, index)


def take_turn(policy: Policy, transcript: Transcript, tools: Sequence[Tool]) -> ModelTurn:
    """Ask ``policy`` for its next turn, check it is one, and record it in ``transcript``."""
    turn = policy(transcript, tools)
    if not isinstance(turn, ModelTurn):
        raise TypeError(f"a policy must return a ModelTurn, not {type(turn).__name__}")
    transcript.add_turn(turn)
    return turn


def _turn(step: Any, index: int) -> ModelTurn:
    raw = {"script_step": index}
    if isinstance(step, ModelTurn):
        return step
    if isinstance(step, str):
        return ModelTurn(text=step, raw=raw, stop_reason="end_turn")
    if _is_call(step):
        step = [step]
    calls = tuple(_call(item, index, n) for n, item in enumerate(step))
    if not calls:
        raise TypeError(f"script step {index} holds no calls; use a string for a final answer")
    return ModelTurn(calls=calls, raw=raw, stop_reason="tool_use")


def _is_call(value: Any) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], str)
        and isinstance(value[1], dict)
    )


def _call(item: Any, index: int, n: int) -> ToolCall:
    if isinstance(item, ToolCall):
        return item
    if not _is_call(item):
        raise TypeError(f"script step {index}: a call is (name, args), not {item!r}")
    name, arguments = item
    # Ids unique across the run and the same on every replay of the script.
    return ToolCall(
        f"call_{index}_{n}", name, dict(arguments), {"name": name, "arguments": arguments}
    )
