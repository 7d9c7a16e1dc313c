"""A question a listener failed to take (the notices' database away when the unwind asked) is
not left for its expiry: the reaper's look comes forward, and that look tells the listeners
again, so the person is told while the question can still be answered.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from saga import RunState
from saga.core import RETELL_SECONDS
from saga.hooks import RunListener
from saga.model import CompensationState
from tests.integration.helpers import wait_until
from tests.integration.reversal_deployment import Asking, asking_deployment

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def asking_long(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Asking]:
    """Questions that wait ten minutes: time for the reaper to look before they expire."""
    extra = {"SAGA_REVERSAL_ASK_SECONDS": "600"}
    with asking_deployment(tmp_path_factory.mktemp("reversal-retell"), extra) as made:
        yield made


class _DatabaseAway(RunListener):
    def reversal_asked(self, run_id: str, step: int) -> None:
        raise OperationalError("INSERT INTO saga_notices", {}, Exception("database away"))


def test_a_question_a_listener_failed_to_take_is_told_again_by_the_reaper(
    asking_long: Asking,
) -> None:
    # Given a question whose notice the worker sent
    run, asked = asking_long.asked()
    notice_id = f"{run.run_id}:0:asked:2"
    wait_until(lambda: asking_long.receiver.of(notice_id), 30, "the question's notice")
    saga, store = asking_long.saga, asking_long.saga.store
    assert (store.due_at(run.run_id) or 0) >= (asked.ask_expires or 0) - 1  # looked at on expiry

    # When a listener fails to take the question (its notices' database away)
    saga.core.listeners.append(_DatabaseAway())
    try:
        saga.core.reversal_asked(run.run_id, 2)
    finally:
        saga.core.listeners.pop()

    # Then the reaper's look comes forward from the expiry to RETELL_SECONDS from now
    assert (store.due_at(run.run_id) or 0) <= store.now() + RETELL_SECONDS

    # And that look, before the question expires, tells the listeners again: a notice that
    # was never written (its rows gone, as when the first tell failed) is written and sent;
    # the question still waits, and the next look is its expiry again
    with saga.notifier.store.engine.begin() as connection:
        connection.execute(
            text("DELETE FROM saga_notices WHERE escalation_id = :id"), {"id": notice_id}
        )
    report = saga.reap(now=store.now() + RETELL_SECONDS + 1)
    assert report.unanswered == []
    wait_until(lambda: len(asking_long.receiver.of(notice_id)) == 2, 30, "the notice sent again")
    assert asking_long.undo(run, 2).state is CompensationState.ASKED
    assert (store.due_at(run.run_id) or 0) >= (asked.ask_expires or 0) - 1
    saga.decide_reversal(run.run_id, 2, "reverse", args_hash=asked.ask_hash, by="ada")
    assert run.wait(timeout=30).state is RunState.COMPENSATED
