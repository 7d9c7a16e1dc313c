"""The saga's rules as plain functions: the dispatcher's pivot rules, the unwind order, how a
failing run ends, and what is still live in the world afterwards.

Everything here is built by hand: no Redis, no broker.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from saga.errors import CallRefusedError, RunEndedError
from saga.model import CompensationState, RunState, StepState, ToolClass
from saga.rules import (
    REASON_AFTER_PIVOT,
    REASON_COMPENSATION_FAILED,
    REASON_COMPENSATION_NOT_BUILT,
    check_call,
    conclusion,
    gate_for,
    not_undone,
    once_undone,
    unwind_order,
)
from saga.stack import CompensationRecord, RunPicture, RunView, StepRecord

RUN_ID = "run-rules"


def view(
    *,
    state: RunState = RunState.RUNNING,
    pivot_step: int | None = None,
    in_flight: dict[int, ToolClass] | None = None,
    allow_after_pivot: bool = False,
) -> RunView:
    return RunView(
        run_id=RUN_ID,
        state=state,
        version="7",
        pivot_step=pivot_step,
        in_flight=in_flight or {},
        allow_after_pivot=allow_after_pivot,
    )


def step(
    number: int,
    tool: str,
    tool_class: ToolClass,
    state: StepState = StepState.SUCCEEDED,
    result: Any = None,
) -> StepRecord:
    return StepRecord(
        step=number,
        tool=tool,
        tool_class=tool_class,
        args={"n": number},
        state=state,
        attempts=1,
        result=result,
    )


def entry(number: int, tool: str) -> dict[str, Any]:
    return {
        "step": number,
        "tool": tool,
        "args": {"ref": f"r{number}"},
        "idempotency_key": f"{RUN_ID}:{number}:undo",
        "description": f"{tool} for step {number}",
    }


def compensation(
    number: int, tool: str, state: CompensationState, error: dict[str, Any] | None = None
) -> CompensationRecord:
    return CompensationRecord(
        step=number, entry=entry(number, tool), state=state, attempts=2, error=error
    )


def picture(
    steps: list[StepRecord],
    *,
    stack: list[dict[str, Any]] | None = None,
    compensations: list[CompensationRecord] | None = None,
    pivot_step: int | None = None,
) -> RunPicture:
    return RunPicture(
        run_id=RUN_ID,
        state=RunState.UNWINDING,
        reason="step 9 failed",
        pivot_step=pivot_step,
        steps=steps,
        stack=stack or [],
        compensations=compensations or [],
        created=1_700_000_000.0,
        ended=None,
    )


# -- check_call: class 5 waits for the reversible work to settle ---------------------------


@pytest.mark.parametrize(
    "unsettled_class",
    [ToolClass.CONVERGENT_WRITE, ToolClass.REVERSIBLE_WRITE, ToolClass.COMPENSATABLE_WRITE],
)
def test_class_5_refused_while_a_write_is_in_flight(unsettled_class: ToolClass) -> None:
    """A class 5 call is refused while a class 2/3/4 step has not settled, naming that step."""
    # Given a run with a read (step 1) and a write (step 4) in flight
    run = view(in_flight={1: ToolClass.READ, 4: unsettled_class})

    # When the agent asks for an irreversible call
    with pytest.raises(CallRefusedError) as refused:
        check_call(run, "send_reply", ToolClass.IRREVERSIBLE_WRITE)

    # Then the refusal names only the unsettled write, never the read
    assert refused.value.unsettled_steps == (4,)
    assert "send_reply" in str(refused.value)
    assert "step(s) 4 " in str(refused.value)


def test_class_5_refusal_lists_every_unsettled_write_in_order() -> None:
    """All unsettled writes are listed, sorted by step number, whatever the dict order."""
    run = view(
        in_flight={
            7: ToolClass.COMPENSATABLE_WRITE,
            2: ToolClass.REVERSIBLE_WRITE,
            5: ToolClass.READ,
            3: ToolClass.CONVERGENT_WRITE,
        }
    )

    with pytest.raises(CallRefusedError) as refused:
        check_call(run, "send_reply", ToolClass.IRREVERSIBLE_WRITE)

    assert refused.value.unsettled_steps == (2, 3, 7)
    assert "step(s) 2, 3, 7 have not settled" in str(refused.value)


def test_class_5_allowed_while_only_a_read_is_in_flight() -> None:
    """A read in flight does not hold back an irreversible call: it has nothing to undo."""
    run = view(in_flight={1: ToolClass.READ, 2: ToolClass.READ})

    assert check_call(run, "send_reply", ToolClass.IRREVERSIBLE_WRITE) is None


def test_class_5_allowed_on_an_idle_run_and_after_the_pivot() -> None:
    """A second irreversible call is fine: nothing reversible is left unsettled."""
    assert check_call(view(), "send_reply", ToolClass.IRREVERSIBLE_WRITE) is None
    assert check_call(view(pivot_step=3), "send_reply", ToolClass.IRREVERSIBLE_WRITE) is None


# -- check_call: reversible work belongs before the pivot ----------------------------------


@pytest.mark.parametrize("tool_class", [ToolClass.REVERSIBLE_WRITE, ToolClass.COMPENSATABLE_WRITE])
def test_class_3_and_4_refused_after_the_pivot(tool_class: ToolClass) -> None:
    """Past the pivot a reversible write is refused, and the message names the pivot step."""
    run = view(pivot_step=3)

    with pytest.raises(CallRefusedError) as refused:
        check_call(run, "issue_credit", tool_class)

    message = str(refused.value)
    assert f"class {tool_class.value}" in message
    assert "past its pivot (step 3, irreversible)" in message
    assert refused.value.unsettled_steps == ()


@pytest.mark.parametrize("tool_class", [ToolClass.REVERSIBLE_WRITE, ToolClass.COMPENSATABLE_WRITE])
def test_class_3_and_4_refused_while_a_class_5_step_is_in_flight(tool_class: ToolClass) -> None:
    """An irreversible step in flight already counts as the pivot for reversible writes."""
    run = view(in_flight={6: ToolClass.IRREVERSIBLE_WRITE, 2: ToolClass.READ})

    with pytest.raises(CallRefusedError) as refused:
        check_call(run, "set_ticket_status", tool_class)

    assert refused.value.unsettled_steps == (6,)
    assert "(step 6, irreversible)" in str(refused.value)


@pytest.mark.parametrize("tool_class", [ToolClass.REVERSIBLE_WRITE, ToolClass.COMPENSATABLE_WRITE])
def test_class_3_and_4_allowed_after_the_pivot_when_the_run_allows_it(
    tool_class: ToolClass,
) -> None:
    """``allow_after_pivot`` lifts the refusal, past the pivot and with the pivot in flight."""
    past = view(pivot_step=3, allow_after_pivot=True)
    in_flight = view(in_flight={4: ToolClass.IRREVERSIBLE_WRITE}, allow_after_pivot=True)

    assert check_call(past, "issue_credit", tool_class) is None
    assert check_call(in_flight, "issue_credit", tool_class) is None


@pytest.mark.parametrize(
    "tool_class", [ToolClass.READ, ToolClass.CONVERGENT_WRITE, ToolClass.IRREVERSIBLE_WRITE]
)
def test_class_1_2_5_allowed_after_the_pivot(tool_class: ToolClass) -> None:
    """Reads, convergent writes and further irreversible calls may follow the pivot."""
    run = view(pivot_step=2, in_flight={5: ToolClass.IRREVERSIBLE_WRITE})

    assert check_call(run, "whatever", tool_class) is None


@pytest.mark.parametrize(
    "state",
    [RunState.UNWINDING, RunState.COMPLETED, RunState.COMPENSATED, RunState.ESCALATED],
)
@pytest.mark.parametrize("tool_class", list(ToolClass))
def test_any_call_on_a_run_that_is_not_running_is_refused(
    state: RunState, tool_class: ToolClass
) -> None:
    """A run that is unwinding or has ended takes no more calls of any class."""
    with pytest.raises(RunEndedError) as ended:
        check_call(view(state=state), "get_order", tool_class)

    assert ended.value.state == state.value
    assert ended.value.run_id == RUN_ID
    assert state.value in str(ended.value)


# -- unwind_order --------------------------------------------------------------------------


def test_unwind_order_is_most_recent_first_whatever_the_input_order() -> None:
    """The stack unwinds by step number, highest first, even if it was read out of order."""
    shuffled = [entry(3, "c"), entry(10, "j"), entry(2, "b"), entry(7, "g")]

    ordered = unwind_order(shuffled)

    assert [e["step"] for e in ordered] == [10, 7, 3, 2]
    # the input is left as it was
    assert [e["step"] for e in shuffled] == [3, 10, 2, 7]


def test_unwind_order_compares_step_numbers_as_numbers() -> None:
    """Step "10" sorts above step "9": numbers, not strings."""
    stack = [{"step": "9", "tool": "a"}, {"step": "10", "tool": "b"}, {"step": 1, "tool": "c"}]

    assert [e["tool"] for e in unwind_order(stack)] == ["b", "a", "c"]


def test_unwind_order_of_an_empty_stack_is_empty() -> None:
    """Nothing pushed, nothing to undo."""
    assert unwind_order([]) == []


# -- conclusion ----------------------------------------------------------------------------


def test_conclusion_past_the_pivot_escalates() -> None:
    """A run that failed after an irreversible step escalates, even with its undos all done."""
    run = picture(
        [
            step(1, "issue_credit", ToolClass.COMPENSATABLE_WRITE),
            step(2, "send_reply", ToolClass.IRREVERSIBLE_WRITE),
            step(3, "set_ticket_status", ToolClass.REVERSIBLE_WRITE, StepState.FAILED),
        ],
        compensations=[compensation(1, "reverse_credit", CompensationState.DONE)],
        pivot_step=2,
    )

    assert conclusion(run) == (RunState.ESCALATED, REASON_AFTER_PIVOT)
    assert REASON_AFTER_PIVOT == "failed after an irreversible step"


def test_conclusion_with_a_failed_compensation_escalates() -> None:
    """A compensation that failed means a person has to look: escalate, loudly."""
    run = picture(
        [
            step(1, "issue_credit", ToolClass.COMPENSATABLE_WRITE),
            step(2, "set_ticket_status", ToolClass.REVERSIBLE_WRITE),
            step(3, "send_reply", ToolClass.IRREVERSIBLE_WRITE, StepState.FAILED),
        ],
        stack=[entry(1, "reverse_credit")],
        compensations=[
            compensation(1, "reverse_credit", CompensationState.FAILED, {"message": "down"}),
            compensation(2, "set_ticket_status", CompensationState.DONE),
        ],
    )

    assert conclusion(run) == (RunState.ESCALATED, REASON_COMPENSATION_FAILED)
    assert REASON_COMPENSATION_FAILED == "compensation failed"


def test_conclusion_with_a_non_empty_stack_escalates() -> None:
    """An undo left on the stack was never confirmed, whatever the compensation records say."""
    run = picture(
        [step(1, "issue_credit", ToolClass.COMPENSATABLE_WRITE)],
        stack=[entry(1, "reverse_credit")],
        compensations=[compensation(1, "reverse_credit", CompensationState.DONE)],
    )

    assert conclusion(run) == (RunState.ESCALATED, REASON_COMPENSATION_FAILED)


def test_conclusion_with_a_pending_compensation_escalates() -> None:
    """A compensation that never ran counts as not undone."""
    run = picture(
        [step(1, "issue_credit", ToolClass.COMPENSATABLE_WRITE)],
        compensations=[compensation(1, "reverse_credit", CompensationState.PENDING)],
    )

    assert conclusion(run) == (RunState.ESCALATED, REASON_COMPENSATION_FAILED)


def test_conclusion_when_everything_was_undone_is_compensated() -> None:
    """Every undo done, stack empty, no pivot: the world is as it was."""
    run = picture(
        [
            step(1, "get_order", ToolClass.READ),
            step(2, "issue_credit", ToolClass.COMPENSATABLE_WRITE),
            step(3, "set_ticket_status", ToolClass.REVERSIBLE_WRITE),
            step(4, "send_reply", ToolClass.IRREVERSIBLE_WRITE, StepState.FAILED),
        ],
        compensations=[
            compensation(2, "reverse_credit", CompensationState.DONE),
            compensation(3, "set_ticket_status", CompensationState.DONE),
        ],
    )

    assert conclusion(run) == (RunState.COMPENSATED, "")


def _last_undo_running(older: CompensationState) -> RunPicture:
    """Two undos: step 3's running (its entry still on the stack), step 2's in ``older``."""
    return picture(
        [
            step(2, "issue_credit", ToolClass.COMPENSATABLE_WRITE),
            step(3, "set_ticket_status", ToolClass.REVERSIBLE_WRITE),
            step(4, "send_reply", ToolClass.IRREVERSIBLE_WRITE, StepState.FAILED),
        ],
        stack=[entry(3, "set_ticket_status")]
        + ([entry(2, "reverse_credit")] if older is CompensationState.FAILED else []),
        compensations=[
            compensation(2, "reverse_credit", older),
            compensation(3, "set_ticket_status", CompensationState.RUNNING),
        ],
    )


def test_the_run_once_the_last_undo_is_done_is_judged_on_the_reading_before() -> None:
    """The run as the undo's record leaves it: that undo done, its entry off the stack; its
    verdict is the conclusion's."""
    undone = once_undone(_last_undo_running(CompensationState.DONE), 3)
    assert undone is not None and undone.stack == []
    assert [c.state for c in undone.compensations] == [CompensationState.DONE] * 2
    assert conclusion(undone) == (RunState.COMPENSATED, "")
    undone = once_undone(_last_undo_running(CompensationState.FAILED), 3)
    assert undone is not None and undone.stack == [entry(2, "reverse_credit")]
    assert conclusion(undone) == (RunState.ESCALATED, REASON_COMPENSATION_FAILED)


