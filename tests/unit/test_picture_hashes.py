"""Rebuilding a run's keys from its record: ``hashes_of`` is the inverse of ``picture_from``
(no Redis: the raw hashes are what the scripts would store)."""

from __future__ import annotations

from typing import Any

from saga.model import CompensationState, RunState, StepState, ToolClass
from saga.picture import CompensationRecord, RunPicture, StepRecord, hashes_of, picture_from

RUN = "r-4921"


def entry(step: int, tool: str, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "step": step,
        "idempotency_key": f"{RUN}:{step}:undo",
        "tool": tool,
        "args": args,
        "description": f"{tool} for step {step} — ✓",
    }


def escalated_picture(**changes: Any) -> RunPicture:
    """A run whose credit reversal failed twice over (requeued once), the ticket restored, a
    hosted call on step 3, a broken undo, a step reconciled, every optional field set."""
    credit = entry(2, "reverse_credit", {"credit_id": "cr_4921_7", "amount": 2500.5})
    status = entry(3, "set_ticket_status", {"ticket_id": 9104, "status": "open"})
    broken = {**entry(4, "", {}), "broken": True}
    values: dict[str, Any] = {
        "run_id": RUN,
        "state": RunState.ESCALATED,
        "reason": "compensation failed",
        "pivot_step": None,
        "steps": [
            StepRecord(1, "get_order", ToolClass.READ, {"order_id": 4921}, StepState.SUCCEEDED, 1,
                       result={"order_id": 4921, "lines": [1, None, True]}, started=1.5),
            StepRecord(2, "issue_credit", ToolClass.COMPENSATABLE_WRITE, {"amount": 250_000},
                       StepState.SUCCEEDED, 2, result={"credit_id": "cr_4921_7"},
                       error={"type": "Timeout", "message": "slow"}, reconciled="happened",
                       started=1_700_000_000.123456, lease=1_700_000_030.5, landed="late"),
            StepRecord(3, "set_ticket_status", ToolClass.REVERSIBLE_WRITE,
                       {"ticket_id": 9104, "status": "pending"}, StepState.SUCCEEDED, 1,
                       result=None, call="2:0"),
            StepRecord(4, "odd_write", ToolClass.COMPENSATABLE_WRITE, {}, StepState.SUCCEEDED, 1,
                       result="ok"),
            StepRecord(5, "send_reply", ToolClass.IRREVERSIBLE_WRITE, {"to": "ada"},
                       StepState.FAILED, 3, error={"type": "SMTPError", "message": "down"}),
        ],
        "stack": [credit, broken],
        "compensations": [
            CompensationRecord(2, credit, CompensationState.FAILED, attempts=9,
                               error={"type": "HTTPError", "message": "503"},
                               settled_at=1_700_000_100.25, task_id=f"{RUN}:2:undo:ab12cd34",
                               round_start=5,
                               history=[{"attempts": 5, "error": '{"m":1}', "at": "1.5"}],
                               errors=[{"error": {"type": "HTTPError", "message": "503",
                                                  "attempt": 4}, "at": "1700000100.25"}]),
            CompensationRecord(3, status, CompensationState.DONE, attempts=1,
                               settled_at=1_700_000_099.0, task_id=f"{RUN}:3:undo:ab12cd34"),
            CompensationRecord(4, broken, CompensationState.FAILED, attempts=0,
                               error={"type": "CompensationBuildError", "message": "no"}),
        ],
        "created": 1_700_000_000.25,
        "ended": 1_700_000_100.5,
        "extra": {"owner": "requeue:1", "sent": "1", "generation": "1"},
        "updated": 1_700_000_100.5,
        "deadline": 900.0,
        "doubt": "",
        "in_flight": (),
        "version": "42",
        "cause": "step 5 failed",
        "recorded": True,
        "recorded_version": "42",  # keys of a recorded run saw their record written
        "actions": (
            {"kind": "requeue", "generation": 1, "by": "alice", "at": 1_700_000_050.0,
             "count": 1, "corrections": {"2": {"before": {"a": 1}, "after": {"a": 2}}}},
        ),
        "resolution": {"by": "bob", "note": "refunded by phone — ✓", "escalation_id": f"{RUN}:1",
                       "at": 1_700_000_200.75},
    }  # fmt: skip
    values.update(changes)
    return RunPicture(**values)


def round_trip(picture: RunPicture) -> RunPicture:
    run, steps, stack, comps = hashes_of(picture)
    return picture_from(picture.run_id, run, steps, stack, comps, [])


def test_a_rebuilt_run_reads_back_as_it_was_recorded() -> None:
    """Every field the picture holds survives: steps, stack, undos, actions, a resolution."""
    picture = escalated_picture()
    assert round_trip(picture) == picture


def test_each_stack_entry_is_its_compensations_very_string() -> None:
    """The done script removes an entry by value: stack and compensation must match bytes."""
    run, _, stack, comps = hashes_of(escalated_picture())
    assert stack == [comps["2:entry"], comps["4:entry"]]
    assert run["next_step"] == "5" and run["recorded"] == "1"


def test_a_resolution_holds_only_at_the_version_it_was_made() -> None:
    """A run that moved on since (an effect landed late) is open again."""
    run, steps, stack, comps = hashes_of(escalated_picture())
    run["version"] = "43"
    assert picture_from(RUN, run, steps, stack, comps, []).resolution is None


def test_a_run_with_nothing_optional_round_trips_too() -> None:
    """An ended run with no steps, no undo, never requeued, never resolved."""
    picture = escalated_picture(
        state=RunState.COMPLETED,
        reason="",
        steps=[],
        stack=[],
        compensations=[],
        ended=None,
        extra={"owner": "", "sent": "0", "generation": "0"},
        cause="",
        recorded=False,
        actions=(),
        resolution=None,
        pivot_step=None,
    )
    assert round_trip(picture) == picture
