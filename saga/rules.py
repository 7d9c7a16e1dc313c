"""The saga's rules, as plain functions: which calls the dispatcher takes, in which order the
stack unwinds, and how a failing run ends.

No broker, no Redis: these are the rules the seed states, testable on their own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from saga.errors import CallRefusedError, RunEndedError, SagaError, ToolDefinitionError
from saga.model import CompensationState, OnFailure, RunState, StepState, ToolClass
from saga.picture import RunPicture, RunView

# Types only: the records and the CLI's read-only commands load the rules, and must not load
# the tool declarations (pydantic) with them.
if TYPE_CHECKING:
    from saga.tools import Tool

REASON_AFTER_PIVOT = "failed after an irreversible step"
REASON_COMPENSATION_FAILED = "compensation failed"
#: Every undo not done was kept on purpose by a person asked about it (``reversal="ask"``):
#: the run ends escalated, and resolved by that decision, so the books list the effect.
REASON_KEPT = "kept on purpose: a person decided not to reverse it"
#: A step's compensation function raised: its effect is live, and there is no undo to requeue.
REASON_COMPENSATION_NOT_BUILT = "a compensation could not be built"
#: The run's keys in Redis are older than its SQL record (the store went back in time).
REASON_STORE_BEHIND = (
    "its Redis state is older than its SQL record (the store went back in time): "
    "nothing was undone or concluded again; a person decides"
)

_BEFORE_PIVOT = frozenset(
    {ToolClass.CONVERGENT_WRITE, ToolClass.REVERSIBLE_WRITE, ToolClass.COMPENSATABLE_WRITE}
)


@dataclass(frozen=True)
class CallGate:
    """What must hold, at the moment a call is reserved, for it to be dispatched.

    The rules below decide the gate; Redis checks it atomically in the reserve script, and
    ``check_call`` checks it in Python to say exactly why a call was refused.
    """

    #: No step of these classes may be in flight.
    unsettled_classes: frozenset[ToolClass]
    #: The run must not be past its pivot (nor have its pivot step in flight).
    before_pivot: bool


def gate_for(tool_class: ToolClass) -> CallGate:
    """A class 5 call waits until every write before it has settled: if one of them failed
    after the mail went out, there would be nothing left to unwind with. A class 3/4 call
    belongs before the point of no return (unless the run allows otherwise)."""
    return CallGate(
        unsettled_classes=(
            _BEFORE_PIVOT if tool_class is ToolClass.IRREVERSIBLE_WRITE else frozenset()
        ),
        before_pivot=tool_class.needs_compensation,
    )


def check_call(view: RunView, tool: str, tool_class: ToolClass) -> None:
    """Refuse a call the pivot rules forbid; return quietly if it may be dispatched."""
    if view.state is not RunState.RUNNING:
        raise RunEndedError(view.run_id, view.state.value)
    gate = gate_for(tool_class)
    unsettled = sorted(s for s, c in view.in_flight.items() if c in gate.unsettled_classes)
    if unsettled:
        listed = ", ".join(str(s) for s in unsettled)
        raise CallRefusedError(
            f"{tool} is irreversible (class 5) and is refused while step(s) {listed} "
            "have not settled; wait for them, then call it again",
            unsettled,
        )
    if gate.before_pivot and not view.allow_after_pivot:
        pivot_in_flight = sorted(
            s for s, c in view.in_flight.items() if c is ToolClass.IRREVERSIBLE_WRITE
        )
        if view.pivot_step is not None or pivot_in_flight:
            where = view.pivot_step or pivot_in_flight[0]
            raise CallRefusedError(
                f"{tool} is class {tool_class.value} and the run is past its pivot (step "
                f"{where}, irreversible): reversible work must come before the pivot",
                pivot_in_flight,
            )


def beside_writes(tool: str, tool_class: ToolClass, others: Iterable[tuple[str, ToolClass]]) -> str:
    """Why a class 5 call asked for in the same answer as class 2-4 calls is not run ('' if it
    may be). The dispatcher would take it if it came first, and the mail would go out before
    the writes it speaks of; the model can ask again once they have succeeded."""
    writes = [name for name, klass in others if klass in _BEFORE_PIVOT]
    if tool_class is not ToolClass.IRREVERSIBLE_WRITE or not writes:
        return ""
    return (
        f"{tool} is irreversible (class 5) and was asked for in the same answer as "
        f"{', '.join(writes)}; it is not run until those have settled: ask for it again "
        "in your next turn if they succeed"
    )


def unwind_order(stack: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Most recent first: undo in the reverse of the order things were done."""
    return sorted(stack, key=lambda entry: int(entry["step"]), reverse=True)


def conclusion(picture: RunPicture) -> tuple[RunState, str]:
    """How a failing run ends, once its unwind (if any) has run."""
    if picture.pivot_step is not None:
        return RunState.ESCALATED, picture.doubt or REASON_AFTER_PIVOT
    if any(c.entry.get("broken") for c in picture.compensations):
        return RunState.ESCALATED, REASON_COMPENSATION_NOT_BUILT
    undone = (CompensationState.DONE, CompensationState.KEPT)
    if any(c.state not in undone for c in picture.compensations):
        return RunState.ESCALATED, REASON_COMPENSATION_FAILED
    if any(c.state is CompensationState.KEPT for c in picture.compensations):
        return RunState.ESCALATED, REASON_KEPT
    if picture.stack:
        return RunState.ESCALATED, REASON_COMPENSATION_FAILED
    if picture.doubt:
        return RunState.ESCALATED, picture.doubt
    # A requeued run that compensates goes back to what set it failing ("step 4 failed"),
    # kept as its cause when it escalated: the verdict "compensation failed" no longer holds.
    return RunState.COMPENSATED, picture.cause