def test_the_run_once_undone_is_not_judged_where_the_reading_cannot_tell() -> None:
    """An undo not running (a repeat, or not begun), or whose entry is not the one on the
    stack, or a run no longer unwinding, leaves it to the reading after the record."""
    run = _last_undo_running(CompensationState.DONE)
    assert once_undone(run, 2) is None
    assert once_undone(run, 7) is None
    other = dataclasses.replace(run, stack=[{**entry(3, "set_ticket_status"), "args": {}}])
    assert once_undone(other, 3) is None
    twice = dataclasses.replace(run, stack=run.stack * 2)
    assert once_undone(twice, 3) is None
    ended = dataclasses.replace(run, state=RunState.COMPENSATED)
    assert once_undone(ended, 3) is None


def test_conclusion_of_a_run_with_nothing_to_undo_is_compensated() -> None:
    """A run whose only step was a read that failed has nothing to undo."""
    run = picture([step(1, "get_order", ToolClass.READ, StepState.FAILED)])

    assert conclusion(run) == (RunState.COMPENSATED, "")


# -- not_undone ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("undo", "why"),
    [
        (CompensationState.FAILED, "its compensation failed"),
        (CompensationState.PENDING, "its compensation has not run yet (a requeue runs it)"),
        (None, "it has no compensation on record"),
    ],
)
def test_not_undone_says_whether_the_undo_failed_or_never_ran(
    undo: CompensationState | None, why: str
) -> None:
    """R12: an effect that landed after its run escalated has an undo that never ran; the
    person reading the card must not be told it failed."""
    run = picture(
        [step(1, "issue_credit", ToolClass.COMPENSATABLE_WRITE, result={"credit": "cr_1"})],
        compensations=[] if undo is None else [compensation(1, "reverse_credit", undo)],
    )

    assert [live["why"] for live in not_undone(run)] == [why]


