"""Placing a turn's calls: each call of the model's answer is refused, left to a person, or
dispatched as a step, in the model's order.

Its own module because what a turn asks for and what the run is allowed to do are two
judgements: the turn (``saga.agents.hosted``) decides when to ask and when the loop ends; this
decides, call by call, what becomes of the answer, and tells the turn who will see them all
placed, so that exactly someone sends the next turn.
"""

from __future__ import annotations

import enum
import logging

from saga import rules
from saga.agents import approvals
from saga.agents.agent import Agent
from saga.agents.messages import ModelTurn, ToolCall
from saga.agents.turn_state import LoopState, TurnStore
from saga.constants import call_marker
from saga.core import Core
from saga.errors import (
    CallRefusedError,
    DispatchError,
    InvalidArgumentsError,
    PayloadError,
    RunEndedError,
    UnknownToolError,
)
from saga.model import OnFailure, ToolClass
from saga.picture import RunPicture

logger = logging.getLogger("saga.agents")


class Placed(enum.Enum):
    """Who will see a turn's calls all placed: what ``dispatch_calls`` found."""

    #: The run stopped taking calls (it is failing: the unwind needs no more turns).
    STOPPED = "stopped"
    #: The last call got a new step here. Every earlier call was placed (or refused) before
    #: that step was reserved, so its settling, or a later one, finds the turn complete.
    BY_LAST_STEP = "by_last_step"
    #: Anything else (the last call refused, waiting, not taken by the broker, or placed by
    #: an earlier delivery whose steps may all have settled already): the turn checks itself.
    BY_OTHERS = "by_others"


def dispatch_calls(
    core: Core,
    turns: TurnStore,
    agent: Agent,
    picture: RunPicture,
    state: LoopState,
    turn: int,
    answer: ModelTurn,
) -> Placed:
    """Dispatch (or refuse) each call in the model's order."""
    run_id = picture.run_id
    had_steps = {s.call for s in picture.steps if s.call}
    placed = Placed.BY_OTHERS
    for i, call in enumerate(answer.calls):
        placed = Placed.BY_OTHERS
        if (turn, i) in state.refused:
            continue
        refusal = _refusal(agent, call, i, answer)
        if refusal:
            turns.record_refusal(run_id, turn, i, refusal)
            continue
        tool = agent.tool(call.name)
        assert tool is not None
        if tool.name in agent.approval:
            verdict = approvals.judge(turns, run_id, state, turn, i, call)
            if verdict is None:
                continue  # waits for a person; deciding sends this turn again
            if verdict:
                turns.record_refusal(run_id, turn, i, verdict)
                continue
        marker = call_marker(turn, i)
        try:
            core.dispatch(
                run_id,
                call.name,
                call.arguments,
                marker=marker,
                feed_back_failure=agent.failure_mode(tool) is OnFailure.FEED_BACK,
            )
        except (CallRefusedError, InvalidArgumentsError, UnknownToolError, PayloadError) as exc:
            turns.record_refusal(run_id, turn, i, str(exc))
        except RunEndedError:
            return Placed.STOPPED
        except DispatchError:  # released: its step says "not dispatched", and the model is told
            logger.warning("run %s turn %d: call %d not taken by the broker", run_id, turn, i)
        else:
            if marker not in had_steps:
                placed = Placed.BY_LAST_STEP
        if core.faults is not None:
            core.faults.strike("between_dispatches", call.name)
    return placed


def _class_of(agent: Agent, call: ToolCall) -> ToolClass | None:
    tool = agent.tool(call.name)
    return None if tool is None or call.error else tool.tool_class


def _refusal(agent: Agent, call: ToolCall, i: int, answer: ModelTurn) -> str:
    """Why call ``i`` is not dispatched at all ('' if it is): the model can act on each."""
    if call.error:
        return call.error
    klass = _class_of(agent, call)
    if klass is None:
        return f"unknown tool {call.name!r}; you may call: {', '.join(agent.tool_names)}"
    others = [(c.name, _class_of(agent, c)) for j, c in enumerate(answer.calls) if j != i]
    return rules.beside_writes(call.name, klass, [(n, k) for n, k in others if k is not None])
