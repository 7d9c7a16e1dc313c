"""An unwind's conclusion is made by its last compensation's task when nothing but the
conclusion is left of its chain (one Celery message fewer per unwind); the
``saga.conclude_unwind`` message is still sent whenever that conclusion cannot be made there.

Driven through the real scripts and worker functions with a captured broker
(``engine_harness``): each test delivers the unwind's messages one by one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from saga import RunState
from saga.constants import CONCLUDE_UNWIND_TASK, run_keys
from saga.errors import StoreUnavailableError
from tests.integration.engine_harness import Harness, harness

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
    # Given an aborted run, and the stack's Redis away for the conclusion after the last undo
    run_id, _, _ = aborted_with_two_credits(h)
    real = h.saga.core.conclude
    refusals = []

    def away_once(*args: object, **kwargs: object) -> RunState:
        if not refusals:
            refusals.append(args)
            raise StoreUnavailableError("saga store unreachable (conclude): injected")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(h.saga.core, "conclude", away_once)
    # When the two reversals are delivered
    delivered = deliver_all(h)
    # Then the conclusion went as a message of its own, which concluded the run
    assert refusals and delivered == [REVERSE, REVERSE, CONCLUDE_UNWIND_TASK]
    picture = h.saga.picture(run_id)
    assert picture.state is RunState.COMPENSATED and picture.recorded


def test_a_last_undo_redelivered_after_a_death_before_concluding_concludes_once(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an aborted run whose last reversal's worker dies right after recording the undo
    # done, before concluding (nothing acked: the message comes back)
    run_id, first, second = aborted_with_two_credits(h)
    h.deliver(h.take(REVERSE, compensates=second))
    last = h.take(REVERSE, compensates=first)
    real = h.saga.core.conclude

    def dies(*args: object, **kwargs: object) -> RunState:
        raise SystemExit("worker killed")

    monkeypatch.setattr(h.saga.core, "conclude", dies)
    with pytest.raises(SystemExit):
        h.deliver(last)
    assert h.saga.picture(run_id).state is RunState.UNWINDING
    # When the message is delivered again
    monkeypatch.setattr(h.saga.core, "conclude", real)
    h.deliver(last)
    # Then the redelivery replays the undo (not applied twice) and concludes the run
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


def test_the_last_undo_concludes_on_the_reading_taken_with_its_outcome(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an aborted run whose newest reversal has run
    run_id, first, second = aborted_with_two_credits(h)
    h.deliver(h.take(REVERSE, compensates=second))
    # When the last one runs
    readings = counting_readings(h, monkeypatch)
    h.deliver(h.take(REVERSE, compensates=first))
    # Then it concluded and recorded the run on the reading made with its own outcome
    assert readings == []
    picture = h.saga.picture(run_id)
    assert picture.state is RunState.COMPENSATED and picture.recorded


def test_a_run_that_moved_after_the_last_undo_was_recorded_is_read_again_to_conclude(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an aborted run whose last undo's reading goes stale at once (another transition
    # of the run lands between the undo's transaction and the conclusion)
    run_id, first, second = aborted_with_two_credits(h)
    h.deliver(h.take(REVERSE, compensates=second))
    store = h.saga.store
    real = store.record_last_compensation

    def then_moved(*args: object, **kwargs: object) -> object:
        answered = real(*args, **kwargs)  # type: ignore[arg-type]
        store.client.hincrby(run_keys(run_id)[0], "version", 1)
        return answered

    monkeypatch.setattr(store, "record_last_compensation", then_moved)
    readings = counting_readings(h, monkeypatch)
    # When the last undo runs
    h.deliver(h.take(REVERSE, compensates=first))
    # Then the conclusion on the stale reading was refused by its version fence, and the run
    # read again and concluded, its record of the version it ended at
    assert readings == [run_id]
    picture = h.saga.picture(run_id)
    assert picture.state is RunState.COMPENSATED and picture.recorded
    record = h.saga.records.run(run_id)
    assert record is not None and str(record.version) == picture.version
