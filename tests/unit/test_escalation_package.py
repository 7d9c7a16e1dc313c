"""The escalation package and its renderers, on runs built by hand: the schema's shape, why a
run escalated, the commands, the timeline, and that JSON, Markdown and the card say the same.

Assertions are on structure (keys, rows, the order of lines), not on whole-text snapshots.
"""

from __future__ import annotations

import io
import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from saga.escalations import (
    SCHEMA_VERSION,
    classify,
    escalation_package,
    plain,
    run_card,
    run_document,
    run_document_from_records,
    run_json,
    timeline,
    to_json,
    to_markdown,
    to_rich,
)
from saga.escalations.document import attempt_errors
from saga.model import CompensationState, RunState, StepState, ToolClass
from saga.picture import CompensationRecord, RunPicture, StepRecord
from saga.records import EscalationRecord, RunRecord
from saga.rules import REASON_AFTER_PIVOT, REASON_COMPENSATION_FAILED, not_undone

RUN = "run-4921"
CREATED = 1_700_000_000.0
ESCALATION_KEYS = {
    "schema_version",
    "kind",
    "escalation_id",
    "run_id",
    "generation",
    "created_at",
    "open",
    "resolution",
    "why",
    "cause",
    "run",
    "moved_on",
    "stack",
    "failed_compensations",
    "live",
    "requeueable",
    "commands",
}
RUN_KEYS = {
    "run_id",
    "state",
    "reason",
    "cause",
    "pivot_step",
    "generation",
    "created_at",
    "ended_at",
    "agent",
    "steps",
    "stack",
    "compensations",
    "live",
    "questions",
    "source",
}


def undo(step: int, tool: str, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "step": step,
        "idempotency_key": f"{RUN}:{step}:undo",
        "tool": tool,
        "args": args,
        "description": f"{tool} for step {step}",
    }


CREDIT_UNDO = undo(2, "reverse_credit", {"credit_id": "cr_9104_1"})
STATUS_UNDO = undo(3, "set_ticket_status", {"ticket_id": 9104, "status": "open"})


def seed_steps(last: StepState = StepState.FAILED) -> list[StepRecord]:
    """The seed's run: read, credit, status, then the reply (failed unless said otherwise)."""
    reply_error = {"type": "ServiceUnavailableError", "message": "mail is down"}
    return [
        StepRecord(
            1,
            "get_order",
            ToolClass.READ,
            {"order_id": 4921},
            StepState.SUCCEEDED,
            1,
            {"total": 499900},
        ),
        StepRecord(
            2,
            "issue_credit",
            ToolClass.COMPENSATABLE_WRITE,
            {"order_id": 4921, "amount_cents": 250000},
            StepState.SUCCEEDED,
            1,
            {"credit_id": "cr_9104_1"},
        ),
        StepRecord(
            3,
            "set_ticket_status",
            ToolClass.REVERSIBLE_WRITE,
            {"ticket_id": 9104, "status": "pending_refund"},
            StepState.SUCCEEDED,
            1,
            {"ticket_id": 9104, "previous": "open"},
        ),
        StepRecord(
            4,
            "send_reply",
            ToolClass.IRREVERSIBLE_WRITE,
            {"to": "ada@example.com"},
            last,
            3 if last is StepState.FAILED else 1,
            None if last is StepState.FAILED else {"message_id": "m1"},
            reply_error if last is StepState.FAILED else None,
        ),
    ]


def failed_status_undo(attempts: int = 3) -> CompensationRecord:
    errors = [
        {
            "error": {
                "type": "ServiceUnavailableError",
                "message": "tickets is down",
                "attempt": n,
            },
            "at": f"{CREATED + 40 + n:.6f}",
        }
        for n in range(1, attempts + 1)
    ]
    return CompensationRecord(
        3,
        STATUS_UNDO,
        CompensationState.FAILED,
        attempts,
        errors[-1]["error"],
        CREATED + 50,
        errors=errors,
    )


def escalated_picture() -> RunPicture:
    """Compensation failed: the credit was reversed, the ticket could not be restored."""
    return RunPicture(
        RUN,
        RunState.ESCALATED,
        REASON_COMPENSATION_FAILED,
        None,
        seed_steps(),
        [STATUS_UNDO],
        [
            failed_status_undo(),
            CompensationRecord(2, CREDIT_UNDO, CompensationState.DONE, 1, None, CREATED + 51),
        ],
        CREATED,
        CREATED + 52,
        extra={"generation": "0"},
        cause="step 4 failed",
    )


