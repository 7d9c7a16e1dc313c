"""The drill's plan: which faults a scenario meets, one case each, from the steps of its clean
run; and ``max_cases`` of them sampled with a seed. Plain Python: no worker, no Redis."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from saga.model import ToolClass

if TYPE_CHECKING:
    from saga.engine import Saga

#: Every kind of fault, in the order the cases are planned.
KINDS = (
    "fail_before_effect",
    "fail_after_effect",
    "killed_mid_effect",
    "delivered_twice",
    "undo_fails_once",
    "undo_fails_after_effect",
    "undo_fails_always",
    "undo_killed_mid_effect",
    "undo_delivered_twice",
    "aborted_after",
    "aborted_mid_effect",
    "model_differs_on_replay",
)
#: What a kind means, for the reports.
MEANINGS = {
    "none": "the clean run",
    "fail_before_effect": "the step fails before its effect, every attempt",
    "fail_after_effect": "the step's effect happens, then it fails, every attempt",
    "killed_mid_effect": "the worker dies after the effect, before the outcome: redelivery",
    "delivered_twice": "the step's message is delivered again while its effect is under way",
    "undo_fails_once": "the undo fails once before its effect",
    "undo_fails_after_effect": "the undo's effect happens, then it fails once: retried",
    "undo_fails_always": "the undo fails every attempt",
    "undo_killed_mid_effect": "the worker dies after the undo's effect, before its outcome",
    "undo_delivered_twice": "the undo's message is delivered again while its effect is under way",
    "aborted_after": "the run is aborted after this step",
    "aborted_mid_effect": "the run is aborted while this step's effect is under way",
    "model_differs_on_replay": "the turn's delivery dies once the model answered, before the "
    "answer is recorded; asked again, the model answers differently",
}
#: The kinds that strike an undo (the run aborted after the last step before the pivot).
UNDO_KINDS = frozenset(k for k in KINDS if k.startswith("undo_"))
#: The kinds that strike a hosted run's model turn, not a step (``saga.testing.drill_turns``).
TURN_KINDS = frozenset({"model_differs_on_replay"})
#: The kinds where the drill itself sends a copy of a message the workers already have.
DUPLICATE_KINDS = frozenset({"delivered_twice", "undo_delivered_twice"})
#: Seconds a delivery is held after its effect, before its outcome is recorded, while the
#: drill delivers its message again or aborts the run: longer than a worker takes to pick a
#: message up, well within the task time limit.
HOLD_SECONDS = 1.5


@dataclass(frozen=True)
class Fault:
    """One fault of one case: its kind, the step (position) it strikes and its tool."""

    kind: str
    step: int = 0
    tool: str = ""
    #: Which call of ``tool`` (at its fault point) it strikes, from 1; and for how many calls.
    nth: int = 1
    times: int = 1
    #: Abort the run once this many calls were made (0: let the scenario run to its end).
    abort_after: int = 0
    #: The model turn it strikes (a turn kind; ``tool`` is then the agent's name).
    turn: int = 0

    @property
    def name(self) -> str:
        if self.kind == "none":
            return "clean run"
        at = f"turn {self.turn}" if self.turn else f"step {self.step}"
        return f"{self.kind} @ {at} ({self.tool})"


@dataclass(frozen=True)
class PlannedStep:
    """A step of the clean run: its position in the scenario, its tool, class and undo."""

    position: int
    tool: str
    tool_class: ToolClass
    undo_tool: str


def pivot_of(steps: Sequence[PlannedStep]) -> int:
    """The position of the first irreversible step (0: none)."""
    return next((s.position for s in steps if s.tool_class is ToolClass.IRREVERSIBLE_WRITE), 0)


def plan(steps: Sequence[PlannedStep], saga: Saga) -> list[Fault]:
    """Every case of a scenario whose clean run made ``steps``."""
    faults: list[Fault] = []
    seen: dict[str, int] = {}
    for s in steps:
        seen[s.tool] = nth = seen.get(s.tool, 0) + 1
        attempts = saga.registry.get(s.tool).retry.attempts
        faults.append(Fault("fail_before_effect", s.position, s.tool, nth, attempts))
        if s.tool_class.is_write:
            faults.append(Fault("fail_after_effect", s.position, s.tool, nth, attempts))
            faults.append(Fault("killed_mid_effect", s.position, s.tool, nth))
            faults.append(Fault("delivered_twice", s.position, s.tool, nth))
            faults.append(
                Fault("aborted_mid_effect", s.position, s.tool, nth, abort_after=s.position)
            )
    # The undos run when the run is aborted after the last step before the pivot (a class 5
    # step), newest first: the nth undo of a tool is counted from that end.
    pivot = pivot_of(steps)
    last = pivot - 1 if pivot else len(steps)
    undone = [s for s in steps if s.position <= last and s.undo_tool]
    for s in undone:
        nth = 1 + sum(1 for o in undone if o.position > s.position and o.undo_tool == s.undo_tool)
        attempts = saga.registry.get(s.undo_tool).retry.attempts
        at = (s.position, s.undo_tool, nth)
        faults.append(Fault("undo_fails_once", *at, abort_after=last))
        faults.append(Fault("undo_fails_after_effect", *at, abort_after=last))
        faults.append(Fault("undo_fails_always", *at, times=attempts, abort_after=last))
        faults.append(Fault("undo_killed_mid_effect", *at, abort_after=last))
        faults.append(Fault("undo_delivered_twice", *at, abort_after=last))
    for s in steps:
        faults.append(Fault("aborted_after", s.position, s.tool, abort_after=s.position))
    order = {kind: i for i, kind in enumerate(KINDS)}
    return sorted(faults, key=lambda f: (order[f.kind], f.step))


def sample(cases: list[Fault], max_cases: int | None, seed: int) -> list[Fault]:
    """``max_cases`` of ``cases`` drawn with ``seed``, in their planned order."""
    if max_cases is None or max_cases >= len(cases):
        return list(cases)
    picked = sorted(random.Random(seed).sample(range(len(cases)), max(0, max_cases)))
    return [cases[i] for i in picked]
