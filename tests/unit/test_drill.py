"""The drill's plan, its sampling, its judgment and its reports, without a worker."""

from __future__ import annotations

import json
from typing import Any

import pytest

from saga import StepContext, ToolClass, ToolDefinitionError, ToolRegistry, Undo
from saga.model import RunState
from saga.testing.drill import (
    CaseResult,
    DrillReport,
    Fault,
    Mismatch,
    StepOutcome,
    _mismatches,
    _PlannedStep,
    plan,
    sample,
)
from saga.testing.drill_report import to_json, to_markdown, to_text


class _Registry:
    """What ``plan`` reads of a Saga: each tool's retry attempts."""

    def __init__(self, registry: ToolRegistry) -> None:
        self.registry = registry


def _tools() -> ToolRegistry:
    tools = ToolRegistry()

    def undo(args: dict[str, Any], result: Any) -> Undo:
        return Undo("put_back", {"ref": "r"})

    @tools.tool(ToolClass.READ)
    def read(ctx: StepContext) -> int:
        return 1

    @tools.tool(ToolClass.COMPENSATABLE_WRITE, compensation=undo, verify=lambda k, a: 1)
    def write(ctx: StepContext) -> int:
        return 1

    @tools.compensation(verify=lambda k, a: 1)
    def put_back(ctx: StepContext, ref: str) -> None:
        return None

    @tools.tool(ToolClass.IRREVERSIBLE_WRITE)
    def send(ctx: StepContext) -> int:
        return 1

    return tools


STEPS = [
    _PlannedStep(1, "read", ToolClass.READ, ""),
    _PlannedStep(2, "write", ToolClass.COMPENSATABLE_WRITE, "put_back"),
    _PlannedStep(3, "write", ToolClass.COMPENSATABLE_WRITE, "put_back"),
    _PlannedStep(4, "send", ToolClass.IRREVERSIBLE_WRITE, ""),
]


def test_the_plan_has_each_fault_at_each_step_and_undo() -> None:
    faults = plan(STEPS, _Registry(_tools()))  # type: ignore[arg-type]
    names = [f.name for f in faults]
    assert names.count("fail_before_effect @ step 1 (read)") == 1
    assert "fail_after_effect @ step 1 (read)" not in names  # a read has no effect
    assert sum(f.kind == "killed_mid_effect" for f in faults) == 3
    assert sum(f.kind == "aborted_after" for f in faults) == 4
    # the second write is the tool's second call; its undo runs first (newest first)
    second = next(f for f in faults if f.name == "fail_before_effect @ step 3 (write)")
    assert (second.nth, second.times) == (2, 3)
    undos = {f.step: f for f in faults if f.kind == "undo_fails_always"}
    assert (undos[3].nth, undos[2].nth) == (1, 2)
    assert undos[2].times == 5 and undos[2].abort_after == 3  # before the pivot (step 4)
    assert len(faults) == 1 + 3 * 3 + 2 * 3 + 4


def test_sampling_is_bounded_seeded_and_keeps_the_order() -> None:
    faults = [Fault("aborted_after", n) for n in range(1, 21)]
    picked = sample(faults, 5, seed=3)
    assert picked == sample(faults, 5, seed=3) and len(picked) == 5
    assert [f.step for f in picked] == sorted(f.step for f in picked)
    assert sample(faults, None, 0) == faults


@pytest.mark.parametrize(
    ("saga", "world", "source", "undo", "state", "expected"),
    [
        ("undone", 0, "verify", 1, RunState.COMPENSATED, []),
        ("undone", 1, "verify", 1, RunState.COMPENSATED, ["undone, but the effect is live"]),
        ("undone", 1, "lookup", None, RunState.COMPENSATED, []),  # a lookup finds it still
        ("undone", 0, "verify", 2, RunState.COMPENSATED, ["undo was applied 2 times"]),
        ("none", 1, "lookup", None, RunState.COMPENSATED, ["nobody will undo it"]),
        ("live", 2, "verify", None, RunState.COMPLETED, ["applied 2 times"]),
        ("live", 0, "verify", None, RunState.COMPLETED, ["no such effect"]),
        ("live", 1, "verify", None, RunState.COMPENSATED, ["not escalated"]),
        ("escalated", 1, "verify", None, RunState.ESCALATED, []),
        ("live", None, "", None, RunState.COMPLETED, []),
    ],
)
def test_a_step_is_judged_by_the_world(
    saga: str,
    world: int | None,
    source: str,
    undo: int | None,
    state: RunState,
    expected: list[str],
) -> None:
    found = _mismatches(StepOutcome(2, "write", saga, world, source, undo), state, True)
    assert len(found) == len(expected)
    for what, part in zip(found, expected, strict=True):
        assert part in what


def test_the_reports_name_every_mismatch() -> None:
    case = CaseResult(Fault("aborted_after", 3, "write", abort_after=3), run_id="r1")
    case.end_state = "compensated"
    case.steps = [StepOutcome(2, "write", "undone", 1, "verify", 2)]
    found = _mismatches(case.steps[0], RunState.COMPENSATED, True)
    case.mismatches = [Mismatch(case.fault.name, "write", 2, what) for what in found]
    report = DrillReport("book", [(2, "write", 4)], [case])
    text = to_text(report)
    assert "undone/1 x2" in text and "MISMATCH (2)" in text
    assert "MISMATCH aborted_after @ step 3 (write): step 2 (write): saga reports" in text
    assert "#### Mismatches" in to_markdown(report)
    data = json.loads(json.dumps(to_json(report)))
    assert data["ok"] is False and len(data["mismatches"]) == 2


def test_verify_is_for_writes_and_compensations() -> None:
    tools = ToolRegistry()
    with pytest.raises(ToolDefinitionError, match="verify of peek"):

        @tools.tool(ToolClass.READ, verify=lambda k, a: 1)
        def peek() -> int:
            return 1

    with pytest.raises(ToolDefinitionError, match="verify of undo_it"):

        @tools.compensation(verify="not callable")
        def undo_it() -> None:
            return None
