"""Runs and escalations recorded for people, on SQLite and on PostgreSQL.

Every test runs on both databases: a file in ``tmp_path`` for SQLite, a schema of its own
(dropped afterwards) for PostgreSQL.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, func, inspect, select, text

from saga.errors import StaleRecordError
from saga.model import CompensationState, RunState, StepState, ToolClass
from saga.records import EscalationRecord, RecordStore, RunRecord
from saga.rules import REASON_AFTER_PIVOT, REASON_COMPENSATION_FAILED
from saga.stack import CompensationRecord, RunPicture, StepRecord
from saga.validation import RUN_ID_MAX_LENGTH, check_run_id
from tests.conftest import POSTGRES_URL, postgres_schema

CREATED = 1_700_000_000.25
ENDED = 1_700_000_042.5

UNICODE_NOTE = "Zoë’s refund — ✓ 退款 🧾"
NESTED: dict[str, Any] = {
    "note": UNICODE_NOTE,
    "lines": [{"sku": "A-1", "qty": 2, "tags": ["gift", "ñ"]}, {"sku": "B-2", "qty": 1}],
    "meta": {"deep": {"deeper": [1, 2.5, None, True, False, {"k": "√"}]}},
}


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def records(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RecordStore]:
    """A RecordStore on an empty database of this test's own."""
    if request.param == "sqlite":
        store = RecordStore(f"sqlite:///{tmp_path / 'records.db'}")
        yield store
        store.dispose()
        return

    with postgres_schema("t") as (schema, url):
        store = RecordStore(url)
        admin = create_engine(POSTGRES_URL, connect_args={"connect_timeout": 5})
        try:
            # the tables went into this test's schema, not into public
            assert {"saga_runs", "saga_escalations"} <= set(
                inspect(admin).get_table_names(schema=schema)
            )
            yield store
        finally:
            store.dispose()
            admin.dispose()


# -- pictures built by hand ----------------------------------------------------------------


def step(
    number: int,
    tool: str,
    tool_class: ToolClass,
    state: StepState = StepState.SUCCEEDED,
    *,
    args: dict[str, Any] | None = None,
    result: Any = None,
    error: dict[str, Any] | None = None,
) -> StepRecord:
    return StepRecord(
        step=number,
        tool=tool,
        tool_class=tool_class,
        args=args if args is not None else {"order_id": 4921},
        state=state,
        attempts=1,
        result=result,
        error=error,
    )


def undo_entry(run_id: str, number: int, tool: str, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "step": number,
        "idempotency_key": f"{run_id}:{number}:undo",
        "tool": tool,
        "args": args,
        "description": f"{tool} for step {number}",
    }


def picture(
    run_id: str,
    steps: list[StepRecord],
    *,
    state: RunState = RunState.UNWINDING,
    reason: str = "",
    pivot_step: int | None = None,
    stack: list[dict[str, Any]] | None = None,
    compensations: list[CompensationRecord] | None = None,
    ended: float | None = ENDED,
    generation: str = "0",
    **more: Any,
) -> RunPicture:
    return RunPicture(
        run_id=run_id,
        state=state,
        reason=reason,
        pivot_step=pivot_step,
        steps=steps,
        stack=stack or [],
        compensations=compensations or [],
        created=CREATED,
        ended=ended,
        extra={"owner": "step:4", "sent": "1", "generation": generation},
        **more,
    )