def past_pivot_picture() -> RunPicture:
    steps = [*seed_steps(StepState.SUCCEEDED)]
    steps.append(
        StepRecord(
            5,
            "notify_webhook",
            ToolClass.IRREVERSIBLE_WRITE,
            {"url": "u"},
            StepState.FAILED,
            3,
            error={"type": "E", "message": "webhook is down"},
        )
    )
    pending = [
        CompensationRecord(2, CREDIT_UNDO, CompensationState.PENDING, 0),
        CompensationRecord(3, STATUS_UNDO, CompensationState.PENDING, 0),
    ]
    return RunPicture(
        RUN,
        RunState.ESCALATED,
        REASON_AFTER_PIVOT,
        4,
        steps,
        [CREDIT_UNDO, STATUS_UNDO],
        pending,
        CREATED,
        CREATED + 9,
        extra={"generation": "0"},
        cause="step 5 failed",
    )


def record_of(picture: RunPicture, *, resolved: bool = False) -> EscalationRecord:
    """What ``RecordStore.record_outcome`` writes for this picture."""
    failed = [
        {
            "step": c.step,
            "undo": c.entry,
            "attempts": c.attempts,
            "error": c.error,
            "state": c.state.value,
            "history": c.history,
            "errors": c.errors,
        }
        for c in picture.compensations
        if c.state is CompensationState.FAILED
    ]
    steps = [
        {**vars(s), "tool_class": int(s.tool_class), "state": s.state.value} for s in picture.steps
    ]
    return EscalationRecord(
        escalation_id=f"{picture.run_id}:{picture.generation}",
        run_id=picture.run_id,
        reason=picture.reason,
        cause=picture.cause,
        created_at=datetime.fromtimestamp(CREATED + 60, UTC),
        steps_done=[s for s in steps if s["state"] == "succeeded"],
        stack=picture.stack,
        failed_compensations=failed,
        not_undone=not_undone(picture),
        resolved=resolved,
        resolution="resolved by ada: refunded by hand" if resolved else "",
    )


def run_record_of(picture: RunPicture, state: str | None = None) -> RunRecord:
    return RunRecord(
        run_id=picture.run_id,
        state=state or picture.state.value,
        reason=picture.reason,
        created_at=datetime.fromtimestamp(CREATED),  # naive, as SQLite hands it back
        ended_at=datetime.fromtimestamp(CREATED + 52, UTC),
        steps=[
            {**vars(s), "tool_class": int(s.tool_class), "state": s.state.value}
            for s in picture.steps
        ],
    )


def card_text(renderable: Any) -> str:
    console = Console(file=io.StringIO(), width=140, color_system=None)
    console.print(renderable, crop=False)
    return console.file.getvalue()  # type: ignore[attr-defined]


# -- the document ------------------------------------------------------------------------------


def test_the_package_has_the_versioned_shape() -> None:
    """The top-level and run keys are the schema's, version 1: scripts may rely on them."""
    picture = escalated_picture()
    package = escalation_package(record_of(picture), picture)
    assert (package["schema_version"], package["kind"]) == (SCHEMA_VERSION, "saga.escalation")
    assert SCHEMA_VERSION == 1
    assert set(package) == ESCALATION_KEYS
    assert set(package["run"]) == RUN_KEYS
    assert set(run_json(package["run"])) == RUN_KEYS | {"schema_version", "kind"}
    assert json.loads(to_json(package)) == package


def test_each_step_has_class_arguments_result_and_attempts() -> None:
    package = escalation_package(record_of(escalated_picture()), escalated_picture())
    credit = package["run"]["steps"][1]
    assert (credit["tool"], credit["tool_class"], credit["class_name"]) == (
        "issue_credit",
        4,
        "compensatable write",
    )
    assert credit["args"] == {"order_id": 4921, "amount_cents": 250000}
    assert credit["result"] == {"credit_id": "cr_9104_1"} and credit["attempts"] == 1
    assert credit["undo"] is not None and credit["undo"]["args"] == {"credit_id": "cr_9104_1"}
    reply = package["run"]["steps"][3]
    assert (reply["state"], reply["attempts"], reply["error"]["message"]) == (
        "failed",
        3,
        "mail is down",
    )


