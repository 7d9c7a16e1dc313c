"""The drill's judgment of one case: each write step as saga reports it and as its system has
it (the tool's ``verify``, else its ``lookup``), and every way the two disagree."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from saga.constants import compensation_idempotency_key, step_idempotency_key
from saga.model import CompensationState, RunState, StepState
from saga.testing.drill_plan import Fault

if TYPE_CHECKING:
    from saga.engine import Saga
    from saga.picture import RunPicture


@dataclass(frozen=True)
class StepOutcome:
    """One write step of a case: what saga reports and what the world says."""

    step: int
    tool: str
    #: saga's word: "undone", "live", "escalated" (live in an escalated run), "in_doubt",
    #: "none" (failed, skipped: no effect).
    saga: str
    #: The world's: how many times the effect is live (``verify``), whether it happened
    #: (``lookup``: 1 or 0), or None (the tool declares neither).
    world: int | None
    source: str
    #: How many times its undo was applied (the compensation's ``verify``), or None.
    undo_applied: int | None = None


@dataclass(frozen=True)
class Mismatch:
    fault: str
    tool: str
    step: int
    what: str

    def __str__(self) -> str:
        if not self.step and not self.tool:  # the case's own (a run that did not end, ...)
            return f"{self.fault}: {self.what}"
        return f"{self.fault}: step {self.step} ({self.tool}): {self.what}"


@dataclass
class CaseResult:
    fault: Fault
    run_id: str = ""
    end_state: str = ""
    reason: str = ""
    #: What the scenario raised (a failed step's error, as the agent saw it).
    raised: str = ""
    steps: list[StepOutcome] = field(default_factory=list)
    mismatches: list[Mismatch] = field(default_factory=list)
    seconds: float = 0.0
    #: How many times the fault's point was reached (None: the case installs no rule).
    hits: int | None = None
    #: The id of the message the drill delivered a second time ('' if none was).
    copy: str = ""

    def mismatch(self, what: str, *, step: int | None = None) -> None:
        """A mismatch of the case itself (not of one step's effect): at the fault's step."""
        at = self.fault.step if step is None else step
        self.mismatches.append(Mismatch(self.fault.name, self.fault.tool if at else "", at, what))


def judge(saga: Saga, picture: RunPicture, result: CaseResult) -> None:
    """Each write step of the run, as saga reports it and as its system has it."""
    escalated = picture.state is RunState.ESCALATED
    undos = {c.step: c for c in picture.compensations}
    positions = {s.step: i for i, s in enumerate(sorted(picture.steps, key=lambda s: s.step), 1)}
    for record in picture.steps:
        tool = saga.registry.get(record.tool)
        if not record.tool_class.is_write:
            continue
        undo = undos.get(record.step)
        if undo is not None and undo.state is CompensationState.DONE:
            said = "undone"
        elif record.state is StepState.SUCCEEDED:
            said = "escalated" if escalated else "live"
        elif record.state is StepState.IN_DOUBT:
            said = "in_doubt"
        else:
            said = "none"
        key = step_idempotency_key(picture.run_id, record.step)
        world, source = _world(tool.verify, tool.lookup, key, record.args)
        undo_applied = None
        if undo is not None:
            undo_tool = saga.registry.get(str(undo.entry.get("tool")))
            if undo_tool.verify is not None:
                undo_key = compensation_idempotency_key(picture.run_id, record.step)
                undo_applied = _count(undo_tool.verify(undo_key, undo.entry.get("args") or {}))
        outcome = StepOutcome(
            positions[record.step], record.tool, said, world, source, undo_applied
        )
        result.steps.append(outcome)
        for what in mismatches_of(outcome, picture.state, tool.compensation is not None):
            result.mismatches.append(Mismatch(result.fault.name, record.tool, outcome.step, what))


def _world(verify: Any, lookup: Any, key: str, args: dict[str, Any]) -> tuple[int | None, str]:
    try:
        if verify is not None:
            return _count(verify(key, args)), "verify"
        if lookup is not None:
            return (0 if lookup(key, args) is None else 1), "lookup"
    except Exception as exc:  # a system that cannot answer is reported, not guessed at
        return None, f"error: {type(exc).__name__}: {exc}"
    return None, ""


def _count(answer: bool | int) -> int:
    return int(answer)


def mismatches_of(step: StepOutcome, state: RunState, compensatable: bool) -> list[str]:
    """What the world says that saga does not (an empty list: they agree)."""
    found: list[str] = []
    n = step.world
    if n is not None and n >= 2:
        found.append(f"the effect was applied {n} times under one idempotency key")
    if step.undo_applied is not None and step.undo_applied >= 2:
        found.append(f"the undo was applied {step.undo_applied} times under one idempotency key")
    if n is None:
        return found
    if step.saga == "undone":
        if step.source == "verify" and n >= 1:  # a lookup finds an undone effect too
            found.append("saga reports it undone, but the effect is live")
    elif step.saga == "none":
        if n >= 1:
            found.append("the effect is live, and saga reports none: nobody will undo it")
    elif step.saga in ("live", "escalated"):
        if n == 0:
            found.append(f"saga reports it {step.saga}, but the system has no such effect")
        elif state is RunState.COMPENSATED and compensatable:
            found.append("a live effect in a run that ended compensated, not escalated")
    return found
