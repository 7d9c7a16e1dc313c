"""Calls a person must approve: asked once, decided once, expiring with the run's deadline.

A request, a decision and an expiry are each one script on the Redis clock
(``request_approval.lua``, ``decide_approval.lua``, ``expire_approval.lua``), and the last two
exclude each other: a person's "ok" either lands before the expiry and stands, or is refused
as expired; it is never taken and then ignored. Expiry is judged by the turn when it runs, and
by the reaper when the run has waited a whole deadline (the request is progress, so that is
exactly when it expires): an unanswered approval is fed back to the model without spending
one of the run's revivals.
"""

from __future__ import annotations

import json
from typing import Any

from saga.agents.messages import ToolCall
from saga.agents.turn_state import LoopState, TurnStore, args_hash
from saga.constants import call_marker
from saga.stack import RunStore


def expired_message(tool: str) -> str:
    return f"nobody approved {tool} in time; the request expired"


def verdict_of(decision: dict[str, Any], call: ToolCall) -> str:
    """'' for an approval of exactly this call; else what the model is told."""
    if decision["verdict"] == "approved" and decision["args_hash"] == args_hash(call):
        return ""
    why = decision.get("reason") or "no reason given"
    return f"a person ({decision.get('by') or 'unknown'}) declined {call.name}: {why}"


def judge(
    turns: TurnStore, run_id: str, state: LoopState, turn: int, i: int, call: ToolCall
) -> str | None:
    """For call ``i`` of ``turn``, which needs a person: '' once approved (dispatch it), the
    refusal the model is told (denied, expired), or None while it waits (asked now if it was
    not asked yet)."""
    decision = state.decisions.get((turn, i))
    if decision is not None:
        return verdict_of(decision, call)
    if (turn, i) not in state.approvals:
        turns.request_approval(run_id, turn, i, call)
        return None
    outcome = turns.store.expire_approval(run_id, call_marker(turn, i), expired_message(call.name))
    if outcome.status == "decided":
        return verdict_of(json.loads(str(outcome.values[0])), call)
    if outcome.status == "expired":
        return expired_message(call.name)
    return None  # waiting (or, unknown, a request that cannot be: asked above)


def expire_waiting(store: RunStore, run_id: str, state: LoopState) -> tuple[int, int]:
    """The reaper's look at a run idle on its current turn's approvals: expire those due.
    Returns (expired now or before, still waiting); decided ones count as neither."""
    turn = state.current_turn
    answer = state.answers.get(turn)
    expired = waiting = 0
    for where, request in sorted(state.approvals.items()):
        if where[0] != turn or where in state.decisions or answer is None:
            continue
        tool = str(request.get("tool") or answer.calls[where[1]].name)
        outcome = store.expire_approval(run_id, call_marker(*where), expired_message(tool))
        if outcome.status == "expired":
            expired += 1
        elif outcome.status == "waiting":
            waiting += 1
    return expired, waiting
