"""An unwind's conclusion is made by its last compensation's task when nothing but the
conclusion is left of its chain (one Celery message fewer per unwind); the
``saga.conclude_unwind`` message is still sent whenever that conclusion cannot be made there.

Driven through the real scripts and worker functions with a captured broker
(``engine_harness``): each test delivers the unwind's messages one by one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from saga import RunPicture, RunState
from saga.constants import CONCLUDE_UNWIND_TASK
from saga.errors import StoreUnavailableError
from tests.integration.engine_harness import Harness, harness
from tests.integration.helpers import moved_after_reading

REVERSE = "tools.reverse_credit"


@pytest.fixture
def h(redis_url: str, tmp_path: Path) -> Iterator[Harness]:
    yield from harness(redis_url, tmp_path)


def aborted_with_two_credits(h: Harness) -> tuple[str, int, int]:
    """A run with two credits applied, aborted: its chain of two reversals is queued."""
    run_id = h.start()
    steps = []
    for amount in (100, 200):
        step = h.saga.dispatch(run_id, "issue_credit", {"amount": amount}).step
        h.deliver(h.take("tools.issue_credit", run_id=run_id, step=step))
        steps.append(step)
    h.saga.abort(run_id, "cancelled")
    return run_id, steps[0], steps[1]


def deliver_all(h: Harness) -> list[str]:
    """Deliver every queued message (and what they send); the names delivered, in order."""
    names = []
    while h.queue:
        message = h.queue.pop(0)
        names.append(message.name)
        h.deliver(message)
    return names


def test_the_last_undo_concludes_the_unwind_without_another_message(h: Harness) -> None:
    # Given an aborted run whose two reversals are queued as one chain
    run_id, first, second = aborted_with_two_credits(h)
    # When the two are delivered
    delivered = deliver_all(h)
    # Then no conclusion message was sent: the last reversal concluded, and the run is
    # compensated, recorded in SQL, its undos applied newest first
    assert delivered == [REVERSE, REVERSE]
    picture = h.saga.picture(run_id)
    assert picture.state is RunState.COMPENSATED and picture.recorded
    record = h.saga.records.run(run_id)
    assert record is not None and record.state == "compensated"
    assert h.world.reversals == [f"{run_id}:{second}:undo", f"{run_id}:{first}:undo"]


def test_a_last_undo_that_fails_for_good_concludes_escalated_without_another_message(
    h: Harness,
) -> None:
    # Given an aborted run whose oldest reversal will fail for good (5 attempts)
    run_id, first, second = aborted_with_two_credits(h)
    reverse_newest = h.take(REVERSE, compensates=second)
    h.deliver(reverse_newest)
    h.world.failing_reversals = 100
    # When the rest is delivered (each retry is a message of its own)
    delivered = deliver_all(h)
    # Then it gave up, and the run ended escalated with no conclusion message
    assert CONCLUDE_UNWIND_TASK not in delivered and set(delivered) == {REVERSE}
    picture = h.saga.picture(run_id)
    assert picture.state is RunState.ESCALATED and picture.recorded
    assert [c.step for c in picture.compensations if c.state.value == "failed"] == [first]


def test_a_conclusion_that_cannot_be_made_after_the_last_undo_is_sent_as_before(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an aborted run, and the stack's Redis away for what follows the last undo's record
    # (the conclusion made and recorded with it, or apart where it could not be judged first)
    run_id, _, _ = aborted_with_two_credits(h)
    core, refusals = h.saga.core, []
    for name in ("conclude", "concluded"):
        real = getattr(core, name)

        def away_once(*args: object, real: Any = real, **kwargs: object) -> RunState:
            if not refusals:
                refusals.append(args)
                raise StoreUnavailableError("saga store unreachable (conclude): injected")
            return real(*args, **kwargs)  # type: ignore[no-any-return]

        monkeypatch.setattr(core, name, away_once)
    # When the two reversals are delivered
    delivered = deliver_all(h)
    # Then the conclusion went as a message of its own, which concluded the run
    assert refusals and delivered == [REVERSE, REVERSE, CONCLUDE_UNWIND_TASK]
    picture = h.saga.picture(run_id)
    assert picture.state is RunState.COMPENSATED and picture.recorded


def test_a_last_undo_redelivered_after_a_death_before_its_record_concludes_once(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an aborted run whose last reversal's worker dies right after recording the undo
    # done (and the conclusion with it), before the run's SQL record: nothing acked, the
    # message comes back
    run_id, first, second = aborted_with_two_credits(h)
    h.deliver(h.take(REVERSE, compensates=second))
    last = h.take(REVERSE, compensates=first)
    core = h.saga.core

    def dies(*args: object, **kwargs: object) -> RunState:
        raise SystemExit("worker killed")

    with monkeypatch.context() as patched:
        patched.setattr(core, "conclude", dies)
        patched.setattr(core, "concluded", dies)
        with pytest.raises(SystemExit):
            h.deliver(last)
    assert not h.saga.picture(run_id).recorded
    # When the message is delivered again
    h.deliver(last)
    # Then the redelivery replays the undo (not applied twice) and records the run's end
    assert h.queue == []
    picture = h.saga.picture(run_id)
    assert picture.state is RunState.COMPENSATED and picture.recorded
    assert h.world.reversals == [f"{run_id}:{second}:undo", f"{run_id}:{first}:undo"]


def counting_readings(h: Harness, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every whole reading of a run (``RunStore.picture``) from now on, by run id."""
    real, readings = h.saga.store.picture, []

    def counted(run_id: str) -> object:
        readings.append(run_id)
        return real(run_id)

    monkeypatch.setattr(h.saga.store, "picture", counted)
    return readings