def test_a_failed_compensation_lists_every_attempts_error() -> None:
    package = escalation_package(record_of(escalated_picture()), escalated_picture())
    [failed] = package["failed_compensations"]
    assert failed["step"] == 3 and failed["undo"] is not None
    assert failed["undo"]["idempotency_key"] == f"{RUN}:3:undo"
    assert [(e["attempt"], e["message"]) for e in failed["errors"]] == [
        (1, "tickets is down"),
        (2, "tickets is down"),
        (3, "tickets is down"),
    ]
    assert failed["errors"][0]["at"] == "2023-11-14T22:14:01+00:00"
    assert package["stack"][0]["args"] == {"ticket_id": 9104, "status": "open"}
    assert [(i["tool"], i["why"]) for i in package["live"]] == [
        ("set_ticket_status", "its compensation failed")
    ]


def test_older_records_give_each_rounds_last_error() -> None:
    """Escalations recorded before every attempt's error was kept still show what they have."""
    history = [{"attempts": 3, "error": '{"type":"E","message":"down","attempt":3}', "at": "1.0"}]
    errors = attempt_errors([], history, {"type": "E", "message": "still down", "attempt": 6}, 2.0)
    assert [(e["attempt"], e["message"], e["at"]) for e in errors] == [
        (3, "down", "1970-01-01T00:00:01+00:00"),
        (6, "still down", "1970-01-01T00:00:02+00:00"),
    ]


@pytest.mark.parametrize(
    ("reason", "cause", "kind", "also"),
    [
        (REASON_COMPENSATION_FAILED, "step 4 failed", "compensation_failed", []),
        (REASON_AFTER_PIVOT, "step 5 failed", "after_pivot", []),
        ("step 2 (issue_credit) in doubt: no lookup", "step 2 in doubt", "in_doubt", []),
        (
            "an effect landed after the run ended",
            "step 2 landed after the run ended",
            "late_landing",
            [],
        ),
        ("the reaper could not handle this run", "KeyError: 'state'", "unhandled", []),
        (
            REASON_AFTER_PIVOT,
            "aborted: abandoned: no progress for 901s",
            "after_pivot",
            ["deadline"],
        ),
        (
            REASON_COMPENSATION_FAILED,
            "step 3 landed after the run ended compensated",
            "compensation_failed",
            ["late_landing"],
        ),
        ("something new", "", "other", []),
    ],
)
def test_why_names_the_verdict_first_and_what_else_applies(
    reason: str, cause: str, kind: str, also: list[str]
) -> None:
    why = classify(reason, cause)
    assert (why["kind"], why["also"], why["reason"]) == (kind, also, reason)
    assert why["summary"]


def test_commands_follow_what_can_be_done() -> None:
    # Given a compensation failure (requeueable), the same resolved, and one past the pivot
    picture = escalated_picture()
    requeueable = escalation_package(
        record_of(picture), picture, command="saga --app my.app:saga", corrections=True
    )
    resolved = escalation_package(record_of(picture, resolved=True), picture)
    pivot = escalation_package(record_of(past_pivot_picture()), past_pivot_picture())

    # Then each offers exactly the commands that apply, with the invocation it was given
    assert requeueable["requeueable"] is True
    assert requeueable["commands"] == {
        "show": f"saga --app my.app:saga show {RUN}",
        "requeue": f"saga --app my.app:saga requeue {RUN}",
        "requeue_with_correction": f"saga --app my.app:saga requeue {RUN} --set 3.ticket_id=VALUE",
        "resolve": f"saga --app my.app:saga resolve {RUN}:0 --note 'what was done, and by whom'",
        "answer_reversal": [],
    }
    assert resolved["commands"]["requeue"] is resolved["commands"]["resolve"] is None
    assert (resolved["open"], resolved["resolution"]) == (
        False,
        "resolved by ada: refunded by hand",
    )
    assert pivot["requeueable"] is False and pivot["commands"]["requeue"] is None
    assert pivot["commands"]["requeue_with_correction"] is None
    assert pivot["why"]["kind"] == "after_pivot"


def test_a_run_escalated_before_its_record_was_written_has_a_package() -> None:
    package = escalation_package(None, escalated_picture())
    assert package["escalation_id"] == f"{RUN}:0" and package["open"] is True
    assert [c["step"] for c in package["failed_compensations"]] == [3]
    with pytest.raises(ValueError, match="escalated run"):
        escalation_package(None, None)


def test_a_requeued_run_says_it_moved_on() -> None:
    picture = escalated_picture()
    later = RunPicture(**{**vars(picture), "state": RunState.COMPENSATED, "reason": ""})
    assert escalation_package(record_of(picture), later)["moved_on"] == "the run is compensated now"
    again = RunPicture(**{**vars(picture), "extra": {"generation": "1"}})
    assert "escalated again" in escalation_package(record_of(picture), again)["moved_on"]


