"""The drill's plan, its sampling, its judgment and its reports, without a worker."""

from __future__ import annotations

import json
from typing import Any

import pytest

from saga import StepContext, ToolClass, ToolDefinitionError, ToolRegistry, Undo
from saga.errors import StepRejectedError
from saga.model import RunState, StepState
from saga.testing.drill import (
    KINDS,
    CaseResult,
    DrillReport,
    Fault,
    Mismatch,
    StepOutcome,
    install_rule,
    plan,
    sample,
)
from saga.testing.drill_judge import mismatches_of
from saga.testing.drill_plan import HOLD_SECONDS, MEANINGS, PlannedStep
from saga.testing.drill_replay import RecordedCall, Replay, calls_of, with_setup
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
    PlannedStep(1, "read", ToolClass.READ, ""),
    PlannedStep(2, "write", ToolClass.COMPENSATABLE_WRITE, "put_back"),
    PlannedStep(3, "write", ToolClass.COMPENSATABLE_WRITE, "put_back"),
    PlannedStep(4, "send", ToolClass.IRREVERSIBLE_WRITE, ""),
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
    # each write is delivered twice and aborted mid-effect; a read has no effect to strike
    assert [f.step for f in faults if f.kind == "delivered_twice"] == [2, 3, 4]
    mid = [(f.step, f.nth, f.abort_after) for f in faults if f.kind == "aborted_mid_effect"]
    assert mid == [(2, 1, 2), (3, 2, 3), (4, 1, 4)]
    # every undo is also killed mid-effect and delivered twice, newest first as above
    for kind in ("undo_killed_mid_effect", "undo_delivered_twice"):
        struck = {f.step: (f.tool, f.nth, f.abort_after) for f in faults if f.kind == kind}
        assert struck == {2: ("put_back", 2, 3), 3: ("put_back", 1, 3)}
    steps = 4 + 3 * 4  # each step fails before; each write after, killed, twice, aborted mid
    assert len(faults) == steps + 2 * 5 + 4  # five undo kinds for each of two undos; aborts


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
    found = mismatches_of(StepOutcome(2, "write", saga, world, source, undo), state, True)
    assert len(found) == len(expected)
    for what, part in zip(found, expected, strict=True):
        assert part in what


def test_the_reports_name_every_mismatch() -> None:
    case = CaseResult(Fault("aborted_after", 3, "write", abort_after=3), run_id="r1")
    case.end_state = "compensated"
    case.steps = [StepOutcome(2, "write", "undone", 1, "verify", 2)]
    found = mismatches_of(case.steps[0], RunState.COMPENSATED, True)
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


class _ToolRules:
    """What ``install_rule`` asks of a tool's faults, written down instead of into Redis."""

    def __init__(self, tool: str, written: list[tuple[str, str, dict[str, Any]]]) -> None:
        self.tool, self.written = tool, written

    def __getattr__(self, method: str) -> Any:
        def write(*args: Any, **options: Any) -> str:
            self.written.append((self.tool, method, {"args": args, **options}))
            return "rule"

        return write


class _Rules:
    def __init__(self) -> None:
        self.written: list[tuple[str, str, dict[str, Any]]] = []

    def tool(self, name: str) -> _ToolRules:
        return _ToolRules(name, self.written)


@pytest.mark.parametrize(
    ("fault", "method", "options"),
    [
        (Fault("killed_mid_effect", 2, "write", 2), "kill_worker", {"at": "after_effect"}),
        (Fault("delivered_twice", 2, "write", 2), "delay", {"at": "after_effect"}),
        (Fault("aborted_mid_effect", 2, "write", 2), "delay", {"at": "after_effect"}),
        (
            Fault("undo_killed_mid_effect", 2, "put_back", 2),
            "kill_worker",
            {"at": "after_compensation"},
        ),
        (Fault("undo_delivered_twice", 2, "put_back", 2), "delay", {"at": "after_compensation"}),
        (
            Fault("undo_fails_after_effect", 2, "put_back", 2),
            "fail_compensation",
            {"after_effect": True},
        ),
    ],
)
def test_each_kind_is_a_rule_at_its_point(
    fault: Fault, method: str, options: dict[str, Any]
) -> None:
    rules = _Rules()
    assert install_rule(rules, fault) == "rule"  # type: ignore[arg-type]
    ((tool, called, given),) = rules.written
    assert (tool, called, given["nth"]) == (fault.tool, method, 2)
    assert options.items() <= given.items()
    if method == "delay":  # held after the effect while the drill strikes
        assert given["args"] == (HOLD_SECONDS,)