def test_an_undo_never_built_escalates_saying_so_and_its_effect_is_not_undoable() -> None:
    """A compensation function that raised left an undo that cannot run: the verdict and the
    live list say the compensation could not be built, not that an undo gave up."""
    why = "the compensation could not be built: KeyError 'creditid'"
    broken = {**entry(2, ""), "args": {}, "broken": True, "description": why}
    failed = CompensationRecord(step=2, entry=broken, state=CompensationState.FAILED, attempts=0)
    run = picture(
        [
            step(1, "issue_credit", ToolClass.COMPENSATABLE_WRITE, result={"credit": "cr_1"}),
            step(2, "issue_credit", ToolClass.COMPENSATABLE_WRITE, result={"credit": "cr_2"}),
        ],
        stack=[broken],
        compensations=[compensation(1, "reverse_credit", CompensationState.DONE), failed],
    )

    assert conclusion(run) == (RunState.ESCALATED, REASON_COMPENSATION_NOT_BUILT)
    assert [(live["step"], live["why"]) for live in not_undone(run)] == [
        (2, f"not undoable: {why}")
    ]


def test_not_undone_lists_live_effects_with_their_reasons() -> None:
    """Irreversible, convergent and failed-compensation effects are listed, each with why."""
    # Given a run with one step of every kind, one compensation done and one failed
    run = picture(
        [
            step(1, "get_order", ToolClass.READ, result={"order": 4921}),
            step(2, "set_priority", ToolClass.CONVERGENT_WRITE, result="high"),
            step(3, "issue_credit", ToolClass.COMPENSATABLE_WRITE, result={"credit": "cr_1"}),
            step(4, "set_ticket_status", ToolClass.REVERSIBLE_WRITE, result="pending"),
            step(5, "send_reply", ToolClass.IRREVERSIBLE_WRITE, result={"mail": "m_1"}),
            step(6, "issue_credit", ToolClass.COMPENSATABLE_WRITE, StepState.FAILED),
            step(7, "set_ticket_status", ToolClass.REVERSIBLE_WRITE, StepState.SKIPPED),
        ],
        stack=[entry(3, "reverse_credit")],
        compensations=[
            compensation(3, "reverse_credit", CompensationState.FAILED, {"message": "503"}),
            compensation(4, "set_ticket_status", CompensationState.DONE),
        ],
    )

    # When
    live = not_undone(run)

    # Then only succeeded writes that were not undone remain, in step order
    assert live == [
        {
            "step": 2,
            "tool": "set_priority",
            "result": "high",
            "why": "convergent write: kept, it has no undo",
        },
        {
            "step": 3,
            "tool": "issue_credit",
            "result": {"credit": "cr_1"},
            "why": "its compensation failed",
        },
        {
            "step": 5,
            "tool": "send_reply",
            "result": {"mail": "m_1"},
            "why": "irreversible: cannot be undone",
        },
    ]