def test_from_the_records_alone_the_unwind_is_inferred() -> None:
    """Once the Redis keys expired: steps from the run record, undos from the escalation."""
    picture = escalated_picture()
    escalated = run_document_from_records(run_record_of(picture), [record_of(picture)])
    assert escalated["source"] == "database" and escalated["pivot_step"] is None
    assert escalated["created_at"] == "2023-11-14T22:13:20+00:00"  # a naive time is UTC
    comps = {c["step"]: c for c in escalated["compensations"]}
    assert (comps[3]["state"], comps[3]["recorded"], len(comps[3]["errors"])) == ("failed", True, 3)
    assert (comps[2]["state"], comps[2]["recorded"]) == ("done", False)  # left the stack
    compensated = run_document_from_records(run_record_of(picture, "compensated"), [])
    assert {c["state"] for c in compensated["compensations"]} == {"done"}
    pivot = past_pivot_picture()
    past = run_document_from_records(run_record_of(pivot), [record_of(pivot)])
    assert past["pivot_step"] == 4
    assert {c["state"] for c in past["compensations"]} == {"pending"}


# -- the timeline ------------------------------------------------------------------------------


def _lines(picture: RunPicture) -> list[str]:
    return plain(timeline(run_document(picture))).splitlines()


def test_the_timeline_draws_the_seed() -> None:
    """Forward steps with classes and pushes, the pivot line before the first class 5 step,
    the unwind newest first with ✓/✗, and how the run ended."""
    lines = _lines(escalated_picture())
    assert "FORWARD" in lines[0] and "COMPENSATION STACK" in lines[0]
    forward = [line for line in lines if re.match(r"\s+[①②③④] \w+\(", line) and "class" in line]
    assert [line.split()[1].split("(")[0] for line in forward] == [
        "get_order",
        "issue_credit",
        "set_ticket_status",
        "send_reply",
    ]
    assert "class ④ ✓  push: reverse_credit(credit_id='cr_9104_1')" in forward[1]
    assert "class ① ✓  (nothing: reads need no undo)" in forward[0]
    assert "✗  FAILS after 3 attempt(s): mail is down" in forward[3]
    pivot = next(i for i, line in enumerate(lines) if " PIVOT " in line)
    assert "③" in lines[pivot - 1] and "④" in lines[pivot + 1]
    unwind = lines[lines.index("   UNWIND (reverse order)") + 1 :]
    assert (
        unwind[0].startswith("   ③ set_ticket_status") and "✗  (3 attempt(s): tickets" in unwind[0]
    )
    assert unwind[1].startswith("   ② reverse_credit") and "✓" in unwind[1]
    assert unwind[2].startswith("   ① —") and "✓" in unwind[2]
    assert unwind[3] == "   → run ends escalated (compensation failed)"


def test_past_the_pivot_nothing_is_unwound() -> None:
    lines = _lines(past_pivot_picture())
    assert any("PIVOT (step 4)" in line for line in lines)
    start = lines.index("   past the pivot (step 4): nothing is unwound")
    assert [line.split()[1].split("(")[0] for line in lines[start + 1 : start + 3]] == [
        "reverse_credit",
        "set_ticket_status",
    ]
    assert all("not run: on the stack" in line for line in lines[start + 1 : start + 3])
    assert "UNWIND (reverse order)" not in "\n".join(lines)


def test_a_completed_or_running_run_has_no_unwind() -> None:
    done = RunPicture(**{**vars(past_pivot_picture()), "state": RunState.COMPLETED, "reason": ""})
    text = plain(timeline(run_document(done)))
    assert "UNWIND" not in text and "past the pivot" not in text
    assert text.endswith("→ run ends completed")
    running = RunPicture(**{**vars(done), "state": RunState.RUNNING, "ended": None})
    assert plain(timeline(run_document(running))).endswith("→ run is running")