def failed_compensation_picture(run_id: str, generation: str = "0", **more: Any) -> RunPicture:
    """The seed's run: credit and status undone partly; the credit reversal failed."""
    credit = undo_entry(run_id, 2, "reverse_credit", {"credit_id": "cr_9104_1"})
    status = undo_entry(run_id, 3, "set_ticket_status", {"ticket_id": 9104, "status": "open"})
    return picture(
        run_id,
        [
            step(1, "get_order", ToolClass.READ, result={"order_id": 4921}),
            step(2, "issue_credit", ToolClass.COMPENSATABLE_WRITE, result={"id": "cr_9104_1"}),
            step(3, "set_ticket_status", ToolClass.REVERSIBLE_WRITE, result={"was": "open"}),
            step(
                4,
                "send_reply",
                ToolClass.IRREVERSIBLE_WRITE,
                StepState.FAILED,
                error={"type": "SMTPError", "message": "mail service down"},
            ),
        ],
        reason="step 4 failed",
        stack=[credit],
        compensations=[
            CompensationRecord(
                step=2,
                entry=credit,
                state=CompensationState.FAILED,
                attempts=5,
                error={"type": "HTTPError", "message": "billing 503"},
            ),
            CompensationRecord(step=3, entry=status, state=CompensationState.DONE, attempts=1),
        ],
        generation=generation,
        **more,
    )