def test_a_final_failure_starts_its_unwind_from_the_reading_taken_with_it(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a run with a credit applied, whose stock hold fails for good (two attempts)
    run_id = h.start()
    credit = h.saga.dispatch(run_id, "issue_credit", {"amount": 100}).step
    h.deliver(h.take("tools.issue_credit", run_id=run_id, step=credit))
    h.world.failing_holds = 100
    hold = h.saga.dispatch(run_id, "hold_stock", {"sku": "A-1"}).step
    h.deliver(h.take("tools.hold_stock", run_id=run_id, step=hold))  # the first attempt: retry
    # When its last attempt fails
    readings = counting_readings(h, monkeypatch)
    h.deliver(h.take("tools.hold_stock", run_id=run_id, step=hold))
    # Then the unwind's chain is sent from the reading made with the failure's record, in the
    # same transaction: the run is not read again in between
    assert readings == []
    assert h.saga.picture(run_id).state is RunState.UNWINDING
    h.deliver(h.take(REVERSE, compensates=credit))
    picture = h.saga.picture(run_id)
    assert picture.state is RunState.COMPENSATED and picture.recorded
    assert h.world.reversals == [f"{run_id}:{credit}:undo"]


def test_the_last_undos_record_concludes_the_run_judged_on_the_reading_just_before(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an aborted run whose newest reversal has run
    run_id, first, second = aborted_with_two_credits(h)
    h.deliver(h.take(REVERSE, compensates=second))
    conclusions = counting_conclusions(h, monkeypatch)
    # When the last one runs
    readings = counting_readings(h, monkeypatch)
    h.deliver(h.take(REVERSE, compensates=first))
    # Then the run was read once, before the undo's record, and the script that recorded the
    # undo done concluded it (no conclusion of its own); its end is recorded in SQL as the
    # keys hold it, though the run was not read again after the script
    assert readings == [run_id] and conclusions == []
    picture = h.saga.picture(run_id)
    assert picture.state is RunState.COMPENSATED and picture.recorded
    recorded = h.saga.records.picture(run_id)
    assert recorded is not None and _as_told(recorded) == _as_told(picture)


def _as_told(picture: RunPicture) -> tuple[object, ...]:
    """What a run's SQL record and its keys must agree on once it ended."""
    undos = [(c.step, c.state, c.settled_at, c.attempts, c.error) for c in picture.compensations]
    ended = picture.ended and round(picture.ended, 3)
    return picture.state, picture.reason, picture.cause, ended, picture.version, undos


def test_a_run_that_moved_after_the_reading_is_read_again_to_conclude(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an aborted run whose last undo's reading goes stale at once (another transition
    # of the run lands between that reading and the undo's record)
    run_id, first, second = aborted_with_two_credits(h)
    h.deliver(h.take(REVERSE, compensates=second))
    store = h.saga.store
    moved = moved_after_reading(store, monkeypatch)
    record, answers = store.record_done_and_conclude, []

    def answered(*args: Any, **kwargs: Any) -> Any:
        outcome = record(*args, **kwargs)
        answers.append(outcome.values)
        return outcome

    monkeypatch.setattr(store, "record_done_and_conclude", answered)
    conclusions = counting_conclusions(h, monkeypatch)
    # When the last undo runs
    h.deliver(h.take(REVERSE, compensates=first))
    # Then the record's conclusion was refused by its version fence, and the run read again
    # and concluded the usual way, its record of the version it ended at
    assert moved == [run_id] and answers == [("moved",)] and conclusions == [run_id]
    picture = h.saga.picture(run_id)
    assert picture.state is RunState.COMPENSATED and picture.recorded
    record = h.saga.records.run(run_id)
    assert record is not None and str(record.version) == picture.version


def counting_conclusions(h: Harness, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every conclusion script called on its own (``RunStore.conclude``), by run id."""
    real, called = h.saga.store.conclude, []

    def counted(run_id: str, *args: Any, **kwargs: Any) -> Any:
        called.append(run_id)
        return real(run_id, *args, **kwargs)

    monkeypatch.setattr(h.saga.store, "conclude", counted)
    return called