def test_every_step_state_has_its_mark() -> None:
    steps = [
        StepRecord(
            1, "a", ToolClass.COMPENSATABLE_WRITE, {}, StepState.IN_DOUBT, 2, reconciled="unknown"
        ),
        StepRecord(
            2,
            "b",
            ToolClass.READ,
            {},
            StepState.REJECTED,
            1,
            error={"type": "ToolRejected", "message": "too much"},
        ),
        StepRecord(3, "c", ToolClass.READ, {}, StepState.SKIPPED, 0),
        StepRecord(4, "d", ToolClass.READ, {}, StepState.RUNNING, 1),
    ]
    picture = RunPicture(
        RUN, RunState.UNWINDING, "step 1 in doubt", None, steps, [], [], CREATED, None
    )
    lines = _lines(picture)
    assert "?  IN DOUBT after 2 attempt(s) (lookup: unknown)" in lines[2]
    assert "·  refused, told to the agent: too much" in lines[3]
    assert "·  never ran" in lines[4]
    assert "…  running" in lines[5]
    assert lines[-1] == "   → run is unwinding"


def test_an_undo_that_could_not_be_built_is_shown_as_such() -> None:
    broken = {
        **CREDIT_UNDO,
        "tool": "",
        "args": {},
        "broken": True,
        "description": "cannot undo step 2 (issue_credit): KeyError",
    }
    picture = RunPicture(
        RUN,
        RunState.ESCALATED,
        REASON_COMPENSATION_FAILED,
        None,
        seed_steps()[:2],
        [broken],
        [
            CompensationRecord(
                2,
                broken,
                CompensationState.FAILED,
                0,
                {"type": "CompensationBuildError", "message": "cannot undo"},
            )
        ],
        CREATED,
        CREATED + 1,
    )
    lines = _lines(picture)
    assert "push failed: cannot undo step 2 (issue_credit): KeyError" in lines[3]
    package = escalation_package(None, picture)
    assert package["stack"][0]["broken"] is True
    assert package["failed_compensations"][0]["errors"][0]["type"] == "CompensationBuildError"


# -- the renderers say the same ----------------------------------------------------------------


def test_markdown_has_every_section_and_the_same_timeline() -> None:
    picture = escalated_picture()
    package = escalation_package(record_of(picture), picture)
    markdown = to_markdown(package)
    headings = [line for line in markdown.splitlines() if line.startswith("#")]
    assert headings == [
        f"## Escalation `{RUN}:0`: compensation failed",
        "### Timeline",
        "### Steps",
        "### Stack (captured references)",
        "### Failed compensations",
        "#### Step 3: `set_ticket_status(ticket_id=9104, status='open')`",
        "### Still live in the world",
        "### Commands",
    ]
    assert f"```text\n{plain(timeline(package['run']))}\n```" in markdown
    assert f"saga requeue {RUN}  # once the cause is fixed" in markdown
    assert markdown.count("| ServiceUnavailableError | tickets is down |") == 3


def test_markdown_cells_cannot_break_the_table() -> None:
    picture = escalated_picture()
    odd = RunPicture(**{**vars(picture), "cause": "a | b\nc"})
    steps = [*odd.steps]
    steps[0] = StepRecord(
        1,
        "get_order",
        ToolClass.READ,
        {"note": "x|y"},
        StepState.SUCCEEDED,
        1,
        {"text": "long " * 100},
    )
    odd = RunPicture(**{**vars(odd), "steps": steps})
    markdown = to_markdown(escalation_package(record_of(odd), odd))
    row = next(line for line in markdown.splitlines() if line.startswith("| 1 |"))
    assert "x\\|y" in row and row.count(" | ") == 6
    assert "…" in row


def test_the_card_draws_the_same_timeline_and_every_part() -> None:
    picture = escalated_picture()
    package = escalation_package(record_of(picture), picture)
    text = card_text(to_rich(package))
    assert f"ESCALATION {RUN}:0 · open" in text
    for line in plain(timeline(package["run"])).splitlines():
        assert line in text
    for part in ("Steps", "Stack (captured references)", "Still live in the world", "Commands"):
        assert part in text
    assert text.count("ServiceUnavailableError: tickets is down") == 3
    assert f"saga requeue {RUN}" in text
    shown = card_text(run_card(run_document(picture)))
    assert plain(timeline(run_document(picture))).splitlines()[2] in shown


def test_json_keeps_text_as_written() -> None:
    picture = escalated_picture()
    odd = RunPicture(**{**vars(picture), "cause": "Zoë’s refund — ✓ 退款"})
    assert "Zoë’s refund — ✓ 退款" in to_json(escalation_package(record_of(odd), odd))


def test_the_package_modules_need_no_celery() -> None:
    """The documents and renderers are plain Python (the CLI and the demo wire Celery)."""
    folder = Path(__file__).resolve().parents[2] / "saga" / "escalations"
    for module in folder.glob("*.py"):
        assert not re.search(r"^\s*(import|from)\s+celery\b", module.read_text(), re.M), module