def test_an_abort_after_a_step_writes_no_rule_and_every_kind_is_described() -> None:
    rules = _Rules()
    assert install_rule(rules, Fault("aborted_after", 2, "write", abort_after=2)) is None  # type: ignore[arg-type]
    assert not rules.written
    assert set(KINDS) | {"none"} == set(MEANINGS)


def test_a_recorded_run_is_replayed_call_by_call_in_step_order() -> None:
    # Given a run's steps as recorded: one refused before dispatch, out of order
    rows = [
        (3, "send", {}, "succeeded"),
        (1, "read", {"id": 7}, "succeeded"),
        (2, "write", {"amount": 5}, "rejected"),
        (4, "write", {"amount": 9}, StepState.NOT_DISPATCHED.value),
    ]
    calls = calls_of(rows)
    assert calls == [
        RecordedCall(1, "read", {"id": 7}),
        RecordedCall(2, "write", {"amount": 5}),
        RecordedCall(3, "send", {}),
    ]

    # When they are replayed (the world set up first), the rejected call fed back again
    done: list[Any] = []
    run = _ScriptedRun(done, reject="write")
    Replay("r-1", calls, setup=lambda: done.append("setup"))(run)  # type: ignore[arg-type]

    # Then every call is made again, in order, and the run finished
    assert done == ["setup", ("read", {"id": 7}), ("write", {"amount": 5}), ("send", {}), "finish"]
    assert Replay("r-1", calls).__qualname__ == "run r-1"


def test_a_setup_runs_before_each_play_of_a_scenario() -> None:
    done: list[Any] = []

    def refund(run: Any) -> None:
        done.append("play")

    play = with_setup(lambda: done.append("setup"), refund)
    play(None)  # type: ignore[arg-type]
    play(None)  # type: ignore[arg-type]
    assert done == ["setup", "play", "setup", "play"] and play.__qualname__ == refund.__qualname__


class _ScriptedRun:
    """A ``Run`` for the replay: it writes down each call; ``reject`` is fed back."""

    def __init__(self, done: list[Any], reject: str) -> None:
        self.done, self.reject = done, reject

    def call(self, tool: str, /, **args: Any) -> _Handle:
        self.done.append((tool, args))
        return _Handle(tool, refused=tool == self.reject)

    def finish(self, timeout: float | None = None) -> None:
        self.done.append("finish")


class _Handle:
    def __init__(self, tool: str, refused: bool) -> None:
        self.tool, self.refused = tool, refused

    def result(self, timeout: float | None = None) -> Any:
        if self.refused:
            raise StepRejectedError("r-1", 2, self.tool, "refused")
        return {}


def test_the_matrix_marks_the_pivot_and_the_json_names_the_copy() -> None:
    case = CaseResult(Fault("delivered_twice", 4, "send"), run_id="r1", copy="r1:4")
    case.end_state = "completed"
    case.steps = [
        StepOutcome(2, "write", "live", 1, "verify"),
        StepOutcome(4, "send", "live", 1, "verify"),
    ]
    report = DrillReport("book", [(2, "write", 4), (4, "send", 5)], [case])
    assert report.pivot == 4
    assert "4 send (pivot)" in to_text(report).splitlines()[0]
    data = to_json(report)
    assert data["pivot"] == 4 and data["cases"][0]["copy"] == "r1:4"


def test_the_command_takes_a_scenario_or_a_recorded_run() -> None:
    from click.testing import CliRunner

    from saga.cli.main import cli

    both = ["drill", "--app", "m:s", "--scenario", "m:f", "--from-run", "r-1"]
    for args in (["drill", "--app", "m:s"], both):
        result = CliRunner().invoke(cli, args)
        assert (
            result.exit_code == 2
            and "--scenario MODULE:FUNCTION, --from-run RUN or --agent NAME" in result.output
        )
    shown = CliRunner().invoke(cli, ["drill", "--help"]).output
    assert "--from-run RUN" in shown and "delivered twice" in shown and "--setup" in shown
