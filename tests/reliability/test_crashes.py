"""Workers killed at the worst moments: the stack survives and nothing is applied twice.

Each test owns its Redis and workers (see conftest). Effects are counted in the demo
systems, keyed by idempotency key, not in the saga's own records.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from saga import RunState
from tasks import systems
from tests.integration.helpers import CREDIT, ORDER, TICKET, demo_steps
from tests.reliability.conftest import Private

pytestmark = pytest.mark.timeout(120)


def test_kill_after_the_effect_but_before_the_push_applies_it_once(
    private: Callable[..., Private],
) -> None:
    # Given a worker that dies right after the credit is issued, before the undo is pushed
    env = private()
    env.worker(concurrency=1)
    rule = env.faults.kill("after_effect", "issue_credit")

    # When the agent runs the sequence (the message is redelivered to a fresh pool process)
    run = env.saga.start_run()
    results = demo_steps(env.saga.run(run.run_id))
    picture = run.finish(timeout=30)

    # Then the credit exists once and its undo is on the stack once
    assert env.faults.hits(rule) >= 1
    assert len(results) == 4 and picture.state is RunState.COMPLETED
    assert [e["amount_cents"] for e in systems.ledger(ORDER)] == [CREDIT]
    assert [e["tool"] for e in picture.stack] == ["reverse_credit", "set_ticket_status"]
    assert picture.step(2).attempts == 2
    assert systems.get_ticket(TICKET)["status"] == "pending_refund"