def as_utc(moment: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes (stored as UTC); PostgreSQL aware ones."""
    if moment is None:
        return None
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def count(records: RecordStore, model: type[RunRecord] | type[EscalationRecord]) -> int:
    with records.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(model)).scalar_one())


# -- runs ----------------------------------------------------------------------------------


def test_recorded_run_is_read_back(records: RecordStore) -> None:
    """``record_run`` then ``run()`` gives the state, reason, times and every step."""
    # Given a completed run of two steps
    run_id = uuid.uuid4().hex
    run = picture(
        run_id,
        [
            step(1, "get_order", ToolClass.READ, result={"order_id": 4921}),
            step(
                2,
                "set_priority",
                ToolClass.CONVERGENT_WRITE,
                StepState.FAILED,
                args={"priority": "high"},
                error={"type": "Timeout", "message": "slow"},
            ),
        ],
        state=RunState.COMPLETED,
    )

    # When it is recorded
    records.record_run(run, RunState.COMPLETED.value, "done by agent")
    stored = records.run(run_id)

    # Then it reads back as written
    assert stored is not None
    assert (stored.run_id, stored.state, stored.reason) == (run_id, "completed", "done by agent")
    assert as_utc(stored.created_at) == datetime.fromtimestamp(CREATED, UTC)
    assert as_utc(stored.ended_at) == datetime.fromtimestamp(ENDED, UTC)
    assert stored.steps == [
        {
            "step": 1,
            "tool": "get_order",
            "tool_class": 1,
            "args": {"order_id": 4921},
            "state": "succeeded",
            "attempts": 1,
            "result": {"order_id": 4921},
            "error": None,
            "reconciled": "",
            "started": None,
            "lease": None,
            "landed": "",
            "call": "",
        },
        {
            "step": 2,
            "tool": "set_priority",
            "tool_class": 2,
            "args": {"priority": "high"},
            "state": "failed",
            "attempts": 1,
            "result": None,
            "error": {"type": "Timeout", "message": "slow"},
            "reconciled": "",
            "started": None,
            "lease": None,
            "landed": "",
            "call": "",
        },
    ]
    assert records.run(uuid.uuid4().hex) is None


def test_run_without_an_end_time_is_stamped_now(records: RecordStore) -> None:
    """A picture read before the end was stamped gets the time of recording."""
    run_id = uuid.uuid4().hex
    before = time.time()

    records.record_run(picture(run_id, [], ended=None), "escalated", "x")

    stored = records.run(run_id)
    assert stored is not None
    ended = as_utc(stored.ended_at)
    assert ended is not None
    assert before - 1 <= ended.timestamp() <= time.time() + 1


def test_writing_the_same_run_twice_is_an_upsert(records: RecordStore) -> None:
    """A redelivered conclusion rewrites the one row, holding the latest state."""
    run_id = uuid.uuid4().hex
    other = uuid.uuid4().hex
    first = picture(run_id, [step(1, "get_order", ToolClass.READ)])
    later = picture(
        run_id,
        [
            step(1, "get_order", ToolClass.READ),
            step(2, "issue_credit", ToolClass.COMPENSATABLE_WRITE),
        ],
    )

    records.record_run(first, "unwinding", "step 2 failed")
    records.record_run(picture(other, []), "completed", "")
    records.record_run(later, "escalated", REASON_COMPENSATION_FAILED)

    assert count(records, RunRecord) == 2
    stored = records.run(run_id)
    assert stored is not None
    assert (stored.state, stored.reason) == ("escalated", REASON_COMPENSATION_FAILED)
    assert [s["step"] for s in stored.steps] == [1, 2]
    assert records.run(other).state == "completed"  # type: ignore[union-attr]


def test_run_json_round_trips_nested_values_and_unicode(records: RecordStore) -> None:
    """Arguments and results come back exactly: nesting, null/bool, floats and unicode."""
    run_id = uuid.uuid4().hex
    run = picture(
        run_id,
        [step(1, "issue_credit", ToolClass.COMPENSATABLE_WRITE, args=NESTED, result=[NESTED])],
        reason=UNICODE_NOTE,
    )

    records.record_run(run, "compensated", UNICODE_NOTE)

    stored = records.run(run_id)
    assert stored is not None
    assert stored.reason == UNICODE_NOTE
    assert stored.steps[0]["args"] == NESTED
    assert stored.steps[0]["result"] == [NESTED]


# -- escalations ---------------------------------------------------------------------------


def test_escalation_holds_the_whole_picture(records: RecordStore) -> None:
    """Steps done (succeeded only), the stack, the failed undos with error and attempts, and
    what is still live, each with why."""
    # Given a run whose credit reversal failed after the reply could not be sent
    run_id = uuid.uuid4().hex
    run = failed_compensation_picture(run_id)

    # When it is escalated
    returned = records.record_escalation(run, REASON_COMPENSATION_FAILED)
    [stored] = records.escalations(run_id)

    # Then the stored record holds the whole picture
    for record in (returned, stored):
        assert record.escalation_id == f"{run_id}:0"
        assert record.run_id == run_id
        assert record.reason == REASON_COMPENSATION_FAILED
        assert record.resolved is False
        assert [s["step"] for s in record.steps_done] == [1, 2, 3]
        assert {s["state"] for s in record.steps_done} == {"succeeded"}
        assert record.steps_done[1]["result"] == {"id": "cr_9104_1"}
        assert record.stack == run.stack
        assert record.failed_compensations == [
            {
                "step": 2,
                "undo": run.stack[0],
                "attempts": 5,
                "error": {"type": "HTTPError", "message": "billing 503"},
                "state": "failed",
                "history": [],
                "errors": [],
            }
        ]
        assert record.not_undone == [
            {
                "step": 2,
                "tool": "issue_credit",
                "result": {"id": "cr_9104_1"},
                "why": "its compensation failed",
            }
        ]
    assert as_utc(stored.created_at) is not None


def test_escalation_past_the_pivot_lists_what_was_never_unwound(records: RecordStore) -> None:
    """Past the pivot the undos never ran: they stay on the stack and are listed as live."""
    run_id = uuid.uuid4().hex
    credit = undo_entry(run_id, 1, "reverse_credit", {"credit_id": "cr_1"})
    run = picture(
        run_id,
        [
            step(1, "issue_credit", ToolClass.COMPENSATABLE_WRITE, result={"id": "cr_1"}),
            step(2, "send_reply", ToolClass.IRREVERSIBLE_WRITE, result={"mail": "m_1"}),
            step(3, "set_priority", ToolClass.CONVERGENT_WRITE, StepState.FAILED),
        ],
        pivot_step=2,
        stack=[credit],
        compensations=[
            CompensationRecord(1, credit, CompensationState.PENDING, attempts=0),
        ],
    )

    record = records.record_escalation(run, REASON_AFTER_PIVOT)

    # the credit's undo never ran: it is on the stack and live, but it did not fail
    assert record.failed_compensations == []
    assert record.stack == [credit]
    assert [(n["step"], n["why"]) for n in records.escalations(run_id)[0].not_undone] == [
        (1, "not unwound: the run was past its pivot"),
        (2, "irreversible: cannot be undone"),
    ]


def test_the_same_escalation_written_twice_stays_one_row(records: RecordStore) -> None:
    """A redelivered conclusion upserts the escalation; a new generation is a new one."""
    run_id = uuid.uuid4().hex
    run = failed_compensation_picture(run_id)

    records.record_escalation(run, REASON_COMPENSATION_FAILED)
    records.record_escalation(run, "compensation failed (again)")

    assert count(records, EscalationRecord) == 1
    [only] = records.escalations(run_id)
    assert only.reason == "compensation failed (again)"

    records.record_escalation(failed_compensation_picture(run_id, "1"), REASON_COMPENSATION_FAILED)
    assert [e.escalation_id for e in records.escalations(run_id)] == [f"{run_id}:0", f"{run_id}:1"]


def test_the_longest_accepted_run_id_is_recorded(records: RecordStore) -> None:
    """R4: a run id of the full accepted length (128) fits the run and escalation rows on
    PostgreSQL too, with a requeue generation of many digits."""
    # Given the longest run id start_run accepts, escalated after many requeues
    run_id = check_run_id(("t-" + uuid.uuid4().hex * 4)[:RUN_ID_MAX_LENGTH])
    assert len(run_id) == RUN_ID_MAX_LENGTH
    generation = "9" * 31

    # When its run and escalation are recorded
    records.record_run(failed_compensation_picture(run_id), RunState.ESCALATED.value, "x")
    records.record_escalation(
        failed_compensation_picture(run_id, generation), REASON_COMPENSATION_FAILED
    )

    # Then both read back whole
    record = records.run(run_id)
    assert record is not None and record.run_id == run_id
    [escalation] = records.escalations(run_id)
    assert escalation.escalation_id == f"{run_id}:{generation}"


def test_every_run_id_column_holds_the_longest_accepted_run_id() -> None:
    """R4 again, for hosted runs: a transcript keyed by a 65-128 character run id must fit too
    (its row is written in the run's transaction: one that does not fit loses both)."""
    columns = [
        (table.name, table.c.run_id.type.length)
        for table in RunRecord.metadata.sorted_tables
        if "run_id" in table.c
    ]
    assert {name for name, _ in columns} >= {"saga_runs", "saga_escalations", "saga_transcripts"}
    assert all(length == RUN_ID_MAX_LENGTH for _, length in columns), columns


def test_open_escalations_and_resolving_them(records: RecordStore) -> None:
    """``resolve_escalations`` closes every escalation of one run, and only of that run."""
    # Given two runs escalated, the first twice (before and after a requeue)
    first, second = uuid.uuid4().hex, uuid.uuid4().hex
    records.record_escalation(failed_compensation_picture(first), REASON_COMPENSATION_FAILED)
    records.record_escalation(failed_compensation_picture(second), REASON_COMPENSATION_FAILED)
    records.record_escalation(failed_compensation_picture(first, "1"), REASON_COMPENSATION_FAILED)
    assert {e.escalation_id for e in records.escalations(open_only=True)} == {
        f"{first}:0",
        f"{second}:0",
        f"{first}:1",
    }

    # When the first run's escalations are resolved
    records.resolve_escalations(first)

    # Then only the second run's is open; all three are still there
    assert [e.escalation_id for e in records.escalations(open_only=True)] == [f"{second}:0"]
    assert records.escalations(first, open_only=True) == []
    everything = {e.escalation_id: e.resolved for e in records.escalations()}
    assert everything == {f"{first}:0": True, f"{first}:1": True, f"{second}:0": False}
    records.resolve_escalations(uuid.uuid4().hex)  # an unknown run is a no-op
    assert len(records.escalations(open_only=True)) == 1


def test_escalation_json_round_trips_nested_values_and_unicode(records: RecordStore) -> None:
    """The stack entries and results come back exactly as they went in."""
    run_id = uuid.uuid4().hex
    entry = undo_entry(run_id, 1, "reverse_credit", NESTED)
    run = picture(
        run_id,
        [step(1, "issue_credit", ToolClass.COMPENSATABLE_WRITE, args=NESTED, result=NESTED)],
        stack=[entry],
        compensations=[
            CompensationRecord(
                1, entry, CompensationState.FAILED, 3, error={"message": UNICODE_NOTE}
            )
        ],
    )

    records.record_escalation(run, UNICODE_NOTE)

    [stored] = records.escalations(run_id)
    assert stored.reason == UNICODE_NOTE
    assert stored.stack == [entry]
    assert stored.steps_done[0]["args"] == NESTED
    assert stored.failed_compensations[0]["undo"]["args"] == NESTED
    assert stored.failed_compensations[0]["error"] == {"message": UNICODE_NOTE}
    assert stored.not_undone[0]["result"] == NESTED


# -- what a requeue needs once the keys have expired ---------------------------------------


def escalated(run_id: str, **more: Any) -> RunPicture:
    """The seed's escalated run as its keys hold it when it is recorded."""
    values: dict[str, Any] = {
        "state": RunState.ESCALATED,
        "version": "17",
        "deadline": 900.0,
        "updated": ENDED,
        "cause": "step 4 failed",
        "recorded": True,
    }
    values.update(more)
    run = failed_compensation_picture(run_id, **values)
    return dataclasses.replace(run, reason=REASON_COMPENSATION_FAILED)


def test_the_outcome_holds_steps_compensations_and_what_rebuilding_takes(
    records: RecordStore,
) -> None:
    """Steps and undos become rows; the picture read back from SQL is the one recorded."""
    # Given an escalated run, recorded as it ended
    run_id = uuid.uuid4().hex
    run = escalated(run_id)

    # When its outcome is written
    records.record_outcome(run)

    # Then its steps and compensations are rows, the undo still on the stack marked so
    assert [(s.step, s.tool, s.state) for s in records.steps(run_id)] == [
        (1, "get_order", "succeeded"),
        (2, "issue_credit", "succeeded"),
        (3, "set_ticket_status", "succeeded"),
        (4, "send_reply", "failed"),
    ]
    assert [
        (c.step, c.state, c.attempts, c.stack_position) for c in records.compensations(run_id)
    ] == [
        (2, "failed", 5, 0),
        (3, "done", 1, None),
    ]
    # and the picture read back from SQL is the recorded one (times to the microsecond)
    back = records.picture(run_id)
    assert back is not None
    assert back == dataclasses.replace(run, created=back.created, updated=back.updated)
    assert (back.created, back.updated) == (pytest.approx(CREATED), pytest.approx(ENDED))
    assert back.stack[0]["idempotency_key"] == f"{run_id}:2:undo"


def test_a_record_without_what_rebuilding_takes_gives_no_picture(records: RecordStore) -> None:
    """A run written before the record held its version (or never written) cannot be rebuilt."""
    run_id = uuid.uuid4().hex
    records.record_run(picture(run_id, []), "escalated", "x")  # no version: an old record
    assert records.picture(run_id) is None
    assert records.picture(uuid.uuid4().hex) is None


def test_operator_actions_are_recorded_with_who_and_what(records: RecordStore) -> None:
    """A requeue (with its corrections) and a resolve kept in the run's keys become rows, oldest
    first; the resolve closes the escalation with the note, who and when."""
    # Given a run requeued once with a correction, escalated again, then resolved by hand
    run_id = uuid.uuid4().hex
    corrections = {"2": {"before": {"credit_id": "cr_1"}, "after": {"credit_id": "cr_2"}}}
    requeued = {"kind": "requeue", "generation": 1, "by": "alice", "at": CREATED + 60}
    run = escalated(
        run_id,
        generation="1",
        actions=({**requeued, "count": 1, "corrections": corrections},),
        resolution={
            "by": "bob",
            "note": UNICODE_NOTE,
            "escalation_id": f"{run_id}:1",
            "at": CREATED + 120,
        },
    )

    # When it is recorded (twice: a redelivered conclusion)
    records.record_outcome(run)
    records.record_outcome(run)

    # Then both actions are there, once each, oldest first
    actions = records.actions(run_id)
    assert [(a.kind, a.by, a.escalation_id, a.count) for a in actions] == [
        ("requeue", "alice", f"{run_id}:0", 1),
        ("resolve", "bob", f"{run_id}:1", 0),
    ]
    assert actions[0].corrections == corrections
    assert actions[1].note == UNICODE_NOTE
    assert as_utc(actions[1].at) == datetime.fromtimestamp(CREATED + 120, UTC)
    # and the escalation is closed by bob, with his note
    [escalation] = records.escalations(run_id)
    assert (escalation.resolved, escalation.resolved_by, escalation.resolution) == (
        True,
        "bob",
        UNICODE_NOTE,
    )
    assert as_utc(escalation.resolved_at) == datetime.fromtimestamp(CREATED + 120, UTC)


def test_compensated_after_a_requeue_closes_the_escalation_saying_by_whom(
    records: RecordStore,
) -> None:
    """The escalation a requeue dealt with is closed with the reason and the requeuer."""
    run_id = uuid.uuid4().hex
    records.record_outcome(escalated(run_id))
    action = {"kind": "requeue", "generation": 1, "by": "alice", "at": CREATED + 60, "count": 1}
    requeued = escalated(run_id, generation="1", actions=({**action, "corrections": {}},))
    undone = [dataclasses.replace(c, state=CompensationState.DONE) for c in requeued.compensations]
    done = dataclasses.replace(requeued, state=RunState.COMPENSATED, stack=[], compensations=undone)

    records.record_outcome(done)

    [escalation] = records.escalations(run_id)
    assert (escalation.resolved, escalation.resolution) == (
        True,
        "compensated after requeue by alice",
    )
    assert escalation.resolved_at is not None
    assert records.run(run_id).state == "compensated"  # type: ignore[union-attr]


def test_resolving_by_hand_in_sql_alone(records: RecordStore) -> None:
    """The reaper's escalation is closed with who and why, once; a second resolve says no."""
    run_id = uuid.uuid4().hex
    records.record_unreadable(run_id, "bad data in its keys")

    assert records.resolve_escalation(f"{run_id}:reaper", "cleaned up by hand", "carol")
    assert not records.resolve_escalation(f"{run_id}:reaper", "again", "dave")

    [escalation] = records.escalations(run_id)
    assert (escalation.resolved, escalation.resolved_by, escalation.resolution) == (
        True,
        "carol",
        "cleaned up by hand",
    )
    [action] = records.actions(run_id)
    assert (action.kind, action.by, action.action_id) == (
        "resolve",
        "carol",
        f"{run_id}:reaper:resolve",
    )


def test_runs_are_listed_newest_first_by_state_tool_agent_and_time(records: RecordStore) -> None:
    """The operator's list: filters combine, newest first, limited."""
    # Given three runs: an escalated one with a credit, a completed hosted one, an old one
    first, hosted, old = (uuid.uuid4().hex for _ in range(3))
    records.record_outcome(escalated(first))
    agent = {"name": "refund", "input": "Order 4921 arrived late.", "created": "1"}
    records.record_outcome(
        picture(hosted, [], state=RunState.COMPLETED, agent=agent, version="3", deadline=60.0)
    )
    records.record_run(
        dataclasses.replace(picture(old, []), created=CREATED - 86_400), "completed", ""
    )

    # Then each filter finds its runs
    assert [r.run_id for r in records.runs()] == [*sorted([first, hosted]), old]  # ties: by id
    assert [r.run_id for r in records.runs(state="escalated")] == [first]
    assert [r.run_id for r in records.runs(tool="issue_credit")] == [first]
    assert [r.run_id for r in records.runs(agent="refund")] == [hosted]
    since = datetime.fromtimestamp(CREATED - 10, UTC)
    assert {r.run_id for r in records.runs(since=since)} == {first, hosted}
    assert len(records.runs(limit=1)) == 1
    assert records.runs(state="completed", tool="issue_credit") == []
    assert records.transcript(hosted) is not None


def test_a_hosted_run_of_the_longest_run_id_keeps_its_transcript(records: RecordStore) -> None:
    """The transcript's run id column takes the 128 characters a run id may have."""
    run_id = ("t-" + uuid.uuid4().hex * 4)[:RUN_ID_MAX_LENGTH]
    agent = {"name": "refund", "input": "hi", "created": "1"}
    records.record_outcome(picture(run_id, [], state=RunState.COMPLETED, agent=agent, version="1"))
    transcript = records.transcript(run_id)
    assert transcript is not None and transcript.agent == "refund"


def _record_actions_at_once(url: str, barrier: Any, count: int, errors: Any) -> None:
    """One worker process: open the store at the barrier and record ``count`` actions."""
    from saga.records import ActionRecord

    barrier.wait(timeout=30)
    try:
        store = RecordStore(url)
        for _ in range(count):
            store.record_action(
                ActionRecord(
                    action_id=uuid.uuid4().hex,
                    run_id="run",
                    escalation_id="escalation",
                    kind="resolve",
                    by="ops",
                    at=datetime.now(UTC),
                    note="",
                    corrections={},
                    count=0,
                )
            )
        store.dispose()
    except Exception as exc:
        errors.put(f"{type(exc).__name__}: {exc}")


def test_processes_opening_a_new_sqlite_file_at_once_all_record(tmp_path: Path) -> None:
    """Turn workers recording their first runs at the same moment: every process opens its
    first connection together, and none is told "database is locked" (it was: all asked to
    switch the file to WAL, and SQLite refuses that at once while another connection reads)."""
    import multiprocessing

    url = f"sqlite:///{tmp_path / 'records.db'}"
    processes, count = 8, 20
    context = multiprocessing.get_context("spawn")
    barrier, errors = context.Barrier(processes), context.Queue()
    workers = [
        context.Process(target=_record_actions_at_once, args=(url, barrier, count, errors))
        for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert all(worker.exitcode == 0 for worker in workers)
    failures = [errors.get(timeout=1) for _ in range(errors.qsize())]
    assert failures == []
    engine = create_engine(url)
    with engine.connect() as connection:
        recorded = connection.scalar(text("SELECT count(*) FROM saga_actions"))
        mode = connection.scalar(text("PRAGMA journal_mode"))
    engine.dispose()
    assert (recorded, mode) == (processes * count, "wal")


def test_a_sqlite_record_is_on_disk_once_committed(tmp_path: Path) -> None:
    """A run's record in SQLite is synced at its commit (``synchronous=FULL`` on the WAL), so
    a power cut cannot take a record the store was told is written and expires keys after."""
    store = RecordStore(f"sqlite:///{tmp_path / 'records.db'}")
    try:
        with store.engine.connect() as connection:
            mode = connection.scalar(text("PRAGMA journal_mode"))
            synchronous = connection.scalar(text("PRAGMA synchronous"))
    finally:
        store.dispose()
    assert (mode, synchronous) == ("wal", 2)  # 2: FULL (1 would be NORMAL)


def test_a_stale_picture_never_writes_over_a_later_record(records: RecordStore) -> None:
    """A reaper that read the run escalated, then paused while a requeue compensated and
    recorded it, must not write its older story back (found by the model check)."""
    run_id = f"stale-{uuid.uuid4().hex[:8]}"
    escalated = failed_compensation_picture(run_id, version="7")
    done = [dataclasses.replace(c, state=CompensationState.DONE) for c in escalated.compensations]
    compensated = dataclasses.replace(
        escalated, state=RunState.COMPENSATED, version="9", compensations=done, stack=[]
    )
    records.record_outcome(compensated)

    with pytest.raises(StaleRecordError, match="version 7"):
        records.record_outcome(escalated)

    row = records.run(run_id)
    assert row is not None and (row.state, row.version) == ("compensated", 9)
    assert records.escalations(run_id) == []
    records.record_outcome(compensated)  # the same version again (a redelivery) is written
    unversioned = dataclasses.replace(escalated, version="")
    records.record_outcome(unversioned)  # a picture without a version (old data) is too