def once_undone(picture: RunPicture, step: int) -> RunPicture | None:
    """The run as recording the running undo of ``step`` done leaves it, from the reading
    just before that record: the undo done, its entry off the stack (the record's time and
    version are the script's, known once it ran). None where the reading cannot tell: the run
    not unwinding, the undo not running, or its entry not the one on the stack."""
    undo = next((c for c in picture.compensations if c.step == step), None)
    on_stack = [e for e in picture.stack if int(e["step"]) == step]
    if (
        picture.state is not RunState.UNWINDING
        or undo is None
        or undo.state is not CompensationState.RUNNING
        or on_stack != [undo.entry]
    ):
        return None
    return replace(
        picture,
        compensations=[
            replace(c, state=CompensationState.DONE) if c.step == step else c
            for c in picture.compensations
        ],
        stack=[e for e in picture.stack if int(e["step"]) != step],
    )


def not_undone(picture: RunPicture) -> list[dict[str, Any]]:
    """Effects still live in the world after the run ended, each with why."""
    undos = {c.step: c.state for c in picture.compensations}
    undone = {step for step, state in undos.items() if state is CompensationState.DONE}
    unbuilt = {c.step: c.entry for c in picture.compensations if c.entry.get("broken")}
    live = []
    for step in picture.steps:
        if step.state is StepState.IN_DOUBT:
            why = "in doubt: nothing could tell whether it happened"
            live.append({"step": step.step, "tool": step.tool, "result": None, "why": why})
            continue
        if step.state is not StepState.SUCCEEDED or not step.tool_class.is_write:
            continue
        if step.step in undone:
            continue
        if step.tool_class is ToolClass.IRREVERSIBLE_WRITE:
            why = "irreversible: cannot be undone"
        elif step.step in unbuilt:
            why = f"not undoable: {unbuilt[step.step].get('description', '')}"
        elif step.tool_class is ToolClass.CONVERGENT_WRITE:
            why = "convergent write: kept, it has no undo"
        elif picture.pivot_step is not None:
            why = "not unwound: the run was past its pivot"
        elif undos.get(step.step) is CompensationState.KEPT:
            why = f"kept on purpose: {kept_because(picture, step.step)}"
        elif undos.get(step.step) is CompensationState.FAILED:
            why = "its compensation failed"
        elif step.step in undos:
            why = "its compensation has not run yet (a requeue runs it)"
        else:
            why = "it has no compensation on record"
        live.append({"step": step.step, "tool": step.tool, "result": step.result, "why": why})
    return live


def kept_because(picture: RunPicture, step: int) -> str:
    """Who kept step ``step``'s effect and why (the last decision about its reversal)."""
    undo = next((c for c in picture.compensations if c.step == step), None)
    decided = undo.decisions[-1] if undo is not None and undo.decisions else {}
    return f"{decided.get('by') or 'a person'}: {decided.get('note') or 'no note'}"


def kept_resolution(picture: RunPicture) -> dict[str, str]:
    """The resolution of a run whose undos a person chose to keep: who decided, and each kept
    step's note."""
    kept = [c for c in picture.compensations if c.state is CompensationState.KEPT]
    deciders = sorted({str((c.decisions or [{}])[-1].get("by") or "") for c in kept} - {""})
    note = "; ".join(f"step {c.step} kept: {kept_because(picture, c.step)}" for c in kept)
    return {"by": ", ".join(deciders) or "a person", "note": note}


def failure_mode(tool: Tool, overrides: Mapping[str, OnFailure]) -> OnFailure:
    """A failed read changed nothing, so the caller (or its model) may as well try something
    else; a failed write unwinds, because what the run did so far was built on it. The same
    default for hosted runs, driven runs and the integrations; ``overrides`` win."""
    if tool.name in overrides:
        return overrides[tool.name]
    return OnFailure.FEED_BACK if tool.tool_class is ToolClass.READ else OnFailure.UNWIND


def check_on_failure(
    owner: str,
    on_failure: Mapping[str, OnFailure | str] | None,
    tools: Iterable[Tool],
    error: type[SagaError] = ToolDefinitionError,
) -> dict[str, OnFailure]:
    """``on_failure`` may only name ``tools`` (what ``owner`` may call), each with a known mode;
    a typo would otherwise silently leave the default in place. ``error``: what to raise."""
    if on_failure is not None and not isinstance(on_failure, Mapping):
        kind = type(on_failure).__name__
        raise error(f"on_failure of {owner} maps tool names to modes, it is no {kind}")
    names = {t.name for t in tools}
    overrides: dict[str, OnFailure] = {}
    for tool, mode in (on_failure or {}).items():
        if tool not in names:
            raise error(f"on_failure of {owner} names {tool!r}, which it may not call")
        try:
            overrides[tool] = OnFailure(mode)
        except ValueError:
            known = ", ".join(m.value for m in OnFailure)
            raise error(f"on_failure {mode!r}: use one of {known}") from None
    return overrides