def test_not_undone_past_the_pivot_names_the_pivot() -> None:
    """Past the pivot nothing is unwound, so every reversible effect stays live for that reason."""
    run = picture(
        [
            step(1, "issue_credit", ToolClass.COMPENSATABLE_WRITE, result={"credit": "cr_2"}),
            step(2, "set_ticket_status", ToolClass.REVERSIBLE_WRITE, result="open"),
            step(3, "send_reply", ToolClass.IRREVERSIBLE_WRITE, result={"mail": "m_2"}),
            step(4, "get_order", ToolClass.READ, StepState.FAILED),
        ],
        stack=[entry(1, "reverse_credit"), entry(2, "set_ticket_status")],
        compensations=[
            compensation(1, "reverse_credit", CompensationState.PENDING),
            compensation(2, "set_ticket_status", CompensationState.PENDING),
        ],
        pivot_step=3,
    )

    live = not_undone(run)

    assert [(e["step"], e["why"]) for e in live] == [
        (1, "not unwound: the run was past its pivot"),
        (2, "not unwound: the run was past its pivot"),
        (3, "irreversible: cannot be undone"),
    ]


def test_not_undone_is_empty_when_everything_was_undone() -> None:
    """A fully compensated run leaves nothing live (reads never count)."""
    run = picture(
        [
            step(1, "get_order", ToolClass.READ),
            step(2, "issue_credit", ToolClass.COMPENSATABLE_WRITE),
        ],
        compensations=[compensation(2, "reverse_credit", CompensationState.DONE)],
    )

    assert not_undone(run) == []


@pytest.mark.parametrize(
    ("tool_class", "unsettled", "before_pivot"),
    [
        (ToolClass.READ, set(), False),
        (ToolClass.CONVERGENT_WRITE, set(), False),
        (ToolClass.REVERSIBLE_WRITE, set(), True),
        (ToolClass.COMPENSATABLE_WRITE, set(), True),
        (ToolClass.IRREVERSIBLE_WRITE, {2, 3, 4}, False),
    ],
)
def test_the_gate_redis_checks_is_the_rule_check_call_explains(
    tool_class: ToolClass, unsettled: set[int], before_pivot: bool
) -> None:
    """The reserve script enforces exactly these gates; check_call words the refusals."""
    gate = gate_for(tool_class)
    assert {int(c) for c in gate.unsettled_classes} == unsettled
    assert gate.before_pivot is before_pivot