# -- a person decides before a costly reversal ----------------------------------------------


ASKED_UNDO = {**CREDIT_UNDO, "ask": True, "ask_why": "costly(args, result) was true for this step"}


def _not_answered_picture() -> RunPicture:
    """The credit's question expired unanswered: its undo failed (``NotAnswered``)."""
    error = {
        "type": "NotAnswered",
        "message": "a person was asked whether to reverse it, "
        "and did not answer by 1764930000.000000",
    }
    failed = CompensationRecord(
        2,
        ASKED_UNDO,
        CompensationState.FAILED,
        0,
        error,
        CREATED + 50,
        errors=[{"error": error, "at": f"{CREATED + 50:.6f}"}],
    )
    done = CompensationRecord(3, STATUS_UNDO, CompensationState.DONE, 1, None, CREATED + 40)
    return RunPicture(
        RUN,
        RunState.ESCALATED,
        REASON_COMPENSATION_FAILED,
        None,
        seed_steps(),
        [ASKED_UNDO],
        [failed, done],
        CREATED,
        CREATED + 52,
        extra={"generation": "0"},
        cause="aborted: the customer cancelled",
    )


def _asked_again_picture() -> RunPicture:
    """The same run requeued: its unwind asks the question again (generation 1)."""
    asked = CompensationRecord(
        2,
        ASKED_UNDO,
        CompensationState.ASKED,
        0,
        ask_expires=CREATED + 3600,
        ask_hash="ab" * 20,
        asked_at=CREATED + 60,
        decisions=[{"decision": "later", "by": "ada", "note": "", "at": "1"}],
    )
    picture = _not_answered_picture()
    return RunPicture(
        RUN,
        RunState.UNWINDING,
        "",
        None,
        picture.steps,
        [ASKED_UNDO],
        [asked, picture.compensations[1]],
        CREATED,
        None,
        extra={"generation": "1"},
        cause=picture.cause,
    )


def test_an_escalation_names_the_question_nobody_answered() -> None:
    picture = _not_answered_picture()
    package = escalation_package(record_of(picture), picture)
    assert package["why"]["kind"] == "compensation_failed"
    assert package["why"]["also"] == ["unanswered"]
    markdown = to_markdown(package)
    assert "**Asked and not answered:** step 2: reverse_credit" in markdown
    assert "a requeue asks the question again" in markdown
    console = Console(record=True, width=300, color_system=None, file=io.StringIO())
    console.print(to_rich(package))
    assert "Asked and not answered: step 2" in console.export_text()


def test_the_card_shows_the_question_a_run_waits_at_and_the_commands_answering_it() -> None:
    # Given the escalated run, requeued, waiting at the same question again
    record = record_of(_not_answered_picture())
    package = escalation_package(record, _asked_again_picture(), command="saga --app m:saga")
    [question] = package["run"]["questions"]
    assert (question["tool"], question["args_hash"]) == ("reverse_credit", "ab" * 20)
    assert question["why"] == "costly(args, result) was true for this step"
    assert question["until"] == datetime.fromtimestamp(CREATED + 3600, UTC).isoformat(
        timespec="seconds"
    )
    [answer] = package["commands"]["answer_reversal"]
    assert answer == {
        "step": 2,
        "show": f"saga --app m:saga reversal {RUN}",
        "reverse": f"saga --app m:saga reversal {RUN} 2 --reverse --hash {'ab' * 20}",
        "keep": f"saga --app m:saga reversal {RUN} 2 --keep --note 'why it stays, for the books' "
        f"--hash {'ab' * 20}",
        "later": f"saga --app m:saga reversal {RUN} 2 --later --hash {'ab' * 20}",
        "api": answer["api"],
    }
    assert f"/api/runs/{RUN}/reversals/2" in answer["api"] and '"args_hash"' in answer["api"]
    # Then the card and the Markdown show it, with every command whole
    console = Console(record=True, width=400, color_system=None, file=io.StringIO())
    console.print(to_rich(package))
    card = console.export_text()
    assert "A PERSON DECIDES" in card and "earlier: later by ada" in card
    assert all(
        c in card for c in (answer["reverse"], answer["keep"], answer["later"], answer["api"])
    )
    markdown = to_markdown(package)
    assert "### A person decides: reverse step 2?" in markdown
    assert f"- **Hash:** `{'ab' * 20}`" in markdown and answer["keep"] in markdown
